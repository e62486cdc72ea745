"""Pipes between processes, with the API of ``multiprocessing.connection``.

::

    end 0                          state store                          end 1
    send(obj) --RPUSH------------> pipe:<name>:1 ----BLPOP (+LPOP n)--> recv()
    recv()  <--BLPOP (+LPOP n)---- pipe:<name>:0 <-----------RPUSH----- send(obj)
        |                                                                  |
        +-- local buffer of prefetched messages      close(): last copy ---+
                                                     pushes end-of-stream

    once one process reads a direction and its writers are instances (_direct):
    send(obj) --nimbus.messaging, a socket (tag: the direction)-------> recv()

Each direction of a :func:`Pipe` is a Redis list named by the end that reads
it. Every list element is one message: ``b"B"`` + the bytes, or ``b"E"``, the
end-of-stream marker (or a switch marker, below; ``_payload`` draws them
all). A send writes its RPUSH (and the PEXPIRE that renews the list's TTL)
asking the store for no reply, so a send costs one ``write``; a receive with
nothing in hand blocks in one BLPOP, or, in a tight loop, takes up to 63 more
waiting messages with a pipelined ``LPOP key count``, keeping them in a
local buffer that :meth:`Connection.poll`, :meth:`Connection.recv` and
:func:`wait` see. On close (explicit, at garbage collection or at process exit)
prefetched messages are pushed back to the head of the list.

A direction *switches* to direct messaging (the handover engine,
``nimbus.multiprocessing._handover``, and its Pipe lane ``_direct``) while
one process reads it: the reader claims the direction when it starts reading,
each writer finds the claim within 20 ms of sending and puts a switch marker
in the list, and from there sends straight to the reader's socket; the reader
reads the list up to each writer's marker, then that writer's direct
messages, so every message arrives once and in order. Copies of an end that
are only held (the stdlib documentation's parent that keeps the child's end)
change nothing; a second process reading the direction takes it back to the
store, in order, for good. A :class:`Connection` is the stdlib's
``_ConnectionBase`` with its three hooks filled (``_send_bytes``,
``_recv_bytes``, ``_poll``), and its own ``send``/``recv`` for nimbus's
pickling. ``NIMBUS_MESSAGING_DIRECT=0`` keeps every message in the store.

An end may be pickled to other processes, like a file descriptor inherited by a
child: each copy holds a reference (taken when it is pickled), and when the
last copy of an end is closed an end-of-stream marker is pushed to the list the
peer reads (or sent directly), so the peer's ``recv`` raises :class:`EOFError`
once it has read everything before it; so does a direct reader whose only
writer died. A send to an end whose copies are all closed is dropped
(the stdlib raises ``BrokenPipeError``). A reading end's :meth:`Connection.fileno`
is the read end of a private OS pipe, readable while a message is in hand (see
``_pump``: a thread then reads the end, one message ahead), so ``select`` and
``poll`` on it work as on the stdlib's; :func:`wait` needs no descriptor.

``Listener``, ``Client``, ``answer_challenge``, ``deliver_challenge``,
``BufferTooShort`` and ``AuthenticationError`` are the stdlib's own: they are
real sockets, which work between the processes of one host.
"""

from __future__ import annotations

import collections
import io
import pickle
import threading
import time
from collections.abc import Iterable
from multiprocessing import AuthenticationError, BufferTooShort, util
from multiprocessing.connection import (  # type: ignore[attr-defined]  # noqa: F401
    CHALLENGE,
    Client,
    Listener,
    _ConnectionBase,
    address_type,
    answer_challenge,
    arbitrary_address,
    default_family,
    deliver_challenge,
    families,
)
from typing import TYPE_CHECKING, Any

from nimbus import serialization
from nimbus.errors import StateStoreError
from nimbus.multiprocessing import _direct, _releasing, _wait
from nimbus.multiprocessing import _site as _state
from nimbus.multiprocessing._direct import PipeLane
from nimbus.multiprocessing._handover import LOOK, Consumer
from nimbus.multiprocessing._payload import (
    EOS,
    MESSAGE,
    SWITCH,
    Item,
    as_message,
    load,
    undecodable,
)
from nimbus.multiprocessing._payload import FRAMED as _FRAMED
from nimbus.multiprocessing._pump import Pump
from nimbus.multiprocessing._wait import seconds
from nimbus.statestore import Keys, Program, link
from nimbus.statestore import pack as pack_command
from nimbus.statestore.lua import CONNECTION_RELEASE as _RELEASE

