"""The program of the task a warm worker runs now: set by the worker, read by ``nimbus.statestore``.

::

    Executor: payload (args, kwargs, limits, row)  -->  worker: before = join(row)
                                                                fn(*args)  -- statestore.program(),
                                                                              messaging.instance_id()
                                                                leave(before)  -> the on_leave hooks

An Executor's tasks are instances of one program (its client's, or the one the
service hands out for an endpoint), so they message each other: each task
carries that program's row (``statestore.Program.row()``, or the reason there
is none), and the worker joins it for the task's run only. This module is kept
to a few lines with no imports: every task of an Executor goes through
:func:`join` and :func:`leave`, and a worker whose tasks never use the store
or messaging imports neither (two global stores a task).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ask_root", "join", "leave", "on_leave", "row"]

row: Any = None  # the running task's Program.row() or the reason it has none; None: no task's
# how a task's worker asks its executor's process to start the program's store, which is
# that process's own, not started yet (set by the worker: a notice to its manager)
ask_root: Callable[[str], None] | None = None


def join(new: Any) -> Any:
    """Make ``new`` the program of the task about to run; returns what :func:`leave` takes."""
    global row
    before, row = row, new
    return before


def leave(before: Any) -> None:
    """The task ended: the program of before :func:`join` again, then the hooks (the last
    registered first, as atexit) let go of what the task's program left here."""
    global row
    left, row = row, before
    if _hooks and left is not None and left is not before:
        for hook in reversed(_hooks):
            hook(left)


_hooks: list[Callable[[Any], None]] = []


def on_leave(fn: Callable[[Any], None]) -> None:
    """Call ``fn(row)`` when a task that joined ``row`` ends (:func:`leave`)."""
    _hooks.append(fn)
