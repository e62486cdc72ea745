"""Queues over the state store, with the API of ``multiprocessing.queues``.

::

    producer                                 state store                    consumer
    put(obj) -> buffer --feeder thread--> RPUSH q m1 m2 ... mN --> BLPOP/LPOP n --> local
                 (pickles a batch,          (one list: queue:<name>)     buffer --> get()
                  one command per batch)

    once the queue has one consumer and it is a live instance (``_qdirect``):
    put(obj) -> buffer --feeder thread--> nimbus.messaging (a batch a send) --> get()

Like the stdlib's, :class:`Queue` pickles in a feeder thread: ``put`` only
appends to a local buffer, and the feeder sends everything buffered with one
RPUSH, so a producer is not bound by one round trip per item. An object that
fails to pickle is reported by the feeder (printed, as in the stdlib), not by
``put``. A consumer calling ``get`` in a tight loop takes up to 64 waiting
items at once into a local buffer (one calling it now and then takes one at a
time); held items go back to the head of the list when the queue is closed,
garbage collected, or the process exits. With several consumers, one in a
tight loop may so hold items that another could have taken; a
:class:`SimpleQueue` (a Pool's job and result queues) takes one item a ``get``.

A bounded queue (``maxsize > 0``) counts its items in the store: ``put``
reserves a slot (one round trip) and ``get`` releases it, pushing a wake-up
token that blocked putters wait for with BLPOP. It takes one item at a time.
:class:`JoinableQueue` counts unfinished tasks in the store the same way.
Every object pickles to other processes (as its program and name) and works
there.

An unbounded :class:`Queue` (and :class:`JoinableQueue`) switches to direct
messaging while one process consumes it: the first process to call ``get``
claims it, and each producer, within 20 ms of its next send, marks its switch
in the list and sends its batches straight to the consumer's socket. A second
consumer makes the queue shared, for good: the first gives its claim up and
puts what came to it directly, and did not deliver, back into the list,
before each producer's later items. Each producer's order holds and every
item arrives once across the switch (``nimbus.multiprocessing._handover``
says how, and what a consumer killed by a signal loses). Bounded queues,
:class:`SimpleQueue` (a Pool's job queue, with competing consumers) and
``NIMBUS_MESSAGING_DIRECT=0`` stay in the store. ``qsize`` and ``empty``
count the list and what the calling process holds: items on their way to
the consumer, or held by it, count in the consumer only. ``qsize`` of an unbounded queue is the list's length plus what this
process holds (approximate, as in the stdlib).
"""

from __future__ import annotations

import collections
import os
import threading
import time
import traceback
import types
import weakref
from multiprocessing import util
from queue import Empty, Full
from typing import Any

from nimbus.errors import StateStoreError
from nimbus.multiprocessing import _qdirect, _site
from nimbus.multiprocessing._payload import MESSAGE, load, pack, unpack
from nimbus.multiprocessing.connection import Connection, link, seconds
from nimbus.statestore import Keys, Program
from nimbus.statestore.lua import QUEUE_RELEASE as _RELEASE
from nimbus.statestore.lua import QUEUE_RESERVE as _RESERVE
from nimbus.statestore.lua import QUEUE_TASK_DONE as _TASK_DONE

__all__ = ["JoinableQueue", "Queue", "SimpleQueue"]

_BATCH_ITEMS = 1000  # most items the feeder sends in one command
_BATCH_BYTES = 1 << 20
_WAKE_SLICE = 0.2  # a blocked waiter re-checks the store at least this often

# KEYS: count; ARGV: maxsize, ttl. 1 if a slot was reserved, else 0.
# KEYS: count, notfull; ARGV: released, maxsize, ttl.
# KEYS: unfinished, joined; ARGV: ttl. -1 if there was no unfinished task.
_sentinel = object()


def _rebuild(cls: type[Queue], prog: Program, name: str, maxsize: int) -> Queue:
    if not issubclass(cls, Queue):  # the stdlib's subclass, bound before nimbus was installed
        cls = _on_nimbus(cls)
    queue = cls.__new__(cls)
    queue._setup(prog, name, maxsize)
    return queue


