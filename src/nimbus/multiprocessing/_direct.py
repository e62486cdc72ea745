"""The Pipe lane of the handover engine: one direction of a pipe, straight to its reader.

::

    writing end's copies           state store                        reading end's copies
    send --RPUSH-----------------> pipe:<name>:<end> --BLPOP---------> recv   (store)
    send --nimbus.messaging (once switched, see _handover) ----------> recv   (direct)
    last copy closed: "E", direct if switched, else into the list ---> EOFError

A *lane* is one direction of a pipe, named by the end that reads it. The claim,
the switch, the give-up and the failures are the engine's
(``nimbus.multiprocessing._handover``): the process that reads the lane claims
it, the process that writes it switches to that claim. Holding a copy of an
end is no use of it: the stdlib documentation's ``a, b = Pipe()`` whose parent
starts a child with ``b`` and keeps its own copy goes direct both ways, and
goes back to the store, in order and for good, only when a second process
really reads or writes the lane.

What only a Pipe adds: *one writer.* A pipe keeps the order in which its
writers' messages happen (processes taking turns under a lock see their turns
in order), which two sockets cannot; so a second process's first write makes
the lane the store's, after the switched writer, if any, is stopped (see
:meth:`PipeWriter._join`). And *end-of-stream*: the last copy of the writing end to
close sends ``E`` (``connection._release`` counts the copies), directly when
its process is switched, so that it follows that process's direct messages;
and a direct reader whose only writer copy died (a killed process never
closes) reads end-of-stream, as the stdlib's reader of a pipe whose only
writer died would.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nimbus._lazy import lazy
from nimbus.errors import MessagingTimeout, PeerExited, PeerLost
from nimbus.multiprocessing._handover import (
    CHECK,
    Consumer,
    Lane,
    Producer,
    endpoint,
    file_message,
    giveup_key,
    one,
)
from nimbus.multiprocessing._payload import EOS
from nimbus.statestore import Keys, Program, link
from nimbus.statestore.lua import PIPE_SECOND as _SECOND

if TYPE_CHECKING:
    from nimbus import messaging
else:  # on first use (it imports redis-py)
    messaging = lazy("nimbus.messaging", globals())

__all__ = ["PipeLane", "PipeReader", "PipeWriter", "lanes", "reader", "writer"]

GONE_LOOK = 0.5  # seconds between a silent direct reader's looks at its writers' lives


@dataclass(frozen=True)
class PipeLane(Lane):
    """A pipe direction's keys, with the count of its writing end's copies."""

    writer_refs: str
    writers_users: str  # the processes that have written this direction (a set)


def lanes(keys: Keys, name: str) -> tuple[PipeLane, PipeLane]:
    """The two lanes of pipe ``name``: lane ``e`` is read by end ``e``."""
    return tuple(  # type: ignore[return-value]
        PipeLane(
            keys.pipe(name, e),
            keys.pipe_holder(name, e),
            keys.pipe_mode(name, e),
            keys.pipe_writer(name, e),
            keys.pipe_refs(name, 1 - e),
            keys.pipe_writer_users(name, e),
        )
        for e in (0, 1)
    )


class PipeReader(Consumer):
    """A pipe direction's reader in this process: the engine's, and a dead writer's EOS."""

    lane: PipeLane
    _gone_look = 0.0

    def writer_gone(self) -> bool:
        """Whether the lane's only writer copy died switched to us (looked at every
        GONE_LOOK seconds, when nothing is pending): every switched writer is gone, one
        was killed (one that exited closed its copy), nothing they sent waits, and the
        writing end has one copy left: the killed one's."""
        now = time.monotonic()
        if now < self._gone_look or self.pending:
            return False
        self._gone_look = now + GONE_LOOK
        ep, killed = messaging.current(), False
        for source in list(self.opened):
            if source not in self.gone and ep.alive(source):
                return False
            try:  # how it ended: its connection broke (killed), or it said goodbye
                message = ep.recv_with_source(source, 0, self.tag)[1]
            except PeerLost:
                killed = True
                continue
            except (PeerExited, MessagingTimeout):
                continue
            with self.lock:  # it had sent more: delivered next
                file_message(self.pending, source, message)
            return False
        refs = link(self.prog).command("GET", self.lane.writer_refs) if killed else None
        return refs == b"1" and not self.held()


# A process's first write of a lane: the writers become two or more, so the lane goes to
# the store for good; a writer switched already is stopped (its holder gives the claim up).
class PipeWriter(Producer):
    """A pipe direction's writer in this process: the engine's, one writer at a time,
    and end-of-stream."""

    lane: PipeLane
    _joined = False

    def _check(self, now: float) -> None:
        """The engine's look at the claim; the first one (at the first send) joins."""
        if not self._joined:
            self._join()
            if self.off:
                return
        super()._check(now)

    def _join(self) -> None:
        """This process's first write of the lane. A Pipe keeps the order of its
        writers' messages as they happen, which two sockets cannot: a lane written
        by two processes is the store's, and a second writer first waits until the
        switched one, if any, is stopped: its holder gave the claim up (what came
        directly is in the list) and it looks at the claim before its next send."""
        self._joined = True
        ep = endpoint(self.prog)
        me = ep.id if ep is not None else f"pid:{os.getpid()}"
        lane, store, ttl = self.lane, link(self.prog), self.prog.ttl_ms
        keys = [lane.holder, lane.mode, lane.writers, lane.writers_users]
        claim = store.eval(_SECOND, keys, [me, ttl])
        if claim is None:
            return
        self.off = True
        if claim:
            giveup = giveup_key(self.prog, claim.decode().partition(":")[0])
            store.call(("RPUSH", giveup, claim), ("PEXPIRE", giveup, ttl))
        deadline = time.monotonic() + 5.0
        while store.command("EXISTS", lane.writers) and time.monotonic() < deadline:
            time.sleep(0.002)  # the holder gives up: switched writers leave the hash
        time.sleep(2 * CHECK)  # the holder forwarded; the switched writer looks first

    def close_end(self) -> bool:
        """End-of-stream of the writing end's last copy, directly if switched; False:
        the caller pushes it to the list."""
        with self.lock:
            return self.peer is not None and self.send_switched(EOS)


def reader(prog: Program, lane: PipeLane) -> PipeReader:
    """This process's reader of ``lane`` (one for all its copies of the end)."""
    return one(PipeReader, prog, lane)


def writer(prog: Program, lane: PipeLane) -> PipeWriter:
    """This process's writer of ``lane`` (one for all its copies of the end)."""
    return one(PipeWriter, prog, lane)
