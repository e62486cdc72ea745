"""nimbus on Slurm beside Parsl's HighThroughputExecutor with its SlurmProvider, one run.

::

    sudo python bench/providers.py [--quick] [--no-parsl] [--json out.json]

Starts the tests' private Slurm cluster (``tests/slurm_support.py``: munged,
slurmctld, slurmd n1..n4 on this machine; root only), then measures on it:

* first task with 0 blocks -> its result (nimbus: the task asks for a block at
  once; Parsl: its strategy tick, ``strategy_period`` 5 s), p50 and p95;
* 10,000 no-op tasks over 4 single-node blocks (2 workers each), tasks/s;
* churn: tasks of 0.2-1 s through blocks with a 30 s walltime and a block
  scancelled mid-run: failed, lost, duplicate results (nimbus);
* idle blocks: seconds from the last result to every block cancelled, against
  ``max_idle`` (nimbus);
* a killed slurmd under load: seconds to the lost manager, tasks all done;
* scheduler load: ``squeue`` calls per status period with 4 blocks (a shim on
  PATH counts them);
* ``mp.Pool(16)`` map over 4 nodes vs 1 node (report).

Parsl lives in its own venv (``bench/.venv-parsl``, as ``bench/_htex.py``
makes it); its side runs in a subprocess of that venv's python, which runs this
file with ``--parsl-driver``. Only the stdlib at the top: that python imports
this file too.
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/multiprocessing.py sits beside this file: keep this directory off sys.path,
# or parsl's ``import multiprocessing`` (in the driver) would import it
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

ROOT = HERE.parent
PARSL_VENV = HERE / ".venv-parsl"


def noop(*args: object) -> None:
    return None


def sleepy(i: int, seconds: float, log: str) -> int:
    import os
    import time

    with open(log, "a") as f:  # one line per run: a task that ran twice has two
        f.write(f"{i} {os.environ.get('SLURMD_NODENAME', '?')}\n")
    time.sleep(seconds)
    return i


# ---------------------------------------------------------------- Parsl side


def parsl_driver(op: str, n: int, partition: str) -> dict[str, Any]:
    import parsl
    from parsl.config import Config
    from parsl.executors import HighThroughputExecutor
    from parsl.launchers import SingleNodeLauncher
    from parsl.providers import SlurmProvider

    run_dir = tempfile.mkdtemp(prefix="parsl-bench-")
    path = os.environ["PATH"]
    if op == "first":  # each try a fresh DFK with 0 blocks, Parsl's default strategy
        times = []
        for i in range(n):
            htex = HighThroughputExecutor(
                label="htex",
                address="127.0.0.1",
                max_workers_per_node=2,
                provider=SlurmProvider(
                    partition=partition,
                    init_blocks=0,
                    min_blocks=0,
                    max_blocks=1,
                    nodes_per_block=1,
                    walltime="00:10:00",
                    launcher=SingleNodeLauncher(),
                    worker_init=f"export PATH={path}",
                ),
            )
            config = Config(executors=[htex], run_dir=f"{run_dir}/{i}", strategy="simple")
            dfk = parsl.load(config)
            try:

                @parsl.python_app
                def app() -> None:
                    return None

                t0 = time.monotonic()
                app().result(timeout=600)
                times.append(time.monotonic() - t0)
            finally:
                dfk.cleanup()
                parsl.clear()
            time.sleep(3)  # its block cancelled, the node idle again
        return {"first": times, "parsl": parsl.__version__}
    # throughput over 4 single-node blocks, HTEX driven directly (as Globus Compute does)
    htex = HighThroughputExecutor(
        label="htex",
        address="127.0.0.1",
        max_workers_per_node=2,
        provider=SlurmProvider(
            partition=partition,
            init_blocks=4,
            min_blocks=4,
            max_blocks=4,
            nodes_per_block=1,
            exclusive=True,
            walltime="00:10:00",
            launcher=SingleNodeLauncher(),
            worker_init=f"export PATH={path}",
        ),
    )
    htex.run_dir = run_dir
    htex.provider.script_dir = os.path.join(run_dir, "submit_scripts")
    os.makedirs(htex.provider.script_dir, exist_ok=True)
    htex.start()
    try:
        htex.scale_out_facade(4)
        deadline = time.monotonic() + 180
        while sum(m["worker_count"] for m in htex.connected_managers()) < 8:
            if time.monotonic() > deadline:
                raise RuntimeError("HTEX workers did not connect in 180 s")
            time.sleep(0.1)
        for f in [htex.submit(noop, {}) for _ in range(200)]:
            f.result(timeout=120)
        t0 = time.monotonic()
        futures = [htex.submit(noop, {}) for _ in range(n)]
        for f in futures:
            f.result(timeout=600)
        return {"throughput": n / (time.monotonic() - t0), "parsl": parsl.__version__}
    finally:
        try:
            htex.scale_in_facade(4)
        finally:
            htex.shutdown()


def run_parsl(op: str, n: int, partition: str) -> dict[str, Any]:
    python = PARSL_VENV / "bin" / "python"
    if not python.exists():
        return {"error": f"no Parsl venv at {PARSL_VENV} (see bench/_htex.py ensure_venv)"}
    env = {**os.environ, "PATH": f"{python.parent}:{os.environ['PATH']}"}
    cmd = [str(python), __file__, "--parsl-driver", op, "--n", str(n), "--partition", partition]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-800:]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# ---------------------------------------------------------------- nimbus side


def settings(cluster: Any, **changes: Any) -> Any:
    from nimbus.config import Settings

    base = {
        "provider": "slurm",
        "partition": cluster.partition,
        "workers_per_node": 2,
        "walltime": "00:10:00",
        "agent_listen": "127.0.0.1:0",
        "max_blocks": 4,
    }
    return Settings.load().replace(**{**base, **changes})


def wait_managers(ex: Any, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(ex._backend.agent.remote_managers()) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{n} managers did not join in {timeout} s")
        time.sleep(0.05)


def nimbus_first(cluster: Any, tries: int) -> list[float]:
    from nimbus import Executor

    times = []
    for _ in range(tries):
        with Executor(settings=settings(cluster, max_blocks=1)) as ex:
            t0 = time.monotonic()
            ex.submit(noop).result(timeout=120)
            times.append(time.monotonic() - t0)
        cluster.wait_idle(60)
    return times


def nimbus_throughput(cluster: Any, n: int) -> tuple[float, dict[str, Any]]:
    from nimbus import Executor

    s = settings(cluster, min_blocks=4, init_blocks=4, exclusive=True, max_idle=600.0)
    with Executor(settings=s) as ex:
        wait_managers(ex, 4)
        for f in [ex.submit(noop) for _ in range(200)]:
            f.result(timeout=60)
        calls0, t0 = ex._backend.scaler.status_calls, time.monotonic()
        futures = [ex.submit(noop) for _ in range(n)]
        for f in futures:
            f.result(timeout=600)
        elapsed = time.monotonic() - t0
        time.sleep(max(0.0, 6 - elapsed))  # at least three status periods with 4 blocks
        window = time.monotonic() - t0
        calls = ex._backend.scaler.status_calls - calls0
    load = {"status_calls": calls, "seconds": round(window, 1), "blocks": 4}
    return n / elapsed, load


def nimbus_churn(cluster: Any, n: int, log: Path) -> dict[str, Any]:
    from nimbus import Executor

    s = settings(cluster, walltime="00:00:30", max_blocks=4, exclusive=True, max_idle=3.0)
    rng = random.Random(17)
    failed = 0
    with Executor(settings=s) as ex:
        futures = [ex.submit(sleepy, i, rng.uniform(0.2, 1.0), str(log)) for i in range(n)]
        time.sleep(6)
        managers = ex._backend.agent.remote_managers()
        if managers:
            cluster.run("scancel", managers[0].block, check=False)  # forced scale-in
        results = []
        for f in futures:
            try:
                results.append(f.result(timeout=600))
            except Exception:
                failed += 1
        stats = ex._backend.scaler.statistics()
    runs = [int(line.split()[0]) for line in log.read_text().splitlines()]
    return {
        "tasks": n,
        "failed": failed,
        "lost": n - len(results) - failed,
        "wrong": sum(r != i for i, r in enumerate(results)),
        "ran_twice": len(runs) - len(set(runs)),
        "blocks_submitted": stats["submitted"],
    }


def nimbus_idle(cluster: Any, max_idle: float) -> float:
    from nimbus import Executor

    with Executor(settings=settings(cluster, max_blocks=2, max_idle=max_idle)) as ex:
        list(ex.map(noop, range(100)))
        t0 = time.monotonic()
        while ex._backend.scaler.blocks:
            if time.monotonic() - t0 > max_idle + 60:
                break
            time.sleep(0.05)
        return time.monotonic() - t0


def nimbus_killed_slurmd(cluster: Any) -> dict[str, Any]:
    from nimbus import Executor

    s = settings(cluster, min_blocks=2, init_blocks=2, exclusive=True, max_idle=600.0)
    with Executor(settings=s) as ex:
        wait_managers(ex, 2)
        futures = [ex.submit(time.sleep, 0.3) for _ in range(60)]
        time.sleep(1)
        victim = ex._backend.agent.remote_managers()[0]
        t0 = time.monotonic()
        cluster.kill_slurmd(victim.node)
        try:
            while not ex._backend.agent.lost and time.monotonic() - t0 < 30:
                time.sleep(0.01)
            detected = time.monotonic() - t0
            done = sum(1 for f in futures if f.exception(timeout=120) is None)
        finally:
            cluster.restart_slurmd(victim.node)
        requeued = ex._backend.agent.lost[0][2] if ex._backend.agent.lost else 0
    cluster.wait_idle(90)
    return {"lost_detected_s": round(detected, 2), "done": done, "of": 60, "requeued": requeued}


POOL_PROGRAM = """
import time, nimbus.multiprocessing as mp
def work(x):
    s = 0
    for i in range(300_000):
        s += i
    return s
