"""The switch to direct messaging that Pipes and Queues share: one reader, its writers.

::

    writer W (a Producer)          state store                          reader H (a Consumer)
    send --RPUSH-----------------> <list> --BLPOP/LPOP----------------> take   (store)
         <-EVAL switch (each CHECK)- holder = H:<token> <---claim------ first read
         --switch: RPUSH "S" H|W --> (list) ------------"S" popped-----> W's mail opens
    send --nimbus.messaging (tag: list|claim) -------------------------> take   (direct)
    claim gone: "R" direct, wait for H's "F" (W's mail is in the list) ...then RPUSH

A *lane* is one direction: a Queue, or the direction of a Pipe that one end
reads. Its keys are a :class:`Lane`; :mod:`_qdirect` and :mod:`_direct` are
the two thin lanes that build them and add what only their kind needs.

*Claim.* The first process of the program to read a lane claims it (the
``holder`` key). A second process reading while the holder lives marks the
lane *shared*, for good, deletes the claim and pushes it to the holder's
``giveup`` list (a holder found dead is replaced instead: nothing of it can be
saved). A thread of each holding process waits on that list (BLPOP: no
traffic while idle), so a claim is given up at any moment, whatever the
holder's own reads are doing. Holding a copy of a Pipe end or a Queue is no
use: only reading is, so the stdlib documentation's ``a, b = Pipe()`` whose
parent keeps ``b`` goes direct.

*Switch, per writer.* Every process that writes a lane has one
:class:`Producer` for it. While it sends, it looks at the claim every CHECK
seconds; when a process other than its own holds it, one script records the
writer in ``writers`` and pushes ``S<claim>|<writer>`` into the list, and from
there its messages go to the holder's socket. The holder delivers a writer's
direct messages only after it read that writer's ``S`` from the list.
Everything the writer put before is ahead of the marker, so each writer's
order holds; writers switch independently (a second writer is no reason to
go back to the store).

*Give up.* When its claim is gone (a second reader, or its own close or
exit), the holder takes, under its lock, what it received directly and did
not deliver, and the ``writers`` switched to the claim (the script that reads
them also deletes the claim, so no writer joins them later). Their messages
go to the tail of the list, then whatever still arrives from each, up to its
``R``. A writer that finds the claim gone pushes it to the holder's
``giveup`` list, sends ``R`` and waits for the holder's ``F`` before it
pushes to the list again, so its messages reach the list in order. Every
message is delivered by the holder or taken from the list: once.

*Failures.* A killed writer loses what it had not sent. A writer whose
direct send fails (the holder is gone) goes back to the list without ``R``,
never to switch to that claim again. A holder killed
by a signal loses what was sent to it directly and not yet delivered; the
next reader replaces its claim. A holder that exits normally gives its claim
up and forwards until each switched writer sent ``R``, is gone, or has sent
nothing for QUIET seconds (GRACE at most; ``_forward``).

*Store only.* Shared lanes, processes of another program or that cannot be
instances, ``NIMBUS_MESSAGING_DIRECT=0``.
"""

from __future__ import annotations

import collections
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import util
from typing import TYPE_CHECKING, Any, TypeVar

from nimbus._lazy import lazy
from nimbus.errors import ConfigError, MessagingTimeout, PeerExited, PeerLost, StateStoreError
from nimbus.multiprocessing import _site as _state
from nimbus.multiprocessing._forward import Forwarder, file_message, stop_all, take_direct
from nimbus.multiprocessing._payload import REVERT, Item
from nimbus.statestore import Program, link
from nimbus.statestore.lua import HANDOVER_CLAIM as _CLAIM
from nimbus.statestore.lua import HANDOVER_GIVE_UP as _GIVE_UP
from nimbus.statestore.lua import HANDOVER_SHARE as _SHARE
from nimbus.statestore.lua import HANDOVER_STEAL as _STEAL
from nimbus.statestore.lua import HANDOVER_SWITCH as _SWITCH

if TYPE_CHECKING:
    from nimbus import messaging
else:  # on first use: messaging imports redis-py, half of what importing nimbus costs
    messaging = lazy("nimbus.messaging", globals())

__all__ = ["Consumer", "Lane", "Producer", "endpoint", "file_message", "giveup_key", "one"]

