"""What the dashboard benchmarks share: a real service in a subprocess, its users, the
login a browser does, and the timing of pages.

    root, env = isolated("nimbus-bench-dash-", NIMBUS_SERVICE_ADMINS="boss")
    service = Service(root, env, persist=True)
    service.start()                     # seconds until it serves
    token, user_id = new_user(Settings.load(env), "bench")
    http = login(service.url, token)    # the session cookie, as from the form
    ms(timed(http, "/tasks", 50), 0.95)
    service.stop()
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

PROFILE = os.environ.get("BENCH_PROFILE", "").split()  # e.g. "-m cProfile -o FILE"


def isolated(prefix: str, **variables: str) -> tuple[Path, dict[str, str]]:
    """A fresh directory and the environment of a service and its clients kept in it
    (no ``NIMBUS_*`` of this shell; ``variables`` added), also set in this process."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIMBUS_")}
    env.update(NIMBUS_RUNTIME_DIR=str(root / "rt"), XDG_CONFIG_HOME=str(root / "cfg"), **variables)
    os.environ.update({k: env[k] for k in ("XDG_CONFIG_HOME", "NIMBUS_RUNTIME_DIR")})
    return root, env


class Service:
    """``nimbus service start`` (``--persist``: its embedded Redis kept on disk) in
    ``root``, and that Redis."""

    def __init__(self, root: Path, env: dict[str, str], *, persist: bool = False) -> None:
        self.root, self.env, self.persist = root, env, persist
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> float:
        """Start it; the seconds until it serves."""
        url_file = self.root / "url"
        url_file.unlink(missing_ok=True)
        cmd = [sys.executable, *PROFILE, "-m", "nimbus", "service", "start", "--port", "0"]
        if self.persist:
            cmd.append("--persist")
        started = time.perf_counter()
        with open(self.root / "service.log", "ab") as log:
            self.proc = subprocess.Popen(
                [*cmd, "--url-file", str(url_file)], env=self.env, stdout=log, stderr=log
            )
        deadline = time.monotonic() + 300
        while not url_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((self.root / "service.log").read_text()[-2000:])
            time.sleep(0.05)
        self.url = url_file.read_text().strip()
        return time.perf_counter() - started

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(120)

    def redis_state(self) -> dict[str, Any]:
        [path] = glob.glob(str(self.root / "rt" / "redis-*.json"))
        state: dict[str, Any] = json.loads(Path(path).read_text())
        return state

    def processes(self) -> list[psutil.Process]:
        """The service's process and its Redis's."""
        assert self.proc is not None
        return [psutil.Process(self.proc.pid), psutil.Process(self.redis_state()["server"][0])]

    def redis(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=self.redis_state()["socket"])


def new_user(settings: Any, name: str) -> tuple[str, str]:
    """A token of a new user ``name`` of the service's registry, and the user's id."""
    from nimbus.service.registry import Registry

    registry = Registry(settings.registry_url)
    try:
        token = registry.create_user_token(name)
        user = registry.principal(token)
        assert user is not None
        return token, user.user_id
    finally:
        registry.close()


def login(url: str, token: str) -> httpx.Client:
    """A client logged in to the dashboard through its form, as a browser does."""
    http = httpx.Client(base_url=url, timeout=120)
    csrf = re.search(r'name="csrf" value="([^"]+)"', http.get("/login").text)
    assert csrf is not None
    response = http.post("/login", data={"token": token, "csrf": csrf[1]})
    assert response.status_code == 303, response.text
    return http


def timed(http: httpx.Client, path: str, n: int) -> list[float]:
    """The seconds of ``n`` GETs of ``path``, one after another."""
    out = []
    for _ in range(n):
        start = time.perf_counter()
        response = http.get(path)
        out.append(time.perf_counter() - start)
        response.raise_for_status()
    return out


def ms(values: list[float], q: float) -> str:
    """The ``q`` quantile of ``values`` (seconds), in milliseconds."""
    values = sorted(values)
    return f"{values[min(len(values) - 1, int(q * len(values)))] * 1000:.0f} ms"
