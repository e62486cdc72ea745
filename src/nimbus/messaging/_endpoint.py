"""An instance's endpoint: its listening socket, links to peers, and mailbox.

::

    send(peer, obj)                                                   recv(source, timeout)
      pickle-5 -> link to peer? --yes--> MSG over the socket ----+         ^
                       |                                          v         |
                       no (not listening yet, or unreachable)   poll() -> mailbox, in order
                       +--> RPUSH inbox:<peer> in the store --> inbox thread (BLPOP) -+

Every message carries a sequence number per (sender, receiver) pair, whichever
way it travels, so the mailbox (``_mailbox``) delivers each sender's messages
once and in order even when the sender switched from the store to the socket
mid-stream. A send that finds the peer's socket full reads what is waiting for
this instance meanwhile, so rings and exchanges never deadlock on full buffers.

The path of a small message in a burst (a send after a send, to a connected
peer) is one dict lookup and one append to the link's ``pending`` queue, no
lock; the queue is numbered and framed (BATCH frames) when it reaches COALESCE
bytes, at the next ``recv``, or by the flusher thread within FLUSH_DELAY.
"""

from __future__ import annotations

import _thread
import collections
import dataclasses
import itertools
import logging
import os
import pickle
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import redis

from nimbus import serialization
from nimbus.errors import (
    MessagingTimeout,
    PeerExited,
    PeerLost,
    PeerUnreachable,
    StateStoreError,
)
from nimbus.keys import Keys
from nimbus.messaging import _link
from nimbus.messaging._directory import ALIVE, EXITED, Directory, Entry, host_id, socket_path
from nimbus.messaging._mailbox import Mailbox
from nimbus.wire import ProtocolError, pack, unpack

__all__ = ["ANY", "HEARTBEAT", "Endpoint", "Transport"]

ANY: Any = None
HEARTBEAT = 0.5  # seconds: how soon a silent dead peer is noticed by a waiting recv
RETRY = 0.002  # seconds between tries to reach a peer that does not listen yet
RETRY_TCP = 0.25  # first wait before trying an unreachable TCP address again ...
MAX_BACKOFF = 5.0  # ... doubling up to this
IDLE_POLL = 5  # seconds an idle inbox waits in the store before it looks again
COALESCE = 32 * 1024  # bytes of small messages queued before they are written at once
FLUSH_DELAY = 0.0002  # seconds the last of a burst of sends may wait to be written
log = logging.getLogger("nimbus.messaging")
_PLAIN = (bytes, str)  # pickled straight when small (no out-of-band buffers to find)
_INLINE = 64 * 1024
_BATCHED = _link.BATCHED
_READ = select.POLLIN | select.POLLERR | select.POLLHUP


@runtime_checkable
class Transport(Protocol):
    """What carries messages between instances: the plug point (``Endpoint`` is one)."""

    def send(self, peer: str, obj: object) -> None: ...

    def recv(self, source: str | None = ANY, timeout: float | None = None) -> Any: ...


