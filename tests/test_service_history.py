"""The finished-task history in SQL (SQLite, and a real PostgreSQL), filled by the flusher
from a real Redis with the real queue scripts: keyset pages, owners, filters; two
flushers never double-write; an entry a flusher took and did not acknowledge is
written by another; Redis keeps a bounded window and the pages still show every task."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from sqlalchemy import create_engine, event

from nimbus.service.flusher import GROUP, Flusher
from nimbus.service.history import History, Query
from nimbus.service.listing import Filter, index, page
from nimbus.service.queues import TaskStore
from nimbus.statestore import Keys, connect_async
from test_service_postgres import postgres  # noqa: F401  (the fixture)

OK = msgpack.packb([0, b"result", []])


def _row(i: int, owner: str, *, score: float, state: str = "success", ep: str = "e1") -> tuple:
    return (f"t{i:05d}", owner, ep, "f", "g1", state, score, score + 1, score + 2, None, OK, b"")


@pytest.fixture(params=["sqlite", "postgresql"])
def history(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[History]:
    if request.param == "sqlite":
        engine = create_engine(f"sqlite:///{tmp_path / 'registry.db'}")
        event.listen(engine, "connect", lambda c, _: c.execute("PRAGMA journal_mode=WAL"))
    else:
        pg = request.getfixturevalue("postgres")
        engine = create_engine(pg.url.replace("postgresql://", "postgresql+psycopg://"))
        with engine.begin() as connection:
            connection.exec_driver_sql("DROP TABLE IF EXISTS task_history")
    yield History(engine)
    engine.dispose()


@pytest.fixture
def sqlite_history(tmp_path: Path) -> Iterator[History]:
    """A history in SQLite, as a service's default registry keeps it."""
    engine = create_engine(f"sqlite:///{tmp_path / 'registry.db'}")
    yield History(engine)
    engine.dispose()


@contextlib.asynccontextmanager
async def _task_store(store_url: str, history: History) -> AsyncIterator[TaskStore]:
    """The real queues on the store at ``store_url`` under a new program's keys, saving to
    ``history``; every key of theirs is removed after."""
    store = TaskStore(connect_async(store_url), Keys(Keys.program_id_new()), result_ttl=600)
    store.history = history
    try:
        yield store
    finally:
        rest = [k async for k in store.redis.scan_iter(match=store.keys.pattern())]
        if rest:
            await store.redis.unlink(*rest)
        await store.redis.aclose()


