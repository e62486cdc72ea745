"""Workers forked from this process (``nimbus.runtime.popen_fork``)."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

from nimbus.runtime.popen_fork import fork_worker, no_fork


def _files_of(pid: int) -> set[str]:
    found = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            found.add(os.readlink(f"/proc/{pid}/fd/{name}"))
        except OSError:
            pass
    return found


def test_a_worker_forked_beside_a_sweep_does_not_keep_its_descriptor(tmp_path: Path) -> None:
    """Review 7 #14: the chores' sweeps (``_local._remove_stale``) run on their own thread
    while warm workers are forked; a worker forked while a sweep had a directory or file
    open kept that descriptor for life (and its children after it). A fork now waits
    for what is opened and closed under ``no_fork()``."""
    scanned = tmp_path / "scanned"
    scanned.write_bytes(b"")
    opened, let_go = threading.Event(), threading.Event()

    def sweep() -> None:
        with no_fork():
            fd = os.open(scanned, os.O_RDONLY)
            opened.set()
            let_go.wait(30)
            os.close(fd)

    sweeper = threading.Thread(target=sweep)
    sweeper.start()
    assert opened.wait(30)
    ours, theirs = socket.socketpair()
    workers = []
    forking = threading.Thread(target=lambda: workers.append(fork_worker(theirs, [], [])))
    forking.start()
    forking.join(1.0)  # (forked at once without the lock; waits for the sweep with it)
    let_go.set()
    sweeper.join(30)
    forking.join(30)
    theirs.close()
    (worker,) = workers
    try:
        assert str(scanned) not in _files_of(worker.pid)
    finally:
        worker.kill()
        worker.wait()
        ours.close()


def test_a_child_forked_while_no_fork_is_held_can_fork_workers() -> None:
    """Review 8: the lock ``no_fork`` holds was inherited held by a process forked
    meanwhile (by another thread), whose first worker fork then waited for ever."""
    import os

    from nimbus.runtime import popen_fork

    with popen_fork.no_fork():
        pid = os.fork()
        if pid == 0:  # the child: the lock is its own, free
            os._exit(0 if popen_fork._forking.acquire(timeout=5) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
