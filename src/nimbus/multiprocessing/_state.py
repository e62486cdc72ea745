"""The program: where this multiprocessing program's shared state lives.

A *program* is one run of a user's multiprocessing code: its root process
and every process it starts, on any worker. Its shared objects (queues,
locks, values, pipes ...) are keys in one state store (Redis) under one
program id (see ``nimbus.keys``), so two programs sharing a Redis never meet.

::

    root process                       worker running a child Process
    ------------                       ------------------------------
    program()  -> starts the store     adopt(Program) <- carried by the task
               -> new program id       program()      -> the adopted one
    keepalive thread: EXPIRE keys      shared objects pickle as (Program, name)
    at exit: delete the program's keys

With ``NIMBUS_ENDPOINT`` set, the program runs on that endpoint: its store is
the one the service hands out (``nimbus.multiprocessing._remote``), reached by
this process and by the endpoint's workers, and its id starts with the
prefix the service allows this user.

Every key gets the program's TTL when created; the root keeps them alive
while it runs and deletes them at a normal exit, so after a SIGKILL of the
root they expire within ``key_ttl`` seconds (``NIMBUS_KEY_TTL``).

A program on the local runtime keeps its Values and Arrays in this host's
shared memory instead (``nimbus.multiprocessing._heap``), removed at the root's
exit; ``NIMBUS_SHARED_MEMORY=0`` keeps them in the store.
"""

from __future__ import annotations

import functools
import os
import pickle
import sys
import threading
from dataclasses import dataclass
from multiprocessing import util
from multiprocessing.reduction import ForkingPickler

import redis

from nimbus import serialization, statestore
from nimbus.config import Settings
from nimbus.errors import SerializationError, StateStoreError
from nimbus.keys import Keys
from nimbus.multiprocessing import _heap as heap

__all__ = [
    "Program",
    "adopt",
    "current",
    "dumps",
    "endpoint_workers",
    "is_root",
    "main_by_value",
    "on_shared_endpoint",
    "program",
]


@dataclass(frozen=True)
class Program:
    """The state store URL, program id and key TTL of one program.

    ``remote``: its processes run on a remote endpoint (``NIMBUS_ENDPOINT``).
    ``shared``: the directory of this host's shared memory that holds its
    Values and Arrays (``nimbus.multiprocessing._heap``); None: they are in the store.
    """

    url: str
    program_id: str
    key_ttl: float
    remote: bool = False
    shared: str | None = None

    @property
    def keys(self) -> Keys:
        return Keys(self.program_id)

    @property
    def ttl_ms(self) -> int:
        return int(self.key_ttl * 1000)

    def client(self) -> redis.Redis:
        """This process's client of the program's store (cached per URL)."""
        return statestore.connect(self.url)


class _Root:
    """The store, keepalive and cleanup owned by the program's root process."""

    def __init__(self, settings: Settings) -> None:
        if settings.endpoint:
            from nimbus.multiprocessing._remote import open_store

            handed = open_store(settings)
            self.shared_endpoint = not handed.yours
            self.workers: int | None = handed.workers
            self.store = statestore.StateStore(handed.url)
            program_id = f"{handed.key_prefix}.{Keys.program_id_new()}"
            self.program = Program(handed.url, program_id, settings.key_ttl, remote=True)
        else:
            self.shared_endpoint = False
            self.workers = None
            self.store = statestore.StateStore.from_settings(settings)
            self.store.stop_at_close_only()  # Pools' and Queues' exit finalizers still use it
            program_id = Keys.program_id_new()
            shared = None
            # processes on a provider's nodes (NIMBUS_PROVIDER=slurm) are remote: their
            # output and exits come through the store, and this host's memory is not theirs
            remote = settings.provider != "local"
            if os.environ.get("NIMBUS_SHARED_MEMORY", "1") != "0" and not remote:
                shared = heap.directory(settings.runtime_dir, program_id)
            self.program = Program(
                self.store.url, program_id, settings.key_ttl, remote=remote, shared=shared
            )
        self.pid = os.getpid()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._keepalive, name="nimbus-keepalive", daemon=True
        )
        self._thread.start()
        # last of the stdlib's exit finalizers: after connections' own clean-up
        util.Finalize(None, self.close, exitpriority=-100)

    def _keepalive(self) -> None:
        program = self.program
        interval = max(0.5, program.key_ttl / 3)
        while not self._stop.wait(interval):
            try:
                client = program.client()
                for key in client.scan_iter(match=program.keys.pattern(), count=1000):
                    client.pexpire(key, program.ttl_ms)
            except redis.RedisError:
                pass  # the store is gone; the users of the objects see the error

    def close(self) -> None:
        if os.getpid() != self.pid or self._stop.is_set():
            return
        self._stop.set()
        try:
            client = self.program.client()
            keys = list(client.scan_iter(match=self.program.keys.pattern(), count=1000))
            for start in range(0, len(keys), 500):
                client.unlink(*keys[start : start + 500])
        except redis.RedisError:
            pass
        if self.program.shared is not None:
            heap.remove(self.program.shared)
        self.store.close()