CHECK = 0.02  # seconds between a sending writer's looks at the claim
CLAIM_RETRY = 0.05  # seconds between a reader's tries to claim
LOOK = 0.05  # seconds a direct reader waits on its socket before it looks at the list


@dataclass(frozen=True)
class Lane:
    """The keys of one lane: its list, the claim, shared-for-good, the switched writers."""

    list: str
    holder: str
    mode: str
    writers: str


def endpoint(prog: Program) -> Any:
    """This process's instance for ``prog``, or None (direct off, a process of another
    program, or it cannot be one, e.g. its socket path would be too long: the store will do)."""
    if not messaging.direct_enabled() or _state.current() != prog:
        return None
    try:
        return messaging.current()
    except (ConfigError, OSError) as exc:
        util.debug(f"nimbus: this process stays in the store: {exc!r}")
        return None


def giveup_key(prog: Program, instance: str) -> str:
    """The list where instance ``instance`` finds the claims it must give up."""
    return prog.keys.giveup(instance)


# ---------------------------------------------------------------- the reader


class Consumer:
    """This process's reading side of one lane: its claim and its direct messages."""

    def __init__(self, prog: Program, lane: Lane) -> None:
        self.prog = prog
        self.lane = lane
        self.lock = threading.Lock()  # the claim, the opened writers, the pending messages
        self.claim: str | None = None
        self.tag = ""
        self.done = False  # this lane stays in the store for this process
        self.opened: set[str] = set()  # writers whose "S" was read: deliverable
        # direct, not delivered (a writer's entry goes when it is empty: see ``_file``)
        self.pending: dict[str, collections.deque[Item]] = {}
        self.gone: set[str] = set()  # switched writers found gone (they send no more)
        self.solo: str | None = None  # the one opened writer, not gone (the common case)
        self._next_try = 0.0
        self._next_look = 0.0

    def try_claim(self) -> None:
        """Claim the lane at a read (at most every CLAIM_RETRY seconds)."""
        now = time.monotonic()
        if self.done or self.claim is not None or now < self._next_try:
            return
        self._next_try = now + CLAIM_RETRY
        ep = endpoint(self.prog)
        if ep is None:
            self.done = True
            return
        lane, ttl = self.lane, self.prog.ttl_ms
        claim = f"{ep.id}:{secrets.token_hex(4)}"
        store = link(self.prog)
        found = store.eval(_CLAIM, [lane.holder, lane.mode], [claim, ttl])
        if found[0] == 1:
            self._claimed(claim)
            return
        if found[0] == 2:
            holder = found[1].decode()
            instance = holder.partition(":")[0]
            if instance == ep.id:
                return  # our own claim, given up a moment ago: try again later
            if not ep.alive(instance):
                if store.eval(_STEAL, [lane.holder, lane.mode], [holder, claim, ttl]):
                    self._claimed(claim)
                return
            giveup = giveup_key(self.prog, instance)
            store.eval(_SHARE, [lane.holder, lane.mode, giveup], [holder, ttl])
        self.done = True

    def _claimed(self, claim: str) -> None:
        with self.lock:
            self.claim = claim
            self.tag = f"{self.lane.list}|{claim}"  # of its direct messages
        _watch(self, claim.partition(":")[0])

    def marker(self, item: bytes) -> None:
        """A switch marker read from the list: its writer's direct messages may go now."""
        claim, _, source = item[1:].decode().partition("|")
        with self.lock:
            if claim == self.claim:
                self.opened.add(source)
                self._set_solo()

    def active(self) -> bool:
        """Whether direct messages may come (claimed, some writer switched)."""
        return self.claim is not None and bool(self.opened or self.pending)

    def look_at_list(self) -> bool:
        """Whether a direct reader should look at the list now: every LOOK seconds
        (writers not switched yet), or at once when a writer's "S" is awaited."""
        now = time.monotonic()
        if now >= self._next_look:
            self._next_look = now + LOOK
            return True
        pending = self.pending
        if not pending:  # the common case, at each direct message
            return False
        opened = self.opened
        return any(s not in opened for s in list(pending))

    def held(self) -> int:
        """Messages received directly and not delivered (the socket read first)."""
        if self.active():
            with self.lock:
                if self.claim is not None:
                    take_direct(self.tag, self.pending)
        return sum(len(q) for q in list(self.pending.values()))

    def take(self) -> Item | None:
        """A deliverable direct message, if any (the socket is read when none is)."""
        with self.lock:
            if self.claim is None:
                return None
            item = self._deliverable()
            if item is None:
                take_direct(self.tag, self.pending)
                item = self._deliverable()
            return item

    def receive(self, timeout: float) -> Item | None:
        """A deliverable direct message, waiting up to ``timeout`` for one: the common
        case, one wait that hands the message over as it is read."""
        lock = self.lock  # acquire/release: cheaper than ``with``, at each message
        lock.acquire()
        try:
            if self.claim is None:
                return None
            if not self.pending:  # one switched writer, nothing else: exactly its next
                return self._receive(self.solo, timeout)
            item = self._deliverable()
            return item if item is not None else self._receive(None, timeout)
        finally:
            lock.release()

    def receive_next(self) -> Item | None:
        """:meth:`receive` for LOOK seconds in the common case (one switched writer,
        nothing pending, no :meth:`look_at_list` due); None: not it, or nothing came."""
        if self.pending or time.monotonic() >= self._next_look:
            return None
        lock = self.lock
        lock.acquire()
        try:
            only = self.solo
            if only is None or self.pending:
                return None
            message = messaging.current().recv_next(only, self.tag, LOOK)
            if message is messaging.NOTHING:
                return None  # nothing came, or not the simple case: the general way
            if type(message) is not list and message != REVERT:
                return message  # type: ignore[no-any-return]
            file_message(self.pending, only, message)
            return self._deliverable()
        finally:
            lock.release()

    def _set_solo(self) -> None:
        """``solo`` after the opened or gone writers changed (``lock`` held)."""
        opened = self.opened
        only = next(iter(opened)) if len(opened) == 1 else None
        self.solo = None if only in self.gone else only

    def _receive(self, only: str | None, timeout: float) -> Item | None:
        """Wait up to ``timeout`` for a direct message (from ``only``, if not None: one
        switched writer, nothing pending); a deliverable one or None (``lock`` held)."""
        try:
            source, message = messaging.current().recv_with_source(only, timeout, self.tag)
        except MessagingTimeout:
            return None
        except (PeerLost, PeerExited):
            self.gone.add(only or "")  # it sent nothing more: wait for anyone now
            self._set_solo()
            return None
        if source == only and type(message) is not list and message != REVERT:
            return message  # type: ignore[no-any-return]
        file_message(self.pending, source, message)
        return self._deliverable()

    def writer_gone(self) -> bool:
        """Whether the lane ended because its writers died (never, for a queue)."""
        return False

    def _deliverable(self) -> Item | None:
        pending = self.pending
        for source in self.opened:
            found = pending.get(source)
            if found and found[0] != REVERT:  # nothing follows "R": the claim is going
                item = found.popleft()
                if not found:
                    del pending[source]
                return item
        return None

    def give_up(self, *, at_exit: bool = False, read_again: bool = True) -> None:
        """Give the claim up (or find it gone): see the module's docstring. With
        ``read_again=False`` (no copy of the end left) exit waits for no silent writer."""
        with self.lock:
            claim, self.claim = self.claim, None
            self.done = True
            if claim is None:
                return
            lane = self.lane
            switched = link(self.prog).eval(_GIVE_UP, [lane.holder, lane.writers], [claim])
            pending, self.pending, self.opened = self.pending, {}, set()
            self.solo = None
            forwarder = Forwarder(self.prog, lane.list, self.tag, switched, pending)
            if not read_again:
                forwarder.quiet = 0.0
            forwarder.step()
        if forwarder.waiting:
            forwarder.start(at_exit)


