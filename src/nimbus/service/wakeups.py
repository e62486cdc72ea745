"""Wake-ups between the processes of one service: one Redis subscription each.

Several service processes may share one queue Redis and one registry (behind a load
balancer): an endpoint's agent connected to one, the clients that wait for its tasks
to another. What a process cannot see by itself comes on two channels, both heard by
one subscription per process (``listen``)::

    TaskStore.woken  endpoint ids: held tasks joined their queues (the finish script's
                     settle, ``nimbus.service.held``) --> this process's dispatchers of
                     those endpoints look at their queues now
    <prefix>ended    task ids: tasks ended (the scripts FINISH, CANCEL, FAIL_HELD)
                     --> this process's result long-polls of them answer
                     (``Hub.wait_done``) and its client WebSockets watching them get
                     their results, read from Redis (``prefix``: the task keys'
                     ``Keys.task('')``)

The scripts that end tasks publish their ids on ``ended`` (``tell_ended``: one
message a script call) only while more than one process subscribes to it, so a lone
service process publishes nothing, hears nothing and pays one O(1) ``PUBSUB NUMSUB``
a script call: it wakes its own waiters itself (``Hub.deliver``). With several, each
process hears its own messages too: the waiters it woke are gone by then and it
finds nothing to do. After each (re)subscription a process wakes its long-polls and
reads the results of the tasks its WebSockets watch, so what ended while no message
could reach it (at its start, or Redis away) is not waited for until a poll's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from nimbus.protocol import ResultRow
from nimbus.records import TaskState

if TYPE_CHECKING:
    from nimbus.service.context import ServiceContext

__all__ = ["ENDED", "listen", "tell_ended"]

log = logging.getLogger(__name__)

# The pub/sub channel (after the task prefix) of the ids of tasks just ended,
# space-separated
ENDED = "ended"
RETRY = 1.0  # seconds before subscribing again after the queue Redis went away
CHUNK = 1000  # watched tasks whose results are read at once after a (re)subscription


def tell_ended(prefix: str, ids: str) -> str:
    """The Lua that publishes the tasks of the Lua table ``ids`` (just ended) on
    ``<prefix>ended`` if more than one service process listens (``prefix``: the Lua
    expression of the task key prefix, ``TaskStore``'s ``keys.task('')``)."""
    channel = f"{prefix} .. '{ENDED}'"
    return (
        f"if #{ids} > 0 and redis.call('PUBSUB', 'NUMSUB', {channel})[2] > 1 then\n"
        f"  redis.call('PUBLISH', {channel}, table.concat({ids}, ' '))  -- wakeups.py\n"
        f"end\n"
    )


async def ended(ctx: ServiceContext, task_ids: list[str]) -> None:
    """Tasks ended (in any process): wake this process's long-polls of them, and send
    their results to the client WebSockets here that watch them."""
    watched = ctx.hub.ended(task_ids)
    if watched:
        await _deliver(ctx, watched)


async def _deliver(ctx: ServiceContext, task_ids: list[str]) -> None:
    """The results of those of ``task_ids`` that ended, to whoever watches them here."""
    for start in range(0, len(task_ids), CHUNK):
        chunk = task_ids[start : start + CHUNK]
        rows = [
            ResultRow(task_id, TaskState(result[0]), result[1], result[2])
            for task_id, result in zip(chunk, await ctx.store.results(chunk))
            if result is not None
        ]
        if rows:
            await ctx.hub.deliver(rows)  # a watcher delivered meanwhile is not sent twice


async def _caught_up(ctx: ServiceContext) -> None:
    """Just (re)subscribed: what ended before is answered now, not at a poll's end."""
    ctx.hub.wake_all()
    await _deliver(ctx, list(ctx.hub.watchers))


async def listen(ctx: ServiceContext) -> None:
    """Until cancelled: hear ``TaskStore.woken`` (wake this process's dispatchers of
    those endpoints) and ``<prefix>ended`` (:func:`ended`), subscribing again
    whenever the queue Redis goes away."""
    store = ctx.store
    channel = store.keys.task("") + ENDED
    ended_channel = channel.encode()
    while True:
        pubsub = store.redis.pubsub()
        try:
            await pubsub.subscribe(store.woken, channel)
            confirmed = 0
            while True:
                message = await pubsub.get_message(timeout=None)
                if message is None:
                    continue
                if message["type"] == "subscribe":
                    confirmed += 1
                    if confirmed == 2:  # both heard from now on: what ended before, now
                        await _caught_up(ctx)
                    continue
                if message["type"] != "message":
                    continue
                ids = message["data"].decode(errors="replace").split()
                if message["channel"] == ended_channel:
                    await ended(ctx, ids)
                else:
                    for endpoint_id in ids:
                        ctx.hub.work_arrived(endpoint_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the queue Redis went away: subscribe again
            log.debug("subscription to other service processes' wake-ups lost: %s", exc)
            await asyncio.sleep(RETRY)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(pubsub.aclose())
