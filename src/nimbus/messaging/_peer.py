"""Connections between two instances: the handshake and the message frames.

::

    connecting instance                               listening instance
    connect() --HELLO [version, program, token, id, its directory entry, follows]-->
              <--WELCOME [id] or REFUSED [reason]----  acceptor: check version, program
                                                       and token (logged); the entry is
                                                       cached
      (over TCP a small first message may follow the HELLO at once, ``follows``: the
       acceptor reads it whole before it answers, so the answer never reaches a
       sender whose socket still holds that message; the sender reads the answer
       before the link's second send or its goodbye; ``answer``)
    MSG [seq, tag] + pickle + out-of-band buffers --->  mailbox (in order per sender)
    PICKLE seq tag + a small pickle ---------------->  mailbox
    RAW seq tag + bytes (a small bytes as it is) --->  mailbox
    BATCH [first seq, tag, [lengths], raw] + data -->  mailbox, one message per length
    BYE [next seq] (clean exit) -------------------->  the sender exited

Frames are ``nimbus.wire`` frames (their kinds and the channel's fast path for
small ones are in ``_stream``): a fixed header, msgpack metadata, then the
pickle and its pickle-5 buffers, written with one scatter-gather ``sendmsg``
and read into preallocated buffers. A link carries messages one way; two
instances that talk both ways hold two links (an instance that accepts a link
over TCP opens its own back at once: ``Sender._call_back``).

Small messages sent in a burst wait in the link's ``pending`` queue, appended
to without a lock and without a sequence number; whoever writes the link
(holding its lock) numbers them and frames each run of one tag as a single
BATCH frame: its pickles back to back, their lengths in the metadata. The
receiver cuts a batch into messages in one pass, with no per-message frame.
Small ``bytes`` are sent as they are, not pickled (RAW, BATCH frames marked raw).
"""

from __future__ import annotations

import collections
import hmac
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from itertools import groupby, repeat, starmap
from operator import itemgetter
from typing import Any

import msgpack

from nimbus.errors import PeerLost, PeerRefused, PeerUnreachable
from nimbus.messaging._stream import (
    BATCH,
    BYE,
    HELLO,
    MSG,
    PICKLE,
    RAW,
    REFUSED,
    WELCOME,
    Stream,
    readonly_mask,
    writable_as_sent,
)
from nimbus.wire import Channel, Frame, ProtocolError, pack, unpack

__all__ = [
    "BATCH",
    "BYE",
    "MSG",
    "PICKLE",
    "PROTOCOL",
    "RAW",
    "Peer",
    "Stream",
    "accept",
    "connect",
    "ended",
    "readonly_mask",
    "writable_as_sent",
]

log = logging.getLogger("nimbus.messaging")

PROTOCOL = 4  # 3: small messages carry their number in the frame header; 4: a message
# may follow a HELLO before its answer (read whole by the acceptor before it answers:
# ``Peer.early``), and a HELLO carries the connector's directory entry (``Peer.entry``)
HANDSHAKE_TIMEOUT = 5.0
CONNECT_TIMEOUT = 1.0  # a TCP peer that does not answer within this is unreachable (for now)
SOCKET_BUFFER = 4 * 1024 * 1024
SMALL_LIMIT = 64 * 1024  # a pickle this small is copied into its frame
BATCHED = 4096  # a pickle this small (and with no out-of-band buffers) may wait in ``pending``
BATCH_BYTES = 32 * 1024  # pickles in one BATCH frame (about: runs are cut by count)
_tag_raw = itemgetter(0, 2)
_data = itemgetter(1)
TAGS = 64  # packed tags a link keeps (tags beyond are packed per message)
_ENDED = select.POLLRDHUP | select.POLLHUP | select.POLLERR  # (whatever input waits)
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