# ---------------------------------------------------------------- the writer


class Producer:
    """This process's writing side of one lane (shared by its objects of the lane)."""

    def __init__(self, prog: Program, lane: Lane) -> None:
        self.prog = prog
        self.lane = lane
        self.lock = threading.Lock()  # one sender at a time: one order
        self.peer: str | None = None  # the holder's instance, while switched
        self.claim = b""
        self.tag = ""
        self.dead = b""  # a claim whose holder we could not reach
        self.off = False  # the lane is shared: store only, for good
        self._next_check = 0.0

    def send(self, message: Any) -> bool:
        """Send ``message`` (one, or a batch: a list) directly if switched; False: the
        caller pushes it to the list."""
        lock = self.lock  # acquire/release: cheaper than ``with``, at each message
        lock.acquire()
        try:
            now = time.monotonic()
            if now >= self._next_check and not self.off:
                self._check(now)
            peer = self.peer
            if peer is None:
                return False
            try:  # ``send_switched``, inline: the common case
                messaging.current().send(peer, message, self.tag)
                return True
            except (PeerLost, PeerExited):  # the holder is gone: the list will do
                self.dead = self.claim
                self._revert(notify=False)
                return False
        finally:
            lock.release()

    def send_switched(self, message: Any) -> bool:
        """Send ``message`` to the holder now (``lock`` held, switched); False: it is gone."""
        peer = self.peer
        assert peer is not None
        try:
            messaging.current().send(peer, message, self.tag)
            return True
        except (PeerLost, PeerExited):  # the holder is gone: the list will do
            self.dead = self.claim
            self._revert(notify=False)
            return False

    def _check(self, now: float) -> None:
        self._next_check = now + CHECK
        lane = self.lane
        store = link(self.prog)
        if self.peer is not None:
            if store.command("GET", lane.holder) != self.claim:
                self._revert(notify=True)
            return
        holder, shared = store.call(("MGET", lane.holder, lane.mode))[0]
        if shared is not None:
            self.off = True
            return
        if holder is None or holder == self.dead:
            return
        ep = endpoint(self.prog)  # this process becomes an instance only now
        if ep is None:
            self.off = True
            return
        args = [ep.id, self.dead, self.prog.ttl_ms]
        found = store.eval(_SWITCH, [lane.holder, lane.mode, lane.writers, lane.list], args)
        if found == -1:
            self.off = True
        elif isinstance(found, bytes):
            self.peer = found.decode().partition(":")[0]
            self.claim = found
            self.tag = f"{lane.list}|{found.decode()}"

    def _revert(self, *, notify: bool) -> None:
        """Back to the list: "R" to the holder, and its "F" once it forwarded our messages."""
        peer, tag, claim = self.peer, self.tag, self.claim
        self.peer, self.claim, self.tag = None, b"", ""
        if peer is None or not notify:
            return
        ep = messaging.current()
        giveup, ttl = giveup_key(self.prog, peer), self.prog.ttl_ms
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


