"""Real programs run unmodified through ``nimbus run``, compared with plain ``python``.

Each program under ``run/`` is ordinary code (plain ``import multiprocessing``,
or a library that uses it inside). It runs as ``python PROGRAM ARGS`` and as
``python -m nimbus run PROGRAM ARGS``; the exit code and standard output must
be equal, and the nimbus run's processes must be nimbus's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROGRAMS = Path(__file__).parent / "run"
SRC = Path(__file__).resolve().parents[2] / "src"


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(SRC)}
    return subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=150, check=False
    )


def on_both(program: str, *args: str, cwd: Path) -> tuple[str, str]:
    """Run the program under python and under `nimbus run`: (stdout, nimbus's stderr)."""
    path = str(PROGRAMS / program)
    stdlib = _run([sys.executable, path, *args], cwd)
    nimbus = _run([sys.executable, "-m", "nimbus", "run", path, *args], cwd)
    assert nimbus.returncode == stdlib.returncode, nimbus.stderr
    assert nimbus.stdout == stdlib.stdout, nimbus.stderr
    return stdlib.stdout, nimbus.stderr


CASES = [
    pytest.param(
        "pool_queue_idioms.py", (), "manager [('2', 2), (0.25, None), (1, '1')]", id="docs"
    ),
    pytest.param("events_and_exits.py", (), "exit codes [0, 3, 1, -15]", id="pymotw"),
    pytest.param("futures_pool.py", (), "(17, True)", id="futures"),
    pytest.param("tqdm_process_map.py", (), "396010000", id="tqdm"),
    pytest.param("pandarallel_apply.py", ("pipe",), "True", id="pandarallel-pipe"),
    pytest.param("pandarallel_apply.py", ("memory_fs",), "True", id="pandarallel-memory_fs"),
    pytest.param("scientific.py", ("emcee",), "emcee", id="emcee"),
    pytest.param("scientific.py", ("scipy",), "scipy", id="scipy-de"),
    pytest.param("scientific.py", ("sklearn",), "sklearn {'C'", id="sklearn-joblib"),
    pytest.param("scientific.py", ("loky",), "loky joblib [0, 1, 8", id="sklearn-joblib-loky"),
    pytest.param("gym_async.py", (), "gym", id="gymnasium"),
    pytest.param("parmap_map.py", (), "parmap [6, 7", id="parmap"),
    pytest.param("pebble_pool.py", (), "timeout\nafter 0.01\ndone True", id="pebble"),
    # stranger 16 F1: what the __main__ guard set up, as a forked child sees it
    pytest.param("guarded_state.py", ("processes",), "executor 49 [4, 8]", id="guard-process"),
    pytest.param(
        "guarded_state.py", ("pool",), "again [0, 5, 10] [100, 101, 102]", id="guard-pool"
    ),
    pytest.param("guarded_state.py", ("emcee",), "emcee", id="guard-emcee"),
]
IMPORTS = {
    "tqdm": "tqdm",
    "pandarallel-pipe": "pandarallel",
    "pandarallel-memory_fs": "pandarallel",
    "emcee": "emcee",
    "scipy-de": "scipy",
    "sklearn-joblib": "sklearn",
    "sklearn-joblib-loky": "sklearn",
    "gymnasium": "gymnasium",
    "parmap": "parmap",
    "pebble": "pebble",
    "guard-emcee": "emcee",
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("program", "args", "expected"), CASES)
def test_program_under_nimbus_run_equals_python(
    program: str,
    args: tuple[str, ...],
    expected: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    module = IMPORTS.get(request.node.callspec.id)
    if module is not None:
        pytest.importorskip(module)
    if "memory_fs" in args and not Path("/dev/shm").is_dir():
        pytest.skip("no memory file system")
    stdout, stderr = on_both(program, *args, cwd=tmp_path)
    assert expected in stdout
    if program in ("futures_pool.py", "gym_async.py"):  # their processes were nimbus's
        assert "process class nimbus.multiprocessing.context" in stderr
    if "loky" in args:  # the program's multiprocessing was nimbus's, loky's its own
        assert "multiprocessing is nimbus.multiprocessing" in stderr
