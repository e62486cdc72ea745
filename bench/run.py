"""``nimbus run`` of a program against ``python`` of it: what the launcher adds.

    python bench/run.py                 # 15 repeats of each, alternating; medians
    python bench/run.py --repeat 3 --json out.json

Each repeat runs a fresh interpreter: ``python noop.py`` then ``python -m
nimbus run noop.py`` (the ``nimbus`` command takes the same path), and a
program that imports ``multiprocessing`` and starts nothing, both ways (under
``nimbus run`` that import is nimbus's package, imported on first use). The
figure is the median wall time; the target is at most 50 ms added for the
no-op script (issue 16).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_ADDED_S = 0.050
PROGRAMS = {
    "no-op script": "pass\n",
    "script importing multiprocessing": "import multiprocessing\n",
}


def _time(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def measure(repeat: int) -> list[dict[str, object]]:
    """Per program: the median seconds under python and under `nimbus run`."""
    env = dict(os.environ)
    src = Path(__file__).resolve().parents[1] / "src"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH")) if p)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, text in PROGRAMS.items():
            script = Path(tmp) / "program.py"
            script.write_text(text)
            plain = [sys.executable, str(script)]
            nimbus = [sys.executable, "-m", "nimbus", "run", str(script)]
            _time(plain, env), _time(nimbus, env)  # warm the file cache
            python_s, run_s = [], []
            for _ in range(repeat):
                python_s.append(_time(plain, env))
                run_s.append(_time(nimbus, env))
            py, nr = statistics.median(python_s), statistics.median(run_s)
            rows.append({"program": label, "python_s": py, "nimbus_run_s": nr, "added_s": nr - py})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=15, help="runs of each; median (15)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    rows = measure(args.repeat)
    print(f"{'program':36} {'python':>9} {'nimbus run':>11} {'added':>9}  target")
    for row in rows:
        added = float(row["added_s"])  # type: ignore[arg-type]
        target = ""
        if row["program"] == "no-op script":
            target = f"<= {TARGET_ADDED_S * 1000:.0f} ms " + (
                "ok" if added <= TARGET_ADDED_S else "MISSED"
            )
        print(
            f"{row['program']:36} {float(row['python_s']) * 1000:7.1f}ms "  # type: ignore[arg-type]
            f"{float(row['nimbus_run_s']) * 1000:9.1f}ms {added * 1000:7.1f}ms  {target}"  # type: ignore[arg-type]
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"repeat": args.repeat, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
