"""A lock file shared by the processes of one machine, taken with a deadline: :func:`lock_file`.

::

    with lock_file(path, timeout):   # TimeoutError after ``timeout`` s; the caller
        ...                          # translates it, naming what it waited for

It is a POSIX record lock (``fcntl.lockf``), which belongs to the *process*: a
child forked while it is held does not hold it, and it goes with its holder
(an ``flock`` belongs to the open file, which a forked child shares: the lock
then outlives its holder for as long as the child lives, and every other
process waits for it for ever). Record locks do not exclude the threads of one
process, so a ``threading.Lock`` per path does that; a forked child starts with
none of them held.

The lock is polled until the deadline, never waited on without one.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["lock_file"]

_guard = threading.Lock()
_threads: dict[str, threading.Lock] = {}  # this process's lock of each path


def _after_fork() -> None:
    """In a forked child: none of the parent's locks are held here (the record locks
    are not inherited either)."""
    global _guard, _threads
    _guard = threading.Lock()
    _threads = {}


os.register_at_fork(after_in_child=_after_fork)


@contextmanager
def lock_file(path: str | Path, timeout: float) -> Iterator[None]:
    """Hold the exclusive lock of ``path`` (created 0600 if missing) in the block.

    Raises :class:`TimeoutError` (naming ``path``) when another process or thread
    held it for ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    key = os.path.abspath(path)
    with _guard:
        local = _threads.setdefault(key, threading.Lock())
    if not local.acquire(timeout=max(timeout, 0.0)):
        raise TimeoutError(f"lock file {path} held by another thread for {timeout} s")
    try:
        fd = os.open(key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            pause = 0.001
            while True:
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EACCES, errno.EAGAIN):
                        raise
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"lock file {path} held by another process for {timeout} s"
                    ) from None
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
            yield
        finally:
            os.close(fd)  # (releases the record lock)
    finally:
        local.release()
