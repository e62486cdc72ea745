"""The task store's scripts on a real Redis: a batch larger than their chunk of 1,000
is queued, indexed and taken whole and in order (each task with its environment), and finishing it gives its owner's
quota back (once per task, a second result ignored) and leaves nothing in flight."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import msgpack

from nimbus.records import TaskRecord, TaskState
from nimbus.service.counters import measures, metrics_key
from nimbus.service.queues import TaskStore
from nimbus.statestore import Keys, connect_async


def test_a_large_batch_is_queued_and_indexed_whole_and_in_order(store_url: str) -> None:
    store = TaskStore(connect_async(store_url), Keys(Keys.program_id_new()), result_ttl=60)

    async def scenario() -> None:
        try:
            env = {"name": "geo", "requirements": ["six"], "sandbox": True}
            rows = [
                (str(uuid.uuid4()), "f", b"x", None, "", env if i % 2 else None)
                for i in range(2_345)
            ]
            ids = [row[0] for row in rows]
            await store.submit("o", "ep", "g", rows, max_tasks=10**6, max_bytes=10**9)
            keys, redis = store.keys, store.redis
            assert await redis.zcard(keys.user_tasks("o")) == len(ids)
            assert await redis.zcard(keys.all_tasks()) == len(ids)
            assert [i.decode() for i in await redis.lrange(keys.group("g"), 0, -1)] == ids
            assert await redis.ttl(keys.group("g")) > 0
            taken: list[str] = []
            envs: list[object] = []
            while len(taken) < len(ids):
                batch, broken = await store.take("ep", "conn", 700)
                assert batch and not broken
                taken += [row[0] for row in batch]
                envs += [row[6] for row in batch]
            assert taken == ids  # queued in the order submitted
            assert envs == [row[5] for row in rows]  # each with its environment, or None
            queued = keys.user_queued("o")
            assert await redis.hmget(queued, ["tasks", "bytes"]) == [b"2345", b"2345"]
            done = [(i, "success", b"r", b"", "") for i in ids]
            stored, _ = await store.finish("ep", done[:1500] + done)  # a second result: ignored
            assert stored == ids
            assert await redis.hmget(queued, ["tasks", "bytes"]) == [b"0", b"0"]  # given back
            assert await redis.hlen(keys.endpoint_inflight("ep")) == 0
        finally:
            async for key in store.redis.scan_iter(match=store.keys.pattern()):
                await store.redis.delete(key)
            await store.redis.aclose()

    asyncio.run(scenario())


def test_the_counters_are_the_same_whether_the_service_picks_the_measures_or_not(
    store_url: str,
) -> None:
    """The finish script counts a record's run and net bytes from ``counters.measures``
    (what the service passes) exactly as from the packed record (rows without them)."""
    store = TaskStore(connect_async(store_url), Keys(Keys.program_id_new()), result_ttl=60)
    records = []
    for i in range(40):
        record = TaskRecord(str(uuid.uuid4()), TaskState.SUCCESS, function="f")
        record.started, record.ended = 1000.0 + i, 1000.0 + i + 0.01 * i  # spread over buckets
        record.net_bytes_in, record.net_bytes_out = 10 * i, 7 * i
        records.append(record.to_wire())
    records[3][[f.name for f in dataclasses.fields(TaskRecord)].index("started")] = 0.0  # never ran

    async def counted(endpoint: str, with_measures: bool) -> dict[bytes, bytes]:
        rows = [(str(uuid.uuid4()), "f", b"x", None, "") for _ in records]
        await store.submit("o", endpoint, "g" + endpoint, rows, max_tasks=10**6, max_bytes=10**9)
        taken, _ = await store.take(endpoint, "conn", len(rows))
        assert len(taken) == len(rows)
        done = [
            (row[0], "success", msgpack.packb([0, b"", []]), msgpack.packb(record), "")
            + ((measures(record),) if with_measures else ())
            for row, record in zip(rows, records)
        ]
        stored, _ = await store.finish(endpoint, done)
        assert len(stored) == len(rows)
        counts: dict[bytes, bytes] = await store.redis.hgetall(metrics_key(store.keys, endpoint))
        return counts

    async def scenario() -> None:
        try:
            picked = await counted("a", with_measures=True)
            read = await counted("b", with_measures=False)
            assert picked[b"run:count"] == read[b"run:count"] == b"39"  # one never ran
            assert picked[b"net_in"] == read[b"net_in"] == str(10 * sum(range(40))).encode()
            assert picked[b"done:success"] == b"40"
            for field in picked.keys() | read.keys():  # wait: the clock of each submit
                if not field.startswith(b"wait:"):
                    assert picked[field] == read[field], field
        finally:
            async for key in store.redis.scan_iter(match=store.keys.pattern()):
                await store.redis.delete(key)
            await store.redis.aclose()

    asyncio.run(scenario())


def test_an_endpoints_held_tasks_are_among_its_tasks_and_failing_them_frees_them(
    store_url: str,
) -> None:
    """A task held on ep2 for an input on ep1 is one of ep2's tasks (deleting ep2 fails
    it: the service finishes them as failed); failed there, its input's success no longer
    queues it on ep2, and its quota is given back."""
    store = TaskStore(connect_async(store_url), Keys(Keys.program_id_new()), result_ttl=60)

    async def scenario() -> None:
        try:
            a, b = str(uuid.uuid4()), str(uuid.uuid4())
            keys, redis = store.keys, store.redis
            limits = {"max_tasks": 100, "max_bytes": 10**6}
            await store.submit("o", "ep1", "g1", [(a, "f", b"x", None, "")], **limits)
            await store.submit("o", "ep2", "g2", [(b, "f", b"y", None, "")], after=[[a]], **limits)
            assert await store.endpoint_task_ids("ep2") == [b]  # held: in no queue
            gone = [[b, "failed", b"deleted", b"", ""]]
            assert (await store.finish("ep2", gone))[0] == [b]  # as delete_endpoint does
            assert await store.endpoint_task_ids("ep2") == []
            await store.forget_endpoint("ep2")
            await store.take("ep1", "conn", 10)
            await store.finish("ep1", [(a, "success", b"r", b"", "")])
            assert await redis.exists(keys.endpoint_queue("ep2")) == 0  # not queued again
            assert await redis.hmget(keys.user_queued("o"), ["tasks", "bytes"]) == [b"0", b"0"]
            c, d = str(uuid.uuid4()), str(uuid.uuid4())  # released: out of the held set
            await store.submit("o", "ep1", "g3", [(c, "f", b"x", None, "")], **limits)
            await store.submit("o", "ep2", "g4", [(d, "f", b"y", None, "")], after=[[c]], **limits)
            await store.take("ep1", "conn", 10)
            await store.finish("ep1", [(c, "success", b"r", b"", "")])
            assert await redis.smembers(keys.endpoint_held("ep2")) == set()
            assert await store.endpoint_task_ids("ep2") == [d]  # queued now
            e, f = str(uuid.uuid4()), str(uuid.uuid4())  # cancelled: out of the held set
            await store.submit("o", "ep1", "g5", [(e, "f", b"x", None, "")], **limits)
            await store.submit("o", "ep2", "g6", [(f, "f", b"y", None, "")], after=[[e]], **limits)
            assert await store.cancel(f, "ep2") is not None
            assert await redis.smembers(keys.endpoint_held("ep2")) == set()
        finally:
            async for key in store.redis.scan_iter(match=store.keys.pattern()):
                await store.redis.delete(key)
            await store.redis.aclose()

    asyncio.run(scenario())


def test_held_tasks_to_fail_wait_in_a_stream_until_failed_whoever_reads_them(
    store_url: str,
) -> None:
    """The script that fails an input appends its held dependents to the stream
    ``to_fail`` at once: a consumer that took them and died leaves them pending, another
    claims them, and ``fail_held`` fails them and acknowledges them in one script (theirs
    appended in turn); a dependent submitted after its input failed is appended too."""
    store = TaskStore(connect_async(store_url), Keys(Keys.program_id_new()), result_ttl=60)

    async def scenario() -> None:
        try:
            a, b, c = (str(uuid.uuid4()) for _ in range(3))
            redis = store.redis
            limits = {"max_tasks": 100, "max_bytes": 10**6}
            await store.to_fail_group()
            await store.submit("o", "ep", "g1", [(a, "f", b"x", None, "")], **limits)
            rows = [(b, "f", b"y", None, ""), (c, "f", b"z", None, "")]
            await store.submit("o", "ep", "g2", rows, after=[[a], [b]], **limits)
            await store.take("ep", "conn", 10)
            await store.finish("ep", [(a, "failed", b"err", b"", "")])
            taken = await store.read_to_fail("dead", count=10, block=0.1)
            assert [row for _, row in taken] == [(b, a, "failed")]
            # "dead" stops here: nothing acknowledged, b still held
            assert (await store.info([b]))[0]["state"] == "waiting-for-endpoint"  # type: ignore[index]
            assert await store.read_to_fail("next", count=10, block=0.1) == []
            claimed = await store.read_to_fail("next", count=10, claim=0)
            assert [row for _, row in claimed] == [(b, a, "failed")]
            stored, _ = await store.fail_held([(b, b"input failed")], [e for e, _ in claimed])
            assert stored == [b]
            chain = await store.read_to_fail("next", count=10, block=0.1)
            assert [row for _, row in chain] == [(c, b, "failed")]
            await store.fail_held([(c, b"input failed")], [e for e, _ in chain])
            counted = await redis.hget(metrics_key(store.keys, "ep"), "done:failed")
            assert counted == b"3"  # a (finished failed), then b and c (failed held)
            assert (await redis.xpending(store.to_fail, "fail"))["pending"] == 0
            assert await redis.xlen(store.to_fail) == 0
            assert await redis.hmget(store.keys.user_queued("o"), ["tasks", "bytes"]) == [
                b"0",
                b"0",
            ]
            late = str(uuid.uuid4())
            await store.submit(
                "o", "ep", "g3", [(late, "f", b"w", None, "")], after=[[a]], **limits
            )
            again = await store.read_to_fail("next", count=10, block=0.1)
            assert [row for _, row in again] == [(late, a, "failed")]
        finally:
            async for key in store.redis.scan_iter(match=store.keys.pattern()):
                await store.redis.delete(key)
            await store.redis.aclose()

    asyncio.run(scenario())


def test_held_tasks_joining_a_queue_are_published_for_every_service_process(
    store_url: str,
) -> None:
    """The finish that releases held tasks publishes their endpoints on ``woken`` (every
    service process wakes its dispatchers of them, wherever the agents are connected)."""
    store = TaskStore(connect_async(store_url), Keys(Keys.program_id_new()), result_ttl=60)

    async def scenario() -> None:
        pubsub = store.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(store.woken)
            a, b = str(uuid.uuid4()), str(uuid.uuid4())
            limits = {"max_tasks": 100, "max_bytes": 10**6}
            await store.submit("o", "ep1", "g1", [(a, "f", b"x", None, "")], **limits)
            await store.submit("o", "ep2", "g2", [(b, "f", b"y", None, "")], after=[[a]], **limits)
            await store.take("ep1", "conn", 10)
            await store.finish("ep1", [(a, "success", b"r", b"", "")])
            got = []  # (a subscription's confirmation reads as None)
            for _ in range(5):
                message = await pubsub.get_message(timeout=1)
                if message is not None:
                    got.append(message["data"])
                    break
            assert got == [b"ep2"]
        finally:
            await pubsub.aclose()
            async for key in store.redis.scan_iter(match=store.keys.pattern()):
                await store.redis.delete(key)
            await store.redis.aclose()

    asyncio.run(scenario())


def test_a_finish_releases_held_tasks_whatever_nimbus_queued_their_input(store_url: str) -> None:
    """A task whose hash says it has no dependents ('then' 0, set at submit) reads no
    set of dependents as it ends; one held for (an input earlier in the same batch, or
    one queued by an older nimbus: no 'then') is released when it succeeds."""
    store = TaskStore(connect_async(store_url), Keys(Keys.program_id_new()), result_ttl=60)

    async def scenario() -> None:
        try:
            a, b, c, d = (str(uuid.uuid4()) for _ in range(4))
            limits = {"max_tasks": 100, "max_bytes": 10**6}
            await store.submit("o", "ep1", "g1", [(a, "f", b"x", None, "")], **limits)
            await store.submit(
                "o", "ep1", "g2", [(b, "f", b"x", None, ""), (c, "f", b"y", None, "")],
                after=[None, [b]], **limits,
            )  # fmt: skip
            assert await store.redis.hget(store.keys.task(a), "then") == b"0"
            assert await store.redis.hget(store.keys.task(b), "then") == b"1"
            await store.submit("o", "ep1", "g3", [(d, "f", b"z", None, "")], after=[[a]], **limits)
            await store.redis.hdel(store.keys.task(a), "then")  # as an older nimbus queued it
            taken, _ = await store.take("ep1", "conn", 10)
            assert sorted(t[0] for t in taken) == sorted([a, b])  # c and d are held
            await store.finish(
                "ep1", [(a, "success", b"r", b"", ""), (b, "success", b"r", b"", "")]
            )
            taken, _ = await store.take("ep1", "conn", 10)
            assert sorted(t[0] for t in taken) == sorted([c, d])  # both released
        finally:
            async for key in store.redis.scan_iter(match=store.keys.pattern()):
                await store.redis.delete(key)
            await store.redis.aclose()

    asyncio.run(scenario())
