"""The task listing on a real Redis with real queue scripts: keyset pages in order
across ties, filters, an expired cursor, the time a page takes deep in a large index,
and a batch older than Redis's window read from the SQL history."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import msgpack
import pytest
from sqlalchemy import create_engine

from nimbus.records import TaskRecord, TaskState
from nimbus.service import listing
from nimbus.service.dashboard import _batches, _timeline
from nimbus.service.flusher import Flusher
from nimbus.service.history import History
from nimbus.service.listing import Filter, decode_cursor, index, live_window, page
from nimbus.service.queues import TaskStore
from nimbus.statestore import Keys, connect_async

N = 20_000  # tasks in the index
BATCH = 5_000  # per submit: a batch shares one score, so most cursors fall inside ties
OWNER = "owner-1"


async def _fill(store: TaskStore) -> list[str]:
    """Submit N tasks to endpoints a and b (functions f and g); newest first."""
    ids: list[str] = []
    for b in range(N // BATCH):
        rows = [(str(uuid.uuid4()), "f" if i % 3 else "g", b"x", None, "") for i in range(BATCH)]
        endpoint = "ep-a" if b % 2 == 0 else "ep-b"
        await store.submit(OWNER, endpoint, f"grp{b}", rows, max_tasks=10**9, max_bytes=10**12)
        ids += [row[0] for row in rows]
        await asyncio.sleep(0.002)  # distinct scores between batches
    taken, _ = await store.take("ep-a", "conn-1", 10)  # 10 dispatched
    await store.running("ep-a", [row[0] for row in taken[:4]])  # 4 of them running
    scores = await store.redis.zrevrange(store.keys.all_tasks(), 0, -1)
    assert scores == await store.redis.zrevrange(store.keys.user_tasks(OWNER), 0, -1)
    return [member.decode() for member in scores]


async def _drop(store: TaskStore) -> None:
    """Every key of ``store``'s program unlinked (1,000 a command), its connection closed."""
    keys = [key async for key in store.redis.scan_iter(match=store.keys.pattern())]
    for i in range(0, len(keys), 1000):
        await store.redis.unlink(*keys[i : i + 1000])
    await store.redis.aclose()


@pytest.fixture
def store(store_url: str) -> TaskStore:
    return TaskStore(connect_async(store_url), Keys(Keys.program_id_new()), result_ttl=60)


@pytest.fixture(params=[False, True], ids=["user", "admin"])
def key(request: pytest.FixtureRequest, store: TaskStore) -> str:
    """The user's own index, or the admin's of every task (one user here: the same tasks)."""
    return index(store, OWNER, admin=request.param)


def test_pages_filters_and_latency(store: TaskStore, key: str) -> None:

    async def scenario() -> None:
        try:
            newest_first = await _fill(store)
            assert len(newest_first) == N

            seen: list[str] = []
            after = None
            took: list[float] = []
            while True:  # every task once, in the index's order
                start = time.perf_counter()
                rows, cursor = await page(store, key, Filter(), after, 500, None)
                took.append(time.perf_counter() - start)
                seen += [row.task_id for row in rows]
                if not cursor:
                    break
                after = decode_cursor(cursor)
            assert seen == newest_first
            took.sort()
            p95 = took[int(0.95 * len(took))]
            print(f"\n{len(took)} pages of 500 over {N} tasks: p95 {p95 * 1000:.1f} ms")
            assert p95 < 0.2

            deep = decode_cursor(f"0.0~{newest_first[-101]}")  # a cursor near the end
            assert deep is not None
            start = time.perf_counter()
            rows, cursor = await page(store, key, Filter(), (float("inf"), deep[1]), 50, None)
            deep_ms = (time.perf_counter() - start) * 1000
            print(f"a page of 50 at position {N - 100} of {N}: {deep_ms:.1f} ms")
            assert [row.task_id for row in rows] == newest_first[-100:-50]

            async def every(flt: Filter) -> list[str]:
                """Follow the cursors: a filtered page reads at most SCAN_CAP ids."""
                out: list[str] = []
                after = None
                while True:
                    rows, cursor = await page(store, key, flt, after, 50, None)
                    assert flt.state == "" or {row.state for row in rows} <= {flt.state}
                    out += [row.task_id for row in rows]
                    if not cursor:
                        return out
                    after = decode_cursor(cursor)

            assert len(await every(Filter(state="running"))) == 4  # in the oldest batch
            assert len(await every(Filter(state="dispatched"))) == 6
            g_on_b, cursor = await page(
                store, key, Filter(endpoint="ep-b", function="g"), None, 50, None
            )
            assert len(g_on_b) == 50 and cursor
            assert {(row.endpoint_id, row.function_id) for row in g_on_b} == {("ep-b", "g")}

            # the cursor's own task leaves the index (expired): the next page is the same
            _, cursor = await page(store, key, Filter(), None, 50, None)
            nxt = decode_cursor(cursor)
            assert nxt is not None
            await store.redis.zrem(key, nxt[1])
            second, _ = await page(store, key, Filter(), nxt, 50, None)
            assert [row.task_id for row in second] == newest_first[50:100]

            live = await live_window(store, key, Filter(state="waiting-for-endpoint"))
            assert live and all(row.state == "waiting-for-endpoint" for row in live)
        finally:
            await _drop(store)

    asyncio.run(scenario())


