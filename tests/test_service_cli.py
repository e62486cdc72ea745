"""The operator's commands against a real service: tokens, login, endpoint lifecycle, tasks."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from service_support import CLI, Service, service_env


def nimbus(service: Service, *args: str, timeout: float = 60) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", CLI, *args],
        env=service.env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
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


def test_bad_token_login_fails_cleanly(service: Service) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CLI, "login", "--service", service.url, "--token", "nimbus_bad"],
        env=service.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert "invalid token" in proc.stderr and "Traceback" not in proc.stderr


def test_persist_is_for_the_embedded_redis_only(tmp_path: Path) -> None:
    env = service_env(tmp_path, NIMBUS_REDIS_URL="redis://127.0.0.1:1")
    proc = subprocess.run(
        [sys.executable, "-c", CLI, "service", "start", "--port", "0", "--persist"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "--persist" in proc.stderr and "NIMBUS_REDIS_URL" in proc.stderr
    assert "Traceback" not in proc.stderr
