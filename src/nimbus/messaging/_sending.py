"""The sending half of an instance: links out, numbering, the store (writing: ``_flushing``).

::

    send(peer, obj) -- small, after a send, peer connected --> link.pending (no lock)
          |                                                       | COALESCE bytes, next recv,
          |                                                       v or the flusher (FLUSH_DELAY)
          +-- otherwise: link.lock --> frames queued/written --> socket
          |
          +-- peer not listening (yet) or unreachable --> RPUSH inbox:<peer> in the store

A link to a peer on another host (TCP) carries a small first message (up to
``FOLLOWS`` bytes) right behind the HELLO, before the peer's answer: each first
contact costs the sender a TCP connect, not a round trip through the peer's
process too (an exchange's first sends to several peers overlap their
handshakes). The peer reads that message whole before it answers. Until its
answer is read the link waits in ``_opening``; the next send to that peer, or the
goodbye, reads it (a refusal raises at that send, as :class:`PeerRefused`, and is
logged at a goodbye; the message sent before it was not taken). An instance that
accepts a link over TCP opens one back to its peer at once, in a thread of its own
(``_call_back``): its first reply, or its part of an exchange, then goes over a
link already open. One its peer closed meanwhile is dropped at its first use (a new
connect says what became of the peer); unused, it is closed once its peer exited.

Every message to a peer takes the next number of that peer's count, whichever
way it goes, so the receiver delivers once and in order across a switch from
the store to a socket. The first send after a ``recv`` goes at once (a request
waits for its reply); sends in a row are coalesced. A send that finds the
peer's socket full reads this instance's own sockets meanwhile (``_progress``),
so rings and exchanges never deadlock on full buffers. A large message nothing can
change (``BEHIND`` bytes or more, its buffers all ``bytes``) is not waited for: what
the socket did not take is written behind the send (``_flushing``).
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from nimbus import serialization
from nimbus.errors import (
    MessagingError,
    PeerExited,
    PeerLost,
    PeerRefused,
    PeerUnreachable,
    StateStoreError,
)
from nimbus.messaging import _peer
from nimbus.messaging._directory import ALIVE, EXITED, Directory, Entry, socket_path
from nimbus.messaging._flushing import BEHIND, COALESCE, Flusher, fixed
from nimbus.statestore import Keys
from nimbus.wire import pack

__all__ = ["Sender"]

log = logging.getLogger("nimbus.messaging")

RETRY = 0.002  # seconds between tries to reach a peer that does not listen yet
RETRY_TCP = 0.25  # first wait before trying an unreachable TCP address again ...
MAX_BACKOFF = 5.0  # ... doubling up to this
FOLLOWS = 256 * 1024  # a first message over TCP this small follows its HELLO before
# the answer (a larger one takes far longer than the round trip)
REFUSAL_WAIT = 0.1  # seconds a broken link not yet answered is read for a refusal
GOODBYE_WAIT = 1.0  # seconds a closing link's goodbye is written, and its answer read
_PLAIN = (bytes, str)  # pickled straight when small (no out-of-band buffers to find)
_INLINE = 64 * 1024
_BATCHED = _peer.BATCHED
_RAW, _PICKLE = _peer.RAW, _peer.PICKLE
_NO_BUFFERS: list[Any] = []  # shared, never changed: saves a list per small send


class Sender(Flusher):
    """Sending to other instances; :class:`~nimbus.messaging.Instance` adds the rest."""

    # set by the instance
    id: str
    entry: Entry
    directory: Directory
    direct: bool
    _client: Callable[[], redis.Redis]
    _keys: Keys
    _token: bytes
    _ttl_ms: int
    _sockdir: Path
    _closed: bool

    def __init__(self) -> None:
        Flusher.__init__(self)
        self._out: dict[str, _peer.Peer] = {}
        self._opening: dict[str, _peer.Peer] = {}  # links out whose answer is unread
        self._refused: dict[str, PeerRefused] = {}  # a write failed: the peer had refused
        self._no_follow: set[str] = set()  # peers that refused: no message before the answer
        self._connecting: dict[str, threading.Lock] = {}  # per peer: one thread opens links
        self._out_lock = threading.Lock()
        # one numbering per peer, whichever way its messages go (taken without a lock)
        self._seq: dict[str, itertools.count[int]] = collections.defaultdict(itertools.count)
        self._retry_at: dict[str, float] = {}
        self._backoff: dict[str, float] = {}
        self._recvs = 0  # receives so far (the instance counts them)

    def send(self, peer: str, obj: object, tag: Any = 0) -> None:
        """Send ``obj`` to instance ``peer``: over a socket if it listens, else the store.

        Small ``bytes`` travel as they are over sockets (no pickle at either end).
        """
        raws: list[Any] = _NO_BUFFERS
        if type(obj) is bytes and (size := len(obj)) <= _BATCHED:
            data: Any = obj
            raw = True
        else:
            raw = False
            if type(obj) in _PLAIN and len(obj) < _INLINE:  # type: ignore[arg-type]
                data = pickle.dumps(obj, 5)  # the common small case, no detour
            else:
                data, buffers = serialization.dumps(obj)
                raws = [b.raw() for b in buffers]
            size = len(data)
            if raws or size > _BATCHED:
                self._send_slow(peer, self._out.get(peer), tag, data, raws, raw)
                return
        link = self._out.get(peer)
        if link is not None:
            if link.recvs == self._recvs:
                # a send after a send (no recv between) to a connected peer: queue it, no lock
                link.pending.append((tag, data, raw))
                queued = link.queued + size
                link.queued = queued
                if queued >= COALESCE:
                    with link.lock:
                        self._write(link)
                elif not link.armed:  # read after the append: see ``_flush_dirty``
                    self._arm(link)
                return
            lock = link.lock
            lock.acquire()  # not ``with``: half the cost, on every reply
            try:
                # the first send since a receive (a reply, say) with nothing queued
                # before it: written now, as ``_send_slow`` would (inline: the common case)
                if link.error is None and not link.pending and link.recvs != self._recvs:
                    link.recvs = self._recvs
                    seq = next(link.count)  # type: ignore[arg-type]  # set on links out
                    packed = link.tags.get(tag) if type(tag) is str else None
                    if packed is None:
                        packed = link.packed(tag)
                    try:  # ``_send_message``, inline
                        if link.channel.send_message(_RAW if raw else _PICKLE, seq, packed, data):
                            return
                    except OSError as exc:
                        self._drop_out(link)
                        raise self._gone(link.peer, exc) from exc
                    self._flush(link)
                    return
            finally:
                lock.release()
        self._send_slow(peer, link, tag, data, raws, raw)

    def _send_slow(
        self, peer: str, link: _peer.Peer | None, tag: Any, data: bytes, raws: list[Any], raw: bool
    ) -> None:
        """Send one message that does not just join a link's ``pending`` queue.

        ``raw``: ``data`` is the ``bytes`` sent, not a pickle. Raises the error of a
        write behind an earlier send to ``peer`` that broke (``_lost``).
        """
        if self._failed and peer in self._failed:
            raise self._failed.pop(peer)
        if link is None and self.direct:
            link, sent = self._open(peer, (tag, data, raws, raw))
            if sent:
                return
        if link is None:
            if raw:
                data = pickle.dumps(data, 5)
            self._push_store(peer, self._number(peer, 1), tag, data, raws)
            return
        with link.lock:
            if link.error is not None:
                raise self._gone(peer, link.error)
            if link.pending:
                link.frame_pending(self._number)  # what waits goes first
            seq = next(self._seq[peer])
            # the first send since a receive goes now (a request waits for its reply);
            # more sends in a row are coalesced, up to COALESCE bytes or FLUSH_DELAY
            now = link.recvs != self._recvs
            link.recvs = self._recvs
            if now and not raws and len(data) <= _peer.SMALL_LIMIT:
                self._send_message(link, _RAW if raw else _PICKLE, seq, link.packed(tag), data)
                return
            link.queue(seq, tag, data, raws, raw)
            if now or link.channel.pending_output >= COALESCE:
                if len(data) + sum(r.nbytes for r in raws) < BEHIND or not fixed(raws):
                    self._flush(link)
                    return
                # a large message nothing can change once this returns (a pickle made
                # here, ``bytes``; the buffers of an array, which the caller may change, are
                # written before it returns): what the socket does not take now is written
                # behind this call, so sends in a row to several peers (an exchange's)
                # keep all their links busy at once, not one after the other
                try:
                    if link.channel.flush():
                        return
                except OSError as exc:
                    self._drop_out(link)
                    raise self._gone(peer, exc) from exc
                self._large.add(link)
        if not link.armed:
            self._arm(link)

    def _send_message(
        self, link: _peer.Peer, kind: int, seq: int, packed: bytes, data: bytes
    ) -> None:
        """Write one small message now (``link.lock`` held); while the socket is full,
        read our own sockets (``_flush``)."""
        try:
            if link.channel.send_message(kind, seq, packed, data):
                return
        except OSError as exc:
            self._drop_out(link)
            raise self._gone(link.peer, exc) from exc
        self._flush(link)

    def _number(self, peer: str, n: int) -> int:
        """Reserve ``n`` consecutive sequence numbers for messages to ``peer``; the first.

        Atomic without a lock: ``next`` of a count, and ``list(islice(count))``
        run in C without a switch of threads in between.
        """
        if n == 1:
            return next(self._seq[peer])
        taken = list(itertools.islice(self._seq[peer], n))  # all n at once, not one by one
        return taken[0]

    def _open(
        self, peer: str, first: tuple[Any, bytes, list[Any], bool] | None = None
    ) -> tuple[_peer.Peer | None, bool]:
        """``(link, sent)``: a link to ``peer`` (None while it does not listen: its
        messages go to the store), and whether ``first`` went on it.

        ``first`` (tag, data, buffers, raw): the message to send. Over TCP a small one
        (up to FOLLOWS bytes) is written with the HELLO, at once, before the answer
        (read later: the link waits in ``_opening``), unless this peer refused a link
        before. One thread at a time opens a link to a peer: another finds it opened.
        """
        if peer == self.id:
            raise ValueError("an instance cannot send to itself")
        if self._opening:
            opened = self._opening.get(peer)
            if opened is not None and not opened.back:
                return self._answered(opened), False
        with self._connecting.setdefault(peer, threading.Lock()):
            link = self._out.get(peer) or self._opening.get(peer)
            if link is not None and link.back:
                link = self._taken_back(link)
            if link is not None:  # opened by another thread meanwhile
                return (self._answered(link) if link.unanswered else link), False
            return self._connect(peer, first)

    def _taken_back(self, link: _peer.Peer) -> _peer.Peer | None:
        """Link back ``link`` (``_call_back``'s) at its first use (``_connecting[peer]``
        held): answered and open, or None (dropped: the peer closed it, having exited
        since, or refused it; nothing was sent on it, so a new connect says what became
        of the peer, as if there had been no link back)."""
        link.back = False
        if _peer.ended(link):  # (seen before the answer is read: its peer's end of stream)
            with self._out_lock:
                if self._opening.get(link.peer) is link:
                    del self._opening[link.peer]
            link.close()
            return None
        try:
            return self._answered(link)
        except MessagingError:
            return None  # (dropped by ``_answered``)

    def _call_back(self, peer: str) -> None:
        """Open a link to ``peer``, which opened one to us over TCP, unless one is open
        or opening: a peer that sent to us is likely to be sent to (a reply, the rest
        of an exchange), and a first contact across hosts costs a connect and the
        peer's acceptor in the path of the message. Run in a thread of its own; its
        answer is read at the first send. Whatever fails, the first send tries again."""
        lock = self._connecting.setdefault(peer, threading.Lock())
        if not lock.acquire(blocking=False):
            return  # a link to it is opening
        try:
            if not self._closed and peer not in self._out and peer not in self._opening:
                self._connect(peer, None, back=True)
        except Exception as exc:  # an optimisation: the first send tries again
            log.debug("nimbus.messaging: %s did not call %s back: %r", self.id, peer, exc)
        finally:
            lock.release()

    def _unlinked(self, peer: str, exited: bool) -> None:
        """``peer``'s links in all ended (``exited``: with its goodbye): an unused link
        back to it is closed now if it exited, or closed its end (killed, say), not
        kept till this instance closes (one socket per peer that ever sent to it, in
        an instance that only receives). Kept otherwise: closing it would tell a peer
        that lives on that this instance ended. One being taken is left to its sender."""
        link = self._opening.get(peer)
        if link is None or not link.back or not (exited or _peer.ended(link)):
            return
        lock = self._connecting.get(peer)
        if lock is None or not lock.acquire(blocking=False):
            return
        try:
            with self._out_lock:
                if self._opening.get(peer) is not link or not link.back:
                    return
                del self._opening[peer]
                link.unanswered = False  # (not read: a goodbye racing this skips it)
        finally:
            lock.release()
        link.close()

    def _connect(
        self, peer: str, first: tuple[Any, bytes, list[Any], bool] | None, back: bool = False
    ) -> tuple[_peer.Peer | None, bool]:
        """``_open``'s connect (its lock held); ``back``: ``_call_back``'s."""
        now = time.monotonic()
        if now < self._retry_at.get(peer, 0.0):
            return None, False
        address: tuple[str, Any]
        local = socket_path(self._sockdir, peer)
        if os.path.exists(local):
            address = ("unix", str(local))
        else:
            entry = self.directory.lookup(peer)
            if entry is not None and entry.state == ALIVE and entry.host == self.entry.host:
                entry = self.directory.refresh(peer)  # its socket went away: did it exit?
            if entry is not None and entry.state == EXITED:
                raise _exited(peer)
            if entry is None or entry.host == self.entry.host or entry.tcp is None:
                self._retry_at[peer] = now + RETRY
                return None, False
            address = ("tcp", entry.tcp)
        # on this host a first message gains nothing from following its HELLO
        follows = (
            first is not None
            and address[0] == "tcp"
            and peer not in self._no_follow
            and len(first[1]) + sum(r.nbytes for r in first[2]) <= FOLLOWS
        )
        try:
            link = _peer.connect(
                address,
                peer=peer,
                me=self.id,
                program_id=self._keys.program_id,
                token=self._token,
                answered=not (follows or back),
                follows=follows,
                entry=self.entry.dumps(),  # (the peer's reply needs no lookup then)
            )
        except PeerUnreachable:
            self.directory.invalidate(peer)
            if address[0] == "tcp":  # a timeout costs up to a second: back off
                # its address may be from a lookup of another peer (the directory read
                # whole) from before it exited: the store says now
                entry = self.directory.refresh(peer)
                if entry is not None and entry.state == EXITED:
                    raise _exited(peer) from None
                backoff = min(MAX_BACKOFF, 2 * self._backoff.get(peer, RETRY_TCP / 2))
                self._backoff[peer] = backoff
                self._retry_at[peer] = time.monotonic() + backoff
            else:
                self._retry_at[peer] = now + RETRY
            return None, False
        self._backoff.pop(peer, None)
        link.count = self._seq[peer]  # the one numbering of ``peer``, whichever way
        if first is not None and link.unanswered:
            # HELLO and message in one write, before another thread sees the link: the
            # peer answers once it has the message whole, so nothing may come between
            tag, data, raws, raw = first
            with link.lock:
                link.recvs = self._recvs
                link.queue(next(self._seq[peer]), tag, data, raws, raw)
                self._flush(link)  # (a broken write: ``_drop_out``, PeerLost or PeerRefused)
        link.back = back  # (before another thread sees it)
        with self._out_lock:
            closed = self._closed  # (a link back opened while this instance closed)
            if not closed and link.unanswered:
                self._opening[peer] = link
            elif not closed:
                self._out[peer] = link
        if closed:  # said goodbye to, as the others (its peer then knows this one exited)
            if first is not None and not link.unanswered:
                # ``first``, not written yet, goes before the goodbye (not after it through
                # the store: the goodbye takes a number, and the peer waits for each)
                tag, data, raws, raw = first
                with link.lock:
                    link.queue(next(self._seq[peer]), tag, data, raws, raw)
            self._goodbye(link)
            return None, first is not None
        return link, link.unanswered

    def _answered(self, link: _peer.Peer) -> _peer.Peer:
        """``link`` (from ``_opening``) once its peer's answer is read, now in ``_out``;
        :class:`PeerRefused` (or the link's loss) raised if the peer refused it. A link
        dropped meanwhile (another thread's write broke) is returned with its error."""
        with link.lock:
            if link.error is None:
                try:
                    _peer.answer(link)
                except MessagingError as exc:
                    link.error = exc
                    if isinstance(exc, PeerRefused):
                        self._no_follow.add(link.peer)  # its next links wait for the answer
                    self._drop_out(link)
                    raise
        with self._out_lock:
            if self._opening.get(link.peer) is link:
                del self._opening[link.peer]
                self._out[link.peer] = link
        return link

    def _push_store(self, peer: str, seq: int, tag: Any, data: bytes, raws: list[Any]) -> None:
        key = self._keys.inbox(peer)
        parts = [data, *(bytes(r) for r in raws)]
        message = pack((self.id, seq, tag, parts, _peer.readonly_mask(raws)))
        try:
            pipe = self._client().pipeline(transaction=False)
            pipe.rpush(key, message)
            pipe.pexpire(key, self._ttl_ms)
            pipe.execute()
        except redis.RedisError as exc:
            raise StateStoreError(f"cannot queue a message for {peer}: {exc}") from exc

    def _gone(self, peer: str, exc: BaseException) -> MessagingError:
        """The error of a link to ``peer`` that broke: :class:`PeerExited` if the peer
        exited normally (its goodbye came in, or the directory says so), else
        :class:`PeerLost` (:class:`PeerRefused` if it had refused the link)."""
        refused = self._refused.pop(peer, None)
        if refused is not None:
            return refused
        exited = self._ended_as(peer) == EXITED
        if not exited:
            try:
                entry = self.directory.refresh(peer)
            except StateStoreError:
                entry = None
            exited = entry is not None and entry.state == EXITED
        if exited:
            return _exited(peer)
        return PeerLost(str(exc) if type(exc) is PeerLost else f"instance {peer} is lost: {exc}")

    def _ended_as(self, peer: str) -> str | None:
        """How ``peer``'s link in ended ("exited", "lost"), if it did (the instance's)."""
        return None

    def _drop_out(self, link: _peer.Peer) -> None:
        """Forget broken ``link`` and close it (whoever calls this raises its error, or
        keeps it: ``_lost``)."""
        self._large.discard(link)
        with self._out_lock:
            if self._out.get(link.peer) is link:
                del self._out[link.peer]
            if self._opening.get(link.peer) is link:
                del self._opening[link.peer]
        if link.unanswered:  # a write broke before the answer was read: a refusal?
            try:
                _peer.answer(link, REFUSAL_WAIT)
            except PeerRefused as exc:
                self._refused[link.peer] = exc  # what ``_gone`` raises
                self._no_follow.add(link.peer)
            except MessagingError:
                pass
        self.directory.invalidate(link.peer)
        link.close()

    def _say_goodbye(self) -> None:
        """Write what is queued and a BYE on every link out, then close them."""
        for error in self._failed.values():  # (no later send to raise it at)
            log.warning(
                "nimbus.messaging: %s; what was sent to it before was not written whole", error
            )
        self._failed.clear()
        with self._out_lock:  # (a link opened from now on is closed: ``_connect``)
            links = [*self._out.values(), *self._opening.values()]
        for link in links:
            self._goodbye(link)
        self._out.clear()
        self._opening.clear()

    def _goodbye(self, link: _peer.Peer) -> None:
        """Write what ``link`` holds queued and a BYE, then close it (the instance closes)."""
        try:
            with link.lock:
                link.frame_pending(self._number)
                link.channel.send(_peer.BYE, pack(self._number(link.peer, 1)))
                link.sock.setblocking(True)
                link.sock.settimeout(GOODBYE_WAIT)
                link.channel.flush()
        except OSError:
            pass
        if link.unanswered:
            # a socket closed with input unread (the answer) is reset, not closed:
            # what it still holds for the peer is dropped, the peer's read breaks
            try:
                _peer.answer(link, GOODBYE_WAIT)
            except PeerRefused as exc:  # nothing left to raise it to: said here
                log.warning("nimbus.messaging: %s; the message sent to it was not taken", exc)
            except MessagingError:
                pass
        link.close()


def _exited(peer: str) -> PeerExited:
    return PeerExited(
        f"instance {peer} has exited (normally): it takes no more messages; send to "
        f"an instance only while it runs (e.g. before joining its process)"
    )
