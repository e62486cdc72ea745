"""An instance's mailbox: each sender's messages delivered once and in order.

::

    socket frames  --deliver(link, frames)--+   (MSG, PICKLE, RAW: one message; BATCH: many; BYE)
    one small message --take(link, msg, tag)-+
    store inbox    --put(sender, seq, ...)---+
                                             v
          per sender: seq == expected --> mail (one deque, arrival order) --> pop(source, tag)
                      seq >  expected --> held until the gap before it fills
                      seq <  expected --> a duplicate, dropped

Every message carries a sequence number per (sender, receiver) pair, whichever
way it travelled, so a sender that switched from the store to a socket
mid-stream is still delivered once and in order. A batch that arrives in order
(the common case of a burst) is one entry of the mail, a :class:`Run`: its
messages cut apart in one C-level pass, then taken one by one. A ``pop`` that
finds the run it wants at the head of the mail takes the next message from it
without the lock (``popleft`` is atomic: each message leaves once, in order),
so a receiver draining a burst pays no lock per message. A receiver waiting
for one sender and tag that reads exactly the message it waits for, next in
order with no mail waiting, gets it from ``take`` straight away: it never
enters the mail.
"""

from __future__ import annotations

import collections
import pickle
import threading
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import msgpack

from nimbus.errors import MessageDecodeError
from nimbus.messaging import _peer
from nimbus.messaging._stream import MESSAGES, SEQ, Message
from nimbus.wire import Frame

__all__ = ["Mail", "Mailbox", "Run", "decode"]

# sender, tag, pickle, its out-of-band buffers (None: the data is the message itself)
Mail = tuple[str, Any, Any, Sequence[Any] | None]
unpackb = msgpack.unpackb
MSG, PICKLE, RAW, BATCH, BYE = _peer.MSG, _peer.PICKLE, _peer.RAW, _peer.BATCH, _peer.BYE
_seq_of = SEQ.unpack_from  # the number of a small message (PICKLE, RAW), its tag after it
_UNKNOWN = object()  # a packed tag not seen yet


def decode(sender: str, data: Any, buffers: Sequence[Any] | None) -> Any:
    """Unpickle one message; an error names its sender (the link stays usable)."""
    if buffers is None:
        return data  # sent as it is
    try:
        return pickle.loads(data, buffers=buffers)
    except Exception as exc:
        raise MessageDecodeError(
            f"a message from instance {sender} cannot be unpickled here: "
            f"cannot unpickle payload: {type(exc).__name__}: {exc}",
            sender,
        ) from exc


class Run:
    """Messages from one sender with one tag, next to each other in its order: a
    BATCH that arrived in order, one entry of the mail, its pieces taken one by one.

    Pieces leave from the left only (``popleft``, atomic: each exactly once,
    in order) and none is added after it is made, so a used-up run is done.
    """

    __slots__ = ("pieces", "raw", "sender", "tag")

    def __init__(self, sender: str, tag: Any, pieces: collections.deque[Any], raw: bool) -> None:
        self.sender = sender
        self.tag = tag
        self.pieces = pieces  # each a small bytes: the message itself (raw) or its pickle
        self.raw = raw


