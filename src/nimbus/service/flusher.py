"""Moving finished tasks from the queue Redis to the SQL history, in bulk, off the task path.

::

    finish / cancel script ---XADD ids + rows---> stream TaskStore.finished
                                              | consumer group "history": each entry to one
                                              v service process's Flusher
    Flusher (one per service process, run in its writer process: history_writer.py),
    when no task ended for a TICK, BACKLOG entries wait or the oldest waited DELAY:
    XREADGROUP (or XAUTOCLAIM of entries another process took and did not
    acknowledge within CLAIM_IDLE) -> the rows the entries
    carry -> History.write (one transaction, idempotent) -> one script: XACK + XDEL
    the entries, trim the indexes (a task is saved once the stream holds no entry as
    old as its own, which its hash names: no mark is written task by task)

The scripts that end tasks append, in one XADD a call, the ids and the history's
row of each task they ended (its fields as they were then: nothing is read back
from the task hashes, which may have expired meanwhile); entries with ids only
(held tasks failed, tasks an older nimbus kept in Redis) are read from the hashes.
The writes wait while tasks keep ending, at most ``DELAY`` (so they are few and
large, and a task reaches the history within about that), and when the service
stops the entries waiting are written. Two processes never write an entry at once
(the group hands each entry to one consumer), and an entry is acknowledged only
after its rows are committed: a process that dies in between leaves it pending,
and another (or the next start) claims it after ``CLAIM_IDLE`` and writes it
again, which the history's first-row-wins insert makes harmless. So nothing an
agent's result was acknowledged for is lost, as long as the queue Redis keeps its
stream (``--persist``). While the database is away, the entries (results
included) wait in the queue Redis.

Redis keeps what is live and a recent window: each index (everyone's, a user's)
keeps ``RECENT`` tasks once they are saved, and a tenth more before it is trimmed
(twice as many while tasks keep ending: the trim's deletions wait for a pause); a
saved task beyond that is dropped from the index, and from Redis when it leaves
everyone's. An index whose oldest ``TRIM_SCAN`` tasks are all still live is not
trimmed further until they end.

The SQL history keeps ``keep`` seconds (the ``history_days`` setting; None:
forever): every ``EXPIRE_EVERY`` seconds a flusher deletes the rows submitted
before that, ``EXPIRE_BATCH`` a transaction with a pause between them, so
that the writes of finished tasks (and the other processes' flushers, which
may delete the same rows: harmless) go on meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Sequence
from typing import Any

import msgpack
import redis
from sqlalchemy.exc import OperationalError

from nimbus.service.history import FIELDS, History
from nimbus.service.queues import DONE, TaskStore

__all__ = ["CLAIM_IDLE", "EXPIRE_EVERY", "GROUP", "RECENT", "Flusher"]

GROUP = "history"
RECENT = 10_000  # saved tasks an index keeps in Redis, newest
CLAIM_IDLE = (
    30.0  # seconds an entry taken by a process stays unacknowledged before another takes it
)
BATCH = 500  # stream entries read at once (an entry holds the rows of one finish call)
DELAY = 2.0  # seconds a finished task waits at most for its write while tasks keep ending
BACKLOG = 1000  # entries waiting that start a write at once
TICK = 0.2  # seconds between two looks at the stream's length
GONE_MS = 3_600_000  # a consumer idle this long, with nothing pending, is dropped
TRIM_SCAN = 2000  # oldest members of an index looked at by one trim
EXPIRE_EVERY = 300.0  # seconds between two deletions of the history's expired rows
EXPIRE_BATCH = 2000  # rows deleted by one transaction
EXPIRE_PAUSE = 0.05  # seconds between two such transactions
_FIELDS = ("owner", "endpoint", "function", "group", "state", "submitted", "dispatched",
           "ended", "timeout", "result", "record")  # fmt: skip
_WIDTH = len(FIELDS)  # the values of one row in a stream entry's flat "rows"

# KEYS: the stream, everyone's index, the users' indexes; ARGV: group, task prefix,
# RECENT, TRIM_SCAN, the slack an index may exceed RECENT by before it is trimmed,
# the entry ids and the ids of the tasks saved that do not name their entry (each one
# string, space-separated). A task the finish or cancel script ended names the entry of
# its row ('entry'): it is saved once the stream holds no entry as old (an entry leaves
# the stream only here, once its rows are committed), so it is marked by no write here.
_SAVED = """
local entries, n = {}, 0
for id in string.gmatch(ARGV[6], '%S+') do entries[#entries + 1] = id end
for id in string.gmatch(ARGV[7], '%S+') do
  local key = ARGV[2] .. id
  if redis.call('EXISTS', key) == 1 then redis.call('HSET', key, 'saved', 1) end
end
for i = 1, #entries, 1000 do
  local part = {unpack(entries, i, math.min(i + 999, #entries))}
  redis.call('XACK', KEYS[1], ARGV[1], unpack(part))
  redis.call('XDEL', KEYS[1], unpack(part))
end
local first  -- the oldest entry not yet saved: {ms, seq}, or none
local function position(entry)
  local ms, seq = string.match(entry, '^(%d+)-(%d+)$')
  if ms then return {tonumber(ms), tonumber(seq)} end
end
local function saved(entry)  -- a task's entry, older than any the stream holds?
  if not entry then return false end
  if first == nil then
    local oldest = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1]
    first = oldest and position(oldest[1]) or false
  end
  if not first then return true end
  local at = position(entry)
  return at ~= nil and (at[1] < first[1] or (at[1] == first[1] and at[2] < first[2]))
end
local recent, scan, slack, trimmed = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), 0
local out = {}  -- id -> out of the indexes, as found in the first that held it
for k = 2, #KEYS do
  local excess = redis.call('ZCARD', KEYS[k]) - recent
  if excess > slack then
    local drop = {}
    for _, id in ipairs(redis.call('ZRANGE', KEYS[k], 0, math.min(excess, scan) - 1)) do
      local key = ARGV[2] .. id
      local gone = out[id]
      if gone == nil then
        local v = redis.call('HMGET', key, 'state', 'saved', 'entry')
        gone = not v[1] or v[2] or saved(v[3])  -- in the SQL history (or expired)
        out[id] = gone and true or false
      end
      if gone then
        drop[#drop + 1] = id
        if k == 2 then redis.call('DEL', key) end  -- out of everyone's: out of Redis
      end
    end
    for i = 1, #drop, 1000 do
      redis.call('ZREM', KEYS[k], unpack(drop, i, math.min(i + 999, #drop)))
    end
    trimmed = trimmed + #drop
  end
end
return trimmed
"""

log = logging.getLogger(__name__)


class Flusher:
    """This process's consumer of the finished-tasks stream; :meth:`run` until cancelled."""

    def __init__(self, store: TaskStore, history: History, keep: float | None = None) -> None:
        self.store = store
        self.history = history
        self.keep = keep  # seconds the SQL history keeps a task (None: forever)
        self._next_expire = 0.0
        self.expire_batch = EXPIRE_BATCH
        self.redis: Any = store.redis
        self.consumer = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._saved = self.redis.register_script(_SAVED)
        self._next_claim = 0.0
        self.recent = RECENT
        self.claim_idle = CLAIM_IDLE
        self.batch = BATCH
        self.gone_ms = GONE_MS
        self.delay = DELAY
        self.backlog = BACKLOG
        self.tick = TICK
        self._untrimmed: set[bytes] = set()  # owners whose indexes a busy write left over
        self.written = 0  # rows this flusher wrote

    async def start(self) -> bool:
        """Make the consumer group if it is missing; True if this call made it."""
        try:
            await self.redis.xgroup_create(self.store.finished, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
            return False
        return True

    async def backfill(self) -> int:
        """Queue for the history the finished tasks an older nimbus kept in Redis only
        (its everyone's index, oldest first); how many."""
        index = self.store.keys.all_tasks()
        prefix = self.store.keys.task("")
        total, start = 0, 0
        while True:
            ids = await self.redis.zrange(index, start, start + 999)
            if not ids:
                return total
            start += len(ids)
            pipe = self.redis.pipeline(transaction=False)
            for task_id in ids:
                pipe.hget(prefix + task_id.decode(), "state")
            states = await pipe.execute(raise_on_error=False)
            done = [i for i, s in zip(ids, states) if isinstance(s, bytes) and s.decode() in DONE]
            if done:
                await self.redis.xadd(self.store.finished, {"ids": b" ".join(done)})
                total += len(done)

    async def prepare(self) -> None:
        """The consumer group, made if missing (then the older layout's tasks queued);
        the consumers of processes gone (nothing pending, idle an hour) dropped."""
        if not await self.start():
            for consumer in await self.redis.xinfo_consumers(self.store.finished, GROUP):
                if consumer["pending"] == 0 and consumer["idle"] >= self.gone_ms:
                    await self.redis.xgroup_delconsumer(
                        self.store.finished, GROUP, consumer["name"]
                    )
            return
        queued = await self.backfill()
        if queued:
            log.info("moving %d finished tasks kept in Redis to the SQL history", queued)

    async def run(self) -> None:
        """Write the finished tasks when none ended for a ``TICK`` (the service is idle),
        when ``BACKLOG`` entries wait or when the oldest waited ``DELAY``; and, as the
        service stops (cancelled), those still waiting."""
        ready, since, seen = False, 0.0, 0
        try:
            while True:
                try:
                    if not ready:
                        await self.prepare()
                        ready = True
                    waiting = await self.redis.xlen(self.store.finished)
                    now = time.monotonic()
                    if not seen:
                        since = now
                    idle = waiting == seen  # no task ended since the last look
                    if waiting and (idle or waiting >= self.backlog or now - since >= self.delay):
                        await self.drain(busy=not idle)
                        waiting = 0
                    seen = waiting
                    if not waiting and self._untrimmed:  # a pause: the trims that waited
                        await self.trim()
                    if self.keep is not None and time.monotonic() >= self._next_expire:
                        self._next_expire = time.monotonic() + EXPIRE_EVERY
                        expired = await self.expire()
                        if expired:
                            log.info("%d tasks older than the history keeps deleted", expired)
                    await asyncio.sleep(self.tick)
                except asyncio.CancelledError:
                    raise
                except redis.ResponseError as exc:
                    if "NOGROUP" not in str(exc):
                        raise
                    ready = False  # the queue Redis started again empty: make the group again
                except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                    log.debug("the queue Redis is away (%s): finished tasks wait in it", exc)
                    ready = False  # (its outage is said once, by the service's supervisor)
                    await asyncio.sleep(1.0)
                except OperationalError as exc:  # the database away or locked: they wait too
                    log.warning("cannot write finished tasks to the SQL history yet: %s", exc)
                    await asyncio.sleep(1.0)
                except Exception:
                    log.exception("moving finished tasks to the SQL history")
                    ready = False
                    await asyncio.sleep(1.0)
        except asyncio.CancelledError:
            # the service stops: what ended last is written now, not at its next start
            with contextlib.suppress(Exception):
                if not ready:  # (stopped as it started, or while Redis was away)
                    await self.prepare()
                await self.step(0, own=True)  # (a write the cancellation interrupted)
                await self.drain()
            raise

    async def drain(self, busy: bool = False) -> int:
        """Write the entries waiting, a batch at a time, until none is left; the rows.
        ``busy``: tasks keep ending, so the indexes are trimmed only past twice ``recent``."""
        total = 0
        while written := await self.step(0, busy=busy):
            total += written
        return total

    async def expire(self) -> int:
        """Delete the history's rows submitted more than ``keep`` seconds ago, in
        batches; how many went."""
        if self.keep is None:
            return 0
        before, total = time.time() - self.keep, 0
        while True:
            n = await asyncio.to_thread(self.history.trim, before, self.expire_batch)
            total += n
            if n < self.expire_batch:
                return total
            await asyncio.sleep(EXPIRE_PAUSE)

    async def step(self, block: float = 1.0, own: bool = False, busy: bool = False) -> int:
        """Read, write and acknowledge one batch of entries (``own``: of those this
        flusher read before and did not acknowledge); the rows written. An index is
        trimmed once it holds a tenth more than ``recent`` saved tasks, or twice as many
        when ``busy`` (the trim's deletions wait for a pause)."""
        entries: list[tuple[Any, Any]] = []
        now = time.monotonic()
        if now >= self._next_claim:  # entries of a process that died with them
            self._next_claim = now + self.claim_idle / 2
            claimed = await self.redis.xautoclaim(
                self.store.finished,
                GROUP,
                self.consumer,
                int(self.claim_idle * 1000),
                start_id="0-0",
                count=self.batch,
            )
            entries += claimed[1]
        if not entries:
            got = await self.redis.xreadgroup(
                GROUP, self.consumer, {self.store.finished: "0" if own else ">"}, count=self.batch,
                block=int(block * 1000) or None,
            )  # fmt: skip
            for _, messages in got or ():
                entries += messages
        if not entries:
            return 0
        rows: list[Sequence[Any]] = []
        ids: list[bytes] = []  # of entries without their rows (a held task failed, backfill)
        unnamed: list[bytes] = []  # tasks saved that do not name their entry: marked saved
        for _, fields in entries:
            if not fields:  # deleted meanwhile (acknowledged by another process)
                continue
            if b"rows" in fields:
                flat = msgpack.unpackb(fields[b"rows"], raw=True)
                rows += [flat[i : i + _WIDTH] for i in range(0, len(flat), _WIDTH)]
                if b"e" not in fields:  # (appended by an older nimbus)
                    unnamed += flat[::_WIDTH]
            else:
                ids += fields.get(b"ids", b"").split()
        prefix = self.store.keys.task("")
        if ids:
            pipe = self.redis.pipeline(transaction=False)
            for task_id in dict.fromkeys(ids):
                pipe.hmget(prefix + task_id.decode(), _FIELDS)
            for task_id, values in zip(dict.fromkeys(ids), await pipe.execute(False)):
                if isinstance(values, Exception) or not values[4]:  # expired, or broken
                    continue
                if values[4].decode(errors="replace") in DONE:
                    rows.append((task_id, *values))
                    unnamed.append(task_id)
        owners = {row[1] or b"" for row in rows}
        await asyncio.to_thread(self.history.write, rows)
        await self._trim(owners, busy, entries, unnamed)
        self.written += len(rows)
        return len(rows)

    async def trim(self) -> int:
        """Trim the indexes a busy write left over ``recent`` (a tenth more kept), a
        ``TRIM_SCAN`` at a time; how many tasks left them."""
        total = 0
        while self._untrimmed:
            trimmed = await self._trim(self._untrimmed)
            total += trimmed
            if trimmed < TRIM_SCAN:
                self._untrimmed.clear()
            await asyncio.sleep(0)  # (other clients of Redis between two)
        return total

    async def _trim(
        self,
        owners: set[bytes],
        busy: bool = False,
        entries: Sequence[tuple[Any, Any]] = (),
        unnamed: Sequence[bytes] = (),
    ) -> int:
        """The script that acknowledges ``entries``, marks the tasks ``unnamed`` (saved, not
        naming their entry) saved and trims everyone's index and ``owners``' indexes; how
        many tasks left them."""
        if busy:
            self._untrimmed |= owners
        keys = self.store.keys
        return int(
            await self._saved(
                keys=[
                    self.store.finished,
                    keys.all_tasks(),
                    *(
                        keys.user_tasks(owner.decode(errors="replace"))
                        for owner in sorted(owners)
                        if owner
                    ),
                ],
                args=[
                    GROUP,
                    keys.task(""),
                    self.recent,
                    TRIM_SCAN,
                    self.recent if busy else self.recent // 10,
                    b" ".join(entry_id for entry_id, _ in entries),
                    b" ".join(unnamed),
                ],
            )
        )
