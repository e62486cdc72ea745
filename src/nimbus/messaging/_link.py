"""Connections between two instances: the handshake and the message frames.

::

    connecting instance                               listening instance
    connect() --HELLO [version, program, token, id]--> acceptor: check version,
              <--WELCOME [id] or REFUSED [reason]----  program and token (logged)
    MSG [seq, tag] + pickle + out-of-band buffers --->  mailbox (in order per sender)
    RAW [seq, tag] + bytes (a small bytes as it is) ->  mailbox
    BATCH [first seq, tag, [lengths], raw] + data -->  mailbox, one message per length
    BYE [next seq] (clean exit) -------------------->  the sender exited

Frames are ``nimbus.wire`` frames: a fixed header, msgpack metadata, then the
pickle and its pickle-5 buffers, written with one scatter-gather ``sendmsg``
and read into preallocated buffers. A link carries messages one way; two
instances that talk both ways hold two links.

Small messages sent in a burst wait in the link's ``pending`` queue, appended
to without a lock and without a sequence number; whoever writes the link
(holding its lock) numbers them and frames each run of one tag as a single
BATCH frame: its pickles back to back, their lengths in the metadata. The
receiver cuts a batch into messages in one pass, with no per-message frame.
Small ``bytes`` are sent as they are, not pickled (RAW, BATCH frames marked raw).
"""

from __future__ import annotations

import _socket
import collections
import ctypes
import hmac
import logging
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from itertools import groupby
from operator import itemgetter
from typing import Any

import msgpack

from nimbus import telemetry
from nimbus.errors import PeerLost, PeerRefused, PeerUnreachable
from nimbus.wire import (
    HEADER,
    MAGIC,
    SCRATCH,
    VERSION,
    Buffer,
    Channel,
    Frame,
    ProtocolError,
    pack,
    unpack,
)

__all__ = [
    "BATCH",
    "BYE",
    "HELLO",
    "MSG",
    "PROTOCOL",
    "RAW",
    "Link",
    "Stream",
    "accept",
    "connect",
]

log = logging.getLogger("nimbus.messaging")

PROTOCOL = 2
HELLO, WELCOME, REFUSED, MSG, BYE, BATCH, RAW = 16, 17, 18, 19, 20, 21, 22
HANDSHAKE_TIMEOUT = 5.0
CONNECT_TIMEOUT = 1.0  # a TCP peer that does not answer within this is unreachable (for now)
SOCKET_BUFFER = 4 * 1024 * 1024
SMALL_LIMIT = 64 * 1024  # a pickle this small is copied into its frame
BATCHED = 4096  # a pickle this small (and with no out-of-band buffers) may wait in ``pending``
BATCH_BYTES = 32 * 1024  # pickles in one BATCH frame (about: runs are cut by count)
_tag_raw = itemgetter(0, 2)
_data = itemgetter(1)
_SMALL = struct.Struct("<2sBBIIQ")  # the header of a frame with one buffer, and its length


# The socket methods themselves: a worker wraps ``socket.socket``'s to count a task's
# bytes (``nimbus.telemetry``), which costs microseconds per call; the small-message
# paths call these and count into the same totals.
_raw_send = _socket.socket.send
_raw_recv_into = _socket.socket.recv_into
_DONTWAIT = socket.MSG_DONTWAIT
_COUNTS = telemetry.COUNTS

_FORCE = {socket.SO_SNDBUF: 32, socket.SO_RCVBUF: 33}  # SO_SNDBUFFORCE, SO_RCVBUFFORCE


