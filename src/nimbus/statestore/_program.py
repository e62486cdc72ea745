"""The program: where this multiprocessing program's shared state lives.

A *program* is one run of a user's multiprocessing code: its root process
and every process it starts, on any worker. Its shared objects (queues,
locks, values, pipes ...) are keys in one state store (Redis) under one
program id (see ``nimbus.statestore.keys``), so two programs sharing a Redis never meet.

::

    root process                       worker running a child Process
    ------------                       ------------------------------
    program()  -> starts the store     adopt(Program) <- carried by the task
               -> new program id       program()      -> the adopted one
    keepalive thread: EXPIRE keys      shared objects pickle as (Program, name)
    at exit: delete the program's keys

How a root opens its program is its *opener*: by default the store of the
settings (``NIMBUS_REDIS_URL`` or an embedded Redis) and a new program id;
``nimbus.multiprocessing`` sets its own (:func:`set_opener`): with
``NIMBUS_ENDPOINT`` set, the store the service hands out for that endpoint,
reached by this process and by the endpoint's workers, and an id that starts
with the prefix the service allows this user.

Every key gets the program's TTL when created; the root keeps them alive
while it runs and deletes them at a normal exit, so after a SIGKILL of the
root they expire within ``key_ttl`` seconds (``NIMBUS_KEY_TTL``).

A program may keep some objects outside the store (``Program.shared``: a
directory of this host's shared memory, see ``nimbus.multiprocessing``);
the opener's ``on_close`` removes them at the root's exit.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import util
from typing import TYPE_CHECKING

from nimbus import _joined as _joined_task
from nimbus._lazy import lazy
from nimbus.config import Settings
from nimbus.errors import StateStoreError
from nimbus.statestore._connect import (
    AskedStart,
    ask_to_start,
    booting,
    booting_server,
    connect,
    is_booting,
    untouched,
    when_ready,
)
from nimbus.statestore._embedded import EmbeddedRedis
from nimbus.statestore._store import StateStore
from nimbus.statestore.keys import Keys

if TYPE_CHECKING:
    import redis
else:  # imported on first use (redis-py: at the first connection)
    redis = lazy("redis", globals())

__all__ = [
    "Opener",
    "Program",
    "Root",
    "adopt",
    "current",
    "is_root",
    "join",
    "leave",
    "on_leave",
    "open_local",
    "open_store",
    "program",
    "root",
    "set_opener",
    "start_asked",
]


@dataclass(frozen=True)
class Program:
    """The state store URL, program id and key TTL of one program.

    ``remote``: its processes run on a remote endpoint (``NIMBUS_ENDPOINT``).
    ``shared``: the directory of this host's shared memory that holds its
    Values and Arrays (``nimbus.multiprocessing``); None: they are in the store.
    ``endpoint``: the id of the endpoint whose workers run its tasks, when its store is
    the one the service handed out for it (its id is then ``<user's prefix>.<random>``);
    its tasks' ``nimbus.data.store()`` is their user's keys there.
    """

    url: str
    program_id: str
    key_ttl: float
    remote: bool = False
    shared: str | None = None
    endpoint: str = ""

    @property
    def keys(self) -> Keys:
        return Keys(self.program_id)

    @property
    def ttl_ms(self) -> int:
        return int(self.key_ttl * 1000)

    def client(self) -> redis.Redis:
        """This process's client of the program's store (cached per URL)."""
        return connect(self.url)

    def row(self) -> Row:
        """What an Executor's task carries to join this program (:func:`join`): its URL,
        id, TTL, ``remote``, its booting store's owner and ``endpoint``, pickled once (a task's payload holds it as bytes, which
        cost no more to pickle than nothing does)."""
        server = booting_server(self.url)  # not started yet: a task's worker asks for it
        owner, timeout = (server.owner_pid, server.start_timeout) if server else (0, 0.0)
        fields = (
            self.url,
            self.program_id,
            self.key_ttl,
            self.remote,
            owner,
            timeout,
            self.endpoint,
        )
        return pickle.dumps(fields, 5)

    def booting(self) -> bool:
        """Whether the program's store may not answer yet (:func:`open_store`; never waits)."""
        return is_booting(self.url)


class Root:
    """The store, keepalive and cleanup owned by the program's root process.

    Started by an opener (:func:`set_opener`) with the store it opened and the
    program; ``on_close`` runs at the root's exit, after the program's keys
    are deleted and before the store closes.
    """

    def __init__(
        self,
        store: StateStore,
        program: Program,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.program = program
        self.on_close = on_close
        self.pid = os.getpid()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._keepalive, name="nimbus-keepalive", daemon=True
        )
        # a booting store has no keys yet: kept alive from its first use (a program
        # that only starts Processes starts no thread for it)
        if not when_ready(program.url, self._thread.start):
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
        # an embedded store this process never used (still booting, maybe) is not waited
        # for at exit: its keys, a child's, go with it
        if not untouched(self.program.url):
            self._delete_keys()
        if self.on_close is not None:
            self.on_close()
        self.store.close()

    def _delete_keys(self) -> None:
        # a remote store that answers nothing (hung, or gone with no reset) is given a
        # few seconds a reply, not for ever: its keys expire by their TTL anyway
        remote = self.program.remote
        try:
            client = (
                connect(self.program.url, own=True, timeout=5) if remote else self.program.client()
            )
            try:
                keys = list(client.scan_iter(match=self.program.keys.pattern(), count=1000))
                for start in range(0, len(keys), 500):
                    client.unlink(*keys[start : start + 500])
            finally:
                if remote:
                    client.close()
        except redis.RedisError:
            pass


