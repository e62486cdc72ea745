"""``nimbus netbench --endpoint NAME --sizes 128M,512M,1G``: worker size, objects, cost.

::

    this machine: an object server on --server (GET /N answers N bytes, PUT swallows)
    the endpoint: for each size, one task limited to memory=size and
                  cpus=size / MB_PER_CPU downloads --objects objects of --object-size
                  one after another (keep-alive HTTP, as an S3 client), then one uploads
                  as many; each object's time is taken in the task (these are the
                  size x concurrency grid's cells at concurrency 1: ``_grid``)

As on the seed's platform, a bigger function gets a bigger CPU share (one CPU
at ``MB_PER_CPU``): whether more memory buys more bandwidth is what the sweep
shows. Per size: seconds per object each way (median, p95), the rate, the
bytes the task's records counted, and the cost of a million tasks that each
move one object under a price table (``Prices``: per GB-second and per
request; the defaults are AWS Lambda's x86 list prices, change them with
``--price-gb-second`` / ``--price-request``). The recommendation is the smallest
size whose download rate is within 5 % of the best.

The objects come from netbench's own object server rather than the service's
data store: a task holds no credential for the store (its agent's token reads
only a task's own argument blobs), and sending the user's token with each task
would keep it in the task's stored payload.
"""

from __future__ import annotations

import http.client
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["MB_PER_CPU", "Prices", "SizePoint", "recommend", "size_points", "transfer_objects"]

MB_PER_CPU = 1769  # MiB of memory per CPU on the seed's platform (AWS Lambda)
WITHIN = 0.05  # the recommendation: the smallest size within this of the best rate


@dataclass(frozen=True)
class Prices:
    """What a task costs: ``gb_second`` per GiB of memory a second, ``request`` each."""

    gb_second: float = 0.0000166667
    request: float = 0.0000002

    def per_million(self, memory: int, seconds: float) -> float:
        return 1e6 * (seconds * memory / (1 << 30) * self.gb_second + self.request)


@dataclass(frozen=True)
class SizePoint:
    """One worker size: its objects' times each way and what it costs."""

    memory: int  # bytes
    cpus: float
    objects: int
    object_size: int
    down_median_s: float
    down_p95_s: float
    up_median_s: float
    up_p95_s: float
    down_mbit: float
    up_mbit: float
    counted_in: int  # bytes the download task's record counted
    counted_out: int
    net_source: str
    cost_per_million_down: float  # tasks that each download one object
    cost_per_million_up: float

    def row(self) -> dict[str, Any]:
        return asdict(self)


def transfer_objects(
    address: tuple[str, int], direction: str, count: int, size: int
) -> list[float]:
    """A task: move ``count`` objects of ``size`` bytes one after another over one
    keep-alive connection; each one's seconds."""
    conn = http.client.HTTPConnection(*address, timeout=300)
    body = b"u" * size if direction == "up" else b""
    buf = bytearray(1 << 20)
    times = []
    try:
        for _ in range(count):
            started = time.perf_counter()
            if direction == "up":
                conn.request("PUT", "/up", body=body, headers={"Content-Length": str(size)})
                conn.getresponse().read()
            else:
                conn.request("GET", f"/{size}")
                response, got = conn.getresponse(), 0
                while got < size:
                    n = response.readinto(buf)
                    if not n:
                        raise ConnectionError(f"the object server sent {got} of {size} bytes")
                    got += n
            times.append(time.perf_counter() - started)
    finally:
        conn.close()
    return times


def _p95(times: list[float]) -> float:
    return sorted(times)[min(len(times) - 1, int(0.95 * len(times)))]


def size_points(tasks: list[Any], prices: Prices) -> list[SizePoint]:
    """Each worker size's point from the grid's tasks that ran alone (``_grid``:
    concurrency 1, one down and one up a size; a size without both, none)."""
    alone = {(t.memory, t.direction): t for t in tasks if t.concurrency == 1}
    points = []
    for memory in sorted({m for m, _ in alone if (m, "up") in alone and (m, "down") in alone}):
        down, up = alone[memory, "down"], alone[memory, "up"]
        cpus = round(memory / (MB_PER_CPU << 20), 3)
        count, size = len(down.times), down.bytes // max(1, len(down.times))
        point = SizePoint(
            memory=memory, cpus=cpus, objects=count, object_size=size,
            down_median_s=round(statistics.median(down.times), 5),
            down_p95_s=round(_p95(list(down.times)), 5),
            up_median_s=round(statistics.median(up.times), 5),
            up_p95_s=round(_p95(list(up.times)), 5),
            down_mbit=down.mbit, up_mbit=up.mbit,
            counted_in=down.counted, counted_out=up.counted, net_source=down.net_source,
            cost_per_million_down=round(prices.per_million(memory, statistics.mean(down.times)), 4),
            cost_per_million_up=round(prices.per_million(memory, statistics.mean(up.times)), 4),
        )  # fmt: skip
        points.append(point)
    return points


def recommend(points: list[SizePoint]) -> dict[str, Any]:
    """The smallest size within ``WITHIN`` of the best download rate, and its cost."""
    if not points:
        return {"within": WITHIN, "smallest_size_within": None, "why": "no size ran a task"}
    best = max(p.down_mbit for p in points)
    enough = [p for p in points if p.down_mbit >= (1 - WITHIN) * best]
    pick = min(enough, key=lambda p: p.memory)
    return {
        "within": WITHIN,
        "best_down_mbit": best,
        "smallest_size_within": f"{pick.memory >> 20}M",
        "its_down_mbit": pick.down_mbit,
        "its_cost_per_million_down": pick.cost_per_million_down,
    }
