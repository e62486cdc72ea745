"""Queue items straight to the queue's one consumer, with the state store as the fallback.

::

    producer P (its feeder)         state store                          consumer H
    batch --RPUSH----------------> queue:<name> --BLPOP/LPOP-----------> get()   (store)
          <-EVAL switch (each CHECK)- holder = H:<token> <---claim------ first get()
          --switch: RPUSH "S" H|P -> (list) ------------"S" popped-----> P's mail opens
    batch --nimbus.messaging (tag: queue|claim) ------------------------> get()   (direct)
    claim gone: "R" direct, wait for H's "F" (P's mail is in the list) ...then RPUSH

*Claim.* A consumer is whoever calls ``get``. The first process of the program
to call it on an unbounded queue *claims* the queue (the ``holder`` key). A
second process calling ``get`` while the holder lives marks the queue
*shared*, for good, deletes the claim and pushes it to the holder's
``giveup`` list (a holder found dead is replaced instead: nothing of it can
be saved). A thread of each holding process waits on that list (BLPOP: no
traffic while idle), so a claim is given up at any moment, whatever the
holder's own ``get`` is doing.

*Switch, per producer.* Every process that puts has one :class:`Producer` per
queue, which its Queue objects' feeders share. While it sends, it looks at the
claim every CHECK seconds; when a process other than its own holds it, one
script records the producer in ``writers`` and pushes ``S<claim>|<producer>``
into the list, and from there its batches go to the holder's socket. The
holder delivers a producer's direct items only after it read that producer's
``S`` from the list. Everything the producer put before is ahead of the
marker, so each producer's order holds; producers switch independently.

*Give up.* When its claim is gone (a second consumer, or its own close or
exit), the holder takes, under its lock, what it received directly and did
not deliver, and the ``writers`` switched to the claim (the script that reads
them also deletes the claim, so no producer joins them later). Their items go
to the tail of the list, then whatever still arrives from each, up to its
``R``. A producer that finds the claim gone pushes it to the holder's
``giveup`` list, sends ``R`` and waits (its feeder, not ``put``) for the
holder's ``F`` before it pushes to the list again, so its items reach the
list in order. The holder's prefetched list items stay its
own, as in store mode (and go back to the head of the list when it closes).
Every item is delivered by the holder or taken from the list: once.

*Failures.* A killed producer loses what its feeder had not sent (so does the
stdlib's); what it sent arrives. A producer whose direct send fails (the
holder is gone) goes back to the list without ``R``, never to switch to that
claim again. A holder killed by a signal loses what was sent to it directly
and not yet delivered (the stdlib loses at most the item being read, and may
leave the queue's lock held); the next consumer replaces its claim. A holder
that exits normally gives up its claim and forwards until each switched
producer sent ``R``, is gone, or has sent nothing for QUIET seconds (GRACE at
most): a producer whose feeder stalls for longer than QUIET between its look
at the claim and its send would lose that batch.

*Latency.* A ``put`` right after a ``get`` of the same process (a request
and its reply) sends from its own thread when nothing waits for the feeder;
a flood goes through the feeder, a batch a message, so ``put`` never waits
for a consumer that does not read.

*Store only.* Bounded queues (their count lives in the store), shared queues,
processes of another program, ``NIMBUS_MESSAGING_DIRECT=0``.
"""

from __future__ import annotations

import collections
import os
import secrets
import threading
import time
from multiprocessing import util
from typing import Any, TypeVar

from nimbus.errors import MessagingTimeout, PeerExited, PeerLost, StateStoreError
from nimbus.messaging import _api
from nimbus.multiprocessing._direct import endpoint
from nimbus.multiprocessing._payload import REVERT
from nimbus.statestore import Program, link
from nimbus.statestore.lua import (
    QUEUE_LANE_CLAIM as _CLAIM,
)
from nimbus.statestore.lua import (
    QUEUE_LANE_GIVE_UP as _GIVE_UP,
)
from nimbus.statestore.lua import (
    QUEUE_LANE_SHARE as _SHARE,
)
from nimbus.statestore.lua import (
    QUEUE_LANE_STEAL as _STEAL,
)
from nimbus.statestore.lua import (
    QUEUE_LANE_SWITCH as _SWITCH,
)

