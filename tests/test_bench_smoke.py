"""Smoke runs of the benchmarks in bench/: each runs end to end and prints its table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "executor.py"


@pytest.mark.timeout(120)
def test_bench_executor_quick_roundtrip() -> None:
    pytest.importorskip("nimbus.executor")
    import nimbus

    env = dict(os.environ)
    # The script must import the same nimbus this test process does.
    package_parent = str(Path(nimbus.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--repeat", "1", "--only", "roundtrip"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next((line for line in lines if line.startswith("workload")), None)
    assert header is not None, proc.stdout
    for column in ("PPE", "nimbus", "ratio", "target", "result"):
        assert column in header
    row = next((line for line in lines if line.startswith("roundtrip")), None)
    assert row is not None, proc.stdout
    assert row.rstrip().endswith(("PASS", "MISS")), row


@pytest.mark.timeout(120)
def test_bench_messaging_quick() -> None:
    """bench/messaging.py runs every workload at quick sizes and prints its table."""
    import nimbus

    env = dict(os.environ)
    package_parent = str(Path(nimbus.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "messaging.py"), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next((line for line in lines if line.startswith("workload")), None)
    assert header is not None, proc.stdout
    for column in ("reference", "nimbus", "ratio", "target", "result"):
        assert column in header
    for name in ("rtt 64B", "rtt 1MB", "oneway", "allreduce", "directory"):
        row = next((line for line in lines if line.startswith(name)), None)
        assert row is not None, proc.stdout
        assert row.rstrip().endswith(("PASS", "MISS", "report")), row


@pytest.mark.timeout(180)
def test_bench_multiprocessing_quick(tmp_path: Path) -> None:
    import json

    import nimbus

    env = dict(os.environ)
    package_parent = str(Path(nimbus.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    out = tmp_path / "mp.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "multiprocessing.py"),
            *("--quick", "--repeat", "1", "--only", "lock", "--only", "queue"),
            *("--json", str(out)),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {row["name"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"cold start", "lock", "queue"}
    for name in ("lock", "queue"):
        assert rows[name]["status"] in ("PASS", "MISS"), rows[name]
        assert rows[name]["ratio"] > 0
    assert "stdlib" in proc.stdout and "nimbus" in proc.stdout
