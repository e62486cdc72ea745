"""The dashboard at the issue's scale: 1,000,000 task records, 1,000 new events/s.

Starts a real service (uvicorn, SQLite, the embedded Redis kept on disk with
``--persist``) in a subprocess and stores ``--records`` finished task records
in its SQL history directly (``nimbus.service.history``, as the flusher writes
them), ``FILL`` at a time: the history the pages read, without running a
million tasks. Then, while ``--rate`` new tasks a second arrive through the
service's submit API (to an endpoint that stays offline), it measures from this
process:

    first render        the first GET /tasks after the records were stored
    tasks p50/p95       GET /tasks (first page of 50, rendered), repeated
    deep page           GET /tasks?after=<a cursor among the oldest records>
    CPU                 service + its Redis, one /tasks/stream open vs none: a
                        user's page (the arrivals are other users'), an admin's (all)
                        (side by side, alternated, ``--seconds`` each)
    live                submit one task -> its row's event on an open stream
    memory              the service's and its Redis's resident memory, the SQLite file
    restart             stop the service, start it again: records still there,
                        first render and p95 again

    python bench/dashboard.py                      # 1,000,000 records, 1,000/s
    python bench/dashboard.py --records 20000      # a smoke run
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import shutil  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402
import msgpack  # noqa: E402
import psutil  # noqa: E402

sys.path.append(str(_HERE))  # after the stdlib: for _report, _dashboard
from _dashboard import Service, isolated, login, ms, new_user, timed  # noqa: E402
from _report import grid  # noqa: E402

FILL = 10_000  # records stored by one script call


def noop() -> None:
    """Never runs: its endpoint stays offline."""


def cpu(processes: list[psutil.Process]) -> float:
    return sum(t.user + t.system for t in (p.cpu_times() for p in processes))


def _arrive(url: str, token: str, rate: float, halt: Any, sent: Any) -> None:
    """One sender process's loop: ``rate`` tasks a second, 10 batches a second."""
    from nimbus.client import Client
    from nimbus.config import Settings

    client = Client(url, token, settings=Settings.load())
    per = max(1, int(rate // 10))
    began, mine = time.monotonic(), 0
    while not halt.is_set():
        client.batch_run(noop, [()] * per, endpoint="offline")
        mine += per
        with sent.get_lock():
            sent.value += per
        ahead = began + mine / rate - time.monotonic()
        if ahead > 0:
            halt.wait(ahead)
    client.close()


class Arrivals:
    """``rate`` new tasks a second through the service's submit API, from ``PROCESSES``
    sender processes (not threads of this one: their work would hold this process's GIL
    while it times a page, adding their time to the page's), each sending 10 batches a
    second."""

    PROCESSES = 2

    def __init__(self, url: str, token: str, rate: int) -> None:
        spawn = multiprocessing.get_context("spawn")
        self.halt = spawn.Event()
        self.sent = spawn.Value("q", 0)
        per = rate / self.PROCESSES
        self.procs = [
            spawn.Process(target=_arrive, args=(url, token, per, self.halt, self.sent))
            for _ in range(self.PROCESSES if rate else 0)
        ]
        self.began = self.ended = 0.0

    def start(self) -> None:
        self.began = time.monotonic()
        for proc in self.procs:
            proc.start()

    def stop(self) -> float:
        """Stop; the rate reached (tasks a second)."""
        self.halt.set()
        for proc in self.procs:
            proc.join(60)
        self.ended = time.monotonic()
        return self.total / max(1e-9, self.ended - self.began) if self.procs else 0.0

    @property
    def total(self) -> int:
        return int(self.sent.value)


class Reader(threading.Thread):
    """An open /tasks/stream, read as a browser reads it."""

    def __init__(self, http: httpx.Client) -> None:
        super().__init__(daemon=True)
        self.http = http
        self.arrived: dict[str, float] = {}  # task id -> when its first event came
        self.halt = threading.Event()

    def run(self) -> None:
        try:
            with self.http.stream("GET", "/tasks/stream") as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: "):
                        task_id = json.loads(line[6:])["task_id"]
                        self.arrived.setdefault(task_id, time.perf_counter())
                    if self.halt.is_set():
                        return
        except httpx.HTTPError:
            if not self.halt.is_set():
                raise

    def wait(self, task_id: str, timeout: float) -> float | None:
        end = time.perf_counter() + timeout
        while time.perf_counter() < end:
            if task_id in self.arrived:
                return self.arrived[task_id]
            time.sleep(0.005)
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--rate", type=int, default=1_000, help="new tasks a second")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=10.0, help="per CPU sample")
    args = parser.parse_args()
    root, env = isolated(
        "nimbus-bench-dash-",
        NIMBUS_MAX_QUEUED_TASKS=str(10_000_000),
        NIMBUS_SERVICE_ADMINS="boss",  # whose pages show every user's tasks
    )
    service = Service(root, env, persist=True)
    service.start()
    rows: list[tuple[str, str, str]] = []
    try:
        from nimbus.client import Client
        from nimbus.config import Settings
        from nimbus.records import TaskRecord, TaskState
        from nimbus.service.app import SERVICE_ID
        from nimbus.statestore import Keys

        settings = Settings.load(env)
        token, user_id = new_user(settings, "bench")
        client = Client(service.url, token, settings=settings)
        other_token, _ = new_user(settings, "others")
        other = Client(service.url, other_token, settings=settings)
        other.register_endpoint("offline")
        other.close()
        endpoint_id = client.register_endpoint("offline")["endpoint_id"]
        function_id = client.register_function(noop)
        keys = Keys(SERVICE_ID)
        now = time.time()
        record = TaskRecord("x", TaskState.SUCCESS, "noop", "endpoint/offline/w0", "node1")
        record.submitted, record.started, record.ended = now, now, now + 0.01
        record_bytes = msgpack.packb(record.to_wire())
        result = msgpack.packb([0, msgpack.packb(None), []])
        store = service.redis()
        from sqlalchemy.engine import make_url

        from nimbus.service.history import History
        from nimbus.service.registry import Registry

        registry = Registry(settings.registry_url)
        history = History(registry.engine)
        filled = time.perf_counter()
        for first in range(0, args.records, FILL):  # in the SQL history, as the flusher writes
            batch = []
            for i in range(first, min(first + FILL, args.records)):
                t = now - (args.records - i) * 0.002
                batch.append((f"00000000-0000-4000-8000-{i:012x}", user_id, endpoint_id,
                              function_id, "", "success", t, t + 0.001, t + 0.011, None,
                              result, record_bytes))  # fmt: skip
            history.write(batch)
        filled = time.perf_counter() - filled
        registry.close()
        database = Path(make_url(settings.registry_url).database or "")
        rows.append(("records stored", f"{args.records:,}", f"in {filled:.1f} s (SQL, bulk)"))

        arrivals = Arrivals(service.url, other_token, args.rate)  # other users' tasks
        arrivals.start()
        http = login(service.url, token)
        first_render = timed(http, "/tasks", 1)
        tasks = timed(http, "/tasks", args.repeat)
        deep = timed(http, f"/tasks?after={now - (args.records - 5) * 0.002!r}~g", 10)
        rows += [
            ("tasks page, first render", ms(first_render, 0.5), "target <= 1 s"),
            ("tasks page p50 / p95", f"{ms(tasks, 0.5)} / {ms(tasks, 0.95)}", "p95 <= 200 ms"),
            ("tasks page among the oldest, p95", ms(deep, 0.95), ""),
        ]

        procs = service.processes()
        boss, _ = new_user(settings, "boss")
        samples: dict[str, list[float]] = {"none": [], "open": [], "admin": []}
        for _ in range(2):
            for kind in samples:
                reader = (
                    None
                    if kind == "none"
                    else Reader(login(service.url, boss if kind == "admin" else token))
                )
                if reader is not None:
                    reader.start()
                    time.sleep(1.0)
                before, t0 = cpu(procs), time.perf_counter()
                time.sleep(args.seconds)
                samples[kind].append((cpu(procs) - before) / (time.perf_counter() - t0))
                if reader is not None:
                    reader.halt.set()
                    reader.http.close()
        none, opened, admin = (sum(samples[k]) / len(samples[k]) for k in samples)
        rows += [
            (
                "service CPU, one page open vs none",
                f"+{(opened - none) * 100:.1f} % of a core",
                f"{opened * 100:.0f} % vs {none * 100:.0f} % (service + Redis; target +5 %)",
            ),
            (
                "the same, the admin's page (every task)",
                f"+{(admin - none) * 100:.1f} % of a core",
                f"{admin * 100:.0f} % vs {none * 100:.0f} %",
            ),
        ]

        reader = Reader(login(service.url, token))
        reader.start()
        time.sleep(1.0)
        live = []
        for _ in range(5):
            t0 = time.perf_counter()
            [task_id] = client.batch_run(noop, [()], endpoint="offline")
            if (came := reader.wait(task_id, 10)) is not None:
                live.append(came - t0)
            time.sleep(0.3)
        reader.halt.set()
        rows.append(
            ("a new task on an open page, max", ms(live, 1.0), f"{len(live)}/5 seen; target 1 s")
        )
        reached = arrivals.stop()
        rows.append(
            ("new tasks arriving meanwhile", f"{reached:.0f}/s", f"asked {args.rate}/s, "
             f"{arrivals.total:,} in all")
        )  # fmt: skip

        service_rss, redis_rss = (p.memory_info().rss for p in procs)
        used = store.info("memory")["used_memory"]
        rows.append(
            (
                "memory with the records",
                f"service {service_rss / 2**20:.0f} MB",
                f"its Redis {redis_rss / 2**20:.0f} MB RSS ({used / 2**20:.0f} MB used)",
            )
        )
        disk = sum(f.stat().st_size for f in database.parent.glob(database.name + "*"))
        rows.append(("SQLite registry + history on disk", f"{disk / 2**20:.0f} MB", ""))
        store.close()
        http.close()
        client.close()

        service.stop()
        restart = service.start()
        store = service.redis()
        registry = Registry(settings.registry_url)
        kept = History(registry.engine).count() + store.zcard(keys.all_tasks())
        registry.close()
        http = login(service.url, token)
        first_render = timed(http, "/tasks", 1)
        tasks = timed(http, "/tasks", args.repeat)
        service_rss, redis_rss = (p.memory_info().rss for p in service.processes())
        rows += [
            ("after a restart: records", f"{kept:,}", f"service up in {restart:.1f} s"),
            ("after a restart: first render", ms(first_render, 0.5), ""),
            ("after a restart: p95", ms(tasks, 0.95), ""),
            ("after a restart: memory",
             f"service {service_rss / 2**20:.0f} MB", f"its Redis {redis_rss / 2**20:.0f} MB"),
        ]  # fmt: skip
        store.close()
        http.close()
    finally:
        print(grid(("workload", "figure", ""), rows))
        service.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
