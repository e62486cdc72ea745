"""Tasks that take other tasks' results: held by the service until their inputs end.

::

    submit(rows, after=[[input ids], ...])  --> a row with inputs not done is held
        (task hash: 'waits' = inputs left; the input's set of dependents names it)
    an input ends (finish, cancel)  --> settle(woken, failed):
        success: its dependents wait for one input less; at none they join their
                 endpoint's queue, whose dispatchers are woken here
        failed / cancelled: its dependents fail with InputFailed naming it (and theirs
                 in turn), their results delivered to whoever waits

The data of an input never passes here: a kept input's result stays on its endpoint,
and the dependent's arguments name it by the reference the client chose for it
(``nimbus.data``); the service only orders the two.
"""

from __future__ import annotations

import asyncio
import logging
import pickle

from nimbus.errors import InputFailed
from nimbus.protocol import ResultRow, pack
from nimbus.records import TaskState
from nimbus.service.context import STATUS_ERROR, ServiceContext
from nimbus.service.queues import Held

__all__ = ["held_by", "settle"]

log = logging.getLogger(__name__)

MAX_ROUNDS = 10_000  # a chain of held tasks failed link by link (a guard, never reached)
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


async def settle(ctx: ServiceContext, woken: list[str], failed: list[Held]) -> None:
    """Wake the dispatchers of ``woken`` endpoints; fail the held tasks ``failed``."""
    for endpoint_id in woken:
        ctx.hub.work_arrived(endpoint_id)
    rounds = 0
    while failed and rounds < MAX_ROUNDS:
        rounds += 1
        results = {
            task_id: failure(task_id, input_id, state) for task_id, input_id, state in failed
        }
        stored, drop, failed = await ctx.store.fail_held(list(results.items()))
        ctx.data.drop(drop)
        await ctx.hub.deliver([ResultRow(i, TaskState.FAILED, results[i], b"") for i in stored])


def held_by(ctx: ServiceContext) -> None:
    """Let ``ctx``'s task store settle held tasks through ``ctx`` (its hub and data):
    dispatchers are woken at once; held tasks are failed just after (in a task of the
    loop), so that the input's own result, delivered by the caller of the step that
    ended it, reaches its client first."""
    running: set[asyncio.Task[None]] = set()

    async def settled(woken: list[str], failed: list[Held]) -> None:
        for endpoint_id in woken:
            ctx.hub.work_arrived(endpoint_id)
        if woken:
            await ctx.released_on_deleted(woken)
        if failed:
            job = asyncio.ensure_future(settle(ctx, [], failed))
            running.add(job)
            job.add_done_callback(_logged)
            job.add_done_callback(running.discard)

    ctx.store.settle = settled


def _logged(job: asyncio.Task[None]) -> None:
    if not job.cancelled() and job.exception() is not None:
        log.error("failing tasks held for a failed input failed", exc_info=job.exception())
