"""The Queue lane of the handover engine: a queue's items straight to its one consumer.

::

    producer P (its feeder)         state store                          consumer H
    batch --RPUSH----------------> queue:<name> --BLPOP/LPOP-----------> get()   (store)
    batch --nimbus.messaging (a batch a message) ----------------------> get()   (direct)

The claim, the switch, the give-up and the failures are the engine's
(``nimbus.multiprocessing._handover``): a queue is one lane whose consumer is
whoever calls ``get``. What only a Queue adds:

*Batches.* A producer's feeder sends what is buffered as one message (a list
of items), so a flood costs a send a batch, not an item.

*Latency.* A ``put`` right after a ``get`` of the same process (a request and
its reply) sends from its own thread when nothing waits for the feeder; a
flood goes through the feeder, so ``put`` never waits for a consumer that does
not read.

*Store only.* Bounded queues (their count lives in the store) besides the
engine's cases.
"""

from __future__ import annotations

import time

from nimbus.multiprocessing._handover import LOOK, Consumer, Lane, Producer, one
from nimbus.statestore import Program

__all__ = ["LOOK", "Consumer", "QueueProducer", "consumer", "got", "producer"]


def lane(prog: Program, name: str) -> Lane:
    """The keys of queue ``name``'s lane."""
    keys = prog.keys
    return Lane(
        keys.queue(name),
        keys.queue_field(name, "holder"),
        keys.queue_field(name, "mode"),
        keys.queue_field(name, "writers"),
    )


class QueueProducer(Producer):
    """A queue's producer: batches from the feeder, single items from ``put``."""

    _gets = -1  # the count of gets at our last send from put's thread

    def send_now(self, message: bytes) -> bool:
        """Send one item directly from ``put``'s thread; False: the feeder sends it.

        Only while switched, with no look at the claim due (one may wait for the
        holder), and after a ``get`` of this process since the last such send: a
        request and its reply go at once, while a flood goes through the feeder,
        in batches, and never makes ``put`` wait for a consumer that does not read.
        """
        with self.lock:
            gets = _gets
            if self.peer is None or gets == self._gets or time.monotonic() >= self._next_check:
                return False
            if not self.send_switched(message):
                return False
            self._gets = gets
            return True


_gets = 0  # Queue gets in this process (see QueueProducer.send_now)


def got() -> None:
    """A Queue ``get`` returned here."""
    global _gets
    _gets += 1


def consumer(prog: Program, name: str) -> Consumer:
    """This process's consumer of queue ``name`` (one for all its Queue objects)."""
    return one(Consumer, prog, lane(prog, name))


def producer(prog: Program, name: str) -> QueueProducer:
    """This process's producer of queue ``name`` (one for all its Queue objects)."""
    return one(QueueProducer, prog, lane(prog, name))