_lock = threading.Lock()
_sides: dict[tuple[str, str, str], Any] = {}  # (store, list, kind): this process's side
_claimed: list[Consumer] = []
_watchers: set[str] = set()  # giveup lists with a thread waiting on them
_exit_registered: list[util.Finalize] = []

_Side = TypeVar("_Side", bound=Consumer | Producer)


def one(make: Callable[[Program, Lane], _Side], prog: Program, lane: Lane) -> _Side:
    """This process's one ``make(prog, lane)`` (its Consumer or Producer of the lane)."""
    key = (prog.url, lane.list, getattr(make, "__name__", ""))
    with _lock:
        found = _sides.get(key)
        if found is None:
            found = _sides[key] = make(prog, lane)
        return found


def _watch(c: Consumer, instance: str) -> None:
    key = giveup_key(c.prog, instance)
    with _lock:
        _claimed.append(c)
        if not _exit_registered:
            _exit_registered.append(util.Finalize(None, _at_exit, exitpriority=8))
        if key in _watchers:
            return
        _watchers.add(key)
    thread = threading.Thread(
        target=_watch_claims, args=(c.prog, key), name="nimbus-claims", daemon=True
    )
    thread.start()


def _watch_claims(prog: Program, key: str) -> None:
    """Give up each claim pushed to ``key`` (a second reader, or a writer that found
    the claim gone, pushed it)."""
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
                util.debug(f"nimbus: giving up {c.lane.list} failed: {exc!r}")


def _at_exit() -> None:
    """Give every claim up and forward (a while) before the endpoint closes."""
    with _lock:
        held = list(_claimed)
        _claimed.clear()
    for c in held:
        try:
            c.give_up(at_exit=True)
        except Exception as exc:  # nobody to raise to at exit
            util.debug(f"nimbus: giving up {c.lane.list} failed: {exc!r}")
    stop_all()


def _forget() -> None:
    """In a forked child: the parent's claims and switches stay the parent's."""
    global _lock
    _lock = threading.Lock()
    _sides.clear()
    _claimed.clear()
    _watchers.clear()
    _exit_registered.clear()


os.register_at_fork(after_in_child=_forget)
