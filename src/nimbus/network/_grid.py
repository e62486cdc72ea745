"""``nimbus netbench --endpoint NAME --sizes ... --concurrency ...``: the size x concurrency grid.

::

    for each worker size s (memory s, CPU s / MB_PER_CPU: ``_sizes``)
      for each concurrency n (1 always, then --concurrency)
        down: n tasks at once, each on a worker of its own limited to s, each
              downloading --objects objects of --object-size from the object
              server, all from one instant; then up: the same uploading

A cell is one (size, n, direction): each task's rate (its bytes over the sum of
its objects' times), their mean / min / max, the aggregate (all the cell's bytes
over the span from the common start to the last task's end) and the median and
p95 seconds per object over all its tasks. The recommendation, per size and
direction: the most tasks per host at which each task still gets ``share`` of
the link (the mean per-task rate at least ``share`` x the cap's payload rate; the
cap is the report's: ``--cap`` or the best aggregate of the bandwidth sweep) --
past it, each gets less. The
cells at n = 1 are the size sweep's points (``_sizes.SizePoint``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import asdict, dataclass
from typing import Any

from nimbus.errors import ConfigError
from nimbus.network._sizes import MB_PER_CPU, transfer_objects

__all__ = ["Cell", "GridTask", "check_sizes", "grid", "objects_at", "past_which"]

START_AFTER = 1.0  # seconds from submit to a cell's common start: all its tasks reach it


def objects_at(
    address: tuple[str, int], direction: str, count: int, size: int, start_at: float
) -> tuple[list[float], float, float]:
    """A task: from ``start_at`` (``time.time()``), move the objects; each one's seconds,
    and the wall-clock start and end of the transfer."""
    delay = start_at - time.time()
    if delay > 0:
        time.sleep(delay)
    began = time.time()
    times = transfer_objects(address, direction, count, size)
    return times, began, time.time()


def limited() -> None:
    """A task that does nothing: run under a size's limits, it says they can be set."""


def check_sizes(executor: Executor, sizes: list[int]) -> None:
    """The endpoint's workers take a task's memory and CPU limits; a ConfigError naming
    the endpoint setting that gives them (before any run of any sweep) otherwise."""
    memory = min(sizes)
    cpus = round(memory / (MB_PER_CPU << 20), 3)
    sized: Any = executor.options(memory=memory, cpus=max(cpus, 0.01))  # type: ignore[attr-defined]
    try:
        sized.submit(limited).result(timeout=300)
    except ConfigError as exc:
        raise ConfigError(
            f"netbench --sizes runs each task limited to a size, which this endpoint's "
            f"workers cannot take: {exc}; nothing was measured"
        ) from None


@dataclass(frozen=True)
class GridTask:
    """One task of one cell (a row of ``netbench-grid.csv``)."""

    memory: int
    concurrency: int
    direction: str
    task: int
    bytes: int
    seconds: float  # the sum of its objects' times
    mbit: float
    counted: int  # bytes its record counted that way (0 without a record)
    net_source: str  # what counted them (the record's)
    times: tuple[float, ...]
    began: float
    ended: float

    def row(self) -> dict[str, Any]:
        row = asdict(self)
        del row["times"], row["began"], row["ended"]
        return row


@dataclass(frozen=True)
class Cell:
    """One (size, concurrency, direction) of the grid."""

    memory: int
    cpus: float
    concurrency: int
    direction: str
    per_task_mean_mbit: float
    per_task_min_mbit: float
    per_task_max_mbit: float
    aggregate_mbit: float
    object_median_s: float
    object_p95_s: float

    def row(self) -> dict[str, Any]:
        return asdict(self)


def _p95(times: list[float]) -> float:
    return sorted(times)[min(len(times) - 1, int(0.95 * len(times)))]