__all__ = [
    "AuthenticationError",
    "BufferTooShort",
    "Client",
    "Connection",
    "Listener",
    "Pipe",
    "answer_challenge",
    "deliver_challenge",
    "wait",
]

PREFETCH = 64  # most messages a reader takes from the store at once
_TIGHT_LOOP = 0.001  # a reader back within this many seconds is in a loop: prefetch more
_PLAIN = (bytes, str)  # pickled the same with or without the program's reducers
_SMALL = serialization.OOB_THRESHOLD  # below this, bytes are pickled in band anyway
_COPIED = 4096  # a direct message up to this size is unpickled from a copy (``_payload.load``)

# Decrement the references of an end (the key goes at zero); how many are left.
# ---------------------------------------------------------------- Connection


class Connection(_ConnectionBase):
    """One end of a :func:`Pipe`, or a reader or writer of a shared list.

    The stdlib's ``_ConnectionBase`` gives the public surface (its argument
    checks, ``recv_bytes_into``, the context manager); this class fills its
    three hooks ``_send_bytes``, ``_recv_bytes`` and ``_poll``, and keeps
    ``send`` and ``recv`` for nimbus's pickling (out-of-band buffers travel
    unframed). ``refs`` is the key counting the copies of this end (None for
    the ends of a queue, which never signal end-of-stream); ``lanes`` are the
    directions of a pipe it reads and writes, which may go direct (``_direct``).
    """

    if TYPE_CHECKING:  # the stdlib base's, untyped there
        _handle: int | None
        _readable: bool
        _writable: bool

        def _check_closed(self) -> None: ...
        def _check_readable(self) -> None: ...
        def _check_writable(self) -> None: ...

    def __init__(
        self,
        prog: Program,
        read_key: str | None,
        write_key: str | None,
        refs: str | None = None,
        lanes: tuple[PipeLane | None, PipeLane | None] | None = None,
    ) -> None:
        super().__init__(0, read_key is not None, write_key is not None)  # no descriptor
        self._program = prog
        self._read_key = read_key
        self._write_key = write_key
        self._refs = refs
        self._lanes = lanes
        self._new_direct()
        self._buffer: collections.deque[bytes] = collections.deque()
        self._held: Item | None = None  # the next message, taken by a poll
        self._eof = False
        self._eos_next = False  # end-of-stream came, and messages it overtook go first
        self._batch = 1
        self._prefetch = PREFETCH
        self._ttl_ms = prog.ttl_ms
        self._wait_forever: bytes | None = None  # BLPOP of the list, packed once
        self._misses = 0
        self._last = 0.0
        self._pump: Pump | None = None  # once fileno() was asked (a reading end)
        self._pumps: list[Pump] = []  # the same, for the finalizer
        self._finalize()
        # a process's bootstrap clears the finalizers (ours were made while its
        # process object was unpickled) and then runs the after-fork hooks
        util.register_after_fork(self, Connection._finalize)

    def _new_direct(self) -> None:
        """This process's direct sides of the lanes this end reads and writes."""
        read_lane, write_lane = self._lanes or (None, None)
        self._reader: Consumer | None = (
            _direct.reader(self._program, read_lane) if read_lane else None
        )
        self._writer = _direct.writer(self._program, write_lane) if write_lane else None

    def _finalize(self) -> None:
        """(Re)register what happens at close or exit: prefetched items go back, refs drop."""
        previous = getattr(self, "_finalizer", None)
        if previous is not None:
            previous.cancel()  # registered again after a fork: one release, not two
            self._new_direct()  # the parent's claims and switches stay the parent's
            if self._pump is not None:  # and so do its pump thread and the message it holds
                self._pump.forget()
                self._pump = None
                self._pumps = []
        self._finalizer = util.Finalize(
            self, _release_quietly, self._release_args(), exitpriority=10
        )

    def _release_args(self) -> tuple[Any, ...]:
        """What :func:`_release` needs (the finalizer must not hold the connection)."""
        return (
            self._program,
            self._read_key,
            self._write_key,
            self._refs,
            self._buffer,
            self._reader,
            self._writer,
            self._pumps,
        )

    def __del__(self) -> None:
        """Collected: the finalizer releases this copy (quietly)."""

    def _close(self) -> None:
        self._finalizer.cancel()
        held, self._held = self._held, None
        if held is not None and not self._eof:
            self._buffer.appendleft(as_message(held))
        _release(*self._release_args())
        self._pump = None

    def fileno(self) -> int:
        """A descriptor readable while a message is in hand (a reading end; see ``_pump``).

        A write-only end has none: :class:`OSError`.
        """
        self._check_closed()
        if not self._readable:
            raise OSError(
                "a write-only nimbus Connection has no file descriptor; use nimbus wait()"
            )
        if self._pump is None:
            self._pump = Pump(self, Connection._poll, Connection._recv_item)
            self._pumps.append(self._pump)
        return self._pump.read_fd

    def _pumped(self) -> Pump | None:
        """The pump, if this end has one and the caller is not its thread."""
        pump = self._pump
        if pump is None or pump.thread is threading.current_thread():
            return None
        return pump

    # -- sending

    def _send_message(self, message: Item) -> None:
        writer = self._writer
        if writer is not None and writer.send(message):
            return
        self._push(as_message(message))

    def _push(self, message: bytes) -> None:
        key = self._write_key
        assert key is not None
        link(self._program).push(key, message, self._ttl_ms)

    def _send_bytes(self, buf: memoryview) -> None:
        self._send_message(MESSAGE + buf)

    def send(self, obj: object) -> None:
        """Send a picklable object."""
        if self._handle is None or not self._writable:
            self._check_closed()
            self._check_writable()
        if type(obj) in _PLAIN and len(obj) < _SMALL:  # type: ignore[arg-type]
            # the common small case, inline (a round trip costs each call here)
            message: Item = MESSAGE + pickle.dumps(obj, serialization.PROTOCOL)
        else:
            data, buffers = _state.dumps(obj)
            # directly, the buffers travel as they are (no framing copy)
            message = (data, *buffers) if buffers else MESSAGE + data
        writer = self._writer  # ``_send_message``, inline (a round trip costs each call)
        if writer is not None and writer.send(message):
            return
        self._push(as_message(message))

    # -- receiving

    def _direct_now(self) -> bool:
        """Whether direct messages may come to this end now (``wait`` slices its waits)."""
        if self._pump is not None:
            return False
        reader = self._reader
        return reader is not None and reader.active()

    def _ready(self) -> bool:
        """Whether a message (or end-of-stream) is in hand, without waiting."""
        if self._pump is not None and (pump := self._pumped()) is not None:
            return pump.ready()
        if self._eof or self._eos_next or self._held is not None:
            return True
        buffer, reader = self._buffer, self._reader
        if reader is None:  # a queue's reader: its markers are the queue's
            return bool(buffer)
        while buffer:
            if buffer[0][:1] != SWITCH:
                return True
            reader.marker(buffer.popleft())
        if reader is not None and reader.active():
            self._held = reader.take()
            return self._held is not None
        return False

    def _next(self, deadline: float | None) -> Item | None:
        """The next message, from the list or (claimed, see ``_handover``) directly;
        None: none came by ``deadline`` (None: wait for it)."""
        if self._held is not None:
            item, self._held = self._held, None
            return item
        reader, buffer = self._reader, self._buffer
        if reader is not None and reader.claim is None:
            reader.try_claim()
        tried = False
        while True:
            while buffer:
                message = buffer.popleft()
                if message[:1] != SWITCH or reader is None:
                    return message
                reader.marker(message)
            remaining = None if deadline is None else deadline - time.monotonic()
            if tried and remaining is not None and remaining <= 0:
                return None
            tried = True
            if reader is not None and reader.active():
                # writers are switched: wait on the socket, look at the list now and then
                if reader.look_at_list() and self._from_store(0):
                    continue
                wait = LOOK if remaining is None else min(LOOK, remaining)
                direct = reader.receive(max(wait, 0.0))
                if direct is not None:
                    return direct
                if reader.writer_gone():
                    return EOS  # its only writer copy died: end of stream
                continue
            self._from_store(remaining)

    def _more(self) -> int:
        """How many more messages than one to take from the store now (LPOP after
        the BLPOP): none, unless the reader is in a tight loop and prefetching pays
        (a reader whose prefetches keep finding nothing, a ping-pong, tries every 32nd)."""
        now = time.monotonic()
        self._batch = min(self._prefetch, self._batch * 2) if now - self._last < _TIGHT_LOOP else 1
        if self._batch > 1 and (self._misses < 4 or self._misses % 32 == 0):
            return self._batch - 1
        return 0

    def _from_store(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` (None: forever) for the list; whether something came
        (to the buffer)."""
        key = self._read_key
        store = link(self._program)
        if timeout is not None and timeout <= 0:
            replies = store.call(("LPOP", key, self._batch))
            return self._take(None, replies[0])
        more = self._more()
        if timeout is None and not more:  # the common wait, lean: one BLPOP packed once
            packed = self._wait_forever
            if packed is None:
                packed = self._wait_forever = pack_command("BLPOP", key, 0)
            self._buffer.append(store.request(packed)[1])
            self._misses += 1
            return True
        commands: list[tuple[Any, ...]] = [
            ("BLPOP", key, 0 if timeout is None else seconds(timeout))
        ]
        if more:
            commands.append(("LPOP", key, more))
        replies = store.call(*commands)
        return self._take(replies[0], replies[1] if more else None)

    def _take(self, popped: Any, more: Any) -> bool:
        """Put what a fill returned into the local buffer; whether anything came."""
        if popped is not None:
            self._buffer.append(popped[1])
        if more:
            self._buffer.extend(more)
            self._misses = 0
        else:
            self._misses += 1
        return popped is not None or bool(more)

    def _poll(self, timeout: float | None) -> bool:
        """Whether there is anything to read, waiting up to ``timeout`` (None: forever)."""
        if self._pump is not None and (pump := self._pumped()) is not None:
            return pump.wait(None if timeout is None else max(timeout, 0.0))
        if self._ready():
            return True
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        item = self._next(deadline)
        if item is None:
            return False
        if isinstance(item, bytes):
            self._buffer.appendleft(item)  # in hand (and back to the list, if closed)
        else:
            self._held = item
        return True

    def _recv_item(self) -> Item:
        """The next message (waiting for it); :class:`EOFError` at end of stream."""
        if self._pump is not None and (pump := self._pumped()) is not None:
            pumped: Item = pump.take()
            return pumped
        if self._eof:
            raise EOFError
        item = self._next(None) if not self._eos_next else EOS
        assert item is not None
        if item == EOS:
            earlier = self._before_eos()
            if earlier is not None:
                self._eos_next = True
                return earlier
            self._eof = True
            _push_back(self._program, self._read_key, collections.deque([EOS]))
            raise EOFError  # (left in the list for the other copies of this end)
        self._last = time.monotonic()
        return item

    def _before_eos(self) -> Item | None:
        """A message sent before end-of-stream that it overtook (several writers, some
        switched: their sockets and the list are not one line): it goes first."""
        reader, buffer = self._reader, self._buffer
        if reader is None:
            return None
        while True:  # to the end of the list: its switch markers may open more writers
            if reader.claim is not None:
                reader.held()  # what the sockets have, read now
                direct = reader.take()
                if direct is not None:
                    return direct
            if not buffer:
                found = link(self._program).call(("LPOP", self._read_key, PREFETCH))[0]
                if not found:
                    return None
                buffer.extend(found)
            while buffer:
                message = buffer.popleft()
                if message[:1] == SWITCH:
                    reader.marker(message)
                elif message != EOS:
                    return message

    def _recv_bytes(self, maxsize: int | None = None) -> io.BytesIO | None:
        message = as_message(self._recv_item())
        if maxsize is not None and len(message) - 1 > maxsize:
            return None
        buf = io.BytesIO(message[1:])
        buf.seek(0, io.SEEK_END)  # as the stdlib's: recv_bytes_into reads its size here
        return buf

    def recv(self) -> Any:
        """Receive a picklable object."""
        if self._handle is None or not self._readable:
            self._check_closed()
            self._check_readable()
        reader = self._reader
        if reader is not None and self._held is None and not self._buffer and self._pump is None:
            # a direct reader's common case, no detour (see ``Consumer.receive_next``)
            item = None if self._eof or self._eos_next else reader.receive_next()
            if item is None or item == EOS:
                self._held = item  # end-of-stream, or nothing: the general way
                item = self._recv_item()
            elif type(item) is bytes and 1 < len(item) <= _COPIED and item[1] != _FRAMED:
                try:  # a small plain pickle: ``load``, inline
                    return pickle.loads(item[1:])
                except Exception as exc:
                    raise undecodable(exc) from exc
        else:
            item = self._recv_item()
        if isinstance(item, bytes):
            return load(item)
        return serialization.loads(item[0], item[1:])  # sent directly, unframed

    # -- pickling

    def __reduce__(self) -> tuple[Any, ...]:
        self._check_closed()
        if self._refs is not None:  # the copy's reference is taken now, not when unpickled
            link(self._program).call(
                ("INCR", self._refs), ("PEXPIRE", self._refs, self._program.ttl_ms)
            )
        args = (self._program, self._read_key, self._write_key, self._refs, self._lanes)
        return (Connection, args)

    def __repr__(self) -> str:
        state = "closed" if self._handle is None else "open"
        return f"<{type(self).__name__} {self._read_key or self._write_key} {state}>"


def _push_back(prog: Program, key: str | None, buffer: collections.deque[bytes]) -> None:
    items = list(buffer)
    buffer.clear()
    link(prog).call(("LPUSH", key, *reversed(items)), ("PEXPIRE", key, prog.ttl_ms))


def _release(
    prog: Program,
    read_key: str | None,
    write_key: str | None,
    refs: str | None,
    buffer: collections.deque[bytes],
    reader: Consumer | None = None,
    writer: _direct.PipeWriter | None = None,
    pumps: list[Pump] | None = None,
) -> None:
    """Give back prefetched messages and this copy's reference (quietly at exit)."""
    try:
        if pumps:  # its message in hand is the first to give back
            pumped = pumps.pop().stop()
            if pumped is not None:
                buffer.appendleft(as_message(pumped))
        if buffer:
            _push_back(prog, read_key, buffer)
        left = None if refs is None else link(prog).eval(_RELEASE, (refs,), ())
        if reader is not None and reader.claim is not None:
            # what came directly goes to the list, for the other copies; with none left
            # nobody reads the lane again, and a silent writer is not waited for
            reader.give_up(read_again=left is None or left > 0)
        if left is not None:
            last = write_key is not None and left <= 0
            # the last copy: end-of-stream, after its direct messages if switched
            if last and (writer is None or not writer.close_end()):
                link(prog).call(("RPUSH", write_key, EOS), ("PEXPIRE", write_key, prog.ttl_ms))
    except (StateStoreError, OSError):
        if not util.is_exiting():
            raise


def _release_quietly(*args: Any) -> None:
    """The finalizer of a copy collected or left open at exit: never raises.

    At exit it releases now. Collected, it queues the release for the
    releasing thread (``_releasing``): the garbage collector runs finalizers in
    whichever thread allocates, which may be in the middle of its own call on
    its link or hold the lane reader's lock.
    """
    if util.is_exiting():
        _release_now(*args)
    else:
        _releasing.later(_release_now, args)


def _release_now(*args: Any) -> None:
    try:
        _release(*args)
    except Exception as exc:  # nobody to raise to; the keys expire with the program's TTL
        util.debug(f"nimbus: releasing a connection failed: {exc!r}")


def Pipe(duplex: bool = True, *, prog: Program | None = None) -> tuple[Connection, Connection]:
    """Two connected :class:`Connection` s; one-way (read end, write end) if not ``duplex``."""
    prog = prog if prog is not None else _state.shared_program()  # (imports its clients)
    keys: Keys = prog.keys
    name = Keys.new_name()
    list0, list1 = keys.pipe(name, 0), keys.pipe(name, 1)
    refs0, refs1 = keys.pipe_refs(name, 0), keys.pipe_refs(name, 1)
    ttl = prog.ttl_ms
    link(prog).call(
        ("SET", refs0, 1, "PX", ttl),
        ("SET", refs1, 1, "PX", ttl),
    )
    lane0, lane1 = _direct.lanes(keys, name)
    if duplex:
        return (
            Connection(prog, list0, list1, refs0, (lane0, lane1)),
            Connection(prog, list1, list0, refs1, (lane1, lane0)),
        )
    return (
        Connection(prog, list0, None, refs0, (lane0, None)),
        Connection(prog, None, list0, refs1, (None, lane0)),
    )


# ---------------------------------------------------------------- wait


def wait(object_list: Iterable[Any], timeout: float | None = None) -> list[Any]:
    """The objects of ``object_list`` ready to read, waiting up to ``timeout`` seconds.

    Takes nimbus :class:`Connection` s, and anything the stdlib's ``wait``
    takes (file descriptors, objects with ``fileno()``, stdlib connections,
    sockets, process sentinels); see ``nimbus.multiprocessing._wait``.
    """
    return _wait.wait(object_list, timeout, Connection)