_STDLIB_QUEUES = ("Queue", "JoinableQueue")  # of multiprocessing.queues, nimbus's stand in
_rebased: dict[type, type] = {}  # a stdlib-based subclass -> the same on nimbus's queue
_rebased_from: dict[type, type] = {}  # and back: it pickles as the original


def _on_nimbus(cls: type) -> type[Queue]:
    """``cls``, a subclass of the stdlib's ``multiprocessing.queues.Queue``, made again on
    nimbus's (its own attributes, each class of its chain; ``super()`` in its methods works).

    A module a process imported before nimbus was installed keeps the stdlib's classes:
    ``concurrent.futures.process._SafeQueue`` (a ProcessPoolExecutor's call queue) or a
    user's subclass in the main module, both imported by an endpoint's shared worker,
    which stays uninstalled, before it forks the program's process. The queue such a
    process unpickles is this class's instance (``isinstance`` of the original is False).
    """
    if cls.__module__ == "multiprocessing.queues" and cls.__name__ in _STDLIB_QUEUES:
        made: type[Queue] = globals()[cls.__name__]
        return made
    if issubclass(cls, Queue):
        return cls
    made = _rebased.get(cls)  # type: ignore[assignment]
    if made is None:
        bases = tuple(_on_nimbus(base) if _stdlib_queue(base) else base for base in cls.__bases__)
        slots = cls.__dict__.get("__slots__", ())
        slots = (slots,) if isinstance(slots, str) else tuple(slots)
        skip = {"__dict__", "__weakref__", *slots}
        namespace = {k: v for k, v in vars(cls).items() if k not in skip}
        made = type(cls)(cls.__name__, bases, namespace)
        made.__qualname__ = cls.__qualname__
        for key, value in namespace.items():  # their `__class__` cell: the new class
            fixed = _reclassed(value, cls, made)
            if fixed is not value:
                setattr(made, key, fixed)
        _rebased[cls], _rebased_from[made] = made, cls
    return made


def _stdlib_queue(cls: type) -> bool:
    return any(
        c.__module__ == "multiprocessing.queues" and c.__name__ in _STDLIB_QUEUES
        for c in cls.__mro__
    )


def _reclassed(value: Any, old: type, new: type) -> Any:
    """``value`` (a function, or a static/class method or property of functions) with a
    ``__class__`` cell of ``old`` (what ``super()`` uses) re-made with one of ``new``."""
    if isinstance(value, (staticmethod, classmethod)):
        func = _reclassed(value.__func__, old, new)
        return value if func is value.__func__ else type(value)(func)
    if isinstance(value, property):
        fget, fset, fdel = (_reclassed(f, old, new) for f in (value.fget, value.fset, value.fdel))
        if (fget, fset, fdel) == (value.fget, value.fset, value.fdel):
            return value
        return type(value)(fget, fset, fdel, doc=value.__doc__)
    if not isinstance(value, types.FunctionType) or value.__closure__ is None:
        return value
    names, cells = value.__code__.co_freevars, value.__closure__
    if "__class__" not in names or cells[names.index("__class__")].cell_contents is not old:
        return value
    closure = tuple(
        types.CellType(new) if n == "__class__" else c for n, c in zip(names, cells, strict=True)
    )
    func = types.FunctionType(
        value.__code__, value.__globals__, value.__name__, value.__defaults__, closure
    )
    func.__kwdefaults__ = value.__kwdefaults__
    func.__dict__.update(value.__dict__)
    func.__qualname__ = value.__qualname__
    func.__doc__ = value.__doc__
    return func