def _tune(sock: socket.socket) -> None:
    """Large socket buffers (fewer wake-ups for large messages), no Nagle on TCP."""
    for option, force in _FORCE.items():
        try:  # past the system's limit where allowed (CAP_NET_ADMIN), else up to it
            sock.setsockopt(socket.SOL_SOCKET, force, SOCKET_BUFFER)
        except OSError:
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
            except OSError:
                pass
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


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

    def send_small(self, kind: int, meta: bytes, data: bytes) -> bool:
        """Queue a frame with one small buffer and write what the socket takes now.

        True when everything queued is written. Nothing queued before it (the
        common case): one ``send`` of the frame, no queue.
        """
        if self._out or self._tail:
            self.queue_small(kind, meta, data)
            return self.flush()
        frame = _SMALL.pack(MAGIC, VERSION, kind, 1, len(meta), len(data)) + meta + data
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

    def queue_small(self, kind: int, meta: bytes, data: bytes) -> None:
        """Queue a frame with one small buffer, written by the next :meth:`flush`
        (small frames in a row are copied into one buffer: one ``send`` for all)."""
        tail = self._tail
        tail += _SMALL.pack(MAGIC, VERSION, kind, 1, len(meta), len(data))
        tail += meta
        tail += data
        self._out_bytes += _SMALL.size + len(meta) + len(data)

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
            frames.append(Frame(kind, bytes(view[m0:d0]), [bytes(view[d0:stop])]))
            start = stop
        self._start = start
        if start != end or self._kind >= 0 or self._big is not None:
            super()._parse(frames)


