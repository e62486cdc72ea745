"""The receiving half of an instance: links in, read into the mailbox; recv's waits.

::

    a link in (the instance accepted it: _link_in) --wake pipe--> poll() --> _read_events --+
    a message that went through the store (the instance's inbox thread) --------------------+
                                                                                            v
    recv / recv_with_source / poll_tagged  <-------------- the mailbox, in each sender's order
    recv_next(source, tag, timeout)  <-- one read of that writer's link (no poll first)

:class:`Receiver` reads the links in into the
:class:`~nimbus.messaging._mailbox.Mailbox` (in-order delivery) and waits in
``recv``, checking a silent peer's liveness every HEARTBEAT. ``recv_next`` is
the lean wait of a reader of one writer (a Pipe's direction): one read of that
writer's link, which waits in the kernel itself while no other thread reads (no
poll first), after a bounded spin of reads that do not wait (``_spin``: a prompt
reply is read without sleeping; spins that find nothing back off). The instance
(:class:`~nimbus.messaging.Instance`) listens, accepts the links in and hands
them over (:meth:`Receiver._link_in`); the sending half is
:class:`~nimbus.messaging._sending.Sender`.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nimbus.errors import ConfigError, MessagingTimeout, PeerExited, PeerLost, StateStoreError
from nimbus.messaging import _peer
from nimbus.messaging._directory import ALIVE, EXITED, Directory, Entry, socket_path
from nimbus.messaging._mailbox import Mail, Mailbox, Run, decode
from nimbus.wire import ProtocolError

__all__ = ["ANY", "HEARTBEAT", "NOTHING", "Receiver"]

ANY: Any = None
HEARTBEAT = 0.5  # seconds: how soon a silent dead peer is noticed by a waiting recv
SHARED = 1.0  # seconds recv_next polls after it saw another thread reading the sockets
BLOCK = 0.01  # seconds recv_next waits in one link's read (other threads' input waits as long)
SPIN = 50e-6  # seconds recv_next reads without waiting first (``_spin``)
SPIN_BACKOFF = 64  # after spins that found nothing, up to this many waits go without one
BACKGROUND_STEP = 0.02  # seconds: the longest sleep of a background wait (``poll_tagged``)
_READ = select.POLLIN | select.POLLERR | select.POLLHUP
_DONTWAIT = socket.MSG_DONTWAIT
_NOT_A_TAG = object()  # no message has it: ``Mailbox.take`` delivers to the mail
_NOBODY = object()  # ``_progress`` waits for no message in particular
NOTHING: Any = object()  # ``recv_next``: no message (yet), or not the simple case


class Receiver:
    """Receiving from other instances; :class:`~nimbus.messaging.Instance` adds the rest."""

    # set by the instance
    directory: Directory
    entry: Entry
    _sockdir: Path
    # the sending half's (it writes coalesced messages before a receive waits)
    _dirty: set[_peer.Peer]
    _behind: set[_peer.Peer]
    _recvs: int
    _flush_dirty: Callable[..., None]
    _unlinked: Callable[[str, bool], None]

    def __init__(self) -> None:
        self._mailbox = Mailbox()  # per-sender order
        self._io = threading.RLock()  # reading the inbound sockets
        self._in: dict[int, _peer.Peer] = {}
        self._from: dict[str, _peer.Peer] = {}  # the link in from each peer (its latest)
        self._shared_until = 0.0  # till then, recv_next polls: other threads read too
        self._new_in: list[_peer.Peer] | None = []  # None: the links in are closed
        self._poll = select.poll()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poll.register(self._wake_r, _READ)

    def _link_in(self, link: _peer.Peer) -> None:
        """A link in the instance accepted: read from the next wait on (closed if the
        links in were closed meanwhile)."""
        with self._mailbox.lock:
            new = self._new_in
            if new is not None:
                new.append(link)
        if new is None:
            link.close()
        else:
            self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # full (a wake-up is pending anyway) or closed
            pass

    def recv(self, source: str | None = ANY, timeout: float | None = None, tag: Any = 0) -> Any:
        """The next message (from ``source``, or from anyone); waits up to ``timeout``."""
        return self.recv_with_source(source, timeout, tag)[1]

    def recv_with_source(
        self, source: str | None = ANY, timeout: float | None = None, tag: Any = 0
    ) -> tuple[str, Any]:
        """``(sender, obj)`` of the next message (from ``source``, or from anyone)."""
        self._recvs += 1
        if self._dirty or self._behind:
            self._flush_dirty(None if timeout is None else time.monotonic() + timeout)
        mailbox = self._mailbox
        waiting = mailbox.mail
        if waiting:  # the common case: no wait
            try:  # the commonest: the next message of the run at the head (``Mailbox.pop``, inline)
                run = waiting[0]
                if type(run) is Run and run.tag == tag and (source is None or run.sender == source):
                    data = run.pieces.popleft()
                    if run.raw:
                        return run.sender, data
                    return run.sender, decode(run.sender, data, ())
            except IndexError:  # taken meanwhile by another thread
                pass
            found = mailbox.pop(source, tag)
            if found is not None:
                return found
        if timeout is not None and timeout < 0:  # as queue.Queue.get (checked before a wait)
            raise ConfigError(f"recv: timeout must be a non-negative number, not {timeout!r}")
        start = time.monotonic()
        if source is None or source not in mailbox.ended:
            # the next common case: one wait for input, and it is there
            seen = mailbox.arrivals
            wait = HEARTBEAT
            if timeout is not None and timeout < HEARTBEAT:
                wait = timeout if timeout > 0.0 else 0.0
            mail = self._progress(wait, None, seen, source, tag)
            if mail is not None:  # the one message wanted, handed over as it was read
                sender, _, data, buffers = mail
                return sender, decode(sender, data, buffers)
            if mailbox.mail:
                found = mailbox.pop(source, tag)
                if found is not None:
                    return found
        return self._wait(source, timeout, tag, start)

    def _wait(
        self, source: str | None, timeout: float | None, tag: Any, start: float
    ) -> tuple[str, Any]:
        """``recv_with_source`` when what it wants is not waiting yet (since ``start``)."""
        mailbox = self._mailbox
        now = time.monotonic()
        deadline = None if timeout is None else start + timeout
        next_check = start + HEARTBEAT
        while True:
            seen = mailbox.arrivals
            if mailbox.mail:
                found = mailbox.pop(source, tag)
                if found is not None:
                    return found
            wait = HEARTBEAT
            if source is not None:
                ended = mailbox.ended.get(source)
                if ended == EXITED:
                    raise PeerExited(f"instance {source} exited; it sent nothing more")
                if ended is not None:
                    raise PeerLost(f"instance {source} is lost: its connection broke")
                if now >= next_check:
                    self._check_alive(source)
                    next_check = now + HEARTBEAT
                wait = next_check - now
            if deadline is not None:
                if now >= deadline:
                    raise MessagingTimeout(
                        f"no message from {source or 'any instance'} within {timeout} s"
                        + self._never_seen(source)
                    )
                wait = min(wait, deadline - now)
            mail = self._progress(wait, None, seen, source, tag)
            if mail is not None:
                return mail[0], decode(mail[0], mail[2], mail[3])
            now = time.monotonic()

    def poll_tagged(
        self,
        source: str | None,
        tag: Any,
        timeout: float | None = 0.0,
        *,
        background: bool = False,
    ) -> bool:
        """Whether ``recv_with_source(source, tag=tag)`` would return or raise at once.

        True when a message with ``tag`` (from ``source``, or anyone) waits, or
        when ``source`` has ended. Reads the sockets even for a ``timeout`` of
        0; waits up to ``timeout`` seconds (None: forever). For a reader that
        waits on several things (``nimbus.multiprocessing.connection``).

        ``background``: a helper thread's wait (``multiprocessing._forward``), which
        must not delay the program's own reads: it reads what has come, and waits
        outside the sockets (steps of up to BACKGROUND_STEP), never in a poll that
        a reading thread would have to wait for.
        """
        if self._dirty or (self._behind and not background):
            self._flush_dirty(None if timeout is None else time.monotonic() + timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        next_check = time.monotonic() + HEARTBEAT
        wait = 0.0
        step = BACKGROUND_STEP / 16
        while True:
            seen = self._mailbox.arrivals
            if background and wait > 0.0:
                time.sleep(min(wait, step))
                step = min(step * 2, BACKGROUND_STEP)
                self._progress(0.0, seen=seen)
            else:
                self._progress(wait, seen=seen)
            with self._mailbox.lock:
                if self._mailbox.waiting(source, tag):
                    return True
                if source is not None and source in self._mailbox.ended:
                    return True
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            if source is not None and now >= next_check:
                try:
                    self._check_alive(source)
                except (PeerLost, PeerExited):
                    return True
                next_check = now + HEARTBEAT
            wait = HEARTBEAT if deadline is None else min(HEARTBEAT, deadline - now)

    def alive(self, peer: str) -> bool:
        """False if ``peer`` is known to be gone (its socket refuses, or it exited)."""
        try:
            self._check_alive(peer)
        except (PeerLost, PeerExited):
            return False
        return self._mailbox.ended.get(peer) is None

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
        if entry is not None and entry.state == ALIVE and entry.host == self.entry.host:
            # its socket is gone (a program starting here removes the sockets of the
            # killed): is its process?
            try:
                os.kill(entry.pid, 0)
            except ProcessLookupError:
                raise PeerLost(f"instance {peer} is gone (its process {entry.pid} is)") from None
            except OSError:
                pass
        if entry is not None and entry.state == EXITED:
            self._progress(0.0)
            with self._mailbox.lock:
                if not any(link.peer == peer for link in self._in.values()):
                    self._mailbox.ended.setdefault(peer, EXITED)

    def _progress(
        self,
        timeout: float,
        writer: _peer.Peer | list[_peer.Peer] | None = None,
        seen: int | None = None,
        want: Any = _NOBODY,
        tag: Any = 0,
    ) -> Mail | None:
        """Wait up to ``timeout`` for input (or for ``writer``'s socket, or one of a list's,
        to take more); read it.

        ``seen`` is the arrival count the caller last looked at: if messages
        arrived since (read by another thread), this returns without waiting.
        A message from ``want`` (None: anyone) with ``tag``, read alone and next
        in order with no other mail waiting, is returned (undecoded) rather
        than put in the mailbox: the caller waits for exactly it (``Mailbox.take``).
        """
        io = self._io
        if not io.acquire(False):
            # another thread is reading: what it reads lands in the mailbox; for a while
            # no reader blocks on one link only (``recv_next``), all of them poll
            self._shared_until = time.monotonic() + SHARED
            if not io.acquire(True, timeout):
                return None
        found = None
        try:
            if seen is not None and seen != self._mailbox.arrivals:
                timeout = 0.0
            if self._new_in:
                self._adopt_new()
            poll = self._poll
            if writer is None:
                events = poll.poll(timeout * 1000)
            else:
                fds = []
                for w in writer if isinstance(writer, list) else [writer]:
                    fd = w.sock.fileno()
                    if fd >= 0:  # (not a link another thread dropped meanwhile)
                        poll.register(fd, select.POLLOUT)
                        fds.append(fd)
                try:
                    events = poll.poll(timeout * 1000)
                finally:
                    for fd in fds:
                        poll.unregister(fd)
            found = self._read_events(events, want, tag)
        finally:
            io.release()
        return found

    def _read_events(self, events: list[tuple[int, int]], want: Any, tag: Any) -> Mail | None:
        """Read the sockets ``poll`` found ready (``_io`` held); as :meth:`_progress`."""
        found = None
        links = self._in
        for fd, _ in events:
            link = links.get(fd)
            if link is not None:  # as ``_read``, inline: the common case
                try:
                    got = link.channel.receive_message()
                except (OSError, ProtocolError):
                    got = None
                if isinstance(got, tuple):  # one small message
                    if found is None and (link.peer == want or want is None):
                        found = self._mailbox.take(link, got, tag)
                    else:
                        self._mailbox.take(link, got, _NOT_A_TAG)
                elif got:
                    self._mailbox.deliver(link, got)
                elif got is None:
                    self._ended(link)
            elif fd == self._wake_r:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                self._adopt_new()
        return found

    def recv_next(self, source: str, tag: Any, timeout: float) -> Any:
        """The next message from ``source`` with ``tag``, as :meth:`recv` gives it, if it
        comes within ``timeout`` seconds: the wait of a reader of one writer (a Pipe's
        direction), one read of the writer's link with nothing around it.

        The only thread reading waits in that read itself (up to BLOCK seconds; no
        poll first); one that saw others reading lately (SHARED) polls every link.
        :data:`NOTHING` when none came in time, or when anything else is going on
        (mail waiting, another thread reading the sockets, input from another link,
        a message out of its order or with another tag): what was read is in the
        mailbox, and :meth:`recv_with_source` takes it from there (and raises for a
        peer that ended).
        """
        self._recvs += 1
        if self._dirty or self._behind:
            self._flush_dirty(time.monotonic() + timeout)
        if self._mailbox.mail or self._new_in:
            return NOTHING
        io = self._io
        if not io.acquire(False):
            self._shared_until = time.monotonic() + SHARED
            return NOTHING
        try:
            link = self._from.get(source)
            if (
                link is not None
                and timeout >= 0.001
                and not (self._shared_until and time.monotonic() < self._shared_until)
            ):
                wait = timeout if timeout < BLOCK else BLOCK
                if link.wait != wait:
                    _peer.wait_in_reads(link, wait)
                flags = 0  # the read waits
            else:
                events = self._poll.poll(timeout * 1000.0)
                link = self._in.get(events[0][0]) if len(events) == 1 else None
                if link is None or link.peer != source:
                    if events:
                        self._read_events(events, _NOBODY, tag)
                    return NOTHING
                flags = _DONTWAIT
            try:
                got = _spin(link) if flags == 0 else []
                if got == []:
                    got = link.channel.receive_message(flags)
            except (OSError, ProtocolError):
                got = None
            if isinstance(got, tuple):
                mail = self._mailbox.take(link, got, tag)
                if mail is None:
                    return NOTHING
                if mail[3] is None:
                    return mail[2]  # small bytes, sent as they are
                return decode(source, mail[2], mail[3])
            if got:
                self._mailbox.deliver(link, got)
            elif got is None:
                self._ended(link)
            return NOTHING
        finally:
            io.release()

    def _adopt_new(self) -> None:
        if self._new_in:
            with self._mailbox.lock:
                new = self._new_in or []
                if self._new_in is not None:  # (None: closed meanwhile)
                    self._new_in = []
            for link in new:
                self._in[link.fileno()] = link
                self._from[link.peer] = link
                self._poll.register(link.fileno(), _READ)
                if link.early:  # messages read with its HELLO: before what follows them
                    early, link.early = link.early, []
                    self._mailbox.deliver(link, early)
                self._read(link)

    def _read(self, link: _peer.Peer) -> None:
        try:
            frames = link.channel.receive()
        except (OSError, ProtocolError):
            frames = None
        if frames:
            self._mailbox.deliver(link, frames)
        elif frames is None:
            self._ended(link)

    def _ended_as(self, peer: str) -> str | None:
        """How ``peer``'s link in ended ("exited": its goodbye came; "lost"), if it did."""
        return self._mailbox.ended.get(peer)

    def _ended(self, link: _peer.Peer) -> None:
        """``link`` reached its end of stream: forget it; its peer exited or is lost."""
        fd = link.fileno()
        self._poll.unregister(fd)
        del self._in[fd]
        if self._from.get(link.peer) is link:
            del self._from[link.peer]
            for other in self._in.values():  # a second link from the peer (a race at connect)
                if other.peer == link.peer:
                    self._from[link.peer] = other
        link.close()
        self._mailbox.end(link.peer, EXITED if link.closed_cleanly else "lost")
        if link.peer not in self._from:  # no link in from it left
            self._unlinked(link.peer, link.closed_cleanly)

    def _close_links_in(self) -> None:
        """Close the links in and the wake-up pipe (the instance closes)."""
        with self._mailbox.lock:
            new, self._new_in = self._new_in or [], None
        for link in [*self._in.values(), *new]:
            link.close()
        self._in.clear()
        self._from.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)


