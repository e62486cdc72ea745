"""Service + real endpoint agent processes + SDK: results, errors, cancel, timeouts, faults."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nimbus import Client, Executor
from nimbus.config import Settings
from nimbus.errors import (
    AuthError,
    NotFound,
    RemoteTraceback,
    TaskTimeoutError,
    VersionMismatchError,
)
from nimbus.protocol import WS_AGENT
from nimbus.protocol.wsclient import ws_url
from nimbus.statestore import StateStore
from service_support import (
    CLI,
    EndpointProcess,
    Service,
    assert_first_results,
    free_port,
    process_tree,
    service_env,
    tokened_run,
)


def square(x: int) -> int:
    return x * x


def fail(message: str) -> None:
    raise KeyError(message)


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _settings(service: Service, client: Client) -> Settings:
    return service.user_settings(client.token)


def test_client_run_and_result(alice: Client, lab: EndpointProcess) -> None:
    task_id = alice.run(square, 7, endpoint="lab")
    assert alice.get_result(task_id, timeout=30) == 49
    task = alice.get_task(task_id)
    assert task["state"] == "success"
    record = task["record"]
    assert record["task_id"] == task_id and record["pid"] > 0
    assert record["ended"] >= record["started"] > 0
    ids = alice.batch_run(square, [(i,) for i in range(20)], endpoint="lab")
    assert [alice.get_result(i, timeout=30) for i in ids] == [i * i for i in range(20)]
    listed = {t["task_id"] for t in alice.list_tasks("success", limit=1000)}
    assert set(ids) <= listed


def test_remote_exception_keeps_its_type_and_traceback(alice: Client, lab: EndpointProcess) -> None:
    task_id = alice.run(fail, "boom", endpoint="lab")
    with pytest.raises(KeyError, match="boom") as info:
        alice.get_result(task_id, timeout=30)
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "in fail" in str(info.value.__cause__)
    assert alice.get_task(task_id)["state"] == "failed"


def test_executor_on_endpoint(service: Service, alice: Client, lab: EndpointProcess) -> None:
    with Executor(endpoint="lab", settings=_settings(service, alice)) as ex:
        assert sum(ex.map(square, range(500))) == sum(i * i for i in range(500))
        assert list(ex.map(square, range(10), chunksize=3)) == [i * i for i in range(10)]
        future = ex.submit(square, 12)
        assert future.result(30) == 144
        assert future.record.state.value == "success"
        assert future.record.pid > 0 and future.record.host
        failing = ex.submit(fail, "bad")
        with pytest.raises(KeyError):
            failing.result(30)


def test_executor_cancel_and_timeout(service: Service, alice: Client, lab: EndpointProcess) -> None:
    settings = _settings(service, alice)
    with Executor(endpoint="lab", settings=settings) as ex:
        slow = [ex.submit(nap, 5) for _ in range(4)]
        time.sleep(0.5)
        assert all(f.cancel() for f in slow)
        assert all(f.cancelled() for f in slow)
        start = time.monotonic()
        assert ex.submit(square, 3).result(30) == 9
        assert time.monotonic() - start < 4, "the cancelled tasks kept the workers busy"
        limited = ex.options(timeout=0.5).submit(nap, 30)
        with pytest.raises(TaskTimeoutError):
            limited.result(30)
        with pytest.raises(cf.TimeoutError):
            list(ex.map(nap, [3], timeout=0.2))
    deadline = time.monotonic() + 10
    while alice.list_tasks("running") or alice.list_tasks("dispatched"):
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_client_cancel_queued(service: Service, alice: Client) -> None:
    """A task cancelled while it waits for its (offline) endpoint never runs."""
    later = EndpointProcess(service, alice, "later")  # registered, not started
    queued = alice.run(square, 5, endpoint="later")
    assert alice.get_task(queued)["state"] == "waiting-for-endpoint"
    assert alice.cancel(queued)
    assert not alice.cancel(queued)  # once
    with pytest.raises(cf.CancelledError):
        alice.get_result(queued, timeout=30)
    later.start(alice)
    try:
        assert alice.get_result(alice.run(square, 6, endpoint="later"), timeout=30) == 36
    finally:
        later.stop()
    task = alice.get_task(queued)
    assert task["state"] == "cancelled" and task["record"] is None  # never ran


def test_version_mismatch_is_refused_at_submit(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    import base64

    from nimbus.protocol import PYTHON, SERIALIZER, pack_payload

    payload = base64.b64encode(pack_payload(b"x")).decode()
    with service.http(alice.token) as http:
        fn = http.post(
            "/v1/functions",
            json={
                "function": base64.b64encode(b"x").decode(),
                "python": "2.7",
                "serializer": SERIALIZER,
            },
        ).json()["function_id"]
        response = http.post(
            "/v1/tasks",
            json={
                "endpoint_id": lab.endpoint_id,
                "tasks": [{"function_id": fn, "payload": payload}],
            },
        )
    assert response.status_code == 409
    detail = response.json()["detail"]
    assert "Python 2.7" in detail and f"runs Python {PYTHON}" in detail
    from nimbus.client import error_for

    assert isinstance(error_for(409, detail), VersionMismatchError)


def test_killed_agent_tasks_requeued_exactly_one_result(
    service: Service, alice: Client, tmp_path: Path
) -> None:
    """Every run answers with a token of its own: each task keeps one result, its
    first run's (a run on the killed agent counts if its result got out)."""
    endpoint = EndpointProcess(service, alice, "fragile").start(alice)
    runs = tmp_path / "runs.txt"
    n = 24
    ids = alice.batch_run(tokened_run, [(str(runs), i, 0.25) for i in range(n)], endpoint="fragile")
    deadline = time.monotonic() + 30
    while not runs.exists() or runs.read_text().count("end ") < 4:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert endpoint.proc is not None
    killed = process_tree(endpoint.proc.pid)  # the agent and its workers
    endpoint.kill()  # mid-batch: some done, some running, some prefetched
    replacement = EndpointProcess(service, alice, "fragile")  # same endpoint, new token
    replacement.start(alice)
    try:
        results = [alice.get_result(i, timeout=60) for i in ids]
        assert [t["state"] for t in (alice.get_task(i) for i in ids)] == ["success"] * n
        time.sleep(1.0)  # late duplicates, if any, have arrived: nothing replaced a result
        assert [alice.get_result(i, timeout=5) for i in ids] == results
    finally:
        replacement.stop()
    recorded = assert_first_results(runs, results, lost=killed)
    assert recorded.duplicates() > 0, "no task was running when the agent was killed"


