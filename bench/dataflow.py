"""Data between functions (``nimbus.data``): references against passing by value, one run.

::

    big        100 MB out and back through a task: nimbus.put + task (kept) + get, against
               Ray's ray.put + task + ray.get in the same run (Ray in bench/.venv-ray,
               made on first use); and one way (put + a task that reads it)
    campaign   Colmena-style: 1,000 tasks, 1 MB in and 1 MB out each, in 10 chains of
               100, chained through references vs through the client (each result back
               to the client, then sent out again); on the local runtime and on an
               endpoint through the service; bytes that crossed the client's link
    file       a 1 GB file on endpoint "source" (nimbus.File("source:path"), exported)
               staged to endpoint "dataflow", then used by 16 tasks there: staged once,
               endpoint to endpoint (nimbus.data._direct), against a raw TCP copy of the
               file over the same link (loopback), without nimbus; then used by 16 tasks
               on each of two more endpoints at once (4 endpoints): once per endpoint;
               16 tasks on dataflow writing 1 MB out= files to source, endpoint to
               endpoint, against each task's bytes carried through the client
    mapreduce  WordCount and Sort, 4 nodes in network namespaces with shaped links (1 Gbit/s),
               the shuffle through a shared directory (a file server in a namespace of its
               own, mounted by sshfs on each node over its link: bench/_sharedfs.py), the
               state store (a Redis beside the endpoint, reached over the links) and direct
               messaging over TCP between the nodes (bench/_mapreduce.py); --mr-local: all
               on this machine (a local directory, Unix sockets)
    pipeline   a 2-stage pipeline of 10,000 tasks on an endpoint (stage 1 makes 10 KB
               each, kept; stage 2 reads one and returns 8 bytes): the client's link
               carries only the final results
    kv         a shuffle through nimbus.data.store() in an endpoint's tasks (16 x 16 values
               of 256 KB), against plain redis-py on the same store and one node's files
    deps       tasks given futures on an endpoint: held by the service (sent at once,
               released when their input ends) against held by the client (sent when
               their input is done: ``dependencies`` off, the path of before), in the
               same run, alternated: a 2-stage pipeline of 1,000 tiny tasks (submit to
               last result) and a chain of 100 (seconds per link)

    python bench/dataflow.py                # everything
    python bench/dataflow.py --quick        # small sizes, a smoke run
    python bench/dataflow.py --only big --no-ray --json out.json

Each step says so on stderr as it starts; a wait longer than ``--wait`` (--quick: 60 s)
ends the run at once as hung (exit status 3) with every thread's stack, and
``kill -USR1`` shows them at any time.

Bytes across the client's link are the pickled arguments the Executor handed its
backend and the pickled results it got back (``Executor.statistics()``), so the
service's framing and the WebSocket's are not counted.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import contextlib  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pickle  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any, NoReturn  # noqa: E402

sys.path.append(str(_HERE))  # after the stdlib: for _report and service, never multiprocessing
from _report import grid  # noqa: E402

RAY = "ray==2.60.0"
RAY_VENV = _HERE / ".venv-ray"
MB = 1 << 20
START = time.monotonic()
LONG_WAIT = 900.0  # seconds any one wait may take (--wait); longer is a hang
QUICK_WAIT = 60.0  # --quick: a smoke run takes ~12 s in all; a hang ends well within CI's limit
WAIT = LONG_WAIT


def progress(what: str) -> None:
    """A line on stderr as each step starts (flushed): a run stopped by a time limit
    shows which step it was in."""
    print(f"[dataflow {time.monotonic() - START:6.1f} s] {what}", file=sys.stderr, flush=True)


CLOSERS: list[Any] = []  # what a hung run still undoes: namespaces and links (``close``)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` now, parents first (a new session's too)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def hung(what: str, seconds: float) -> NoReturn:
    """A wait that ran out: said with every thread's stack, and the run ends at once, exit
    status 3. A clean-up would wait for the hung thread too, so what the run started is
    killed instead: every process below this one (the service, the agents in their own
    sessions, their workers and stores), then the namespaces and links are removed."""
    progress(f"HUNG: {what}: no answer within {seconds:g} s; every thread's stack:")
    faulthandler.dump_traceback(sys.stderr, all_threads=True)
    sys.stdout.flush()
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for close in reversed(CLOSERS):
        try:
            close()
        except Exception as exc:  # (each one tried: the run ends anyway)
            progress(f"HUNG: could not undo {close!r}: {exc}")
    os._exit(3)


def result(future: Any, what: str) -> Any:
    """``future.result()`` within ``WAIT`` s, else :func:`hung`."""
    try:
        return future.result(timeout=WAIT)
    except TimeoutError:  # (concurrent.futures.TimeoutError is TimeoutError)
        if future.done():
            raise  # the task's own TimeoutError
        hung(what, WAIT)


def join(threads: list[threading.Thread], what: str) -> None:
    """Join ``threads`` within ``WAIT`` s in all, else :func:`hung`."""
    end = time.monotonic() + WAIT
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
        if t.is_alive():
            hung(what, WAIT)


def echo(blob: bytes) -> bytes:
    return blob


def length(blob: bytes) -> int:
    return len(blob)


def step(blob: bytes) -> bytes:
    """A campaign step: 1 MB in, 1 MB out (a new object, made from the input)."""
    return blob[1:] + blob[:1]


def seed(i: int, size: int) -> bytes:
    return bytes([i % 256]) * size


def digest(blob: bytes) -> int:
    return len(blob) + blob[0]


def ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 1)


# ---------------------------------------------------------------- big: nimbus vs Ray


def nimbus_big(size: int, reps: int) -> dict[str, float]:
    import nimbus
    from nimbus import Executor

    data = os.urandom(size)
    out: dict[str, list[float]] = {"echo": [], "oneway": []}
    progress("big: a local Executor(2) starts")
    with Executor(2) as ex:
        result(ex.submit(length, nimbus.put(b"x")), "big: the first task")
        kept = ex.options(keep=True)
        for i in range(reps):
            progress(f"big: put + task + get {i + 1}/{reps}")
            start = time.perf_counter()
            ref = nimbus.put(data)
            back = result(kept.submit(echo, ref), "big: echo of a put object")
            out["echo"].append(time.perf_counter() - start)
            assert len(back) == size
            del back, ref
            start = time.perf_counter()
            ref = nimbus.put(data)
            assert result(ex.submit(length, ref), "big: length of a put object") == size
            out["oneway"].append(time.perf_counter() - start)
            del ref
        progress("big: the Executor shuts down")
    return {k: ms(v) for k, v in out.items()}


RAY_DRIVER = """
import json, os, statistics, sys, time
import ray
size, reps = int(sys.argv[1]), int(sys.argv[2])
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
         _node_ip_address="127.0.0.1")  # loopback only
