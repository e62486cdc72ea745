"""A holder that gave its claim up: its direct messages, forwarded to the lane's list.

::

    writer W                          holder H (claim gone)                     state store
    send --direct (tag: list|claim)--> Forwarder.step --RPUSH (batches)------> <list>
    "R" (W's last direct message) ---> "F" to W: its direct messages are in the list;
                                       W pushes to the list again from there

Part of the handover (``_handover``'s docstring: *Give up*): a writer's direct
messages reach the list before the ones it pushes after its "R", so each
writer's order holds across the switch back. At exit a holder forwards until
each switched writer sent "R", is gone, or has sent nothing for QUIET seconds
(GRACE at most). Meanwhile it waits off the sockets (``poll_tagged(background=True)``):
a forwarder waiting in them stalled the program's reads of its other Pipes by up to
0.1 s a message. Also the two helpers that read the direct messages of a lane
into per-writer queues, which the holder's reads use too.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from multiprocessing import util
from typing import TYPE_CHECKING, Any

from nimbus._lazy import lazy
from nimbus.errors import MessagingTimeout, PeerExited, PeerLost
from nimbus.multiprocessing._payload import REVERT, Item, as_message
from nimbus.statestore import Program, link

if TYPE_CHECKING:
    from nimbus import messaging
else:  # on first use: messaging imports redis-py
    messaging = lazy("nimbus.messaging", globals())

__all__ = ["ACK", "GRACE", "Forwarder", "file_message", "stop_all", "take_direct"]

ACK = b"F"  # the holder to a writer: your direct messages are in the list
QUIET = 0.5  # at exit: a switched writer silent this long is done
GRACE = 3.0  # at exit: the most a holder forwards
_BATCH = 512  # messages a forward pushes per command
_PULL = 64  # direct messages (each one message or a batch) taken from the socket at once


def take_direct(tag: Any, into: dict[str, collections.deque[Item]]) -> int:
    """Move up to _PULL direct messages with ``tag`` into ``into`` (per writer, in
    order; bounded: writers may send faster than we read); how many came."""
    ep = messaging.current()
    for n in range(_PULL):
        if not ep.poll_tagged(None, tag, 0):
            return n
        try:
            source, message = ep.recv_with_source(None, 0, tag)
        except MessagingTimeout:
            return n
        file_message(into, source, message)
    return _PULL


def file_message(into: dict[str, collections.deque[Item]], source: str, message: Any) -> None:
    """File a direct message (one, or a batch: a list) under its writer (a writer has
    an entry while something of it waits: ``Consumer.pending`` is empty when nothing does)."""
    items = message if isinstance(message, list) else (message,)
    if not items:
        return
    found = into.get(source)
    if found is None:
        found = into[source] = collections.deque()
    found.extend(items)


class Forwarder:
    """A given-up claim's direct messages, to the list: each writer's up to its "R"."""

    def __init__(
        self,
        prog: Program,
        list_key: str,
        tag: str,
        switched: list[bytes],
        pending: dict[str, collections.deque[Item]],
    ) -> None:
        self.prog = prog
        self.list = list_key
        self.tag = tag
        self.waiting = {s.decode() for s in switched} | set(pending)
        self.pending = pending
        self.last = time.monotonic()  # of the last direct message forwarded
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()
        self.quiet = QUIET  # at exit: how long a silent writer is waited for

    def step(self) -> int:
        """Forward what waits; "F" to each writer whose "R" came; how many direct
        messages it took from the socket (``_PULL``: more may wait there)."""
        ep, tag = messaging.current(), self.tag
        items = self.pending
        self.pending = {}
        taken = take_direct(tag, items)
        if taken:
            self.last = time.monotonic()
        done = []
        store = link(self.prog)
        ttl = self.prog.ttl_ms
        for source, queue in items.items():
            out: list[bytes] = []
            for item in queue:
                if item == REVERT:
                    done.append(source)
                    break
                out.append(as_message(item))
            for start in range(0, len(out), _BATCH):
                batch = out[start : start + _BATCH]
                store.call(("RPUSH", self.list, *batch), ("PEXPIRE", self.list, ttl))
        for source in done:
            self.waiting.discard(source)
            try:
                ep.send(source, ACK, tag + "|ack")
            except (PeerLost, PeerExited):
                pass
        return taken

    def start(self, at_exit: bool) -> None:
        self.thread = threading.Thread(target=self._run, name="nimbus-forward", daemon=True)
        with _lock:
            _forwarders.append(self)
        if at_exit:
            self.stop.set()
        self.thread.start()

    def _run(self) -> None:
        ep = messaging.current()
        started = time.monotonic()
        next_look = started + 0.5
        try:
            while self.waiting:
                # the program's own reads go first: this waits off the sockets (a
                # forwarder that waited in them stalled the program's other Pipes)
                ep.poll_tagged(None, self.tag, 0.1, background=True)
                self.step()
                now = time.monotonic()
                if now >= next_look:  # writers gone (killed, exited) send no "R"
                    next_look = now + 0.5
                    gone = [s for s in self.waiting if not ep.alive(s)]
                    if gone:  # what they sent before they went, all of it, first
                        while self.step() == _PULL:  # (at exit: GRACE at most)
                            if self.stop.is_set() and time.monotonic() - started > GRACE:
                                return
                        self.waiting.difference_update(gone)
                if self.stop.is_set() and (now - self.last > self.quiet or now - started > GRACE):
                    return
        except Exception as exc:  # the store or the endpoint closed under us at exit
            util.debug(f"nimbus: forwarding {self.list} stopped: {exc!r}")
        finally:
            with _lock:
                if self in _forwarders:
                    _forwarders.remove(self)


_lock = threading.Lock()
_forwarders: list[Forwarder] = []  # running: stopped (and joined a while) at exit


def stop_all() -> None:
    """At exit: every forwarder stops once its writers are quiet (GRACE at most)."""
    with _lock:
        found = list(_forwarders)
    for f in found:
        f.stop.set()
    for f in found:
        if f.thread is not None and f.quiet:  # quiet 0: no reader left to forward to
            f.thread.join(GRACE + 1.0)


def _forget() -> None:
    """In a forked child: the parent's forwarders stay the parent's."""
    global _lock
    _lock = threading.Lock()
    _forwarders.clear()


os.register_at_fork(after_in_child=_forget)
