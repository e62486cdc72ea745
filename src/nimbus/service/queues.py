"""Per-endpoint task queues and results, in Redis.

::

    submit --> task hash (state waiting) --> endpoint queue (list of ids)
                                                 | take(n): LPOP, state dispatched
                                                 v
                                 endpoint inflight (hash id -> agent connection)
                     requeue(conn) <-- agent lost |  finish(results): first result wins,
                     (back to the queue head)     v  payload dropped, hash expires
                                             task hash (state success/failed/cancelled)

A payload or result in the data store (``nimbus.service.data``) is referenced
by its data id: submit claims the argument blob, finish and cancel delete its
hash (the caller removes the file), a stored result blob expires with the task.

Each user's tasks queued or running, and their inline payload bytes, are
counted in one hash (``Keys.user_queued``): submit refuses a batch that would
pass the user's quota, and a task that ends (finish, cancel) gives its share back.

Each step that moves tasks publishes on the channel ``TaskStore.changes`` the
ids of their owners, space-separated ('' for anyone's): open dashboard pages of
those users re-read what they show. Every step that moves a task is one Lua
script (``nimbus.service.scripts``), so a task is in exactly one of
the queue, the inflight hash or a final state, and a result that arrives twice
(an agent lost, its task run again) is kept once, and counted once (the finish
script keeps the counters of ``nimbus.service.counters`` too). Payloads and results are
bytes the service stores and forwards; nothing here unpickles them.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgpack
import redis.asyncio as aioredis

from nimbus.config import MAX_TIMEOUT
from nimbus.errors import AuthError, NotFound, QuotaExceeded
from nimbus.records import TaskState
from nimbus.service import scripts
from nimbus.service.counters import metrics_key
from nimbus.service.held import TO_FAIL, WOKEN
from nimbus.service.history import History
from nimbus.statestore import Keys

__all__ = ["Broken", "Held", "Taken", "TaskStore"]

Held = tuple[str, str, str]  # a held task to fail: its id, its input's, the input's state
Broken = tuple[str, str, str]  # a task taken whose stored record is broken: id, function, why
Taken = tuple[str, str, bytes, float | None, str, str, dict[str, Any] | None]  # id, function,
# payload, timeout, data id, owner, environment: a task taken to be sent to an agent

DONE = (TaskState.SUCCESS.value, TaskState.FAILED.value, TaskState.CANCELLED.value)
CANCELLED_RESULT = msgpack.packb([2, b"", []])  # Status.SKIPPED, as an agent would send
TO_FAIL_GROUP = "fail"  # the consumer group of ``TaskStore.to_fail``
ENDPOINT_MARK = "ep:"  # on ``changes``, before an endpoint id whose summary changed

_FIELDS = ("state", "owner", "endpoint", "function", "group", "submitted", "dispatched", "ended")


def _raw(obj: object) -> bytes:
    """msgpack that Redis's Lua cmsgpack reads: bytes as the old raw string type."""
    data: bytes = msgpack.packb(obj, use_bin_type=False)
    return data


def _text(value: bytes | None) -> str:
    return value.decode(errors="replace") if value else ""