__all__ = ["ACK", "Consumer", "Producer", "consumer", "producer"]

ACK = b"F"  # the holder to a producer: your direct items are in the list
CHECK = 0.02  # seconds between a sending producer's looks at the claim
CLAIM_RETRY = 0.05  # seconds between a consumer's tries to claim
LOOK = 0.05  # seconds a direct consumer waits on its socket before it looks at the list
QUIET = 0.5  # at exit: a switched producer silent this long is done
GRACE = 3.0  # at exit: the most a holder forwards
_BATCH = 512  # items a forward pushes per command
_PULL = 64  # direct messages (each one item or a batch) taken from the socket at once


class _Keys:
    """The keys of one queue's direct path."""

    def __init__(self, prog: Program, name: str) -> None:
        keys = prog.keys
        self.list = keys.queue(name)
        self.holder = keys.queue_field(name, "holder")
        self.mode = keys.queue_field(name, "mode")
        self.writers = keys.queue_field(name, "writers")


def _tag(list_key: str, claim: str) -> str:
    return f"{list_key}|{claim}"


def _flatten(message: Any) -> list[bytes]:
    """The items of one direct message (a batch is a list)."""
    return message if isinstance(message, list) else [message]


# ---------------------------------------------------------------- the consumer


class Consumer:
    """This process's consuming side of one queue: its claim and its direct items."""

    def __init__(self, prog: Program, name: str) -> None:
        self.prog = prog
        self.keys = _Keys(prog, name)
        self.lock = threading.Lock()  # the claim, the opened producers, the pending items
        self.claim: str | None = None
        self.tag = ""
        self.done = False  # this queue stays in the store for this process
        self.opened: set[str] = set()  # producers whose "S" was read: deliverable
        self.pending: dict[str, collections.deque[bytes]] = {}  # direct, not delivered
        self._next_try = 0.0
        self._next_look = 0.0

    def try_claim(self) -> None:
        """Claim the queue at a ``get`` (at most every CLAIM_RETRY seconds)."""
        now = time.monotonic()
        if self.done or self.claim is not None or now < self._next_try:
            return
        self._next_try = now + CLAIM_RETRY
        ep = _endpoint(self.prog)
        if ep is None:
            self.done = True
            return
        keys, ttl = self.keys, self.prog.ttl_ms
        claim = f"{ep.id}:{secrets.token_hex(4)}"
        store = link(self.prog)
        found = store.eval(_CLAIM, [keys.holder, keys.mode], [claim, ttl])
        if found[0] == 1:
            self._claimed(claim)
            return
        if found[0] == 2:
            holder = found[1].decode()
            instance = holder.partition(":")[0]
            if instance != ep.id and not ep.alive(instance):
                if store.eval(_STEAL, [keys.holder, keys.mode], [holder, claim, ttl]):
                    self._claimed(claim)
                return
            giveup = _giveup_key(self.prog, instance)
            store.eval(_SHARE, [keys.holder, keys.mode, giveup], [holder, ttl])
        self.done = True

    def _claimed(self, claim: str) -> None:
        with self.lock:
            self.claim = claim
            self.tag = _tag(self.keys.list, claim)
        _watch(self, claim.partition(":")[0])

    def marker(self, item: bytes) -> None:
        """A switch marker read from the list: its producer's direct items may go now."""
        claim, _, source = item[1:].decode().partition("|")
        with self.lock:
            if claim == self.claim:
                self.opened.add(source)

    def active(self) -> bool:
        """Whether direct items may come (claimed, some producer switched)."""
        return self.claim is not None and bool(self.opened or self.pending)

    def look_at_list(self) -> bool:
        """Whether a direct consumer should look at the list now: every LOOK seconds
        (producers not switched yet), or at once when a producer's "S" is awaited."""
        now = time.monotonic()
        if now >= self._next_look:
            self._next_look = now + LOOK
            return True
        pending, opened = self.pending, self.opened
        return any(q and s not in opened for s, q in list(pending.items()))

    def held(self) -> int:
        """Items received directly and not delivered (the socket read first)."""
        if self.active():
            with self.lock:
                if self.claim is not None:
                    self._pull()
        return sum(len(q) for q in list(self.pending.values()))

    def take(self) -> bytes | None:
        """A deliverable direct item, if any (the socket is read when none is)."""
        with self.lock:
            if self.claim is None:
                return None
            item = self._deliverable()
            if item is None:
                self._pull()
                item = self._deliverable()
            return item

    def _pull(self) -> None:
        """Move what came directly into ``pending`` (``lock`` held)."""
        _take_direct(self.tag, self.pending)

    def _deliverable(self) -> bytes | None:
        pending = self.pending
        for source in self.opened:
            found = pending.get(source)
            if found and found[0] != REVERT:  # nothing follows "R": the claim is going
                return found.popleft()
        return None

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` for direct mail."""
        tag = self.tag
        if tag:
            _api.current().poll_tagged(None, tag, timeout)

    def give_up(self, *, at_exit: bool = False) -> None:
        """Give the claim up (or find it gone): see the module's docstring."""
        with self.lock:
            claim, self.claim = self.claim, None
            self.done = True
            if claim is None:
                return
            keys = self.keys
            switched = link(self.prog).eval(_GIVE_UP, [keys.holder, keys.writers], [claim])
            pending, self.pending, self.opened = self.pending, {}, set()
            forwarder = _Forwarder(self.prog, keys.list, self.tag, switched, pending)
            forwarder.step()
        if forwarder.waiting:
            forwarder.start(at_exit)


class _Forwarder:
    """A given-up claim's direct items, to the list: each producer's up to its "R"."""

    def __init__(
        self,
        prog: Program,
        list_key: str,
        tag: str,
        switched: list[bytes],
        pending: dict[str, collections.deque[bytes]],
    ) -> None:
        self.prog = prog
        self.list = list_key
        self.tag = tag
        self.waiting = {s.decode() for s in switched} | set(pending)
        self.pending = pending
        self.last = time.monotonic()  # of the last direct message forwarded
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()

    def step(self) -> None:
        """Forward what waits; "F" to each producer whose "R" came."""
        ep, tag = _api.current(), self.tag
        items = self.pending
        self.pending = {}
        if _take_direct(tag, items):
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
                out.append(item)
            for start in range(0, len(out), _BATCH):
                batch = out[start : start + _BATCH]
                store.call(("RPUSH", self.list, *batch), ("PEXPIRE", self.list, ttl))
        for source in done:
            self.waiting.discard(source)
            try:
                ep.send(source, ACK, tag + "|ack")
            except (PeerLost, PeerExited):
                pass

    def start(self, at_exit: bool) -> None:
        self.thread = threading.Thread(target=self._run, name="nimbus-queue-forward", daemon=True)
        with _lock:
            _forwarders.append(self)
        if at_exit:
            self.stop.set()
        self.thread.start()

    def _run(self) -> None:
        ep = _api.current()
        started = time.monotonic()
        next_look = started + 0.5
        try:
            while self.waiting:
                ep.poll_tagged(None, self.tag, 0.1)
                self.step()
                now = time.monotonic()
                if now >= next_look:  # producers gone (killed, exited) send no "R"
                    next_look = now + 0.5
                    gone = [s for s in self.waiting if not ep.alive(s)]
                    if gone:
                        self.step()
                        self.waiting.difference_update(gone)
                if self.stop.is_set() and (now - self.last > QUIET or now - started > GRACE):
                    return
        except Exception as exc:  # the store or the endpoint closed under us at exit
            util.debug(f"nimbus: forwarding {self.list} stopped: {exc!r}")
        finally:
            with _lock:
                if self in _forwarders:
                    _forwarders.remove(self)


# ---------------------------------------------------------------- the producer


class Producer:
    """This process's producing side of one queue (shared by its Queue objects)."""

    def __init__(self, prog: Program, name: str) -> None:
        self.prog = prog
        self.keys = _Keys(prog, name)
        self.lock = threading.Lock()  # one feeder sends at a time: one order
        self.peer: str | None = None  # the holder's instance, while switched
        self.claim = b""
        self.tag = ""
        self.dead = b""  # a claim whose holder we could not reach
        self.off = False  # the queue is shared: store only, for good
        self._next_check = 0.0
        self._gets = -1  # the count of gets at our last send from put's thread

    def send(self, messages: list[bytes]) -> bool:
        """Send a batch directly if switched; False: the caller pushes it to the list."""
        with self.lock:
            now = time.monotonic()
            if now >= self._next_check and not self.off:
                self._check(now)
            peer = self.peer
            if peer is None:
                return False
            try:
                _api.current().send(peer, messages[0] if len(messages) == 1 else messages, self.tag)
                return True
            except (PeerLost, PeerExited):  # the holder is gone: the list will do
                self.dead = self.claim
                self._revert(notify=False)
                return False

    def send_now(self, message: bytes) -> bool:
        """Send one item directly from ``put``'s thread; False: the feeder sends it.

        Only while switched, with no look at the claim due (one may wait for the
        holder), and after a ``get`` of this process since the last such send: a
        request and its reply go at once, while a flood goes through the feeder,
        in batches, and never makes ``put`` wait for a consumer that does not read.
        """
        with self.lock:
            peer = self.peer
            gets = _gets
            if peer is None or gets == self._gets or time.monotonic() >= self._next_check:
                return False
            try:
                _api.current().send(peer, message, self.tag)
                self._gets = gets
                return True
            except (PeerLost, PeerExited):
                self.dead = self.claim
                self._revert(notify=False)
                return False

    def _check(self, now: float) -> None:
        self._next_check = now + CHECK
        keys = self.keys
        store = link(self.prog)
        if self.peer is not None:
            if store.command("GET", keys.holder) != self.claim:
                self._revert(notify=True)
            return
        holder, shared = store.call(("MGET", keys.holder, keys.mode))[0]
        if shared is not None:
            self.off = True
            return
        if holder is None or holder == self.dead:
            return
        ep = _endpoint(self.prog)  # this process becomes an instance only now
        if ep is None:
            self.off = True
            return
        args = [ep.id, self.dead, self.prog.ttl_ms]
        found = store.eval(_SWITCH, [keys.holder, keys.mode, keys.writers, keys.list], args)
        if found == -1:
            self.off = True
        elif isinstance(found, bytes):
            self.peer = found.decode().partition(":")[0]
            self.claim = found
            self.tag = _tag(keys.list, found.decode())

    def _revert(self, *, notify: bool) -> None:
        """Back to the list: "R" to the holder, and its "F" once it forwarded our items."""
        peer, tag, claim = self.peer, self.tag, self.claim
        self.peer, self.claim, self.tag = None, b"", ""
        if peer is None or not notify:
            return
        ep = _api.current()
        giveup, ttl = _giveup_key(self.prog, peer), self.prog.ttl_ms
        try:  # the holder's thread gives the claim up now, if it has not yet
            link(self.prog).call(("RPUSH", giveup, claim), ("PEXPIRE", giveup, ttl))
        except StateStoreError:
            pass
        try:
            ep.send(peer, REVERT, tag)
            ep.recv_with_source(peer, None, tag + "|ack")  # returns or raises in a heartbeat
        except (PeerLost, PeerExited):  # gone: what it held is lost with it
            pass


# ---------------------------------------------------------------- this process's


_gets = 0  # Queue gets in this process (see Producer.send_now)


def _take_direct(tag: Any, into: dict[str, collections.deque[bytes]]) -> int:
    """Move up to _PULL direct messages with ``tag`` into ``into`` (per producer, in
    order; bounded: producers may send faster than we read); how many came."""
    ep = _api.current()
    for n in range(_PULL):
        if not ep.poll_tagged(None, tag, 0):
            return n
        try:
            source, message = ep.recv_with_source(None, 0, tag)
        except MessagingTimeout:
            return n
        found = into.get(source)
        if found is None:
            found = into[source] = collections.deque()
        found.extend(_flatten(message))
    return _PULL


def got() -> None:
    """A Queue ``get`` returned here."""
    global _gets
    _gets += 1


_lock = threading.Lock()
_consumers: dict[str, Consumer] = {}
_producers: dict[str, Producer] = {}
_claimed: list[Consumer] = []
_forwarders: list[_Forwarder] = []
_watchers: set[str] = set()  # giveup lists with a thread waiting on them
_exit_registered: list[util.Finalize] = []


def consumer(prog: Program, name: str) -> Consumer:
    """This process's consumer of queue ``name`` (one for all its Queue objects)."""
    return _one(_consumers, Consumer, prog, name)


def producer(prog: Program, name: str) -> Producer:
    """This process's producer of queue ``name`` (one for all its Queue objects)."""
    return _one(_producers, Producer, prog, name)


_Side = TypeVar("_Side", Consumer, Producer)


def _one(table: dict[str, _Side], make: type[_Side], prog: Program, name: str) -> _Side:
    """The one ``make(prog, name)`` of this process, kept in ``table``."""
    key = f"{prog.url}|{prog.keys.queue(name)}"
    with _lock:
        found = table.get(key)
        if found is None:
            found = table[key] = make(prog, name)
        return found


def _endpoint(prog: Program) -> Any:
    """This process's instance for ``prog``, or None (direct off, another program's
    process, or it cannot be one: e.g. its socket path would be too long)."""
    try:
        return endpoint(prog)
    except Exception as exc:
        util.debug(f"nimbus: queues stay in the store here: {exc!r}")
        return None


def _giveup_key(prog: Program, instance: str) -> str:
    """The list where instance ``instance`` finds the claims it must give up."""
    return prog.keys.queue_field(instance, "giveup")


def _watch(c: Consumer, instance: str) -> None:
    key = _giveup_key(c.prog, instance)
    with _lock:
        _claimed.append(c)
        if not _exit_registered:
            _exit_registered.append(util.Finalize(None, _at_exit, exitpriority=8))
        if key in _watchers:
            return
        _watchers.add(key)
    thread = threading.Thread(
        target=_watch_claims, args=(c.prog, key), name="nimbus-queue-claims", daemon=True
    )
    thread.start()


def _watch_claims(prog: Program, key: str) -> None:
    """Give up each claim pushed to ``key`` (a second consumer, or a producer that
    found the claim gone, pushed it)."""
    store = link(prog)
    while True:
        try:
            popped = store.command("BLPOP", key, 0)
        except Exception as exc:  # the store closed under us (at exit)
            util.debug(f"nimbus: watching {key} stopped: {exc!r}")
            with _lock:
                _watchers.discard(key)
            return
        claim = popped[1].decode()
        with _lock:
            found = [c for c in _claimed if c.claim == claim]
            _claimed[:] = [c for c in _claimed if c.claim is not None and c.claim != claim]
        for c in found:
            try:
                c.give_up()
            except Exception as exc:
                util.debug(f"nimbus: giving up {c.keys.list} failed: {exc!r}")


def _at_exit() -> None:
    """Give every claim up and forward (a while) before the endpoint closes."""
    with _lock:
        held = list(_claimed)
        _claimed.clear()
    for c in held:
        try:
            c.give_up(at_exit=True)
        except Exception as exc:  # nobody to raise to at exit
            util.debug(f"nimbus: giving up {c.keys.list} failed: {exc!r}")
    with _lock:
        found = list(_forwarders)
    for f in found:
        f.stop.set()
    for f in found:
        if f.thread is not None:
            f.thread.join(GRACE + 1.0)


def _forget() -> None:
    """In a forked child: the parent's claims and switches stay the parent's."""
    global _lock
    _lock = threading.Lock()
    _consumers.clear()
    _producers.clear()
    _claimed.clear()
    _forwarders.clear()
    _watchers.clear()
    _exit_registered.clear()


os.register_at_fork(after_in_child=_forget)