Opener = Callable[[Settings], Root]
Row = bytes  # Program.row(): what a task carries


def open_store(settings: Settings) -> StateStore:
    """A root's store: ``NIMBUS_REDIS_URL``'s, or an embedded Redis kept up until the
    root closes it.

    The embedded one is not started here: its address is fixed now, and the first
    connection to it, in the root or in a process it started (a lock file decides
    which one starts it), starts it and waits until it answers (``_connect.booting``,
    ``EmbeddedRedis.serve``): a program that only starts Processes or runs Pools
    (their queues are this host's pipes) never starts it.
    """
    if settings.redis_url:
        store = StateStore.from_settings(settings)
    else:
        server = EmbeddedRedis(settings.ensure_runtime_dir()).defer()
        booting(server, server.url)
        store = StateStore(server.url, server)
    store.stop_at_close_only()  # Pools' and Queues' exit finalizers still use it
    return store


def open_local(settings: Settings) -> Root:
    """The default opener: the settings' store (:func:`open_store`) and a new program id."""
    store = open_store(settings)
    return Root(store, Program(store.url, Keys.program_id_new(), settings.key_ttl))


_lock = threading.Lock()
_root: Root | None = None
_adopted: Program | None = None
_opener: Opener = open_local
_joined: tuple[Row | str, Program] | None = None  # the last row a task joined, made into a Program


def _unlock_in_child() -> None:
    """A fork's copy of the lock: warm workers may be forked (by a manager's thread)
    while another thread of this process opens its program under the lock."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_unlock_in_child)


def set_opener(opener: Opener) -> None:
    """How this process opens its program when it is a root (on first use)."""
    global _opener
    _opener = opener


def program(settings: Settings | None = None) -> Program:
    """The program this process belongs to; the root opens it on first use."""
    global _root
    if _adopted is not None:
        return _adopted
    if _joined_task.row is not None:  # a warm worker's task: its executor's program
        return _of(_joined_task.row)
    with _lock:
        if _root is None or _root.pid != os.getpid():
            try:
                _root = _opener(settings if settings is not None else Settings.load())
            except redis.RedisError as exc:
                raise StateStoreError(f"cannot use the state store: {exc}") from exc
        return _root.program


def root() -> Root | None:
    """This process's :class:`Root` if it is its program's root and opened it already."""
    found = _root
    if _adopted is not None or _joined_task.row is not None:
        return None
    return found if found is not None and found.pid == os.getpid() else None


def current() -> Program | None:
    """The program of this process if it has one already (never opens one)."""
    if _adopted is not None:
        return _adopted
    row = _joined_task.row
    if row is not None:
        return None if type(row) is str else _of(row)
    found = _root
    return found.program if found is not None and found.pid == os.getpid() else None


def start_asked(url: str) -> None:
    """Start this process's own program's store at ``url``, deferred until a task's
    worker asked for it (:class:`~nimbus.statestore._connect.AskedStart`, the other
    side): the first connection starts it. Another URL is ignored; a failure is the
    waiting task's to report."""
    prog = current()
    if prog is None or prog.url != url:
        return
    try:
        connect(url).ping()
    except Exception:  # redis-py's, or StateStoreError
        pass


def is_root() -> bool:
    """Whether this process is its program's root (not a process it started, nor a task
    that joined its executor's program)."""
    return _adopted is None and _joined_task.row is None


def adopt(program: Program | None) -> None:
    """Make this process (a worker running a child) part of ``program``."""
    global _adopted
    _adopted = program


def _of(row: Row | str) -> Program:
    """The Program of a joined task's ``row`` (made once per row), or its refusal raised."""
    global _joined
    joined = _joined
    if joined is not None and (joined[0] is row or joined[0] == row):
        return joined[1]
    if isinstance(row, str):
        raise StateStoreError(row)
    url, program_id, key_ttl, remote, owner, timeout, *later = pickle.loads(row)
    endpoint = later[0] if later else ""  # (a client of before Program.endpoint sends 6)
    ask = _joined_task.ask_root
    if owner and ask is not None:
        # its root's embedded store, deferred: the root starts it when asked, and this
        # worker's first connection waits for it (one the worker started would end with
        # the worker: its cgroup is emptied)
        ask_to_start(AskedStart(ask, url, owner, timeout))
    found = Program(url, program_id, key_ttl, remote, endpoint=endpoint)
    _joined = (row, found)
    return found


def _forget(row: Row | str) -> None:
    """A task's row, made into its Program, is not kept for the worker's next task: a
    remote one's URL holds the password of its user's store (the next may be another
    user's)."""
    global _joined
    _joined = None


_joined_task.on_leave(_forget)  # first registered, last run: after the hooks that use it


def on_leave(fn: Callable[[Program], None]) -> None:
    """Call ``fn(program)`` when a warm worker's task of ``program`` ends (:func:`leave`):
    what it made there for the program (an instance, connections) goes."""

    def hook(row: Row | str) -> None:
        if type(row) is not str:
            fn(_of(row))

    _joined_task.on_leave(hook)


join = _joined_task.join  # a warm worker's task of an Executor joins its program (row)
leave = _joined_task.leave