def test_agent_reconnects_after_service_restart(tmp_path: Path) -> None:
    store = StateStore.open(None, tmp_path / "redis")  # queues outlive the service
    root = tmp_path / "svc"
    root.mkdir()
    service = Service(root, service_env(root, NIMBUS_REDIS_URL=store.url), port=free_port())
    service.start()
    endpoint = None
    try:
        with service.client(service.token("erin")) as client:
            endpoint = EndpointProcess(service, client, "phoenix").start(client)
            assert client.get_result(client.run(square, 2, endpoint="phoenix"), timeout=30) == 4
            endpoint.stop()
            queued = client.batch_run(square, [(i,) for i in range(10)], endpoint="phoenix")
            with cf.ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(client.get_result, queued[3], 120)  # across the restart
                time.sleep(0.5)
                service.stop()
                service.start()  # same port, same registry, same Redis
                endpoint.start(client)
                assert waiting.result(120) == 9
            assert [client.get_result(i, timeout=30) for i in queued] == [i * i for i in range(10)]
            service.stop()
            service.start()  # the running agent finds the service again by itself
            endpoint.wait_online(client, timeout=30)
            assert client.get_result(client.run(square, 3, endpoint="phoenix"), timeout=30) == 9
    finally:
        if endpoint is not None:
            endpoint.stop()
        service.stop()
        store.close()


def test_endpoints_listing(alice: Client, lab: EndpointProcess) -> None:
    rows = {e["name"]: e for e in alice.endpoints()}
    assert rows["lab"]["online"] and rows["lab"]["workers"] == 2
    assert rows["lab"]["last_heartbeat"] > time.time() - 5
    with pytest.raises(NotFound):
        alice.get_endpoint("nope")