def _cell(memory: int, cpus: float, run: list[GridTask]) -> Cell:
    rates = [t.mbit for t in run]
    times = [x for t in run for x in t.times]
    span = max(t.ended for t in run) - min(t.began for t in run)
    return Cell(
        memory=memory, cpus=cpus, concurrency=run[0].concurrency, direction=run[0].direction,
        per_task_mean_mbit=round(statistics.mean(rates), 1),
        per_task_min_mbit=round(min(rates), 1), per_task_max_mbit=round(max(rates), 1),
        aggregate_mbit=round(sum(t.bytes for t in run) * 8 / span / 1e6, 1),
        object_median_s=round(statistics.median(times), 5), object_p95_s=round(_p95(times), 5),
    )  # fmt: skip


def _run_cell(
    limited: Any, memory: int, n: int, direction: str, address: tuple[str, int],
    count: int, size: int,
) -> list[GridTask]:  # fmt: skip
    start_at = time.time() + START_AFTER
    futures = [
        limited.submit(objects_at, address, direction, count, size, start_at) for _ in range(n)
    ]
    run = []
    for task, fut in enumerate(futures, start=1):
        times, began, ended = fut.result(timeout=START_AFTER + 600 + count * 60)
        record = getattr(fut, "record", None)
        counted, source = 0, ""
        if record is not None:
            counted = record.net_bytes_in if direction == "down" else record.net_bytes_out
            source = str(record.net_source or "")
        took = sum(times)
        rate = round(count * size * 8 / took / 1e6, 1)
        point = GridTask(
            memory, n, direction, task, count * size, round(took, 5), rate, counted,
            source, tuple(times), began, ended,
        )  # fmt: skip
        run.append(point)
    late = [f for f in futures if getattr(f, "record", None) and f.record.started > start_at]
    if late:
        raise ConfigError(
            f"netbench --sizes --concurrency {n}: the endpoint started only {n - len(late)} of "
            f"{n} tasks of {memory >> 20}M at once (the others waited for a worker); give it "
            f"more workers or sweep to {n - len(late)} at most"
        )
    return run


def grid(
    executor: Executor,
    address: tuple[str, int],
    sizes: list[int],
    concurrency: list[int],
    count: int,
    size: int,
    progress: Callable[[str], object] = lambda _: None,
) -> tuple[list[Cell], list[GridTask]]:
    """Every (size, n, direction) of the grid, n from ``{1} | concurrency``; its cells
    and their tasks."""
    cells: list[Cell] = []
    tasks: list[GridTask] = []
    for memory in sizes:
        cpus = round(memory / (MB_PER_CPU << 20), 3)
        limited: Any = executor.options(memory=memory, cpus=max(cpus, 0.01))  # type: ignore[attr-defined]
        for n in sorted({1, *concurrency}):
            for direction in ("down", "up"):
                run = _run_cell(limited, memory, n, direction, address, count, size)
                cell = _cell(memory, cpus, run)
                progress(
                    f"size {memory >> 20:>5} MiB x{n} {direction:>4}: per task "
                    f"{cell.per_task_mean_mbit} Mbit/s (min {cell.per_task_min_mbit}), "
                    f"aggregate {cell.aggregate_mbit}"
                )
                cells.append(cell)
                tasks.extend(run)
    return cells, tasks


def past_which(cells: list[Cell], cap_mbit: float, share: float) -> dict[str, Any]:
    """Per size and direction, the most tasks per host each getting ``share`` of
    ``cap_mbit`` (the mean per-task rate); 0 where even one task alone gets less."""
    most: dict[str, dict[str, int]] = {}
    for c in cells:
        at = most.setdefault(f"{c.memory >> 20}M", {}).setdefault(c.direction, 0)
        if c.per_task_mean_mbit >= share * cap_mbit:
            most[f"{c.memory >> 20}M"][c.direction] = max(at, c.concurrency)
    return {
        "share": share,
        "cap_mbit": round(cap_mbit, 1),
        "most_tasks_per_host_each_getting_share": most,
    }
