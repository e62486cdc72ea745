"""Two service processes on one Redis: a task that ends on one wakes those who wait
for it on the other (``nimbus.service.wakeups``): a result long-poll, a client's
WebSocket."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from nimbus import Executor
from nimbus.protocol import MESSAGE_BYTES, Results, decode_frame
from nimbus.service import wakeups
from nimbus.service.held import WOKEN
from nimbus.service.hub import Hub, Peer
from nimbus.service.queues import TaskStore
from nimbus.service.wakeups import ENDED, RETRY
from nimbus.statestore import Keys, StateStore, connect_async
from service_support import EndpointProcess, Service, two_services


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@contextlib.contextmanager
def agent_on_the_second(
    tmp_path: Path, user: str
) -> Iterator[tuple[Service, Service, StateStore, str]]:
    """Two service processes on one queue Redis (``two_services``), ``user``'s token,
    and the agent of its endpoint "far" connected to the second: stopped after."""
    with two_services(tmp_path) as (first, second, store):
        token = first.token(user)
        with second.client(token) as there:
            agent = EndpointProcess(second, there, "far")
            try:
                agent.start(there)
                yield first, second, store, token
            finally:
                agent.stop()


def on_a_redis(tmp_path: Path, scenario: Callable[[str], Coroutine[Any, Any, None]]) -> None:
    """``scenario(url)`` run on a Redis of its own (in ``tmp_path``), closed after."""
    redis_server = StateStore.open(None, tmp_path / "redis")
    try:
        asyncio.run(scenario(redis_server.url))
    finally:
        redis_server.close()


@contextlib.asynccontextmanager
async def two_subscribers(url: str) -> AsyncIterator[tuple[Watched, Any, Any]]:
    """A process's task store on the Redis at ``url`` (``Watched``) and two pubsub
    connections to it (as of two processes): closed after, the store's keys deleted."""
    here = Watched(url)
    one = here.store.redis.pubsub(ignore_subscribe_messages=True)
    two = here.store.redis.pubsub(ignore_subscribe_messages=True)
    try:
        yield here, one, two
    finally:
        await one.aclose()
        await two.aclose()
        await here.close()


async def heard_before_a_mark(store: TaskStore, channel: str, pubsub: Any) -> list[bytes]:
    """What was published on ``channel`` to ``pubsub``: all before a mark published now."""
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


@pytest.mark.timeout(300)  # two services and an agent start: slow on a loaded machine
def test_a_result_long_poll_on_one_process_returns_when_the_task_ends_on_the_other(
    tmp_path: Path,
) -> None:
    """The agent is connected to the second process; the client long-polls the first
    (GET .../result?wait=): it returns within a second of the task's end, not at the
    end of its poll."""
    with (
        agent_on_the_second(tmp_path, "wanda") as (first, second, _redis, token),
        first.client(token) as here,
        second.client(token) as there,
    ):
        late = []
        for seconds in (0.5, 1.0, 0.2):
            task_id = there.run(nap, seconds, endpoint="far")
            assert here.get_result(task_id, timeout=20) == seconds  # one poll of 20 s
            returned = time.time()
            late.append(returned - float(here.get_task(task_id)["ended"]))
        assert max(late) < 1.0, late


@pytest.mark.timeout(300)
def test_an_executor_on_one_process_gets_results_of_tasks_ended_on_the_other(
    tmp_path: Path,
) -> None:
    """An executor's WebSocket to the first process, the endpoint's agent on the second:
    the futures end when their tasks do (the second delivers to no one of its own)."""
    with agent_on_the_second(tmp_path, "wilma") as (first, _second, _redis, token):
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


