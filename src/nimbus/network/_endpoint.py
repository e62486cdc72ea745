"""``nimbus netbench --endpoint NAME``: the bandwidth sweep on a real endpoint.

::

    this machine: traffic server (``_traffic.serve``) on --server HOST
    the endpoint: n tasks at once (n in --concurrency), each downloading (or
                  uploading) for --seconds from it, all starting at the same instant:
                  when the last has started (``_starts``: they meet on this machine;
                  no worker's clock is compared with this one's)

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
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import closing, contextmanager
from typing import Any

from nimbus.errors import ConfigError
from nimbus.network._bench import Point
from nimbus.network._starts import Starts, meet
from nimbus.network._traffic import serve, transfer

__all__ = ["check_reach", "move", "reaches", "sweep", "traffic_server"]

START_WITHIN = 60.0  # seconds from submit for a run's n tasks to start (cold workers too)


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


def move(
    address: tuple[str, int], starts: tuple[str, int], key: str, patience: float,
    direction: str, seconds: float,
) -> Any:  # fmt: skip
    """A task: once all its run's tasks have started (``_starts``), move data for
    ``seconds``; None when told to stop (not all started in time)."""
    started = meet(starts, key, patience, "--endpoint", "sweep")
    return transfer(address, direction, seconds) if started else None


def sweep(
    executor: Executor,
    address: tuple[str, int],
    concurrency: list[int],
    directions: list[str],
    seconds: float,
    progress: Callable[[str], object] = lambda _: None,
    within: float = START_WITHIN,
) -> list[Point]:
    """Every (direction, n): n tasks on ``executor`` at once; a point per task. A run
    whose n tasks did not all start within ``within`` s is not run (said to
    ``progress``), nor the larger ones of its direction; a ConfigError if none ran."""
    points: list[Point] = []
    refused = ""
    with closing(Starts(address[0])) as starts:
        for direction in directions:
            most: int | None = None  # (where refused: how many started)
            for n in concurrency:
                if most is not None and n > most:
                    progress(f"{direction:>4} x{n}: not tried: {refused}")
                    continue
                run, came = _run(executor, starts, within, address, direction, n, seconds)
                if came < n:
                    most, refused = (
                        came,
                        (
                            f"the endpoint started only {came} of {n} tasks within {within:g} s "
                            f"(the others waited for a worker); give it more workers or sweep "
                            f"to {came} at most"
                        ),
                    )
                    progress(f"{direction:>4} x{n}: not run: {refused}")
                    continue
                progress(f"{direction:>4} x{n}: aggregate {sum(p.mbit for p in run):7.1f} Mbit/s")
                points.extend(run)
    if not points:
        raise ConfigError(f"netbench --endpoint: no run of the sweep ran: {refused}")
    return points


def _run(
    executor: Executor, starts: Starts, within: float, address: tuple[str, int],
    direction: str, n: int, seconds: float,
) -> tuple[list[Point], int]:  # fmt: skip
    """One run's points, from the instant all n tasks have started; and how many
    started (fewer than n: none moved anything, no points)."""
    key = uuid.uuid4().hex
    futures = [
        executor.submit(move, address, starts.address, key, within + 60, direction, seconds)
        for _ in range(n)
    ]
    came = starts.gather(key, n, within)
    run = []
    for task, fut in enumerate(futures, start=1):
        out = fut.result(timeout=within + seconds + 300)
        if out is not None:  # (None: told to stop)
            moved, took = out
            record = getattr(fut, "record", None)
            counted = 0
            if record is not None:
                counted = record.net_bytes_in if direction == "down" else record.net_bytes_out
            run.append(Point(direction, n, task, moved, took, counted))
    return run, came
