"""Pipe messages straight between instances, with the state store as the fallback.

::

    writer W                       state store                       reader H
    send --RPUSH-----------------> pipe:<name>:<end> --BLPOP--------> recv   (store mode)
         <-GET holder (every CHECK)-- holder = H:<epoch>  <--claim--- first recv (refs == 1)
         --switch: RPUSH "S" H|sid -> (list)  -----------"S" popped--> direct mode, from W
    send --nimbus.messaging (tag = the lane) ------------------------> recv   (direct mode)
    pickle or holder gone: "R" direct, then RPUSH "M" sid -----------> back to store mode
    close: "E" direct (end-of-stream), no store EOS

A *lane* is one direction of a pipe. Its reader *claims* it when it starts
reading and its end has one copy; its writer *switches* when the lane has a
holder and both ends have one copy each (so there is one reader and one
writer, and nobody else can read or write the list behind their backs). The
switch pushes an in-band marker ``S`` into the list atomically with those
checks: the reader reads the store up to the marker, then the writer's direct
messages, so order holds and nothing is read twice. A writer that pickles its
end (a second writer copy) or finds the claim gone *reverts*: ``R`` as its
last direct message, then the marker ``M`` as its first item in the list. A
writer that cannot reach the holder (its direct send fails) reverts with
``M<sid>!`` and no ``R``; a direct reader looks for it at the head of the list
every ``LOOK`` seconds, and a reader whose writer died reads end-of-stream.

A holder that pickles its end (another process may read it next) gives the
claim up, and what it took but did not deliver goes back into the list. If its
writer had already reverted, the writer's direct messages still on their way
(up to ``R``) go in before the writer's ``M``. If it had not, the give-up
*parks* the writer: its store messages after its revert wait in a side list,
while a thread of the old holder forwards the direct messages that still reach
it to the end of the list; at ``R`` (or ``E``, or the writer's death) the
parked messages follow them and the lane is free again. No reader can read
past a message that is still on its way, whatever the timing. One switch per
claim: a holder that reads ``R`` claims afresh. Closing a held end ends the
lane (its only reader copy is gone); the writer notices within ``CHECK``.

What still goes through the store, and why: every direction with more than
one copy of an end (competing readers or writers: the list is what they
share), messages sent before the switch (the reader may not be an instance
yet), ends used by processes outside the program, and the hand-over of a
claim (forwarding). A holder killed while forwarding loses what it held (the
stdlib would not); a writer that pickles its end while parked may see its
parked messages overtaken by the new copy's.
"""

from __future__ import annotations

import collections
import secrets
import threading
import time
from dataclasses import dataclass
from multiprocessing import util
from typing import Any

from nimbus.errors import ConfigError, MessagingTimeout, PeerExited, PeerLost
from nimbus.messaging import _api
from nimbus.messaging._instance import Instance
from nimbus.multiprocessing import _site as _state
from nimbus.multiprocessing._payload import EOS, MARK, REVERT, Item, as_message
from nimbus.statestore import Keys, Link, Program, link
from nimbus.statestore.lua import (
    PIPE_CLAIM as _CLAIM,
)
from nimbus.statestore.lua import (
    PIPE_DROP as _DROP,
)
from nimbus.statestore.lua import (
    PIPE_GIVE_UP as _GIVE_UP,
)
from nimbus.statestore.lua import (
    PIPE_INSERT as _INSERT,
)
from nimbus.statestore.lua import (
    PIPE_PARKED_PUSH as _PARKED_PUSH,
)
from nimbus.statestore.lua import (
    PIPE_REVERT as _REVERT,
)
from nimbus.statestore.lua import (
    PIPE_SWITCH as _SWITCH,
)
from nimbus.statestore.lua import (
    PIPE_UNPARK as _UNPARK,
)

__all__ = ["Lane", "Reader", "Writer", "endpoint", "lanes"]

CHECK = 0.02  # seconds between a writer's looks at the lane's holder
CLAIM_RETRY = 0.05  # seconds between a reader's tries to claim its lane
GRACE = 1.0  # seconds a process at exit keeps forwarding after giving a claim up
LOOK = 0.5  # seconds a direct reader waits before it looks whether the writer reverted
PARK_LIMIT = 2.0  # seconds a parked writer waits before it asks whether the holder lives
_BATCH = 512


@dataclass(frozen=True)
class Lane:
    """One direction of a pipe: its list and the keys of its switch."""

    list: str
    holder: str
    writer: str
    park: str
    parked: str
    reader_refs: str
    writer_refs: str
    tag: str  # of its direct messages