class Link:
    """One connected, handshaken socket to or from a peer instance."""

    __slots__ = (
        "armed",
        "channel",
        "closed_cleanly",
        "error",
        "lock",
        "packer",
        "peer",
        "pending",
        "queued",
        "recvs",
        "sock",
    )

    def __init__(self, sock: socket.socket, channel: Stream, peer: str) -> None:
        self.sock = sock
        self.channel = channel
        self.peer = peer
        self.lock = threading.Lock()
        self.closed_cleanly = False
        self.error: BaseException | None = None  # a deferred flush failed
        self.recvs = -1  # the endpoint's receive count at this link's last send
        self.packer = msgpack.Packer(use_bin_type=True)  # used under ``lock``
        # small messages (tag, data, raw) not yet numbered nor framed: appended without
        # the lock (a deque's append is atomic), taken by :meth:`frame_pending`
        self.pending: collections.deque[tuple[Any, bytes, bool]] = collections.deque()
        self.queued = 0  # bytes in ``pending``: added to without a lock, so approximate
        self.armed = False  # the endpoint's flusher will frame and write ``pending``

    def queue(self, seq: int, tag: Any, data: bytes, buffers: list[Any], raw: bool) -> None:
        """Queue one message; the caller flushes (now, or later with others).

        ``raw``: ``data`` is a small ``bytes`` sent as it is, not a pickle.
        """
        if raw:
            self.channel.queue_small(RAW, self.packer.pack((seq, tag)), data)
        elif buffers or len(data) > SMALL_LIMIT:
            readonly = readonly_mask(buffers)
            meta = pack((seq, tag, readonly)) if readonly else pack((seq, tag))
            self.channel.send(MSG, meta, [data, *buffers])
        else:
            self.channel.queue_small(MSG, self.packer.pack((seq, tag)), data)

    def send_now(self, seq: int, tag: Any, data: bytes, raw: bool) -> bool:
        """Write one small message without out-of-band buffers now (and what is
        queued before it); True when all is written, else the caller flushes."""
        return self.channel.send_small(RAW if raw else MSG, self.packer.pack((seq, tag)), data)

    def frame_pending(self, number: Callable[[str, int], int]) -> None:
        """Number the ``pending`` messages and queue them as frames (``lock`` held).

        ``number(peer, n)`` reserves ``n`` consecutive sequence numbers and
        returns the first. Each run of one tag (and of raw ``bytes`` or pickles)
        becomes BATCH frames of about ``BATCH_BYTES`` (one message alone, MSG or RAW).
        """
        pending = self.pending
        n = len(pending)
        if not n:
            return
        self.queued = 0
        items = [pending.popleft() for _ in range(n)]
        seq = number(self.peer, n)
        queue_small, packer = self.channel.queue_small, self.packer
        for (tag, raw), run in groupby(items, _tag_raw):
            datas = list(map(_data, run))
            lengths = list(map(len, datas))
            # runs longer than BATCH_BYTES (several threads sending at once) are cut
            step = max(1, len(datas) * BATCH_BYTES // max(1, sum(lengths)))
            for start in range(0, len(datas), step):
                chunk = datas[start : start + step]
                if len(chunk) == 1:
                    queue_small(RAW if raw else MSG, packer.pack((seq, tag)), chunk[0])
                else:
                    meta = packer.pack((seq, tag, lengths[start : start + step], raw))
                    queue_small(BATCH, meta, b"".join(chunk))
                seq += len(chunk)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.channel.close()


def _one_frame(channel: Channel, what: str) -> Frame:
    """One frame within the handshake timeout (the socket is blocking, reads are not)."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT
    frames: list[Frame] | None = []
    while frames == []:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([channel.sock], [], [], remaining)[0]:
            raise TimeoutError(f"no answer within {HANDSHAKE_TIMEOUT} s during the {what}")
        frames = channel.receive()
    if not frames:
        raise ConnectionResetError(f"closed during the {what}")
    if len(frames) > 1:
        raise ProtocolError(f"unexpected frames during the {what}")
    return frames[0]


def connect(address: tuple[str, Any], *, peer: str, me: str, program_id: str, token: bytes) -> Link:
    """Open a link to ``peer`` at ``address`` (``("unix", path)`` or ``("tcp", (host, port))``).

    Raises :class:`PeerUnreachable` when nothing listens there (yet),
    :class:`PeerLost` when the socket exists but its owner is gone, and
    :class:`PeerRefused` when the peer refuses the handshake.
    """
    kind, where = address
    try:
        if kind == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(HANDSHAKE_TIMEOUT)
            try:
                sock.connect(where)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection(tuple(where), timeout=CONNECT_TIMEOUT)
    except FileNotFoundError as exc:
        raise PeerUnreachable(f"instance {peer} is not listening yet") from exc
    except ConnectionRefusedError as exc:
        if kind == "unix":  # the socket file is there but nobody listens: its owner died
            raise PeerLost(f"instance {peer} is gone (its socket refuses connections)") from exc
        raise PeerUnreachable(f"instance {peer} refused a connection at {where}") from exc
    except OSError as exc:
        raise PeerUnreachable(f"instance {peer} cannot be reached at {where}: {exc}") from exc
    sock.settimeout(None)
    _tune(sock)
    channel = Stream(sock)
    try:
        channel.send(HELLO, pack((PROTOCOL, program_id, token, me)))
        channel.flush()
        frame = _one_frame(channel, "handshake")
    except (OSError, ProtocolError) as exc:
        channel.close()
        raise PeerLost(f"instance {peer} dropped the handshake: {exc}") from exc
    if frame.kind != WELCOME:
        channel.close()
        reason = unpack(frame.meta) if frame.kind == REFUSED else f"frame kind {frame.kind}"
        raise PeerRefused(f"instance {peer} refused the connection: {reason}")
    sock.setblocking(False)
    return Link(sock, channel, peer)


def accept(sock: socket.socket, *, me: str, program_id: str, token: bytes) -> Link | None:
    """Check a new connection's handshake; a refusal is answered, logged and closed."""
    sock.settimeout(None)
    _tune(sock)
    channel = Stream(sock)
    try:
        frame = _one_frame(channel, "handshake")
        if frame.kind != HELLO:
            raise ProtocolError(f"expected a handshake, got frame kind {frame.kind}")
        version, program, their_token, peer = unpack(frame.meta)
    except (OSError, ProtocolError, ValueError, TypeError) as exc:
        if channel.bytes_in == 0:  # a liveness probe: connected, said nothing, left
            log.debug("nimbus.messaging: %s was probed", me)
        else:
            log.warning("nimbus.messaging: refused a connection to %s: bad handshake (%s)", me, exc)
        channel.close()
        return None
    reason = None
    if version != PROTOCOL:
        reason = f"protocol version {version} (this instance speaks {PROTOCOL})"
    elif program != program_id:
        reason = "it belongs to another program"
    elif not isinstance(their_token, bytes) or not hmac.compare_digest(their_token, token):
        reason = "wrong auth token"
    if reason is not None:
        log.warning(
            "nimbus.messaging: instance %s refused a connection from %r: %s", me, peer, reason
        )
        try:
            channel.send(REFUSED, pack(reason))
            channel.flush()
        except OSError:
            pass
        channel.close()
        return None
    try:
        channel.send(WELCOME, pack(me))
        channel.flush()
    except OSError:
        channel.close()
        return None
    sock.setblocking(False)
    return Link(sock, channel, str(peer))
