"""Listing a user's tasks, for the dashboard's pages and GET /v1/tasks: keyset pages
and the live window.

::

    Keys.user_tasks(user)  sorted set, score = submit time, member = task id
    (Keys.all_tasks() for an admin: NIMBUS_SERVICE_ADMINS)
        page(after=None)        ZREVRANGE 0..size-1             newest first
        page(after=(s, id))     ZREVRANK id -> r; ZREVRANGE r+1..r+size
                                (id gone: ZCOUNT (s..+inf, plus the ties
                                 of score s with a larger id)
        each id read            HMGET of six fields (no payloads, no results)

all in one Lua script call (``_PAGE``): one round trip a page, the rows
decoded by Redis rather than by the service (a pipeline of 200 HMGETs cost the
service ~30 ms of packing and parsing).

Redis holds the live tasks and a recent window (``nimbus.service.flusher``); the
finished ones are in the SQL history (``nimbus.service.history``): :func:`page`
reads both, keyset, and merges them.

A batch (a task group: one submit) is read the same way: its ids from Redis's
list ``Keys.group(id)``, else (the list gone) from the history's group index
(:func:`group_ids`), and each task Redis no longer holds from the history
(:func:`saved`), so a batch older than Redis's window still shows whole.

A page costs O(log n + the rows read), whatever the history holds: the cursor
is a position in the index, never an offset counted from the start. A filter
(state, endpoint, function) reads batches of 200 until the page is full or ``SCAN_CAP``
ids were read; the page then ends with a cursor to go on from. Tasks of a
batch submit share one score, which is why the cursor carries the id too.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from dataclasses import dataclass, fields
from typing import Any

import msgpack
from sqlalchemy import column, func, select, table

from nimbus.errors import ServiceError
from nimbus.records import TaskRecord, TaskState
from nimbus.service.history import History, Query
from nimbus.service.queues import TaskStore

__all__ = [
    "STATES",
    "Filter",
    "Row",
    "Saved",
    "decode_cursor",
    "group_ids",
    "group_size",
    "index",
    "live_window",
    "page",
    "record_of",
    "saved",
]

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
    """A page's cursor (``Row.cursor``: ``<score>~<task id>``), None for the first page
    (no cursor); a :class:`ServiceError` (422) naming it when it is not one (``nan``
    or ``inf`` too: the page script cannot compare with them)."""
    if not text:
        return None
    score, sep, task_id = text.partition("~")
    try:
        value = float(score)
    except ValueError:
        value = math.nan
    if not (sep and task_id and math.isfinite(value)):
        raise ServiceError(
            f"the cursor {text[:100]!r} is not one a page gave (<score>~<task id>, the score "
            f"a finite number); follow the page's links, or drop 'after' for the first page",
            422,
        )
    return value, task_id


def _seconds(value: bytes | None) -> float:
    try:
        return float(value or 0)
    except ValueError:
        return 0.0


_PAGE = """
local key, prefix = KEYS[1], ARGV[1]
local size, cap = tonumber(ARGV[2]), tonumber(ARGV[3])
local state, endpoint, fn = ARGV[4], ARGV[5], ARGV[6]
local after_score, after_id = ARGV[7], ARGV[8]
local pos = 0
if after_id ~= '' then
  local rank = redis.call('ZREVRANK', key, after_id)
  if rank then
    pos = rank + 1
  else  -- the cursor's task left the index (expired): after the higher scores and the
    pos = redis.call('ZCOUNT', key, '(' .. after_score, '+inf')  -- larger ids of its own
    local offset = 0
    while true do
      local ties = redis.call('ZREVRANGEBYSCORE', key, after_score, after_score, 'LIMIT',
                              offset, 1000)
      local n = 0
      for _, m in ipairs(ties) do if m > after_id then n = n + 1 end end
      pos = pos + n
      if #ties < 1000 or n < #ties then break end
      offset = offset + 1000
    end
  end