class Mailbox:
    """Messages waiting for ``recv``, in order per sender, and which senders ended."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # the mail and the order state
        self.mail: collections.deque[Mail | Run] = collections.deque()
        self.ended: dict[str, str] = {}  # sender -> "exited" or "lost"
        self.arrivals = 0  # bumped after each delivery: a waiting recv looks again
        self._expect: dict[str, int] = collections.defaultdict(int)
        self._held: dict[str, dict[int, tuple[Any, Any, Sequence[Any] | None]]] = {}
        self._tags: dict[bytes, Any] = {}  # packed -> tag, of the small messages read

    def pop(self, source: str | None, tag: Any) -> tuple[str, Any] | None:
        """``(sender, obj)`` of the first waiting message from ``source`` (None:
        anyone) with ``tag``, taken out and decoded; None when there is none."""
        mail = self.mail
        try:
            head = mail[0]
        except IndexError:
            return None
        if type(head) is Run and head.tag == tag and (source is None or head.sender == source):
            # the common case of a burst: the next message of the run at the head,
            # without the lock (only the head run is taken from so, and its pieces
            # leave it one by one, in order, each exactly once: ``popleft`` is atomic)
            try:
                data = head.pieces.popleft()
            except IndexError:
                pass  # used up meanwhile: dropped below, under the lock
            else:
                if head.raw:
                    return head.sender, data
                return head.sender, decode(head.sender, data, ())
        lock = self.lock
        lock.acquire()  # not ``with``: half the cost
        try:
            found = self._first(source, tag)
        finally:
            lock.release()
        if found is None:
            return None
        sender, _, data, buffers = found
        if buffers is None:
            return sender, data  # small bytes, sent as they are
        try:
            return sender, pickle.loads(data, buffers=buffers)
        except Exception:
            return sender, decode(sender, data, buffers)  # raises, naming the sender

    def _first(self, source: str | None, tag: Any) -> Mail | None:
        """Take out the first waiting message from ``source`` with ``tag`` (``lock`` held)."""
        mail = self.mail
        self._drop_used()
        for i, item in enumerate(mail):
            if isinstance(item, Run):
                if item.tag == tag and (source is None or item.sender == source):
                    try:
                        data = item.pieces.popleft()
                    except IndexError:  # used up by a ``pop`` without the lock
                        continue
                    if not item.pieces:
                        del mail[i]  # nothing is ever added to a run: it is done
                    return item.sender, tag, data, None if item.raw else ()
            elif item[1] == tag and (source is None or item[0] == source):
                del mail[i]
                return item
        return None

    def _drop_used(self) -> bool:
        """Drop the used-up runs at the head of the mail (``lock`` held); True: no mail left.

        Only the head run is taken from without the lock, so only the head
        can be a used-up run left behind.
        """
        mail = self.mail
        while mail:
            head = mail[0]
            if type(head) is not Run or head.pieces:
                return False
            mail.popleft()
        return True

    def waiting(self, source: str | None, tag: Any) -> bool:
        """Whether a message from ``source`` (None: anyone) with ``tag`` waits (``lock`` held)."""
        for item in self.mail:
            if isinstance(item, Run):
                if item.tag == tag and (source is None or item.sender == source) and item.pieces:
                    return True
            elif item[1] == tag and (source is None or item[0] == source):
                return True
        return False

    def count(self) -> int:
        """Messages waiting."""
        with self.lock:
            return sum(len(item.pieces) if type(item) is Run else 1 for item in self.mail)

    def put(
        self, sender: str, seq: int, tag: Any, data: Any, buffers: Sequence[Any] | None
    ) -> None:
        """Deliver one message that came another way (the store)."""
        with self.lock:
            self._arrive(sender, seq, tag, data, buffers)
            self.arrivals += 1

    def deliver(self, link: _peer.Peer, frames: list[Frame]) -> None:
        """Deliver the frames read from ``link``."""
        peer = link.peer
        mail = self.mail
        expect = self._expect
        with self.lock:
            for kind, fmeta, bufs in frames:
                if kind == BATCH:
                    seq, tag, lengths, raw = unpackb(fmeta)
                    data = bufs[0]
                    if raw and type(data) is not bytes:
                        data = bytes(data)  # a large frame, read into a bytearray
                    ends = list(accumulate(lengths, initial=0))
                    pieces = map(data.__getitem__, map(slice, ends, ends[1:]))
                    if seq == expect[peer] and not self._held:
                        mail.append(Run(peer, tag, collections.deque(pieces), raw))
                        expect[peer] = seq + len(lengths)
                    else:
                        buffers = None if raw else ()
                        for i, piece in enumerate(pieces, seq):
                            self._arrive(peer, i, tag, piece, buffers)
                elif kind in MESSAGES:
                    # the common case, inline (a raw bytes is the message itself)
                    seq = _seq_of(fmeta)[0]
                    tag = self._tags.get(fmeta[8:], _UNKNOWN)
                    if tag is _UNKNOWN:
                        tag = self._learn(fmeta[8:])
                    buffers = () if kind == PICKLE else None
                    if seq == expect[peer] and not self._held:
                        mail.append((peer, tag, bufs[0], buffers))
                        expect[peer] = seq + 1
                    else:
                        self._arrive(peer, seq, tag, bufs[0], buffers)
                elif kind == MSG:
                    meta = unpackb(fmeta)  # seq, tag (, read-only buffers)
                    rest = (
                        _peer.writable_as_sent(bufs, meta[2] if len(meta) > 2 else 0)
                        if len(bufs) > 1
                        else ()
                    )
                    self._arrive(peer, meta[0], meta[1], bufs[0], rest)
                elif kind == BYE:
                    link.closed_cleanly = True
            self.arrivals += len(frames)

    def take(self, link: _peer.Peer, message: Message, tag: Any) -> Mail | None:
        """Deliver one small message read from ``link`` (``Stream.receive_message``);
        but when it has ``tag``, is next in its sender's order and nothing else
        waits, hand it back (undecoded) instead: the caller waits for exactly it.
        No trip through the mail, no second lock."""
        kind, seq, packed, data = message
        known = self._tags.get(packed, _UNKNOWN)
        if known is _UNKNOWN:
            known = self._learn(packed)
        peer = link.peer
        buffers = () if kind == PICKLE else None
        lock = self.lock
        lock.acquire()  # not ``with``: half the cost, on every message read alone
        try:
            if seq == self._expect[peer] and not self._held:
                self._expect[peer] = seq + 1
                if known == tag and (not self.mail or self._drop_used()):
                    return peer, tag, data, buffers
                self.mail.append((peer, known, data, buffers))
            else:
                self._arrive(peer, seq, known, data, buffers)
            self.arrivals += 1
        finally:
            lock.release()
        return None

    def _learn(self, packed: bytes) -> Any:
        """The tag packed as ``packed``, kept for the next messages (a sender's tags repeat)."""
        tag = unpackb(packed)
        if len(self._tags) < 4 * _peer.TAGS:
            self._tags[packed] = tag
        return tag

    def end(self, sender: str, how: str) -> None:
        """``sender``'s link closed: ``how`` is "exited" (it said goodbye) or "lost"."""
        with self.lock:
            self.ended[sender] = how

    def _arrive(
        self, sender: str, seq: int, tag: Any, data: Any, buffers: Sequence[Any] | None
    ) -> None:
        """Deliver in order (called with ``lock`` held)."""
        expect = self._expect[sender]
        if seq == expect:
            self.mail.append((sender, tag, data, buffers))
            expect += 1
            held = self._held.get(sender)
            while held and expect in held:
                t, d, b = held.pop(expect)
                self.mail.append((sender, t, d, b))
                expect += 1
            if held is not None and not held:
                del self._held[sender]  # none held at all: ``deliver`` takes its short path
            self._expect[sender] = expect
        elif seq > expect:  # an earlier one is still on its way through the store
            self._held.setdefault(sender, {})[seq] = (tag, data, buffers)
        # seq < expect: a duplicate, dropped
