"""Frames over stream sockets: a fixed header, msgpack metadata, raw buffers.

::

    +--------+-----+------+-------+----------+--------------------+------+----------+
    | "NB"   | ver | kind | nbufs | meta_len | nbufs x u64 length | meta | buffers  |
    | 2 B    | 1 B | 1 B  | u32   | u32      |                    |      | raw      |
    +--------+-----+------+-------+----------+--------------------+------+----------+

A :class:`Channel` writes a frame with one scatter-gather ``sendmsg`` (large
buffers are never copied into a message) and reads frames through a scratch
buffer; a buffer larger than the scratch is received straight into its own
preallocated ``bytearray``. The channel works on blocking and non-blocking
sockets: ``send`` queues and ``flush`` writes what the socket takes,
``receive`` returns the frames that are complete.
"""

from __future__ import annotations

import socket
import struct
from collections import deque
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

import msgpack

from nimbus.errors import NimbusError

__all__ = ["Channel", "Frame", "ProtocolError", "pack", "unpack"]

MAGIC = b"NB"
VERSION = 1
HEADER = struct.Struct("<2sBBII")
SCRATCH = 256 * 1024
MAX_IOV = 512
Buffer = bytes | bytearray | memoryview


class ProtocolError(NimbusError):
    """The peer sent bytes that are not a nimbus frame of this version."""


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def unpack(data: Buffer) -> Any:
    return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False)


class Frame(tuple):
    """One received message: its kind, its metadata and its raw buffers.

    A tuple, so that a reader that makes one per small message can make it in
    C, ``tuple.__new__(Frame, (kind, meta, buffers))``, with no Python call;
    its fields are read through C-level getters.
    """

    __slots__ = ()
    kind: int = property(itemgetter(0))  # type: ignore[assignment]
    meta: bytes = property(itemgetter(1))  # type: ignore[assignment]
    buffers: list[Buffer] = property(itemgetter(2))  # type: ignore[assignment]

    def __new__(cls, kind: int, meta: bytes, buffers: list[Buffer]) -> Frame:
        return tuple.__new__(cls, (kind, meta, buffers))


