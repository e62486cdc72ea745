"""Wake-ups between the processes of one service: one Redis subscription each.

Several service processes may share one queue Redis and one registry (behind a load
balancer): an endpoint's agent connected to one, the clients that wait for its tasks
to another. What a process cannot see by itself comes on two channels, both heard by
one subscription per process (``listen``)::

    TaskStore.woken  endpoint ids: tasks joined their queues (submitted: the script
                     SUBMIT; held ones released: the finish script's settle,
                     ``nimbus.service.held``; put back by REQUEUE, an agent's
                     connection lost) --> this process's dispatchers of those
                     endpoints look at their queues now
    <prefix>ended    task ids: tasks ended (the scripts FINISH, CANCEL, FAIL_HELD)
                     --> this process's result long-polls of them answer
                     (``Hub.wait_done``) and its client WebSockets watching them get
                     their results, read from Redis (``prefix``: the task keys'
                     ``Keys.task('')``)

The scripts that end tasks publish their ids on ``ended`` (``tell_ended``: one
message a script call), the submit script its endpoint on ``woken`` when tasks joined
its queue (``tell_woken``), only while more than one process subscribes, so a lone
service process publishes nothing, hears nothing and pays one O(1) ``PUBSUB NUMSUB``
a script call: it wakes its own waiters and dispatchers itself (``Hub.deliver``,
``Hub.work_arrived``). With several, each process hears its own messages too: the
waiters it woke are gone by then and it finds nothing to do. After each
(re)subscription a process wakes its long-polls and dispatchers and reads the results
of the tasks its WebSockets watch, so what ended or was queued while no message could
reach it (at its start, or Redis away) is not waited for until a poll's end. A
subscription silent for ``HEALTH`` seconds is PINGed: one dropped without a reset is
found and made again. Results go to each client connection from a sender task of its
own (``Deliveries``), read and cut into messages by size (``deliver_stored``), so
the subscription's loop never waits on a client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from nimbus.protocol import MESSAGE_BYTES, ResultRow, batches
from nimbus.records import TaskState

if TYPE_CHECKING:
    from redis.asyncio.client import PubSub

    from nimbus.service.context import ServiceContext
    from nimbus.service.hub import Peer

__all__ = ["ENDED", "Deliveries", "deliver_stored", "listen", "tell_ended", "tell_woken"]

log = logging.getLogger(__name__)

# The pub/sub channel (after the task prefix) of the ids of tasks just ended,
# space-separated
ENDED = "ended"
RETRY = 1.0  # seconds before subscribing again after the queue Redis went away
CHUNK = 1000  # most watched tasks whose results are read at once (fewer if large)
# seconds without a message before the subscription is PINGed, and for its answer: a
# connection dropped silently is found within twice as long, then subscribed again
HEALTH = 15.0


def _tell(channel: str, when: str, what: str) -> str:
    """The Lua that publishes ``what`` on ``channel`` (Lua expressions) when ``when``
    holds and more than one service process listens to it."""
    return (
        f"if {when} and redis.call('PUBSUB', 'NUMSUB', {channel})[2] > 1 then\n"
        f"  redis.call('PUBLISH', {channel}, {what})  -- wakeups.py\n"
        f"end\n"
    )


def tell_ended(prefix: str, ids: str) -> str:
    """The Lua that publishes the tasks of the Lua table ``ids`` (just ended) on
    ``<prefix>ended`` if more than one service process listens (``prefix``: the Lua
    expression of the task key prefix, ``TaskStore``'s ``keys.task('')``)."""
    return _tell(f"{prefix} .. '{ENDED}'", f"#{ids} > 0", f"table.concat({ids}, ' ')")


def tell_woken(channel: str, endpoint: str, when: str) -> str:
    """The Lua that publishes ``endpoint`` (tasks just joined its queue) on ``channel``
    (``TaskStore.woken``) when ``when`` holds and more than one service process listens
    (Lua expressions all): the dispatchers of its agents connected to another process
    than the submitter's take them now, not at their idle poll's end."""
    return _tell(channel, when, endpoint)


async def deliver_stored(ctx: ServiceContext, task_ids: list[str]) -> None:
    """The stored results of those of ``task_ids`` that ended, to whoever watches them
    here (``Hub.deliver``: a watcher delivered meanwhile is not sent twice). Read a
    chunk at a time, the next chunk's count fitted to the bytes of the last (about one
    message's worth in memory, not ``CHUNK`` results of up to ``INLINE_MAX`` each), and
    sent in messages of about ``MESSAGE_BYTES`` (``batches``). The one place results
    are read for watchers: a client's ``watch`` (ws.py) and the wake-ups here."""
    start, count = 0, CHUNK
    while start < len(task_ids):
        chunk = task_ids[start : start + count]
        start += len(chunk)
        rows = [
            ResultRow(task_id, TaskState(result[0]), result[1], result[2])
            for task_id, result in zip(chunk, await ctx.store.results(chunk))
            if result is not None
        ]
        for batch in batches(rows, _row_size):
            await ctx.hub.deliver(batch)
        read = sum(map(_row_size, rows))
        count = max(1, min(CHUNK, MESSAGE_BYTES * len(chunk) // read)) if read else CHUNK


def _row_size(row: ResultRow) -> int:
    """Bytes of a stored result row (read from Redis: packed bytes both)."""
    result, record = row.result, row.record
    return (len(result) if isinstance(result, bytes) else 64) + (
        len(record) if isinstance(record, bytes) else 0
    )


class Deliveries:
    """Results sent to each client connection here by a task of its own, so that the
    subscription's loop only reads messages: a client that reads slowly (or not at
    all) delays no one else's results and no wake-up. What ends while its sender is
    busy waits as ids (one sender a connection, not one task a message)."""

    def __init__(self, ctx: ServiceContext) -> None:
        self._ctx = ctx
        self._pending: dict[Peer, dict[str, None]] = {}
        self._senders: dict[Peer, asyncio.Task[None]] = {}

    def add(self, task_ids: list[str]) -> None:
        """Send the results of ``task_ids`` (ended) to the connections watching them."""
        watchers = self._ctx.hub.watchers
        for task_id in task_ids:
            peer = watchers.get(task_id)
            if peer is None or peer.closed:
                continue
            self._pending.setdefault(peer, {})[task_id] = None
            if peer not in self._senders:
                self._senders[peer] = asyncio.create_task(self._send(peer))

    async def _send(self, peer: Peer) -> None:
        try:
            while pending := self._pending.pop(peer, None):
                await deliver_stored(self._ctx, list(pending))
        except Exception as exc:  # the queue Redis went away: the catch-up sends them
            log.debug("results not delivered to a watcher: %s", exc)
            self._pending.pop(peer, None)
        finally:
            self._senders.pop(peer, None)

    async def aclose(self) -> None:
        """Stop sending (the subscription's loop ends)."""
        senders = list(self._senders.values())
        for sender in senders:
            sender.cancel()
        await asyncio.gather(*senders, return_exceptions=True)
        self._pending.clear()


def ended(ctx: ServiceContext, task_ids: list[str], deliveries: Deliveries) -> None:
    """Tasks ended (in any process): wake this process's long-polls of them, and send
    their results to the client WebSockets here that watch them."""
    deliveries.add(ctx.hub.ended(task_ids))


def _caught_up(ctx: ServiceContext, deliveries: Deliveries) -> None:
    """Just (re)subscribed: what ended before is answered now, not at a poll's end, and
    what joined a queue before is taken now by this process's dispatchers."""
    ctx.hub.wake_all()
    for endpoint_id in list(ctx.hub.endpoint_agents):
        ctx.hub.work_arrived(endpoint_id)
    deliveries.add(list(ctx.hub.watchers))


async def listen(ctx: ServiceContext) -> None:
    """Until cancelled: hear ``TaskStore.woken`` (wake this process's dispatchers of
    those endpoints) and ``<prefix>ended`` (:func:`ended`), subscribing again
    whenever the queue Redis goes away, or stops answering (``HEALTH``)."""
    store = ctx.store
    channel = store.keys.task("") + ENDED
    deliveries = Deliveries(ctx)
    try:
        while True:
            pubsub = store.redis.pubsub()
            try:
                await asyncio.wait_for(pubsub.subscribe(store.woken, channel), HEALTH)
                await _hear(ctx, pubsub, channel.encode(), deliveries)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the queue Redis went away: subscribe again
                log.debug("subscription to other service processes' wake-ups lost: %r", exc)
                await asyncio.sleep(RETRY)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.shield(pubsub.aclose())
    finally:
        await deliveries.aclose()


async def _hear(
    ctx: ServiceContext, pubsub: PubSub, ended_channel: bytes, deliveries: Deliveries
) -> None:
    """The subscription's messages until it is lost: a connection dropped without a
    reset (a NAT's or load balancer's idle timeout) raises nothing, so after ``HEALTH``
    seconds without a message a PING is sent, and no answer (nor any message) within
    as long again ends it (``ConnectionError``)."""
    pinged = False
    while True:
        message = await pubsub.get_message(timeout=HEALTH)
        if message is None:
            if pinged:
                raise ConnectionError(f"the queue Redis did not answer a PING in {HEALTH} s")
            await asyncio.wait_for(pubsub.ping(), HEALTH)
            pinged = True
            continue
        pinged = False
        if message["type"] == "subscribe":
            # data: the channels this connection now hears. Both (again, after
            # redis-py reconnected and subscribed by itself, raising nothing):
            # what ended or was queued before, now
            if message["data"] == 2:
                _caught_up(ctx, deliveries)
            continue
        if message["type"] != "message":
            continue
        ids = message["data"].decode(errors="replace").split()
        if message["channel"] == ended_channel:
            ended(ctx, ids, deliveries)
        else:
            for endpoint_id in ids:
                ctx.hub.work_arrived(endpoint_id)