if __name__ == "__main__":
    with mp.Pool(16) as pool:
        pool.map(work, range(16))
        t0 = time.monotonic()
        pool.map(work, range(256))
        print("SECONDS", time.monotonic() - t0)
"""


def nimbus_pool(cluster: Any, blocks: int) -> float:
    program = Path(tempfile.mkdtemp()) / "pool.py"
    program.write_text(POOL_PROGRAM)
    env = {
        **os.environ,
        "NIMBUS_PROVIDER": "slurm",
        "NIMBUS_PARTITION": cluster.partition,
        "NIMBUS_WORKERS_PER_NODE": str(16 // blocks),
        "NIMBUS_EXCLUSIVE": "yes",
        "NIMBUS_MIN_BLOCKS": str(blocks),
        "NIMBUS_INIT_BLOCKS": str(blocks),
        "NIMBUS_MAX_BLOCKS": str(blocks),
        "NIMBUS_AGENT_LISTEN": "127.0.0.1:0",
    }
    done = subprocess.run(
        [sys.executable, str(program)], env=env, capture_output=True, text=True, timeout=600
    )
    for line in done.stdout.splitlines():
        if line.startswith("SECONDS"):
            return float(line.split()[1])
    raise RuntimeError(f"the Pool program failed: {done.stderr[-800:]}")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    parser.add_argument("--no-parsl", action="store_true", help="nimbus only")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--parsl-driver", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--partition", default="debug", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.parsl_driver:
        print(json.dumps(parsl_driver(args.parsl_driver, args.n, args.partition)), flush=True)
        return 0
    sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]
    from slurm_support import Cluster, unavailable

    why = unavailable()
    if why:
        print(f"bench/providers.py: {why}", file=sys.stderr)
        return 2
    tries, tasks, churn = (3, 2000, 60) if args.quick else (7, 10_000, 300)
    root = Path(tempfile.mkdtemp(prefix="nimbus-bench-slurm-"))
    cluster = Cluster(root).start()
    os.environ["SLURM_CONF"] = str(cluster.conf)
    os.environ["XDG_CONFIG_HOME"] = str(root / "config")  # the blocks' output goes there
    out: dict[str, Any] = {}
    try:
        out["first_nimbus"] = nimbus_first(cluster, tries)
        out["throughput_nimbus"], out["scheduler_load"] = nimbus_throughput(cluster, tasks)
        cluster.wait_idle(60)
        if not args.no_parsl:
            out["parsl_first"] = run_parsl("first", tries, cluster.partition)
            cluster.run("scancel", "--user", "root", check=False)
            cluster.wait_idle(60)
            out["parsl_throughput"] = run_parsl("throughput", tasks, cluster.partition)
            cluster.run("scancel", "--user", "root", check=False)
            cluster.wait_idle(60)
        out["churn"] = nimbus_churn(cluster, churn, root / "runs.log")
        cluster.wait_idle(60)
        out["idle_seconds"], out["max_idle"] = nimbus_idle(cluster, 5.0), 5.0
        out["killed_slurmd"] = nimbus_killed_slurmd(cluster)
        out["pool_4_nodes"] = nimbus_pool(cluster, 4)
        cluster.wait_idle(60)
        out["pool_1_node"] = nimbus_pool(cluster, 1)
    finally:
        cluster.stop()
    first = out["first_nimbus"]
    print(f"first task, 0 blocks: nimbus p50 {pct(first, 0.5):.2f} s p95 {pct(first, 0.95):.2f} s")
    pf = out.get("parsl_first", {})
    if "first" in pf:
        p50, p95 = pct(pf["first"], 0.5), pct(pf["first"], 0.95)
        print(f"   Parsl {pf['parsl']} HTEX + SlurmProvider: p50 {p50:.2f} s p95 {p95:.2f} s")
    elif pf:
        print(f"   Parsl: {pf.get('error')}")
    print(f"{tasks} no-ops over 4 blocks: nimbus {out['throughput_nimbus']:.0f}/s", end="")
    pt = out.get("parsl_throughput", {})
    if "throughput" in pt:
        ratio = out["throughput_nimbus"] / pt["throughput"]
        print(f", Parsl HTEX {pt['throughput']:.0f}/s ({ratio:.1f}x)")
    else:
        print(f", Parsl: {pt.get('error', 'not run')}")
    for key in ("scheduler_load", "churn", "killed_slurmd"):
        print(f"{key}: {out[key]}")
    print(f"idle blocks gone {out['idle_seconds']:.1f} s after the last result (max_idle 5 s)")
    print(
        f"mp.Pool(16) map 256: 4 nodes {out['pool_4_nodes']:.2f} s, 1 node {out['pool_1_node']:.2f} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
