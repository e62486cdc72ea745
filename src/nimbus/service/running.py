"""Which service runs on a runtime directory: its ``service.json``, read without the server.

The service writes ``Settings.service_dir / STATE_FILE`` (its URL, pid and start time) once it
accepts connections and removes it when it stops (``nimbus.service.server``).
Reading it imports neither FastAPI, uvicorn nor SQLAlchemy, so a command that
only asks (``nimbus dashboard`` beside a running service) answers at once.
"""

from __future__ import annotations

from nimbus import _service_state
from nimbus._service_state import STATE_FILE
from nimbus.config import Settings

__all__ = ["STATE_FILE", "running_service"]


def running_service(settings: Settings) -> str | None:
    """The URL of the service running with ``settings``' runtime directory, if one runs
    (``nimbus._service_state`` reads the file: the one reader)."""
    state = _service_state.read(settings.service_dir)
    return None if state is None else str(state["url"])
