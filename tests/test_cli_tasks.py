"""``nimbus tasks watch`` against a real service, endpoint and workers."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from service_support import CLI, EndpointProcess, Service


@pytest.fixture(scope="module")
def wanda(service: Service) -> Iterator[tuple[Any, dict[str, str]]]:
    token = service.token("wanda")
    env = service.env | {"NIMBUS_SERVICE_URL": service.url, "NIMBUS_TOKEN": token}
    with service.client(token) as client:
        agent = EndpointProcess(service, client, "watch-ep", workers=2).start(client)
        try:
            yield client, env
        finally:
            agent.stop()


def _watch(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CLI, "tasks", "watch", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err


def test_watch_follows_new_tasks_live_until_done(wanda: tuple[Any, dict[str, str]]) -> None:
    client, env = wanda
    proc = _watch(env, "--until-done", "--interval", "0.1", "--timeout", "60", "--limit", "1")
    time.sleep(1.5)  # the watch is looking before the task exists
    assert proc.poll() is None
    started = time.monotonic()
    task_id = client.run(time.sleep, 2.0, endpoint="watch-ep")
    code, out, err = _finish(proc)
    assert code == 0, out + err
    lines = [line for line in out.splitlines() if task_id in line]
    assert "sleep" in lines[0] and "success" not in lines[0], out  # seen before it ended
    assert "running" in out and "-> success" in lines[-1] and lines[-1].endswith(" s")
    assert out.rstrip().endswith("all 1 finished: 1 success")
    assert time.monotonic() - started < 30


def test_watch_given_ids_exits_1_when_one_failed(wanda: tuple[Any, dict[str, str]]) -> None:
    client, env = wanda
    ok = client.run(abs, -3, endpoint="watch-ep")
    bad = client.run(int, "not a number", endpoint="watch-ep")
    code, out, err = _finish(_watch(env, ok, bad, "--interval", "0.1"))
    assert code == 1, out + err
    assert "all 2 finished: 1 failed, 1 success" in out
    assert f"{bad}  int" in out and f"{ok}  abs" in out


def test_watch_wrong_input_says_what_was_wrong(wanda: tuple[Any, dict[str, str]]) -> None:
    _, env = wanda
    code, _, err = _finish(_watch(env, "--endpoint", "no-such-endpoint", "--timeout", "5"))
    assert code == 1 and "no-such-endpoint" in err and "Traceback" not in err
    missing = str(uuid.uuid4())
    code, _, err = _finish(_watch(env, missing))
    assert code == 1 and missing in err and "not found" in err and "Traceback" not in err
    code, _, err = _finish(_watch(env, missing, "--status", "running"))
    assert code == 2 and "not both" in err
    assert err.startswith("nimbus tasks watch: give task ids") and "configuration error" not in err
    code, _, err = _finish(_watch(env, missing, "--limit", "5"))  # --limit chooses, as in list
    assert code == 2 and "not both" in err and err.count("nimbus tasks watch:") == 1
    code, _, err = _finish(_watch(env, "--interval", "0"))
    assert code == 2 and "--interval" in err and "0.1 to 60" in err
    code, _, err = _finish(_watch(env, "3f2a"))
    assert code == 2 and "is not a task ID" in err


def test_watch_timeout_exits_3(wanda: tuple[Any, dict[str, str]]) -> None:
    client, env = wanda
    task_id = client.run(time.sleep, 5.0, endpoint="watch-ep")
    code, out, err = _finish(_watch(env, task_id, "--timeout", "0.5", "--interval", "0.1"))
    assert code == 3 and task_id in out and "--timeout 0.5 s passed with 1 tasks" in err
    client.get_result(task_id, timeout=30)


def test_watch_counts_an_id_given_twice_once(wanda: tuple[Any, dict[str, str]]) -> None:
    client, env = wanda
    ok = client.run(abs, -3, endpoint="watch-ep")
    code, out, err = _finish(_watch(env, ok, ok, "--interval", "0.1"))
    assert code == 0, out + err
    assert out.rstrip().endswith("all 1 finished: 1 success") and out.count(f"{ok}  abs") == 1


def test_watch_timeout_with_nothing_pending_exits_0(wanda: tuple[Any, dict[str, str]]) -> None:
    client, env = wanda
    task_id = client.run(abs, -4, endpoint="watch-ep")
    client.get_result(task_id, timeout=30)
    code, out, err = _finish(_watch(env, "--limit", "1", "--timeout", "0.5", "--interval", "0.1"))
    assert code == 0, out + err
    assert "nothing left to watch (1 tasks followed, none unfinished)" in out
    assert len([line for line in out.splitlines() if "  abs " in line]) == 1  # --limit 1 holds