@ray.remote
def echo(b):
    return b
@ray.remote
def length(b):
    return len(b)
ray.get([length.remote(b"x") for _ in range(4)])
data = os.urandom(size)
out = {"echo": [], "oneway": []}
for _ in range(reps):
    s = time.perf_counter()
    ref = ray.put(data)
    back = ray.get(echo.remote(ref))
    out["echo"].append(time.perf_counter() - s)
    assert len(back) == size
    del back, ref
    s = time.perf_counter()
    ref = ray.put(data)
    assert ray.get(length.remote(ref)) == size
    out["oneway"].append(time.perf_counter() - s)
    del ref
ray.shutdown()
print(json.dumps({k: round(statistics.median(v) * 1000, 1) for k, v in out.items()}
                 | {"ray": ray.__version__}))
"""


def ray_python() -> Path:
    """bench/.venv-ray's python, with Ray installed in it (made on first use)."""
    python = RAY_VENV / "bin" / "python"
    ok = (
        python.exists()
        and not subprocess.run(
            [str(python), "-c", "import ray"], capture_output=True, check=False
        ).returncode
    )
    if ok:
        return python
    print(f"making {RAY_VENV} with {RAY} (once) ...", file=sys.stderr, flush=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(RAY_VENV)], check=True)
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", RAY],
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    if done.returncode:
        raise RuntimeError(
            f"pip could not install {RAY} into {RAY_VENV}: {done.stderr.strip()[-600:]}; "
            f"make the venv by hand or run with --no-ray"
        )
    return python