def lanes(keys: Keys, name: str) -> tuple[Lane, Lane]:
    """The two lanes of pipe ``name``: lane ``e`` is read by end ``e``."""
    return tuple(  # type: ignore[return-value]
        Lane(
            keys.pipe(name, e),
            keys.pipe_holder(name, e),
            keys.pipe_writer(name, e),
            keys.pipe_park(name, e),
            keys.pipe_parked(name, e),
            keys.pipe_refs(name, e),
            keys.pipe_refs(name, 1 - e),
            f"pipe:{name}:{e}",
        )
        for e in (0, 1)
    )


def endpoint(prog: Program) -> Instance | None:
    """This process's instance, if direct messaging is on and it belongs to ``prog``
    (None too if it cannot be one, e.g. its socket path would be too long: the store will do)."""
    if not _api.direct_enabled() or _state.current() != prog:
        return None
    try:
        return _api.current()
    except ConfigError as exc:
        util.debug(f"nimbus: pipes stay in the store here: {exc}")
        return None


class Reader:
    """The direct side of a pipe end that reads a lane."""

    def __init__(self, prog: Program, lane: Lane) -> None:
        self.prog = prog
        self.lane = lane
        self.tag = lane.tag
        self.claim: str | None = None  # our claim while we hold the lane
        self.source: str | None = None  # the switched writer we read, after its "S"
        self.sid: str | None = None
        self.ready: collections.deque[Item] = collections.deque()  # direct, not delivered
        self._reverted: set[str] = set()  # switches whose "R" we read
        self._next_try = 0.0
        self._look_at = 0.0

    def try_claim(self) -> None:
        """Claim the lane (at most every CLAIM_RETRY seconds)."""
        now = time.monotonic()
        if self.claim is not None or now < self._next_try:
            return
        self._next_try = now + CLAIM_RETRY
        ep = endpoint(self.prog)
        if ep is None or _forwarding(self.lane):
            return
        claim = f"{ep.id}:{secrets.token_hex(4)}"
        lane = self.lane
        if link(self.prog).eval(_CLAIM, [lane.holder, lane.reader_refs], [claim, self.prog.ttl_ms]):
            self.claim = claim

    def marker(self, item: bytes) -> None:
        """A switch marker read from the list: read its writer directly if it is for us."""
        claim, _, sid = item[1:].decode().partition("|")
        if claim == self.claim:
            self.sid = sid
            self.source = sid.partition(":")[0]

    def take(self, buffer: collections.deque[bytes]) -> Item | None:
        """The writer's next direct message, waiting for it as long as it takes; None:
        the writer reverted (the reader goes back to the list, ``buffer`` first).

        Whether the writer failed to reach us (its "M<sid>!" heads the list) is
        looked at only when it has been silent for LOOK seconds: its direct
        messages that did arrive come first anyway.
        """
        ready = self.ready
        if ready:
            return ready.popleft()
        source, tag = self.source, self.tag
        recv = _api.current().recv_with_source
        while True:
            try:
                message = recv(source, LOOK, tag)[1]
                break
            except MessagingTimeout:
                if self._unreached(buffer):
                    self._reverted_now()
                    return None
            except (PeerLost, PeerExited):
                return EOS  # the lane's only writer is gone: end of stream
        if message == REVERT:
            self._reverted_now()
            return None
        return message  # type: ignore[no-any-return]

    def fill(self, timeout: float | None, buffer: collections.deque[bytes]) -> bool:
        """Wait up to ``timeout`` for the writer's next direct message; False if none
        (or the writer reverted: the reader goes back to the list, ``buffer`` first)."""
        assert self.source is not None
        ep = _api.current()
        if timeout is None:  # whatever comes next, looking now and then
            if not self.ready:
                item = self.take(buffer)
                if item is None:
                    return False
                self.ready.append(item)
            return True
        deadline = time.monotonic() + timeout
        try:
            while True:
                now = time.monotonic()
                if now >= self._look_at:  # now and then: did the writer fail to reach us?
                    self._look_at = now + LOOK
                    if self._unreached(buffer):
                        self._reverted_now()
                        return False
                if deadline > now:
                    wait = min(LOOK, deadline - now)
                    try:
                        message = ep.recv_with_source(self.source, wait, self.lane.tag)[1]
                        break
                    except MessagingTimeout:
                        continue
                if not ep.poll_tagged(self.source, self.lane.tag, 0):
                    return False
                message = ep.recv_with_source(self.source, None, self.lane.tag)[1]
                break
        except (PeerLost, PeerExited):
            message = EOS  # the lane's only writer is gone: end of stream
        if message == REVERT:
            self._reverted_now()
            return False
        self.ready.append(message)
        return True

    def _unreached(self, buffer: collections.deque[bytes]) -> bool:
        """Whether the writer reverted without its "R": its "M<sid>!" heads the list."""
        mark = MARK + (self.sid or "").encode() + b"!"
        head: Any = buffer[0] if buffer else link(self.prog).command("LINDEX", self.lane.list, 0)
        return bool(head == mark)

    def _reverted_now(self) -> None:
        """Back to the list; one switch per claim, so the next one needs a new claim."""
        self._reverted.add(self.sid or "")
        self.source = self.sid = None
        self.drop()
        self._next_try = 0.0

    def give_up(self) -> None:
        """Stop reading directly (the end is being pickled; what it took from the list
        went back to the list's head first): see the module's docstring."""
        claim, self.claim = self.claim, None
        lane = self.lane
        store = link(self.prog)
        record = store.eval(
            _GIVE_UP, [lane.holder, lane.writer, lane.park], [claim, self.prog.ttl_ms]
        )
        sid, _, rest = (record or b"").decode().partition("|")
        switched_to, _, state = rest.partition("|")
        ready: list[Item] = list(self.ready)
        self.ready = collections.deque()
        self.source = self.sid = None
        if not sid or switched_to != claim or sid in self._reverted:
            return
        source = sid.partition(":")[0]
        if state.startswith("R"):  # it reverted: its last direct messages are on their way,
            # up to "R" (none are, if it could not send "R")
            items, end = _collect(source, lane.tag, ready, block=state == "R")
            _insert(store, self.prog, lane, sid, items)
            if end == "lost":
                _finish(store, self.prog, lane, sid, [], end)
            return
        items, end = _collect(source, lane.tag, ready, block=False)
        _finish(store, self.prog, lane, sid, items, end)
        if end is None:
            _start_forwarder(self.prog, lane, sid)

    def drop(self) -> None:
        """Give the claim up as the end closes (the lane has no reader any more)."""
        if self.claim is not None:
            claim, self.claim = self.claim, None
            self.source = self.sid = None
            link(self.prog).eval(_DROP, [self.lane.holder], [claim])


