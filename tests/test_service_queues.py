"""The task store's scripts on a real Redis: a batch larger than their chunk of 1,000
is queued, indexed and taken whole and in order (each task with its environment), and finishing it gives its owner's
quota back (once per task, a second result ignored) and leaves nothing in flight."""

from __future__ import annotations

import asyncio
import uuid

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