def ray_big(size: int, reps: int) -> dict[str, Any]:
    python = ray_python()
    (RAY_VENV / "home").mkdir(exist_ok=True)
    done = subprocess.run(
        [str(python), "-c", RAY_DRIVER, str(size), str(reps)],
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
        cwd=RAY_VENV,  # not bench/: its multiprocessing.py would shadow the stdlib's
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        | {
            "RAY_USAGE_STATS_ENABLED": "0",
            "HOME": str(RAY_VENV / "home"),  # its auth token there, not in ~/.ray
            # a loaded machine: give its agents time to start
            "RAY_agent_register_timeout_ms": "300000",
            "RAY_raylet_start_wait_time_s": "300",
        },
    )
    if done.returncode:
        raise RuntimeError(f"the Ray driver failed: {done.stderr.strip()[-1500:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def bench_big(args: argparse.Namespace) -> list[list[str]]:
    size = (10 if args.quick else 100) * MB
    reps = 2 if args.quick else 5
    first = nimbus_big(size, reps)  # nimbus before and after Ray: the same load on both
    ray = None if args.no_ray else ray_big(size, reps)
    second = nimbus_big(size, reps)
    ours = {k: min(first[k], second[k]) for k in first}
    label = f"{size // MB} MB"
    rows = []
    for key, what in (
        ("echo", "out and back: put + task + get"),
        ("oneway", "one way: put + task"),
    ):
        theirs = ray[key] if ray else None
        ratio = f"{ours[key] / theirs:.2f}x" if theirs else "-"
        verdict = (
            "-" if theirs is None or key != "echo" else ("PASS" if ours[key] <= theirs else "MISS")
        )
        rows.append(
            [
                f"{label} {what}",
                f"{ours[key]} ms",
                f"{theirs} ms" if theirs else "-",
                ratio,
                "<= 1.0x Ray" if key == "echo" else "",
                verdict,
            ]
        )
    RESULTS["big"] = {"nimbus_first": first, "nimbus_second": second, "ray": ray}
    return rows


# ---------------------------------------------------------------- campaign


def campaign(ex: Any, chains: int, steps: int, size: int, *, refs: bool) -> tuple[float, int]:
    """Seconds and client-link bytes for ``chains`` chains of ``steps`` 1 MB steps."""
    stats = ex.statistics()
    before = stats["bytes_sent"] + stats["bytes_received"]
    start = time.perf_counter()
    if refs:
        kept = ex.options(keep=True)
        ends = []
        for c in range(chains):
            future = kept.submit(seed, c, size)
            for _ in range(steps - 1):
                future = kept.submit(step, future)
            ends.append(future)
        finals = [result(f, f"campaign: chain {c} through references") for c, f in enumerate(ends)]
    else:
        finals = [b""] * chains

        def chain(c: int) -> None:
            value = result(ex.submit(seed, c, size), f"campaign: chain {c}'s seed")
            for k in range(steps - 1):
                value = result(ex.submit(step, value), f"campaign: chain {c}'s step {k + 1}")
            finals[c] = value

        threads = [threading.Thread(target=chain, args=(c,), daemon=True) for c in range(chains)]
        for t in threads:
            t.start()
        join(threads, "campaign: the chains through the client")
    seconds = time.perf_counter() - start
    assert all(len(f) == size for f in finals)
    stats = ex.statistics()
    return seconds, stats["bytes_sent"] + stats["bytes_received"] - before


def campaign_rows(ex: Any, where: str, args: argparse.Namespace) -> list[list[str]]:
    chains, steps = (4, 10) if args.quick else (10, 100)
    size = MB
    progress(f"campaign, {where}: warming")
    campaign(ex, 2, 2, size, refs=True)  # warm
    campaign(ex, 2, 2, size, refs=False)
    progress(f"campaign, {where}: through the client")
    by_value, by_value_bytes = campaign(ex, chains, steps, size, refs=False)
    progress(f"campaign, {where}: through references")
    by_ref, by_ref_bytes = campaign(ex, chains, steps, size, refs=True)
    final = chains * size  # the last results, fetched by the client in both
    tasks = chains * steps
    RESULTS[f"campaign_{where}"] = {
        "tasks": tasks,
        "by_value_s": by_value,
        "by_ref_s": by_ref,
        "by_value_bytes": by_value_bytes,
        "by_ref_bytes": by_ref_bytes,
        "final_bytes": final,
    }
    speedup = by_value / by_ref
    remote = where != "local runtime"  # locally there is no link to save: informational
    target = ">= 2x; ~0 MB intermediate" if remote else "(no network link here)"
    verdict = "PASS" if speedup >= 2 and by_ref_bytes - final < MB else "MISS"
    return [
        [
            f"campaign {tasks} x 1 MB, {where}: through the client",
            f"{by_value:.2f} s",
            f"{by_value_bytes / MB:.0f} MB",
            "",
            "",
            "",
        ],
        [
            f"campaign {tasks} x 1 MB, {where}: through references",
            f"{by_ref:.2f} s",
            f"{by_ref_bytes / MB:.1f} MB ({max(0, by_ref_bytes - final) / MB:.2f} MB not final)",
            f"{speedup:.2f}x faster",
            target,
            verdict if remote else "-",
        ],
    ]


# ---------------------------------------------------------------- pipeline


def pipeline_rows(ex: Any, args: argparse.Namespace) -> list[list[str]]:
    n = 500 if args.quick else 10_000
    size = 10 * 1024
    stats = ex.statistics()
    before_in, before_out = stats["bytes_received"], stats["bytes_sent"]
    start = time.perf_counter()
    first = ex.map(seed, range(n), [size] * n, keep=True)
    second = [ex.submit(digest, f) for f in first]
    progress(f"pipeline: {2 * n} tasks")
    results = [result(f, "pipeline: a stage-2 task") for f in second]
    seconds = time.perf_counter() - start
    assert results[5] == size + 5
    stats = ex.statistics()
    got = stats["bytes_received"] - before_in
    sent = stats["bytes_sent"] - before_out
    intermediate = n * size
    RESULTS["pipeline"] = {
        "tasks": 2 * n,
        "seconds": seconds,
        "bytes_received": got,
        "bytes_sent": sent,
        "intermediate_bytes": intermediate,
    }
    return [
        [
            f"2-stage pipeline, {2 * n} tasks on an endpoint",
            f"{seconds:.2f} s",
            f"{got / MB:.2f} MB in, {sent / MB:.2f} MB out",
            f"({intermediate / MB:.0f} MB stayed)",
            "only final results",
            "PASS" if got < intermediate / 10 else "MISS",
        ],
    ]


# ---------------------------------------------------------------- put


ECHO = "put + task + get"


def put_rows(ex: Any, endpoint: str, args: argparse.Namespace) -> list[list[str]]:
    """``nimbus.put`` of 100 MB to an endpoint, straight to its node (``data._place``)
    against through the service (the session's direct path off), alternated: put, put +
    a task that reads it, put + a task that returns it (kept) + its ``result()``."""
    import nimbus

    size = (10 if args.quick else 100) * MB
    reps = 2 if args.quick else 5
    data = os.urandom(size)
    times: dict[tuple[bool, str], list[float]] = {}
    where = None
    for i in range(2 * reps):
        direct = i % 2 == 0
        if where is not None:
            where.direct_after = 0.0 if direct else float("inf")
        progress(f"put: {'direct' if direct else 'service'} {i // 2 + 1}/{reps}")
        start = time.perf_counter()
        ref = nimbus.put(data, endpoint=endpoint)
        where = nimbus.data.session(ref.endpoint)
        assert (ref.holder is not None) == direct, "the direct path was not taken"
        put = time.perf_counter() - start
        assert result(ex.submit(length, ref), "put: a task reading the object") == size
        task = time.perf_counter() - start
        back = result(ex.options(keep=True).submit(echo, ref), "put: an echo, kept")
        got = time.perf_counter() - start
        assert len(back) == size
        for key, value in (("put", put), ("put + task", task), (ECHO, got)):
            times.setdefault((direct, key), []).append(value)
        del ref, back
    if where is not None:
        where.direct_after = 0.0
    RESULTS["put"] = {f"{'direct' if d else 'service'} {k}": ms(v) for (d, k), v in times.items()}
    rows = []
    for key in ("put", "put + task", ECHO):
        ours, theirs = ms(times[(True, key)]), ms(times[(False, key)])
        rows.append(
            [
                f"{size // MB} MB {key} to an endpoint, straight to its node",
                f"{ours} ms",
                f"{theirs} ms via the service",
                f"{theirs / ours:.2f}x",
                "",
                "",
            ]
        )
    return rows


# ---------------------------------------------------------------- kv


class RawRedis:
    """The baseline of ``kv``: what a user of funcX's ``get_redis_client()`` writes, plain
    redis-py on the same store, keys and ACL user, values pickled."""

    def __init__(self) -> None:
        from nimbus import statestore

        program = statestore.current()
        assert program is not None and program.endpoint, "not a task of an endpoint's program"
        user = program.program_id.rpartition(".")[0]
        self.keys = statestore.Keys(f"{user}.kv-{program.endpoint}")
        self.client = program.client()

    def set(self, key: str, value: object) -> None:
        self.client.set(self.keys.kv("raw-" + key), pickle.dumps(value, 5), px=600_000)

    def get(self, key: str) -> Any:
        return pickle.loads(self.client.get(self.keys.kv("raw-" + key)))


def kv_of(how: str) -> Any:
    import nimbus.data

    if how == "store":
        return nimbus.data.store()
    if how == "redis":
        return RawRedis()
    return nimbus.data.NodeKeyValue(nimbus.data.default_root() / "bench" / "kv")  # one node's files


def kv_map(i: int, parts: int, size: int, how: str) -> int:
    kv = kv_of(how)
    for j in range(parts):
        kv.set(f"{i}-{j}", bytes([i % 256]) * size)
    return parts


def kv_reduce(j: int, maps: int, how: str) -> int:
    kv = kv_of(how)
    return sum(len(kv.get(f"{i}-{j}")) for i in range(maps))


def kv_rows(ex: Any, args: argparse.Namespace) -> list[list[str]]:
    """A shuffle through the key-value store of an endpoint's tasks: ``maps`` tasks each
    set ``maps`` partitions, then ``maps`` tasks each get theirs from every map; through
    ``nimbus.data.store()`` (the store the service hands out), plain redis-py on the same
    store (funcX's way), and one node's files (``NodeKeyValue``: what ``store()`` was
    before it was the endpoint's), alternated, medians of the submit-to-last-result time."""
    maps, size, reps = (4, 64 << 10, 3) if args.quick else (16, 256 << 10, 6)
    hows = ("store", "redis", "node")
    times: dict[str, list[float]] = {how: [] for how in hows}
    for how in hows:  # warm: workers up, functions registered, clients connected
        [result(f, "kv: warm") for f in [ex.submit(kv_map, i, 1, 1, how) for i in range(8)]]
    for rep in range(reps):
        for how in hows[rep % 3 :] + hows[: rep % 3]:  # (each first in turn)
            progress(f"kv: {how} {rep + 1}/{reps}")
            start = time.perf_counter()
            mapped = [ex.submit(kv_map, i, maps, size, how) for i in range(maps)]
            [result(f, "kv: a map") for f in mapped]
            reduced = [ex.submit(kv_reduce, j, maps, how) for j in range(maps)]
            got = [result(f, "kv: a reduce") for f in reduced]
            times[how].append(time.perf_counter() - start)
            assert got == [maps * size] * maps
    RESULTS["kv"] = times
    med = {how: statistics.median(values) for how, values in times.items()}
    mb = maps * maps * size / MB
    return [
        [
            f"kv shuffle, {maps} x {maps} x {size >> 10} KB ({mb:.0f} MB) on an endpoint: "
            f"store() vs {label}",
            f"{med['store']:.3f} s",
            f"{med[how]:.3f} s",
            f"{med[how] / med['store']:.2f}x",
            "",
            "",
        ]
        for how, label in (("redis", "plain redis-py, same store"), ("node", "one node's files"))
    ]


# ---------------------------------------------------------------- deps


def tiny(i: int) -> int:
    return i


def inc(i: int) -> int:
    return i + 1


def deps_pipeline(ex: Any, n: int) -> float:
    kept = ex.options(keep=True)
    start = time.perf_counter()
    first = [kept.submit(tiny, i) for i in range(n)]
    second = [ex.submit(inc, f) for f in first]
    results = [result(f, "deps: a stage-2 task") for f in second]
    seconds = time.perf_counter() - start
    assert results[-1] == n
    return seconds


def deps_chain(ex: Any, links: int) -> float:
    kept = ex.options(keep=True)
    start = time.perf_counter()
    f = kept.submit(tiny, 0)
    for _ in range(links - 2):
        f = kept.submit(inc, f)
    last = ex.submit(inc, f)
    assert result(last, "deps: the chain's last task") == links - 1
    return time.perf_counter() - start


def deps_rows(ex: Any, args: argparse.Namespace) -> list[list[str]]:
    n, links, reps = (200, 30, 1) if args.quick else (1000, 100, 3)
    backend = ex._backend
    times: dict[tuple[str, bool], list[float]] = {}
    deps_pipeline(ex, 50)  # warm: functions registered, workers up
    for _ in range(reps):
        for service_side in (True, False):
            progress(f"deps: held by the {'service' if service_side else 'client'}")
            backend.dependencies = service_side
            times.setdefault(("pipeline", service_side), []).append(deps_pipeline(ex, n))
            times.setdefault(("chain", service_side), []).append(deps_chain(ex, links))
    backend.dependencies = True
    med = {key: statistics.median(values) for key, values in times.items()}
    RESULTS["deps"] = {f"{k}-{'service' if s else 'client'}": v for (k, s), v in times.items()}
    pipe_new, pipe_old = med["pipeline", True], med["pipeline", False]
    chain_new, chain_old = med["chain", True] / links, med["chain", False] / links
    return [
        [
            f"2-stage pipeline, {n} + {n} tiny tasks, held by the service vs the client",
            f"{pipe_new:.2f} s",
            f"{pipe_old:.2f} s",
            f"{pipe_old / pipe_new:.2f}x",
            "faster",
            "PASS" if pipe_new < pipe_old else "MISS",
        ],
        [
            f"chain of {links} dependent tasks, per link, service vs client",
            f"{chain_new * 1000:.1f} ms",
            f"{chain_old * 1000:.1f} ms",
            f"{chain_old / chain_new:.2f}x",
            "faster",
            "PASS" if chain_new < chain_old else "MISS",
        ],
    ]


def sha_of(path: Any) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


RAW_SENDER = """
import socket, sys
host = sys.argv[3] if len(sys.argv) > 3 else "127.0.0.1"
with socket.create_connection((host, int(sys.argv[1]))) as sock, open(sys.argv[2], "rb") as f:
    sock.sendfile(f)
    assert sock.recv(2) == b"OK"
"""

RAW_RECEIVER = """
import mmap, socket, sys, time
host, size, target = sys.argv[1], int(sys.argv[2]), sys.argv[3]
listener = socket.create_server((host, 0))
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
start = time.perf_counter()
with conn, open(target, "w+b") as out:
    out.truncate(size)
    with mmap.mmap(out.fileno(), size) as mapped:
        view, got = memoryview(mapped), 0
        while got < size:
            got += conn.recv_into(view[got : got + (8 << 20)])
        view.release()
    print(time.perf_counter() - start, flush=True)
    conn.sendall(b"OK")
"""


def raw_copy(
    path: Path, target: Path, source: list[str], dest: tuple[list[str], str] | None = None
) -> float:
    """Seconds a plain copy of ``path`` takes over the link the endpoints use, without
    nimbus: sendfile into a TCP socket from where the source agent runs (``source``, its
    namespace's prefix, if any), received into a file in memory where the target agent
    runs (``dest``: its prefix and the address it takes data on; by default this host's
    127.0.0.1). Timed by the receiver from the connection to the last byte, as the
    nimbus transfer is not (that is timed from the submit, tasks and all)."""
    prefix, host = dest or ([], "127.0.0.1")
    size = path.stat().st_size
    receiver = subprocess.Popen(
        [*prefix, sys.executable, "-c", RAW_RECEIVER, host, str(size), str(target)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert receiver.stdout is not None
        port = receiver.stdout.readline().strip()
        sender = subprocess.run(
            [*source, sys.executable, "-c", RAW_SENDER, port, str(path), host],
            check=True,
            timeout=600,
        )
        assert not sender.returncode
        seconds = float(receiver.stdout.readline())
        receiver.wait(60)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
        target.unlink(missing_ok=True)
    return seconds


def file_rows(
    ex: Any,
    exported: Path,
    args: argparse.Namespace,
    prefix: list[str],
    dest: tuple[list[str], str] | None = None,
) -> list[list[str]]:
    import nimbus
    from nimbus.data._staging import _cache

    size = (10 if args.quick else args.file_mb) * MB
    path = exported / "run42.bin"
    with open(path, "wb") as f:  # in parts: a 1 GB file never whole in this process
        for _ in range(size // (64 * MB)):
            f.write(os.urandom(64 * MB))
        f.write(os.urandom(size % (64 * MB)))
    sha_of(path)  # in the page cache, as a file just written on the source endpoint is
    shm = Path("/dev/shm") / f"nimbus-bench-raw-{os.getpid()}"
    # from the source's namespace (if any) into the target's, as the staged bytes go
    progress("file: raw TCP copies")
    raws = [raw_copy(path, shm, prefix, dest) for _ in range(2)]
    raw = min(raws)
    (exported / "tiny.bin").write_bytes(b"t")  # the same steps for 1 byte: their overhead
    progress("file: staged source -> dataflow")
    start = time.perf_counter()
    ex.submit(sha_of, nimbus.File(f"source:{exported}/tiny.bin"))
    tiny = next(f for k, f in _cache.items() if k[2] == str(exported / "tiny.bin"))
    result(tiny, "file: staging 1 byte")
    overhead = time.perf_counter() - start
    file = nimbus.File(f"source:{path}")
    start = time.perf_counter()
    first = ex.submit(sha_of, file)
    key = next(k for k in _cache if k[2] == str(path))
    staged_files = result(_cache[key], "file: staging the file")
    staged = time.perf_counter() - start
    first_sha = result(first, "file: the first task")
    start = time.perf_counter()
    rest = [ex.submit(sha_of, file) for _ in range(16)]
    shas = {result(f, "file: one of 16 tasks") for f in rest}
    sixteen = time.perf_counter() - start
    transfers = sum(1 for key in _cache if key[2] == str(path))
    assert shas == {first_sha} == {staged_files.sha256}, "a task saw other bytes"
    assert first_sha == sha_of(path)
    direct = not staged_files.refs
    RESULTS["file"] = {
        "bytes": size,
        "raw_link_seconds": raws,
        "staged_seconds": staged,
        "one_byte_staged_seconds": overhead,
        "sixteen_tasks_seconds": sixteen,
        "transfers": transfers,
        "direct": direct,
        "client_bytes": ex.statistics()["bytes_sent"] + ex.statistics()["bytes_received"],
    }
    rate, raw_rate = size / staged / MB, size / raw / MB
    alone = size / max(staged - overhead, 1e-9) / MB  # without the tasks' fixed cost
    RESULTS["file"]["transfer_alone_mb_s"] = alone
    return [
        [
            f"{size // MB} MB file staged source -> dataflow, then 16 tasks"
            + (
                f" (each endpoint in its own namespace, links shaped to {args.netns} Mbit/s)"
                if args.netns
                else f" (link shaped to {args.shaped} Mbit/s)"
                if args.shaped
                else " (loopback)"
            ),
            f"staged {staged:.2f} s ({rate:.0f} MB/s, "
            f"{'endpoint to endpoint' if direct else 'via the client'}); "
            f"16 tasks {sixteen:.2f} s; 1 byte staged {overhead:.2f} s, so the bytes alone "
            f"{alone:.0f} MB/s = {alone / raw_rate:.2f}x raw",
            f"raw TCP copy on the same link {raw_rate:.0f} MB/s; transfers: {transfers}",
            f"{rate / raw_rate:.2f}x",
            ">= 0.8x raw, once",
            "PASS" if rate >= 0.8 * raw_rate and transfers == 1 else "MISS",
        ],
    ]


def fanout_rows(settings: Any, exported: Path, targets: list[str]) -> list[list[str]]:
    """The file of :func:`file_rows` used by 16 tasks on each of ``targets`` (two more
    endpoints: four in all, with source and dataflow) at once: staged once per endpoint,
    each straight from source, while the client carries only the answers."""
    import nimbus
    from nimbus import Executor
    from nimbus.data._staging import _cache

    path = exported / "run42.bin"
    want = sha_of(path)
    file = nimbus.File(f"source:{path}")
    progress(f"fan-out: to {', '.join(targets)}")
    executors = [Executor(endpoint=t, settings=settings) for t in targets]
    try:
        before = {k for k in _cache if k[2] == str(path)}
        start = time.perf_counter()
        futures = [ex.submit(sha_of, file) for ex in executors]  # staged to both at once
        for key in [k for k in _cache if k[2] == str(path) and k not in before]:
            result(_cache[key], "fan-out: staging to the endpoints")
        staging = time.perf_counter() - start
        futures += [ex.submit(sha_of, file) for ex in executors for _ in range(15)]
        shas = {result(f, "fan-out: a task") for f in futures}
        seconds = time.perf_counter() - start
        client = sum(
            ex.statistics()["bytes_sent"] + ex.statistics()["bytes_received"] for ex in executors
        )
    finally:
        for ex in executors:
            ex.shutdown()
    staged = [result(f, "fan-out: a staging") for k, f in _cache.items() if k[2] == str(path)]
    direct = all(not s.refs for s in staged)
    size = path.stat().st_size
    RESULTS["fanout"] = {
        "endpoints": len(targets),
        "staged_seconds": staging,
        "seconds": seconds,
        "transfers": len(staged),
        "direct": direct,
        "client_bytes": client,
    }
    assert shas == {want}, "a task saw other bytes"
    return [
        [
            f"the same file on {len(targets)} more endpoints at once, 16 tasks each",
            f"staged to both {staging:.2f} s ({len(targets) * size / staging / MB:.0f} MB/s "
            f"in all, {'endpoint to endpoint' if direct else 'via the client'}); "
            f"with the {16 * len(targets)} tasks {seconds:.2f} s",
            f"transfers: {len(staged)} for {len(targets) + 1} target endpoints; client "
            f"{client / MB:.2f} MB",
            "",
            "once per endpoint",
            "PASS" if len(staged) == len(targets) + 1 and direct else "MISS",
        ],
    ]


def made(size: int, out: Any = None) -> Any:
    """A task's output of ``size`` bytes: written to ``out`` (its name returned), or
    returned to the client when there is no ``out``."""
    blob = os.urandom(size)
    if out is None:
        return blob
    out.write_bytes(blob)
    return out.name


def put_file(path: str, blob: bytes) -> int:
    return Path(path).write_bytes(blob)


def out_rows(ex: Any, settings: Any, exported: Path, tasks: int = 16) -> list[list[str]]:
    """``tasks`` tasks on dataflow each make 1 MB for endpoint source: written there
    with ``out=nimbus.File("source:...")`` (sent endpoint to endpoint by the tasks'
    workers), against through the client (each task returns its bytes, the client
    sends them to a task on source that writes them), alternated, best of 3 each."""
    import nimbus
    from nimbus import Executor

    progress("out: out= files dataflow -> source")
    (exported / "out").mkdir(exist_ok=True)
    out = nimbus.File(f"source:{exported}/out/{{task_id}}.bin")
    directs, carried = [], []
    with Executor(endpoint="source", settings=settings) as on_source:
        for rep in range(3):
            sent = ex.statistics()["bytes_sent"] + ex.statistics()["bytes_received"]
            start = time.perf_counter()
            names = [
                result(f, "out: a task")
                for f in [ex.submit(made, MB, out=out) for _ in range(tasks)]
            ]
            directs.append(time.perf_counter() - start)
            client = ex.statistics()["bytes_sent"] + ex.statistics()["bytes_received"] - sent
            assert all((exported / "out" / n).stat().st_size == MB for n in names)
            start = time.perf_counter()
            blobs = [ex.submit(made, MB) for _ in range(tasks)]
            writes = [
                on_source.submit(
                    put_file, f"{exported}/out/c{rep}-{i}.bin", result(f, "out: a task")
                )
                for i, f in enumerate(blobs)
            ]
            assert {result(w, "out: a write") for w in writes} == {MB}
            carried.append(time.perf_counter() - start)
    direct, via = min(directs), min(carried)
    RESULTS["out"] = {
        "tasks": tasks,
        "bytes": MB,
        "direct_seconds": directs,
        "via_client_seconds": carried,
        "client_bytes": client,
    }
    return [
        [
            f"{tasks} tasks on dataflow write 1 MB out= files to source",
            f"{direct:.2f} s out= (endpoint to endpoint), {via:.2f} s through the client; "
            f"client {client / MB:.2f} MB",
            f"client carries the {tasks} MB twice instead",
            f"{via / direct:.2f}x",
            "faster than through the client",
            "PASS" if direct < via and client < MB else "MISS",
        ],
    ]


def mapreduce_runs(args: argparse.Namespace, workers: int, total: int, base: Path) -> Any:
    """The row's runs on nodes (``_mapreduce.on_nodes``), in a program of its own (its
    store is the machine's TCP one, not this program's): each run's figures as it ends."""
    import _sharedfs

    rate = args.mr_mbit * 1_000_000
    server_rate = (args.mr_server_mbit or workers * args.mr_mbit) * 1_000_000
    spec = {
        "jobs": args.mr_job or ["wordcount", "sort"],
        "w": workers,
        "total": total,
        "rounds": 1 if args.quick else args.mr_rounds,
        "rate": rate,
        "server_rate": server_rate,
        "base": str(base),
        "limit": WAIT,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIMBUS_")}
    env["NIMBUS_RUNTIME_DIR"] = str(base / "runtime")
    proc = subprocess.Popen(
        [sys.executable, str(_HERE / "_mapreduce.py"), json.dumps(spec)],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert proc.stdout is not None
    done = threading.Event()

    def watch() -> None:  # a run over its wait: the program stopped, the run ends hung
        if not done.wait(WAIT * 2 * 3 * args.mr_rounds + 120):
            proc.terminate()  # (it unmounts and removes its nodes on SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)
            hung("mapreduce on nodes", WAIT)

    threading.Thread(target=watch, daemon=True).start()
    try:
        for line in proc.stdout:
            figures = json.loads(line)
            if "start" in figures:
                progress(f"mapreduce: {figures['start']}")
            else:
                yield figures
    finally:
        done.set()
        if proc.poll() is None:
            proc.terminate()
        proc.wait()
    if proc.returncode:
        raise RuntimeError(
            f"mapreduce on nodes (bench/_mapreduce.py) exited with {proc.returncode}: "
            f"its error is above; {_sharedfs.__name__} needs root, /dev/fuse, sshfs, socat"
        )


def mapreduce_rows(args: argparse.Namespace) -> list[list[str]]:
    """WordCount and Sort, the shuffle three ways (``_mapreduce``), side by side: on 4
    nodes in network namespaces with shaped links, the shared directory a file server's
    over that network (``_sharedfs``); ``--mr-local``: all on this machine."""
    import _mapreduce as mr
    import _sharedfs

    workers = 4
    total = (16 if args.quick else args.mr_mb) * MB
    base = Path(os.environ.get("NIMBUS_BENCH_SHARED", "/var/tmp")) / f"nimbus-mr-{os.getpid()}"
    base.mkdir(parents=True, exist_ok=True)
    where = "on this machine: a local directory, Unix sockets"
    local = args.mr_local
    why = None if local else _sharedfs.missing()
    if why:  # said in the row: not the setting
        progress(f"mapreduce: no nodes here ({why}): all on this machine")
        where += f"; NO NODES: {why}"
        local = True
    if not local:
        where = (
            f"{workers} nodes, links {args.mr_mbit} Mbit/s; shared dir: a file server "
            f"({args.mr_server_mbit or workers * args.mr_mbit} Mbit/s) mounted by sshfs"
        )
    rows = []
    got: dict[str, dict[str, dict[str, Any]]] = {
        j: {} for j in args.mr_job or ["wordcount", "sort"]
    }

    def keep(one: dict[str, Any]) -> None:  # the best of the rounds
        mine = got[one["job"]]
        if one["way"] not in mine or one["seconds"] < mine[one["way"]]["seconds"]:
            mine[one["way"]] = one

    try:
        progress(f"mapreduce: {where}")
        if local:
            for job in got:
                for _ in range(1 if args.quick else args.mr_rounds):  # interleaved rounds
                    for way in ("shared", "store", "direct"):
                        progress(f"mapreduce: {job}, the shuffle through {way}")
                        try:
                            one = mr.run(job, way, workers, total // workers, base, limit=WAIT)
                        except mr.Stuck as exc:
                            hung(f"mapreduce: {job} through {way}: {exc}", WAIT)
                        keep(one | {"job": job, "way": way})
        else:
            for one in mapreduce_runs(args, workers, total, base):
                keep(one)
        for job, ways in got.items():
            assert len({g["result"] for g in ways.values()}) == 1, "the three ways disagree"
            RESULTS[f"mapreduce_{job}"] = ways | {"where": where}
            d, st, sh = (ways[w] for w in ("direct", "store", "shared"))
            vs_shared, vs_store = sh["seconds"] / d["seconds"], st["seconds"] / d["seconds"]
            links = (
                "; MB on the nodes' links d/st/sh "
                + "/".join(f"{x['node_links_bytes'] / MB:.0f}" for x in (d, st, sh))
                if "node_links_bytes" in d
                else ""
            )
            rows.append(
                [
                    f"MapReduce {job}, {total // MB} MB in, {workers} workers, "
                    f"{d['shuffled_bytes'] / MB:.1f} MB shuffled ({where})",
                    f"direct {d['seconds']:.2f} s (exchange {d['exchange']:.2f} s)",
                    f"shared dir {sh['seconds']:.2f} s ({sh['exchange']:.2f}); "
                    f"store {st['seconds']:.2f} s ({st['exchange']:.2f}){links}",
                    f"{vs_shared:.2f}x / {vs_store:.2f}x (exchanges "
                    f"{sh['exchange'] / d['exchange']:.2f}x / "
                    f"{st['exchange'] / d['exchange']:.2f}x)",
                    ">= 3x shared, >= 1.0x store",
                    "PASS" if vs_shared >= 3 and vs_store >= 1.0 else "MISS",
                ]
            )
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    return rows


# ---------------------------------------------------------------- endpoints in namespaces


class Isolated:
    """Endpoint agents each in a network namespace of its own (``--netns``): a
    ``nimbus.network.Link`` (a veth to the node, shaped both ways, the node's 127.0.0.1
    reachable, so the service is), forwarding on between the links (on their node-side
    devices only, which go with them), the agent taking data on its namespace's address.
    :meth:`close` stops the agents and removes every namespace."""

    def __init__(self, stack: Any, mbits: int) -> None:
        self.stack, self.rate = stack, mbits * 1_000_000
        self.links: list[Any] = []
        self.agents: list[subprocess.Popen[bytes]] = []

    def start_agent(self, name: str) -> tuple[list[str], str]:
        """Start endpoint ``name``'s agent in a new namespace: its prefix and address."""
        from nimbus.network import Link
        from nimbus.network._slots import claim

        link = Link.create(claim(9000 + len(self.links)), self.rate)
        self.links.append(link)
        with open(f"/proc/sys/net/ipv4/conf/{link.host_dev}/forwarding", "w") as f:
            f.write("1")  # from this namespace to the others' addresses, via the node
        prefix = ["ip", "netns", "exec", link.ns]
        self.stack.env["NIMBUS_DATA_HOST"] = link.worker_ip
        try:
            self.stack.start_agent(name, prefix)
        finally:
            del self.stack.env["NIMBUS_DATA_HOST"]
            if self.stack.agent is not None:
                self.agents.append(self.stack.agent)
        return prefix, link.worker_ip

    def close(self) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                agent.terminate()
                try:
                    agent.wait(30)
                except subprocess.TimeoutExpired:
                    agent.kill()
                    agent.wait()
        for link in self.links:
            link.close()
        self.links.clear()


# ---------------------------------------------------------------- main

RESULTS: dict[str, Any] = {}
FANOUT = ["dataflow2", "dataflow3"]  # with source and dataflow: the 4 endpoints


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument(
        "--only",
        action="append",
        choices=["big", "put", "campaign", "pipeline", "deps", "kv", "file", "mapreduce"],
    )
    parser.add_argument("--no-ray", action="store_true", help="nimbus only in the big row")
    parser.add_argument("--no-service", action="store_true", help="the local runtime only")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--file-mb", type=int, default=1024, help="the staged file's size")
    parser.add_argument(
        "--shaped",
        type=int,
        default=0,
        help="file row: the source endpoint in a network namespace (nimbus.network), its "
        "link shaped to this many Mbit/s (root); 0: loopback",
    )
    parser.add_argument(
        "--netns",
        type=int,
        default=0,
        help="every endpoint's agent in a network namespace of its own (nimbus.network's "
        "Link), its link shaped to this many Mbit/s both ways, taking data on its "
        "namespace's address (NIMBUS_DATA_HOST); endpoints reach each other through the "
        "node (root); 0: all on the node's loopback",
    )
    parser.add_argument("--mr-mb", type=int, default=1024, help="MapReduce input, all workers")
    parser.add_argument(
        "--mr-mbit", type=int, default=1000, help="MapReduce: each node's link, Mbit/s both ways"
    )
    parser.add_argument(
        "--mr-server-mbit",
        type=int,
        default=0,
        help="MapReduce: the file server's link, Mbit/s (0: the nodes' links together)",
    )
    parser.add_argument("--mr-rounds", type=int, default=2, help="MapReduce: rounds, best of")
    parser.add_argument(
        "--mr-job", action="append", choices=["wordcount", "sort"], help="MapReduce: only these"
    )
    parser.add_argument(
        "--mr-local",
        action="store_true",
        help="MapReduce all on this machine (a local directory, Unix sockets), no nodes",
    )
    parser.add_argument(
        "--wait",
        type=float,
        help=f"seconds any one wait may take before the run ends as hung (exit status 3, "
        f"every thread's stack on stderr); default {LONG_WAIT:.0f}, --quick {QUICK_WAIT:.0f}",
    )
    args = parser.parse_args()
    import signal

    global WAIT
    WAIT = args.wait or (QUICK_WAIT if args.quick else LONG_WAIT)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: where it waits
    # a SIGTERM ends the run as an exception does: the agents stopped, the namespaces gone
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    only = set(
        args.only or ["big", "put", "campaign", "pipeline", "deps", "kv", "file", "mapreduce"]
    )
    rows: list[list[str]] = []
    from nimbus import Executor

    if "big" in only:
        rows += bench_big(args)
    if "mapreduce" in only:
        rows += mapreduce_rows(args)
    if "campaign" in only:
        progress("campaign: a local Executor(2) starts")
        with Executor(2) as ex:
            rows += campaign_rows(ex, "local runtime", args)
    if not args.no_service and only & {"campaign", "put", "pipeline", "deps", "kv", "file"}:
        import service as stackmod  # bench/service.py: a service and an endpoint

        stack = stackmod.Stack(2)
        stack.env["NIMBUS_MAX_PAYLOAD"] = str(256 * MB)  # (the put row: 100 MB through the service)
        source = link = None
        prefix: list[str] = []
        isolated = Isolated(stack, args.netns)
        CLOSERS.append(isolated.close)
        dest: tuple[list[str], str] | None = None
        extra: list[subprocess.Popen[bytes]] = []  # the fan-out's agents
        try:
            progress("the service starts")
            stack.start_service()
            if "file" in only:  # a second endpoint that exports a directory
                import dataclasses

                from nimbus.endpoint.config import EndpointConfig

                exported = stack.root / "exported"
                exported.mkdir()
                stack.configure_endpoint("source")
                config = EndpointConfig.load("source")
                dataclasses.replace(config, exports=str(exported)).save()
                if args.netns:
                    prefix, _ = isolated.start_agent("source")
                elif args.shaped:  # the source agent behind a shaped veth (nimbus.network)
                    from nimbus.network import Link
                    from nimbus.network._slots import claim

                    link = Link.create(claim(9000), args.shaped * 1_000_000)
                    CLOSERS.append(link.close)
                    prefix = ["ip", "netns", "exec", link.ns]
                    stack.start_agent("source", prefix)
                else:
                    stack.start_agent("source")
                source = stack.agent
            progress("endpoint dataflow starts")
            stack.configure_endpoint("dataflow")
            if args.netns:
                dest = isolated.start_agent("dataflow")
            else:
                stack.start_agent("dataflow")
            for name in FANOUT if "file" in only else ():  # endpoints 3 and 4
                stack.configure_endpoint(name)
                if args.netns:
                    isolated.start_agent(name)
                else:
                    last = stack.agent
                    try:
                        stack.start_agent(name)
                    finally:  # stopped below; the stack's own agent stays dataflow's
                        if stack.agent is not None and stack.agent is not last:
                            extra.append(stack.agent)
                        stack.agent = last
            with Executor(endpoint="dataflow", settings=stack.settings) as ex:
                if "campaign" in only:
                    rows += campaign_rows(ex, "endpoint via service", args)
                if "put" in only:
                    rows += put_rows(ex, "dataflow", args)
                if "pipeline" in only:
                    rows += pipeline_rows(ex, args)
                if "deps" in only:
                    rows += deps_rows(ex, args)
                if "kv" in only:
                    rows += kv_rows(ex, args)
                if "file" in only:
                    rows += file_rows(ex, exported, args, prefix, dest)
                    rows += fanout_rows(stack.settings, exported, FANOUT)
                    rows += out_rows(ex, stack.settings, exported)
        finally:
            isolated.close()
            for agent in extra:
                if agent.poll() is None:
                    agent.terminate()
                    agent.wait(30)
            if source is not None and source.poll() is None:
                source.terminate()
                source.wait(30)
            stack.close()
            if link is not None:
                link.close()
    progress("done")
    print(grid(["workload", "nimbus", "Ray / bytes", "ratio", "target", ""], rows))
    if args.json:
        Path(args.json).write_text(json.dumps(RESULTS, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