class Peer:
    """One connected, handshaken socket to or from a peer instance."""

    __slots__ = (
        "armed",
        "back",
        "channel",
        "closed_cleanly",
        "count",
        "early",
        "entry",
        "error",
        "lock",
        "packer",
        "peer",
        "pending",
        "queued",
        "recvs",
        "sock",
        "spin_backoff",
        "spin_skip",
        "tags",
        "unanswered",
        "wait",
    )

    def __init__(self, sock: socket.socket, channel: Stream, peer: str) -> None:
        self.sock = sock
        self.channel = channel
        self.peer = peer
        self.lock = threading.Lock()
        self.closed_cleanly = False
        self.error: BaseException | None = None  # a deferred flush failed
        self.recvs = -1  # the instance's receive count at this link's last send
        self.count: Iterator[int] | None = None  # the sender's numbering of its peer (links out)
        self.packer = msgpack.Packer(use_bin_type=True)  # used under ``lock``
        self.tags: dict[Any, bytes] = {}  # tag -> packed, for small messages (``packed``)
        # small messages (tag, data, raw) not yet numbered nor framed: appended without
        # the lock (a deque's append is atomic), taken by :meth:`frame_pending`
        self.pending: collections.deque[tuple[Any, bytes, bool]] = collections.deque()
        self.queued = 0  # bytes in ``pending``: added to without a lock, so approximate
        self.armed = False  # the instance's flusher will frame and write ``pending``
        self.wait = 0.0  # a link in: how long a read waits (0: reads never wait)
        self.spin_skip = 0  # a link in: waiting reads left before the next spins first
        self.spin_backoff = 0  # the reads skipped after the last spin that found nothing
        self.early: list[Frame] = []  # a link in: frames read with its HELLO
        self.entry: bytes | None = None  # a link in: its peer's directory entry, as it said
        self.unanswered = False  # a link out: its handshake's answer not read yet
        self.back = False  # a link out opened back to a peer (``Sender._call_back``), unused

    def packed(self, tag: Any) -> bytes:
        """``tag`` packed with msgpack, kept for the next messages with it (up to TAGS)."""
        try:
            return self.tags[tag]
        except KeyError:
            packed = pack(tag)
            if len(self.tags) < TAGS:
                self.tags[tag] = packed
            return packed
        except TypeError:  # not hashable
            return pack(tag)

    def queue(self, seq: int, tag: Any, data: bytes, buffers: list[Any], raw: bool) -> None:
        """Queue one message; the caller flushes (now, or later with others).

        ``raw``: ``data`` is a small ``bytes`` sent as it is, not a pickle.
        """
        if raw:
            self.channel.queue_message(RAW, seq, self.packed(tag), data)
        elif buffers or len(data) > SMALL_LIMIT:
            readonly = readonly_mask(buffers)
            meta = pack((seq, tag, readonly)) if readonly else pack((seq, tag))
            self.channel.send(MSG, meta, [data, *buffers])
        else:
            self.channel.queue_message(PICKLE, seq, self.packed(tag), data)

    def frame_pending(self, number: Callable[[str, int], int]) -> None:
        """Number the ``pending`` messages and queue them as frames (``lock`` held).

        ``number(peer, n)`` reserves ``n`` consecutive sequence numbers and
        returns the first. Each run of one tag (and of raw ``bytes`` or pickles)
        becomes BATCH frames of about ``BATCH_BYTES`` (one message alone, PICKLE or RAW).
        """
        pending = self.pending
        n = len(pending)
        if not n:
            return
        self.queued = 0
        items = list(starmap(pending.popleft, repeat((), n)))  # n popleft calls, in C
        seq = number(self.peer, n)
        queue_small, queue_message, packer = (
            self.channel.queue_small,
            self.channel.queue_message,
            self.packer,
        )
        for (tag, raw), run in groupby(items, _tag_raw):
            datas = list(map(_data, run))
            lengths = list(map(len, datas))
            # runs longer than BATCH_BYTES (several threads sending at once) are cut
            step = max(1, len(datas) * BATCH_BYTES // max(1, sum(lengths)))
            for start in range(0, len(datas), step):
                chunk = datas[start : start + step]
                if len(chunk) == 1:
                    queue_message(RAW if raw else PICKLE, seq, self.packed(tag), chunk[0])
                else:
                    meta = packer.pack((seq, tag, lengths[start : start + step], raw))
                    queue_small(BATCH, meta, b"".join(chunk))
                seq += len(chunk)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.channel.close()


def wait_in_reads(link: Peer, seconds: float) -> None:
    """Make a read of link in ``link`` without ``MSG_DONTWAIT`` wait up to ``seconds``
    for input (``SO_RCVTIMEO``); every other read of it passes ``MSG_DONTWAIT``."""
    sock = link.sock
    whole = int(seconds)
    timeval = struct.pack("@ll", whole, int((seconds - whole) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setblocking(True)
    link.wait = seconds


def _frames(channel: Channel, what: str, timeout: float = HANDSHAKE_TIMEOUT) -> list[Frame]:
    """The first frames read within ``timeout`` (reads do not block)."""
    deadline = time.monotonic() + timeout
    frames: list[Frame] | None = []
    while frames == []:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([channel.sock], [], [], remaining)[0]:
            raise TimeoutError(f"no answer within {timeout} s during the {what}")
        frames = channel.receive()
    if not frames:
        raise ConnectionResetError(f"closed during the {what}")
    return frames


def _one_frame(channel: Channel, what: str, timeout: float = HANDSHAKE_TIMEOUT) -> Frame:
    """One frame within ``timeout``, and nothing after it."""
    frames = _frames(channel, what, timeout)
    if len(frames) > 1:
        raise ProtocolError(f"unexpected frames during the {what}")
    return frames[0]


def connect(
    address: tuple[str, Any],
    *,
    peer: str,
    me: str,
    program_id: str,
    token: bytes,
    answered: bool = True,
    follows: bool = False,
    entry: bytes | None = None,
) -> Peer:
    """Open a link to ``peer`` at ``address`` (``("unix", path)`` or ``("tcp", (host, port))``).

    Raises :class:`PeerUnreachable` when nothing listens there (yet),
    :class:`PeerLost` when the socket exists but its owner is gone, and
    :class:`PeerRefused` when the peer refuses the handshake. With ``answered``
    false the link is returned before the answer is read (``unanswered``: read
    later, :func:`answer`). With ``follows`` too, its HELLO is queued, not written:
    the caller queues one message behind it (that the peer reads whole before it
    answers) and writes both at once. ``entry``: this instance's directory entry
    (packed), told to the peer in the HELLO.
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
    link = Peer(sock, channel, peer)
    link.unanswered = True
    follows = follows and not answered
    channel.send(HELLO, pack((PROTOCOL, program_id, token, me, entry, follows)))
    if not follows:
        try:
            channel.flush()
        except OSError as exc:
            channel.close()
            raise PeerLost(f"instance {peer} dropped the handshake: {exc}") from exc
        if answered:
            answer(link)
    sock.setblocking(False)
    return link


def answer(link: Peer, timeout: float = HANDSHAKE_TIMEOUT) -> None:
    """Read the answer to ``link``'s HELLO (waiting up to ``timeout``); the link is
    closed and :class:`PeerRefused` (or :class:`PeerLost`) raised if it is no WELCOME."""
    if not link.unanswered:
        return
    link.unanswered = False  # read now, whatever it is
    peer = link.peer
    try:
        frame = _one_frame(link.channel, "handshake", timeout)
    except (OSError, ProtocolError) as exc:
        link.close()
        raise PeerLost(f"instance {peer} dropped the handshake: {exc}") from exc
    if frame.kind != WELCOME:
        link.close()
        reason = unpack(frame.meta) if frame.kind == REFUSED else f"frame kind {frame.kind}"
        raise PeerRefused(f"instance {peer} refused the connection: {reason}")


def ended(link: Peer) -> bool:
    """Whether link out ``link`` was closed (or reset) at its peer's end, its answer read
    or not (a link out carries nothing else to read: its end of stream is its peer's)."""
    fd = link.sock.fileno()
    if fd < 0:
        return True  # (closed here meanwhile)
    poll = select.poll()
    poll.register(fd, _ENDED)
    return bool(poll.poll(0))


def accept(sock: socket.socket, *, me: str, program_id: str, token: bytes) -> Peer | None:
    """Check a new connection's handshake; a refusal is answered, logged and closed."""
    sock.settimeout(None)
    _tune(sock)
    channel = Stream(sock)
    try:
        frame, *early = _frames(channel, "handshake")
        if frame.kind != HELLO:
            raise ProtocolError(f"expected a handshake, got frame kind {frame.kind}")
        version, program, their_token, peer, *told = unpack(frame.meta)
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
        if len(told) > 1 and told[1] is True and not early:
            # a message follows: read whole before the answer, so the answer never
            # meets a socket that still holds it (a sender that went without reading
            # its answer is reset by it, and what its socket held is dropped)
            early = _frames(channel, "first message")
        channel.send(WELCOME, pack(me))
        channel.flush()
    except (OSError, ProtocolError) as exc:
        log.warning("nimbus.messaging: %s dropped a connection from %r: %s", me, peer, exc)
        channel.close()
        return None
    sock.setblocking(False)
    link = Peer(sock, channel, str(peer))
    link.early = early  # messages that followed the HELLO (the receiver delivers them first)
    if told and isinstance(told[0], bytes):
        link.entry = told[0]
    return link
