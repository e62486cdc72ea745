"""Finalizers' store work, done later on a thread of its own (``later``).

::

    GC, in any thread ---> finalizer: later(fn, args) ---> deque ---> releasing thread: fn(*args)
                           (no lock, no I/O on a link)     + a byte down its own pipe (wake-up)

The garbage collector runs finalizers in whichever thread allocates, which may
be in the middle of its own call on its store link (a finalizer's commands and
replies would interleave with that call's) or hold a lock the finalizer would
take. So a finalizer that talks to the store only queues its work here: a
deque's append is atomic, the thread is started without ``Thread.start`` (it
takes locks) and woken through a pipe of its own. What is still queued at exit
runs then, after the one under way; a forked child forgets its parent's queue.
"""

from __future__ import annotations

import _thread
import collections
import itertools
import os
import time
from collections.abc import Callable
from multiprocessing import util
from typing import Any

__all__ = ["later"]

_queued: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = collections.deque()
_wake: list[int] = []  # the thread's wake pipe (write end, read end), once it runs
_busy = [False]  # the thread is running one (exit waits for it)
_first = [itertools.count()]  # next() is atomic: the caller that draws 0 starts the thread


def later(fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    """Run ``fn(*args)`` on the releasing thread, soon (``fn`` must not raise)."""
    _queued.append((fn, args))
    wake = _wake
    if not wake:
        if next(_first[0]):  # another call is starting the thread: it runs this first
            return
        r, w = os.pipe()  # the first: the thread starts
        os.set_blocking(w, False)
        wake += (w, r)
        _thread.start_new_thread(_run, (r,))
        util.Finalize(None, run_queued, exitpriority=10)
        return
    try:
        os.write(wake[0], b"x")
    except OSError:  # full: a wake-up is pending anyway
        pass


def _run(wake: int) -> None:
    """The releasing thread: what is queued, in order; then wait to be woken."""
    while True:
        while _queued:
            try:
                fn, args = _queued.popleft()
            except IndexError:
                break
            _busy[0] = True
            fn(*args)
            _busy[0] = False
        try:
            os.read(wake, 4096)
        except OSError:
            return


def run_queued() -> None:
    """At exit: what is still queued, now (after the one under way, if any)."""
    deadline = time.monotonic() + 2.0
    while _busy[0] and time.monotonic() < deadline:
        time.sleep(0.001)
    while _queued:
        try:
            fn, args = _queued.popleft()
        except IndexError:
            break
        fn(*args)


def _forget() -> None:
    """In a forked child: the parent's queue (and its thread) are the parent's."""
    _queued.clear()
    for fd in _wake:
        try:
            os.close(fd)
        except OSError:
            pass
    _wake.clear()
    _busy[0] = False
    _first[0] = itertools.count()


os.register_at_fork(after_in_child=_forget)
