"""nimbus.multiprocessing against the stdlib's multiprocessing (fork context).

Both run in this one process, workload after workload; within a workload the
repeats alternate stdlib, nimbus, stdlib, nimbus, ... so drift on a loaded
machine hits both sides alike. The figure reported is the median of the
repeats, and the ratio is always nimbus / stdlib (whether higher or lower is
better is given per row, in the target column).

    python bench/multiprocessing.py                      # full run, 3 repeats
    python bench/multiprocessing.py --quick --repeat 1   # smoke run
    python bench/multiprocessing.py --only pipe_rtt --only lock --json out.json

nimbus is warmed once before anything is timed: its first Process start +
join starts the embedded Redis and the warm workers, and is reported as its
own row ("cold start"). The "new program" rows run a new interpreter per
repeat (``_cold.py``), as a user's program starts: its first Process start +
join, or its Pool(4) map of 64 no-ops, with and without its import. Every workload runs under a time limit (SIGALRM); a
workload that crashes or hangs shows ERROR and the others still run.

This file is called ``multiprocessing.py``, so the directory it sits in must
not be on ``sys.path`` (``import multiprocessing`` would import this file, and
nimbus hands ``sys.path`` to its workers): the first thing it does is drop it.
The worker functions are module level, so forked stdlib children have them and
nimbus ships them by value or imports this file as ``__mp_main__``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import gc  # noqa: E402
import heapq  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

sys.path.append(str(_HERE))  # after the stdlib: for _report, never for multiprocessing
from _report import Figures, Judge, WorkloadTimeout, grid, within  # noqa: E402

SORT_PROCS = 4
SORT_SEED = 20261121

# --- worker functions (run in the child processes) ----------------------------------------------


def noop(*args: object) -> None:
    """Do nothing."""


def sleep1(x: object) -> object:
    time.sleep(1)
    return x


def echo_loop(conn: Any) -> None:
    """Send back every message until None."""
    while True:
        msg = conn.recv()
        if msg is None:
            break
        conn.send(msg)
    conn.close()


def queue_producer(q: Any, ctrl: Any, n: int) -> None:
    q.put("ready")
    ctrl.get()
    for i in range(n):
        q.put(i)
    q.put(None)


def dict_child(d: Any, n: int) -> None:
    """n set+get pairs on a manager dict; store the mean seconds per pair in d['_res']."""
    clock = time.perf_counter
    t0 = clock()
    for i in range(n):
        d["k"] = i
        if d["k"] != i:
            raise RuntimeError("manager dict returned a different value")
    d["_res"] = (clock() - t0) / n


def sort_inplace(arr: Any, lo: int, hi: int) -> None:
    """Sort arr[lo:hi] in place, every read and write an element access of the shared array.

    Iterative quicksort (Hoare partition, middle pivot), insertion sort below 16 items.
    """
    stack = [(lo, hi - 1)]
    while stack:
        lo, hi = stack.pop()
        if hi - lo < 16:
            for i in range(lo + 1, hi + 1):
                x = arr[i]
                j = i - 1
                while j >= lo:
                    y = arr[j]
                    if y <= x:
                        break
                    arr[j + 1] = y
                    j -= 1
                arr[j + 1] = x
            continue
        pivot = arr[(lo + hi) // 2]
        i, j = lo, hi
        while i <= j:
            while arr[i] < pivot:
                i += 1
            while arr[j] > pivot:
                j -= 1
            if i <= j:
                a, b = arr[i], arr[j]
                arr[i], arr[j] = b, a
                i += 1
                j -= 1
        stack.append((lo, j))
        stack.append((i, hi))


def sort_copy(arr: Any, lo: int, hi: int) -> None:
    """Copy arr[lo:hi] out, sort it locally, write it back."""
    local = arr[lo:hi]
    local.sort()
    arr[lo:hi] = local


def sort_pipe(conn: Any) -> None:
    """Receive a list, send it back sorted."""
    data = conn.recv()
    data.sort()
    conn.send(data)
    conn.close()


# --- sizes --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    process_n: int = 50
    pipe_sizes: tuple[tuple[str, int, int], ...] = (
        ("1KB", 1024, 1000),
        ("1MB", 1024 * 1024, 30),
        ("100MB", 100 * 1024 * 1024, 3),
    )
    kept_sizes: tuple[tuple[str, int, int], ...] = (
        ("64B", 64, 2000),
        ("1KB", 1024, 2000),
        ("1MB", 1024 * 1024, 50),
    )
    queue_items: int = 100_000
    lock_n: int = 10_000
    dict_pairs: int = 2_000
    sort_n: int = 1_000_000
    sort_inplace_n: int = 10_000


QUICK = Sizes(
    process_n=10,
    pipe_sizes=(("1KB", 1024, 200), ("1MB", 1024 * 1024, 10), ("10MB", 10 * 1024 * 1024, 2)),
    kept_sizes=(("64B", 64, 500), ("1KB", 1024, 500), ("1MB", 1024 * 1024, 10)),
    queue_items=10_000,
    lock_n=1_000,
    dict_pairs=200,
    sort_n=100_000,
    sort_inplace_n=2_000,
)


# --- workloads: each runs once on one side and returns {row name: figure} -----------------------


def run_pool_map64(mp: Any, sizes: Sizes) -> dict[str, float]:
    t0 = time.perf_counter()
    with mp.Pool(4) as pool:
        out = pool.map(noop, range(64))
        pool.close()
        pool.join()
    elapsed = time.perf_counter() - t0
    if out != [None] * 64:
        raise RuntimeError(f"map returned {out!r}")
    return {"pool_map64": elapsed}


def run_pool_sleep(mp: Any, sizes: Sizes) -> dict[str, float]:
    with mp.Pool(4) as pool:
        t0 = time.perf_counter()
        out = pool.map(sleep1, range(8))
        elapsed = time.perf_counter() - t0
        pool.close()
        pool.join()
    if out != list(range(8)):
        raise RuntimeError(f"map returned {out!r}")
    return {"pool_sleep": elapsed}


def _process_once(mp: Any) -> float:
    t0 = time.perf_counter()
    p = mp.Process(target=noop)
    p.start()
    p.join()
    elapsed = time.perf_counter() - t0
    if p.exitcode != 0:
        raise RuntimeError(f"no-op process exited with {p.exitcode}")
    return elapsed


def run_process(mp: Any, sizes: Sizes) -> dict[str, float]:
    return {"process": statistics.median(_process_once(mp) for _ in range(sizes.process_n))}


def _pipe_rtt(
    mp: Any, pipe_sizes: tuple[tuple[str, int, int], ...], *, keep: bool, prefix: str
) -> dict[str, float]:
    """Round trips to an echoing child; ``keep``: the parent keeps its copy of the
    child's end (the stdlib documentation's idiom), else it closes it."""
    parent, child = mp.Pipe()
    p = mp.Process(target=echo_loop, args=(child,))
    p.start()
    if not keep:
        child.close()
    result = {}
    try:
        for _ in range(20):  # the child is up and both ends are warm
            parent.send(b"w")
            parent.recv()
        for label, size, n in pipe_sizes:
            payload = os.urandom(size)
            samples = []
            for _ in range(n):
                t0 = time.perf_counter()
                parent.send(payload)
                back = parent.recv()
                samples.append(time.perf_counter() - t0)
                if len(back) != size:
                    raise RuntimeError(f"echo returned {len(back)} bytes, sent {size}")
            if back != payload:
                raise RuntimeError("echo returned different bytes")
            del back, payload
            result[f"{prefix} {label}"] = statistics.median(samples)
    finally:
        parent.send(None)
        p.join(5)
        if p.is_alive():  # after a failure: the child may be stuck sending
            p.terminate()
            p.join(5)
        if keep:
            child.close()
    return result


def run_pipe_rtt(mp: Any, sizes: Sizes) -> dict[str, float]:
    return _pipe_rtt(mp, sizes.pipe_sizes, keep=False, prefix="pipe_rtt")


def run_pipe_kept(mp: Any, sizes: Sizes) -> dict[str, float]:
    return _pipe_rtt(mp, sizes.kept_sizes, keep=True, prefix="pipe_kept")


def run_pipe_store(mp: Any, sizes: Sizes) -> dict[str, float]:
    """nimbus's kept-copy round trips through the state store (on the stdlib's side of
    the table: ``NIMBUS_MESSAGING_DIRECT=0``, children inherit it) against direct."""
    if mp is import_nimbus():
        return _pipe_rtt(mp, sizes.kept_sizes, keep=True, prefix="pipe_store")
    os.environ["NIMBUS_MESSAGING_DIRECT"] = "0"
    try:
        return _pipe_rtt(import_nimbus(), sizes.kept_sizes, keep=True, prefix="pipe_store")
    finally:
        del os.environ["NIMBUS_MESSAGING_DIRECT"]


def run_queue(mp: Any, sizes: Sizes) -> dict[str, float]:
    n = sizes.queue_items
    q = mp.Queue()
    ctrl = mp.Queue()
    p = mp.Process(target=queue_producer, args=(q, ctrl, n))
    p.start()
    if q.get() != "ready":
        raise RuntimeError("producer did not say ready")
    t0 = time.perf_counter()
    ctrl.put("go")
    got = 0
    expected = 0
    while True:
        item = q.get()
        if item is None:
            break
        if item != expected:
            raise RuntimeError(f"queue item {item!r}, expected {expected}")
        expected += 1
        got += 1
    elapsed = time.perf_counter() - t0
    p.join()
    if got != n:
        raise RuntimeError(f"got {got} items, expected {n}")
    return {"queue": n / elapsed}


def _new_program(mp: Any, workload: str) -> dict[str, float]:
    """Run ``_cold.py`` (a new program) on ``mp``'s side; its import and workload seconds."""
    side = "stdlib" if mp is multiprocessing.get_context("fork") else "nimbus"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # nimbus, as this one has it
    out = subprocess.run(
        [sys.executable, str(_HERE / "_cold.py"), side, workload],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        raise RuntimeError(f"_cold.py {side} {workload} exited {out.returncode}: {out.stderr}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def run_new_process(mp: Any, sizes: Sizes) -> dict[str, float]:
    figures = _new_program(mp, "process")
    return {
        "new program: Process": figures["run"],
        "new program: Process, with import": figures["import"] + figures["run"],
    }


def run_new_pool(mp: Any, sizes: Sizes) -> dict[str, float]:
    figures = _new_program(mp, "pool_map64")
    return {
        "new program: Pool map64": figures["run"],
        "new program: Pool map64, with import": figures["import"] + figures["run"],
    }


def run_lock(mp: Any, sizes: Sizes) -> dict[str, float]:
    lock = mp.Lock()
    for _ in range(20):
        lock.acquire()
        lock.release()
    t0 = time.perf_counter()
    for _ in range(sizes.lock_n):
        lock.acquire()
        lock.release()
    return {"lock": (time.perf_counter() - t0) / sizes.lock_n}


def run_manager_dict(mp: Any, sizes: Sizes) -> dict[str, float]:
    manager = mp.Manager()
    try:
        d = manager.dict()
        p = mp.Process(target=dict_child, args=(d, sizes.dict_pairs))
        p.start()
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"dict child exited with {p.exitcode}")
        return {"manager_dict": d["_res"]}
    finally:
        manager.shutdown()


_DATA: dict[int, tuple[list[int], list[int]]] = {}


def _sort_data(n: int) -> tuple[list[int], list[int]]:
    """n random ints that fit an Array('i'), and their sorted list (cached)."""
    if n not in _DATA:
        rng = random.Random(SORT_SEED)
        data = [rng.randrange(2**31 - 1) for _ in range(n)]
        _DATA[n] = (data, sorted(data))
    return _DATA[n]


def _bounds(n: int) -> list[tuple[int, int]]:
    step = -(-n // SORT_PROCS)
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def _sort_array(mp: Any, n: int, worker: Callable[[Any, int, int], None]) -> float:
    data, expected = _sort_data(n)
    t0 = time.perf_counter()
    arr = mp.Array("i", data)
    bounds = _bounds(n)
    procs = [mp.Process(target=worker, args=(arr, lo, hi)) for lo, hi in bounds]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    flat = arr[:]
    merged = list(heapq.merge(*(flat[lo:hi] for lo, hi in bounds)))
    elapsed = time.perf_counter() - t0
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"sort workers exited with {[p.exitcode for p in procs]}")
    if merged != expected:
        raise RuntimeError("sorted result differs from sorted(data)")
    return elapsed


def _sort_pipes(mp: Any, n: int) -> float:
    data, expected = _sort_data(n)
    t0 = time.perf_counter()
    bounds = _bounds(n)
    ends = [mp.Pipe() for _ in bounds]
    procs = [mp.Process(target=sort_pipe, args=(child,)) for _, child in ends]
    for p in procs:
        p.start()
    for (parent, child), (lo, hi) in zip(ends, bounds):
        child.close()
        parent.send(data[lo:hi])
    parts = [parent.recv() for parent, _ in ends]
    for p in procs:
        p.join()
    merged = list(heapq.merge(*parts))
    elapsed = time.perf_counter() - t0
    if merged != expected:
        raise RuntimeError("sorted result differs from sorted(data)")
    return elapsed


def run_sort(mp: Any, sizes: Sizes) -> dict[str, float]:
    return {
        "sort (a) shared Array in place": _sort_array(mp, sizes.sort_inplace_n, sort_inplace),
        "sort (b) Array, local copy": _sort_array(mp, sizes.sort_n, sort_copy),
        "sort (c) Pipes": _sort_pipes(mp, sizes.sort_n),
    }


Workload = Callable[[Any, Sizes], dict[str, float]]
WORKLOADS: dict[str, tuple[Workload, float]] = {  # name: (function, time limit per run in s)
    "new_process": (run_new_process, 120),
    "new_pool": (run_new_pool, 120),
    "pool_map64": (run_pool_map64, 30),
    "pool_sleep": (run_pool_sleep, 30),
    "process": (run_process, 30),
    "pipe_rtt": (run_pipe_rtt, 120),
    "pipe_kept": (run_pipe_kept, 120),
    "pipe_store": (run_pipe_store, 120),
    "queue": (run_queue, 60),
    "lock": (run_lock, 30),
    "manager_dict": (run_manager_dict, 30),
    "sort": (run_sort, 180),
}


# --- rows ---------------------------------------------------------------------------------------


@dataclass
class Row(Figures):
    name: str
    workload: str
    title: str
    unit: str  # "s", "ms", "us" or "items/s"
    higher_is_better: bool
    target: str
    judge: Judge | None  # of nimbus / stdlib; None: report
    baseline: list[float] = field(default_factory=list)  # the stdlib's
    nimbus: list[float] = field(default_factory=list)
    error: str = ""


def build_rows(sizes: Sizes) -> list[Row]:
    rows = [
        Row(
            "new program: Process",
            "new_process",
            "a new program's first Process start + join (after its import)",
            "s",
            False,
            "<= 17x",  # issue 16: <= 50 ms, the stdlib's 3 ms
            lambda r: r <= 17,
        ),
        Row(
            "new program: Process, with import",
            "new_process",
            "the same, with the program's import of the module",
            "s",
            False,
            "report",
            None,
        ),
        Row(
            "new program: Pool map64",
            "new_pool",
            "a new program's Pool(4): map 64 no-ops, close, join (after its import)",
            "s",
            False,
            "<= 4.6x",  # issue 16: <= 0.06 s, the stdlib's 0.013 s
            lambda r: r <= 4.6,
        ),
        Row(
            "new program: Pool map64, with import",
            "new_pool",
            "the same, with the program's import of the module",
            "s",
            False,
            "report",
            None,
        ),
        Row(
            "pool_map64",
            "pool_map64",
            "with Pool(4): map 64 no-ops, close, join",
            "s",
            False,
            "<= 1.2x",
            lambda r: r <= 1.2,
        ),
        Row(
            "pool_sleep",
            "pool_sleep",
            "Pool(4) map 8 x sleep(1), wall time (ideal 2 s)",
            "s",
            False,
            "<= 1.025x",  # was nimbus <= 50 ms above the ideal 2 s: 2.05 / 2
            lambda r: r <= 1.025,
        ),
        Row(
            "process",
            "process",
            f"no-op Process start + join, median of {sizes.process_n}",
            "ms",
            False,
            "<= 1.0x",  # was nimbus <= 10 ms, the stdlib's own 9-11 ms
            lambda r: r <= 1.0,
        ),
    ]
    for label, _size, count in sizes.pipe_sizes:
        is_1kb = label == "1KB"
        rows.append(
            Row(
                f"pipe_rtt {label}",
                "pipe_rtt",
                f"Pipe round trip {label} to a child, median of {count}",
                "us" if is_1kb else "ms",
                False,
                "<= 1.3x" if is_1kb else "report",  # was <= 130 us; messaging.py's 1.3x
                (lambda r: r <= 1.3) if is_1kb else None,
            )
        )
    for label, _size, count in sizes.kept_sizes:
        rows.append(
            Row(
                f"pipe_kept {label}",
                "pipe_kept",
                f"Pipe round trip {label}, parent keeps the child's end, median of {count}",
                "us",
                False,
                "<= 1.0x",  # issue 16: the documentation's idiom as fast as the stdlib
                lambda r: r <= 1.0,
            )
        )
    for label, _size, _count in sizes.kept_sizes:
        rows.append(
            Row(
                f"pipe_store {label}",
                "pipe_store",
                f"as pipe_kept {label}; 'stdlib' column: nimbus through the store",
                "us",
                False,
                "<= 0.2x",  # direct against NIMBUS_MESSAGING_DIRECT=0
                lambda r: r <= 0.2,
            )
        )
    rows += [
        Row(
            "queue",
            "queue",
            f"Queue: {sizes.queue_items:,} ints, child -> parent",
            "items/s",
            True,
            ">= 0.9x",
            lambda r: r >= 0.9,
        ),
        Row(
            "lock",
            "lock",
            f"Lock acquire + release, mean of {sizes.lock_n:,}",
            "us",
            False,
            "<= 50x",  # issue 16: <= 2 us, the stdlib's 0.04 us (was <= 100x: the store's)
            lambda r: r <= 50.0,
        ),
        Row(
            "manager_dict",
            "manager_dict",
            f"Manager dict set + get pair in a child, mean of {sizes.dict_pairs:,}",
            "us",
            False,
            "<= 2x",
            lambda r: r <= 2.0,
        ),
        Row(
            "sort (a) shared Array in place",
            "sort",
            f"{sizes.sort_inplace_n:,} ints, {SORT_PROCS} procs sort slices of a shared Array",
            "s",
            False,
            "report",
            None,
        ),
        Row(
            "sort (b) Array, local copy",
            "sort",
            f"{sizes.sort_n:,} ints, {SORT_PROCS} procs copy a slice out, sort, write back",
            "s",
            False,
            "report",
            None,
        ),
        Row(
            "sort (c) Pipes",
            "sort",
            f"{sizes.sort_n:,} ints, {SORT_PROCS} slices sent over Pipes, sorted, sent back",
            "s",
            False,
            "report",
            None,
        ),
    ]
    return rows


# --- time limits --------------------------------------------------------------------------------


def reap_children() -> None:
    """After a failure: terminate what the failed run left behind (nimbus's processes too)."""
    try:
        children = within(10, multiprocessing.active_children)
        for child in children:
            try:
                within(10, child.terminate)
                within(10, lambda c=child: c.join(5))
            except BaseException:
                pass
    except BaseException:
        pass


# --- nimbus -------------------------------------------------------------------------------------


def import_nimbus() -> Any:
    try:
        import nimbus.multiprocessing as nmp
    except ImportError:
        src = str(_HERE.parent / "src")
        if src in sys.path:
            raise
        sys.path.insert(0, src)
        import nimbus.multiprocessing as nmp
    return nmp


# --- output -------------------------------------------------------------------------------------


def print_table(rows: list[Row], args: argparse.Namespace, notes: list[str]) -> None:
    print(
        f"\nnimbus.multiprocessing vs stdlib multiprocessing (fork context): "
        f"median of {args.repeat} repeat(s){', quick sizes' if args.quick else ''}"
    )
    print(f"Python {platform.python_version()} on {platform.system()}, {os.cpu_count()} CPUs")
    for note in notes:
        print(note)
    print("ratio = nimbus / stdlib; the target says which side of it passes\n")
    header = ("workload", "what", "stdlib", "nimbus", "ratio", "target", "result")
    lines = [(row.name, row.what, *row.figure_cells()) for row in rows]
    print(grid(header, lines))
    for row in rows:
        if row.error:
            print(f"\n{row.name}: {row.error}")


def write_json(path: str, rows: list[Row], args: argparse.Namespace, sizes: Sizes) -> None:
    doc = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "repeat": args.repeat,
        "quick": args.quick,
        "sizes": sizes.__dict__,
        "rows": [
            {
                "name": r.name,
                "title": r.title,
                "unit": "items/s" if r.unit == "items/s" else "s",
                "higher_is_better": r.higher_is_better,
                "stdlib": r.baseline,
                "nimbus": r.nimbus,
                "stdlib_median": r.baseline_median,
                "nimbus_median": r.nimbus_median,
                "ratio": r.ratio,
                "target": r.target,
                "status": r.status,
                "error": r.error,
            }
            for r in rows
        ],
    }
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


