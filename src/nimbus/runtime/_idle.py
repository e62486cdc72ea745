"""Work a worker does when it has nothing else to do: :func:`when_idle`, :func:`when_quiet`.

Its serve loop runs :func:`run_idle` as soon as no task is queued, and
:func:`run_later` after the first quiet-time work's ``seconds`` with no frame
(see ``nimbus.runtime.worker``).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

__all__ = ["idle", "later", "run_idle", "run_later", "when_idle", "when_quiet"]

idle: list[Callable[[], None]] = []


def when_idle(fn: Callable[[], None]) -> None:
    """Call ``fn`` once, in this worker's main thread, as soon as it has nothing to do.

    For work that must not delay a task or its result (a task can ask for it).
    """
    idle.append(fn)


def run_idle() -> None:
    while idle:
        fn = idle.pop(0)
        try:
            fn()
        except Exception:
            traceback.print_exc()


later: list[tuple[float, Callable[[], None]]] = []


def when_quiet(fn: Callable[[], None], seconds: float) -> None:
    """Call ``fn`` once, in this worker's main thread, after ``seconds`` with nothing to do.

    For work that is worth doing before the next task only if none comes
    soon: it must not take CPU time from the processes a burst of tasks
    starts (the whole wait starts over whenever a task comes).
    """
    later.append((seconds, fn))
    later.sort(key=lambda item: item[0])


def run_later() -> None:
    """Run the first of the quiet-time work (the rest wait their own time after it)."""
    _seconds, fn = later.pop(0)
    try:
        fn()
    except Exception:
        traceback.print_exc()
