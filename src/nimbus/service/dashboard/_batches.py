"""Progress of your recent batches: each submit message is a task group.

::

    newest RECENT ids of your task index     ZREVRANGE + one pipeline of HMGET group
    each of the newest GROUPS groups         LLEN + LRANGE 0..CAP-1 of Keys.group(id)
                                             + one pipeline of HGET state
    the tasks Redis no longer holds          their states from the SQL history

A group is what one submit sent: a ``Client.batch_run``, or the tasks an
``Executor`` (with ``endpoint=``) sent in one message, which for an
``Executor.map`` are all its tasks up to the batch size. States are read for
the first ``CAP`` tasks of a group; a larger group's counts are of those (the
page says so). The cost of a look is bounded by RECENT + GROUPS x CAP,
whatever the history holds; the live stream reads a finished batch once.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import Response

from nimbus.records import TaskState
from nimbus.service import listing
from nimbus.service.dashboard._html import Html, esc, join, layout, short, when
from nimbus.service.dashboard._routes import Page, Route, Stream, _html, _is_admin, _stream
from nimbus.service.listing import index
from nimbus.service.queues import TaskStore

__all__ = ["Batch", "recent", "router"]

router = APIRouter(include_in_schema=False, route_class=Route)
BATCH_TICK = 1.0  # seconds between looks at the batches of an open batches page, at most

RECENT = 500  # newest task ids whose group is read
GROUPS = 20  # groups shown
CAP = 1000  # task states read of one group
DONE = tuple(state.value for state in TaskState if state.done)


@dataclass
class Batch:
    group_id: str
    submitted: float
    total: int
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def read(self) -> int:
        return sum(self.counts.values())

    @property
    def done(self) -> int:
        return sum(self.counts.get(state, 0) for state in DONE)

    def as_dict(self) -> dict[str, object]:
        return {
            "group_id": self.group_id,
            "total": self.total,
            "read": self.read,
            "done": self.done,
            "counts": dict(sorted(self.counts.items())),
        }


async def recent(
    store: TaskStore, key: str, endpoint: str = "", finished: dict[str, Batch] | None = None
) -> list[Batch]:
    """The newest ``GROUPS`` groups among the newest ``RECENT`` tasks of the index ``key``
    (of ``endpoint`` only, if given), newest first, with their tasks' states counted;
    groups in ``finished`` (every task done when last read) are given as they were, unread."""
    finished = finished or {}
    members = await store.redis.zrevrange(key, 0, RECENT - 1, withscores=True)
    pipe = store.redis.pipeline(transaction=False)
    for member, _ in members:
        pipe.hmget(store.keys.task(member.decode()), ["group", "endpoint"])
    found = await pipe.execute(raise_on_error=False) if members else []
    batches: dict[str, Batch] = {}
    for (_, score), values in zip(members, found):
        if isinstance(values, Exception) or not values[0]:
            continue
        group, where = values[0].decode(), (values[1] or b"").decode()
        if endpoint and where != endpoint:
            continue
        if group not in batches:
            if len(batches) == GROUPS:
                break
            batches[group] = Batch(group, float(score), 0)
    if not batches:
        return []
    for group in batches:
        if group in finished:
            batches[group] = finished[group]
    todo = [batch for group, batch in batches.items() if group not in finished]
    pipe = store.redis.pipeline(transaction=False)
    for batch in todo:
        pipe.llen(store.keys.group(batch.group_id))
        pipe.lrange(store.keys.group(batch.group_id), 0, CAP - 1)
    listed = await pipe.execute() if todo else []
    pipe = store.redis.pipeline(transaction=False)
    order: list[tuple[str, str]] = []  # (group, task id) of each state read
    for i, batch in enumerate(todo):
        batch.total = int(listed[2 * i])
        for task_id in listed[2 * i + 1]:
            pipe.hget(store.keys.task(task_id.decode()), "state")
            order.append((batch.group_id, task_id.decode()))
    states = await pipe.execute(raise_on_error=False) if order else []
    gone = [task_id for (_, task_id), state in zip(order, states) if state is None]
    found = await listing.saved(store, gone)  # out of Redis: the SQL history's
    for (group, task_id), state in zip(order, states):
        if isinstance(state, bytes):
            name = state.decode(errors="replace")
        elif state is None and task_id in found:
            name = found[task_id].state
        else:
            continue
        counts = batches[group].counts
        counts[name] = counts.get(name, 0) + 1
    return list(batches.values())


def _counts(batch: Batch) -> str:
    return ", ".join(f"{n} {state}" for state, n in sorted(batch.counts.items()))


def _batch_row(batch: Batch) -> Html:
    return Html(
        f'<tr data-group="{esc(batch.group_id)}"><td>{esc(short(batch.group_id))}</td>'
        f"<td>{esc(when(batch.submitted))}</td>"
        f'<td><progress max="{max(1, batch.total)}" value="{batch.done}"></progress></td>'
        f'<td class="done">{batch.done}/{batch.total}</td>'
        f'<td class="counts">{esc(_counts(batch))}</td></tr>'
    )


@router.get("/batches", response_model=None)
async def batches_page(request: Request, seen: Page) -> Response:
    ctx, who = seen
    user = who.principal
    key = index(ctx.store, user.user_id, _is_admin(ctx, user))
    batches = await recent(ctx.store, key)
    body = Html(
        '<p id="live" class="live">live</p>'
        '<table id="batches" data-stream="/batches/stream"><thead><tr><th>Batch</th>'
        "<th>Submitted</th><th>Progress</th><th>Done</th><th>States</th></tr></thead>"
        f"<tbody>{join(_batch_row(b) for b in batches)}</tbody></table>"
        "<p>A batch is what one submit sent: a <code>batch_run</code>, or the tasks an "
        "<code>Executor.map</code> sent together. States are counted for the first "
        f"{CAP} tasks of a batch.</p>"
    )
    return _html(layout("Batches", body, user.user_name, who.csrf))


@router.get("/batches/stream", response_model=None)
async def batches_stream(request: Request, seen: Stream) -> Response:
    ctx, who = seen
    key = index(ctx.store, who.principal.user_id, _is_admin(ctx, who.principal))

    sent: dict[str, dict[str, object]] = {}
    finished: dict[str, Batch] = {}

    async def look() -> AsyncIterator[str]:
        nonlocal sent, finished
        batches = await recent(ctx.store, key, finished=finished)
        finished = {b.group_id: b for b in batches if b.total and b.done == b.total}
        for batch in reversed(batches):  # oldest first: the page inserts each on top
            view = batch.as_dict() | {"submitted": when(batch.submitted)}
            view["states"] = _counts(batch)
            if sent.get(batch.group_id) != view:
                sent[batch.group_id] = view
                yield f"event: batch\ndata: {json.dumps(view)}\n\n"
        keep = {batch.group_id for batch in batches}
        sent = {k: v for k, v in sent.items() if k in keep}

    admin = _is_admin(ctx, who.principal)
    return _stream(request, ctx, look, BATCH_TICK, None if admin else who.principal.user_id)