end
local filtered = state ~= '' or endpoint ~= '' or fn ~= ''
local batch = filtered and 200 or size
local out, gone, read = {}, {}, 0
local last_id, last_score, why = '', '', 'end'
while read < cap do
  local members = redis.call('ZREVRANGE', key, pos, pos + batch - 1, 'WITHSCORES')
  if #members == 0 then break end
  pos = pos + #members / 2
  for i = 1, #members, 2 do
    local id = members[i]
    last_id, last_score, read = id, members[i + 1], read + 1
    local v = redis.pcall('HMGET', prefix .. id, 'state', 'endpoint', 'function', 'submitted',
                          'dispatched', 'ended')
    if v.err then  -- not a task's hash (a broken record): not listed, left to its own routes
    elseif not v[1] then
      gone[#gone + 1] = id  -- expired (its result's time to live passed): unindexed
    elseif (state == '' or v[1] == state) and (endpoint == '' or v[2] == endpoint)
        and (fn == '' or v[3] == fn) then
      out[#out + 1] = {id, last_score, v[1], v[2] or '', v[3] or '', v[4] or '', v[5] or '',
                       v[6] or ''}
      if #out == size then why = 'full' break end
    end
    if read >= cap then why = 'cap' break end
  end
  if why ~= 'end' then break end
end
for i = 1, #gone, 1000 do
  redis.call('ZREM', key, unpack(gone, i, math.min(i + 999, #gone)))
end
return {out, why, last_id, last_score}
"""


# the queue Redis client -> its registered page script (not keeping a client alive)
_scripts: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _text(value: bytes) -> str:
    return value.decode(errors="replace")


async def _read(
    store: TaskStore, key: str, flt: Filter, after: tuple[float, str] | None, size: int, cap: int
) -> tuple[list[Row], str]:
    """One script call: up to ``size`` rows ``flt`` keeps from after ``after``, reading at
    most ``cap`` ids; and the cursor to go on from ('' at the end of the index)."""
    script = _scripts.get(store.redis)
    if script is None:  # EVALSHA, loaded once per Redis; its sha1 taken once per client
        script = _scripts[store.redis] = store.redis.register_script(_PAGE)
    score, task_id = after if after is not None else (0.0, "")
    raw, why, last_id, last_score = await script(
        keys=[key],
        args=[store.keys.task(""), size, cap, flt.state, flt.endpoint, flt.function,
              repr(score), task_id],
    )  # fmt: skip
    rows = [
        Row(
            _text(task_id),
            float(score),
            _text(state),
            _text(endpoint),
            _text(function),
            _seconds(submitted),
            _seconds(dispatched),
            _seconds(ended),
        )
        for task_id, score, state, endpoint, function, submitted, dispatched, ended in raw
    ]
    why = _text(why)
    if why == "full":
        return rows, rows[-1].cursor
    if why == "cap":
        return rows, f"{float(last_score)!r}~{_text(last_id)}"
    return rows, ""


async def page(
    store: TaskStore,
    key: str,
    flt: Filter,
    after: tuple[float, str] | None,
    size: int,
    owner: str | None,
) -> tuple[list[Row], str]:
    """Up to ``size`` tasks of the index ``key`` (:func:`index`) that ``flt`` keeps, newest
    first, from after the cursor ``after``; and the cursor of the next page ('' at the end).

    The tasks Redis holds (live, and the recent window) and those of the SQL history
    (``owner``'s, everyone's if None) are read side by side and merged: rows are kept
    down to where both reads are complete, so no task between them is skipped.
    """
    if store.history is None:
        return await _read(store, key, flt, after, size, SCAN_CAP)
    query = Query(owner, flt.state, flt.endpoint, flt.function)
    # side by side: Redis's script runs while a thread reads SQL
    (live, live_cursor), (saved, saved_cursor) = await asyncio.gather(
        _read(store, key, flt, after, size, SCAN_CAP),
        asyncio.to_thread(store.history.page, query, after, size),
    )
    rows = {row.task_id: row for row in (Row(*values) for values in saved)}
    rows.update((row.task_id, row) for row in live)  # Redis's is the fresher
    merged = sorted(rows.values(), key=lambda row: (row.score, row.task_id), reverse=True)
    ends = [c for text in (live_cursor, saved_cursor) if (c := decode_cursor(text))]
    frontier = max(ends, default=None)  # both reads are complete down to here
    if frontier is not None:
        merged = [row for row in merged if (row.score, row.task_id) >= frontier]
    if len(merged) >= size:
        return merged[:size], merged[size - 1].cursor
    return merged, "" if frontier is None else f"{frontier[0]!r}~{frontier[1]}"


async def live_window(store: TaskStore, key: str, flt: Filter) -> list[Row]:
    """The newest ``LIVE_WINDOW`` tasks of the index ``key`` that ``flt`` keeps."""
    rows, _ = await _read(store, key, flt, None, LIVE_WINDOW, LIVE_WINDOW)
    return rows


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


@dataclass(frozen=True)
class Saved:
    """A finished task as the SQL history holds it: what the group pages show of it
    (``worker``, ``started``, ``run_ended`` from its record: '' and 0 without one)."""

    state: str
    owner: str
    endpoint: str
    submitted: float
    dispatched: float
    ended: float
    worker: str
    started: float
    run_ended: float


_NAMES = [f.name for f in fields(TaskRecord)]
_AT = [_NAMES.index(name) for name in ("worker", "started", "ended")]  # in a record's wire list
_CHUNK = 500  # ids one SQL query reads (SQLite's bound parameters are limited)
# the columns of ``nimbus.service.history``'s table that these reads use (read-only)
history = table(
    "task_history",
    *(column(name) for name in ("task_id", "state", "owner_id", "endpoint_id", "group_id",
                                "submitted", "dispatched", "ended", "record")),
)  # fmt: skip


def _saved_rows(table: History, task_ids: list[str]) -> dict[str, Saved]:
    c = history.c
    out: dict[str, Saved] = {}
    with table.engine.connect() as connection:
        for at in range(0, len(task_ids), _CHUNK):
            for task_id, state, owner, endpoint, sub, disp, end, record in connection.execute(
                select(
                    c.task_id, c.state, c.owner_id, c.endpoint_id, c.submitted, c.dispatched,
                    c.ended, c.record,
                ).where(c.task_id.in_(task_ids[at : at + _CHUNK]))
            ):  # fmt: skip
                worker, started, run_ended = "", 0.0, 0.0
                try:
                    wire = msgpack.unpackb(record, raw=False) if record else None
                    if isinstance(wire, list) and len(wire) > max(_AT):
                        worker = str(wire[_AT[0]] or "")
                        started, run_ended = float(wire[_AT[1]] or 0), float(wire[_AT[2]] or 0)
                except (ValueError, TypeError, msgpack.UnpackException):
                    pass  # stored by another version: shown without its worker
                out[task_id] = Saved(
                    state, owner, endpoint, sub, disp, end, worker, started, run_ended
                )
    return out


async def saved(store: TaskStore, task_ids: list[str]) -> dict[str, Saved]:
    """The tasks among ``task_ids`` that the SQL history holds, by id (none without one)."""
    if store.history is None or not task_ids:
        return {}
    return await asyncio.to_thread(_saved_rows, store.history, list(task_ids))


def _group_rows(table: History, group_id: str, limit: int) -> list[str]:
    c = history.c  # the index (group_id, submitted, task_id): O(log n + limit)
    query = (
        select(c.task_id)
        .where(c.group_id == group_id)
        .order_by(c.submitted, c.task_id)
        .limit(limit)
    )
    with table.engine.connect() as connection:
        return list(connection.scalars(query))


async def group_ids(store: TaskStore, group_id: str, limit: int) -> list[str]:
    """The first ``limit`` task ids of a batch in the order submitted: Redis's list of the
    group, or, when Redis no longer has it, the SQL history's (empty: no such batch)."""
    listed = await store.redis.lrange(store.keys.group(group_id), 0, limit - 1)
    if listed or store.history is None:
        return [member.decode() for member in listed]
    return await asyncio.to_thread(_group_rows, store.history, group_id, limit)


async def group_size(store: TaskStore, group_id: str) -> int:
    """How many tasks a batch has (Redis's list, or the SQL history's count)."""
    size = int(await store.redis.llen(store.keys.group(group_id)))
    if size or store.history is None:
        return size
    return await asyncio.to_thread(_group_count, store.history, group_id)


def _group_count(table: History, group_id: str) -> int:
    query = select(func.count()).select_from(history).where(history.c.group_id == group_id)
    with table.engine.connect() as connection:
        return int(connection.scalar(query) or 0)
