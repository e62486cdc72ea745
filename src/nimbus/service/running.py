"""Which service runs on a runtime directory: its ``service.json``, read without the server.

The service writes ``Settings.service_dir / STATE_FILE`` (its URL and pid) once it
accepts connections and removes it when it stops (``nimbus.service.server``).
Reading it imports neither FastAPI, uvicorn nor SQLAlchemy, so a command that
only asks (``nimbus dashboard`` beside a running service) answers at once.
"""

from __future__ import annotations

import json
import os

from nimbus.config import Settings

__all__ = ["STATE_FILE", "running_service"]

STATE_FILE = "service.json"  # in Settings.service_dir while the service runs


def running_service(settings: Settings) -> str | None:
    """The URL of the service running with ``settings``' runtime directory, if one runs."""
    try:
        state = json.loads((settings.service_dir / STATE_FILE).read_text())
        os.kill(int(state["pid"]), 0)
        return str(state["url"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none, or it died without removing the file
