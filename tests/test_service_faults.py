"""Faults of the service's own parts under load: its task queues' Redis killed by SIGKILL."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from nimbus import Executor
from nimbus.errors import TaskLost
from service_support import EndpointProcess, Service, service_env, service_redis

N = 400


def token(i: int) -> tuple[int, str, int]:
    """Task ``i``'s own token: a second run of it would return another."""
    import uuid

    time.sleep(0.01)
    return i, uuid.uuid4().hex, os.getpid()


def _queue_redis_pid(service: Service) -> int:
    """The pid of the service's embedded queue Redis."""
    return service_redis(service)


class _Health:
    """GET /v1/health every 20 ms in a thread: the statuses seen, in order, without repeats."""

    def __init__(self, service: Service) -> None:
        self.url = service.url + "/v1/health"
        self.seen: list[int] = []
        self.retry_after: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self._stop.is_set():
                reply = http.get(self.url)
                if reply.status_code == 503:
                    self.retry_after.add(reply.headers.get("retry-after", ""))
                    assert "unavailable" in reply.json()["detail"]
                if not self.seen or self.seen[-1] != reply.status_code:
                    self.seen.append(reply.status_code)
                time.sleep(0.02)

    def __enter__(self) -> _Health:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)

    def wait_for(self, status: int, timeout: float = 30) -> None:
        """Until ``status`` was seen after a 503 (the outage seen, then its end)."""
        deadline = time.monotonic() + timeout
        while not (503 in self.seen and self.seen[-1] == status):
            assert time.monotonic() < deadline, self.seen
            time.sleep(0.02)


def _outage_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "Redis" in line or "redis" in line]


def test_queue_redis_killed_under_a_map_comes_back_from_its_file(tmp_path: Path) -> None:
    service = Service(tmp_path, service_env(tmp_path), args=["--persist"]).start()
    try:
        with service.client(service.token("kim")) as kim:
            lab = EndpointProcess(service, kim, "lab").start(kim)
            try:
                pid = _queue_redis_pid(service)
                with (
                    _Health(service) as health,
                    Executor(endpoint="lab", settings=service.user_settings(kim.token)) as ex,
                ):
                    futures = [ex.submit(token, i) for i in range(N)]
                    while sum(f.done() for f in futures) < N // 4:
                        time.sleep(0.01)
                    os.kill(pid, signal.SIGKILL)
                    results = [f.result(180) for f in futures]
                    health.wait_for(200)
                assert _queue_redis_pid(service) != pid
                assert kim.list_tasks(limit=1)  # the REST API works again
            finally:
                lab.stop()
    finally:
        service.stop()
    # every task exactly one result: its own, once (a task run twice returns another token,
    # and the service keeps and sends the first)
    assert [i for i, _, _ in results] == list(range(N))
    assert len({tok for _, tok, _ in results}) == N
    assert health.seen[0] == 200 and 503 in health.seen and health.seen[-1] == 200
    assert health.retry_after == {"2"}
    log = service.log.read_text()
    assert log.count("died; restarting it from its append-only file") == 1
    assert "Redis is back" in log
    assert "Traceback" not in log and len(_outage_lines(log)) <= 6, log[-3000:]


def test_queue_redis_killed_without_persist_health_and_calls_recover(tmp_path: Path) -> None:
    service = Service(tmp_path, service_env(tmp_path)).start()
    refused: httpx.Response | None = None  # a raw call made during an outage
    retried = False  # an SDK call made during an outage met a 503 and retried it
    kills = 0
    try:
        with service.client(service.token("lee")) as lee, service.http(lee.token) as http:
            lee.register_endpoint("dark")
            statuses: list[int] = []
            lee._http.event_hooks["response"].append(lambda r: statuses.append(r.status_code))
            while (refused is None or not retried) and kills < 10:
                pid = _queue_redis_pid(service)
                with _Health(service) as health:
                    time.sleep(0.1)
                    os.kill(pid, signal.SIGKILL)
                    kills += 1
                    if refused is None:
                        reply = http.get("/v1/tasks")
                        refused = reply if reply.status_code == 503 else None
                    else:
                        statuses.clear()
                        assert lee.list_tasks() == []  # no error: retried until it worked
                        retried = 503 in statuses
                    health.wait_for(200)
                assert 503 in health.seen, health.seen
                assert _queue_redis_pid(service) != pid
            assert lee.get_endpoint("dark")["name"] == "dark"
    finally:
        service.stop()
    assert refused is not None and retried, kills
    assert refused.headers["retry-after"] == "2"
    assert "retry in a few seconds" in refused.json()["detail"]
    log = service.log.read_text()
    assert log.count("died; restarting it empty: the tasks queued and running are lost") == kills
    assert "Traceback" not in log and len(_outage_lines(log)) <= 4 * kills, log[-3000:]


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def test_tasks_lost_with_the_queue_redis_fail_with_task_lost(tmp_path: Path) -> None:
    """Without --persist, the Executor's futures of tasks the restarted (empty) queue Redis
    no longer has fail with TaskLost at once, instead of waiting forever; the Executor and
    the endpoint go on working."""
    service = Service(tmp_path, service_env(tmp_path)).start()
    try:
        with service.client(service.token("lou")) as lou:
            lab = EndpointProcess(service, lou, "lab", workers=1).start(lou)
            try:
                settings = service.user_settings(lou.token)
                with Executor(endpoint="lab", settings=settings) as ex:
                    running = ex.submit(nap, 8.0)  # on the agent's one worker
                    queued = [ex.submit(square_of, i) for i in range(5)]  # waiting behind it
                    deadline = time.monotonic() + 30
                    while len(lou.list_tasks()) < 6:
                        assert time.monotonic() < deadline
                        time.sleep(0.02)
                    os.kill(_queue_redis_pid(service), signal.SIGKILL)
                    start = time.monotonic()
                    for future in [running, *queued]:
                        with pytest.raises(TaskLost, match="--persist"):
                            future.result(30)
                    took = time.monotonic() - start
                    assert ex.submit(square_of, 7).result(60) == 49  # and on it goes
            finally:
                lab.stop()
    finally:
        service.stop()
    assert took < 7.0, took  # told when the Redis came back (nap(8) still running then)
    log = service.log.read_text()
    assert "lost with the task queues; they were told" in log
    assert "Traceback" not in log, log[-3000:]


def square_of(x: int) -> int:
    return x * x