class Queue:
    """A process- and host-shared FIFO queue (``multiprocessing.Queue``)."""

    def __init__(self, maxsize: int = 0, *, ctx: Any = None) -> None:
        self._setup(_site.shared_program(), Keys.new_name(), max(maxsize, 0))

    def _setup(self, prog: Program, name: str, maxsize: int) -> None:
        self._program = prog
        self._name = name
        self._maxsize = maxsize
        keys = prog.keys
        self._key = keys.queue(name)
        self._count = keys.queue_field(name, "count")
        self._notfull = keys.queue_field(name, "notfull")
        self._reader = Connection(prog, self._key, None)
        if maxsize:
            self._reader._prefetch = 1
        self._direct_sides()
        self._rlock = threading.Lock()
        self._notempty = threading.Condition(threading.Lock())
        self._sendlock = threading.Lock()  # held by the feeder while a batch is in flight
        self._buffer: collections.deque[object] = collections.deque()
        self._thread: threading.Thread | None = None
        self._jointhread: util.Finalize | None = None
        self._joincancelled = False
        self._closed = False
        self._close: util.Finalize | None = None
        self._opid = os.getpid()
        util.register_after_fork(self, Queue._after_fork)

    def _direct_sides(self) -> None:
        """This process's consumer and producer of the queue (None: store only)."""
        self._consumer: _qdirect.Consumer | None = None
        self._producer: _qdirect.QueueProducer | None = None
        if not self._maxsize:  # a bounded queue counts its items in the store
            self._consumer = _qdirect.consumer(self._program, self._name)
            self._producer = _qdirect.producer(self._program, self._name)
        self._reader._reader = self._consumer  # reads directly, after the list's markers

    def __reduce__(self) -> tuple[Any, ...]:
        cls = _rebased_from.get(type(self), type(self))  # (see _on_nimbus)
        return (_rebuild, (cls, self._program, self._name, self._maxsize))

    def _after_fork(self) -> None:
        self._direct_sides()  # the parent's claim and switch stay the parent's
        self._notempty = threading.Condition(threading.Lock())
        self._sendlock = threading.Lock()
        self._buffer = collections.deque()
        self._thread = self._jointhread = self._close = None
        self._joincancelled = self._closed = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._name} maxsize={self._maxsize}>"

    def _call(self, *commands: Any) -> list[Any]:
        return link(self._program).call(*commands)

    # -- put

    def _reserve(self, block: bool, timeout: float | None) -> None:
        """Take a slot of a bounded queue, or raise :class:`Full`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        ttl = self._program.ttl_ms
        while True:
            if link(self._program).eval(_RESERVE, (self._count,), (self._maxsize, ttl)):
                return
            remaining = _WAKE_SLICE if deadline is None else deadline - time.monotonic()
            if not block or remaining <= 0:
                raise Full
            self._call(("BLPOP", self._notfull, seconds(min(remaining, _WAKE_SLICE))))

    def _release(self, n: int) -> None:
        ttl = self._program.ttl_ms
        link(self._program).eval(_RELEASE, (self._count, self._notfull), (n, self._maxsize, ttl))

    def put(self, obj: object, block: bool = True, timeout: float | None = None) -> None:
        """Put ``obj`` on the queue; :class:`queue.Full` if no slot frees in time."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        if self._maxsize:
            self._reserve(block, timeout)
        self._counted_put()
        with self._notempty:
            if self._thread is None:
                self._start_thread()
            if not self._buffer and self._put_direct(obj):
                return
            self._buffer.append(obj)
            self._notempty.notify()

    def _put_direct(self, obj: object) -> bool:
        """Send ``obj`` straight to the consumer from this thread (no feeder hop) when
        switched, nothing waits in the buffer and no batch is in flight; False: the
        feeder sends it (and reports an object that does not pickle, as in the stdlib)."""
        producer = self._producer
        if producer is None or producer.peer is None or not self._sendlock.acquire(False):
            return False
        try:
            try:
                message = pack(obj, MESSAGE)
            except Exception:
                return False
            return producer.send_now(message)
        finally:
            self._sendlock.release()

    def _counted_put(self) -> None:
        """A hook: :class:`JoinableQueue` counts the task."""

    def put_nowait(self, obj: object) -> None:
        """``put(obj, False)``."""
        self.put(obj, False)

    def _start_thread(self) -> None:
        self._buffer.clear()
        self._thread = threading.Thread(target=self._feed, name="QueueFeederThread", daemon=True)
        self._thread.start()
        if not self._joincancelled:
            # before the process's instance closes (5): the feeder may be sending directly
            priority = 6 if self._producer is not None else -5
            self._jointhread = util.Finalize(
                self._thread,
                Queue._finalize_join,
                [weakref.ref(self._thread)],
                exitpriority=priority,
            )
        self._close = util.Finalize(
            self, Queue._finalize_close, [self._buffer, self._notempty], exitpriority=10
        )

    @staticmethod
    def _finalize_join(twr: weakref.ref[threading.Thread]) -> None:
        thread = twr()
        if thread is not None:
            thread.join()

    @staticmethod
    def _finalize_close(buffer: collections.deque[object], notempty: threading.Condition) -> None:
        with notempty:
            buffer.append(_sentinel)
            notempty.notify()

    def _feed(self) -> None:
        """The feeder thread: pickle what is buffered and send it in batches."""
        buffer, notempty = self._buffer, self._notempty
        while True:
            with notempty:
                while not buffer:
                    notempty.wait()
            with self._sendlock:  # qsize() waits for a batch in flight
                with notempty:
                    items: list[object] = []
                    while buffer and len(items) < _BATCH_ITEMS:
                        items.append(buffer.popleft())
                done = self._send_batch(items)
            if done:
                return

    def _send_batch(self, items: list[object]) -> bool:
        """Pickle and send ``items``; True at the close sentinel."""
        prog, key = self._program, self._key
        messages: list[bytes] = []
        size, done = 0, False
        for obj in items:
            if obj is _sentinel:
                done = True
                break
            try:
                message = pack(obj, MESSAGE)
            except Exception as exc:
                if util.is_exiting():
                    return True
                if self._maxsize:
                    self._release(1)
                self._on_queue_feeder_error(exc, obj)
                continue
            messages.append(message)
            size += len(message)
            if size >= _BATCH_BYTES:
                self._send(prog, key, messages)
                messages, size = [], 0
        if messages:
            self._send(prog, key, messages)
        return done

    def _send(self, prog: Program, key: str, messages: list[bytes]) -> None:
        try:
            producer = self._producer
            batch = messages[0] if len(messages) == 1 else messages  # one: as it is
            if producer is not None and producer.send(batch):
                return
            link(prog).call(("RPUSH", key, *messages), ("PEXPIRE", key, prog.ttl_ms))
        except StateStoreError:
            if util.is_exiting():
                return
            traceback.print_exc()

    @staticmethod
    def _on_queue_feeder_error(e: BaseException, obj: object) -> None:
        """Called in the feeder thread when ``obj`` cannot be sent; prints the error."""
        traceback.print_exc()

    # -- get

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """Remove and return an item; :class:`queue.Empty` if none comes in time."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        if not block:
            timeout = 0.0
        deadline = None if timeout is None else time.monotonic() + timeout
        wait = -1 if timeout is None else max(timeout, 0.0)
        if not self._rlock.acquire(True, wait):
            raise Empty
        try:
            message = self._next(deadline)
        finally:
            self._rlock.release()
        if message is None:
            raise Empty
        _qdirect.got()
        if self._maxsize:
            self._release(1)
        return load(message)

    def _next(self, deadline: float | None) -> bytes | None:
        """The next item, from the list or (claimed, see ``_handover``) directly; None:
        none came by ``deadline``. The queue's reader connection reads it, with this
        process's consumer as its direct side."""
        reader = self._reader
        message = reader._next(deadline)
        if message is not None:
            reader._last = time.monotonic()  # a tight loop of gets: fills take more
        return message  # type: ignore[return-value]  # a queue's are bytes

    def get_nowait(self) -> Any:
        """``get(False)``."""
        return self.get(False)

    # -- state

    def qsize(self) -> int:
        """The number of items in the queue (approximate)."""
        if self._maxsize:
            return int(self._call(("GET", self._count))[0] or 0)
        with self._sendlock:
            length = int(self._call(("LLEN", self._key))[0])
            return length + len(self._buffer) + len(self._reader._buffer) + self._held()

    def _held(self) -> int:
        return 0 if self._consumer is None else self._consumer.held()

    def empty(self) -> bool:
        """True if the queue looks empty (approximate)."""
        if self._buffer or self._reader._buffer or self._held():
            return False
        return int(self._call(("LLEN", self._key))[0]) == 0

    def full(self) -> bool:
        """True if a bounded queue has no free slot (approximate)."""
        if not self._maxsize:
            return False
        return int(self._call(("GET", self._count))[0] or 0) >= self._maxsize

    # -- closing

    def close(self) -> None:
        """No more puts or gets here; the feeder flushes what is buffered and exits."""
        self._closed = True
        self._reader.close()  # gives held items back
        if self._consumer is not None:  # and the direct ones (see ``_qdirect``)
            self._consumer.give_up()
        close, self._close = self._close, None
        if close:
            close()

    def join_thread(self) -> None:
        """Wait for the feeder thread to send everything (after :meth:`close`)."""
        assert self._closed, f"Queue {self!r} not closed"
        if self._jointhread:
            self._jointhread()

    def cancel_join_thread(self) -> None:
        """Do not wait for the feeder thread at process exit (buffered items may be lost)."""
        self._joincancelled = True
        try:
            if self._jointhread is not None:
                self._jointhread.cancel()
        except AttributeError:
            pass

    __class_getitem__: Any = classmethod(types.GenericAlias)


