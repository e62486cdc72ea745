"""Tasks that take other tasks' results: held by the service until their inputs end.

::

    submit(rows, after=[[input ids], ...])  --> a row with inputs not done is held
        (task hash: 'waits' = inputs left; the input's set of dependents and its
        endpoint's set of held tasks name it: deleting the endpoint fails it)
    an input ends (finish, cancel)  --> the script's settle():
        success: its dependents wait for one input less; at none they join their
                 endpoint's queue, whose dispatchers are woken here and, through the
                 channel TaskStore.woken, in every service process (``held_by``,
                 ``nimbus.service.wakeups``); one queued for an endpoint deleted meanwhile
                 fails naming it
        failed / cancelled: its dependents are appended, in the same script, to the
                 stream TaskStore.to_fail; a consumer group (one consumer per service
                 process: ``fail_held``) fails them with InputFailed naming it, and
                 acknowledges them in the script that fails them (theirs appended in
                 turn), their results delivered to whoever waits. A process that dies
                 in between leaves its entries pending: the next start (any process)
                 claims them, so no held task waits for ever on a failed input.

The data of an input never passes here: a kept input's result stays on its endpoint,
and the dependent's arguments name it by the reference the client chose for it
(``nimbus.data``); the service only orders the two.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import secrets
import socket
import time

import redis

from nimbus.errors import InputFailed
from nimbus.protocol import ResultRow, pack
from nimbus.records import TaskState
from nimbus.service.context import STATUS_ERROR, ServiceContext

__all__ = ["fail_held", "held_by"]

log = logging.getLogger(__name__)

BATCH = 500  # entries of the stream of held tasks to fail read at once
CLAIM_IDLE = 30.0  # seconds an entry taken stays unacknowledged before any process takes it
RETRY = 1.0  # seconds before reading the stream again after an error (Redis away)
_WHAT = {"failed": "failed", "cancelled": "was cancelled"}


def failure(task_id: str, input_id: str, state: str) -> bytes:
    """The packed result of held task ``task_id`` whose input ``input_id`` ended ``state``."""
    error = InputFailed(
        f"task {task_id} did not run: its input, task {input_id}, "
        f"{_WHAT.get(state, state)}; its own error is on its future (or "
        f"`nimbus tasks result {input_id}`)",
        input_id,
    )
    return pack([STATUS_ERROR, pickle.dumps((error, ""), 5), []])


async def fail_step(
    ctx: ServiceContext, consumer: str, *, block: float, claim: float | None
) -> int:
    """Fail the held tasks of one batch of the stream ``to_fail`` (new entries, or with
    ``claim`` those left unacknowledged that long); how many entries it held."""
    entries = await ctx.store.read_to_fail(consumer, count=BATCH, block=block, claim=claim)
    if not entries:
        return 0
    results: dict[str, bytes] = {}
    for _, (task_id, input_id, state) in entries:
        results.setdefault(task_id, failure(task_id, input_id, state))
    stored, drop = await ctx.store.fail_held(list(results.items()), [e for e, _ in entries])
    ctx.data.drop(drop)
    await ctx.hub.deliver([ResultRow(i, TaskState.FAILED, results[i], b"") for i in stored])
    return len(entries)


async def fail_held(ctx: ServiceContext) -> None:
    """The service process's consumer of ``to_fail``, until cancelled: at start it takes
    every entry left unacknowledged (by a process that stopped, or this one before a
    restart), then reads new ones as they come, and every ``CLAIM_IDLE`` those another
    process took and did not acknowledge in that time."""
    consumer = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    claim: float | None = 0.0  # at start: all pending entries, whoever took them
    next_claim = 0.0
    while True:
        try:
            if claim is None and time.monotonic() >= next_claim:
                claim = CLAIM_IDLE
            if claim is not None:
                await ctx.store.to_fail_group()
                while await fail_step(ctx, consumer, block=0, claim=claim) >= BATCH:
                    pass
                claim, next_claim = None, time.monotonic() + CLAIM_IDLE / 2
            await fail_step(ctx, consumer, block=1.0, claim=None)
        except asyncio.CancelledError:
            raise
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            # the queue Redis is away (its outage is said once, by the service's
            # supervisor): entries stay pending, claimed again later
            log.debug("held tasks to fail wait in the queue Redis (%s)", exc)
            claim = CLAIM_IDLE
            await asyncio.sleep(RETRY)
        except Exception:  # entries stay pending, claimed again later
            log.exception("failing tasks held for a failed input failed; retrying")
            claim = CLAIM_IDLE
            await asyncio.sleep(RETRY)


def held_by(ctx: ServiceContext) -> None:
    """Let ``ctx``'s task store wake the dispatchers of the endpoints whose held tasks
    were queued (an endpoint deleted meanwhile fails them)."""

    async def settled(woken: list[str]) -> None:
        for endpoint_id in woken:
            ctx.hub.work_arrived(endpoint_id)
        await ctx.released_on_deleted(woken)

    ctx.store.settle = settled
