"""The message channel between two instances: frame kinds and a fast path for small frames.

::

    MSG [seq, tag] + pickle + out-of-band buffers     one message
    PICKLE seq tag + pickle                           one small pickle, no buffers
    RAW seq tag + bytes                               one small ``bytes``, sent as it is
    BATCH [first seq, tag, [lengths], raw] + data     many small messages back to back
    BYE [next seq]                                    the sender exited cleanly
    HELLO / WELCOME / REFUSED                         the handshake (``_peer``)

:class:`Stream` is a :class:`nimbus.wire.Channel` whose small one-buffer frames
skip the general state machine: queued ones are copied into one buffer (one
``send`` for all of them), received ones are cut out of the scratch buffer in
one pass after a single read.

The metadata of a PICKLE or RAW frame (the small messages, one buffer) is not
a msgpack array: it is the message's number (u64) then its tag packed with
msgpack, and both ends keep the packed tags they have seen. Sending or
receiving one small message runs no msgpack code, only the ``struct`` of its
header, which carries the number.
"""

from __future__ import annotations

import _socket
import ctypes
import socket
import struct
import sys
from collections.abc import Sequence
from typing import Any

from nimbus import telemetry
from nimbus.wire import (
    HEADER,
    MAGIC,
    SCRATCH,
    VERSION,
    Buffer,
    Channel,
    Frame,
    unpack,
)

__all__ = [
    "BATCH",
    "BYE",
    "HELLO",
    "MESSAGES",
    "MSG",
    "PICKLE",
    "RAW",
    "REFUSED",
    "WELCOME",
    "Message",
    "Stream",
    "readonly_mask",
    "writable_as_sent",
]

HELLO, WELCOME, REFUSED, MSG, BYE, BATCH, RAW, PICKLE = 16, 17, 18, 19, 20, 21, 22, 23
_SMALL = struct.Struct("<2sBBIIQ")  # the header of a frame with one buffer, and its length
_SMALL_SIZE = _SMALL.size
# ... and of a small message (PICKLE, RAW): then its number, the start of its metadata
_MESSAGE = struct.Struct("<2sBBIIQQ")
_MESSAGE_SIZE = _MESSAGE.size
SEQ = struct.Struct("<Q")  # the number at the start of a small message's metadata
MESSAGES = frozenset((PICKLE, RAW))  # the small messages' frames
# ... read with their first 8 bytes (magic, version, kind, one buffer) as one number,
# which names the kind at once
_MESSAGE_HEAD = struct.Struct("<QIQQ")
_MESSAGE_KINDS = {
    int.from_bytes(struct.pack("<2sBBI", MAGIC, VERSION, kind, 1), "little"): kind
    for kind in MESSAGES
}
# a small message as read (``Stream.receive_message``): kind, number, packed tag, data
Message = tuple[int, int, bytes, bytes]

# The socket methods themselves: a worker wraps ``socket.socket``'s to count a task's
# bytes (``nimbus.telemetry``), which costs microseconds per call; the small-message
# paths call these and count into the same totals.
_raw_send = _socket.socket.send
_raw_recv_into = _socket.socket.recv_into
_raw_recv = _socket.socket.recv
_FIRST_READ = 16 * 1024  # most bytes of a reader's first read (``Stream.receive_message``)
_FIRST_READ_MIN = 512  # its least: a read's buffer this small comes from Python's allocator
_DONTWAIT = socket.MSG_DONTWAIT
_COUNTS = telemetry.COUNTS

_new = tuple.__new__  # _new(Frame, fields): Frame(*fields) without a Python call
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_BYTES_DATA = sys.getsizeof(b"") - 1  # offset of a bytes object's data (CPython)


def _fresh_bytes(size: int) -> tuple[bytes, memoryview]:
    """A new, not yet shared ``bytes`` of ``size`` bytes and a writable view of its data.

    Like CPython's own readers (``os.read``), the object is filled before
    anyone else sees it; its hash is computed only later, on first use.
    """
    data: bytes = _new_bytes(None, size)
    raw = (ctypes.c_char * size).from_address(id(data) + _BYTES_DATA)
    return data, memoryview(raw).cast("B")


def readonly_mask(buffers: list[Any]) -> int:
    """Bit ``i`` set: out-of-band buffer ``i`` (1-based; 0 is the pickle) is read-only.

    The receiver rebuilds read-only buffers as ``bytes`` and the others as
    ``bytearray``, so an array arrives writable exactly when it was sent so.
    """
    mask = 0
    for i, buf in enumerate(buffers, 1):
        if buf.readonly:
            mask |= 1 << i
    return mask


