"""A local Executor's finished records handed to this machine's service, for
``nimbus dashboard``: the program's side (``LocalHistory``, the files' folder and
format). The service's side, which writes them to its SQL history, is
``nimbus.service.local_history``; the flow and its costs are drawn there.

A file is ``msgpack([owner, [record.to_wire(), ...]])``, written whole under a
dot-name and renamed into ``directory(settings)``; the owner is ``local:<user>``.
"""

from __future__ import annotations

import getpass
import logging
import os
import secrets
import threading
import time
from collections import deque
from pathlib import Path

import msgpack

from nimbus.config import Settings
from nimbus.records import TaskRecord

__all__ = ["ENDPOINT", "FLUSH_EVERY", "OWNER_PREFIX", "LocalHistory", "directory", "enabled"]

ENDPOINT = "local"  # the endpoint id of a local Executor's rows
OWNER_PREFIX = "local:"  # their owner: this prefix and the program's user name
FLUSH_EVERY = 1.0  # seconds between a program's files
log = logging.getLogger(__name__)


def directory(settings: Settings) -> Path:
    """Where programs leave their finished records for the service."""
    return settings.service_dir / "local-history"


def enabled(settings: Settings) -> bool:
    """Whether this runtime directory has a service to hand a local history to."""
    return (settings.service_dir / "registry.sqlite3").exists()


def _owner() -> str:
    try:
        return OWNER_PREFIX + getpass.getuser()
    except Exception:  # no user name (a container without one): still the machine's
        return OWNER_PREFIX


class LocalHistory:
    """The writer thread of one local Executor; ``add(record)`` on the runtime's thread."""

    def __init__(self, settings: Settings) -> None:
        self._dir = directory(settings)
        self._owner = _owner()
        self._records: deque[TaskRecord] = deque()
        # the deque's own append: no Python frame per task on the runtime's thread
        self.add = self._records.append
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nimbus-local-history", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Hand over what is left, then stop the thread."""
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(FLUSH_EVERY)
            try:
                self._hand_over()
            except OSError as exc:  # the directory is gone or full: these are not kept
                log.warning("local tasks are not kept for nimbus dashboard: %s", exc)
            if stopping:
                return

    def _hand_over(self) -> None:
        records = self._records
        wire = []
        while records:
            wire.append(records.popleft().to_wire())
        if not wire:
            return
        self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        name = f"{time.time():.6f}-{os.getpid()}-{secrets.token_hex(4)}.msgpack"
        part = self._dir / ("." + name)
        part.write_bytes(msgpack.packb([self._owner, wire]))
        part.rename(self._dir / name)  # whole, or not there
