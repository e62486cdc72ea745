"""The Pipe lane of the handover engine: one direction of a pipe, straight to its reader.

::

    writing end's copies           state store                        reading end's copies
    send --RPUSH-----------------> pipe:<name>:<end> --BLPOP---------> recv   (store)
    send --nimbus.messaging (once switched, see _handover) ----------> recv   (direct)
    last copy closed: "E", direct if switched, else into the list ---> EOFError

A *lane* is one direction of a pipe, named by the end that reads it. The claim,
the switch, the give-up and the failures are the engine's
(``nimbus.multiprocessing._handover``): the process that reads the lane claims
it, each process that writes it switches to that claim. Holding a copy of an
end is no use of it: the stdlib documentation's ``a, b = Pipe()`` whose parent
starts a child with ``b`` and keeps its own copy goes direct both ways, and
goes back to the store, in order, only when a second process really reads the
lane (a second writer simply switches too).

What only a Pipe adds is end-of-stream: the last copy of the writing end to
close sends ``E`` (``connection._release`` counts the copies), directly when
its process is switched, so that it follows that process's direct messages;
and a direct reader whose only writer copy died (a killed process never
closes) reads end-of-stream, as the stdlib's reader of a pipe whose only
writer died would.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

from nimbus import messaging
from nimbus.errors import MessagingTimeout, PeerExited, PeerLost
from nimbus.keys import Keys
from nimbus.multiprocessing._handover import Consumer, Lane, Producer, one
from nimbus.multiprocessing._link import link
from nimbus.multiprocessing._payload import EOS
from nimbus.multiprocessing._state import Program

__all__ = ["PipeLane", "PipeReader", "PipeWriter", "lanes", "reader", "writer"]

GONE_LOOK = 0.5  # seconds between a silent direct reader's looks at its writers' lives


@dataclass(frozen=True)
class PipeLane(Lane):
    """A pipe direction's keys, with the count of its writing end's copies."""

    writer_refs: str


def lanes(keys: Keys, name: str) -> tuple[PipeLane, PipeLane]:
    """The two lanes of pipe ``name``: lane ``e`` is read by end ``e``."""
    return tuple(  # type: ignore[return-value]
        PipeLane(
            keys.pipe(name, e),
            keys.pipe_holder(name, e),
            keys.pipe_mode(name, e),
            keys.pipe_writer(name, e),
            keys.pipe_refs(name, 1 - e),
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
        if now < self._gone_look or any(self.pending.values()):
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
                found = self.pending.setdefault(source, collections.deque())
                found.extend(message if isinstance(message, list) else (message,))
            return False
        refs = link(self.prog).command("GET", self.lane.writer_refs) if killed else None
        return refs == b"1" and not self.held()


class PipeWriter(Producer):
    """A pipe direction's writer in this process: the engine's, and end-of-stream."""

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