def writable_as_sent(buffers: list[Any], mask: int) -> list[Any]:
    """``buffers[1:]`` of a received frame, writable where the sender's were."""
    return [
        b if mask >> i & 1 or type(b) is not bytes else bytearray(b)
        for i, b in enumerate(buffers[1:], 1)
    ]


class Stream(Channel):
    """A :class:`~nimbus.wire.Channel` with a fast path for small one-buffer frames.

    Small messages are the common case and the wire format's general state
    machine costs several microseconds per frame in Python: a frame with one
    buffer that is complete in the scratch buffer is cut out in one step, and
    one to send is built as a single ``bytes`` and queued (coalesced with the
    other queued frames into one ``sendmsg``). Everything else takes the
    general path.
    """

    def __init__(self, sock: Any) -> None:
        super().__init__(sock)
        self._tail = bytearray()  # small frames queued after ``_out``, one buffer
        # bytes of the first read of ``receive_message``: doubled (to _FIRST_READ) each
        # time a read fills it, so small messages never cost a large buffer and its shrink
        self._first_read = _FIRST_READ_MIN

    def _seal(self) -> None:
        """Move the small frames queued in ``_tail`` to the end of ``_out``."""
        self._out.append(memoryview(self._tail))
        self._tail = bytearray()

    def send(self, kind: int, meta: bytes, buffers: Sequence[Buffer] = ()) -> None:
        if self._tail:
            self._seal()
        super().send(kind, meta, buffers)

    def flush(self) -> bool:
        """As :meth:`Channel.flush`, with a short path for one queued buffer."""
        if self._tail:
            self._seal()
        out = self._out
        if len(out) == 1:
            first = out[0]
            try:
                sent = _raw_send(self.sock, first)
            except (BlockingIOError, InterruptedError):
                return False
            _COUNTS[1] += sent
            self._out_bytes -= sent
            self.bytes_out += sent
            if sent == first.nbytes:
                out.popleft()
                return True
            out[0] = first[sent:]
        return super().flush()

    def send_message(self, kind: int, seq: int, tag: bytes, data: bytes) -> bool:
        """Queue a small message (PICKLE or RAW: number ``seq``, packed ``tag``) and
        write what the socket takes now.

        True when everything queued is written. Nothing queued before it (the
        common case): one ``send`` of the frame, no queue.
        """
        if self._out or self._tail:
            self.queue_message(kind, seq, tag, data)
            return self.flush()
        frame = _MESSAGE.pack(MAGIC, VERSION, kind, 1, 8 + len(tag), len(data), seq) + tag + data
        try:
            sent = _raw_send(self.sock, frame)
        except (BlockingIOError, InterruptedError):
            sent = 0
        _COUNTS[1] += sent
        self.bytes_out += sent
        if sent == len(frame):
            return True
        self._out.append(memoryview(frame)[sent:])
        self._out_bytes += len(frame) - sent
        return False

    def queue_message(self, kind: int, seq: int, tag: bytes, data: bytes) -> None:
        """Queue a small message (PICKLE or RAW), written by the next :meth:`flush`."""
        tail = self._tail
        tail += _MESSAGE.pack(MAGIC, VERSION, kind, 1, 8 + len(tag), len(data), seq)
        tail += tag
        tail += data
        self._out_bytes += _MESSAGE_SIZE + len(tag) + len(data)

    def queue_small(self, kind: int, meta: bytes, data: bytes) -> None:
        """Queue a frame with one small buffer, written by the next :meth:`flush`
        (small frames in a row are copied into one buffer: one ``send`` for all)."""
        tail = self._tail
        tail += _SMALL.pack(MAGIC, VERSION, kind, 1, len(meta), len(data))
        tail += meta
        tail += data
        self._out_bytes += _SMALL.size + len(meta) + len(data)

    @property
    def mid_frame(self) -> bool:
        """Whether part of a frame was read and the rest is still to come."""
        return self._kind >= 0 or self._big is not None or self._start != self._end

    def receive_message(self, flags: int = _DONTWAIT) -> Message | list[Frame] | None:
        """As :meth:`receive`; but a read that is exactly one small message (the
        commonest case of all) comes back as ``(kind, seq, packed tag, data)``,
        with no frame made: read as one ``bytes`` and cut with two slices.

        ``flags`` 0: the first read waits for input as the socket says
        (``_peer.wait_in_reads``); [] when none came.
        """
        if self._kind >= 0 or self._big is not None or self._start != self._end:
            return self.receive()
        size = self._first_read
        try:
            read = _raw_recv(self.sock, size, flags)
        except (BlockingIOError, InterruptedError):
            return []
        n = len(read)
        if n >= _MESSAGE_SIZE:
            head, meta_len, length, seq = _MESSAGE_HEAD.unpack_from(read)
            kind = _MESSAGE_KINDS.get(head)
            d0 = _SMALL_SIZE + meta_len
            if kind is not None and d0 + length == n:
                _COUNTS[0] += n
                self.bytes_in += n
                return kind, seq, read[_MESSAGE_SIZE:d0], read[d0:]
        elif n == 0:
            return None
        _COUNTS[0] += n
        self.bytes_in += n
        # anything else: into the scratch buffer, read on from there if it was full
        self._start = 0
        self._scratch[:n] = read
        if n == size and size < _FIRST_READ:
            self._first_read = size * 2
        return self._frames(0, n, size if n == size else len(self._scratch))

    def receive(self, block: bool = False) -> list[Frame] | None:
        """As :meth:`Channel.receive`. Between frames (the common case): one read
        into the scratch buffer and the frames it completes, cut out in one pass
        (another read only when that one filled the buffer)."""
        if block or self._kind >= 0 or self._big is not None:
            return super().receive(block)
        end = self._end
        if self._start == end:
            self._start = self._end = end = 0
        elif end == len(self._scratch):
            self._compact_to(0)
            end = self._end
        room = len(self._scratch) - end
        try:
            n = _raw_recv_into(self.sock, self._view[end:], 0, _DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return []
        if n == 0:
            return None
        _COUNTS[0] += n
        self.bytes_in += n
        if end == 0 and _SMALL_SIZE <= n < room:
            # the commonest case of all: the read is exactly one small frame
            view = self._view
            magic, version, kind, nbufs, meta_len, size = _SMALL.unpack_from(view, 0)
            d0 = _SMALL_SIZE + meta_len
            if d0 + size == n and nbufs == 1 and magic == MAGIC and version == VERSION:
                return [_new(Frame, (kind, bytes(view[_SMALL_SIZE:d0]), [bytes(view[d0:n])]))]
        return self._frames(end, n, room)

    def _frames(self, end: int, n: int, room: int) -> list[Frame] | None:
        """The frames completed by ``n`` bytes just read at ``end`` of the scratch
        buffer (``room`` bytes were free there)."""
        self._end = end + n
        frames: list[Frame] = []
        self._parse(frames)
        if n == room:  # the buffer is full: more may be waiting
            more = super().receive()
            if more is None:
                return frames or None
            frames += more
        return frames

    def _recv_into(self, view: memoryview, flags: int) -> int:
        n = _raw_recv_into(self.sock, view, 0, flags)
        _COUNTS[0] += n
        return n

    def _allocate(self, size: int) -> tuple[Buffer, memoryview]:
        """A ``bytes`` the buffer is received into when the sender's was read-only.

        Such a buffer ends up as an immutable object (``bytes``, a read-only
        array): receiving straight into a new ``bytes`` saves zeroing a
        ``bytearray`` and copying it into ``bytes`` afterwards.
        """
        index = len(self._bufs)
        if self._kind == MSG and self._meta is not None:
            meta = unpack(self._meta)
            if len(meta) > 2 and meta[2] >> index & 1:
                return _fresh_bytes(size)
        return super()._allocate(size)

    def _parse(self, frames: list[Frame]) -> None:
        start, end, view = self._start, self._end, self._view
        while self._kind < 0 and self._big is None:
            avail = end - start
            if avail < _SMALL.size:
                if avail < HEADER.size:
                    break
                magic, version, kind, nbufs, meta_len = HEADER.unpack_from(view, start)
                if nbufs != 1 or magic != MAGIC or version != VERSION:
                    break  # no buffer or several: the general path
                self._start = start
                self._ensure(_SMALL.size)
                return
            magic, version, kind, nbufs, meta_len, n = _SMALL.unpack_from(view, start)
            if nbufs != 1 or magic != MAGIC or version != VERSION:
                break  # no buffer or several: the general path
            m0 = start + _SMALL.size
            d0 = m0 + meta_len
            stop = d0 + n
            if stop > end:
                if stop - start > SCRATCH // 4:
                    break  # a large buffer: received straight into its own bytearray
                self._start = start
                self._ensure(stop - start)
                return
            frames.append(_new(Frame, (kind, bytes(view[m0:d0]), [bytes(view[d0:stop])])))
            start = stop
        self._start = start
        if start != end or self._kind >= 0 or self._big is not None:
            super()._parse(frames)