def _timeout(value: bytes | None) -> float | None:
    """A stored timeout (b"" for none); ValueError if the record is broken."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_TIMEOUT:  # also NaN
        raise ValueError(f"timeout {value!r} is not a number of seconds from 0 to {MAX_TIMEOUT}")
    return seconds


def _environment(value: bytes) -> dict[str, Any] | None:
    """A stored environment (b"" for none); ValueError if the record is broken."""
    if not value:
        return None
    try:
        env = msgpack.unpackb(value)
    except Exception:
        env = None
    if not isinstance(env, dict):
        raise ValueError(f"environment {value[:40]!r} is not a packed environment")
    return env


class TaskStore:
    """Task queues and results of one service in one Redis (``keys`` names them)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, result_ttl: float) -> None:
        self.redis: Any = redis  # redis-py's asyncio stubs type replies as bytes | str
        self.keys = keys
        self.result_ttl = max(1, int(result_ttl))
        self._task_prefix = keys.task("")
        self.changes = self._task_prefix + "changed"  # pub/sub channel: tasks moved
        # stream of the ids of tasks ended, that the flusher moves to the SQL history
        self.finished = self._task_prefix + "finished"
        # stream of the held tasks to fail (their input failed), read by a consumer group
        # (``nimbus.service.dependencies``): rows {d: dependent, i: input, s: its state}
        self.to_fail = self._task_prefix + TO_FAIL
        # pub/sub channel: endpoints whose queues held tasks joined (``finish`` publishes)
        self.woken = self._task_prefix + WOKEN
        self.history: History | None = None  # where tasks no longer in Redis are read
        self._data_prefix = keys.data("")
        self._submit = redis.register_script(scripts.SUBMIT)
        self._take = redis.register_script(scripts.TAKE)
        self._finish = redis.register_script(scripts.FINISH)
        self._requeue = redis.register_script(scripts.REQUEUE)
        self._running = redis.register_script(scripts.RUNNING)
        self._cancel = redis.register_script(scripts.CANCEL)
        self._fail_held = redis.register_script(scripts.FAIL_HELD)
        self._then = keys.task_dependents("-")[len(keys.task("-")) :]  # ":then"
        # an endpoint's queue and its set of held tasks, around the endpoint id
        self._queue = [
            *keys.endpoint_queue("\0").split("\0"),
            *keys.endpoint_held("\0").split("\0"),
        ]
        # what to do when tasks held for others are released (the service's
        # ``dependencies.held_by``): called with the endpoints whose queues grew
        self.settle: Callable[[list[str]], Awaitable[None]] | None = None

    async def submit(
        self,
        owner: str,
        endpoint_id: str,
        group_id: str,
        tasks: Sequence[
            tuple[str, str, bytes, float | None, str]
            | tuple[str, str, bytes, float | None, str, dict[str, Any] | None]
        ],
        *,
        max_tasks: int,
        max_bytes: int,
        after: Sequence[Sequence[str] | None] | None = None,
    ) -> None:
        """Queue ``(task_id, function_id, payload, timeout, data_id, environment)`` rows for
        an endpoint.

        ``after`` (one entry per row, or None): the ids of the tasks whose results a row
        takes. Such a task is held (not queued) until they succeed, and fails (the stream
        ``to_fail``) if one fails or is cancelled; an input that is not known, or not ``owner``'s,
        refuses the whole batch (NotFound, AuthError) before anything is queued.

        A row with a ``data_id`` has its payload in the data store (``payload`` is empty);
        ``environment`` (an Environment's ``to_dict()``, or None; a row may leave it out)
        is stored packed.
        :class:`~nimbus.errors.QuotaExceeded` (429), and nothing queued, if the owner
        would then have more than ``max_tasks`` tasks or ``max_bytes`` inline payload
        bytes queued or running.
        """
        rows = [
            (
                task_id,
                fn,
                payload,
                "" if timeout is None else repr(timeout),
                data_id,
                msgpack.packb(env[0]) if env and env[0] is not None else b"",
            )
            for task_id, fn, payload, timeout, data_id, *env in tasks
        ]
        if after is not None:
            rows = [(*row, list(a)) if a else row for row, a in zip(rows, after)]  # type: ignore[misc]
        size = sum(len(row[2]) for row in rows)
        ended: dict[str, str] = {}  # inputs out of Redis, in the SQL history: their state
        while True:
            queued, have, *missing = await self._submit_rows(
                owner, endpoint_id, group_id, rows, size, ended, max_tasks, max_bytes
            )
            if queued != -3 or self.history is None or ended or after is None:
                break
            ended = await self._ended(owner, after)  # saved and dropped from Redis
            if not ended:
                break
        if queued == -3:
            raise NotFound(
                f"tasks[{have}].after: task {_text(missing[0])} is not known (it never was, or "
                f"it ended more than the service's result time ago); pass only futures of "
                f"tasks still known to the service",
                404,
            )
        if queued == -4:
            raise AuthError(
                f"tasks[{have}].after: task {_text(missing[0])} is not yours: a task can take "
                f"the results of its owner's tasks only",
                403,
            )
        if queued == -1:
            raise QuotaExceeded(
                f"quota: you have {have} tasks queued or running and may have at most "
                f"{max_tasks} (NIMBUS_MAX_QUEUED_TASKS on the service); wait for some to "
                f"finish or cancel them, then submit these {len(rows)} again",
                429,
            )
        if queued == -2:
            raise QuotaExceeded(
                f"quota: you have {have} bytes of inline payloads queued or running and may "
                f"have at most {max_bytes} (NIMBUS_MAX_QUEUED_BYTES on the service); these "
                f"{len(rows)} tasks add {size}; wait for some to finish or cancel them",
                429,
            )

    async def _submit_rows(
        self,
        owner: str,
        endpoint_id: str,
        group_id: str,
        rows: list[Any],
        size: int,
        ended: dict[str, str],
        max_tasks: int,
        max_bytes: int,
    ) -> list[Any]:
        blob = _raw([owner, endpoint_id, group_id, repr(time.time()), rows, size, ended])
        reply: list[Any] = await self._submit(
            keys=[
                self.keys.endpoint_queue(endpoint_id),
                self.keys.user_tasks(owner),
                self.keys.group(group_id),
                self.keys.user_queued(owner),
                self.keys.all_tasks(),
                self.keys.endpoint_held(endpoint_id),
            ],
            args=[
                self._task_prefix,
                blob,
                self.result_ttl,
                self._data_prefix,
                max_tasks,
                max_bytes,
                self._then,
            ],
        )
        return reply

    async def _ended(self, owner: str, after: Sequence[Sequence[str] | None]) -> dict[str, str]:
        """The inputs named in ``after`` that are no longer in Redis but in the SQL history
        (saved, then dropped by the flusher's trim): their final state. AuthError (403) for
        one that is not ``owner``'s."""
        assert self.history is not None
        named = list(dict.fromkeys(a for row in after if row for a in row))
        pipe = self.redis.pipeline(transaction=False)
        for task_id in named:
            pipe.exists(self._task_prefix + task_id)
        gone = [a for a, n in zip(named, await pipe.execute()) if not n]
        found = await asyncio.to_thread(self.history.info, gone) if gone else {}
        out = {}
        for task_id, info in found.items():
            if info["owner"] != owner:
                place = next(i for i, row in enumerate(after) if row and task_id in row)
                raise AuthError(
                    f"tasks[{place}].after: task {task_id} is not yours: a task can take "
                    f"the results of its owner's tasks only",
                    403,
                )
            if info["state"] in DONE:
                out[task_id] = info["state"]
        return out

    async def queued(self, owner: str) -> tuple[int, int]:
        """The tasks and inline payload bytes ``owner`` has queued or running."""
        tasks, size = await self.redis.hmget(self.keys.user_queued(owner), ["tasks", "bytes"])
        return int(tasks or 0), int(size or 0)

    async def take(
        self, endpoint_id: str, conn_id: str, n: int
    ) -> tuple[list[Taken], list[Broken]]:
        """Up to ``n`` waiting tasks of an endpoint, now in flight on ``conn_id``.

        Rows are ``(task_id, function_id, payload, timeout, data_id, owner, environment)``;
        a task whose
        stored record cannot be read (a bug, an older version) comes apart, as
        ``(task_id, function_id, why)``, for the caller to fail.
        """
        blob = await self._take(
            keys=[self.keys.endpoint_queue(endpoint_id), self.keys.endpoint_inflight(endpoint_id)],
            args=[n, conn_id, self._task_prefix, repr(time.time())],
        )
        rows = msgpack.unpackb(blob, raw=True)
        if not rows:  # cmsgpack packs an empty table as a map
            return [], []
        out, broken = [], []
        for task_id, fn, payload, timeout, d, owner, env in rows:
            try:
                row = (task_id.decode(), fn.decode(), payload, _timeout(timeout), _text(d))
                out.append((*row, _text(owner), _environment(env)))
            except ValueError as exc:
                broken.append((_text(task_id), _text(fn), str(exc)))
        return out, broken

    async def finish(
        self, endpoint_id: str, results: Sequence[Sequence[Any]]
    ) -> tuple[list[str], list[str]]:
        """Store ``(task_id, state, result, record, result_data_id[, measures])`` rows (first
        wins), and count the tasks stored on the endpoint's metrics hash (``counters``;
        ``measures``: ``counters.measures`` of the record, else the script reads the record).

        Returns the ids stored and the data-store blobs no longer used (arguments of
        the tasks now done, results that came second), to remove.
        """
        args: list[Any] = [
            self._task_prefix,
            repr(time.time()),
            self.result_ttl,
            endpoint_id,
            _raw([list(row) for row in results]),
            self._data_prefix,
            self.finished,
            self._then,
            *self._queue,
        ]
        stored, drop, woken = await self._finish(
            keys=[
                self.keys.endpoint_inflight(endpoint_id),
                metrics_key(self.keys, endpoint_id),
                self.keys.endpoint_held(endpoint_id),
            ],
            args=args,
        )
        if woken and self.settle is not None:
            await self.settle([_text(e) for e in woken])
        return [value.decode() for value in stored], [value.decode() for value in drop]

    async def fail_held(
        self, rows: Sequence[tuple[str, bytes]], entries: Sequence[bytes | str] = ()
    ) -> tuple[list[str], list[str]]:
        """Fail held tasks ``(task_id, packed result)`` (their input failed) and acknowledge
        the ``entries`` of ``to_fail`` that named them (group ``group``): those failed (not
        cancelled or ended meanwhile) and the data-store blobs to remove. The tasks held
        for them are appended to ``to_fail`` in turn."""
        stored, drop = await self._fail_held(
            args=[
                self._task_prefix,
                repr(time.time()),
                self.result_ttl,
                _raw([list(row) for row in rows]),
                self._then,
                self._data_prefix,
                *self._queue,
                self.finished,
                TO_FAIL_GROUP,
                *metrics_key(self.keys, "\0").split("\0"),
                *entries,
            ]
        )
        return [_text(value) for value in stored], [_text(value) for value in drop]

    async def to_fail_group(self) -> None:
        """Make the consumer group of ``to_fail`` if it is missing."""
        try:
            await self.redis.xgroup_create(self.to_fail, TO_FAIL_GROUP, id="0", mkstream=True)
        except aioredis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read_to_fail(
        self, consumer: str, *, count: int, block: float | None = None, claim: float | None = None
    ) -> list[tuple[bytes, Held]]:
        """Entries of ``to_fail`` for ``consumer``: new ones (waiting up to ``block``
        seconds for one), or with ``claim`` those any consumer took more than ``claim``
        seconds ago and did not acknowledge (it died, or failed them partly)."""
        if claim is not None:
            got = await self.redis.xautoclaim(
                self.to_fail, TO_FAIL_GROUP, consumer, int(claim * 1000), "0-0", count=count
            )
            messages = got[1]
        else:
            reply = await self.redis.xreadgroup(
                TO_FAIL_GROUP, consumer, {self.to_fail: ">"}, count=count,
                block=None if block is None else max(1, int(block * 1000)),
            )  # fmt: skip
            messages = [m for _, batch in reply or () for m in batch]
        out = []
        for entry, fields in messages:
            if fields:  # None: deleted meanwhile (acknowledged by another process)
                row = (_text(fields.get(b"d")), _text(fields.get(b"i")), _text(fields.get(b"s")))
                out.append((entry, row))
        return out

    async def running(self, endpoint_id: str, task_ids: Sequence[str]) -> None:
        """Mark dispatched tasks of ``endpoint_id`` as running (its agent said so)."""
        if task_ids:  # when: its run time so far counts from here (not from dispatch)
            await self._running(args=[self._task_prefix, endpoint_id, repr(time.time()), *task_ids])

    async def requeue(self, endpoint_id: str, conn_id: str = "") -> int:
        """Put tasks in flight on ``conn_id`` (all if empty) back at the queue head."""
        n: int = await self._requeue(
            keys=[self.keys.endpoint_queue(endpoint_id), self.keys.endpoint_inflight(endpoint_id)],
            args=[self._task_prefix, conn_id, endpoint_id],
        )
        return n

    async def requeue_all(self) -> int:
        """At start: every task in flight belonged to a connection of a previous run."""
        total = 0
        pattern = self.keys.endpoint_inflight("*")
        async for key in self.redis.scan_iter(match=pattern, count=1000):
            endpoint_id = key.decode().split(":")[-2]
            total += await self.requeue(endpoint_id)
        return total

    async def cancel(self, task_id: str, endpoint_id: str) -> tuple[str, str] | None:
        """Cancel a task not yet done (None if it was): the agent connection holding it
        ('' if none) and the data-store blob of its arguments ('' if none), to remove."""
        done = await self._cancel(
            keys=[
                self._task_prefix + task_id,
                self.keys.endpoint_inflight(endpoint_id),
                metrics_key(self.keys, endpoint_id),
                self.keys.endpoint_held(endpoint_id),
            ],
            args=[
                CANCELLED_RESULT,
                repr(time.time()),
                self.result_ttl,
                task_id,
                self._data_prefix,
                self.finished,
                self._task_prefix,
                self._then,
                *self._queue,
            ],
        )
        if done is None:
            return None
        await self.redis.publish(self.changes, b"")
        conn, data = done
        return _text(conn), _text(data)

    async def info(self, task_ids: Sequence[str]) -> list[dict[str, Any] | None]:
        """Each task's fields (None for an unknown or expired task, or one whose record
        is not a hash), without payloads."""
        pipe = self.redis.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.hmget(self._task_prefix + task_id, [*_FIELDS, "record", "timeout", "started"])
        out: list[dict[str, Any] | None] = []
        for task_id, values in zip(task_ids, await pipe.execute(raise_on_error=False)):
            if isinstance(values, Exception) or values[0] is None:  # unknown, or not a hash
                out.append(None)
                continue
            info: dict[str, Any] = {"task_id": task_id}
            for name, value in zip(_FIELDS, values):
                info[name] = _text(value)
            info["record"] = values[len(_FIELDS)]
            info["started"] = _text(values[-1])  # set once a worker started it ('' before)
            try:
                info["timeout"] = _timeout(values[-2])
            except ValueError:
                info["timeout"] = None  # a broken record: its dispatch fails the task
            out.append(info)
        if self.history is not None and None in out:
            await self._from_history(task_ids, out)
        return out

    async def _from_history(
        self, task_ids: Sequence[str], out: list[Any], result: bool = False
    ) -> None:
        """Fill the ``None`` of ``out`` with the tasks the SQL history holds."""
        assert self.history is not None
        missing = [task_id for task_id, got in zip(task_ids, out) if got is None]
        found = await asyncio.to_thread(self.history.info, missing)
        for i, task_id in enumerate(task_ids):
            if out[i] is None and (info := found.get(task_id)) is not None:
                if result:
                    out[i] = (info["state"], info["result"] or b"", info["record"] or b"")
                else:
                    out[i] = {k: v for k, v in info.items() if k != "result"}

    async def results(self, task_ids: Sequence[str]) -> list[tuple[str, bytes, bytes] | None]:
        """``(state, result, record)`` of each finished task, None for one not finished."""
        pipe = self.redis.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.hmget(self._task_prefix + task_id, ["state", "result", "record"])
        out: list[tuple[str, bytes, bytes] | None] = []
        gone = []  # not in Redis (any more): the SQL history may hold them
        for task_id, values in zip(task_ids, await pipe.execute(raise_on_error=False)):
            if isinstance(values, Exception):  # not a hash: a broken record
                out.append(None)
                continue
            state, result, record = values
            if state is not None and state.decode(errors="replace") in DONE:
                out.append((state.decode(), result or b"", record or b""))
            else:
                out.append(None)
                if state is None:
                    gone.append(task_id)
        if self.history is not None and gone:
            found: list[Any] = [None] * len(gone)
            await self._from_history(gone, found, result=True)
            where = {task_id: i for i, task_id in enumerate(task_ids)}
            for task_id, got in zip(gone, found):
                out[where[task_id]] = got
        return out

    async def user_task_ids(self, owner: str, limit: int) -> list[str]:
        ids = await self.redis.zrevrange(self.keys.user_tasks(owner), 0, limit - 1)
        return [i.decode() for i in ids]

    async def forget(self, owner: str, task_ids: Sequence[str]) -> None:
        """Drop expired tasks from a user's index."""
        if task_ids:
            await self.redis.zrem(self.keys.user_tasks(owner), *task_ids)

    async def group(self, group_id: str) -> list[str]:
        return [i.decode() for i in await self.redis.lrange(self.keys.group(group_id), 0, -1)]

    async def endpoint_task_ids(self, endpoint_id: str) -> list[str]:
        """The tasks queued for an endpoint, in flight on its agents or held there until
        their inputs end (one snapshot)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hkeys(self.keys.endpoint_inflight(endpoint_id))
        pipe.lrange(self.keys.endpoint_queue(endpoint_id), 0, -1)
        pipe.smembers(self.keys.endpoint_held(endpoint_id))
        inflight, queued, held = await pipe.execute()
        return list(dict.fromkeys(i.decode() for i in [*inflight, *queued, *sorted(held)]))

    async def forget_endpoint(self, endpoint_id: str) -> None:
        """Drop a deleted endpoint's queue, in-flight index and status (its tasks are done)."""
        await self.redis.delete(
            self.keys.endpoint_queue(endpoint_id),
            self.keys.endpoint_inflight(endpoint_id),
            self.keys.endpoint_held(endpoint_id),
            self.keys.endpoint_status(endpoint_id),
        )

    async def queue_length(self, endpoint_id: str) -> int:
        n: int = await self.redis.llen(self.keys.endpoint_queue(endpoint_id))
        return n

    async def set_status(self, endpoint_id: str, **fields: Any) -> None:
        await self.redis.hset(self.keys.endpoint_status(endpoint_id), mapping=fields)

    async def endpoint_changed(self, endpoint_id: str) -> None:
        """Say on ``changes`` that an endpoint's summary or connections changed (its
        dashboard page reads its state again; nothing is read while nothing changes)."""
        await self.redis.publish(self.changes, ENDPOINT_MARK + endpoint_id)

    async def status(self, endpoint_id: str) -> dict[str, str]:
        raw = await self.redis.hgetall(self.keys.endpoint_status(endpoint_id))
        return {k.decode(): v.decode() for k, v in raw.items()}
