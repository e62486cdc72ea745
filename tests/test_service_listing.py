"""The dashboard's task reads on a real Redis with real queue scripts: keyset pages in
order across ties, filters, an expired cursor, and the time a page takes deep in a
large index."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

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
            keys = [key async for key in store.redis.scan_iter(match=store.keys.pattern())]
            for i in range(0, len(keys), 1000):
                await store.redis.unlink(*keys[i : i + 1000])
            await store.redis.aclose()

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
            keys = [key async for key in store.redis.scan_iter(match=store.keys.pattern())]
            for i in range(0, len(keys), 1000):
                await store.redis.unlink(*keys[i : i + 1000])
            await store.redis.aclose()

    asyncio.run(scenario())
