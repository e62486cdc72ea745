"""Reading a user's tasks for the dashboard: keyset pages and the live window.

::

    Keys.user_tasks(user)  sorted set, score = submit time, member = task id
    (Keys.all_tasks() for an admin: NIMBUS_SERVICE_ADMINS)
        page(after=None)        ZREVRANGE 0..BATCH-1            newest first
        page(after=(s, id))     ZREVRANK id -> r; ZREVRANGE r+1..r+BATCH
                                (id gone: ZREVRANGEBYSCORE s .. -inf, the
                                 ties up to id skipped)
        each batch of ids       one pipeline of HMGET (no payloads, no results)

A page costs O(log n + the rows read), whatever the history holds: the cursor
is a position in the index, never an offset counted from the start. A filter
(state, endpoint, function) reads batches until the page is full or ``SCAN_CAP``
ids were read; the page then ends with a cursor to go on from. Tasks of a
batch submit share one score, which is why the cursor carries the id too.
"""

from __future__ import annotations

import pickletools
from dataclasses import dataclass

import msgpack

from nimbus.records import TaskRecord, TaskState
from nimbus.service.queues import TaskStore

__all__ = [
    "STATES",
    "Filter",
    "Row",
    "decode_cursor",
    "index",
    "live_window",
    "page",
    "record_of",
    "traceback_text",
]

BATCH = 200
SCAN_CAP = 5000  # ids read for one filtered page at most
LIVE_WINDOW = 100  # newest tasks the live stream watches
_FIELDS = ("state", "endpoint", "function", "submitted", "dispatched", "ended")
STATES = tuple(state.value for state in TaskState if state is not TaskState.RECEIVED)


@dataclass(frozen=True)
class Filter:
    state: str = ""
    endpoint: str = ""
    function: str = ""

    def keeps(self, row: Row) -> bool:
        return (
            (not self.state or row.state == self.state)
            and (not self.endpoint or row.endpoint_id == self.endpoint)
            and (not self.function or row.function_id == self.function)
        )


@dataclass(frozen=True)
class Row:
    task_id: str
    score: float
    state: str
    endpoint_id: str
    function_id: str
    submitted: float
    dispatched: float
    ended: float

    @property
    def cursor(self) -> str:
        return f"{self.score!r}~{self.task_id}"


def decode_cursor(text: str) -> tuple[float, str] | None:
    score, sep, task_id = text.partition("~")
    try:
        return (float(score), task_id) if sep and task_id else None
    except ValueError:
        return None


def _seconds(value: bytes | None) -> float:
    try:
        return float(value or 0)
    except ValueError:
        return 0.0


async def _rows(store: TaskStore, key: str, members: list[tuple[bytes, float]]) -> list[Row]:
    pipe = store.redis.pipeline(transaction=False)
    for member, _ in members:
        pipe.hmget(store.keys.task(member.decode()), list(_FIELDS))
    out, gone = [], []
    for (member, score), values in zip(members, await pipe.execute(raise_on_error=False)):
        task_id = member.decode()
        if isinstance(values, Exception) or values[0] is None:
            gone.append(task_id)  # expired (its result's time to live passed): unindexed
            continue
        state, endpoint, function, submitted, dispatched, ended = values
        out.append(
            Row(
                task_id,
                float(score),
                state.decode(errors="replace"),
                (endpoint or b"").decode(errors="replace"),
                (function or b"").decode(errors="replace"),
                _seconds(submitted),
                _seconds(dispatched),
                _seconds(ended),
            )
        )
    if gone:
        await store.redis.zrem(key, *gone)
    return out


async def _batch(
    store: TaskStore, key: str, after: tuple[float, str] | None
) -> list[tuple[bytes, float]]:
    if after is None:
        members: list[tuple[bytes, float]] = await store.redis.zrevrange(
            key, 0, BATCH - 1, withscores=True
        )
        return members
    score, task_id = after
    rank = await store.redis.zrevrank(key, task_id)
    if rank is not None:
        members = await store.redis.zrevrange(key, rank + 1, rank + BATCH, withscores=True)
        return members
    # the cursor's task left the index meanwhile (expired): go on from its place, which
    # is after the tasks of a higher score and, among equal scores, of a larger id
    offset = 0
    while True:
        members = await store.redis.zrevrangebyscore(
            key, repr(score), "-inf", start=offset, num=BATCH, withscores=True
        )
        after_it = [(m, s) for m, s in members if s < score or m.decode() < task_id]
        if after_it or len(members) < BATCH:
            return after_it
        offset += BATCH


async def page(
    store: TaskStore, key: str, flt: Filter, after: tuple[float, str] | None, size: int
) -> tuple[list[Row], str]:
    """Up to ``size`` tasks of the index ``key`` (:func:`index`) that ``flt`` keeps, newest
    first, from after the cursor ``after``; and the cursor of the next page ('' at the end)."""
    out: list[Row] = []
    read = 0
    while read < SCAN_CAP:
        members = await _batch(store, key, after)
        if not members:
            return out, ""
        read += len(members)
        for row in await _rows(store, key, members):
            if flt.keeps(row):
                out.append(row)
                if len(out) == size:
                    return out, row.cursor
        last, score = members[-1]
        after = (float(score), last.decode())
    return out, f"{after[0]!r}~{after[1]}" if after else ""


async def live_window(store: TaskStore, key: str, flt: Filter) -> list[Row]:
    """The newest ``LIVE_WINDOW`` tasks of the index ``key`` that ``flt`` keeps."""
    members = await store.redis.zrevrange(key, 0, LIVE_WINDOW - 1, withscores=True)
    return [row for row in await _rows(store, key, members) if flt.keeps(row)]


def index(store: TaskStore, user_id: str, admin: bool) -> str:
    """The task index a user's pages read: every task for an admin, else their own."""
    return store.keys.all_tasks() if admin else store.keys.user_tasks(user_id)


def record_of(raw: bytes | None) -> TaskRecord | None:
    if not raw:
        return None
    try:
        return TaskRecord.from_wire(msgpack.unpackb(raw, raw=False))
    except Exception:  # sent by an agent or stored by an older version: not shown
        return None


def traceback_text(result: bytes | None, limit: int = 1 << 20) -> str:
    """The traceback text inside a failed task's result, read from the pickle's opcodes
    without unpickling it (the service never runs what a worker sent); '' if none."""
    if not result or len(result) > limit:
        return ""
    try:
        _, data, _ = msgpack.unpackb(result, raw=False)
        texts = [
            arg
            for _, arg, _ in pickletools.genops(bytes(data))
            if isinstance(arg, str) and "Traceback (most recent call last)" in arg
        ]
    except Exception:  # not a result nimbus packed: nothing to show
        return ""
    return texts[-1] if texts else ""