def test_silent_agent_is_lost_and_its_tasks_run_elsewhere(
    service: Service, alice: Client, tmp_path: Path
) -> None:
    """A frozen agent (its link cut: no heartbeats, no close) loses its tasks to another,
    configured again for the endpoint; thawed, the frozen one may send late results of
    what it had started (the first ones stay) and is told it was replaced, and exits."""
    frozen = EndpointProcess(service, alice, "frozen").start(alice)
    runs = tmp_path / "runs.txt"
    n = 12
    ids = alice.batch_run(tokened_run, [(str(runs), i, 0.3) for i in range(n)], endpoint="frozen")
    deadline = time.monotonic() + 30
    while not runs.exists() or not runs.read_text().split():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert frozen.proc is not None
    stopped = process_tree(frozen.proc.pid)
    os.killpg(frozen.proc.pid, signal.SIGSTOP)  # agent and workers stop; the socket stays open
    try:
        lost = time.monotonic() + 10  # 3 heartbeats of 0.3 s, then the service gives up on it
        while alice.get_endpoint("frozen")["online"]:
            assert time.monotonic() < lost
            time.sleep(0.05)
        helper = EndpointProcess(service, alice, "frozen")  # revokes the frozen one's token
        try:
            helper.start(alice)
            try:
                results = [alice.get_result(i, timeout=60) for i in ids]
            finally:
                os.killpg(frozen.proc.pid, signal.SIGCONT)  # heal: it comes back, replaced
            assert frozen.proc.wait(15) == 1, frozen.log.read_text()[-3000:]
            said = frozen.log.read_text()  # told at once if still connected, else refused
            assert "configured again" in said or "configure frozen" in said, said[-3000:]
            time.sleep(1.5)  # a late result it sent before it heard, if any, has arrived
            assert {t["state"] for t in (alice.get_task(i) for i in ids)} == {"success"}
            assert [alice.get_result(i, timeout=5) for i in ids] == results
        finally:
            helper.stop()
    finally:
        frozen.kill()
    recorded = assert_first_results(runs, results, lost=stopped)
    assert recorded.duplicates() > 0, "no task was held by the frozen agent"


def test_first_result_wins(service: Service, alice: Client) -> None:
    """Two results for one task through the real agent socket and Redis: the service
    keeps the first, in the same message or a later one, and acknowledges both."""
    from websockets.sync.client import connect

    from nimbus import serialization
    from nimbus.protocol import PYTHON, SERIALIZER, pack, unpack
    from nimbus.records import TaskRecord, TaskState
    from nimbus.runtime.messages import Status

    agent = alice.register_endpoint("two-answers")
    ids = alice.batch_run(square, [(1,), (2,)], endpoint="two-answers")
    url = ws_url(service.url, WS_AGENT)

    def row(task_id: str, value: str, pid: int) -> list[object]:
        data, buffers = serialization.dumps(value)
        record = TaskRecord(task_id, TaskState.SUCCESS, pid=pid).to_wire()
        return [
            task_id,
            TaskState.SUCCESS.value,
            [Status.OK, data, [bytes(b) for b in buffers]],
            record,
        ]

    headers = {"Authorization": f"Bearer {agent['token']}"}
    with connect(url, additional_headers=headers) as ws:
        ws.send(
            pack(
                {
                    "op": "hello",
                    "python": PYTHON,
                    "serializer": SERIALIZER,
                    "workers": 1,
                    "window": 4,
                }
            )
        )
        sent: list[str] = []
        while len(sent) < 2:
            msg = unpack(ws.recv(timeout=30))
            if msg["op"] == "tasks":
                sent += [task[0] for task in msg["tasks"]]
        assert sorted(sent) == sorted(ids)
        one, two = ids
        ws.send(pack({"op": "results", "results": [row(one, "first", 1), row(one, "second", 2)]}))
        ws.send(pack({"op": "results", "results": [row(two, "first", 1)]}))
        ws.send(pack({"op": "results", "results": [row(two, "second", 2)]}))
        acked: list[str] = []
        while len(acked) < 4:
            msg = unpack(ws.recv(timeout=30))
            if msg["op"] == "ack":
                acked += msg["ids"]
        assert sorted(acked) == sorted([one, one, two, two])
    for task_id in ids:
        assert alice.get_result(task_id, timeout=30) == "first"
        task = alice.get_task(task_id)
        assert task["state"] == "success" and task["record"]["pid"] == 1


