"""A local Executor's finished records handed to this machine's service, for
``nimbus dashboard``: the program's side (``LocalHistory``, the files' folder and
format). The service's side, which writes them to its SQL history, is
``nimbus.service.local_history``; the flow and its costs are drawn there.

A file is ``msgpack([owner, [record.to_wire(), ...]])``, written whole under a
dot-name and renamed into ``directory(settings)``; the owner is ``local:<user>``.

A ``nimbus run`` program's processes (and any nimbus Process) and its Pool's tasks
are kept the same way, by the process that ran them (:func:`keep`, :func:`ended`):
one record a Process when it ends (its target's name, success when its exit code
is 0), one a Pool task (a map's chunk: the function's name) when the pool worker
puts its result. Fork-safe: a process's writer thread starts at its first record,
and a process forked from one that had a writer starts its own (the copy it
inherited, whose thread did not survive the fork, is dropped unused: no lock of
the parent's is taken in the child); a process hands over what is left
synchronously when it ends (:func:`ended`), before its ``os._exit``. A signal
handler that hands over (a pool worker's SIGTERM) and interrupted its thread's own
hand-over lets that one finish before the process ends (``ended(then)``).
"""

from __future__ import annotations

import getpass
import logging
import os
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path

import msgpack

from nimbus import _service_state
from nimbus.config import Settings
from nimbus.records import TaskRecord

__all__ = [
    "ENDPOINT",
    "FLUSH_EVERY",
    "KEEP_BYTES",
    "OWNER_PREFIX",
    "LocalHistory",
    "active",
    "directory",
    "enabled",
    "ended",
    "keep",
    "new_id",
    "service_state",
    "wanted",
]

ENDPOINT = "local"  # the endpoint id of a local Executor's rows
OWNER_PREFIX = "local:"  # their owner: this prefix and the program's user name
FLUSH_EVERY = 1.0  # seconds between a program's files
SOON = 0.05  # seconds between a pool worker's own hand-overs (keep(soon=True)), at least
WRITE_WAIT = 2.0  # seconds an ending process waits for its thread's file in progress
LOOK_EVERY = 5.0  # seconds between looks whether the service (still) runs
# the files waiting in directory(), at most: a program writes none beyond it (the service
# takes them slower than they come), and the service drops the oldest beyond it
KEEP_BYTES = 64 << 20
log = logging.getLogger(__name__)


def directory(settings: Settings) -> Path:
    """Where programs leave their finished records for the service."""
    return settings.service_dir / "local-history"


def service_state(settings: Settings) -> dict[str, object] | None:
    """The state of the service running on this runtime directory (its ``url``, ``pid``
    and its start time), or None when none runs (``nimbus._service_state``: no file, or
    the process it names is gone, another user's, or a later one with the same pid)."""
    return _service_state.read(settings.service_dir)


def _waiting_bytes(folder: Path) -> int:
    """The bytes of the files waiting in ``folder`` for the service."""
    total = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        try:
            total += os.stat(folder / name).st_size
        except OSError:
            pass  # taken meanwhile
    return total


def enabled(settings: Settings) -> bool:
    """Whether a service runs on this runtime directory to hand a local history to (not
    only existed once: nobody would read the files, which would pile up for ever)."""
    return service_state(settings) is not None


def _owner() -> str:
    try:
        return OWNER_PREFIX + getpass.getuser()
    except Exception:  # no user name (a container without one): still the machine's
        return OWNER_PREFIX


