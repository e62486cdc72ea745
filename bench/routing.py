"""funcX's routing experiment in nimbus: warming-aware vs random routing vs an oracle.

A trace of tasks over environments (default 3,000 tasks over 4 environments,
drawn with weights 4:3:2:1, each a ``time.sleep`` of ``--ms``) runs on
``--nodes`` managers of ``--slots`` worker slots each, in this process, three
times in one run:

* ``warm``: the agent's warming-aware routing (``nimbus.runtime.routing``):
  warm workers of the task's environment first, then unused slots, then an idle
  worker of another environment switches, in proportion to pending work;
* ``random``: each task goes to a random free worker slot, which switches to
  the task's environment when it is not already in it (funcX's baseline);
* ``oracle``: knows the whole trace: lays the slots out before the first task
  (those starts are counted) so that the environment with the most tasks per
  slot has the fewest it can (D'Hondt), and never switches. The trace draws
  every task independently from one mix, so it has no phases: a layout that
  changed during the run could only gain the rounding of the static one, and
  would pay a worker start for it. The last line bounds every router from
  below: a worker start plus the work spread perfectly over every slot.

Every mode starts with no worker at all, and every worker start is a real one:
``--kind plain`` environments are named plain environments (a worker start
of the node's Python); ``--kind sandbox`` ones run under bubblewrap; ``--kind venv`` ones are
virtualenvs of one package each from a wheelhouse made here, built before the
runs (a worker start is then the virtualenv's Python starting). A *cold start* is a worker started; completion
is from the first submit to the last result. The last row compares a warm task
in an environment (``Executor(environment=...)``) with a warm task on today's
plain worker (an ``Executor`` with none): no-op round trips, alternated, median.

    python bench/routing.py                       # 3,000 tasks
    python bench/routing.py --tasks 600 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from nimbus import Environment, Executor  # noqa: E402
from nimbus.records import TaskRecord  # noqa: E402
from nimbus.runtime.agent import Agent  # noqa: E402
from nimbus.runtime.messages import Status  # noqa: E402
from nimbus.runtime.task import Task  # noqa: E402
from nimbus.serialization import FunctionCache, dumps  # noqa: E402

WEIGHTS = (4, 3, 2, 1)


VENV_PACKAGES = ("six==1.16.0", "idna==3.4", "iniconfig==2.0.0", "packaging==24.0")


def environments(kind: str, n: int, wheels: str | None = None) -> list[Environment]:
    if kind == "plain":
        return [Environment(f"env{i}") for i in range(n)]
    if kind == "sandbox":
        return [Environment(f"env{i}", sandbox=True) for i in range(n)]
    if kind == "venv":
        packages = [VENV_PACKAGES[i % len(VENV_PACKAGES)] for i in range(n)]
        return [
            Environment(f"env{i}", requirements=[p], wheelhouse=wheels)
            for i, p in enumerate(packages)
        ]
    raise SystemExit(f"--kind must be plain, sandbox or venv, not {kind!r}")


def venv_setup() -> str:
    """For ``--kind venv``: a private environments directory and a wheelhouse (from the
    package index); the virtualenvs are built before the runs, as on a node that
    built them once (every mode then starts workers in them, cold)."""
    tmp = tempfile.mkdtemp(prefix="nimbus-bench-routing-")
    os.environ["NIMBUS_ENVIRONMENTS_DIR"] = os.path.join(tmp, "environments")
    wheels = os.path.join(tmp, "wheels")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", wheels,
         *VENV_PACKAGES],
        check=True,
        timeout=300,
    )  # fmt: skip
    return wheels


def trace(envs: list[Environment], tasks: int, seed: int) -> list[Environment]:
    rng = random.Random(seed)
    weights = [WEIGHTS[i % len(WEIGHTS)] for i in range(len(envs))]
    return rng.choices(envs, weights=weights, k=tasks)


def oracle_layout(order: list[Environment], slots: int) -> list[Environment]:
    """The slots laid out to finish the whole trace soonest without switching: each
    next slot to the environment with the most tasks per slot (D'Hondt), which
    minimises the largest tasks-per-slot, i.e. the static layout's completion."""
    counts: dict[Environment, int] = {}
    for env in order:
        counts[env] = counts.get(env, 0) + 1
    share = dict.fromkeys(counts, 1)  # every environment needs a worker
    while sum(share.values()) < slots:
        env = max(counts, key=lambda e: counts[e] / share[e])
        share[env] += 1
    return [env for env, n in share.items() for _ in range(n)]


def lower_bound(tasks: int, args: argparse.Namespace, start: float, run: float) -> float:
    """Seconds no router can beat: every slot busy from its first worker start to the
    end, the work (each task ``run`` seconds, as the workers measured it) spread
    perfectly (no layout rounding, no dispatch cost)."""
    return start + tasks * run / (args.nodes * args.slots)


def run(mode: str, order: list[Environment], args: argparse.Namespace) -> dict[str, Any]:
    done = threading.Event()
    results: list[Task] = []
    lock = threading.Lock()

    def on_results(tasks: list[Task]) -> None:
        with lock:
            results.extend(tasks)
            if len(results) >= len(order):
                done.set()

    routing = {"warm": "warm", "random": "random", "oracle": "fixed"}[mode]
    agent = Agent(on_results=on_results, name=mode, routing=routing, seed=args.seed)
    layout = oracle_layout(order, args.nodes * args.slots) if mode == "oracle" else []
    key, body = FunctionCache().get(time.sleep)
    payload, buffers = dumps(((args.ms / 1000,), {}))
    tasks = [
        Task(i, key, body, payload, buffers, TaskRecord(str(i)), environment=env)
        for i, env in enumerate(order)
    ]
    began = time.monotonic()
    try:
        for n in range(args.nodes):
            warm = layout[n * args.slots : (n + 1) * args.slots]
            agent.add_manager(args.slots, prefetch=1, warm=warm)
        agent.submit(tasks)
        if not done.wait(args.limit):
            raise SystemExit(f"{mode}: {len(order) - len(results)} tasks unfinished")
        seconds = time.monotonic() - began
        cold = sum(m.statistics()["spawned"] for m in agent._managers)
        starts = [s for m in agent._managers if (s := m.costs()[1]) is not None]
        runs = [r for m in agent._managers if (r := m.costs()[0]) is not None]
    finally:
        agent.shutdown(kill=True)
    failed = sum(1 for t in results if t.status != Status.OK)
    start = statistics.mean(starts) if starts else 0.0
    return {
        "mode": mode,
        "seconds": seconds,
        "cold_starts": cold,
        "failed": failed,
        "worker_start": start,
        "task_run": statistics.mean(runs) if runs else args.ms / 1000,
    }


def warm_latency(env: Environment, repeat: int) -> dict[str, float]:
    """Median no-op round trip: a warm worker of an environment (``Executor(environment=)``)
    and today's plain worker (an ``Executor`` with no environment), alternated."""
    with Executor(1) as plain, Executor(1, environment=env) as typed:
        views = {"plain": plain, "environment": typed}
        for view in views.values():
            for _ in range(20):
                view.submit(int).result()
        samples: dict[str, list[float]] = {name: [] for name in views}
        for _ in range(repeat):
            for name, view in views.items():  # alternate: drift hits both alike
                t = time.perf_counter()
                view.submit(int).result()
                samples[name].append(time.perf_counter() - t)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--environments", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--slots", type=int, default=4, help="worker slots per node")
    parser.add_argument("--ms", type=float, default=20.0, help="each task sleeps this long")
    parser.add_argument("--kind", default="plain", help="plain, sandbox or venv environments")
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--limit", type=float, default=1800.0, help="seconds per mode at most")
    parser.add_argument("--modes", default="warm,random,oracle")
    parser.add_argument("--repeat", type=int, default=400, help="round trips for latency")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    wheels = venv_setup() if args.kind == "venv" else None
    try:
        return _main(args, environments(args.kind, args.environments, wheels))
    finally:
        if wheels is not None:
            shutil.rmtree(Path(wheels).parent, ignore_errors=True)