class Writer:
    """The direct side of a pipe end that writes a lane."""

    def __init__(self, prog: Program, lane: Lane) -> None:
        self.prog = prog
        self.lane = lane
        self.tag = lane.tag
        self.peer: str | None = None  # the holder we send to, once switched
        self.ep: Instance | None = None  # this process's instance, which sends to it
        self.claim: bytes | None = None
        self.sid = ""
        self.parked: str | None = None  # the holder forwarding our last direct messages
        self._parked_at = 0.0
        self._next_check = 0.0

    def send(self, message: Item) -> bool:
        """Send ``message`` directly if switched (looking at the holder every CHECK
        seconds); False: the caller pushes it to the list."""
        now = time.monotonic()
        if now >= self._next_check:
            self._check(now)
        ep = self.ep
        if ep is not None and self.peer is not None:
            try:
                ep.send(self.peer, message, self.tag)
                return True
            except (PeerLost, PeerExited):  # the only reader copy is gone: the list will do
                self.revert(notify=False)
        if self.parked is not None:
            self._push_parked(as_message(message))
            return True
        return False

    def _push_parked(self, message: bytes) -> None:
        lane = self.lane
        keys = [lane.park, lane.parked, lane.list]
        link(self.prog).eval(_PARKED_PUSH, keys, [self.sid, self.prog.ttl_ms, message])

    def _check(self, now: float) -> None:
        self._next_check = now + CHECK
        lane = self.lane
        store = link(self.prog)
        if self.parked is not None:
            if store.command("GET", lane.park) != self.sid.encode():
                self.parked = None
            elif now - self._parked_at > PARK_LIMIT and not _api.current().alive(self.parked):
                # the holder died while forwarding: what it held is lost with it
                keys = [lane.park, lane.parked, lane.list]
                store.eval(_UNPARK, keys, [self.sid, self.prog.ttl_ms])
                self.parked = None
            return
        if self.peer is None and not _api.direct_enabled():
            return
        holder = store.command("GET", lane.holder)
        if self.peer is not None:
            if holder != self.claim:
                self.revert()
            return
        if holder is None:
            return
        ep = endpoint(self.prog)
        if ep is None or holder.decode().partition(":")[0] == ep.id:
            return
        sid = f"{ep.id}:{secrets.token_hex(4)}"
        keys = [lane.holder, lane.writer, lane.reader_refs, lane.writer_refs, lane.list, lane.park]
        switched = store.eval(_SWITCH, keys, [sid, self.prog.ttl_ms])
        if switched:
            self.peer, self.claim, self.sid = switched.decode().partition(":")[0], switched, sid
            self.ep = ep

    def revert(self, *, notify: bool = True) -> None:
        """Go back to the list: "R" to the holder, then "M" into the list (or parked)."""
        peer, claim, self.peer, self.claim = self.peer, self.claim, None, None
        if peer is None or claim is None:
            return
        sent = False
        if notify:
            try:
                _api.current().send(peer, REVERT, self.lane.tag)
                sent = True
            except (PeerLost, PeerExited):
                pass
        lane = self.lane
        keys = [lane.writer, lane.park, lane.list, lane.parked]
        args = [self.sid, claim.decode(), self.prog.ttl_ms, "" if sent else "!"]
        if link(self.prog).eval(_REVERT, keys, args):
            self.parked, self._parked_at = peer, time.monotonic()

    def close(self) -> bool:
        """End-of-stream of the end's only copy, after its direct or parked messages;
        False: the caller pushes it to the list."""
        if self.peer is not None:
            try:
                _api.current().send(self.peer, EOS, self.lane.tag)
                self.peer = None
                return True
            except (PeerLost, PeerExited):  # "M<sid>!" first, then EOS to the list
                self.revert(notify=False)
                return False
        if (
            self.parked is not None
            and link(self.prog).command("GET", self.lane.writer_refs) == b"1"
        ):
            self._push_parked(EOS)
            return True
        return False


