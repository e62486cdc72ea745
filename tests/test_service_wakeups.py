"""Two service processes on one Redis: a task that ends on one wakes those who wait
for it on the other (``nimbus.service.wakeups``): a result long-poll, a client's
WebSocket."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from nimbus import Executor
from nimbus.service.queues import TaskStore
from nimbus.service.wakeups import ENDED
from nimbus.statestore import Keys, connect_async
from service_support import EndpointProcess, two_services


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@pytest.mark.timeout(300)  # two services and an agent start: slow on a loaded machine
def test_a_result_long_poll_on_one_process_returns_when_the_task_ends_on_the_other(
    tmp_path: Path,
) -> None:
    """The agent is connected to the second process; the client long-polls the first
    (GET .../result?wait=): it returns within a second of the task's end, not at the
    end of its poll."""
    agent = None
    with two_services(tmp_path) as (first, second, _redis):
        try:
            token = first.token("wanda")
            with first.client(token) as here, second.client(token) as there:
                agent = EndpointProcess(second, there, "far").start(there)
                late = []
                for seconds in (0.5, 1.0, 0.2):
                    task_id = there.run(nap, seconds, endpoint="far")
                    assert here.get_result(task_id, timeout=20) == seconds  # one poll of 20 s
                    returned = time.time()
                    late.append(returned - float(here.get_task(task_id)["ended"]))
                assert max(late) < 1.0, late
        finally:
            if agent is not None:
                agent.stop()


@pytest.mark.timeout(300)
def test_an_executor_on_one_process_gets_results_of_tasks_ended_on_the_other(
    tmp_path: Path,
) -> None:
    """An executor's WebSocket to the first process, the endpoint's agent on the second:
    the futures end when their tasks do (the second delivers to no one of its own)."""
    agent = None
    with two_services(tmp_path) as (first, second, _redis):
        try:
            token = first.token("wilma")
            with second.client(token) as there:
                agent = EndpointProcess(second, there, "far").start(there)
            executor = Executor(endpoint="far", settings=first.user_settings(token))
            ended = False
            try:
                start = time.monotonic()
                futures = [executor.submit(nap, 0.1 * i) for i in range(6)]
                assert [f.result(timeout=30) for f in futures] == [0.1 * i for i in range(6)]
                assert time.monotonic() - start < 10  # the dispatcher's idle poll is 5 s
                ended = True
            finally:  # a future sent that never ends would hold a `with`'s exit for ever
                executor.shutdown(wait=ended)
        finally:
            if agent is not None:
                agent.stop()


def test_ended_tasks_are_published_only_while_more_than_one_process_listens(
    store_url: str,
) -> None:
    """The scripts that end tasks (finish, cancel, fail a held task) publish their ids on
    ``<prefix>ended`` when two processes subscribe to it, and nothing for a lone one
    (which wakes its own waiters)."""
    store = TaskStore(connect_async(store_url), Keys(Keys.program_id_new()), result_ttl=60)
    channel = store.keys.task("") + ENDED
    limits = {"max_tasks": 100, "max_bytes": 10**6}

    async def heard(pubsub: Any) -> list[bytes]:
        """What the scripts published on the channel: all before a mark published now."""
        await store.redis.publish(channel, b"mark")
        got: list[bytes] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            message = await pubsub.get_message(timeout=1)  # (None: a subscription confirmed)
            if message is not None and message["data"] == b"mark":
                return got
            if message is not None:
                got.append(message["data"])
        raise AssertionError(f"no mark on the channel after {got}")

    async def end_three() -> list[str]:
        a, b, c = (str(uuid.uuid4()) for _ in range(3))
        await store.submit("o", "ep", "g", [(a, "f", b"x", None, "")], **limits)
        await store.submit("o", "ep", "g2", [(b, "f", b"y", None, "")], after=[[a]], **limits)
        await store.submit("o", "ep", "g3", [(c, "f", b"z", None, "")], **limits)
        await store.take("ep", "conn", 10)
        assert await store.fail_held([(b, b"failed")]) == ([b], [])
        assert await store.cancel(c, "ep") is not None
        assert await store.finish("ep", [(a, "success", b"r", b"", "")]) == ([a], [])
        return [b, c, a]

    async def scenario() -> None:
        one = store.redis.pubsub(ignore_subscribe_messages=True)
        two = store.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await one.subscribe(channel)
            await end_three()
            assert await heard(one) == []  # a lone process: nothing published
            await two.subscribe(channel)
            ended = await end_three()
            want = [i.encode() for i in ended]
            assert await heard(one) == want
            assert await heard(two) == want  # (up to the mark published for one)
        finally:
            await one.aclose()
            await two.aclose()
            async for key in store.redis.scan_iter(match=store.keys.pattern()):
                await store.redis.delete(key)
            await store.redis.aclose()

    asyncio.run(scenario())
