"""CPython's own multiprocessing tests against nimbus.multiprocessing: the fast subset.

Runs ``bench/transparency/run.sh`` with ``FAST=1``: public-API test classes of
``Lib/test/_test_multiprocessing.py`` that cover the main API, through the
harness in ``../shared/transparency``. Every test of the subset must pass. The
full scored run is ``bench/transparency/run.sh`` (see its README).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO.parent / "shared" / "transparency"


@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not (HARNESS / "run_suite.py").is_file(), reason="the shared transparency harness is absent"
)
@pytest.mark.parametrize("mode", ["import", "nimbus-run"])
def test_cpython_suite_fast_subset(mode: str) -> None:
    """``nimbus-run``: the suite unrewritten, `import multiprocessing` aliased by `nimbus run`."""
    env = {**os.environ, "FAST": "1", "HARNESS": str(HARNESS), "RUN": str(int(mode != "import"))}
    run = subprocess.run(
        ["bash", str(REPO / "bench" / "transparency" / "run.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=580,
        check=False,
    )
    report = run.stdout + run.stderr
    assert run.returncode == 0, report
    assert "PUBLIC_SCORE" in report, report