def test_ended_tasks_are_published_only_while_more_than_one_process_listens(
    tmp_path: Path,
) -> None:
    """The scripts that end tasks (finish, cancel, fail a held task) publish their ids on
    ``<prefix>ended`` when two processes subscribe to it, and nothing for a lone one
    (which wakes its own waiters). On a Redis of its own: the module's shared store
    (``store_url``) is found closed after an Executor ran in this process."""
    limits = {"max_tasks": 100, "max_bytes": 10**6}

    async def end_three(store: TaskStore) -> list[str]:
        a, b, c = (str(uuid.uuid4()) for _ in range(3))
        await store.submit("o", "ep", "g", [(a, "f", b"x", None, "")], **limits)
        await store.submit("o", "ep", "g2", [(b, "f", b"y", None, "")], after=[[a]], **limits)
        await store.submit("o", "ep", "g3", [(c, "f", b"z", None, "")], **limits)
        await store.take("ep", "conn", 10)
        assert await store.fail_held([(b, b"failed")]) == ([b], [])
        assert await store.cancel(c, "ep") is not None
        assert await store.finish("ep", [(a, "success", b"r", b"", "")]) == ([a], [])
        return [b, c, a]

    async def scenario(url: str) -> None:
        async with two_subscribers(url) as (here, one, two):
            store, channel = here.store, here.channel
            await one.subscribe(channel)
            await end_three(store)
            assert await heard_before_a_mark(store, channel, one) == []  # a lone process
            await two.subscribe(channel)
            want = [i.encode() for i in await end_three(store)]
            assert await heard_before_a_mark(store, channel, one) == want
            assert await heard_before_a_mark(store, channel, two) == want  # (up to one's mark)

    on_a_redis(tmp_path, scenario)


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
    with (
        agent_on_the_second(tmp_path, "xena") as (first, _second, _redis, token),
        first.client(token) as here,
    ):
        delays = []
        for _ in range(3):  # each after the last ended: the dispatcher just idle
            task_id = here.run(nap, 0.05, endpoint="far")
            assert here.get_result(task_id, timeout=20) == 0.05
            delays.append(dispatch_delay(here, task_id))
        assert max(delays) < 1.0, delays


@pytest.mark.timeout(300)
def test_what_was_queued_while_the_subscriptions_were_lost_starts_when_they_are_back(
    tmp_path: Path,
) -> None:
    """The queue Redis drops both processes' subscriptions and refuses SUBSCRIBE for a
    while (as when it goes away); a task submitted through the first meanwhile is
    published to no one, and the second's dispatcher takes it when the second has
    subscribed again (``wakeups.RETRY``), not at its idle poll's end (5 s)."""
    with (
        agent_on_the_second(tmp_path, "yara") as (first, _second, store, token),
        first.client(token) as here,
        redis.Redis.from_url(store.url) as queue_redis,
    ):
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


def test_a_submit_publishes_its_endpoint_only_while_more_than_one_process_listens(
    tmp_path: Path,
) -> None:
    """The submit script publishes its endpoint on ``TaskStore.woken`` when tasks joined
    its queue and two processes subscribe; nothing for a lone one (which wakes its own
    dispatchers), nothing for tasks that are all held."""
    limits = {"max_tasks": 100, "max_bytes": 10**6}

    async def scenario(url: str) -> None:
        async with two_subscribers(url) as (here, one, two):
            store = here.store
            await one.subscribe(store.woken)
            a = str(uuid.uuid4())
            await store.submit("o", "ep", "g", [(a, "f", b"x", None, "")], **limits)
            assert await heard_before_a_mark(store, store.woken, one) == []  # a lone one
            await two.subscribe(store.woken)
            await store.submit(
                "o", "ep2", "g2", [(str(uuid.uuid4()), "f", b"y", None, "")], **limits
            )
            held = str(uuid.uuid4())
            await store.submit(
                "o", "ep3", "g3", [(held, "f", b"z", None, "")], after=[[a]], **limits
            )
            # the held task's endpoint: not yet
            assert await heard_before_a_mark(store, store.woken, one) == [b"ep2"]
            assert await heard_before_a_mark(store, store.woken, two) == [b"ep2"]

    on_a_redis(tmp_path, scenario)


class Watched:
    """A ``listen`` of a service process (its real hub and task store, on a Redis of
    its own) and the tasks ended for its watchers: what each test needs around it."""

    def __init__(self, url: str) -> None:
        self.store = TaskStore(connect_async(url), Keys(Keys.program_id_new()), result_ttl=60)
        self.hub = Hub()
        self.channel = self.store.keys.task("") + ENDED

    async def end(self, count: int, size: int = 1) -> list[str]:
        """``count`` tasks ended with results of ``size`` bytes each: their ids."""
        ids = [str(uuid.uuid4()) for _ in range(count)]
        rows = [(i, "f", b"x", None, "") for i in ids]
        await self.store.submit("o", "ep", "g", rows, max_tasks=10**4, max_bytes=10**9)
        await self.store.take("ep", "conn", count)
        results = [(i, "success", bytes(size), b"", "") for i in ids]
        assert await self.store.finish("ep", results) == (ids, [])
        return ids

    async def subscribed(self, redis_url: str) -> None:
        """Until this process's subscription is made."""
        with redis.Redis.from_url(redis_url) as plain:
            deadline = time.monotonic() + 10
            while int(dict(plain.pubsub_numsub(self.channel))[self.channel.encode()]) < 1:
                assert time.monotonic() < deadline, "listen did not subscribe"
                await asyncio.sleep(0.05)

    async def close(self) -> None:
        async for key in self.store.redis.scan_iter(match=self.store.keys.pattern()):
            await self.store.redis.delete(key)
        await self.store.redis.aclose()


