"""One new program for ``multiprocessing.py``'s start-up rows: ``python _cold.py SIDE WORKLOAD``.

SIDE is ``stdlib`` (the fork context) or ``nimbus``; WORKLOAD is ``process``
(the program's first Process start + join) or ``pool_map64`` (``Pool(4)``, map
64 no-ops, close, join). It prints one JSON line: the seconds of its import of
the multiprocessing module and of the workload after it. A fresh interpreter
each run, as a user's program is: nothing is warm but the OS's file cache.

The directory of this file must not be on ``sys.path`` (``multiprocessing.py``
beside it would stand in for the stdlib's): the first thing it does is drop it.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import json  # noqa: E402
import time  # noqa: E402


def noop(*args: object) -> None:
    """Do nothing."""


def main() -> None:
    side, workload = sys.argv[1], sys.argv[2]
    t0 = time.perf_counter()
    if side == "nimbus":
        import nimbus.multiprocessing as mp
    else:
        import multiprocessing

        mp = multiprocessing.get_context("fork")  # type: ignore[assignment]
    t1 = time.perf_counter()
    if workload == "process":
        p = mp.Process(target=noop)
        p.start()
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"no-op process exited with {p.exitcode}")
    else:
        with mp.Pool(4) as pool:
            out = pool.map(noop, range(64))
            pool.close()
            pool.join()
        if out != [None] * 64:
            raise RuntimeError(f"map returned {out!r}")
    t2 = time.perf_counter()
    print(json.dumps({"import": t1 - t0, "run": t2 - t1}))


if __name__ == "__main__":
    main()
