"""What carrying its program costs a plain task: an Executor whose tasks carry their
program's row (the default: they can message each other) against one whose tasks
carry none (``_program=False``, as ``nimbus.multiprocessing``'s own), in one run.

Each repeat runs both sides on fresh executors, in turn (the order alternates), so
load drift hits both alike. It prints the median of the paired wall ratios
(row / none, per task of ``map(f, range(N))`` after a warm-up) and the ratio of
the CPU per task (this process and its workers, executor start included).

    python bench/task_program.py                 # 12 repeats of 20,000 tasks
    python bench/task_program.py --repeat 4 --tasks 2000
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

# bench/multiprocessing.py sits beside this file: keep this directory off sys.path (the
# workers import this file's f as the __main__ they are sent, by value)
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import nimbus  # noqa: E402


def f(x: int) -> int:
    return x


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(program: bool, tasks: int) -> tuple[float, float]:
    """Wall and CPU microseconds per task of one executor (its workers reaped at its end)."""
    cpu, children = time.process_time(), _children_cpu()
    with nimbus.Executor(2, _program=program) as ex:
        list(ex.map(f, range(tasks // 10)))  # every worker warm
        began = time.perf_counter()
        list(ex.map(f, range(tasks)))
        wall = time.perf_counter() - began
    spent = time.process_time() - cpu + _children_cpu() - children
    return wall / tasks * 1e6, spent / (tasks + tasks // 10) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=12)
    parser.add_argument("--tasks", type=int, default=20_000)
    args = parser.parse_args()
    if args.repeat < 1 or args.tasks < 10:
        parser.error("--repeat takes 1 or more, --tasks 10 or more")
    sides: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for i in range(args.repeat):
        for program in (False, True) if i % 2 == 0 else (True, False):
            sides[program].append(run(program, args.tasks))
    pairs = [row[0] / none[0] for none, row in zip(sides[False], sides[True], strict=True)]
    none_cpu = statistics.median(cpu for _, cpu in sides[False])
    row_cpu = statistics.median(cpu for _, cpu in sides[True])
    print(
        f"wall per task, row / none: median of {len(pairs)} paired ratios "
        f"{statistics.median(pairs):.3f} (row slower in {sum(p > 1 for p in pairs)})"
    )
    print(
        f"cpu per task: none {none_cpu:.2f} us, row {row_cpu:.2f} us, "
        f"ratio {row_cpu / none_cpu:.3f}"
    )


if __name__ == "__main__":
    main()
