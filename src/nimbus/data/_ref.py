"""References (``nimbus.Ref``) and the client's side of them: who holds what, for how long.

::

    nimbus.put(obj) / a kept task's result --> Ref(id, namespace, user, endpoint, size)
        |  client: a Session holds it (counted by the Python objects that name it);
        |  a thread renews its lease every lease/3 s; the last Ref gone -> freed
        v
    passed to a task: pickled as its five fields, resolved in the worker from the
    node store (``nimbus.data.run``), never through the client

A :class:`Session` is the client's link to one place's store: ``local`` (this node's
store, read and written directly) or an endpoint's (through tasks the Executor runs
there: ``call``). Sessions are found by endpoint in a registry the Executor fills.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures as cf
import getpass
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from nimbus.data._node import NodeStore, hold, release
from nimbus.errors import DataAccessError, DataError, PayloadTooLargeError, ReferenceLost

log = logging.getLogger(__name__)

__all__ = [
    "LEASE",
    "MAX_SCAN",
    "Ref",
    "Scope",
    "Session",
    "get",
    "named",
    "new_id",
    "owner_namespace",
    "pure",
    "put",
    "register",
    "session",
]

LEASE = 300.0  # seconds an object outlives its holder's last renewal (a crashed client)
MAX_SCAN = 256  # items of a list, tuple or dict argument looked into for Refs and futures


def new_id() -> str:
    return uuid.uuid4().hex


class Scope(NamedTuple):
    """What a task of the data path carries: whose data, where, and what to do with it.

    ``namespace`` names the user's store on the node; ``user`` is their name (for
    messages); ``keep`` stores the result there and returns a Ref; ``lease`` is the
    seconds a kept result lives without a renewal; ``ref_id``, if given, is the id
    its kept result takes (chosen by the client, so that tasks submitted before it
    ends can name it: ``Executor`` on an endpoint), else a new one.
    """

    namespace: str
    user: str
    endpoint: str | None
    keep: bool
    lease: float
    ref_id: str = ""


class Ref:
    """A reference to an object kept where it was made (a node's store on an endpoint).

    Pass it to tasks (it is resolved where they run) or ``get()`` it. It is freed when
    no Ref or future naming it remains in the client that holds it, or when its lease
    runs out after that client died.
    """

    __slots__ = ("__weakref__", "_entry", "endpoint", "holder", "id", "namespace", "size", "user")

    def __init__(
        self,
        id: str,
        namespace: str,
        user: str,
        endpoint: str | None,
        size: int,
        holder: tuple[str, int, str, str] | None = None,
    ) -> None:
        self.id = id
        self.namespace = namespace
        self.user = user
        self.endpoint = endpoint
        self.size = size
        # the node of its endpoint that holds it, for the others to fetch it from: its
        # server's host and port, a pin's secret and the pin (a relayed object: _carry)
        self.holder = holder
        self._entry: _Entry | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        fields = (self.id, self.namespace, self.user, self.endpoint, self.size)
        return (Ref, fields if self.holder is None else (*fields, self.holder))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ref) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        where = named(self.endpoint) if self.endpoint else "local"
        return f"<nimbus.Ref {self.id[:12]} of {self.user} on {where}, {self.size} bytes>"

    def get(self, timeout: float | None = None) -> Any:
        """The object (fetched from where it is kept), within ``timeout`` seconds
        (``TimeoutError``; None: no limit). Its endpoint offline (stopped: its objects
        went with it): ``ReferenceLost`` naming the endpoint, at once."""
        return session(self.endpoint).fetch(self, timeout)


class _Entry:
    """One held object: alive while a Ref or future of this client names it (and the
    pin of the node that serves it to the endpoint's other nodes with it)."""

    __slots__ = ("__weakref__", "pin", "ref_id")

    def __init__(self, ref_id: str) -> None:
        self.ref_id = ref_id
        self.pin: Ref | None = None


class Session:
    """The client's holdings in one place's store.

    ``store``: this node's store (local); else ``call(fn, *args, keep=...)`` runs
    ``fn`` as a task of the data path there and returns its future, and ``ensure``
    its user's scope.
    """

    def __init__(
        self,
        namespace: str,
        user: str,
        endpoint: str | None,
        *,
        store: NodeStore | None = None,
        call: Callable[..., Any] | None = None,
        lease: float | None = None,
        name: str = "",
    ) -> None:
        if store is None and call is None:
            raise DataError("a data session needs a store or a way to run tasks")
        self.namespace = namespace
        self.user = user
        self.endpoint = endpoint
        if endpoint is not None and name:  # (messages say the name the user knows)
            _names[endpoint] = name
        self.store = store
        self.call = call
        self.lease = LEASE if lease is None else lease
        self._entries: weakref.WeakValueDictionary[str, _Entry] = weakref.WeakValueDictionary()
        # released, not yet freed (with the node that holds a staged copy's pin)
        self._to_free: collections.deque[tuple[str, tuple[str, int, str] | None]] = (
            collections.deque()
        )
        self._holders: dict[str, tuple[str, int, str]] = {}  # pin -> its node's server
        self.gone: set[str] = set()  # pins whose node a renewal found gone (its copy too)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self.freed = 0  # objects freed so far (statistics)
        self.direct_after = 0.0  # large objects straight to a node from then (``_place``)
        self.reached: set[tuple[str, int]] = set()  # nodes' servers a put reached
        self._pid = os.getpid()  # (a forked child frees nothing of its parent's)

    def scope(self, keep: bool) -> Scope:
        return Scope(self.namespace, self.user, self.endpoint, keep, self.lease)

    # -- holding ------------------------------------------------------------
    def adopt(self, ref: Ref) -> Ref:
        """Hold ``ref`` (a Ref made for this session): counted, renewed, freed."""
        with self._lock:
            entry = self._entries.get(ref.id)
            if entry is None:
                entry = _Entry(ref.id)
                self._entries[ref.id] = entry
                weakref.finalize(entry, self._release, ref.id)
        ref._entry = entry
        if ref.holder is not None and entry.pin is None and self.store is None:
            # kept on one node of the endpoint: its pin there held as long as the object
            # (renewed and freed on that node, wherever the task that does it runs)
            host, port, secret, pin = ref.holder
            self.served(pin, (host, port, secret))
            entry.pin = self.adopt(Ref(pin, self.namespace, self.user, self.endpoint, 0))
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._renewer, name="nimbus-data-lease", daemon=True
                    )
                    self._thread.start()
        return ref

    def served(self, ref_id: str, holder: tuple[str, int, str]) -> None:
        """``ref_id`` (held) is a staged copy's pin on the node that serves it at
        ``holder``: a renewal that runs on another node forwards it there."""
        with self._lock:
            self._holders[ref_id] = holder

    def held(self) -> list[str]:
        return list(self._entries.keys())

    def check(self, ref: Ref) -> None:
        """Refuse a Ref this session cannot pass to its tasks (before any task runs)."""
        if ref.endpoint != self.endpoint:
            there, here = named(ref.endpoint), named(self.endpoint)
            raise DataAccessError(
                f"{ref!r} is kept on {there or 'the local runtime'}, and these tasks "
                f"run on {here or 'the local runtime'}; pass it to tasks there, or "
                f"nimbus.put(ref.get(), endpoint={here or None!r})"
            )
        if ref.namespace != self.namespace:
            raise DataAccessError(
                f"{ref!r} belongs to user {ref.user!r}, and these tasks run as {self.user!r}: "
                f"a reference can be used only by the user who made it; ask them for the "
                f"object itself (ref.get()) and nimbus.put() it yourself"
            )
        if ref._entry is None:  # unpickled here (inside a result): hold it too
            self.adopt(ref)

    def _release(self, ref_id: str) -> None:
        # A finalizer: the cyclic GC runs it in whichever thread allocates, even one
        # inside ``with self._lock`` (a plain Lock would wait on itself for ever), so it
        # takes no lock: dict.pop and deque.append are atomic.
        holder = self._holders.pop(ref_id, None)
        if self._closed.is_set() or os.getpid() != self._pid:  # (the parent holds it)
            return
        if self.store is not None:
            self.store.free([ref_id])
            self.freed += 1
            return
        self._to_free.append((ref_id, holder))  # a staged copy's pin: freed on its node

    # -- the store ----------------------------------------------------------
    def put(self, obj: object) -> Ref:
        if self.store is not None:
            ref_id = new_id()
            size = self.store.write(ref_id, obj, time.time() + self.lease)
            return self.adopt(Ref(ref_id, self.namespace, self.user, self.endpoint, size))
        from nimbus.data._place import place
        from nimbus.data._task import identity

        placed = place(obj, self)
        if placed is not None:
            return placed
        assert self.call is not None
        try:
            ref: Ref = self.call(identity, obj, keep=True).ref()
        except PayloadTooLargeError as exc:  # (it named the task's function, not put)
            raise PayloadTooLargeError(
                f"nimbus.put(obj, endpoint={_names.get(str(self.endpoint), self.endpoint)!r}): "
                f"the object is larger than one request to the service may carry, and it "
                f"went through the service: this client cannot reach the endpoint's node "
                f"(set NIMBUS_DATA_HOST on its agent to an address this client reaches it "
                f"by), or raise NIMBUS_MAX_PAYLOAD on the client and the service, or make "
                f"the object there (a task that returns it, keep=True)"
            ) from exc
        return ref

    def fetch(self, ref: Ref, timeout: float | None = None) -> Any:
        self.check(ref)
        if self.store is not None:
            try:
                return self.store.read(ref.id)
            except FileNotFoundError:
                raise lost(ref) from None
        from nimbus.data._place import take
        from nimbus.data._task import identity

        assert self.call is not None
        read = None
        try:
            taken, obj = take(ref, self, timeout)  # (straight from its node)
            if taken:
                return obj
            read = self.call(identity, ref, keep=False)  # (failed if its endpoint is offline)
            return read.result(timeout)
        except cf.TimeoutError:
            if read is not None:
                read.cancel()
            raise TimeoutError(
                f"{ref!r} was not read within {timeout} s: endpoint {named(self.endpoint)!r} "
                f"has not run the read yet (its workers busy, or the service slow?); try "
                f"again with a longer timeout"
            ) from None

    # -- leases ---------------------------------------------------------------
    def flush(self, *, renew: bool = True) -> None:
        """Free what was released and renew what is held (the renewer does it often)."""
        to_free: list[str] = []
        free_where: dict[str, tuple[str, int, str]] = {}
        try:
            while True:
                ref_id, holder = self._to_free.popleft()
                to_free.append(ref_id)
                if holder is not None:
                    free_where[ref_id] = holder
        except IndexError:  # drained
            pass
        held = self.held() if renew else []
        expires = time.time() + self.lease
        if self.store is not None:
            if held:
                self.store.renew(held, expires)
            return
        from nimbus.data._task import free_objects, renew_objects

        assert self.call is not None
        if to_free:  # (pins of staged copies: forwarded to their nodes where not here)
            if free_where:
                self.call(free_objects, to_free, free_where, keep=False)
            else:
                self.call(free_objects, to_free, keep=False)
            self.freed += len(to_free)
        if held:
            where = {i: h for i in held if (h := self._holders.get(i)) is not None}
            if where:  # (pins of staged copies: forwarded to their nodes where not here)
                renewed = self.call(renew_objects, held, expires, where, keep=False)
                renewed.add_done_callback(self._note_gone)
            else:
                self.call(renew_objects, held, expires, keep=False)

    def _note_gone(self, renewed: Any) -> None:
        """A renewal's lost ids: the pins of staged copies among them are gone with their
        node (the client's cache entry for the file is dropped: ``_staging._fetch``)."""
        try:
            lost = renewed.result()
        except BaseException:  # the renewal itself failed: nothing learnt
            return
        with self._lock:
            self.gone.update(i for i in lost if i in self._holders)

    def _renewer(self) -> None:
        """Free what was released (every second for an endpoint: one task for many) and
        renew the leases of what is held (every third of a lease)."""
        renewed = time.monotonic()
        failing = False
        while not self._closed.wait(min(1.0, self.lease / 3)):
            try:  # (until closed: one failure, a store or a link, is not the last word)
                if time.monotonic() - renewed >= self.lease / 3:
                    renewed = time.monotonic()
                    self.flush()
                else:
                    self.flush(renew=False)
                failing = False
            except Exception as exc:
                if not failing:  # (said once a streak: tried again at the next turn)
                    log.warning(
                        "cannot renew or free the objects of %s now (%s); trying again",
                        self.endpoint or "the local runtime",
                        exc,
                    )
                failing = True

    def close(self) -> None:
        """Free what is released; later releases are left to the leases."""
        if self.store is None and not self._closed.is_set():
            try:
                self.flush()
            except Exception:
                pass
        self._closed.set()


def lost(ref: Ref) -> ReferenceLost:
    return ReferenceLost(
        f"{ref!r} is gone: the node that kept it lost it, or its lease ran out; make "
        f"the object again (nimbus.put, or the task that made it) and pass the new reference",
        ref.id,
    )


# endpoint (None: the local runtime) -> the sessions of this process there, the latest
# last (two Executors of two users on one endpoint each have theirs)
_sessions: dict[str | None, list[Session]] = {}
_sessions_lock = threading.Lock()


def _forget_sessions() -> None:
    """In a forked child (a warm worker, a user's fork): the parent's sessions are not
    its own (their renewer thread is not here; their locks may have been held by another
    thread at the fork): it makes its own on use."""
    global _sessions_lock
    _sessions_lock = threading.Lock()
    _sessions.clear()
    _openers.clear()  # (the parent's Executors: their threads are not here either)


os.register_at_fork(after_in_child=_forget_sessions)


# endpoint id -> the name its Executor was opened with (or the service's name for it)
_names: dict[str, str] = {}


def named(endpoint: str | None) -> str:
    """``endpoint`` (an id) as the user named it where this process knows it."""
    if endpoint is None:
        return ""
    return _names.get(endpoint, endpoint)


def local_namespace() -> str:
    return f"u{os.getuid()}"


def owner_namespace(owner: str) -> str:
    """The namespace of the service's user ``owner`` (their id) on an endpoint: the
    agent names a task's store from the owner the service sends with it, the client
    its own from ``whoami`` (so every token of a user finds the same objects)."""
    return f"user-{owner}"


def session(endpoint: str | None) -> Session:
    """This process's session for ``endpoint`` (None: the local runtime's, made on use)."""
    with _sessions_lock:
        found = _sessions.get(endpoint)
        if not found and endpoint is None:
            store = NodeStore(local_namespace())
            atexit.register(release, hold(store.dir.parent))  # removed when the last goes
            found = _sessions[None] = [
                Session(local_namespace(), getpass.getuser(), None, store=store)
            ]
        makers = _openers.get(endpoint) if not found else None
        make = makers[-1] if makers else None
    if found:
        return found[-1]
    if make is not None:
        return make()
    raise DataError(
        f"no Executor(endpoint={endpoint!r}) is open in this process: open one first, "
        f"objects are placed on an endpoint through it"
    )


# endpoint -> how to make its session (Executors there that have not made it yet)
_openers: dict[str | None, list[Callable[[], Session]]] = {}


def register(
    endpoint: str,
    found: Session | None,
    closed: Session | None = None,
    *,
    opener: Callable[[], Session] | None = None,
) -> None:
    """The Executor's session for ``endpoint`` (or the ``opener`` that makes it on first
    use); ``found`` None: the executor of ``opener`` shut down (``closed``, its session
    if it made one, and ``opener`` are forgotten; other executors' stay)."""
    with _sessions_lock:
        if found is not None:
            there = _sessions.setdefault(endpoint, [])
            if found not in there:
                there.append(found)
        elif closed is None and opener is not None and opener not in _openers.get(endpoint, []):
            _openers.setdefault(endpoint, []).append(opener)
        else:
            if closed is not None and closed in _sessions.get(endpoint, []):
                _sessions[endpoint].remove(closed)
            if opener is not None and opener in _openers.get(endpoint, []):
                _openers[endpoint].remove(opener)


F = TypeVar("F", bound=Callable[..., Any])


def pure(fn: F) -> F:
    """Mark ``fn`` pure (its result depends on its arguments only): a kept result of it
    that is lost (its node died, its lease ran out) is made again by running it again,
    instead of failing the tasks that read it with ``ReferenceLost``."""
    fn.__nimbus_pure__ = True  # type: ignore[attr-defined]
    return fn


def put(obj: object, endpoint: str | None = None) -> Ref:
    """Place ``obj`` once in ``endpoint``'s store (None: this node's); a :class:`Ref` to it.

    Pass the Ref to any number of tasks there: they read it where they run.
    """
    if isinstance(obj, Ref):
        raise DataError(f"{obj!r} is a reference already; pass it to tasks as it is")
    return session(endpoint).put(obj)


def get(ref: Ref) -> Any:
    """The object ``ref`` names."""
    if not isinstance(ref, Ref):
        raise TypeError(f"nimbus.data.get takes a nimbus.Ref, not {type(ref).__name__}")
    return ref.get()