_lock = threading.Lock()
_root: _Root | None = None
_adopted: Program | None = None


def program(settings: Settings | None = None) -> Program:
    """The program this process belongs to; the root starts its store on first use."""
    global _root
    if _adopted is not None:
        return _adopted
    with _lock:
        if _root is None or _root.pid != os.getpid():
            try:
                _root = _Root(settings if settings is not None else Settings.load())
            except redis.RedisError as exc:
                raise StateStoreError(f"cannot use the state store: {exc}") from exc
        return _root.program


def current() -> Program | None:
    """The program of this process if it has one already (never starts one)."""
    if _adopted is not None:
        return _adopted
    root = _root
    return root.program if root is not None and root.pid == os.getpid() else None


def is_root() -> bool:
    """Whether this process is its program's root (not a process it started)."""
    return _adopted is None


def adopt(program: Program | None) -> None:
    """Make this process (a worker running a child) part of ``program``."""
    global _adopted
    _adopted = program


@functools.cache
def main_by_value() -> bool:
    """Whether ``__main__`` must travel by value: children cannot import it (an
    interactive session, ``python -c``, or ``python - < script.py``: no file)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    path = getattr(main, "__file__", None)
    return getattr(spec, "name", None) is None and (path is None or not os.path.isfile(path))


def _remote() -> bool:
    """Whether this process's program runs on a remote endpoint (never starts a store)."""
    if _adopted is not None:
        return _adopted.remote
    root = _root
    return root is not None and root.pid == os.getpid() and root.program.remote


def endpoint_workers() -> int | None:
    """The workers of the endpoint this root's processes run on (None: local, or a child)."""
    root = _root
    return root.workers if _adopted is None and root is not None else None


def on_shared_endpoint() -> bool:
    """Whether this root's processes run on an endpoint someone else runs (shared with us)."""
    root = _root
    return _adopted is None and root is not None and root.shared_endpoint


def dumps(obj: object) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Pickle an object that goes to another process of the program.

    As the stdlib does: with its reducers (connections, sockets and fds are
    handed over) and ``__main__`` by reference (children import the main
    module as the stdlib's spawn does), unless the main module cannot be
    imported (``python -c``, an interactive session) or the program runs on a
    remote endpoint (which may not have the script): then by value.
    """
    try:
        return serialization.dumps(
            obj,
            reducers=ForkingPickler._extra_reducers,
            main_by_value=main_by_value() or _remote(),
        )
    except SerializationError as exc:
        # SerializationError is a TypeError and a PicklingError, what the stdlib
        # raises most; an object's own error (a __reduce__ raising) goes as itself
        cause = exc.__cause__
        if cause is not None and not isinstance(cause, TypeError | pickle.PicklingError):
            raise cause from None
        raise
