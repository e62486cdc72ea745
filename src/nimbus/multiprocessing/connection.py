"""Pipes between processes, with the API of ``multiprocessing.connection``.

::

    end 0                          state store                          end 1
    send(obj) --RPUSH------------> pipe:<name>:1 ----BLPOP (+LPOP n)--> recv()
    recv()  <--BLPOP (+LPOP n)---- pipe:<name>:0 <-----------RPUSH----- send(obj)
        |                                                                  |
        +-- local buffer of prefetched messages      close(): last copy ---+
                                                     pushes end-of-stream

    once both ends of a direction are live instances with one copy each (_direct):
    send(obj) --nimbus.messaging, a socket (tag: the direction)-------> recv()

Each direction of a :func:`Pipe` is a Redis list named by the end that reads
it. Every list element is one message: ``b"B"`` + the bytes, or ``b"E"``, the
end-of-stream marker (or a marker of the switch below; ``_payload`` draws them
all). A send writes its RPUSH (and the PEXPIRE that renews the list's TTL)
asking the store for no reply, so a send costs one ``write``; a receive with
nothing in hand blocks in one BLPOP, or, in a tight loop, takes up to 63 more
waiting messages with a pipelined ``LPOP key count``, keeping them in a
local buffer that :meth:`Connection.poll`, :meth:`Connection.recv` and
:func:`wait` see. On close (explicit, at garbage collection or at process exit)
prefetched messages are pushed back to the head of the list.

A direction *switches* to direct messaging (``nimbus.multiprocessing._direct``)
when its reading end and its writing end each have one copy, in processes of
the program that are instances: the reader claims the direction when it starts
reading, the writer finds the claim within 20 ms of sending and puts a switch
marker in the list, and from there sends straight to the reader's socket; the
reader reads the list up to the marker, then the writer's direct messages, so
every message arrives once and in order. Pickling either end (a second copy),
closing it, or the peer's death goes back to the store the same way, in band.
``NIMBUS_MESSAGING_DIRECT=0`` keeps every message in the store.

An end may be pickled to other processes, like a file descriptor inherited by a
child: each copy holds a reference (taken when it is pickled), and when the
last copy of an end is closed an end-of-stream marker is pushed to the list the
peer reads (or sent directly), so the peer's ``recv`` raises :class:`EOFError`
once it has read everything before it; so does a direct reader whose only
writer died. A send to an end whose copies are all closed is dropped
(the stdlib raises ``BrokenPipeError``). :meth:`Connection.fileno` raises
:class:`OSError`: there is no file descriptor; use :func:`wait` instead of
``select``.

``Listener``, ``Client``, ``answer_challenge``, ``deliver_challenge``,
``BufferTooShort`` and ``AuthenticationError`` are the stdlib's own: they are
real sockets, which work between the processes of one host.
"""

from __future__ import annotations

import collections
import io
import pickle
import time
from collections.abc import Iterable
from multiprocessing import AuthenticationError, BufferTooShort, util
from multiprocessing.connection import (  # type: ignore[attr-defined]  # noqa: F401
    CHALLENGE,
    Client,
    Listener,
    address_type,
    answer_challenge,
    arbitrary_address,
    default_family,
    deliver_challenge,
    families,
)
from types import TracebackType
from typing import Any

from nimbus import serialization
from nimbus.errors import StateStoreError
from nimbus.keys import Keys
from nimbus.multiprocessing import _direct, _state, _wait
from nimbus.multiprocessing._direct import Lane
from nimbus.multiprocessing._link import link
from nimbus.multiprocessing._link import pack as pack_command
from nimbus.multiprocessing._payload import (
    EOS,
    MARK,
    MESSAGE,
    SWITCH,
    as_message,
    frame,
    load,
)
from nimbus.multiprocessing._state import Program, program
from nimbus.multiprocessing._wait import seconds
from nimbus.statestore import Script

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

# Decrement the references of an end; at zero push end-of-stream to the list it writes.
_RELEASE = Script("""
local n = redis.call('DECR', KEYS[1])
if n <= 0 then
  redis.call('DEL', KEYS[1])
  if ARGV[1] == '1' then
    redis.call('RPUSH', KEYS[2], 'E')
    redis.call('PEXPIRE', KEYS[2], ARGV[2])
  end
end
return n
""")


# ---------------------------------------------------------------- Connection


