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
import redis

from nimbus import Executor
from nimbus.service.held import WOKEN
from nimbus.service.queues import TaskStore
from nimbus.service.wakeups import ENDED, RETRY
from nimbus.statestore import Keys, StateStore, connect_async
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
    tmp_path: Path,
) -> None:
    """The scripts that end tasks (finish, cancel, fail a held task) publish their ids on
    ``<prefix>ended`` when two processes subscribe to it, and nothing for a lone one
    (which wakes its own waiters). On a Redis of its own: the module's shared store
    (``store_url``) is found closed after an Executor ran in this process."""
    redis_server = StateStore.open(None, tmp_path / "redis")
    store = TaskStore(connect_async(redis_server.url), Keys(Keys.program_id_new()), result_ttl=60)
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

    try:
        asyncio.run(scenario())
    finally:
        redis_server.close()


def dispatch_delay(client: Any, task_id: str) -> float:
    """Seconds from the task's submit to its dispatch to an agent."""
    record = client.get_task(task_id)
    return float(record["dispatched"]) - float(record["submitted"])


@pytest.mark.timeout(300)
def test_a_task_submitted_on_one_process_starts_at_once_on_an_agent_of_the_other(
    tmp_path: Path,
) -> None:
    """The agent is connected to the second process, idle; a task submitted through the
    first is dispatched within a second (the submit script publishes its endpoint on
    ``TaskStore.woken``), not at the dispatcher's idle poll (5 s)."""
    agent = None
    with two_services(tmp_path) as (first, second, _redis):
        try:
            token = first.token("xena")
            with first.client(token) as here, second.client(token) as there:
                agent = EndpointProcess(second, there, "far").start(there)
                delays = []
                for _ in range(3):  # each after the last ended: the dispatcher just idle
                    task_id = here.run(nap, 0.05, endpoint="far")
                    assert here.get_result(task_id, timeout=20) == 0.05
                    delays.append(dispatch_delay(here, task_id))
                assert max(delays) < 1.0, delays
        finally:
            if agent is not None:
                agent.stop()


@pytest.mark.timeout(300)
def test_what_was_queued_while_the_subscriptions_were_lost_starts_when_they_are_back(
    tmp_path: Path,
) -> None:
    """The queue Redis drops both processes' subscriptions and refuses SUBSCRIBE for a
    while (as when it goes away); a task submitted through the first meanwhile is
    published to no one, and the second's dispatcher takes it when the second has
    subscribed again (``wakeups.RETRY``), not at its idle poll's end (5 s)."""
    agent = None
    with two_services(tmp_path) as (first, second, store):
        try:
            token = first.token("yara")
            with (
                first.client(token) as here,
                second.client(token) as there,
                redis.Redis.from_url(store.url) as queue_redis,
            ):
                agent = EndpointProcess(second, there, "far").start(there)
                assert here.get_result(here.run(nap, 0.05, endpoint="far"), timeout=20) == 0.05
                (woken,) = queue_redis.pubsub_channels(f"*{WOKEN}")

                def listening() -> int:
                    return int(dict(queue_redis.pubsub_numsub(woken))[woken])

                assert listening() == 2
                queue_redis.execute_command("ACL", "SETUSER", "default", "-subscribe")
                try:
                    queue_redis.client_kill_filter(_type="pubsub")
                    assert listening() == 0
                    task_id = here.run(nap, 0.05, endpoint="far")  # published to no one
                finally:
                    queue_redis.execute_command("ACL", "SETUSER", "default", "+subscribe")
                assert here.get_result(task_id, timeout=20) == 0.05
                delay = dispatch_delay(here, task_id)
                assert delay < RETRY + 1.0, delay
        finally:
            if agent is not None:
                agent.stop()


def test_a_submit_publishes_its_endpoint_only_while_more_than_one_process_listens(
    tmp_path: Path,
) -> None:
    """The submit script publishes its endpoint on ``TaskStore.woken`` when tasks joined
    its queue and two processes subscribe; nothing for a lone one (which wakes its own
    dispatchers), nothing for tasks that are all held."""
    redis_server = StateStore.open(None, tmp_path / "redis")
    store = TaskStore(connect_async(redis_server.url), Keys(Keys.program_id_new()), result_ttl=60)
    limits = {"max_tasks": 100, "max_bytes": 10**6}

    async def heard(pubsub: Any) -> list[bytes]:
        await store.redis.publish(store.woken, b"mark")
        got: list[bytes] = []
        while True:
            message = await asyncio.wait_for(pubsub.get_message(timeout=1), 10)
            if message is not None and message["data"] == b"mark":
                return got
            if message is not None:
                got.append(message["data"])

    async def scenario() -> None:
        one = store.redis.pubsub(ignore_subscribe_messages=True)
        two = store.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await one.subscribe(store.woken)
            a = str(uuid.uuid4())
            await store.submit("o", "ep", "g", [(a, "f", b"x", None, "")], **limits)
            assert await heard(one) == []  # a lone process: nothing published
            await two.subscribe(store.woken)
            await store.submit(
                "o", "ep2", "g2", [(str(uuid.uuid4()), "f", b"y", None, "")], **limits
            )
            held = str(uuid.uuid4())
            await store.submit(
                "o", "ep3", "g3", [(held, "f", b"z", None, "")], after=[[a]], **limits
            )
            assert await heard(one) == [b"ep2"]  # the held task's endpoint: not yet
            assert await heard(two) == [b"ep2"]
        finally:
            await one.aclose()
            await two.aclose()
            async for key in store.redis.scan_iter(match=store.keys.pattern()):
                await store.redis.delete(key)
            await store.redis.aclose()

    try:
        asyncio.run(scenario())
    finally:
        redis_server.close()