class JoinableQueue(Queue):
    """A :class:`Queue` with ``task_done`` and ``join``."""

    def _setup(self, prog: Program, name: str, maxsize: int) -> None:
        super()._setup(prog, name, maxsize)
        self._unfinished = prog.keys.queue_field(name, "unfinished")
        self._joined = prog.keys.queue_field(name, "joined")

    def _counted_put(self) -> None:
        ttl = self._program.ttl_ms
        self._call(("INCR", self._unfinished), ("PEXPIRE", self._unfinished, ttl))

    def task_done(self) -> None:
        """Mark one item as processed; :class:`ValueError` if called too many times."""
        ttl = self._program.ttl_ms
        n = link(self._program).eval(_TASK_DONE, (self._unfinished, self._joined), (ttl,))
        if n < 0:
            raise ValueError("task_done() called too many times")

    def join(self) -> None:
        """Block until every item put has been marked done."""
        ttl = self._program.ttl_ms
        while int(self._call(("GET", self._unfinished))[0] or 0) > 0:
            self._call(("BLPOP", self._joined, seconds(_WAKE_SLICE)))
        # pass the wake-up on to other joiners
        self._call(("RPUSH", self._joined, "1"), ("LTRIM", self._joined, -64, -1))
        self._call(("PEXPIRE", self._joined, ttl))


