"""The dashboard's endpoint, task, timeline and directory pages with many task records.

Starts a real service (uvicorn, SQLite, embedded Redis) and a real endpoint daemon
(2 workers) in subprocesses, runs ``--tasks`` no-op tasks through an
``Executor.map`` (each leaves its record: the timeline's bars), publishes a
messaging directory of 20 instances in the user's programs' store, logs in
through the form as a browser does, then times from this process (p50 / p95 of
``--repeat`` requests each):

    endpoints         GET /
    endpoint          GET /endpoints/{id}    (its status, managers, workers)
    task              GET /tasks/{id}        (a done task: record and output)
    timeline          GET /timeline          (the newest 1,000 tasks' bars)
    timeline, batch   GET /timeline?group=   (one batch's first 1,000)
    timeline PNG      GET /timeline.png      (matplotlib, 1,000 bars)
    directory         GET /directory

    python bench/dashboard_pages.py                 # 10,000 tasks
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import contextlib  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

sys.path.append(str(_HERE))  # after the stdlib: for _report, _dashboard
from _dashboard import Service, isolated, login, ms, new_user, timed  # noqa: E402
from _report import grid  # noqa: E402


def noop(i: int) -> int:
    return i


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=40)
    args = parser.parse_args()
    root, env = isolated(
        "nimbus-bench-pages-",
        NIMBUS_MAX_QUEUED_TASKS=str(args.tasks + 1000),
        NIMBUS_HEARTBEAT="0.5",
    )
    service = Service(root, env)
    service.start()
    url = service.url
    daemon: subprocess.Popen[bytes] | None = None
    try:
        from nimbus import Executor
        from nimbus.client import Client
        from nimbus.config import Settings
        from nimbus.endpoint.config import EndpointConfig
        from nimbus.messaging import Directory, Entry
        from nimbus.statestore import Keys, connect

        token, _ = new_user(Settings.load(env), "bench")
        settings = Settings.load(env | {"NIMBUS_SERVICE_URL": url, "NIMBUS_TOKEN": token})
        with Client(url, token, settings=Settings.load(env)) as client:
            ep = client.register_endpoint("lab")
            EndpointConfig("lab", url, ep["endpoint_id"], ep["token"], workers=2).save()
            with open(root / "agent.log", "ab") as log:
                daemon = subprocess.Popen(
                    [sys.executable, "-m", "nimbus.endpoint.daemon", "lab"],
                    env=env,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            while not client.get_endpoint(ep["endpoint_id"])["online"]:
                time.sleep(0.1)
            filled = time.perf_counter()
            with Executor(endpoint="lab", settings=settings) as ex:
                assert list(ex.map(noop, range(args.tasks))) == list(range(args.tasks))
            filled = time.perf_counter() - filled
            [task_id] = client.batch_run(noop, [(7,)], endpoint="lab")
            client.get_result(task_id, timeout=60)
            store = client.store("lab")
            redis = connect(store["url"], own=True)
            keys = Keys(f"{store['key_prefix']}.{Keys.new_name()}")
            directory = Directory(lambda: redis, keys, ttl_ms=600_000)
            for i in range(20):
                directory.set_local(f"inst-{i}", Entry("host/boot", 1000 + i, f"/s/{i}", None))
            directory.publish()
            with contextlib.closing(login(url, token)) as http:
                listed = client.list_tasks(limit=2)  # the newest but one: of the map
                group = listed[-1].get("group_id", "") if len(listed) == 2 else ""
                paths = [
                    ("endpoints", "/", args.repeat),
                    ("endpoint", f"/endpoints/{ep['endpoint_id']}", args.repeat),
                    ("task", f"/tasks/{task_id}", args.repeat),
                    ("timeline (newest 1,000)", "/timeline", args.repeat),
                    ("timeline PNG (1,000 bars)", "/timeline.png", max(5, args.repeat // 4)),
                    ("directory (20 instances)", "/directory", args.repeat),
                ]
                if group:
                    paths.insert(4, ("timeline of one batch", f"/timeline?group={group}", 10))
                rows = [("records stored", f"{args.tasks + 1:,}", f"ran in {filled:.1f} s", "")]
                for name, path, n in paths:
                    first = timed(http, path, 1)
                    took = timed(http, path, n)
                    rows.append((name, ms(took, 0.5), ms(took, 0.95), ms(first, 0.5)))
            redis.delete(keys.directory())
        print(grid(("page", "p50", "p95", "first"), rows))
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(30)
        service.stop()


if __name__ == "__main__":
    main()