def test_keyset_pages_owners_filters_and_a_row_written_twice_kept_once(history: History) -> None:
    rows = [_row(i, "alice" if i % 2 else "bob", score=float(i // 10)) for i in range(300)]
    rows[7] = _row(7, "alice", score=0.0, state="failed", ep="e2")
    assert history.write(rows) == 300
    history.write([_row(7, "alice", score=0.0, state="success")])  # a flusher's retry
    assert history.count() == 300
    assert history.info(["t00007"])["t00007"]["state"] == "failed"  # the first row won

    def every(query: Query) -> list[str]:
        seen, after = [], None
        while True:
            got, cursor = history.page(query, after, 7)  # pages end inside ties of 10
            seen += [row[0] for row in got]
            if not cursor:
                return seen
            score, _, task_id = cursor.partition("~")
            after = (float(score), task_id)

    everyone = every(Query(None))
    assert everyone == sorted(everyone, key=lambda t: (int(t[1:]) // 10, t), reverse=True)
    assert len(everyone) == 300
    alice = every(Query("alice"))
    assert len(alice) == 150 and all(int(t[1:]) % 2 for t in alice)
    assert every(Query("alice", state="failed")) == ["t00007"]
    assert every(Query(None, endpoint="e2")) == ["t00007"]
    assert every(Query("bob", state="failed")) == []
    assert len(every(Query("bob", function="f"))) == 150
    assert len(every(Query(None, group="g1"))) == 300


async def _finished(store: TaskStore, owner: str, endpoint: str, n: int) -> list[str]:
    """``n`` tasks of ``owner`` submitted, taken and finished by the real scripts."""
    ids = [str(uuid.uuid4()) for _ in range(n)]
    await store.submit(
        owner, endpoint, str(uuid.uuid4()), [(i, "fn", b"x", None, "") for i in ids],
        max_tasks=10**9, max_bytes=10**12,
    )  # fmt: skip
    taken, _ = await store.take(endpoint, "conn", n)
    assert len(taken) == n
    stored, _ = await store.finish(endpoint, [(i, "success", OK, b"", "") for i in ids])
    assert sorted(stored) == sorted(ids)
    await asyncio.sleep(0.002)  # the next batch gets a later score
    return ids


def test_flushers_move_finished_tasks_once_and_redis_keeps_a_window(
    store_url: str, sqlite_history: History
) -> None:
    async def scenario() -> None:
        async with _task_store(store_url, sqlite_history) as store:
            a, b = Flusher(store, store.history), Flusher(store, store.history)
            for flusher in (a, b):
                flusher.recent, flusher.batch = 50, 3
            assert await a.start() and not await b.start()  # one group for both
            ids: list[str] = []
            for _ in range(20):
                ids += await _finished(store, "alice", "ep", 30)
            waiting = [str(uuid.uuid4())]  # a live task stays in Redis, whatever its age
            await store.submit("alice", "ep", "g", [(waiting[0], "fn", b"x", None, "")],
                               max_tasks=10**9, max_bytes=10**12)  # fmt: skip
            # the two processes' flushers drain the stream side by side
            while sum(await asyncio.gather(a.step(0.1), b.step(0.1))):
                pass
            assert a.written + b.written == 600 and a.written and b.written
            assert store.history.count() == 600
            assert await store.redis.xlen(store.finished) == 0  # acknowledged and deleted
            pending = await store.redis.xpending(store.finished, GROUP)
            assert pending["pending"] == 0
            # Redis keeps the live task and at most `recent` saved ones an index
            kept = await store.redis.zcard(store.keys.all_tasks())
            assert kept <= 50 + 30 + 1, kept  # trims go by the oldest TRIM_SCAN, each step
            assert await store.redis.zscore(store.keys.all_tasks(), waiting[0]) is not None
            assert await store.redis.exists(store.keys.task(ids[0])) == 0  # out of Redis
            # ... and what left Redis is read from SQL: status, result, the pages
            [info] = await store.info([ids[0]])
            assert info is not None and info["state"] == "success" and info["owner"] == "alice"
            [result] = await store.results([ids[0]])
            assert result is not None and result[1] == OK
            newest_first = [waiting[0], *reversed(ids)]  # batches newest first, ids in a
            seen: list[str] = []  # batch (one score) by id, descending
            after = None
            while True:
                rows, cursor = await page(
                    store, index(store, "alice", False), Filter(), after, 45, "alice"
                )
                seen += [row.task_id for row in rows]
                if not cursor:
                    break
                score, _, task_id = cursor.partition("~")
                after = (float(score), task_id)
            assert len(seen) == len(set(seen)) == 601
            assert set(seen) == set(newest_first)
            order = {task_id: i for i, task_id in enumerate(seen)}
            for older, newer in zip(ids[::30][:-1], ids[::30][1:]):  # batches in order
                assert order[newer] < order[older]
            rows, _ = await page(store, index(store, "bob", False), Filter(), None, 45, "bob")
            assert rows == []  # bob sees none of alice's

    asyncio.run(scenario())


def test_a_task_leaves_redis_once_its_entry_and_every_older_one_are_written(
    store_url: str, sqlite_history: History
) -> None:
    """A task ended names its stream entry, not a mark written once saved: it leaves its
    indexes and Redis only when the stream holds no entry as old (one a dead process took
    keeps every later task); an older nimbus's entry (no name) has its tasks marked."""

    async def scenario() -> None:
        async with _task_store(store_url, sqlite_history) as store:
            flusher = Flusher(store, store.history)
            flusher.recent, flusher.batch, flusher.claim_idle = 0, 1, 3600.0
            await flusher.start()
            first = await _finished(store, "dave", "ep", 10)
            second = await _finished(store, "dave", "ep", 10)
            # another process took the first entry and died with it
            await store.redis.xreadgroup(GROUP, "gone", {store.finished: ">"}, count=1)
            assert await flusher.step(0) == 10  # the second entry: written
            assert store.history.count() == 10
            index_ = store.keys.user_tasks("dave")
            assert await store.redis.zcard(index_) == 20  # an older entry waits: all kept
            assert await store.redis.exists(*(store.keys.task(i) for i in first + second)) == 20
            flusher.claim_idle, flusher._next_claim = 0.0, 0.0
            assert await flusher.step(0) == 10  # the first, claimed: now every one is saved
            assert await store.redis.zcard(index_) == 0
            assert await store.redis.exists(*(store.keys.task(i) for i in first + second)) == 0
            # an entry as an older nimbus appended it: rows, and tasks naming no entry
            third = await _finished(store, "dave", "ep", 5)
            [(entry, fields)] = await store.redis.xrange(store.finished)
            await store.redis.xdel(store.finished, entry)
            await store.redis.xadd(store.finished, {k: fields[k] for k in (b"ids", b"rows")})
            for task_id in third:
                await store.redis.hdel(store.keys.task(task_id), "entry")
            assert await flusher.step(0) == 5
            assert await store.redis.zcard(index_) == 0  # marked saved, then trimmed
            assert store.history.count() == 25

    asyncio.run(scenario())


def test_an_entry_a_dead_flusher_took_is_written_by_another(
    store_url: str, sqlite_history: History
) -> None:
    async def scenario() -> None:
        async with _task_store(store_url, sqlite_history) as store:
            live = Flusher(store, store.history)
            live.claim_idle = 0.2
            await live.start()
            ids = await _finished(store, "alice", "ep", 10)
            # a process took the entry, then died before writing it (no acknowledgement)
            got: Any = await store.redis.xreadgroup(
                GROUP, "dead-process", {store.finished: ">"}, count=10
            )
            assert got and got[0][1]
            assert await live.step(0.05) == 0  # not yet: the dead one may still be working
            await asyncio.sleep(0.3)
            live._next_claim = 0.0
            assert await live.step(0.05) == 10
            assert set(store.history.info(ids)) == set(ids)
            assert (await store.redis.xpending(store.finished, GROUP))["pending"] == 0
            live.gone_ms = 0  # the dead process's consumer, nothing pending, is dropped
            await live.prepare()
            consumers = await store.redis.xinfo_consumers(store.finished, GROUP)
            assert b"dead-process" not in {c["name"] for c in consumers}

    asyncio.run(scenario())


def test_history_survives_a_restart_that_lost_the_queue_redis(tmp_path: Path) -> None:
    """Tasks run through a real service and endpoint; the service restarts with a new,
    empty queue Redis (no ``--persist``): its tasks, their results and records are
    still listed and read, from the SQL history."""
    from nimbus.service.registry import Registry
    from service_support import EndpointProcess, Service, service_env

    service = Service(tmp_path, service_env(tmp_path)).start()
    try:
        token = service.token("rita")
        with service.client(token) as client:
            agent = EndpointProcess(service, client, "hist-ep", workers=1).start(client)
            try:
                ids = [client.run(abs, -i, endpoint="hist-ep") for i in range(5)]
                assert [client.get_result(i, timeout=60) for i in ids] == list(range(5))
            finally:
                agent.stop()
        registry = Registry(service.settings().registry_url)
        try:
            history = History(registry.engine)
            deadline = time.monotonic() + 30
            while set(history.info(ids)) != set(ids):  # the flusher moved them
                assert time.monotonic() < deadline
                time.sleep(0.1)
        finally:
            registry.close()
        service.stop()
        service.start()  # a new embedded Redis: nothing of the old queues
        with service.client(token) as client:
            listed = [t["task_id"] for t in client.list_tasks(None, limit=10)]
            assert set(listed) == set(ids)
            task = client.get_task(ids[3])
            assert task["state"] == "success" and task["record"] is not None
            assert task["record"]["function"] == task["function_id"]  # the worker's record
            assert client.get_result(ids[3], timeout=10) == 3
    finally:
        service.stop()


def test_tasks_an_older_nimbus_kept_in_redis_only_are_moved_and_a_lost_group_is_made_again(
    store_url: str, sqlite_history: History
) -> None:
    async def scenario() -> None:
        async with _task_store(store_url, sqlite_history) as store:
            flusher = Flusher(store, store.history)
            ids = await _finished(store, "olaf", "ep", 25)
            await store.redis.delete(store.finished)  # as an older nimbus left Redis
            await flusher.prepare()  # the first start of this version: they are queued
            assert await flusher.step(0.1) == 25
            assert set(store.history.info(ids)) == set(ids)
            await store.redis.delete(store.finished)  # the queue Redis lost the group
            job = asyncio.create_task(flusher.run())
            more = await _finished(store, "olaf", "ep", 5)
            for _ in range(100):
                if set(store.history.info(more)) == set(more):
                    break
                await asyncio.sleep(0.1)
            assert set(store.history.info(more)) == set(more)
            job.cancel()

    asyncio.run(scenario())


def test_the_flusher_deletes_tasks_older_than_the_history_keeps_in_batches(
    history: History, store_url: str
) -> None:
    """``history_days``: rows submitted before it go (several transactions of a few), the
    others stay; None keeps everything."""
    day = 86400.0
    now = time.time()
    old = [_row(i, "alice", score=now - 40 * day + i) for i in range(23)]
    new = [_row(100 + i, "alice", score=now - 29 * day + i) for i in range(5)]
    history.write(old + new)

    async def scenario() -> None:
        async with _task_store(store_url, history) as store:
            forever = Flusher(store, history)
            assert await forever.expire() == 0 and history.count() == 28
            flusher = Flusher(store, history, keep=30 * day)
            flusher.expire_batch = 4  # 23 rows: six transactions
            job = asyncio.create_task(flusher.run())  # expires at once, then every few minutes
            deadline = time.monotonic() + 20
            while history.count() > 5:
                assert time.monotonic() < deadline, history.count()
                await asyncio.sleep(0.05)
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)
            assert sorted(history.info([r[0] for r in old + new])) == [r[0] for r in new]

    asyncio.run(scenario())


def test_a_dependent_of_a_task_only_the_history_holds_is_accepted(
    store_url: str, sqlite_history: History
) -> None:
    """An input the flusher saved and dropped from Redis (its index over ``RECENT``) is
    read from the SQL history by submit: a success is done (the dependent is queued), a
    failure fails the dependent (the stream of held tasks to fail names it), another
    owner's is refused (403) and an id neither holds is not known (404)."""

    async def scenario() -> None:
        async with _task_store(store_url, sqlite_history) as store:
            flusher = Flusher(store, store.history)
            limits = {"max_tasks": 100, "max_bytes": 10**6}
            await flusher.start()
            await store.to_fail_group()
            [ok] = await _finished(store, "alice", "ep", 1)
            bad = str(uuid.uuid4())
            await store.submit("alice", "ep", "g", [(bad, "fn", b"x", None, "")], **limits)
            await store.take("ep", "conn", 1)
            await store.finish("ep", [(bad, "failed", OK, b"", "")])
            [theirs] = await _finished(store, "bob", "ep", 1)
            while await flusher.step(0.1):
                pass
            assert store.history.count() == 3
            await store.redis.delete(*(store.keys.task(i) for i in (ok, bad, theirs)))  # trimmed
            d1, d2 = str(uuid.uuid4()), str(uuid.uuid4())
            rows = [(d1, "fn", b"y", None, ""), (d2, "fn", b"z", None, "")]
            await store.submit("alice", "ep", "g2", rows, after=[[ok], [ok, bad]], **limits)
            assert await store.endpoint_task_ids("ep") == [d1, d2]  # d1 queued, d2 held
            assert await store.queue_length("ep") == 1
            entries = await store.read_to_fail("c", count=10, block=0.1)
            assert [row for _, row in entries] == [(d2, bad, "failed")]
            for after, error in (([theirs], "is not yours"), ([str(uuid.uuid4())], "not known")):
                with pytest.raises(Exception, match=error):
                    row = [(str(uuid.uuid4()), "fn", b"w", None, "")]
                    await store.submit("alice", "ep", "g3", row, after=[after], **limits)

    asyncio.run(scenario())


def test_an_ended_task_is_written_from_its_stream_entry_even_once_its_hash_is_gone(
    store_url: str, sqlite_history: History
) -> None:
    """The finish and cancel scripts put each task's row in their stream entry: the
    flusher writes the fields the hash had (owner, endpoint, function, group, state,
    times, timeout, result, record) even when the hash expired before the write."""

    async def scenario() -> None:
        async with _task_store(store_url, sqlite_history) as store:
            keys = store.keys
            flusher = Flusher(store, store.history)
            await flusher.start()
            ok, bad, waiting = (str(uuid.uuid4()) for _ in range(3))
            rows = [(ok, "fn", b"x", 5.0, ""), (bad, "fn2", b"y", None, ""),
                    (waiting, "fn", b"z", 7.5, "")]  # fmt: skip
            await store.submit("alice", "ep", "g7", rows, max_tasks=100, max_bytes=10**6)
            await store.take("ep", "conn", 2)
            await store.finish("ep", [(ok, "success", OK, b"rec-ok", ""),
                                      (bad, "failed", b"boom", b"rec-bad", "")])  # fmt: skip
            assert await store.cancel(waiting, "ep") is not None
            ids = [ok, bad, waiting]
            before = (await store.info(ids), await store.results(ids))
            await store.redis.delete(*(keys.task(i) for i in ids))  # expired before the write
            assert await flusher.step(0.1) == 3
            after = (await store.info(ids), await store.results(ids))  # read from SQL
            assert after[1] == before[1]  # states, results, records
            assert after[1][1] == ("failed", b"boom", b"rec-bad")
            for was, now in zip(*before[0:1], *after[0:1]):
                assert was is not None and now is not None
                for field in ("state", "owner", "endpoint", "function", "group", "timeout"):
                    assert now[field] == was[field], (field, now, was)
                for field in ("submitted", "dispatched", "ended"):
                    assert float(now[field] or 0) == float(was[field] or 0), (field, now, was)
            assert [i["timeout"] for i in after[0] if i] == [5.0, None, 7.5]
            assert [i["state"] for i in after[0] if i] == ["success", "failed", "cancelled"]
            assert {i["group"] for i in after[0] if i} == {"g7"}

    asyncio.run(scenario())


def test_the_flusher_writes_within_its_delay_while_tasks_keep_ending_and_all_as_it_stops(
    store_url: str, sqlite_history: History
) -> None:
    """Tasks ending without a pause are written after ``delay`` (not only when they
    stop); those still waiting when the service stops are written as it stops."""

    async def scenario() -> None:
        async with _task_store(store_url, sqlite_history) as store:
            keys = store.keys
            flusher = Flusher(store, store.history)
            flusher.delay, flusher.tick, flusher.recent = 0.5, 0.05, 20
            job = asyncio.create_task(flusher.run())
            try:
                first = await _finished(store, "alice", "ep", 2)
                start, written_at = time.monotonic(), None
                while time.monotonic() - start < 4.0:  # a task ends every few milliseconds
                    await _finished(store, "alice", "ep", 1)
                    if written_at is None and set(store.history.info(first)) == set(first):
                        written_at = time.monotonic() - start
                assert written_at is not None and written_at < 3.0, written_at
                deadline = time.monotonic() + 10  # a pause: Redis keeps `recent` and a tenth more
                while await store.redis.zcard(keys.all_tasks()) > 20 + 2:
                    assert time.monotonic() < deadline, await store.redis.zcard(keys.all_tasks())
                    await asyncio.sleep(0.05)
                job.cancel()
                await asyncio.gather(job, return_exceptions=True)
                # a flusher that looks only every 30 s: the service stops before it looked
                flusher.tick, flusher.delay = 30.0, 60.0
                job = asyncio.create_task(flusher.run())
                await asyncio.sleep(0.3)  # its first look: nothing waits
                last = await _finished(store, "alice", "ep", 3)
                job.cancel()
                await asyncio.gather(job, return_exceptions=True)
                assert set(store.history.info(last)) == set(last)
                assert await store.redis.xlen(store.finished) == 0
            finally:
                job.cancel()
                await asyncio.gather(job, return_exceptions=True)

    asyncio.run(scenario())


def test_each_page_query_walks_an_index_and_the_earlier_indexes_are_dropped(
    tmp_path: Path,
) -> None:
    """SQLite's plan of every page the dashboard and ``GET /v1/tasks`` ask for (an
    owner's or everyone's, by state, endpoint or function, from a cursor) walks an
    index, none sorts; a table made by an earlier version loses the indexes no page
    needs when opened (every write paid for each)."""
    engine = create_engine(f"sqlite:///{tmp_path / 'registry.db'}")
    with engine.begin() as connection:  # as an earlier version left it
        connection.exec_driver_sql(
            "CREATE TABLE task_history (task_id VARCHAR(64) PRIMARY KEY, owner_id TEXT, "
            "endpoint_id TEXT, function_id TEXT, group_id TEXT, state TEXT, submitted FLOAT, "
            "dispatched FLOAT, ended FLOAT, timeout FLOAT, result BLOB, record BLOB)"
        )
        for name, columns in (("ix_history_owner", "owner_id"), ("ix_history_all", ""),
                              ("ix_history_endpoint", "endpoint_id"),
                              ("ix_history_function", "function_id"),
                              ("ix_history_group", "group_id"), ("ix_history_state", "state"),
                              ("ix_history_owner_state", "owner_id, state")):  # fmt: skip
            columns = f"{columns}, " if columns else ""
            connection.exec_driver_sql(
                f"CREATE INDEX {name} ON task_history ({columns}submitted, task_id)"
            )
    history = History(engine)
    history.write([_row(i, f"u{i % 7}", score=float(i), state=("success", "failed",
                   "cancelled")[i % 3], ep=f"e{i % 5}") for i in range(500)])  # fmt: skip
    with engine.connect() as connection:
        names = {r[0] for r in connection.exec_driver_sql("SELECT name FROM sqlite_master")}
    assert not names & {"ix_history_state", "ix_history_owner_state"}
    assert "ix_history_group" in names  # a batch older than Redis keeps (service.listing)
    asked: list[tuple[str, Any]] = []
    event.listen(engine, "before_cursor_execute", lambda *a: asked.append((a[2], a[3])))
    for owner in (None, "u3"):
        for flt in ({}, {"state": "failed"}, {"state": "success"}, {"state": "cancelled"},
                    {"endpoint": "e2"}, {"function": "f"}):  # fmt: skip
            for after in (None, (250.0, "t00250")):
                asked.clear()
                rows, _ = history.page(Query(owner, **flt), after, 10)
                assert rows and all(after is None or row[1] < after[0] for row in rows)
                [(sql, params)] = asked
                with engine.connect() as connection:
                    plan = [r[3] for r in connection.exec_driver_sql(
                        "EXPLAIN QUERY PLAN " + sql, params)]  # fmt: skip
                assert all("USING INDEX" in step or "PRIMARY KEY" in step for step in plan), (
                    owner, flt, plan)  # fmt: skip
                assert not any("TEMP B-TREE" in step for step in plan), (owner, flt, plan)
                column = {"state": "state", "endpoint": "endpoint_id", "function": "function_id"}
                leads = {column[k] for k, v in flt.items() if v != "success"}
                leads |= {"owner_id"} if owner else set()
                if leads:  # an index that leads with one of the filters, not a walk of all
                    assert any(f"{c}=?" in " ".join(plan) for c in leads), (owner, flt, plan)
    engine.dispose()