class LocalHistory:
    """The writer thread of one local Executor; ``add(record)`` on the runtime's thread."""

    def __init__(self, settings: Settings) -> None:
        self._dir = directory(settings)
        self._settings = settings
        # made while the service runs (``active``): serving unless KEEP_BYTES wait; the
        # first hand-overs do not look again (a pool worker that terminate() ends soon
        # after its task writes its record in that time)
        self._serving = _waiting_bytes(self._dir) < KEEP_BYTES
        self._next_look = time.monotonic() + LOOK_EVERY
        self._owner = _owner()
        self._records: deque[TaskRecord] = deque()
        # the deque's own append: no Python frame per task on the runtime's thread
        self.add = self._records.append
        self._stop = threading.Event()
        self._writing = threading.Lock()  # held while the thread writes a file
        self._on_thread = threading.local()  # a hand_over_now under way on this thread
        self.handed = time.monotonic()  # when records were last handed over
        self._thread = threading.Thread(target=self._run, name="nimbus-local-history", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Hand over what is left, then stop the thread."""
        self._stop.set()
        self._thread.join(30)

    def hand_over_now(self, then: Callable[[], object] | None = None) -> None:
        """Hand over what is waiting, on this thread (a process about to end), once the
        thread's hand-over in progress, if any, is written (else its records would die
        half-written with the process); then ``then()``. Maybe in a signal handler: the
        wait is bounded; a handler that interrupted a hand_over_now on its own thread
        (its records taken off the queue, not yet in a file) returns at once, and its
        ``then`` runs once that one is done. (Such a handler ending the process at once,
        a pool worker's SIGTERM as the worker handed over at its end, waited its own
        lock WRITE_WAIT s, then lost those records.)"""
        here = self._on_thread
        if getattr(here, "handing", False):
            if then is not None:
                here.after.append(then)
            return
        here.after = []
        here.handing = True  # (after ``after``: a handler that sees it appends there)
        got = self._writing.acquire(timeout=WRITE_WAIT)
        try:
            self._hand_over()
        except OSError as exc:
            log.warning("local tasks are not kept for nimbus dashboard: %s", exc)
        finally:
            if got:
                self._writing.release()
            here.handing = False
            for after in here.after:  # signal handlers' that came meanwhile
                after()
        if then is not None:
            then()

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(FLUSH_EVERY)
            try:
                with self._writing:
                    self._hand_over()
            except OSError as exc:  # the directory is gone or full: these are not kept
                log.warning("local tasks are not kept for nimbus dashboard: %s", exc)
            if stopping:
                return

    def _hand_over(self) -> None:
        self.handed = time.monotonic()
        records = self._records
        wire = []
        while records:
            wire.append(records.popleft().to_wire())
        if not wire:
            return
        now = time.monotonic()
        if now >= self._next_look:  # (a file read and a listing, each LOOK_EVERY s at most)
            self._next_look = now + LOOK_EVERY
            self._serving = enabled(self._settings) and _waiting_bytes(self._dir) < KEEP_BYTES
        if not self._serving:
            return  # the service stopped, or is KEEP_BYTES behind: not kept (dropped)
        self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        name = f"{time.time():.6f}-{os.getpid()}-{secrets.token_hex(4)}.msgpack"
        part = self._dir / ("." + name)
        part.write_bytes(msgpack.packb([self._owner, wire]))
        part.rename(self._dir / name)  # whole, or not there


# this process's writer (None: not made yet; False: no service to hand records to)
_writer: LocalHistory | bool | None = None
_writer_pid = 0
_settings: Settings | None = None  # loaded once (a forked process inherits it)
_next_look = 0.0  # when a process with no service to hand over to looks again


def _forget_writer() -> None:
    """In a forked child: the parent's writer (its thread gone) is not used."""
    global _writer
    if _writer is not False:
        _writer = None


os.register_at_fork(after_in_child=_forget_writer)


def keep(record: TaskRecord, soon: bool = False) -> None:
    """Keep one finished record of this process (a Process, a Pool task) for ``nimbus
    dashboard``, if this runtime directory has a service; a few microseconds. ``soon``:
    handed over on this thread now if the last hand-over is ``SOON`` seconds old (a pool
    worker, before it puts the task's result: its pool may terminate it right after)."""
    writer = _here()
    if writer is None:
        return
    writer.add(record)
    if soon and time.monotonic() - writer.handed > SOON:
        writer.hand_over_now()


def _here() -> LocalHistory | None:
    """This process's writer, made at its first use (None: no service to hand over to)."""
    global _writer, _writer_pid, _settings, _next_look
    writer = _writer
    if (
        writer is None
        or (writer is False and time.monotonic() >= _next_look)  # a service since?
        or (writer is not False and _writer_pid != os.getpid())
    ):
        if _settings is None:
            _settings = Settings.load()
        writer = _writer = LocalHistory(_settings) if enabled(_settings) else False
        _writer_pid = os.getpid()
        _next_look = time.monotonic() + LOOK_EVERY
    return writer if isinstance(writer, LocalHistory) else None


def active() -> bool:
    """Whether this process hands records over (its writer made now if it is)."""
    return _here() is not None


def wanted() -> bool:
    """False once this process found no service to hand records to (skip making them),
    until it is time to look again."""
    return _writer is not False or time.monotonic() >= _next_look


def ended(then: Callable[[], object] | None = None) -> None:
    """This process is ending: hand over its records now (its daemon thread dies with it),
    then ``then()`` (a signal handler's end of the process: after the hand-over it may
    have interrupted, :meth:`LocalHistory.hand_over_now`)."""
    writer = _writer
    if isinstance(writer, LocalHistory) and _writer_pid == os.getpid():
        writer.hand_over_now(then)
    elif then is not None:
        then()


def new_id() -> str:
    """A task id for a record kept here (as ``uuid4()``)."""
    return str(uuid.uuid4())
