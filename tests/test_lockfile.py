from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from nimbus._lockfile import lock_file

if TYPE_CHECKING:
    from conftest import LockHolder

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _taken_by_another_process(path: Path, within: float) -> bool:
    """Whether a new process takes the lock of ``path`` within ``within`` s."""
    code = (
        "import sys\nfrom nimbus._lockfile import lock_file\n"
        "try:\n    with lock_file(sys.argv[1], float(sys.argv[2])): pass\n"
        "except TimeoutError:\n    sys.exit(3)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path), str(within)],
        env=os.environ | {"PYTHONPATH": SRC},
        timeout=60,
    )
    return done.returncode == 0


def test_a_child_forked_while_the_lock_is_held_does_not_keep_it(tmp_path: Path) -> None:
    # review6 #2: an flock stays held by every child forked while it was held
    path = tmp_path / ".x.lock"
    with lock_file(path, 1):
        child = os.fork()
        if child == 0:  # a long-lived child (a standby, a Process)
            time.sleep(30)
            os._exit(0)
    try:
        assert _taken_by_another_process(path, 3)
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)


def test_another_process_waits_for_it_up_to_its_timeout(
    tmp_path: Path, hold_lock: Callable[[Path], LockHolder]
) -> None:
    path = tmp_path / ".x.lock"
    holder = hold_lock(path)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=str(path)), lock_file(path, 0.5):
        pass
    assert 0.4 < time.monotonic() - start < 3
    holder.let_go()
    with lock_file(path, 1):  # free again
        pass


def test_the_threads_of_one_process_exclude_each_other(tmp_path: Path) -> None:
    path = tmp_path / ".x.lock"
    inside: list[int] = []
    most = [0]

    def work() -> None:
        for _ in range(20):
            with lock_file(path, 10):
                inside.append(1)
                most[0] = max(most[0], len(inside))
                time.sleep(0.001)
                inside.pop()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert most[0] == 1
    failed: list[BaseException] = []

    def another() -> None:
        try:
            with lock_file(path, 0.2):
                pass
        except TimeoutError as exc:
            failed.append(exc)

    with lock_file(path, 1):
        other = threading.Thread(target=another)
        other.start()
        other.join(10)
    assert len(failed) == 1 and "another thread" in str(failed[0])
