"""``nimbus netbench --endpoint NAME``: the bandwidth sweep on a real endpoint.

::

    this machine: traffic server (``_traffic.serve``) on --server HOST
    the endpoint: n tasks at once (n in --concurrency), each downloading (or
                  uploading) for --seconds from it, all starting at the same instant

Each task's point has the bytes its client saw and those its record counted
(``net_bytes_in``/``out``: every byte where the endpoint's workers have
namespaces of their own, ``net_source``). The report is the offline one's
(``_report``); the link's capacity, unknown here, is taken as the best
aggregate seen unless ``--cap`` says it.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from typing import Any

from nimbus.errors import ConfigError
from nimbus.network._bench import Point
from nimbus.network._traffic import serve, transfer

__all__ = ["check_reach", "move", "reaches", "sweep", "traffic_server"]

START_AFTER = 1.0  # seconds from submit to the runs' common start: all tasks reach it


@contextmanager
def traffic_server(host: str) -> Iterator[tuple[str, int]]:
    """The built-in traffic server on ``host`` (an address the endpoint reaches)."""
    listener = socket.create_server((host, 0), backlog=128)
    stop = threading.Event()
    thread = threading.Thread(target=serve, args=(listener, stop), daemon=True)
    thread.start()
    try:
        yield host, listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        listener.close()


def reaches(address: tuple[str, int]) -> str | None:
    """A task: None if its node connects to ``address``, else why not (and where)."""
    try:
        socket.create_connection(address, timeout=10).close()
    except OSError as exc:
        return f"{exc.strerror or exc} on {socket.gethostname()}"
    return None


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_reach(executor: Executor, address: tuple[str, int]) -> None:
    """The endpoint's nodes reach the traffic server at ``address``; a ConfigError
    saying which address to give otherwise (before any run of the sweep)."""
    why = executor.submit(reaches, address).result(timeout=300)
    if why is None:
        return
    host, port = address
    if _loopback(host):
        raise ConfigError(
            f"netbench --endpoint: --server {host} is this machine's loopback and the "
            f"endpoint's nodes are elsewhere: they cannot reach it ({why}); give --server "
            f"an address of this machine that the nodes reach (e.g. its address on their "
            f"network)"
        )
    raise ConfigError(
        f"netbench --endpoint: the endpoint's nodes cannot reach --server {host} (the "
        f"traffic server at {host}:{port}: {why}); give --server an address of this machine "
        f"that the nodes reach, and let them connect to it"
    )


def move(address: tuple[str, int], direction: str, seconds: float, start_at: float) -> Any:
    """A task: from ``start_at`` (``time.time()``), move data for ``seconds``."""
    delay = start_at - time.time()
    if delay > 0:
        time.sleep(delay)
    return transfer(address, direction, seconds)


def sweep(
    executor: Executor,
    address: tuple[str, int],
    concurrency: list[int],
    directions: list[str],
    seconds: float,
    progress: Callable[[str], object] = lambda _: None,
) -> list[Point]:
    """Every (direction, n): n tasks on ``executor`` at once; a point per task."""
    points: list[Point] = []
    for direction in directions:
        for n in concurrency:
            start_at = time.time() + START_AFTER
            futures = [
                executor.submit(move, address, direction, seconds, start_at) for _ in range(n)
            ]
            run = []
            for task, fut in enumerate(futures, start=1):
                moved, took = fut.result(timeout=START_AFTER + seconds + 300)
                record = getattr(fut, "record", None)
                counted = 0
                if record is not None:
                    counted = record.net_bytes_in if direction == "down" else record.net_bytes_out
                run.append(Point(direction, n, task, moved, took, counted))
            records = [getattr(f, "record", None) for f in futures]
            late = [r for r in records if r is not None and r.started > start_at]
            if late:
                raise ConfigError(
                    f"netbench --concurrency {n}: the endpoint started only {n - len(late)} of "
                    f"{n} tasks at once (the others waited for a worker); give it more workers "
                    f"or sweep to {n - len(late)} at most"
                )
            progress(f"{direction:>4} x{n}: aggregate {sum(p.mbit for p in run):7.1f} Mbit/s")
            points.extend(run)
    return points
