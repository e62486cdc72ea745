"""nimbus.executor.Executor against concurrent.futures.ProcessPoolExecutor.

Both run in this one process, workload after workload; within a workload the
repeats alternate PPE, nimbus, PPE, nimbus, ... so drift on a loaded machine
hits both sides alike. Each repeat uses a fresh executor. The figure reported
is the median of the repeats, and the ratio is always nimbus / PPE (whether
higher or lower is better is given per row, in the target column).

PPE uses the fork context (the Linux default) except in the ``startup`` row,
whose baseline is the spawn context.

Every row but two warms its executor first (every worker up and has run a
task). ``startup`` and ``spread`` do not: ``spread`` hands a fresh executor
2 x workers long sleeps at once and is judged against the same sleeps on a fresh
ProcessPoolExecutor (which spreads them ideally: 1.01x); the ratio of each to the
ideal (the sleeps spread evenly over the workers) is printed under the table.

    python bench/executor.py                      # full run, 3 repeats
    python bench/executor.py --quick --repeat 1   # smoke run
    python bench/executor.py --baseline-only      # PPE only
    python bench/executor.py --only roundtrip --only map --json out.json

The task functions below are module level, so PPE's spawned children (which
import this file as ``__mp_main__``) and forked children find them. Keep the
top of this module cheap: nimbus is imported only when it is used.
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/multiprocessing.py sits beside this file: keep this directory off sys.path,
# or ``import multiprocessing`` would import it (nimbus hands sys.path to workers too)
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

sys.path.append(str(_HERE))  # after the stdlib: for _report, never for multiprocessing
from _report import Figures, Judge, grid  # noqa: E402

RESULT_TIMEOUT = 300.0  # seconds to wait for any one result before calling it a crash
SLEEP_SECONDS = 0.01
# The sleep row was "nimbus <= 1.05 x the ideal": PPE sleeps the same sleeps beside
# it (its overshoot is the machine's), so the 5% is now over PPE.
SLEEP_OVER_PPE = 1.05


# --- task functions (run in the workers) --------------------------------------------------------


def noop(*args: object, **kwargs: object) -> None:
    """Do nothing."""


def sleep_task(seconds: float) -> None:
    time.sleep(seconds)


def echo(value: object) -> object:
    return value


# --- sizes --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    roundtrip_calls: int = 2_000
    throughput_tasks: int = 10_000
    map_items: int = 100_000
    map_chunksize: int = 100
    sleep_tasks: int = 200
    bigarg_bytes: int = 100 * 1024 * 1024
    spread_seconds: float = 1.0


QUICK = Sizes(
    roundtrip_calls=200,
    throughput_tasks=1_000,
    map_items=10_000,
    sleep_tasks=40,
    bigarg_bytes=10 * 1024 * 1024,
    spread_seconds=0.5,
)

ExecutorFactory = Callable[[], concurrent.futures.Executor]


# --- workloads: each returns one figure for one fresh executor ----------------------------------


def _warm(ex: concurrent.futures.Executor, workers: int) -> None:
    """Make sure every worker is up and has run a task."""
    futures = [ex.submit(sleep_task, 0.02) for _ in range(workers)]
    futures += [ex.submit(noop) for _ in range(50)]
    for fut in futures:
        fut.result(timeout=RESULT_TIMEOUT)


def run_roundtrip(make: ExecutorFactory, sizes: Sizes, workers: int) -> float:
    """Median seconds of one sequential submit(noop).result()."""
    with make() as ex:
        _warm(ex, workers)
        for _ in range(200):
            ex.submit(noop).result(timeout=RESULT_TIMEOUT)
        samples = []
        clock = time.perf_counter
        for _ in range(sizes.roundtrip_calls):
            t0 = clock()
            ex.submit(noop).result(timeout=RESULT_TIMEOUT)
            samples.append(clock() - t0)
    return statistics.median(samples)


def run_throughput(make: ExecutorFactory, sizes: Sizes, workers: int) -> float:
    """Tasks per second: submit all no-ops, then wait for every result."""
    with make() as ex:
        _warm(ex, workers)
        t0 = time.perf_counter()
        futures = [ex.submit(noop) for _ in range(sizes.throughput_tasks)]
        for fut in futures:
            fut.result(timeout=RESULT_TIMEOUT)
        elapsed = time.perf_counter() - t0
    return sizes.throughput_tasks / elapsed


def run_map(make: ExecutorFactory, sizes: Sizes, workers: int) -> float:
    """Items per second through map(noop, range(n), chunksize=...)."""
    with make() as ex:
        _warm(ex, workers)
        t0 = time.perf_counter()
        results = list(
            ex.map(
                noop, range(sizes.map_items), chunksize=sizes.map_chunksize, timeout=RESULT_TIMEOUT
            )
        )
        elapsed = time.perf_counter() - t0
    if len(results) != sizes.map_items:
        raise RuntimeError(f"map returned {len(results)} results, expected {sizes.map_items}")
    return sizes.map_items / elapsed


def run_sleep(make: ExecutorFactory, sizes: Sizes, workers: int) -> float:
    """Wall seconds for sleep_tasks x time.sleep(0.01)."""
    with make() as ex:
        _warm(ex, workers)
        t0 = time.perf_counter()
        futures = [ex.submit(sleep_task, SLEEP_SECONDS) for _ in range(sizes.sleep_tasks)]
        for fut in futures:
            fut.result(timeout=RESULT_TIMEOUT)
        elapsed = time.perf_counter() - t0
    return elapsed


_PAYLOAD: dict[int, bytes] = {}


def run_bigarg(make: ExecutorFactory, sizes: Sizes, workers: int) -> float:
    """Median seconds of 3 echo(payload) round trips of a large random bytes object."""
    payload = _PAYLOAD.get(sizes.bigarg_bytes)
    if payload is None:
        payload = _PAYLOAD[sizes.bigarg_bytes] = os.urandom(sizes.bigarg_bytes)
    with make() as ex:
        _warm(ex, workers)
        ex.submit(echo, payload[: 1024 * 1024]).result(timeout=RESULT_TIMEOUT)
        samples = []
        for _ in range(3):
            t0 = time.perf_counter()
            result = ex.submit(echo, payload).result(timeout=RESULT_TIMEOUT)
            samples.append(time.perf_counter() - t0)
            if result != payload:
                raise RuntimeError("echo returned different bytes")
            del result
    return statistics.median(samples)


def run_startup(make: ExecutorFactory, sizes: Sizes, workers: int) -> float:
    """Seconds from creating an executor to its first result (shutdown not timed)."""
    t0 = time.perf_counter()
    ex = make()
    try:
        ex.submit(noop).result(timeout=RESULT_TIMEOUT)
        elapsed = time.perf_counter() - t0
    finally:
        ex.shutdown(wait=True)
    return elapsed


_FIRST_STARTS: list[float] = []  # spread: seconds from creating a nimbus executor to a task


def run_spread(make: ExecutorFactory, sizes: Sizes, workers: int) -> float:
    """Seconds from creating an executor to the last of 2 x workers long sleeps given at once.

    No warm-up: the workers may still be starting when the tasks come. Shutdown
    is not timed. For nimbus, when its first task started is kept too (the
    workers' start-up, the rest of the figure beyond the ideal).
    """
    created = time.time()
    t0 = time.perf_counter()
    ex = make()
    try:
        futures = [ex.submit(sleep_task, sizes.spread_seconds) for _ in range(2 * workers)]
        for fut in futures:
            fut.result(timeout=RESULT_TIMEOUT)
        elapsed = time.perf_counter() - t0
    finally:
        ex.shutdown(wait=True)
    records = [getattr(fut, "record", None) for fut in futures]
    if all(records):
        _FIRST_STARTS.append(min(r.started for r in records) - created)  # type: ignore[union-attr]
    return elapsed


# --- rows ---------------------------------------------------------------------------------------


@dataclass
class Row(Figures):
    name: str
    title: str
    unit: str  # "us", "s" or "tasks/s"
    higher_is_better: bool
    run: Callable[[ExecutorFactory, Sizes, int], float]
    ppe_context: str
    target: str
    judge: Judge | None  # nimbus / ppe -> pass
    ideal: float | None = None  # the best possible figure, when the row is judged against it
    baseline: list[float] = field(default_factory=list)  # ProcessPoolExecutor's
    nimbus: list[float] = field(default_factory=list)
    error: str = ""


def build_rows(sizes: Sizes, workers: int) -> list[Row]:
    sleep_ideal = sizes.sleep_tasks * SLEEP_SECONDS / workers
    mb = sizes.bigarg_bytes // (1024 * 1024)
    spread_ideal = 2 * sizes.spread_seconds
    return [
        Row(
            "roundtrip",
            f"no-op round trip, median of {sizes.roundtrip_calls:,}",
            "us",
            False,
            run_roundtrip,
            "fork",
            "<= 1.0x",
            lambda r: r <= 1.0,
        ),
        Row(
            "throughput",
            f"{sizes.throughput_tasks:,} no-op submits, then results",
            "tasks/s",
            True,
            run_throughput,
            "fork",
            ">= 1.0x",
            lambda r: r >= 1.0,
        ),
        Row(
            "map",
            f"map {sizes.map_items:,} no-ops, chunksize {sizes.map_chunksize}",
            "tasks/s",
            True,
            run_map,
            "fork",
            ">= 0.8x",
            lambda r: r >= 0.8,
        ),
        Row(
            "sleep",
            f"{sizes.sleep_tasks} x sleep({SLEEP_SECONDS}) on {workers} workers",
            "s",
            False,
            run_sleep,
            "fork",
            f"<= {SLEEP_OVER_PPE}x (ideal {sleep_ideal:.2f} s)",
            lambda r: r <= SLEEP_OVER_PPE,
        ),
        Row(
            "bigarg",
            f"{mb} MB bytes argument + result round trip, median of 3",
            "s",
            False,
            run_bigarg,
            "fork",
            "<= 1.0x",
            lambda r: r <= 1.0,
        ),
        Row(
            "startup",
            "new executor to first result",
            "s",
            False,
            run_startup,
            "spawn",
            "<= 1.0x",
            lambda r: r <= 1.0,
        ),
        Row(
            "spread",
            f"fresh executor, no warm-up: {2 * workers} x sleep({sizes.spread_seconds:g}) "
            f"on {workers} workers",
            "s",
            False,
            run_spread,
            "fork",
            f"<= {SLEEP_OVER_PPE}x (ideal {spread_ideal:.2f} s)",
            lambda r: r <= SLEEP_OVER_PPE,
            ideal=spread_ideal,
        ),
    ]


WORKLOADS = ("roundtrip", "throughput", "map", "sleep", "bigarg", "startup", "spread")


# --- executors ----------------------------------------------------------------------------------


def ppe_factory(context: str, workers: int) -> ExecutorFactory:
    ctx = multiprocessing.get_context(context)
    return lambda: concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx)


def nimbus_factory(workers: int) -> ExecutorFactory:
    try:
        from nimbus.executor import Executor
    except ImportError:
        src = str(Path(__file__).resolve().parents[1] / "src")
        if src in sys.path:
            raise
        sys.path.insert(0, src)
        from nimbus.executor import Executor
    return lambda: Executor(workers)


# --- output -------------------------------------------------------------------------------------


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    print(
        f"nimbus vs concurrent.futures.ProcessPoolExecutor: {args.workers} workers, "
        f"median of {args.repeat} repeat(s){', quick sizes' if args.quick else ''}"
    )
    print(
        f"Python {platform.python_version()} on {platform.system()}, "
        f"{os.cpu_count()} CPUs; PPE context per row in the 'PPE ctx' column"
    )
    print("ratio = nimbus / PPE; the target says which direction is better\n")
    header = ("workload", "what", "PPE ctx", "PPE", "nimbus", "ratio", "target", "result")
    lines = [(row.name, row.what, row.ppe_context, *row.figure_cells()) for row in rows]
    print(grid(header, lines))
    for row in rows:
        if row.ideal and row.nimbus_median is not None:
            base = row.baseline_median
            ppe = f", PPE {base / row.ideal:.2f}x" if base is not None else ""
            print(f"\n{row.name}: nimbus {row.nimbus_median / row.ideal:.2f}x the ideal{ppe}")
    if _FIRST_STARTS:
        first = statistics.median(_FIRST_STARTS)
        print(
            f"spread: nimbus's first task started {first:.3f} s after the executor was created "
            "(median): its workers' start-up, as in the startup row"
        )
    for row in rows:
        if row.error:
            print(f"\n{row.name}: {row.error}")


def write_json(path: str, rows: list[Row], args: argparse.Namespace, sizes: Sizes) -> None:
    doc = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "workers": args.workers,
        "repeat": args.repeat,
        "quick": args.quick,
        "baseline_only": args.baseline_only,
        "sizes": sizes.__dict__,
        "rows": [
            {
                "name": r.name,
                "title": r.title,
                "unit": "s" if r.unit == "us" else r.unit,
                "higher_is_better": r.higher_is_better,
                "ppe_context": r.ppe_context,
                "ppe": r.baseline,
                "nimbus": r.nimbus,
                "ppe_median": r.baseline_median,
                "nimbus_median": r.nimbus_median,
                "ratio": r.ratio,
                "ideal": r.ideal,
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
    parser.add_argument("--workers", type=int, default=2, help="workers on each side (default 2)")
    parser.add_argument("--repeat", type=int, default=3, help="repeats; median reported (3)")
    parser.add_argument(
        "--only", action="append", choices=WORKLOADS, metavar="NAME", help=", ".join(WORKLOADS)
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes for a smoke run")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--baseline-only", action="store_true", help="run only the PPE side")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.workers < 1:
        parser.error("--repeat and --workers must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = QUICK if args.quick else Sizes()
    rows = [r for r in build_rows(sizes, args.workers) if not args.only or r.name in args.only]
    make_nimbus = None
    if not args.baseline_only:
        try:
            make_nimbus = nimbus_factory(args.workers)
        except ImportError as exc:
            print(f"cannot import nimbus.executor ({exc}); try --baseline-only", file=sys.stderr)
            return 2
    for row in rows:
        make_ppe = ppe_factory(row.ppe_context, args.workers)
        print(f"running {row.name} ...", file=sys.stderr, flush=True)
        try:
            for _ in range(args.repeat):
                gc.collect()
                row.baseline.append(row.run(make_ppe, sizes, args.workers))
                if make_nimbus is not None:
                    gc.collect()
                    row.nimbus.append(row.run(make_nimbus, sizes, args.workers))
        except Exception as exc:  # a crash in one workload must not hide the others
            traceback.print_exc()
            row.error = f"{type(exc).__name__}: {exc}"
    print_table(rows, args)
    if args.json:
        write_json(args.json, rows, args, sizes)
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
