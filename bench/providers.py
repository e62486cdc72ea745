"""nimbus on Slurm beside Parsl's HighThroughputExecutor with its SlurmProvider, one run.

::

    sudo python bench/providers.py [--quick] [--no-parsl] [--only churn,...] [--json out.json]

Starts the tests' private Slurm cluster (``tests/slurm_support.py``: munged,
slurmctld, slurmd n1..n4 on this machine; root only), then measures on it:

* first task with 0 blocks -> its result (nimbus: the task asks for a block at
  once; Parsl: its strategy tick, ``strategy_period`` 5 s), p50 and p95;
* 10,000 no-op tasks over 4 single-node blocks (2 workers each), tasks/s, both;
* churn: 1,000 tasks of 0.2-5 s through blocks with a 2-minute walltime and a
  running block scancelled 20 s in (the forced scale-in), on both sides:
  failed, lost, wrong and duplicate results, blocks ended at their walltime;
* idle blocks: seconds from the last result to every block cancelled, against
  ``max_idle`` (nimbus);
* a killed slurmd under load: seconds to the lost manager, tasks all done;
* scheduler load: ``squeue`` runs per status period with 4 blocks (a shim on
  PATH counts them, beside the scaler's own count);
* ``mp.Pool(16)`` map over 4 nodes vs 1 node (report).

Parsl lives in its own venv (``bench/.venv-parsl``, as ``bench/_htex.py``
makes it on first use); its side runs in a subprocess of that venv's python, which runs this
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


def slurm_htex(partition: str, path: str, blocks: tuple[int, int, int], walltime: str) -> Any:
    """HTEX of 2 workers a node on single-node, whole-node Slurm blocks of ``partition``
    (``blocks``: init, min, max); the workers find python on ``path``."""
    from parsl.executors import HighThroughputExecutor
    from parsl.launchers import SingleNodeLauncher
    from parsl.providers import SlurmProvider

    init, least, most = blocks
    return HighThroughputExecutor(
        label="htex",
        address="127.0.0.1",
        max_workers_per_node=2,
        provider=SlurmProvider(
            partition=partition,
            init_blocks=init,
            min_blocks=least,
            max_blocks=most,
            nodes_per_block=1,
            exclusive=True,  # (SlurmProvider's default)
            walltime=walltime,
            launcher=SingleNodeLauncher(),
            worker_init=f"export PATH={path}",
        ),
    )


def parsl_driver(op: str, n: int, partition: str) -> dict[str, Any]:
    import parsl
    from parsl.config import Config

    run_dir = tempfile.mkdtemp(prefix="parsl-bench-")
    path = os.environ["PATH"]
    if op == "first":  # each try a fresh DFK with 0 blocks, Parsl's default strategy
        times = []
        for i in range(n):
            htex = slurm_htex(partition, path, (0, 0, 1), "00:10:00")
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
    if op == "churn":
        return parsl_churn(n, partition, run_dir, path)
    # throughput over 4 single-node blocks, HTEX driven directly (as Globus Compute does)
    htex = slurm_htex(partition, path, (4, 4, 4), "00:10:00")
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


def parsl_churn(n: int, partition: str, run_dir: str, path: str) -> dict[str, Any]:
    """The churn workload on HTEX + SlurmProvider, Parsl's defaults (retries 0)."""
    import parsl
    from parsl.config import Config

    htex = slurm_htex(partition, path, (0, 0, 4), CHURN_WALLTIME)
    config = Config(executors=[htex], run_dir=run_dir, strategy="htex_auto_scale", max_idletime=3.0)
    dfk = parsl.load(config)
    log = Path(run_dir) / "runs.log"
    try:

        @parsl.python_app
        def app(i: int, seconds: float, log: str) -> int:
            import os
            import time

            with open(log, "a") as f:
                f.write(f"{i} {os.environ.get('SLURMD_NODENAME', '?')}\n")
            time.sleep(seconds)
            return i

        rng = random.Random(17)
        t0 = time.monotonic()
        futures = [app(i, rng.uniform(*CHURN_SECONDS), str(log)) for i in range(n)]
        out = churn_outcome(futures, n, log, t0, scale_in_at=CHURN_SCANCEL_AT)
        out["parsl"] = parsl.__version__
        return out
    finally:
        dfk.cleanup()
        parsl.clear()