class SimpleQueue:
    """A simplified queue (``multiprocessing.SimpleQueue``): ``put`` sends at once."""

    def __init__(self, *, ctx: Any = None) -> None:
        self._setup(_site.shared_program(), Keys.new_name())

    def _setup(self, prog: Program, name: str) -> None:
        self._program = prog
        self._name = name
        key = prog.keys.queue(name)
        self._reader = Connection(prog, key, None)
        self._reader._prefetch = 1  # one item a get: several consumers share it (a Pool's)
        self._writer = Connection(prog, None, key)
        self._rlock = threading.Lock()
        self._wlock = None
        self._poll = self._reader.poll

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_simple, (self._program, self._name))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._name}>"

    def close(self) -> None:
        """Close this process's reader and writer (held items go back)."""
        self._reader.close()
        self._writer.close()

    def empty(self) -> bool:
        """True if there is nothing to get (looks, takes nothing: others may get it)."""
        if self._reader._buffer:
            return False
        return int(link(self._program).call(("LLEN", self._reader._read_key))[0]) == 0

    def get(self) -> Any:
        """Remove and return an item, waiting for one."""
        with self._rlock:
            res = self._reader.recv_bytes()
        return unpack(res)

    def put(self, obj: object) -> None:
        """Put an item; an object that cannot be pickled raises here."""
        self._writer.send_bytes(pack(obj))

    __class_getitem__: Any = classmethod(types.GenericAlias)


def _rebuild_simple(prog: Program, name: str) -> SimpleQueue:
    queue = SimpleQueue.__new__(SimpleQueue)
    queue._setup(prog, name)
    return queue