class Connection:
    """One end of a :func:`Pipe`, or a reader or writer of a shared list.

    ``refs`` is the key counting the copies of this end (None for the ends of
    a queue, which never signal end-of-stream); ``lanes`` are the directions
    of a pipe it reads and writes, which may go direct (see ``_direct``).
    """

    def __init__(
        self,
        prog: Program,
        read_key: str | None,
        write_key: str | None,
        refs: str | None = None,
        lanes: tuple[Lane | None, Lane | None] | None = None,
    ) -> None:
        self._program = prog
        self._read_key = read_key
        self._write_key = write_key
        self._refs = refs
        self._lanes = lanes
        self._new_direct()
        self._buffer: collections.deque[bytes] = collections.deque()
        self._eof = False
        self._closed = False
        self._batch = 1
        self._prefetch = PREFETCH
        self._ttl_ms = prog.ttl_ms
        self._wait_forever: bytes | None = None  # BLPOP of the list, packed once
        self._misses = 0
        self._last = 0.0
        self._finalize()
        # a process's bootstrap clears the finalizers (ours were made while its
        # process object was unpickled) and then runs the after-fork hooks
        util.register_after_fork(self, Connection._finalize)

    def _new_direct(self) -> None:
        """The direct sides of the lanes this end reads and writes (fresh: store mode)."""
        read_lane, write_lane = self._lanes or (None, None)
        self._reader = _direct.Reader(self._program, read_lane) if read_lane else None
        self._writer = _direct.Writer(self._program, write_lane) if write_lane else None

    def _finalize(self) -> None:
        """(Re)register what happens at close or exit: prefetched items go back, refs drop."""
        previous = getattr(self, "_finalizer", None)
        if previous is not None:
            previous.cancel()  # registered again after a fork: one release, not two
            self._new_direct()  # the parent's claims and switches stay the parent's
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
        )

    # -- properties

    @property
    def closed(self) -> bool:
        """True if the connection is closed."""
        return self._closed

    @property
    def readable(self) -> bool:
        """True if the connection is readable."""
        return self._read_key is not None

    @property
    def writable(self) -> bool:
        """True if the connection is writable."""
        return self._write_key is not None

    def fileno(self) -> int:
        """There is no file descriptor: raises :class:`OSError` (use :func:`wait`)."""
        self._check_closed()
        raise OSError("a nimbus Connection has no file descriptor; use nimbus wait()")

    def _check_closed(self) -> None:
        if self._closed:
            raise OSError("handle is closed")

    def _check_readable(self) -> None:
        if self._read_key is None:
            raise OSError("connection is write-only")

    def _check_writable(self) -> None:
        if self._write_key is None:
            raise OSError("connection is read-only")

    # -- sending

    def _send_message(self, message: bytes) -> None:
        writer = self._writer
        if writer is not None and writer.send(message):
            return
        self._push(message)

    def _push(self, message: bytes) -> None:
        key = self._write_key
        assert key is not None
        link(self._program).push(key, message, self._ttl_ms)

    def send_bytes(self, buf: Any, offset: int = 0, size: int | None = None) -> None:
        """Send the bytes of a bytes-like object (``buf[offset:offset + size]``)."""
        self._check_closed()
        self._check_writable()
        m = memoryview(buf)
        if m.itemsize > 1:
            m = m.cast("B")
        n = m.nbytes
        if offset < 0:
            raise ValueError("offset is negative")
        if n < offset:
            raise ValueError("buffer length < offset")
        if size is None:
            size = n - offset
        elif size < 0:
            raise ValueError("size is negative")
        elif offset + size > n:
            raise ValueError("buffer length < offset + size")
        self._send_message(MESSAGE + m[offset : offset + size])

    def send(self, obj: object) -> None:
        """Send a picklable object."""
        if self._closed or self._write_key is None:
            self._check_closed()
            self._check_writable()
        if type(obj) in _PLAIN and len(obj) < _SMALL:  # type: ignore[arg-type]
            # the common small case, inline (a round trip costs each call here)
            message = MESSAGE + pickle.dumps(obj, serialization.PROTOCOL)
            writer = self._writer
            if writer is None or not writer.send(message):
                self._push(message)
            return
        data, buffers = _state.dumps(obj)
        if not buffers:
            self._send_message(MESSAGE + data)
            return
        writer = self._writer  # directly, the buffers travel as they are (no framing copy)
        if writer is None or not writer.send((data, *buffers)):
            self._push(frame(MESSAGE, data, buffers))

    # -- receiving

    def _ready(self) -> bool:
        if self._eof:
            return True
        reader = self._reader
        if reader is None:
            return bool(self._buffer)
        buffer = self._buffer
        while True:
            if reader.ready:
                return True
            if reader.source is not None:  # after a switch: the writer's direct messages
                if reader.fill(0, buffer):
                    return True
                if reader.source is not None:
                    return False
                continue  # the writer reverted: the list again
            if not buffer:
                return False
            kind = buffer[0][:1]
            if kind == SWITCH:
                reader.marker(buffer.popleft())
            elif kind == MARK:
                buffer.popleft()
            else:
                return True

    def _more(self) -> int:
        """How many more messages than one to take from the store now (LPOP after
        the BLPOP): none, unless the reader is in a tight loop and prefetching pays
        (a reader whose prefetches keep finding nothing, a ping-pong, tries every 32nd)."""
        now = time.monotonic()
        self._batch = min(self._prefetch, self._batch * 2) if now - self._last < _TIGHT_LOOP else 1
        if self._batch > 1 and (self._misses < 4 or self._misses % 32 == 0):
            return self._batch - 1
        return 0

    def _fill(self, wait: float | str, more: int) -> None:
        """BLPOP waiting ``wait`` seconds (0: forever) and LPOP of ``more`` (if any),
        in one round trip; what came goes to the buffer."""
        commands: list[tuple[Any, ...]] = [("BLPOP", self._read_key, wait)]
        if more:
            commands.append(("LPOP", self._read_key, more))
        replies = link(self._program).call(*commands)
        self._take(replies[0], replies[1] if more else None)

    def _pop(self) -> bytes | None:
        """The store's next message for an end with nothing in hand, waiting for it:
        one BLPOP packed once (the common wait, lean). None: the reader prefetches
        now (the message and more went to the buffer)."""
        reader = self._reader
        if reader is not None and reader.claim is None:
            reader.try_claim()
        more = self._more()
        if more:
            self._fill(0, more)
            return None
        packed = self._wait_forever
        if packed is None:
            packed = self._wait_forever = pack_command("BLPOP", self._read_key, 0)
        popped = link(self._program).request(packed)
        self._misses += 1
        return popped[1]  # type: ignore[no-any-return]

    def _take(self, popped: Any, more: Any) -> None:
        """Put what a fill returned into the local buffer."""
        if popped is not None:
            self._buffer.append(popped[1])
        if more:
            self._buffer.extend(more)
            self._misses = 0
        else:
            self._misses += 1

    def _poll(self, timeout: float | None, *, looked: bool = False) -> bool:
        """Whether there is anything to read, waiting up to ``timeout``; ``looked``:
        the caller has just found :meth:`_ready` False. A marker taken from the list
        (a switch) is not something to read: the wait goes on to ``timeout``."""
        if not looked and self._ready():
            return True
        if timeout is None or timeout <= 0:
            return self._poll_once(timeout)
        deadline = time.monotonic() + timeout
        while not self._poll_once(timeout):
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                return False
        return True

    def _poll_once(self, timeout: float | None) -> bool:
        reader = self._reader
        if reader is not None:
            if reader.claim is None:
                reader.try_claim()
            if reader.source is not None:
                start = time.monotonic()
                if reader.fill(timeout, self._buffer) or reader.source is not None:
                    return self._ready()
                if self._ready():  # the writer reverted: wait in the list for the rest
                    return True
                if timeout is not None:
                    timeout = max(0.0, timeout - (time.monotonic() - start))
        if timeout is not None and timeout <= 0:
            replies = link(self._program).call(("LPOP", self._read_key, self._batch))
            self._take(None, replies[0])
            return self._ready()
        if timeout is None:
            item = self._pop()
            if item is not None:
                self._buffer.append(item)
            return self._ready()
        self._fill(seconds(timeout), self._more())
        return self._ready()

    def _recv_message(self) -> bytes:
        return as_message(self._recv_item())

    def _recv_item(self) -> bytes | tuple[Any, ...]:
        reader = self._reader
        if reader is not None and reader.source is not None and not reader.ready:
            reader.fill(
                None, self._buffer
            )  # the direct path: straight to the writer's next message
        if not self._ready():
            while not self._poll(None, looked=True):
                pass
        self._last = time.monotonic()
        if self._eof:
            raise EOFError
        if reader is not None and reader.ready:
            message = reader.ready.popleft()
            if message == EOS:  # this end has no other copy: nothing to leave behind
                self._eof = True
                raise EOFError
            return message
        message = self._buffer.popleft()
        if message[:1] == EOS:
            self._eof = True
            self._buffer.appendleft(message)  # left for the other copies of this end
            self._push_back()
            raise EOFError
        return message

    def _push_back(self) -> None:
        if self._buffer:
            _push_back(self._program, self._read_key, self._buffer)

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        """Receive one message as bytes; :class:`EOFError` at end of stream."""
        self._check_closed()
        self._check_readable()
        if maxlength is not None and maxlength < 0:
            raise ValueError("negative maxlength")
        message = self._recv_message()
        if maxlength is not None and len(message) - 1 > maxlength:
            self.close()
            raise OSError("bad message length")
        return message[1:]

    def recv_bytes_into(self, buf: Any, offset: int = 0) -> int:
        """Receive one message into a writable buffer; returns its size."""
        self._check_closed()
        self._check_readable()
        with memoryview(buf) as m:
            itemsize = m.itemsize
            bytesize = itemsize * len(m)
            if offset < 0:
                raise ValueError("negative offset")
            elif offset > bytesize:
                raise ValueError("offset too large")
            message = self._recv_message()
            size = len(message) - 1
            if bytesize < offset + size:
                raise BufferTooShort(message[1:])
            result = io.BytesIO(memoryview(message)[1:])
            result.readinto(m[offset // itemsize : (offset + size) // itemsize])
            return size

    def recv(self) -> Any:
        """Receive a picklable object."""
        if self._closed or self._read_key is None:
            self._check_closed()
            self._check_readable()
        reader = self._reader
        if reader is not None and reader.source is not None and not self._eof:
            # the direct path's common case: the writer's next message, no detour
            item = reader.take(self._buffer)
            if item is not None:
                if isinstance(item, bytes):
                    if item == EOS:  # this end has no other copy: nothing to leave behind
                        self._eof = True
                        raise EOFError
                    return load(item)
                return serialization.loads(item[0], item[1:])  # sent unframed
        elif not self._buffer and not self._eof and (reader is None or not reader.ready):
            # the store path's common case: nothing in hand, wait for the next message
            item = self._pop()
            if item is not None:
                if item[:1] == MESSAGE:
                    self._last = time.monotonic()
                    return load(item)
                self._buffer.append(item)  # a marker or end-of-stream: the general path
        message = self._recv_item()
        if isinstance(message, bytes):
            return load(message)
        return serialization.loads(message[0], message[1:])  # sent directly, unframed

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether there is anything to read; waits up to ``timeout`` (None: forever)."""
        self._check_closed()
        self._check_readable()
        return self._poll(timeout)

    # -- closing and pickling

    def close(self) -> None:
        """Close this copy of the end (the last copy signals end-of-stream)."""
        if not self._closed:
            self._closed = True
            self._finalizer.cancel()
            _release(*self._release_args())

    def __enter__(self) -> Connection:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        self._check_closed()
        # another copy may read or write: this one stops going direct first
        if self._reader is not None and self._reader.claim is not None:
            self._push_back()
            self._reader.give_up()
        if self._writer is not None:
            self._writer.revert()
        if self._refs is not None:  # the copy's reference is taken now, not when unpickled
            link(self._program).call(
                ("INCR", self._refs), ("PEXPIRE", self._refs, self._program.ttl_ms)
            )
        args = (self._program, self._read_key, self._write_key, self._refs, self._lanes)
        return (Connection, args)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
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
    reader: _direct.Reader | None = None,
    writer: _direct.Writer | None = None,
) -> None:
    """Give back prefetched messages and this copy's reference (quietly at exit)."""
    try:
        if buffer:
            _push_back(prog, read_key, buffer)
        if reader is not None:
            reader.drop()
        if refs is not None:
            # a direct writer (the only copy of its end) sent end-of-stream itself
            direct_eos = writer is not None and writer.close()
            eos = "1" if write_key is not None and not direct_eos else "0"
            link(prog).eval(_RELEASE, (refs, write_key or refs), (eos, prog.ttl_ms))
    except (StateStoreError, OSError):
        if not util.is_exiting():
            raise


def _release_quietly(*args: Any) -> None:
    """:func:`_release` for a connection collected or left open at exit: never raises."""
    try:
        _release(*args)
    except Exception as exc:  # nobody to raise to; the keys expire with the program's TTL
        util.debug(f"nimbus: releasing a connection failed: {exc!r}")


def Pipe(duplex: bool = True, *, prog: Program | None = None) -> tuple[Connection, Connection]:
    """Two connected :class:`Connection` s; one-way (read end, write end) if not ``duplex``."""
    prog = prog if prog is not None else program()
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
