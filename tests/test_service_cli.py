"""The operator's commands against a real service: tokens, login, endpoint lifecycle, tasks."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from service_support import CLI, Service, service_env


def _cli(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``nimbus *args`` run in a new process with environment ``env``."""
    return subprocess.run(
        [sys.executable, "-c", CLI, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def nimbus(service: Service, *args: str, timeout: float = 60) -> str:
    """What ``nimbus *args`` prints, it having exited 0."""
    proc = _cli(service.env, *args, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_operator_flow(service: Service) -> None:
    token = nimbus(service, "service", "token", "create", "olivia").strip()
    assert token.startswith("nimbus_")
    assert "logged in" in nimbus(service, "login", "--service", service.url, "--token", token)
    assert "configured" in nimbus(service, "endpoint", "configure", "cli-ep", "--workers", "1")
    assert "started" in nimbus(service, "endpoint", "start", "cli-ep")
    try:
        deadline = time.monotonic() + 30
        while "online" not in nimbus(service, "endpoint", "status", "cli-ep"):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        listing = nimbus(service, "endpoints", "list")
        assert "cli-ep" in listing and "olivia" in listing and "online" in listing
        assert "running" in nimbus(service, "endpoint", "list")
        with service.client(token) as client:
            task_id = client.run(pow, 2, 10, endpoint="cli-ep")
            assert client.get_result(task_id, timeout=30) == 1024
        rows = json.loads(nimbus(service, "tasks", "list", "--status", "success", "--json"))
        assert [r["task_id"] for r in rows] == [task_id]
        assert task_id in nimbus(service, "tasks", "list")
        assert nimbus(service, "tasks", "list", "--status", "running").count("\n") == 1  # header
        shown = json.loads(nimbus(service, "tasks", "show", task_id))
        assert shown["state"] == "success" and shown["record"]["cpu_user"] >= 0

    finally:
        assert "stopped" in nimbus(service, "endpoint", "stop", "cli-ep")
    assert "stopped" in nimbus(service, "endpoint", "list")


def test_configure_of_a_running_endpoint_starts_its_agent_again(
    service: Service, tmp_path: Path
) -> None:
    """Stranger 6 #4: the new token stopped the running agent and configure said nothing."""
    token = nimbus(service, "service", "token", "create", "cora").strip()
    nimbus(service, "login", "--service", service.url, "--token", token)
    nimbus(service, "endpoint", "configure", "cfg-ep", "--workers", "1")
    assert "started" in nimbus(service, "endpoint", "start", "cfg-ep")
    try:
        first = nimbus(service, "endpoint", "status", "cfg-ep").splitlines()[0]
        assert first.startswith("agent:   running (pid "), first
        said = nimbus(service, "endpoint", "configure", "cfg-ep", "--exports", str(tmp_path))
        old_pid = first.split("pid ")[1].rstrip(")")
        assert f"its running agent (pid {old_pid}) stops" in said, said
        assert "endpoint cfg-ep started (pid " in said, said
        deadline = time.monotonic() + 30
        while True:  # online again, with the new token, in a new agent
            status = nimbus(service, "endpoint", "status", "cfg-ep")
            if "service: online" in status:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.3)
        assert "agent:   running (pid " in status and f"(pid {old_pid})" not in status, status
    finally:
        nimbus(service, "endpoint", "stop", "cfg-ep")


def test_bad_token_login_fails_cleanly(service: Service) -> None:
    proc = _cli(service.env, "login", "--service", service.url, "--token", "nimbus_bad")
    assert proc.returncode == 1
    assert "invalid token" in proc.stderr and "Traceback" not in proc.stderr


def test_persist_is_for_the_embedded_redis_only(tmp_path: Path) -> None:
    env = service_env(tmp_path, NIMBUS_REDIS_URL="redis://127.0.0.1:1")
    proc = _cli(env, "service", "start", "--port", "0", "--persist")
    assert proc.returncode == 2
    assert "--persist" in proc.stderr and "NIMBUS_REDIS_URL" in proc.stderr
    assert "Traceback" not in proc.stderr


def _refused_soon(service: Service, token: str) -> bool:
    """Whether ``token`` gets 401 within a few seconds (the service looks every second)."""
    deadline = time.monotonic() + 10
    with service.http(token) as http:
        while time.monotonic() < deadline:
            if http.get("/v1/whoami").status_code == 401:
                return True
            time.sleep(0.1)
    return False


def test_token_list_and_revoke_one_by_id(service: Service) -> None:
    first = nimbus(service, "service", "token", "create", "quinn").strip()
    second = nimbus(service, "service", "token", "create", "quinn").strip()
    with service.client(first) as client:
        client.register_endpoint("quinn-ep")
    rows = json.loads(nimbus(service, "service", "token", "list", "--json"))
    mine = [r for r in rows if r["user"] == "quinn"]
    assert len(mine) == 3 and {r["endpoint"] for r in mine} == {"", "quinn-ep"}
    table = nimbus(service, "service", "token", "list")
    assert table.splitlines()[0].split() == ["ID", "USER", "ENDPOINT", "CREATED"]
    assert all(r["id"] in table for r in mine)
    assert first not in table and second not in table  # IDs only, never the tokens
    with service.http(first) as http:
        assert http.get("/v1/whoami").status_code == 200  # cached by the service now
    from nimbus.service.registry import hash_token

    target = hash_token(first)[:12]
    out = nimbus(service, "service", "token", "revoke", target)
    assert out.strip() == f"revoked token {target} (user quinn)"
    assert _refused_soon(service, first)
    with service.http(second) as http:
        assert http.get("/v1/whoami").json()["name"] == "quinn"
    listed = nimbus(service, "service", "token", "list")
    assert target not in listed and hash_token(second)[:12] in listed


def test_revoking_a_user_disconnects_their_agent_and_clients(service: Service) -> None:
    from nimbus import Executor
    from nimbus.errors import AuthError
    from service_support import EndpointProcess

    token = nimbus(service, "service", "token", "create", "rita").strip()
    with service.client(token) as client:
        endpoint = EndpointProcess(service, client, "rita-lab").start(client)
        try:
            with Executor(endpoint="rita-lab", settings=service.user_settings(token)) as ex:
                assert ex.submit(pow, 2, 5).result(30) == 32
                waiting = ex.submit(time.sleep, 60)
                out = nimbus(service, "service", "token", "revoke", "rita")
                assert "(user rita)" in out and "(endpoint rita-lab of rita)" in out
                assert endpoint.proc is not None
                assert endpoint.proc.wait(30) == 1  # the agent stops, saying why
                log = endpoint.log.read_text()
                assert "token revoked by the service admin" in log
                assert "Traceback" not in log
                with pytest.raises(AuthError, match="revoked"):
                    waiting.result(30)
                with pytest.raises(AuthError, match="revoked"):
                    ex.submit(pow, 2, 6).result(30)  # fails at once, not queued
            assert _refused_soon(service, token)
        finally:
            endpoint.stop()


def test_token_revoke_bad_input(service: Service) -> None:
    unknown = _cli(service.env, "service", "token", "revoke", "nobody-at-all")
    assert unknown.returncode == 2  # a bad argument (stranger 6 #10)
    assert "no user named 'nobody-at-all'" in unknown.stderr
    assert "nimbus service token list" in unknown.stderr and "Traceback" not in unknown.stderr
    no_such_id = _cli(service.env, "service", "token", "revoke", "ffffff000000")
    assert no_such_id.returncode == 2 and "no token with ID ffffff000000" in no_such_id.stderr
    missing = _cli(service.env, "service", "token", "revoke")
    assert missing.returncode == 2 and "NAME|ID" in missing.stderr
    nimbus(service, "service", "token", "create", "sam")
    assert nimbus(service, "service", "token", "revoke", "sam").startswith("revoked token")
    assert nimbus(service, "service", "token", "revoke", "sam").strip() == "user sam has no tokens"


def test_revoking_a_users_token_cuts_the_store_urls_it_fetched(service: Service) -> None:
    import redis

    from nimbus.service.registry import hash_token
    from service_support import EndpointProcess

    leaked = nimbus(service, "service", "token", "create", "sam").strip()
    kept = nimbus(service, "service", "token", "create", "sam").strip()
    with service.client(kept) as client:
        endpoint = EndpointProcess(service, client, "sam-lab").start(client)
        try:
            with service.client(leaked) as thief:
                stolen = thief.store(endpoint.endpoint_id)["url"]
            held = redis.Redis.from_url(stolen)
            held.ping()  # connected before the revocation
            nimbus(service, "service", "token", "revoke", hash_token(leaked)[:12])
            assert _refused_soon(service, leaked)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # its connection is closed, its password gone
                try:
                    held.ping()
                except redis.RedisError:
                    break
                time.sleep(0.1)
            else:
                pytest.fail("a connection made with a revoked token's store URL still works")
            with pytest.raises(redis.RedisError), redis.Redis.from_url(stolen) as again:
                again.ping()
            held.close()
            fresh = client.store(endpoint.endpoint_id)["url"]  # the kept token gets a new one
            assert fresh != stolen
            with redis.Redis.from_url(fresh) as works:
                assert works.ping()
        finally:
            endpoint.stop()


# ---------------------------------------------------------------- the first hour (issue 14)


def _as(service: Service, token: str, *args: str, **kw: Any) -> subprocess.Popen[str]:
    env = service.env | {"NIMBUS_SERVICE_URL": service.url, "NIMBUS_TOKEN": token}
    return subprocess.Popen(
        [sys.executable, "-c", CLI, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def _run_as(service: Service, token: str, *args: str) -> tuple[int, str, str]:
    proc = _as(service, token, *args)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def test_sigterm_stops_the_service_and_removes_its_redis_files(tmp_path: Path) -> None:
    svc = Service(tmp_path, service_env(tmp_path)).start()
    runtime = tmp_path / "rt"
    try:
        files = sorted(p.suffix for p in runtime.glob("redis-*"))
        assert files == [".json", ".log", ".sock"], files
        assert (runtime / "service" / "service.json").exists()
    finally:
        svc.stop()  # SIGTERM
    assert svc.proc is not None and svc.proc.returncode == 0, svc.log.read_text()[-3000:]
    assert list(runtime.glob("redis-*")) == []
    assert not (runtime / "service" / "service.json").exists()
    assert "Traceback" not in svc.log.read_text()


def test_token_commands_name_the_registry_and_service_they_use(
    service: Service, tmp_path: Path
) -> None:
    here = _cli(service.env, "service", "token", "create", "tess")
    assert here.returncode == 0, here.stderr
    registry = f"{service.env['NIMBUS_RUNTIME_DIR']}/service/registry.sqlite3"
    assert registry in here.stderr and f"service running at {service.url}" in here.stderr
    assert here.stdout.startswith("nimbus_")  # only the token on stdout, for scripts
    # another runtime directory: another registry, and no service runs on it
    other = service.env | {"NIMBUS_RUNTIME_DIR": str(tmp_path / "other")}
    elsewhere = _cli(other, "service", "token", "list")
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert f"{tmp_path}/other/service/registry.sqlite3" in elsewhere.stderr
    assert f"no service runs with runtime directory {tmp_path}/other" in elsewhere.stderr
    assert "tess" not in elsewhere.stdout


@pytest.mark.timeout(120)
def test_tasks_list_names_functions_times_running_tasks_and_says_when_cut(
    service: Service, alice: Any, lab: Any
) -> None:
    token = service.token("alice")
    quick = [alice.run(pow, 2, n, endpoint="lab") for n in range(3)]
    assert [alice.get_result(t, timeout=30) for t in quick] == [1, 2, 4]
    slow = alice.run(time.sleep, 3, endpoint="lab")
    deadline = time.monotonic() + 20
    while alice.get_task(slow)["state"] != "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)
    code, out, err = _run_as(service, token, "tasks", "list")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["TASK", "FUNCTION", "STATE", "ENDPOINT", "SUBMITTED", "RUN", "(s)"]
    [running] = [line for line in lines if slow in line]
    assert running.split()[1:4] == ["sleep", "running", "lab"]
    assert running.split()[-1].endswith("+") and float(running.split()[-1][:-1]) >= 0.3
    [done] = [line for line in lines if quick[0] in line]
    assert done.split()[1:3] == ["pow", "success"] and float(done.split()[-1]) >= 0
    assert err == ""  # all shown
    code, out, err = _run_as(service, token, "tasks", "list", "--limit", "2")
    assert code == 0 and len(out.splitlines()) == 3  # the header and two tasks
    assert "showing the newest 2 tasks" in err and "--limit" in err
    assert alice.get_result(slow, timeout=30) is None


def test_tasks_list_running_is_what_workers_started_timed_from_their_start(
    service: Service, alice: Any, lab: Any
) -> None:
    """Stranger 6 #3: 16 tasks on a 2-worker endpoint listed as running (those waiting in
    the workers' windows too), a 3 s task's run time 12.7+ (counted from dispatch)."""
    token = service.token("alice")
    ids = alice.batch_run(time.sleep, [(1.5,)] * 8, endpoint="lab")
    try:
        most, waiting, shown, deadline = 0, 0, False, time.monotonic() + 60
        until = deadline  # sampled for 3 s once two run: all through the first two tasks
        while time.monotonic() < min(deadline, until):
            rows = alice.list_tasks(limit=50)
            mine = [r for r in rows if r["task_id"] in ids]
            running = [r for r in mine if r["state"] == "running"]
            most = max(most, len(running))
            waiting = max(waiting, sum(r["state"] in ("dispatched", "waiting") for r in mine))
            for r in running:  # from the worker's start: after it was dispatched
                assert r["started"] >= r["dispatched"] > 0, r
            if len(running) == 2 and waiting >= 2 and not shown:
                until, shown = time.monotonic() + 3.0, True
                code, out, err = _run_as(service, token, "tasks", "list", "--status", "running")
                assert code == 0, err
                times = [float(line.split()[-1].rstrip("+")) for line in out.splitlines()[1:]]
                assert times and max(times) < 1.5 + 1.0, out  # 1.5 s tasks (+ the CLI's start)
            time.sleep(0.1)
        assert shown and most <= 2, most  # lab has 2 workers
        assert waiting >= 2 and most == 2, (most, waiting)
    finally:
        assert [alice.get_result(t, timeout=60) for t in ids] == [None] * 8


def test_tasks_show_gives_a_failed_tasks_exception_and_traceback(
    service: Service, alice: Any, lab: Any
) -> None:
    token = service.token("alice")
    failed = alice.run(int, "not a number", endpoint="lab")
    with pytest.raises(ValueError):
        alice.get_result(failed, timeout=30)
    code, out, err = _run_as(service, token, "tasks", "show", failed)
    assert code == 0, err
    shown = json.loads(out)
    assert shown["state"] == "failed"
    assert shown["error"]["type"] == "ValueError"
    assert "invalid literal for int()" in shown["error"]["message"]
    assert shown["error"]["traceback"].startswith("Traceback (most recent call last)")
    assert "not a number" in shown["error"]["traceback"]


def test_tasks_list_into_a_closed_pipe_ends_quietly(service: Service, alice: Any, lab: Any) -> None:
    token = service.token("alice")
    for n in range(3):
        alice.run(pow, 3, n, endpoint="lab")
    proc = _as(service, token, "tasks", "list")
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # as `| head` does once it has its lines
    err = proc.stderr.read()
    proc.stderr.close()
    proc.wait(60)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert err == ""
    piped = subprocess.run(
        f"{sys.executable} -c '{CLI}' tasks list | head -1",
        shell=True,
        env=service.env | {"NIMBUS_SERVICE_URL": service.url, "NIMBUS_TOKEN": token},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert piped.stdout.split() == [
        "TASK", "FUNCTION", "STATE", "ENDPOINT", "SUBMITTED", "RUN", "(s)"
    ]  # fmt: skip
    assert "Traceback" not in piped.stderr


def test_get_result_of_a_cancelled_task_names_it(service: Service, alice: Any) -> None:
    import concurrent.futures as cf

    endpoint_id = alice.register_endpoint("nobody-runs-this")["endpoint_id"]
    task_id = alice.run(pow, 2, 3, endpoint=endpoint_id)  # waits: its endpoint is offline
    assert alice.cancel(task_id)
    with pytest.raises(cf.CancelledError, match=f"task {task_id} was cancelled"):
        alice.get_result(task_id, timeout=30)


@pytest.mark.parametrize("name", ["", "a b*", "x" * 201, "../etc", "ünïcode"])
def test_registry_refuses_user_names_an_endpoint_could_not_have(
    service: Service, name: str
) -> None:
    with pytest.raises(ValueError, match="is not a user name: 1-200 letters, digits"):
        service.token(name)
    assert name not in _cli(service.env, "service", "token", "list").stdout.split()


def test_endpoint_provider_checked_at_configure_and_a_dying_agent_said_at_start(
    service: Service,
) -> None:
    token = nimbus(service, "service", "token", "create", "pavel").strip()
    nimbus(service, "login", "--service", service.url, "--token", token)
    refused = _cli(service.env, "endpoint", "configure", "lab2", "--provider", "nope")
    assert refused.returncode == 2
    assert "--provider: unknown provider 'nope'; known providers: local, slurm" in refused.stderr
    assert "lab2" not in nimbus(service, "endpoint", "list")  # nothing written
    # an endpoint file edited by hand (or by an older nimbus) that its agent cannot run
    nimbus(service, "endpoint", "configure", "lab2", "--workers", "1")
    toml = Path(service.env["XDG_CONFIG_HOME"]) / "nimbus" / "endpoints" / "lab2" / "endpoint.toml"
    text = toml.read_text()
    assert 'provider = "local"' in text
    toml.write_text(text.replace('provider = "local"', 'provider = "nope"'))
    start = _cli(service.env, "endpoint", "start", "lab2")
    if start.returncode == 0:
        _cli(service.env, "endpoint", "stop", "lab2")
    assert start.returncode == 1, start.stdout + start.stderr
    assert "started" not in start.stdout
    assert "its agent exited at start" in start.stderr and "'nope'" in start.stderr
    assert "stopped" in nimbus(service, "endpoint", "list")


def test_a_provider_endpoint_with_no_block_says_0_workers_up_to_its_size(
    service: Service,
) -> None:
    """Stranger 6 #8: a Slurm endpoint running no block said "online, 8 workers"."""
    token = nimbus(service, "service", "token", "create", "petra").strip()
    nimbus(service, "login", "--service", service.url, "--token", token)
    env = {**service.env, "SLURM_CONF": "/nonexistent/slurm.conf"}  # no block is asked for
    configured = _cli(env, "endpoint", "configure", "hpc-ep", "--workers", "3", "--provider",
                      "slurm", "--partition", "debug", "--init-blocks", "0", "--min-blocks", "0",
                      "--agent-listen", "127.0.0.1:0")  # fmt: skip
    assert configured.returncode == 0, configured.stderr
    started = _cli(env, "endpoint", "start", "hpc-ep")
    assert started.returncode == 0, started.stderr
    try:
        deadline = time.monotonic() + 30
        while True:
            status = _cli(env, "endpoint", "status", "hpc-ep").stdout
            if "service: online" in status and "(up to " in status:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.3)
        assert "service: online, 0 workers (up to " in status, status  # its blocks' size
        [row] = [r for r in nimbus(service, "endpoints", "list").splitlines() if "hpc-ep" in r]
        assert " 0/" in row, row
    finally:
        _cli(env, "endpoint", "stop", "hpc-ep")


def test_a_port_in_use_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """`nimbus service start` and `nimbus dashboard` on a busy port: a usage error."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = service_env(tmp_path)
        for command in (["service", "start"], ["dashboard", "--user", "dana"]):
            proc = _cli(env, *command, "--port", str(port))
            assert proc.returncode == 2, proc.stderr
            assert proc.stderr == (
                f"nimbus {command[0]}{' start' if command[0] == 'service' else ''}: port {port} "
                "is in use (a service already runs there?): choose another with --port\n"
            )
            assert proc.stdout == ""  # no token made for the dashboard either
