"""A local Executor with its history kept for ``nimbus dashboard`` vs without.

Side by side, alternated, in one process: ``on`` runs in a runtime directory that
has a service registry (its finished records are handed, packed in a file a
second, to the service, as ``nimbus.service.local_history`` does), ``off`` in one
that has none. Each repeat
is a fresh Executor (2 workers, warmed): ``--tasks`` no-op tasks submitted at
once (throughput), then ``--calls`` no-ops one after another (round trip).

    python bench/local_history.py                 # 20,000 tasks, 500 calls, 5 repeats
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

sys.path.append(str(_HERE))  # after the stdlib: for _report
from _report import grid  # noqa: E402


def noop() -> None:
    return None


def run(root: Path, tasks: int, calls: int) -> tuple[float, float]:
    from nimbus import Executor
    from nimbus.config import Settings

    env = {k: v for k, v in os.environ.items() if not k.startswith("NIMBUS_")}
    env["NIMBUS_RUNTIME_DIR"] = str(root)
    with Executor(max_workers=2, settings=Settings.load(env)) as pool:
        list(pool.map(noop, range(0)))
        [f.result() for f in [pool.submit(noop) for _ in range(100)]]  # warm
        t0 = time.perf_counter()
        for f in [pool.submit(noop) for _ in range(tasks)]:
            f.result()
        rate = tasks / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(calls):
            pool.submit(noop).result()
        latency = (time.perf_counter() - t0) / calls
    return rate, latency


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    top = Path(tempfile.mkdtemp(prefix="nimbus-bench-lh-"))
    try:
        on, off = top / "on", top / "off"
        from nimbus.service.registry import Registry

        Registry(f"sqlite:///{on / 'service' / 'registry.sqlite3'}").close()  # as the dashboard
        off.mkdir()
        got: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
        for _ in range(args.repeat):
            for name, root in (("off", off), ("on", on)):
                got[name].append(run(root, args.tasks, args.calls))
        rows = []
        for name in got:
            rate = statistics.median(r for r, _ in got[name])
            latency = statistics.median(lat for _, lat in got[name])
            rows.append((name, f"{rate:,.0f} tasks/s", f"{latency * 1e6:,.0f} us"))
        ratio = statistics.median(r for r, _ in got["on"]) / statistics.median(
            r for r, _ in got["off"]
        )
        rows.append(("on / off", f"{ratio:.3f}x throughput", ""))
        print(grid(("history", f"{args.tasks:,} no-ops at once", "one no-op round trip"), rows))
        import msgpack

        files = list((on / "service" / "local-history").glob("*.msgpack"))
        kept = sum(len(msgpack.unpackb(f.read_bytes())[1]) for f in files)
        print(f"records handed to the service: {kept:,} in {len(files)} files")
    finally:
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