def churn_outcome(
    futures: list[Any], n: int, log: Path, t0: float, *, scale_in_at: float
) -> dict[str, Any]:
    """Wait for every future (scancel one running block ``scale_in_at`` s in); the counts."""
    scancelled = ""
    before, timed_out, sampled = timed_out_jobs(), set(), 0.0
    results: dict[int, Any] = {}
    errors: dict[str, int] = {}
    deadline = t0 + CHURN_DEADLINE
    pending = dict(enumerate(futures))
    while pending and time.monotonic() < deadline:
        if not scancelled and time.monotonic() - t0 >= scale_in_at:
            scancelled = scancel_one_running() or "none running"
        if time.monotonic() - sampled > 5:
            sampled = time.monotonic()
            timed_out |= timed_out_jobs() - before
        for i, f in list(pending.items()):
            if f.done():
                del pending[i]
                exc = f.exception()
                if exc is None:
                    results[i] = f.result()
                else:
                    name = type(exc).__name__
                    errors[name] = errors.get(name, 0) + 1
        time.sleep(0.2)
    runs = [int(line.split()[0]) for line in log.read_text().splitlines()] if log.exists() else []
    return {
        "tasks": n,
        "done": len(results),
        "failed": sum(errors.values()),
        "errors": errors,
        "lost": len(pending),
        "wrong": sum(r != i for i, r in results.items()),
        "ran_twice": len(runs) - len(set(runs)),
        "seconds": round(time.monotonic() - t0, 1),
        "scancelled": scancelled,
        "blocks_at_walltime": len(timed_out | (timed_out_jobs() - before)),
    }


def scancel_one_running() -> str:
    """The forced scale-in: scancel one running job of this user (the first squeue lists)."""
    out = subprocess.run(
        ["squeue", "-h", "--states=RUNNING", "-o", "%i"], capture_output=True, text=True
    ).stdout.split()
    if out:
        subprocess.run(["scancel", out[0]], capture_output=True)
        return out[0]
    return ""


def timed_out_jobs() -> set[str]:
    """Jobs that ended at their walltime (squeue keeps ended jobs MinJobAge s: sample often)."""
    out = subprocess.run(
        ["squeue", "-h", "--states=TIMEOUT", "-o", "%i"], capture_output=True, text=True
    ).stdout
    return set(out.split())


def run_parsl(op: str, n: int, partition: str) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    try:
        from _htex import ensure_venv
    finally:
        sys.path.remove(str(HERE))
    python = ensure_venv(PARSL_VENV)  # made and installed on first use
    env = {**os.environ, "PATH": f"{python.parent}:{os.environ['PATH']}"}
    cmd = [str(python), __file__, "--parsl-driver", op, "--n", str(n), "--partition", partition]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
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
        shimmed0 = squeue_calls()
        futures = [ex.submit(noop) for _ in range(n)]
        for f in futures:
            f.result(timeout=600)
        elapsed = time.monotonic() - t0
        time.sleep(max(0.0, 6 - elapsed))  # at least three status periods with 4 blocks
        window = time.monotonic() - t0
        calls = ex._backend.scaler.status_calls - calls0
        shimmed = squeue_calls() - shimmed0
    load = {
        "status_calls": calls,
        "squeue_runs_on_path": shimmed,
        "seconds": round(window, 1),
        "period": ex._backend.scaler.period,
        "blocks": 4,
    }
    return n / elapsed, load


SQUEUE_LOG: Path | None = None  # the shim's log: one line per squeue run


def install_squeue_shim(root: Path) -> None:
    """Put an ``squeue`` on PATH that logs each run, then runs the real one."""
    global SQUEUE_LOG
    real = subprocess.run(["which", "squeue"], capture_output=True, text=True).stdout.strip()
    shim = root / "shim"
    shim.mkdir(exist_ok=True)
    SQUEUE_LOG = root / "squeue.calls"
    (shim / "squeue").write_text(f'#!/bin/sh\necho x >> {SQUEUE_LOG}\nexec {real} "$@"\n')
    (shim / "squeue").chmod(0o755)
    os.environ["PATH"] = f"{shim}:{os.environ['PATH']}"


def squeue_calls() -> int:
    if SQUEUE_LOG is None or not SQUEUE_LOG.exists():
        return 0
    return len(SQUEUE_LOG.read_text().split())


def nimbus_churn(cluster: Any, n: int, log: Path) -> dict[str, Any]:
    from nimbus import Executor

    s = settings(cluster, walltime=CHURN_WALLTIME, max_blocks=4, exclusive=True, max_idle=3.0)
    rng = random.Random(17)
    with Executor(settings=s) as ex:
        t0 = time.monotonic()
        futures = [ex.submit(sleepy, i, rng.uniform(*CHURN_SECONDS), str(log)) for i in range(n)]
        out = churn_outcome(futures, n, log, t0, scale_in_at=CHURN_SCANCEL_AT)
        stats = ex._backend.scaler.statistics()
        out["requeued"] = sum(count for _, _, count in ex._backend.agent.lost)
        out["managers_lost"] = len(ex._backend.agent.lost)
    out["blocks_submitted"] = stats["submitted"]
    return out


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


CHURN_WALLTIME = "00:02:00"  # the 2-minute blocks
CHURN_SECONDS = (0.2, 5.0)  # each task sleeps uniform(0.2, 5) s
CHURN_SCANCEL_AT = 20.0  # the forced scale-in: a running block scancelled this far in
CHURN_DEADLINE = 1800.0  # a task not done by then is lost


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


