"""Plain multiprocessing programs, run unmodified on the stdlib and on nimbus.

Each script under ``scripts/`` is ordinary stdlib code (``import
multiprocessing``). It runs twice as a subprocess: as written, and as a copy
whose only change is that import line, swapped for ``import
nimbus.multiprocessing as multiprocessing``. The two outputs must be equal.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
STDLIB_IMPORT = "import multiprocessing\n"
NIMBUS_IMPORT = "import nimbus.multiprocessing as multiprocessing\n"


def _run(script: Path, cwd: Path) -> str:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"{script.name} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _on_both(name: str, tmp_path: Path) -> tuple[str, str]:
    original = SCRIPTS / name
    text = original.read_text()
    assert text.count(STDLIB_IMPORT) == 1
    swapped = tmp_path / name
    swapped.write_text(text.replace(STDLIB_IMPORT, NIMBUS_IMPORT))
    return _run(original, tmp_path), _run(swapped, tmp_path)


@pytest.mark.timeout(60)
def test_monte_carlo_pi(tmp_path: Path) -> None:
    stdlib, nimbus = _on_both("monte_carlo_pi.py", tmp_path)
    assert "pi ~ 3.14" in stdlib
    assert nimbus == stdlib


@pytest.mark.timeout(60)
def test_parallel_sort(tmp_path: Path) -> None:
    stdlib, nimbus = _on_both("parallel_sort.py", tmp_path)
    assert "sorted: True" in stdlib
    assert "exit codes: [0, 0, 0, 0]" in stdlib
    assert nimbus == stdlib