def test_a_page_reads_only_its_rows_wherever_it_is_in_the_index(store: TaskStore, key: str) -> None:
    """The EXPLAIN of a Redis read: the commands one page ran, from INFO commandstats
    (a script's commands count too). A page of 50 near the end of 20,000 tasks reads
    50 hashes and one range, never the history before it."""

    async def calls() -> dict[str, int]:
        stats = await store.redis.info("commandstats")
        return {name: int(stat["calls"]) for name, stat in stats.items()}

    async def scenario() -> None:
        try:
            newest_first = await _fill(store)
            for after in (None, (float("inf"), newest_first[-101])):
                before = await calls()
                rows, _ = await page(store, key, Filter(), after, 50, None)
                ran = {k: v - before.get(k, 0) for k, v in (await calls()).items()}
                ran = {k: v for k, v in ran.items() if v and k != "cmdstat_info"}
                assert len(rows) == 50
                assert ran.get("cmdstat_hmget") == 50, ran
                assert ran.get("cmdstat_zrevrange") == 1, ran
                assert sum(ran.values()) <= 55, ran  # + EVALSHA, ZREVRANK: no scan
        finally:
            await _drop(store)

    asyncio.run(scenario())


OK = msgpack.packb([0, b"result", []])


async def _finish(store: TaskStore, owner: str, group: str, n: int) -> list[str]:
    """``n`` tasks of ``owner`` in batch ``group`` submitted, taken and finished by the real
    scripts, each with a record naming its worker; in the order submitted."""
    ids = [str(uuid.uuid4()) for _ in range(n)]
    await store.submit(owner, "ep", group, [(i, "fn", b"x", None, "") for i in ids],
                       max_tasks=10**9, max_bytes=10**12)  # fmt: skip
    taken, _ = await store.take("ep", "conn", n)
    assert len(taken) == n
    now = time.time()
    rows = []
    for i in ids:
        record = TaskRecord(i, TaskState.SUCCESS, "fn", "ep/w1", "node1")
        record.submitted, record.started, record.ended = now, now + 0.1, now + 0.2
        rows.append((i, "success", OK, msgpack.packb(record.to_wire()), ""))
    await store.finish("ep", rows)
    await asyncio.sleep(0.002)  # the next batch gets a later score
    return ids


def test_a_batch_older_than_redis_keeps_is_read_from_the_sql_history(
    store_url: str, tmp_path: Path
) -> None:
    """A batch whose tasks the flusher moved to SQL and dropped from Redis (its index past
    ``recent``) still shows whole: its ids (also once Redis's list of it is gone), each
    task's state, worker and times for the timeline, and its counts on the batches page."""
    keys = Keys(Keys.program_id_new())
    engine = create_engine(f"sqlite:///{tmp_path / 'registry.db'}")

    async def scenario() -> None:
        store = TaskStore(connect_async(store_url), keys, result_ttl=600)
        store.history = History(engine)
        flusher = Flusher(store, store.history)
        flusher.recent = 40
        try:
            assert await flusher.start()
            old = await _finish(store, "alice", "old-batch", 30)
            big = await _finish(store, "alice", "big-batch", 60)  # 40 of it leave Redis
            for i in range(2):
                await _finish(store, "alice", f"newer-{i}", 10)
            while await flusher.step(0.1):
                pass
            for task_id in old:
                assert not await store.redis.exists(keys.task(task_id))
            assert sum([await store.redis.exists(keys.task(i)) for i in big]) == 20
            assert await listing.group_ids(store, "old-batch", 1000) == old  # Redis's list
            # the timeline's reads: every task of the old batch, from SQL
            got = await _timeline._read(store, old)
            assert [row[0] for row in got] == [b"success"] * 30
            assert {row[5] for row in got} == {b"ep/w1"} and {row[8] for row in got} == {b"alice"}
            assert all(row[7] > row[6] > row[2] > 0 for row in got)  # ended, started, submitted
            # Redis lost the batch's list too (an older layout, a queue Redis started empty)
            await store.redis.delete(keys.group("old-batch"))
            assert sorted(await listing.group_ids(store, "old-batch", 1000)) == sorted(old)
            assert await listing.group_size(store, "old-batch") == 30
            assert await listing.group_ids(store, "no-such-batch", 1000) == []
            # the batches page: the big batch, partly out of Redis, counted whole
            batches = await _batches.recent(store, index(store, "alice", False))
            by_group = {batch.group_id: batch for batch in batches}
            assert by_group["big-batch"].total == 60
            assert by_group["big-batch"].counts == {"success": 60}, by_group["big-batch"]
            assert by_group["big-batch"].done == 60
        finally:
            await _drop(store)

    asyncio.run(scenario())
    engine.dispose()


def test_a_cursor_is_decoded_or_refused_naming_it() -> None:
    """review6 #12: ``nan`` reached the page script (ZCOUNT refused it): a 500."""
    from nimbus.errors import ServiceError

    assert decode_cursor("") is None  # the first page
    assert decode_cursor("1700000000.25~t-1") == (1700000000.25, "t-1")
    for bad in ("nan~t", "inf~t", "-inf~t", "NaN~t", "x~t", "1.0~", "1.0", "~t"):
        with pytest.raises(ServiceError, match="cursor") as raised:
            decode_cursor(bad)
        assert raised.value.status == 422 and repr(bad) in str(raised.value)