# --- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="repeats; median reported (3)")
    parser.add_argument(
        "--only",
        action="append",
        choices=list(WORKLOADS),
        metavar="NAME",
        help=", ".join(WORKLOADS),
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes for a smoke run")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument(
        "--inplace-n",
        type=int,
        metavar="N",
        help="ints for sort (a), the in-place sort of a shared Array "
        f"(default {Sizes.sort_inplace_n:,}; quick {QUICK.sort_inplace_n:,})",
    )
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = QUICK if args.quick else Sizes()
    if args.inplace_n:
        sizes = Sizes(**{**sizes.__dict__, "sort_inplace_n": args.inplace_n})
    stdlib_mp = multiprocessing.get_context("fork")
    try:
        nmp = import_nimbus()
    except ImportError as exc:
        print(f"cannot import nimbus.multiprocessing ({exc})", file=sys.stderr)
        return 2
    notes = [f"load average at start: {os.getloadavg()[0]:.2f}"]
    cold = Row(
        "cold start",
        "cold",
        "first Process start + join (nimbus: embedded Redis + warm workers)",
        "s",
        False,
        "report",
        None,
    )
    workloads = [w for w in WORKLOADS if not args.only or w in args.only]
    rows = [r for r in build_rows(sizes) if r.workload in workloads]
    by_name = {r.name: r for r in rows}
    timed_out = False

    print("cold start: first Process start + join, stdlib then nimbus", file=sys.stderr)
    try:
        cold.baseline.append(within(60, lambda: _process_once(stdlib_mp)))
        cold.nimbus.append(within(120, lambda: _process_once(nmp)))
        notes.append(
            "nimbus was pre-warmed by that first Process start + join (the cold start row)"
        )
    except BaseException as exc:
        traceback.print_exc()
        cold.error = f"{type(exc).__name__}: {exc}"
        timed_out |= isinstance(exc, WorkloadTimeout)
        reap_children()

    for name in workloads:
        fn, limit = WORKLOADS[name]
        mine = [r for r in rows if r.workload == name]
        print(f"running {name} ...", file=sys.stderr, flush=True)
        try:
            for _ in range(args.repeat):
                for side, mp in (("baseline", stdlib_mp), ("nimbus", nmp)):
                    gc.collect()
                    t0 = time.perf_counter()
                    try:
                        figures = within(limit, lambda fn=fn, mp=mp: fn(mp, sizes))
                    except BaseException as exc:
                        who = "stdlib" if side == "baseline" else side
                        raise RuntimeError(
                            f"{who}: {type(exc).__name__}: {exc} "
                            f"(after {time.perf_counter() - t0:.1f} s)"
                        ) from exc
                    for row_name, value in figures.items():
                        getattr(by_name[row_name], side).append(value)
        except Exception as exc:  # a crash in one workload must not hide the others
            traceback.print_exc()
            for row in mine:
                row.error = str(exc)
            timed_out |= isinstance(exc.__cause__, WorkloadTimeout)
            reap_children()

    notes.append(f"load average at end: {os.getloadavg()[0]:.2f}")
    print_table([cold, *rows], args, notes)
    if args.json:
        write_json(args.json, [cold, *rows], args, sizes)
    code = 1 if cold.error or any(r.error for r in rows) else 0
    if timed_out:  # a hung nimbus call may keep a thread or the exit handlers waiting
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