class Channel:
    """Framed messages over one connected stream socket."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self._out: deque[memoryview] = deque()
        self._out_bytes = 0
        self._scratch = bytearray(SCRATCH)
        self._view = memoryview(self._scratch)
        self._start = 0
        self._end = 0
        # the frame being assembled
        self._kind = -1
        self._nbufs = 0
        self._meta_len = 0
        self._lengths: tuple[int, ...] | None = None
        self._meta: bytes | None = None
        self._bufs: list[Buffer] = []
        self._big: Buffer | None = None
        self._big_view: memoryview | None = None  # where the large buffer is written
        self._big_filled = 0
        self.bytes_in = 0
        self.bytes_out = 0

    # -- sending ---------------------------------------------------------
    def send(self, kind: int, meta: bytes, buffers: Sequence[Buffer] = ()) -> None:
        """Queue one frame; call :meth:`flush` to write it."""
        lengths = [memoryview(b).nbytes for b in buffers]
        head = HEADER.pack(MAGIC, VERSION, kind, len(lengths), len(meta))
        if lengths:
            head += struct.pack(f"<{len(lengths)}Q", *lengths)
        out = self._out
        out.append(memoryview(head + meta))
        total = len(head) + len(meta)
        for buf, n in zip(buffers, lengths, strict=True):
            if n:
                out.append(memoryview(buf).cast("B"))
                total += n
        self._out_bytes += total

    @property
    def pending_output(self) -> int:
        """Bytes queued but not yet written."""
        return self._out_bytes

    def flush(self) -> bool:
        """Write as much as the socket takes; True when everything is written.

        On a blocking socket this returns only when all is written.
        """
        out = self._out
        while out:
            chunk = [out[i] for i in range(min(len(out), MAX_IOV))]
            try:
                sent = self.sock.sendmsg(chunk)
            except (BlockingIOError, InterruptedError):
                return False
            self._out_bytes -= sent
            self.bytes_out += sent
            while sent:
                first = out[0]
                if sent >= first.nbytes:
                    sent -= first.nbytes
                    out.popleft()
                else:
                    out[0] = first[sent:]
                    sent = 0
        return True

    # -- receiving -------------------------------------------------------
    def receive(self, block: bool = False) -> list[Frame] | None:
        """Frames completed by what the socket has now; ``None`` at end of stream.

        With ``block`` it waits for at least some bytes first.
        """
        frames: list[Frame] = []
        flags = 0 if block else socket.MSG_DONTWAIT
        while True:
            self._parse(frames)
            if frames:
                flags = socket.MSG_DONTWAIT
            try:
                if self._big_view is not None:
                    view = self._big_view[self._big_filled :]
                    room = view.nbytes
                    n = self._recv_into(view, flags)
                    self._big_filled += n
                else:
                    if self._start == self._end:
                        self._start = self._end = 0
                    elif self._end == len(self._scratch):
                        self._compact_to(0)
                    room = len(self._scratch) - self._end
                    n = self._recv_into(self._view[self._end :], flags)
                    self._end += n
            except (BlockingIOError, InterruptedError):
                return frames
            except OSError:
                # a peer that died with bytes unread resets the stream: what it sent
                # before comes first (the next read finds the end: None)
                if frames:
                    return frames
                raise
            if n == 0:
                return frames or None
            self.bytes_in += n
            flags = socket.MSG_DONTWAIT
            if n < room:  # a read that leaves room drained the socket: no read just for EAGAIN
                self._parse(frames)
                return frames

    def _recv_into(self, view: memoryview, flags: int) -> int:
        """One read from the socket into ``view`` (a subclass may count it)."""
        n: int = self.sock.recv_into(view, 0, flags)
        return n

    def _parse(self, frames: list[Frame]) -> None:
        view = self._view
        while True:
            if self._big is not None and self._big_view is not None:
                if self._big_filled < self._big_view.nbytes:
                    return
                self._bufs.append(self._big)
                self._big = self._big_view = None
            avail = self._end - self._start
            if self._kind < 0:
                if avail < HEADER.size:
                    return
                magic, version, kind, nbufs, meta_len = HEADER.unpack_from(view, self._start)
                if magic != MAGIC or version != VERSION:
                    raise ProtocolError(
                        f"not a nimbus v{VERSION} frame (got {bytes(view[self._start : self._start + 4])!r})"
                    )
                self._start += HEADER.size
                self._kind, self._nbufs, self._meta_len = kind, nbufs, meta_len
                self._lengths = None if nbufs else ()
                self._meta = None
                continue
            if self._lengths is None:
                size = 8 * self._nbufs
                if avail < size:
                    self._ensure(size)
                    return
                self._lengths = struct.unpack_from(f"<{self._nbufs}Q", view, self._start)
                self._start += size
                continue
            if self._meta is None:
                if avail < self._meta_len:
                    self._ensure(self._meta_len)
                    return
                self._meta = bytes(view[self._start : self._start + self._meta_len])
                self._start += self._meta_len
                continue
            index = len(self._bufs)
            if index < self._nbufs:
                n = self._lengths[index]
                if avail >= n:
                    self._bufs.append(bytes(view[self._start : self._start + n]))
                    self._start += n
                    continue
                if n <= SCRATCH // 4:
                    self._ensure(n)
                    return
                big, writable = self._allocate(n)
                writable[:avail] = view[self._start : self._end]
                self._start = self._end = 0
                self._big, self._big_view, self._big_filled = big, writable, avail
                continue
            frames.append(Frame(self._kind, self._meta, self._bufs))
            self._kind = -1
            self._bufs = []

    def _allocate(self, size: int) -> tuple[Buffer, memoryview]:
        """A buffer for one large incoming buffer of the current frame, and a writable view."""
        big = bytearray(size)
        return big, memoryview(big)

    def _ensure(self, size: int) -> None:
        """Make room for ``size`` contiguous bytes from the read position."""
        if len(self._scratch) - self._start < size:
            self._compact_to(size)

    def _compact_to(self, size: int) -> None:
        live = self._end - self._start
        if size > len(self._scratch):
            grown = bytearray(size)
            grown[:live] = self._view[self._start : self._end]
            self._scratch = grown
            self._view = memoryview(grown)
        else:
            self._scratch[:live] = self._view[self._start : self._end]
        self._start, self._end = 0, live

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