# ---------------------------------------------------------------- forwarding


def _collect(
    source: str, tag: str, items: list[Item], *, block: bool
) -> tuple[list[Item], str | None]:
    """A switched writer's direct messages: those waiting (or, with ``block``, all up to
    its "R"), and how its stream ended: "R", "E", "lost" (it died) or None (not yet)."""
    if items and items[-1] == EOS:
        return items, "E"
    ep = _api.current()
    while block or ep.poll_tagged(source, tag, 0):
        try:  # returns or raises within a heartbeat
            message = ep.recv_with_source(source, None, tag)[1]
        except (PeerLost, PeerExited):
            return items, "lost"
        if message == REVERT:
            return items, "R"
        items.append(message)
        if message == EOS:
            return items, "E"
    return items, None


def _insert(store: Link, prog: Program, lane: Lane, sid: str, items: list[Item]) -> None:
    """Put ``items`` into the list before the writer's "M" (or last, if it is not there)."""
    pivot = MARK + sid.encode()
    for start in range(0, len(items), _BATCH):
        batch = [as_message(item) for item in items[start : start + _BATCH]]
        store.eval(_INSERT, [lane.list], [pivot, prog.ttl_ms, *batch])


def _finish(
    store: Link, prog: Program, lane: Lane, sid: str, items: list[Item], end: str | None
) -> None:
    """Forward ``items`` to the end of the list; when the writer's stream has ended,
    its parked store messages follow (and end-of-stream, if it died)."""
    for start in range(0, len(items), _BATCH):
        batch = [as_message(item) for item in items[start : start + _BATCH]]
        store.call(("RPUSH", lane.list, *batch), ("PEXPIRE", lane.list, prog.ttl_ms))
    if end is not None:
        store.eval(_UNPARK, [lane.park, lane.parked, lane.list], [sid, prog.ttl_ms])
    if end == "lost":
        store.call(("RPUSH", lane.list, EOS), ("PEXPIRE", lane.list, prog.ttl_ms))


_forwarders: dict[str, tuple[threading.Thread, threading.Event, float]] = {}
_forwarders_lock = threading.Lock()


def _forwarding(lane: Lane) -> bool:
    found = _forwarders.get(lane.list)
    return found is not None and found[0].is_alive()


def _start_forwarder(prog: Program, lane: Lane, sid: str) -> None:
    stop = threading.Event()
    thread = threading.Thread(
        target=_forward, args=(prog, lane, sid, stop), name="nimbus-pipe-forward", daemon=True
    )
    with _forwarders_lock:
        if not _forwarders:
            util.Finalize(None, _stop_forwarders, exitpriority=7)
        _forwarders[lane.list] = (thread, stop, time.monotonic())
    thread.start()


def _forward(prog: Program, lane: Lane, sid: str, stop: threading.Event) -> None:
    """Forward what a switched writer sends after the claim was given up, to its "R"."""
    source = sid.partition(":")[0]
    store = link(prog)
    try:
        ep = _api.current()
        while True:
            if not ep.poll_tagged(source, lane.tag, 0.1):
                if stop.is_set():
                    return
                continue
            items, end = _collect(source, lane.tag, [], block=False)
            _finish(store, prog, lane, sid, items, end)
            if end is not None:
                return
    except Exception as exc:  # the store or the endpoint closed under us at exit
        util.debug(f"nimbus: forwarding {lane.list} stopped: {exc!r}")


def _stop_forwarders() -> None:
    """At exit: keep forwarding until GRACE after each give-up, then stop."""
    with _forwarders_lock:
        found = list(_forwarders.values())
        _forwarders.clear()
    for thread, stop, started in found:
        thread.join(max(0.0, started + GRACE - time.monotonic()))
        stop.set()
        thread.join(1.0)