class Endpoint:
    """One instance: ``send``/``recv`` to and from other instances of the program."""

    def __init__(
        self,
        client: Callable[[], redis.Redis],
        keys: Keys,
        token: bytes,
        directory: Path,
        *,
        instance_id: str | None = None,
        tcp_host: str | None = None,
        ttl_ms: int = 3_600_000,
        direct: bool = True,
        host: str | None = None,
    ) -> None:
        self.id = instance_id or secrets.token_hex(8)
        self.pid = os.getpid()
        self._client = client  # called when needed: making a client is slow on a busy host
        self._keys = keys
        self._token = token
        self._ttl_ms = ttl_ms
        self._sockdir = directory
        self.direct = direct  # False: every message goes through the store (for comparison)
        self.directory = Directory(client, keys, ttl_ms)
        self._out: dict[str, _link.Link] = {}
        self._out_lock = threading.Lock()
        # one numbering per peer, whichever way its messages go (taken without a lock)
        self._seq: dict[str, itertools.count[int]] = collections.defaultdict(itertools.count)
        self._retry_at: dict[str, float] = {}
        self._backoff: dict[str, float] = {}
        self._dirty: set[_link.Link] = set()  # links holding coalesced messages
        self._flush_soon = threading.Event()
        self._flush_armed = False  # the flusher will write the dirty links soon
        self._flusher: threading.Thread | None = None
        self._recvs = 0
        # receiving: links in, the mailbox (per-sender order)
        self._mailbox = Mailbox()
        self._io = threading.RLock()  # reading the inbound sockets
        self._in: dict[int, _link.Link] = {}
        self._new_in: list[_link.Link] = []
        self._poll = select.poll()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poll.register(self._wake_r, _READ)
        self._closed = False
        # listening
        self._path = socket_path(directory, self.id)
        self._listeners = [self._listen_unix()]
        tcp = None
        if tcp_host:
            lsock = socket.create_server((tcp_host, 0), backlog=128)
            self._listeners.append(lsock)
            tcp = (tcp_host, lsock.getsockname()[1])
        self.entry = Entry(host or host_id(), self.pid, str(self._path), tcp, ALIVE)
        self.directory.set_local(self.id, self.entry)
        # daemon threads started without waiting for them to run (Thread.start waits,
        # which costs milliseconds on a busy host, in the path of a new instance)
        for lsock in self._listeners:
            _thread.start_new_thread(self._acceptor, (lsock,))
        _thread.start_new_thread(self._inbox, ())

    def _listen_unix(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._path.unlink()
        except FileNotFoundError:
            pass
        sock.bind(str(self._path))
        os.chmod(self._path, 0o600)
        sock.listen(128)
        return sock

    # ------------------------------------------------------------ background

    def _acceptor(self, lsock: socket.socket) -> None:
        while not self._closed:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return  # closed
            link = _link.accept(
                conn, me=self.id, program_id=self._keys.program_id, token=self._token
            )
            if link is not None:
                with self._mailbox.lock:
                    self._new_in.append(link)
                self._wake()

    def _inbox(self) -> None:
        """Publish this instance, then take the messages that went through the store.

        Peers on this host find the socket by its path at once; the directory
        entry (for peers elsewhere) goes out here, off the path of a new instance.
        """
        try:
            self.directory.publish()
        except StateStoreError:
            pass  # lookups from other hosts fail until the next publish (at close)
        key = self._keys.inbox(self.id)
        while not self._closed:
            try:
                popped: Any = self._client().blpop([key], timeout=IDLE_POLL)
                if popped is None:
                    continue
                sender, seq, tag, parts, readonly = unpack(popped[1])
            except (redis.RedisError, OSError, ValueError, TypeError) as exc:
                if self._closed:
                    return
                log.debug("nimbus.messaging: inbox of %s: %r", self.id, exc)
                time.sleep(0.1)
                continue
            self._mailbox.put(sender, seq, tag, parts[0], _link.writable_as_sent(parts, readonly))
            self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # full (a wake-up is pending anyway) or closed
            pass

    # ------------------------------------------------------------ sending

    def send(self, peer: str, obj: object, tag: Any = 0) -> None:
        """Send ``obj`` to instance ``peer``: over a socket if it listens, else the store.

        Small ``bytes`` travel as they are over sockets (no pickle at either end).
        """
        if type(obj) is bytes and len(obj) <= _BATCHED:
            link = self._out.get(peer)
            # a send after a send (no recv between) to a connected peer: queue it, no lock
            if link is not None and link.recvs == self._recvs:
                link.pending.append((tag, obj, True))
                link.queued += len(obj)
                if link.queued >= COALESCE:
                    with link.lock:
                        self._write(link)
                elif not link.armed:  # read after the append: see ``_flush_dirty``
                    self._arm(link)
                return
            self._send_slow(peer, link, tag, obj, [], True)
            return
        raws: list[Any] = []
        if type(obj) in _PLAIN and len(obj) < _INLINE:  # type: ignore[arg-type]
            data = pickle.dumps(obj, 5)  # the common small case, no detour
        else:
            data, buffers = serialization.dumps(obj)
            raws = [b.raw() for b in buffers]
        link = self._out.get(peer)
        if link is not None and link.recvs == self._recvs and not raws and len(data) <= _BATCHED:
            link.pending.append((tag, data, False))
            link.queued += len(data)
            if link.queued >= COALESCE:
                with link.lock:
                    self._write(link)
            elif not link.armed:
                self._arm(link)
            return
        self._send_slow(peer, link, tag, data, raws, False)

    def _send_slow(
        self, peer: str, link: _link.Link | None, tag: Any, data: bytes, raws: list[Any], raw: bool
    ) -> None:
        """Send one message that does not just join a link's ``pending`` queue.

        ``raw``: ``data`` is the ``bytes`` sent, not a pickle.
        """
        if link is None and self.direct:
            link = self._open(peer)
        if link is None:
            if raw:
                data = pickle.dumps(data, 5)
            self._push_store(peer, self._number(peer, 1), tag, data, raws)
            return
        with link.lock:
            if link.error is not None:
                raise PeerLost(f"instance {peer} is lost: {link.error}")
            if link.pending:
                link.frame_pending(self._number)  # what waits goes first
            seq = next(self._seq[peer])
            # the first send since a receive goes now (a request waits for its reply);
            # more sends in a row are coalesced, up to COALESCE bytes or FLUSH_DELAY
            now = link.recvs != self._recvs
            link.recvs = self._recvs
            if now and not raws and len(data) <= _link.SMALL_LIMIT:
                try:
                    if link.send_now(seq, tag, data, raw):
                        return
                except OSError as exc:
                    self._drop_out(link)
                    raise PeerLost(f"instance {peer} is lost: {exc}") from exc
                self._flush(link)
                return
            link.queue(seq, tag, data, raws, raw)
            if now or link.channel.pending_output >= COALESCE:
                self._flush(link)
                return
        if not link.armed:
            self._arm(link)

    def _number(self, peer: str, n: int) -> int:
        """Reserve ``n`` consecutive sequence numbers for messages to ``peer``; the first.

        Atomic without a lock: ``next`` of a count, and ``list(islice(count))``
        run in C without a switch of threads in between.
        """
        if n == 1:
            return next(self._seq[peer])
        taken = list(itertools.islice(self._seq[peer], n))  # all n at once, not one by one
        return taken[0]

    def _write(self, link: _link.Link) -> None:
        """Frame and write what ``link`` holds (``link.lock`` held)."""
        if link.error is None:
            link.frame_pending(self._number)
            self._flush(link)

    def _arm(self, link: _link.Link) -> None:
        """Have the flusher write ``link`` within FLUSH_DELAY."""
        link.armed = True
        self._dirty.add(link)  # before the flag is read (the flusher clears it, then flushes)
        if not self._flush_armed:
            self._defer()

    def _defer(self) -> None:
        """Wake the flusher (started on first use)."""
        self._flush_armed = True
        if self._flusher is None:
            self._flusher = threading.Thread(
                target=self._flush_later, name="nimbus-msg-flush", daemon=True
            )
            self._flusher.start()
        self._flush_soon.set()

    def _flush_later(self) -> None:
        while not self._closed:
            self._flush_soon.wait()
            self._flush_soon.clear()
            time.sleep(FLUSH_DELAY)
            self._flush_armed = False
            self._flush_dirty()

    def _flush_dirty(self) -> None:
        """Write every coalesced message now (before waiting, at close, from the flusher).

        A link's ``armed`` is cleared before its ``pending`` is taken: a send
        that appended and then saw ``armed`` set is in what is taken; one that
        saw it clear arms the link again.
        """
        while self._dirty:
            try:
                link = self._dirty.pop()
            except KeyError:
                return
            with link.lock:
                link.armed = False
                try:
                    self._write(link)
                except PeerLost as exc:
                    link.error = exc

    def _open(self, peer: str) -> _link.Link | None:
        """A link to ``peer``, or None while it does not listen (its messages go to the store)."""
        if peer == self.id:
            raise ValueError("an instance cannot send to itself")
        now = time.monotonic()
        if now < self._retry_at.get(peer, 0.0):
            return None
        address: tuple[str, Any]
        local = socket_path(self._sockdir, peer)
        if os.path.exists(local):
            address = ("unix", str(local))
        else:
            entry = self.directory.lookup(peer)
            if entry is not None and entry.state == ALIVE and entry.host == self.entry.host:
                entry = self.directory.refresh(peer)  # its socket went away: did it exit?
            if entry is not None and entry.state == EXITED:
                raise PeerExited(f"instance {peer} has exited")
            if entry is None or entry.host == self.entry.host or entry.tcp is None:
                self._retry_at[peer] = now + RETRY
                return None
            address = ("tcp", entry.tcp)
        try:
            link = _link.connect(
                address,
                peer=peer,
                me=self.id,
                program_id=self._keys.program_id,
                token=self._token,
            )
        except PeerUnreachable:
            self.directory.invalidate(peer)
            if address[0] == "tcp":  # a timeout costs up to a second: back off
                backoff = min(MAX_BACKOFF, 2 * self._backoff.get(peer, RETRY_TCP / 2))
                self._backoff[peer] = backoff
                self._retry_at[peer] = time.monotonic() + backoff
            else:
                self._retry_at[peer] = now + RETRY
            return None
        self._backoff.pop(peer, None)
        with self._out_lock:
            old = self._out.get(peer)
            if old is not None:  # another thread opened one meanwhile
                link.close()
                return old
            self._out[peer] = link
        return link

    def _push_store(self, peer: str, seq: int, tag: Any, data: bytes, raws: list[Any]) -> None:
        key = self._keys.inbox(peer)
        parts = [data, *(bytes(r) for r in raws)]
        message = pack((self.id, seq, tag, parts, _link.readonly_mask(raws)))
        try:
            pipe = self._client().pipeline(transaction=False)
            pipe.rpush(key, message)
            pipe.pexpire(key, self._ttl_ms)
            pipe.execute()
        except redis.RedisError as exc:
            raise StateStoreError(f"cannot queue a message for {peer}: {exc}") from exc

    def _flush(self, link: _link.Link) -> None:
        """Write what ``link`` holds; while its socket is full, read our own sockets."""
        try:
            while not link.channel.flush():
                self._progress(0.05, writer=link)
        except OSError as exc:
            self._drop_out(link)
            raise PeerLost(f"instance {link.peer} is lost: {exc}") from exc

    def _drop_out(self, link: _link.Link) -> None:
        with self._out_lock:
            if self._out.get(link.peer) is link:
                del self._out[link.peer]
        self.directory.invalidate(link.peer)
        link.close()

    # ------------------------------------------------------------ receiving

    def recv(self, source: str | None = ANY, timeout: float | None = None, tag: Any = 0) -> Any:
        """The next message (from ``source``, or from anyone); waits up to ``timeout``."""
        return self.recv_with_source(source, timeout, tag)[1]

    def recv_with_source(
        self, source: str | None = ANY, timeout: float | None = None, tag: Any = 0
    ) -> tuple[str, Any]:
        """``(sender, obj)`` of the next message (from ``source``, or from anyone)."""
        self._recvs += 1
        if self._dirty:
            self._flush_dirty()
        mailbox = self._mailbox
        if mailbox.mail:  # the common case: no wait
            found = mailbox.pop(source, tag)
            if found is not None:
                return found
        return self._wait(source, timeout, tag)

    def _wait(self, source: str | None, timeout: float | None, tag: Any) -> tuple[str, Any]:
        """``recv_with_source`` when what it wants is not waiting yet."""
        mailbox = self._mailbox
        deadline = next_check = None
        while True:
            seen = mailbox.arrivals
            if mailbox.mail:
                found = mailbox.pop(source, tag)
                if found is not None:
                    return found
            if source is not None:
                ended = mailbox.ended.get(source)
                if ended == EXITED:
                    raise PeerExited(f"instance {source} exited; it sent nothing more")
                if ended is not None:
                    raise PeerLost(f"instance {source} is lost: its connection broke")
            now = time.monotonic()
            if next_check is None:
                next_check = now + HEARTBEAT
                deadline = None if timeout is None else now + timeout
            if deadline is not None and now >= deadline:
                raise MessagingTimeout(
                    f"no message from {source or 'any instance'} within {timeout} s"
                    + self._never_seen(source)
                )
            if source is not None and now >= next_check:
                self._check_alive(source)
                next_check = now + HEARTBEAT
            wait = min(HEARTBEAT, next_check - now) if source is not None else HEARTBEAT
            if deadline is not None:
                wait = min(wait, deadline - now)
            self._progress(max(wait, 0.0), seen=seen)

    def _never_seen(self, source: str | None) -> str:
        """A hint for a timeout: ``source`` never became an instance (not started?)."""
        if source is None or os.path.exists(socket_path(self._sockdir, source)):
            return ""
        try:
            if self.directory.refresh(source) is not None:
                return ""
        except StateStoreError:
            return ""
        return f"; instance {source} never became addressable (was it started?)"

    def _check_alive(self, peer: str) -> None:
        """Raise if ``peer`` is known dead or exited (for a recv waiting on it)."""
        path = socket_path(self._sockdir, peer)
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
            except ConnectionRefusedError as exc:
                raise PeerLost(f"instance {peer} is gone (its socket refuses connections)") from exc
            except OSError:
                pass
            finally:
                probe.close()
            return
        entry = self.directory.refresh(peer)
        if entry is not None and entry.state == EXITED:
            self._progress(0.0)
            with self._mailbox.lock:
                if not any(link.peer == peer for link in self._in.values()):
                    self._mailbox.ended.setdefault(peer, EXITED)

    def _progress(
        self, timeout: float, writer: _link.Link | None = None, seen: int | None = None
    ) -> None:
        """Wait up to ``timeout`` for input (or for ``writer``'s socket to drain); read it.

        ``seen`` is the arrival count the caller last looked at: if messages
        arrived since (read by another thread), this returns without waiting.
        """
        if not self._io.acquire(True, timeout):
            return  # another thread is reading; what it reads lands in the mailbox
        try:
            if seen is not None and seen != self._mailbox.arrivals:
                timeout = 0.0
            if self._new_in:
                self._adopt_new()
            if writer is not None:
                self._poll.register(writer.sock, select.POLLOUT)
            try:
                events = self._poll.poll(timeout * 1000)
            finally:
                if writer is not None:
                    self._poll.unregister(writer.sock)
            for fd, _ in events:
                if fd == self._wake_r:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                    self._adopt_new()
                    continue
                link = self._in.get(fd)
                if link is not None:
                    self._read(link)
        finally:
            self._io.release()

    def _adopt_new(self) -> None:
        if self._new_in:
            with self._mailbox.lock:
                new, self._new_in = self._new_in, []
            for link in new:
                self._in[link.fileno()] = link
                self._poll.register(link.fileno(), _READ)
                self._read(link)

    def _read(self, link: _link.Link) -> None:
        try:
            frames = link.channel.receive()
        except (OSError, ProtocolError):
            frames = None
        if frames:
            self._mailbox.deliver(link, frames)
        if frames is None:  # end of stream
            fd = link.fileno()
            self._poll.unregister(fd)
            del self._in[fd]
            link.close()
            self._mailbox.end(link.peer, EXITED if link.closed_cleanly else "lost")

    # ------------------------------------------------------------ closing

    def close(self) -> None:
        """Say goodbye to the peers, stop listening and mark this instance exited."""
        if self._closed or os.getpid() != self.pid:
            return
        self._flush_dirty()
        self._closed = True
        self._flush_soon.set()
        for link in list(self._out.values()):
            try:
                with link.lock:
                    link.channel.send(_link.BYE, pack(self._number(link.peer, 1)))
                    link.sock.setblocking(True)
                    link.sock.settimeout(1.0)
                    link.channel.flush()
            except OSError:
                pass
            link.close()
        self._out.clear()
        for lsock in self._listeners:
            try:
                lsock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            lsock.close()
        try:
            self._path.unlink()
        except FileNotFoundError:
            pass
        try:
            self.directory.set_local(self.id, dataclasses.replace(self.entry, state=EXITED))
            self.directory.publish()
            # wake the inbox thread out of its BLPOP so that it ends now
            key = self._keys.inbox(self.id)
            pipe = self._client().pipeline(transaction=False)
            pipe.rpush(key, b"")
            pipe.pexpire(key, 1000)
            pipe.execute()
        except (StateStoreError, redis.RedisError):
            pass
        for link in list(self._in.values()):
            link.close()
        self._in.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def statistics(self) -> dict[str, int]:
        """Links out and in, messages waiting, and bytes moved over sockets."""
        links = [*self._out.values(), *self._in.values()]
        return {
            "links_out": len(self._out),
            "links_in": len(self._in),
            "waiting": len(self._mailbox.mail),
            "bytes_out": sum(link.channel.bytes_out for link in links),
            "bytes_in": sum(link.channel.bytes_in for link in links),
        }
