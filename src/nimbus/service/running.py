"""Which service runs on a runtime directory: its ``service.json``, read without the server.

The service writes ``Settings.service_dir / STATE_FILE`` (its URL and pid) once it
accepts connections and removes it when it stops (``nimbus.service.server``).
Reading it imports neither FastAPI, uvicorn nor SQLAlchemy, so a command that
only asks (``nimbus dashboard`` beside a running service) answers at once.
"""

from __future__ import annotations

from nimbus.config import Settings
from nimbus.local_history import SERVICE_STATE as STATE_FILE
from nimbus.local_history import service_state

__all__ = ["STATE_FILE", "running_service"]


def running_service(settings: Settings) -> str | None:
    """The URL of the service running with ``settings``' runtime directory, if one runs
    (read where local programs read it too: they hand their records to a running one)."""
    state = service_state(settings)  # (None: none, or it died without removing the file)
    return None if state is None or "url" not in state else str(state["url"])
