"""Smoke run of bench/service.py: service, endpoint and client run end to end and print a table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "service.py"


@pytest.mark.timeout(120)
def test_bench_service_quick(tmp_path: Path) -> None:
    import nimbus

    env = {k: v for k, v in os.environ.items() if not k.startswith("NIMBUS_")}
    package_parent = str(Path(nimbus.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--workers", "2", "--json", str(out)],
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
    for column in ("what", "nimbus", "target", "result"):
        assert column in header
    for name in ("roundtrip", "throughput", "offline", "heartbeats"):
        row = next((line for line in lines if line.startswith(name)), None)
        assert row is not None, proc.stdout
    offline = next(line for line in lines if line.startswith("offline"))
    assert "2000/2000 complete" in offline, offline
    assert out.exists()
