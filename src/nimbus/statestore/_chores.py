"""A program's chores: the sweeps of what dead programs left, off its first start.

::

    program() / LocalSite()  -- later(fn) -->  [fn, ...]  -- CHORES_AFTER s, or at exit -->
                                                             one thread runs them in order

A root opening its program removes what programs killed on this host left
(their embedded Redis's files, shared memory directories, relay and
messaging sockets). None of it is needed for the program's own first
``Process`` start, which it would hold up by milliseconds (a thread of the
same process doing them meanwhile holds the interpreter's lock): they run
on one thread ``CHORES_AFTER`` seconds later, or at the program's exit if
that comes first (a short program still sweeps). A process forked from the
root (a warm worker) does not inherit them.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable

__all__ = ["CHORES_AFTER", "later", "run_now"]

CHORES_AFTER = 1.0  # seconds after the first chore was asked for that they run

_chores: list[Callable[[], object]] = []
_lock = threading.Lock()
_now = threading.Event()
_thread: threading.Thread | None = None
_registered = False  # run_now is an exit handler
log = logging.getLogger(__name__)


def later(fn: Callable[[], object]) -> None:
    """Run ``fn`` (a sweep) on the chores' thread, soon but not now; at exit at the latest."""
    global _thread, _registered
    with _lock:
        _chores.append(fn)
        if _thread is None:
            _thread = threading.Thread(target=_run, name="nimbus-chores", daemon=True)
            _thread.start()
            if not _registered:
                _registered = True
                atexit.register(run_now)


def run_now(timeout: float = 10.0) -> None:
    """Run the chores asked for so far now (at exit), and wait for them."""
    thread = _thread
    if thread is None or thread.ident is None:
        return
    _now.set()
    if thread is not threading.current_thread():
        thread.join(timeout)


def _run() -> None:
    global _thread
    _now.wait(CHORES_AFTER)
    while True:
        with _lock:
            if not _chores:
                _thread = None  # a later chore starts another
                return
            fn = _chores.pop(0)
        try:
            fn()
        except Exception:  # a sweep that failed leaves files for the next program's
            log.debug("nimbus: a sweep of dead programs' files failed", exc_info=True)


def _forget_in_child() -> None:
    """A fork (a warm worker) runs none of its parent's chores."""
    global _lock, _thread, _now
    _lock = threading.Lock()
    _now = threading.Event()
    _thread = None
    _chores.clear()


os.register_at_fork(after_in_child=_forget_in_child)
