"""Workers forked from this process: a warm one in milliseconds.

::

    manager's process (has imported what the workers need)
        fork_worker(sock, close, preload) --os.fork--> child: _become_worker (own session,
        |                                              stdin /dev/null, unbuffered stdio,
        v                                              blank __main__), closes what it must
    ForkedWorker(pid): poll / wait / kill              not keep, then worker.main(FD, preload)

A process that has imported what its workers need (a multiprocessing program's
root) gets a worker in milliseconds rather than a new interpreter's start and
imports; the worker imports its preload only once it has been quiet a while.
:class:`ForkedWorker` is the part of ``subprocess.Popen`` a manager uses, as the
stdlib's ``multiprocessing.popen_fork`` is for a forked ``Process``; the worker
itself is ``nimbus.runtime.worker``.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any

from nimbus.runtime.worker import main

__all__ = ["ForkedWorker", "at_worker_start", "fork_worker", "no_fork", "open_descriptors"]

_forking = threading.Lock()  # held by each fork of a worker, and by no_fork()


def _new_lock() -> None:
    global _forking
    _forking = threading.Lock()  # a fork while another thread held it: not held here


os.register_at_fork(after_in_child=_new_lock)


@contextlib.contextmanager
def no_fork() -> Iterator[None]:
    """While inside, this process forks no worker: a descriptor opened and closed inside
    (a sweep's directory listing, on another thread than the forks) is no worker's."""
    with _forking:
        yield


_at_start: list[tuple[Callable[[], object], bool]] = []


def at_worker_start(fn: Callable[[], object], *, once: bool = False) -> None:
    """Have each worker forked from now on (``once``: the next one only) call ``fn``
    first, before it serves: work its first task needs, done while the root still
    starts the others (``fn`` may leave it for the worker's first idle moment)."""
    _at_start.append((fn, once))


class ForkedWorker:
    """A worker forked from this process: the part of ``subprocess.Popen`` a manager uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 255 << 8  # reaped elsewhere: its code is lost
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def fork_worker(
    sock: socket.socket,
    close: list[Callable[[], object]],
    preload: list[str],
    keep: set[int] | None = None,
) -> ForkedWorker:
    """Fork a worker from this process, serving on ``sock`` (its end of the channel).

    For a process that has imported what its workers need already (the root
    of a multiprocessing program): a fork takes milliseconds where a new
    interpreter and its imports take a good part of a second. The child
    becomes what ``python -u -c WORKER_MAIN`` would be: a session of its own,
    stdin from ``/dev/null``, unbuffered stdout and stderr, a blank
    ``__main__`` (a task imports the program's main module as a new worker
    does), and nothing of its parent's but what it inherits; ``close`` are
    called in the child first (the manager's ends of the other channels).
    With ``keep`` (:func:`open_descriptors` as the first worker forked), the
    child closes every descriptor opened since, but its channel: a worker
    forked later (one replacing a worker that died) has the descriptors the
    first ones have, not those the program opened meanwhile.
    """
    for stream in (sys.stdout, sys.stderr):  # what is buffered is written once, here
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    with _forking:  # (released in the child too: its copy of the lock)
        pid = os.fork()
    if pid:
        _at_start[:] = [(fn, once) for fn, once in _at_start if not once]
        return ForkedWorker(pid)
    code = 1
    try:
        _become_worker(close)
        if keep is not None:
            _close_newer(keep, sock.fileno())
        for fn, _ in _at_start:
            try:
                fn()
            except Exception:  # the task that needs it does it again, and reports
                pass
        code = main([str(sock.fileno()), *preload], preload_later=True)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(code)


def open_descriptors() -> set[int]:
    """This process's open descriptors."""
    for where in ("/proc/self/fd", "/dev/fd"):
        try:
            names = os.listdir(where)
        except OSError:
            continue
        found = set()
        for name in names:
            try:
                os.fstat(int(name))
            except (OSError, ValueError):  # the listing's own, closed by now
                continue
            found.add(int(name))
        return found
    return set()


def _close_newer(keep: set[int], channel: int) -> None:
    """Close the descriptors that are not in ``keep`` (but stdio and ``channel``)."""
    for fd in open_descriptors() - keep:
        if fd > 2 and fd != channel:
            try:
                os.close(fd)
            except OSError:
                pass


def _become_worker(close: list[Callable[[], object]]) -> None:
    """In a forked worker: let go of what was the parent's (see :func:`fork_worker`)."""
    os.setsid()
    # this thread (the manager's, a daemon) is the main thread now: as a new
    # interpreter's, it is not a daemon (threads it starts are not: they are waited for)
    me: Any = threading.current_thread()
    me._daemonic = False
    me._name = "MainThread"
    for fn in close:
        try:
            fn()
        except OSError:
            pass
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for name in ("stdout", "stderr"):
        old = getattr(sys, name)
        fd = 1 if name == "stdout" else 2
        raw = io.FileIO(fd, "w", closefd=False)
        setattr(
            sys,
            name,
            io.TextIOWrapper(
                raw,
                encoding=getattr(old, "encoding", None) or "utf-8",
                errors=getattr(old, "errors", None) or "backslashreplace",
                line_buffering=True,
                write_through=True,
            ),
        )
    main_module = types.ModuleType("__main__")
    main_module.__builtins__ = __builtins__  # type: ignore[attr-defined]
    sys.modules["__main__"] = main_module