SECTIONS = ("first", "throughput", "churn", "idle", "slurmd", "pool")


def measure(
    cluster: Any, only: set[str], parsl: bool, sizes: tuple[int, int, int]
) -> dict[str, Any]:
    tries, tasks, churn = sizes
    out: dict[str, Any] = {"sizes": {"tries": tries, "tasks": tasks, "churn": churn}}

    def settle() -> None:
        cluster.run("scancel", "--user", "root", check=False)
        cluster.wait_idle(90)

    if "first" in only:
        out["first_nimbus"] = nimbus_first(cluster, tries)
        settle()
        if parsl:
            out["parsl_first"] = run_parsl("first", tries, cluster.partition)
            settle()
    if "throughput" in only:
        out["throughput_nimbus"], out["scheduler_load"] = nimbus_throughput(cluster, tasks)
        settle()
        if parsl:
            out["parsl_throughput"] = run_parsl("throughput", tasks, cluster.partition)
            settle()
    if "churn" in only:
        log = Path(tempfile.mkdtemp(prefix="nimbus-churn-")) / "runs.log"
        out["churn"] = nimbus_churn(cluster, churn, log)
        settle()
        if parsl:
            out["parsl_churn"] = run_parsl("churn", churn, cluster.partition)
            settle()
    if "idle" in only:
        out["idle_seconds"], out["max_idle"] = nimbus_idle(cluster, 5.0), 5.0
        settle()
    if "slurmd" in only:
        out["killed_slurmd"] = nimbus_killed_slurmd(cluster)
        settle()
    if "pool" in only:
        out["pool_4_nodes"] = nimbus_pool(cluster, 4)
        settle()
        out["pool_1_node"] = nimbus_pool(cluster, 1)
        settle()
    return out


def report(out: dict[str, Any]) -> None:
    if "first_nimbus" in out:
        first = out["first_nimbus"]
        p50, p95 = pct(first, 0.5), pct(first, 0.95)
        print(f"first task, 0 blocks: nimbus p50 {p50:.2f} s p95 {p95:.2f} s")
        pf = out.get("parsl_first", {})
        if "first" in pf:
            p50, p95 = pct(pf["first"], 0.5), pct(pf["first"], 0.95)
            print(f"   Parsl {pf['parsl']} HTEX + SlurmProvider: p50 {p50:.2f} s p95 {p95:.2f} s")
        elif pf:
            print(f"   Parsl: {pf.get('error')}")
    if "throughput_nimbus" in out:
        tasks = out["sizes"]["tasks"]
        print(f"{tasks} no-ops over 4 blocks: nimbus {out['throughput_nimbus']:.0f}/s", end="")
        pt = out.get("parsl_throughput", {})
        if "throughput" in pt:
            ratio = out["throughput_nimbus"] / pt["throughput"]
            print(f", Parsl HTEX {pt['throughput']:.0f}/s ({ratio:.1f}x)")
        else:
            print(f", Parsl: {pt.get('error', 'not run')}")
    for key in ("scheduler_load", "churn", "parsl_churn", "killed_slurmd"):
        if key in out:
            print(f"{key}: {out[key]}")
    if "idle_seconds" in out:
        print(f"idle blocks gone {out['idle_seconds']:.1f} s after the last result (max_idle 5 s)")
    if "pool_1_node" in out:
        four, one = out["pool_4_nodes"], out["pool_1_node"]
        print(f"mp.Pool(16) map 256: 4 nodes {four:.2f} s, 1 node {one:.2f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    parser.add_argument("--no-parsl", action="store_true", help="nimbus only")
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma-separated of {', '.join(SECTIONS)}"
    )
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--parsl-driver", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--partition", default="debug", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.parsl_driver:
        print(json.dumps(parsl_driver(args.parsl_driver, args.n, args.partition)), flush=True)
        return 0
    only = set(args.only.split(","))
    if only - set(SECTIONS):
        parser.error(f"--only: unknown {', '.join(sorted(only - set(SECTIONS)))}")
    sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]
    from slurm_support import Cluster, unavailable

    why = unavailable()
    if why:
        print(f"bench/providers.py: {why}", file=sys.stderr)
        return 2
    sizes = (3, 2000, 100) if args.quick else (9, 10_000, 1000)
    root = Path(tempfile.mkdtemp(prefix="nimbus-bench-slurm-"))
    cluster = Cluster(root).start()
    os.environ["SLURM_CONF"] = str(cluster.conf)
    os.environ["XDG_CONFIG_HOME"] = str(root / "config")  # the blocks' output goes there
    install_squeue_shim(root)  # the scheduler load, counted outside nimbus
    try:
        out = measure(cluster, only, not args.no_parsl, sizes)
    finally:
        cluster.stop()
    report(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