def _spin(link: _peer.Peer) -> Any:
    """Reads of ``link`` that do not wait, for up to SPIN seconds, before the caller's
    read waits in the kernel: what a read gave, or [] when nothing came.

    A reply that comes within microseconds (a ping-pong between two processes on
    two cores) is read without either process sleeping: waking a sleeping process
    costs more than the whole message here. A spin that finds nothing (the peer
    is busy, or shares this core: spinning only delays it) makes the next
    1, 2, 4, ... SPIN_BACKOFF waiting reads go without one, and a spin that
    finds a message halves that, so a Pipe whose peer does not answer at once
    (or shares a core with it, as on a loaded machine) costs at most SPIN
    every SPIN_BACKOFF messages, and an idle one nothing more. A large message that has begun to come is left
    to the caller's reads, as before (no spin for it: its bytes come as the peer
    writes them, and waiting in the kernel for them costs no more)."""
    if link.spin_skip:
        link.spin_skip -= 1
        return []
    channel = link.channel
    receive = channel.receive_message
    clock = time.perf_counter
    end = clock() + SPIN
    got = receive(_DONTWAIT)
    while got == []:
        if channel.mid_frame:
            return got
        if clock() >= end:
            backoff = link.spin_backoff * 2 or 1
            link.spin_skip = link.spin_backoff = min(backoff, SPIN_BACKOFF)
            return got
        got = receive(_DONTWAIT)
    link.spin_backoff >>= 1  # found: halved (spins keep on while they keep finding)
    return got