@contextlib.asynccontextmanager
async def listen_running(here: Watched, redis_url: str) -> AsyncIterator[None]:
    """``wakeups.listen`` of ``here`` running, its subscription made; cancelled after."""
    listener = asyncio.create_task(wakeups.listen(cast(Any, here)))
    try:
        await here.subscribed(redis_url)
        yield
    finally:
        listener.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await listener


def reader() -> tuple[Peer, asyncio.Queue[list[str]]]:
    """A client connection that reads at once: the task ids of each message it got."""
    got: asyncio.Queue[list[str]] = asyncio.Queue()

    async def send(data: bytes) -> None:
        rows = Results.decode(decode_frame(data, {"results"})).results
        await got.put([row.task_id for row in rows])

    return Peer(uuid.uuid4().hex, send), got


async def heard(got: asyncio.Queue[list[str]], want: set[str], within: float) -> int:
    """Messages until all of ``want`` were heard (``within`` seconds)."""
    seen: set[str] = set()
    messages = 0
    async with asyncio.timeout(within):
        while not want <= seen:
            seen.update(await got.get())
            messages += 1
    return messages


def test_a_client_that_never_reads_delays_no_other_clients_results(tmp_path: Path) -> None:
    """Two client connections watch tasks that end in one message on ``ended``; the
    first never reads (its send never returns): the second gets its result at once,
    and so does a later one (the subscription's loop does not wait on the first)."""

    async def never(data: bytes) -> None:
        await asyncio.Event().wait()

    async def scenario(url: str) -> None:
        here = Watched(url)
        try:
            async with listen_running(here, url):
                stuck, (peer, got) = Peer("stuck", never), reader()
                (a, b) = await here.end(2)
                here.hub.watch([a], stuck)
                here.hub.watch([b], peer)
                await here.store.redis.publish(here.channel, f"{a} {b}")
                await heard(got, {b}, within=5)
                (c,) = await here.end(1)
                here.hub.watch([c], peer)
                await here.store.redis.publish(here.channel, c)
                await heard(got, {c}, within=5)
        finally:
            await here.close()

    on_a_redis(tmp_path, scenario)


def test_results_larger_than_a_message_are_sent_in_several(tmp_path: Path) -> None:
    """Watched tasks whose results add up to more than ``MESSAGE_BYTES`` are delivered
    in several messages of about that size, not one (the SDK refuses a message over
    ``RECEIVE_MAX``)."""
    size = MESSAGE_BYTES // 3

    async def scenario(url: str) -> None:
        here = Watched(url)
        try:
            async with listen_running(here, url):
                (peer, got) = reader()
                sizes: list[int] = []
                send = peer._send

                async def sized(data: bytes) -> None:
                    sizes.append(len(data))
                    await send(data)

                peer._send = sized
                ids = await here.end(6, size)
                here.hub.watch(ids, peer)
                await here.store.redis.publish(here.channel, " ".join(ids))
                assert await heard(got, set(ids), within=30) >= 2
                assert max(sizes) < MESSAGE_BYTES + size, sizes
        finally:
            await here.close()

    on_a_redis(tmp_path, scenario)