def _main(args: argparse.Namespace, envs: list[Environment]) -> int:
    from nimbus.environments import prepare

    for env in envs:  # built once per node before the runs (venv): every start is cold
        prepare(env)
    order = trace(envs, args.tasks, args.seed)
    rows = {}
    for mode in args.modes.split(","):
        print(f"running {mode} ...", file=sys.stderr, flush=True)
        rows[mode] = run(mode, order, args)
    latency = warm_latency(envs[0], args.repeat)
    print(
        f"{args.tasks} tasks x sleep({args.ms / 1000:g}) over {args.environments} {args.kind} "
        f"environments (weights {':'.join(map(str, WEIGHTS[: args.environments]))}), "
        f"{args.nodes} nodes x {args.slots} slots"
    )
    print(f"{'routing':8} {'completion':>11} {'cold starts':>12} {'failed':>7}")
    for row in rows.values():
        print(
            f"{row['mode']:8} {row['seconds']:10.2f}s {row['cold_starts']:12d} {row['failed']:7d}"
        )
    if "warm" in rows and "random" in rows:
        cut = 1 - rows["warm"]["seconds"] / rows["random"]["seconds"]
        print(f"warm vs random: {cut:.0%} shorter completion (target >= 61 %)")
    if "warm" in rows and "oracle" in rows:
        over = rows["warm"]["seconds"] / rows["oracle"]["seconds"] - 1
        print(f"warm vs oracle: {over:+.0%} (target within 10 %)")
    starts = [r["worker_start"] for r in rows.values() if r["worker_start"]]
    if starts:
        task_run = min(r["task_run"] for r in rows.values())
        bound = lower_bound(len(order), args, min(starts), task_run)
        print(
            f"lower bound (a worker start of {min(starts) * 1000:.0f} ms + {len(order)} tasks "
            f"of {task_run * 1000:.1f} ms spread over every slot): {bound:.2f}s; "
            + ", ".join(f"{m} {r['seconds'] / bound - 1:+.0%}" for m, r in rows.items())
        )
        rows_bound = {"lower_bound": bound}
    else:
        rows_bound = {}
    ratio = latency["environment"] / latency["plain"]
    print(
        f"warm task round trip: environment {latency['environment'] * 1e6:.0f} us, "
        f"plain {latency['plain'] * 1e6:.0f} us: {ratio:.2f}x (target <= 1.05x)"
    )
    if args.json:
        figures = {"rows": rows, "latency": latency, **rows_bound}
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
