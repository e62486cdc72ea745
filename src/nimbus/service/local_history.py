"""A local Executor's finished tasks in this machine's history, for ``nimbus dashboard``.

::

    Executor (local backend)  _on_results: deque.append(record)   (the runtime's thread)
    LocalHistory thread       every FLUSH_EVERY s: the records so far -> History.write
                              (one transaction), and once more at shutdown

It is on when this runtime directory has a service registry (``NIMBUS_RUNTIME_DIR``
``/service/registry.sqlite3``: ``nimbus dashboard`` or ``nimbus service start``
made it) or ``NIMBUS_DATABASE_URL`` names one, and off otherwise: a program never
creates a database by running tasks. Its rows carry the owner ``local:<user>``
and the endpoint ``local``; the dashboard's admin (``nimbus dashboard``'s user)
sees them on the tasks and task pages. A database it cannot write to costs the
program nothing but a warning: the tasks' results are unaffected.
"""

from __future__ import annotations

import getpass
import logging
import threading
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

import msgpack

from nimbus.config import Settings
from nimbus.records import TaskRecord

if TYPE_CHECKING:
    from nimbus.service.history import History

__all__ = ["ENDPOINT", "FLUSH_EVERY", "LocalHistory", "enabled"]

ENDPOINT = "local"  # the endpoint id of a local Executor's rows
FLUSH_EVERY = 1.0  # seconds between writes
log = logging.getLogger(__name__)


def enabled(settings: Settings) -> bool:
    """Whether a registry for this runtime exists to write a local history into."""
    if settings.database_url is not None:
        return True
    return (settings.service_dir / "registry.sqlite3").exists()


def owner() -> str:
    try:
        return "local:" + getpass.getuser()
    except Exception:  # no user name (a container without one): still the machine's
        return "local:"


class LocalHistory:
    """The writer thread of one local Executor; :meth:`add` on the runtime's thread."""

    def __init__(self, settings: Settings) -> None:
        self._url = settings.registry_url
        self._owner = owner()
        self._records: deque[TaskRecord] = deque()
        # add(record): a finished task's record, written by the next flush (the deque's
        # own append: no Python frame per task on the runtime's thread)
        self.add = self._records.append
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nimbus-local-history", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Write what is left, then stop the thread."""
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        from nimbus.service.history import History
        from nimbus.service.registry import Registry

        try:
            if self._url.startswith("sqlite:///"):
                Path(self._url[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
            registry = Registry(self._url)
            history = History(registry.engine)
        except Exception as exc:
            log.warning("local tasks are not kept for nimbus dashboard: %s", exc)
            self._records.clear()
            return
        try:
            while True:
                stopping = self._stop.wait(FLUSH_EVERY)
                self._write(history)
                if stopping:
                    return
        finally:
            registry.close()

    def _write(self, history: History) -> None:
        records = self._records
        rows = []
        while records:
            r = records.popleft()
            rows.append(
                (r.task_id, self._owner, ENDPOINT, r.function, "", r.state.value, r.submitted,
                 r.dispatched, r.ended, None, b"", msgpack.packb(r.to_wire()))
            )  # fmt: skip
        if rows:
            try:
                history.write(rows)
            except Exception as exc:  # the database is away or locked for long: dropped
                log.warning("%d local tasks not kept for nimbus dashboard: %s", len(rows), exc)
