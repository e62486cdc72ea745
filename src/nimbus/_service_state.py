"""Which service runs on this runtime directory: its ``service.json``, one reader.

::

    nimbus.service.server (once it accepts)  -- text(url) -->  service.json
    nimbus.service.running (the CLI, `nimbus dashboard`)  --\\
    nimbus.local_history (every local program)            ---+-- read(service_dir) --> its url, or None

The file holds the service's URL, its pid and the pid's start time (clock ticks
since boot, ``/proc/<pid>/stat``): a service killed without removing it (SIGKILL,
the OOM killer, a container's restart) leaves the file, and its pid may be any
process's later; the start time tells it is not the service. A pid of another
user's process (``PermissionError``) is not ours either: the runtime directory is
this user's. Reading imports nothing heavy (no FastAPI, no psutil).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["STATE_FILE", "read", "start_time", "text"]

STATE_FILE = "service.json"  # in Settings.service_dir while the service runs


def start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, as text); None if it is
    not a process of this user's that runs, "?" where /proc cannot tell."""
    try:
        os.kill(pid, 0)
    except OSError:  # gone, or another user's (PermissionError)
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except FileNotFoundError:
        return None  # ended meanwhile
    except (OSError, IndexError):
        return "?"
    if fields[:1] == [b"Z"]:
        return None  # ended, not yet reaped
    return fields[19].decode() if len(fields) > 19 else "?"


def text(url: str) -> str:
    """What the service writes to its state file as it accepts: its url, pid, start time."""
    pid = os.getpid()
    return json.dumps({"url": url, "pid": pid, "started": start_time(pid)})


def read(service_dir: Path) -> dict[str, object] | None:
    """The state of the service running on the runtime directory of ``service_dir``
    (``url``, ``pid``, ``started``), or None: no file, or the process it names is gone,
    not this user's, or a later process with the same pid."""
    try:
        state = json.loads((service_dir / STATE_FILE).read_text())
        pid = int(state["pid"]) if isinstance(state, dict) and "url" in state else 0
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if pid <= 0:
        return None
    now = start_time(pid)
    if now is None or (now != "?" and state.get("started") != now):
        return None
    return dict(state)
