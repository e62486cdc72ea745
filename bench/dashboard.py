"""The dashboard with many task records: page latency, first render, a task appearing live.

Starts a real service (uvicorn, SQLite, embedded Redis) in a subprocess,
submits ``--tasks`` tasks to an endpoint that never comes online (they stay
queued: records the tasks page must page through), logs in through the form as
a browser does, then measures from this process:

    tasks p50/p95    GET /tasks (first page of 50, rendered), repeated
    deep page        GET /tasks?after=<a cursor near the oldest task>
    endpoints        GET /
    metrics          GET /metrics
    live             submit one task -> its row's event on an open /tasks/stream

    python bench/dashboard.py                 # 100,000 tasks
    python bench/dashboard.py --tasks 10000   # a smoke run

Not yet measured (issue 20): 1,000,000 records with 1,000 events/s arriving,
the service CPU added by an open page, memory after a restart.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402

sys.path.append(str(_HERE))  # after the stdlib: for _report
from _report import grid  # noqa: E402

CLI = "import sys; from nimbus.cli import main; sys.exit(main())"
BATCH = 5_000


def noop() -> None:
    """Never runs: its endpoint stays offline."""


def start(root: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    url_file = root / "url"
    cmd = [sys.executable, "-c", CLI, "service", "start", "--port", "0"]
    with open(root / "service.log", "ab") as log:
        proc = subprocess.Popen(
            [*cmd, "--url-file", str(url_file)], env=env, stdout=log, stderr=log
        )
    deadline = time.monotonic() + 60
    while not url_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError((root / "service.log").read_text()[-2000:])
        time.sleep(0.05)
    return proc, url_file.read_text().strip()


def timed(http: httpx.Client, path: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        response = http.get(path)
        out.append(time.perf_counter() - start)
        response.raise_for_status()
    return out


def ms(values: list[float], q: float) -> str:
    values = sorted(values)
    return f"{values[min(len(values) - 1, int(q * len(values)))] * 1000:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="nimbus-bench-dash-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIMBUS_")}
    env.update(
        NIMBUS_RUNTIME_DIR=str(root / "rt"),
        XDG_CONFIG_HOME=str(root / "cfg"),
        NIMBUS_MAX_QUEUED_TASKS=str(args.tasks + 1000),
    )
    os.environ.update({k: env[k] for k in ("XDG_CONFIG_HOME", "NIMBUS_RUNTIME_DIR")})
    proc, url = start(root, env)
    try:
        from nimbus.client import Client
        from nimbus.config import Settings
        from nimbus.service.registry import Registry

        registry = Registry(Settings.load(env).registry_url)
        token = registry.create_user_token("bench")
        registry.close()
        with Client(url, token, settings=Settings.load(env)) as client:
            client.register_endpoint("offline")
            filled = time.perf_counter()
            oldest = 0.0
            for done in range(0, args.tasks, BATCH):
                client.batch_run(noop, [()] * min(BATCH, args.tasks - done), endpoint="offline")
                oldest = oldest or time.time()  # after the first batch's score, before the next
            filled = time.perf_counter() - filled
            with httpx.Client(base_url=url, timeout=60) as http:
                form = http.get("/login").text
                csrf = re.search(r'name="csrf" value="([^"]+)"', form)
                assert csrf is not None
                login = http.post("/login", data={"token": token, "csrf": csrf[1]})
                assert login.status_code == 303, login.text
                first = timed(http, "/tasks", 1)
                tasks = timed(http, "/tasks", args.repeat)
                deep_cursor = f"{oldest!r}~g"  # in the oldest batch: 'g' sorts after every id
                deep = timed(http, f"/tasks?after={deep_cursor}", max(5, args.repeat // 5))
                endpoints = timed(http, "/", args.repeat)
                metrics = timed(http, "/metrics", max(5, args.repeat // 5))
                live = []
                for _ in range(5):
                    with http.stream("GET", "/tasks/stream") as stream:
                        lines = stream.iter_lines()
                        for line in lines:  # the stream first sends the window it sees
                            if line.startswith("retry"):
                                break
                        time.sleep(0.5)
                        t0 = time.perf_counter()
                        [task_id] = client.batch_run(noop, [()], endpoint="offline")
                        for line in lines:
                            if line.startswith("data:") and task_id in line:
                                live.append(time.perf_counter() - t0)
                                break
        rows = [
            ("records stored", f"{args.tasks:,}", f"submitted in {filled:.1f} s"),
            ("tasks page, first render", ms(first, 0.5), ""),
            ("tasks page p50 / p95", ms(tasks, 0.5), ms(tasks, 0.95)),
            ("tasks page in the oldest batch, p95", ms(deep, 0.95), ""),
            ("endpoints page p95", ms(endpoints, 0.95), ""),
            ("metrics p95", ms(metrics, 0.95), ""),
            ("a new task on an open page, max", f"{max(live) * 1000:.0f} ms", f"{len(live)} runs"),
        ]
        print(grid(("workload", "figure", ""), rows))
        print(f"(median tasks page {statistics.median(tasks) * 1000:.1f} ms)")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


if __name__ == "__main__":
    main()
