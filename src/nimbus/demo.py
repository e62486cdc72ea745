"""``nimbus demo``: a Monte Carlo estimate of pi on every core.

Each task throws ``samples`` darts at the unit square with its own seeded
``random.Random`` and counts the hits inside the quarter circle; the caller sums
the hits and prints the estimate with a summary of the task records.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Sequence

from nimbus.records import TaskRecord

__all__ = ["count_hits", "run"]

_SEED = 20240601
_TOLERANCE = 6.0  # standard errors; a larger error means tasks were lost or repeated


def count_hits(seed: int, samples: int) -> int:
    """How many of ``samples`` random points of the unit square fall in the unit circle."""
    rng = random.Random(seed)
    rand = rng.random
    hits = 0
    for _ in range(samples):
        x = rand()
        y = rand()
        if x * x + y * y <= 1.0:
            hits += 1
    return hits


def run(n_tasks: int = 64, samples_per_task: int = 200_000) -> int:
    """Run the demo on the embedded runtime; return a process exit code."""
    from nimbus.executor import Executor, Future

    start = time.perf_counter()
    with Executor(max_workers=None) as ex:
        futures = [ex.submit(count_hits, _SEED + i, samples_per_task) for i in range(n_tasks)]
        hits = sum(f.result() for f in futures)
        records: list[TaskRecord] = []
        for f in futures:
            assert isinstance(f, Future)  # submit is typed as returning cf.Future
            records.append(f.record)
    wall = time.perf_counter() - start

    total = n_tasks * samples_per_task
    estimate = 4.0 * hits / total
    error = estimate - math.pi
    print(f"pi ~ {estimate:.6f}  (error {error:+.6f}, {total:,} samples in {n_tasks} tasks)")
    print(f"wall time {wall:.2f} s, {n_tasks / wall:.1f} tasks/s")
    _print_records(records)
    p = math.pi / 4
    limit = _TOLERANCE * 4.0 * math.sqrt(p * (1 - p) / total)
    if abs(error) > limit:
        print(f"error larger than {limit:.6f}: the tasks did not all run correctly")
        return 1
    return 0


def _print_records(records: Sequence[TaskRecord]) -> None:
    per_worker = Counter(r.worker or f"pid {r.pid}" for r in records)
    queued = [r.queued_seconds for r in records]
    running = [r.run_seconds for r in records]
    cpu = sum(r.cpu_user + r.cpu_system for r in records)
    peak_mb = max((r.peak_memory for r in records), default=0) / 2**20
    net_in = sum(r.net_bytes_in for r in records)
    net_out = sum(r.net_bytes_out for r in records)

    print(f"task records ({len(records)} tasks on {len(per_worker)} workers):")
    counts = ", ".join(f"{worker}: {n}" for worker, n in sorted(per_worker.items()))
    print(f"  tasks per worker   {counts}")
    print(f"  queued seconds     median {_median(queued):.4f}, max {max(queued, default=0):.4f}")
    print(f"  run seconds        median {_median(running):.4f}, max {max(running, default=0):.4f}")
    print(f"  CPU user+system    {cpu:.2f} s total")
    print(f"  peak memory        {peak_mb:.1f} MB (largest task)")
    print(f"  network bytes      {net_in:,} in, {net_out:,} out")


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0
