"""Every byte a task moves, and what a worker may use: nimbus's network layer.

Two sides (see each module's drawing):

* the manager's, :class:`WorkerNetworks`: each worker gets a network namespace
  joined to the node by a veth pair (``_link``: counters, ``tc`` bandwidth
  limits, the node's loopback kept reachable) and a cgroup (``_cgroup``: CPU and
  memory limits); ``command(name, argv)`` is the start prefix that puts it there;
* the worker's, :class:`TaskNet`: the namespace's counters read at a task's
  end (``_meter``; the last end is the next start), its TCP summary
  (``_diag``), co-location and the host NIC's rate (``_colocation``, sampled by
  one manager a host: ``_nic``); ``_gauge`` is what the worker calls around a
  task, ``_limits`` a task's own limits (``Executor.options``);
* ``nimbus netbench``: offline (``_bench``) or on an endpoint (``_endpoint``),
  reported by ``_report``.

Why a namespace and not eBPF cgroup counters: the veth is needed anyway for the
bandwidth limits, its counters are exact for everything in the namespace (C
libraries and children included) at the cost of one ``pread`` per task, and it
needs no BPF toolchain. ``net_accounting=auto`` (the default) counts by cgroup
where allowed, else (without root) by the socket counts of ``nimbus.telemetry``
(``net_source`` says which), never by a namespace (no way beyond the node); asking for
``netns`` or a limit without root is a ``ConfigError`` naming the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

# a worker imports this package for TaskNet alone: the rest (config, subprocess,
# dataclasses) is imported on first use (PEP 562), as nimbus.errors does
from nimbus.network._gauge import SKIPPED, TaskGauge
from nimbus.network._meter import DEVICE, TaskNet, nimbus_port

if TYPE_CHECKING:
    from nimbus.network._link import Link
    from nimbus.network._workers import Limits, WorkerNetworks

__all__ = [
    "DEVICE",
    "SKIPPED",
    "Limits",
    "Link",
    "TaskGauge",
    "TaskNet",
    "WorkerNetworks",
    "apply_limits",
    "netbench",
    "netbench_endpoint",
    "nimbus_port",
    "task_limits",
]


def __getattr__(name: str) -> Any:
    if name == "Link":
        from nimbus.network._link import Link

        return Link
    if name in ("Limits", "WorkerNetworks"):
        from nimbus.network import _workers

        return getattr(_workers, name)
    raise AttributeError(f"module 'nimbus.network' has no attribute {name!r}")


def task_limits(**options: Any) -> Any:
    """A task's own limits from ``Executor.options(bandwidth=, memory=, cpus=)``, checked
    as the endpoint's ``worker_*`` are; a ConfigError naming what is wrong."""
    from nimbus.network._limits import TaskLimits

    unknown = set(options) - {"bandwidth", "memory", "cpus"}
    if unknown:
        raise TypeError(
            f"options() got unexpected keyword(s) {', '.join(sorted(unknown))}; it takes "
            "timeout, environment, keep, bandwidth, memory, cpus"
        )
    return TaskLimits.parse(**options)


def apply_limits(
    row: tuple[Any, ...], failed: Callable[[BaseException], None]
) -> Callable[[], None]:
    """Set a task's own limits (what its payload carries: ``TaskLimits.row``) on this
    worker; returns what puts the worker's own back. A limit that cannot be put back
    goes to ``failed``; one that cannot be set raises (what it set is put back first)."""
    from nimbus.network._limits import TaskLimits, apply

    return apply(TaskLimits(*row), failed)


def netbench(
    concurrency: list[int],
    directions: list[str],
    seconds: float,
    cap: int,
    out: Path,
    *,
    share: float = 0.25,
    progress: Callable[[str], object] = lambda _: None,
) -> list[Path]:
    """Run the offline co-location sweep and write its report into ``out``. Interrupted
    (``KeyboardInterrupt``), the runs that finished are written first, and the
    interrupt is raised on with a note saying where."""
    from nimbus.network._bench import Offline
    from nimbus.network._report import summarize, write

    points = []
    runs = 0
    try:
        with Offline(workers=max(concurrency), cap=cap) as bench:
            for direction in directions:
                for n in concurrency:
                    run = bench.run(direction, n, seconds)
                    total = sum(p.mbit for p in run)
                    progress(f"{direction:>4} x{n}: aggregate {total:7.1f} Mbit/s")
                    points.extend(run)
                    runs += 1
    except KeyboardInterrupt as exc:
        if runs:  # (the namespaces are gone by now)
            write(points, summarize(points, cap, share), out)
            exc.add_note(
                f"the report of the {runs} run{'s' * (runs > 1)} that finished is in {out}"
            )
        raise
    return write(points, summarize(points, cap, share), out)


def netbench_endpoint(
    executor: Any,
    server: str,
    concurrency: list[int],
    directions: list[str],
    seconds: float,
    out: Path,
    *,
    cap: int | None = None,
    share: float = 0.25,
    sizes: list[int] | None = None,
    objects: int = 100,
    object_size: int = 10 << 20,
    price_gb_second: float | None = None,
    price_request: float | None = None,
    progress: Callable[[str], object] = lambda _: None,
) -> list[Path]:
    """The bandwidth sweep on ``executor``'s endpoint against a traffic server on
    ``server`` (this machine's address as the endpoint reaches it) and, given ``sizes``
    (bytes of worker memory), the object workload on the size x concurrency grid
    (``_grid``: at each size, 1 and each of ``concurrency`` tasks at once), the cost of
    the lone tasks under the prices given (USD; None: ``_sizes.Prices``'s defaults);
    the report into ``out``."""
    from nimbus.network._endpoint import check_reach, sweep, traffic_server
    from nimbus.network._grid import check_sizes, grid, past_which
    from nimbus.network._objects import object_server
    from nimbus.network._report import PAYLOAD, summarize, write
    from nimbus.network._sizes import Prices, recommend, size_points

    with traffic_server(server) as address:
        check_reach(executor, address)  # (--server 127.0.0.1, the default, on a remote one)
        if sizes:
            check_sizes(executor, sizes)  # limits the workers cannot take: before any run
        points = sweep(executor, address, concurrency, directions, seconds, progress)
    if cap is None:  # the best aggregate seen stands for the link's capacity
        best = max(
            sum(p.mbit for p in points if (p.direction, p.concurrency) == key)
            for key in {(p.direction, p.concurrency) for p in points}
        )
        cap = int(best * 1e6 / PAYLOAD)
    summary = summarize(points, cap, share)
    if sizes:
        prices = Prices()
        prices = Prices(
            prices.gb_second if price_gb_second is None else price_gb_second,
            prices.request if price_request is None else price_request,
        )
        try:
            with object_server(server) as port:
                cells, tasks = grid(
                    executor, (server, port), sizes, concurrency, objects, object_size, progress
                )
        except Exception:  # the bandwidth sweep's results are kept; the error as it was
            write(points, summary, out)
            progress(f"the size sweep failed; the bandwidth sweep's report is in {out}")
            raise
        at = size_points(tasks, prices)
        summary["sizes"] = {
            "prices": {"gb_second": prices.gb_second, "request": prices.request},
            "points": [p.row() for p in at],
            "recommendation": recommend(at),
            "grid": {
                "cells": [c.row() for c in cells],
                "tasks": [t.row() for t in tasks],
                "recommendation": past_which(cells, cap * PAYLOAD / 1e6, share),
            },
        }
    return write(points, summary, out)
