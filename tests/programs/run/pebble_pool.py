"""pebble's ProcessPool: map, schedule, a task's exception, a timeout, recycled workers.

pebble waits on its pipes' descriptors itself (``select.poll`` on ``fileno()``).
"""

import math
import multiprocessing
import sys
import time
from concurrent.futures import TimeoutError

from pebble import ProcessPool


def root(x):
    return math.sqrt(x)


def fail(x):
    raise ValueError(f"bad {x}")


def slow(seconds):
    time.sleep(seconds)
    return seconds


if __name__ == "__main__":
    with ProcessPool(max_workers=2, max_tasks=3) as pool:
        print("map", list(pool.map(root, range(10), timeout=60).result()))
        print("schedule", pool.schedule(root, args=(81,)).result())
        try:
            pool.schedule(fail, args=(7,)).result()
        except ValueError as exc:
            print("error", exc)
        try:
            pool.schedule(slow, args=(30,), timeout=0.5).result()
        except TimeoutError:
            print("timeout")
        print("after", pool.schedule(slow, args=(0.01,)).result())
    print("done", multiprocessing.__name__ in ("multiprocessing", "nimbus.multiprocessing"))
    sys.exit(3)
