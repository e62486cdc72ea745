"""Writing what an instance's links out hold: coalesced small messages, large ones behind
their sends, and the flusher thread.

::

    send (a burst) --> link.pending --_arm--> _dirty --the flusher, FLUSH_DELAY later,
                                                      or the next recv, or the close--+
    send (BEHIND bytes or more, all ``bytes``): what the socket did not take          |
                   --> the link's channel --_arm--> _dirty                            |
                                                                                      v
    _flush_dirty: every dirty link framed, then all of them written at once as each
                  socket takes more (``_behind`` until written), reading the
                  instance's own sockets meanwhile

Sends in a row of small messages become one write (``COALESCE`` bytes, or
``FLUSH_DELAY`` at most). A large message that nothing can change once its send
returns (``fixed``: a pickle made by the send, or ``bytes``; an array's buffers are
written before it returns) is not waited for: an exchange's sends in a row to
several peers fill all their links together instead of one after the other.
Whoever writes them, a receive and the close wait for all of them (``_behind``); a
large one whose write breaks raises at the next send to its peer, or is logged at
close (``_failed``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from nimbus.errors import MessagingError
from nimbus.messaging import _peer

__all__ = ["BEHIND", "COALESCE", "FLUSH_DELAY", "Flusher", "fixed"]

BEHIND = 1 << 20  # bytes of a message from which what the socket does not take at once
# is written behind its send (the flusher, the next recv), not waited for by it
COALESCE = 32 * 1024  # bytes of small messages queued before they are written at once
FLUSH_DELAY = 0.0002  # seconds the last of a burst of sends may wait to be written


class Flusher:
    """The links out that hold what is not written yet, and who writes it; the
    :class:`~nimbus.messaging._sending.Sender` that queues it gives the rest."""

    _closed: bool  # set by the instance

    def __init__(self) -> None:
        self._dirty: set[_peer.Peer] = set()  # links holding coalesced messages
        self._behind: set[_peer.Peer] = set()  # links taken from _dirty, not written yet
        self._large: set[_peer.Peer] = set()  # links writing a large message behind its send
        self._failed: dict[str, MessagingError] = {}  # peer: such a write broke
        self._flush_soon = threading.Event()
        self._flush_armed = False  # the flusher will write the dirty links soon
        self._flusher: threading.Thread | None = None

    def _progress(self, timeout: float, writer: _peer.Peer | list[_peer.Peer] | None = None) -> Any:
        """Read this instance's sockets until ``writer``'s (or one of the ``writer``
        list's) can take more (the instance's)."""
        raise NotImplementedError

    def _number(self, peer: str, n: int) -> int:
        """Reserve ``n`` sequence numbers for messages to ``peer`` (the sender's)."""
        raise NotImplementedError

    def _drop_out(self, link: _peer.Peer) -> None:
        """Forget broken ``link`` and close it (the sender's)."""
        raise NotImplementedError

    def _gone(self, peer: str, exc: BaseException) -> MessagingError:
        """The error of a link to ``peer`` that broke (the sender's)."""
        raise NotImplementedError

    def _write(self, link: _peer.Peer) -> None:
        """Frame and write what ``link`` holds (``link.lock`` held)."""
        if link.error is None:
            link.frame_pending(self._number)
            self._flush(link)

    def _arm(self, link: _peer.Peer) -> None:
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

    def _flush_dirty(self, until: float | None = None) -> None:
        """Write every coalesced or large message queued (before waiting, at close, from
        the flusher): all the links at once, each as its socket takes more, reading
        this instance's own sockets meanwhile (several large messages to several peers
        go out together, each link busy; none waits for another's to drain).

        A link's ``armed`` is cleared before its ``pending`` is taken: a send
        that appended and then saw ``armed`` set is in what is taken; one that
        saw it clear arms the link again. A link taken from ``_dirty`` is in
        ``_behind`` until its socket took everything (it joins ``_behind`` before it
        leaves ``_dirty``): every thread here writes all of them, and returns only
        when both are empty, so a close, or a receive, that comes while another
        thread (the flusher) writes a link waits for that link too. ``until``: a
        receive's deadline (``time.monotonic()``), after which it returns anyway (a
        peer that does not read makes it wait, not miss its timeout).
        """
        dirty, behind = self._dirty, self._behind
        while dirty or behind:
            behind.update(dirty)  # (one C call: a set of links, hashed by identity)
            while dirty:
                try:
                    link = dirty.pop()
                except KeyError:
                    break
                with link.lock:
                    link.armed = False
                    if link.error is None:
                        link.frame_pending(self._number)
            full: list[_peer.Peer] = []
            for link in list(behind):
                with link.lock:
                    try:
                        if link.error is not None or link.channel.flush():
                            behind.discard(link)
                            self._large.discard(link)
                            continue
                    except OSError as exc:
                        behind.discard(link)
                        self._lost(link, exc)
                        continue
                full.append(link)
            if full:
                wait = 0.05
                if until is not None:
                    wait = min(wait, until - time.monotonic())
                    if wait <= 0.0:
                        return
                self._progress(wait, full)

    def _lost(self, link: _peer.Peer, exc: OSError) -> None:
        """A write behind its send broke (``link.lock`` held): the link is dropped. If it
        held a large message written behind its send (``_large``), the error is raised at
        the next send to its peer (logged at close if none comes), as that send would
        have raised had it waited; coalesced small messages, as ever, raise at a later
        send only as the peer's new link (or its absence) says."""
        large = link in self._large
        self._drop_out(link)
        link.error = error = self._gone(link.peer, exc)
        if large:
            self._failed.setdefault(link.peer, error)

    def _flush(self, link: _peer.Peer) -> None:
        """Write what ``link`` holds; while its socket is full, read our own sockets."""
        try:
            while not link.channel.flush():
                self._progress(0.05, writer=link)
        except OSError as exc:
            self._drop_out(link)
            raise self._gone(link.peer, exc) from exc


def fixed(raws: list[Any]) -> bool:
    """Whether the out-of-band buffers of a message are all of ``bytes`` objects, which
    nobody can change (so they may be written after its send returned)."""
    return all(type(raw.obj) is bytes for raw in raws)