class Blackhole:
    """A TCP proxy on loopback to a Unix-socket Redis that can stop passing bytes on
    the connections it has, keeping them open (a NAT or load balancer that dropped
    them without a reset); later connections pass."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.silent = False  # later connections pass nothing either (the host is gone)
        self.flowing: list[asyncio.Event] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}"

    def drop_silently(self) -> None:
        for flowing in self.flowing:
            flowing.clear()

    def go_silent(self) -> None:
        """Pass no more bytes, on any connection, now or later."""
        self.silent = True
        self.drop_silently()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_unix_connection(self.path)
        flowing = asyncio.Event()
        if not self.silent:
            flowing.set()
        self.flowing.append(flowing)
        self.writers += [writer, up_writer]

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    await flowing.wait()
                    dst.write(data)
                    await dst.drain()

        for task in (pump(reader, up_writer), pump(up_reader, writer)):
            self.tasks.add(asyncio.create_task(task))

    async def close(self) -> None:
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for writer in self.writers:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        await self.server.wait_closed()


def test_a_subscription_dropped_silently_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection of the subscription stops passing bytes without a reset: within
    twice ``HEALTH`` (and ``RETRY``) the process has subscribed again and caught up (a
    task that ended meanwhile reaches its watcher)."""
    monkeypatch.setattr(wakeups, "HEALTH", 0.5)

    async def scenario(url: str) -> None:
        direct = Watched(url)  # the test's own commands: not through the proxy
        proxy = Blackhole(url.removeprefix("unix://"))
        here = Watched(await proxy.start())
        here.store = TaskStore(here.store.redis, direct.store.keys, result_ttl=60)
        here.channel = direct.channel
        try:
            async with listen_running(here, url):
                proxy.drop_silently()  # (its only connection: the subscription's)
                peer, got = reader()
                (a,) = await direct.end(1)
                here.hub.watch([a], peer)  # ended unheard: only the catch-up delivers it
                start = time.monotonic()
                await heard(got, {a}, within=10)
                assert time.monotonic() - start < 2 * 0.5 + RETRY + 2
        finally:
            await proxy.close()
            await here.store.redis.aclose()
            await direct.close()

    on_a_redis(tmp_path, scenario)


def test_a_requeue_publishes_its_endpoint_while_more_than_one_process_listens(
    tmp_path: Path,
) -> None:
    """An agent's connection dropped: its tasks go back to the queue, and the endpoint
    is published on ``TaskStore.woken`` (agents connected to other processes take them
    now); nothing when no task went back."""

    async def scenario(url: str) -> None:
        async with two_subscribers(url) as (here, one, two):
            store = here.store
            await one.subscribe(store.woken)
            await two.subscribe(store.woken)
            rows = [(str(uuid.uuid4()), "f", b"x", None, "")]
            await store.submit("o", "ep", "g", rows, max_tasks=100, max_bytes=10**6)
            assert await heard_before_a_mark(store, store.woken, one) == [b"ep"]  # (submit)
            await store.take("ep", "conn", 10)
            assert await store.requeue("ep", "other-conn") == 0
            assert await store.requeue("ep", "conn") == 1
            # the second requeue's only
            assert await heard_before_a_mark(store, store.woken, one) == [b"ep"]

    on_a_redis(tmp_path, scenario)


@contextlib.contextmanager
def blackhole_in_a_thread(path: str) -> Iterator[tuple[Blackhole, str, asyncio.AbstractEventLoop]]:
    """A :class:`Blackhole` to the Redis at Unix socket ``path``, run by a loop of its own
    in a thread (for another process to connect through): its URL, closed after."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    proxy = Blackhole(path)
    try:
        url = asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(10)
        yield proxy, url, loop
    finally:
        asyncio.run_coroutine_threadsafe(proxy.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.mark.timeout(200)
def test_a_service_stops_when_its_queue_redis_went_silent(tmp_path: Path) -> None:
    """review6 #6: the queue Redis stops answering without a reset; SIGTERM stopped the
    jobs and waited for them with no bound (the flusher's last commands never return):
    ``nimbus service stop`` never ended."""
    from nimbus.service.app import STOP_WAIT
    from service_support import free_port, service_env

    store = StateStore.open(None, tmp_path / "redis")
    root = tmp_path / "svc"
    root.mkdir()
    try:
        with blackhole_in_a_thread(store.url.removeprefix("unix://")) as (proxy, url, loop):
            service = Service(root, service_env(root, NIMBUS_REDIS_URL=url), port=free_port())
            service.start()
            assert service.proc is not None
            try:
                with service.http() as http:
                    assert http.get("/v1/health").status_code == 200  # (a pooled connection)
                time.sleep(1)
                loop.call_soon_threadsafe(proxy.go_silent)
                time.sleep(0.5)
                start = time.monotonic()
                service.proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    service.proc.wait(STOP_WAIT + 30)
                stopped = service.proc.poll() is not None
                assert stopped, "the service did not stop"
                assert time.monotonic() - start < STOP_WAIT + 20
            finally:
                service.stop()  # (SIGKILL if still running)
    finally:
        store.close()