def test_executor_refuses_unknown_or_mismatched_endpoints(service: Service, alice: Client) -> None:
    from websockets.sync.client import connect

    from nimbus.protocol import PYTHON, SERIALIZER, pack

    settings = _settings(service, alice)
    with pytest.raises(NotFound, match="nope"):
        Executor(endpoint="nope", settings=settings)
    old = alice.register_endpoint("old-python")
    url = ws_url(service.url, WS_AGENT)
    with connect(url, additional_headers={"Authorization": f"Bearer {old['token']}"}) as ws:
        ws.send(pack({"op": "hello", "python": "3.9", "serializer": SERIALIZER, "workers": 1}))
        deadline = time.monotonic() + 10
        while not alice.get_endpoint("old-python")["online"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(VersionMismatchError) as info:
            Executor(endpoint="old-python", settings=settings)
        message = str(info.value)
        assert "Python 3.9" in message and f"Python {PYTHON}" in message
        with pytest.raises(VersionMismatchError, match=r"Python 3\.9"):
            alice.run(square, 1, endpoint="old-python")


def test_running_state_is_visible(alice: Client, lab: EndpointProcess) -> None:
    task_id = alice.run(nap, 1.5, endpoint="lab")
    deadline = time.monotonic() + 10
    while alice.get_task(task_id)["state"] != "running":
        assert time.monotonic() < deadline, alice.get_task(task_id)
        time.sleep(0.05)
    assert task_id in [t["task_id"] for t in alice.list_tasks("running")]
    assert alice.get_result(task_id, timeout=30) == 1.5
    assert alice.get_task(task_id)["state"] == "success"


def test_sigterm_answers_long_polls_instead_of_waiting_for_them(tmp_path: Path) -> None:
    """uvicorn's graceful shutdown waits for requests under way: a long-poll is told to
    answer at once (the task is not done yet), not cut off with a 500 after a while."""
    root = tmp_path / "svc"
    root.mkdir()
    service = Service(root, service_env(root)).start()
    try:
        with service.client(service.token("gail")) as client:
            client.register_endpoint("nobody-home")  # never started: its task waits
            task_id = client.run(square, 2, endpoint="nobody-home")
            with service.http(client.token) as http, cf.ThreadPoolExecutor(1) as pool:
                poll = pool.submit(http.get, f"/v1/tasks/{task_id}/result", params={"wait": 120})
                time.sleep(1.0)  # the long-poll is waiting on the service
                assert service.proc is not None
                service.proc.send_signal(signal.SIGTERM)
                response = poll.result(60)
        assert response.status_code == 200, response.text
        assert response.json() == {
            "task_id": task_id,
            "state": "waiting-for-endpoint",
            "result": None,
        }
        assert service.proc.wait(60) == 0  # a graceful exit, its embedded Redis stopped
    finally:
        service.stop()


def test_a_revoked_token_ends_an_executor_and_an_endpoint_daemon_saying_what_to_do(
    service: Service,
) -> None:
    """Both peers of the service stand on one WebSocket client: when the admin revokes a
    user (their token and their endpoints'), the daemon exits and the Executor's tasks
    fail, each with an error naming its token and what to do; a daemon started again
    with the revoked token stops at once, saying the same."""
    token = service.token("rev")  # a user of its own: revoking it touches no other test
    with service.client(token) as client:
        endpoint = EndpointProcess(service, client, "rev-lab").start(client)
        try:
            with Executor(endpoint="rev-lab", settings=service.user_settings(token)) as ex:
                assert ex.submit(square, 3).result(30) == 9
                waiting = ex.submit(nap, 60)
                revoke = subprocess.run(
                    [sys.executable, "-c", CLI, "service", "token", "revoke", "rev"],
                    env=service.env,
                    capture_output=True,
                    text=True,
                    timeout=60,
                    check=False,
                )
                assert revoke.returncode == 0, revoke.stdout + revoke.stderr
                assert endpoint.proc is not None
                assert endpoint.proc.wait(30) == 1
                log = endpoint.log.read_text()
                assert "endpoint rev-lab's token was revoked" in log, log
                assert "run `nimbus endpoint configure rev-lab` for a new one" in log, log
                assert "Traceback" not in log
                with pytest.raises(AuthError) as info:
                    waiting.result(30)
                said = str(info.value)
                assert "this client's token" in said and "was revoked" in said, said
                assert "ask the service admin for a new one" in said, said
                with pytest.raises(AuthError, match="this client's token"):
                    ex.submit(square, 4).result(30)  # fails at once, not queued
            endpoint.start()  # with the revoked token: refused when it connects
            assert endpoint.proc.wait(30) == 1
            log = endpoint.log.read_text()
            assert "refused endpoint rev-lab's token (HTTP 40" in log, log
            assert log.count("nimbus endpoint configure rev-lab") == 2, log
        finally:
            endpoint.stop()
