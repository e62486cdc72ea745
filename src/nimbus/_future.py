"""``nimbus.Future``: a ``concurrent.futures.Future`` whose ``cancel()`` stops its task."""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures._base import (  # the states Future.cancel must set
    CANCELLED,
    CANCELLED_AND_NOTIFIED,
    FINISHED,
    PENDING,
    RUNNING,
)
from typing import Any

from nimbus.records import TaskRecord, TaskState

__all__ = ["Future"]


class _Condition(threading.Condition):
    """A ``threading.Condition`` on its own ``RLock`` whose lock methods are looked up
    when called, not bound at creation. A future is made each task, and the stdlib's
    condition binds five: five of the eleven objects of a future that the collector
    walks while a program holds many, and half the time to make one (2.7 us, not 5.5)."""

    def __init__(self) -> None:  # (no super().__init__: it binds them)
        self._lock = threading.RLock()
        self._waiters: deque[Any] = deque()

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        return self._lock.acquire(*args, **kwargs)

    def release(self) -> None:
        self._lock.release()

    def _release_save(self) -> Any:
        return self._lock._release_save()  # type: ignore[attr-defined]

    def _acquire_restore(self, state: Any) -> None:
        self._lock._acquire_restore(state)  # type: ignore[attr-defined]

    def _is_owned(self) -> bool:
        return bool(self._lock._is_owned())  # type: ignore[attr-defined]


class Future(cf.Future[Any]):
    """A ``concurrent.futures.Future`` whose ``cancel()`` also stops running tasks.

    ``record`` is the task's :class:`~nimbus.records.TaskRecord`, complete
    once the future is done. In a process forked while it was pending it is failed
    with a ``RuntimeError`` (:meth:`orphan`): its result arrives in the process that
    submitted it only (waited for there, it hung).
    """

    record: TaskRecord
    _task: Any = None  # its nimbus.runtime.task.Task (a floor above this module)
    _stop: Callable[[Any], None] | None = None
    _after: list[cf.Future[Any]] | None = None  # the futures of the tasks whose results it takes

    def __init__(self) -> None:  # the stdlib's, with the lighter condition
        self._condition = _Condition()
        self._state = PENDING
        self._result = None
        self._exception = None
        self._waiters: list[Any] = []
        self._done_callbacks: list[Callable[[cf.Future[Any]], object]] = []

    def orphan(self, owner: int) -> None:
        """In a process forked from ``owner`` while this was pending (the only thread
        there): failed with a ``RuntimeError`` saying so, its callbacks not run (they
        are ``owner``'s); its result arrives in ``owner`` only."""
        if self._state in (PENDING, RUNNING):
            self._condition = _Condition()  # (another thread of owner's may have held it)
            self._waiters = []  # owner's threads' waits
            self._exception = RuntimeError(_forked_wait(owner))
            self._state = FINISHED

    def cancel(self) -> bool:
        """Cancel the task; a running task's worker is killed and replaced."""
        with self._condition:
            if self._state == FINISHED:
                return False
            if self._state in (CANCELLED, CANCELLED_AND_NOTIFIED):
                return True
            running = self._state == RUNNING
            self._state = CANCELLED_AND_NOTIFIED
            for waiter in self._waiters:
                waiter.add_cancelled(self)
            self._condition.notify_all()
        task = self._task
        if task is not None:
            task.cancelled = True
            if running and self._stop is not None:
                self._stop(task)
        self.record.state = TaskState.CANCELLED
        self._invoke_callbacks()  # type: ignore[attr-defined]
        return True

    def cancel_unstarted(self) -> bool:
        """Cancel the task unless a worker has said it runs it (``shutdown(cancel_futures=True)``).

        As the stdlib: the running one finishes and its future resolves. A task a
        worker holds queued is skipped there; one that started in the instant
        between is left to finish (its worker is never killed for it).
        """
        task = self._task
        if task is not None and task.started:
            return False
        with self._condition:
            if self._state == FINISHED:
                return False
            if self._state in (CANCELLED, CANCELLED_AND_NOTIFIED):
                return True
            queued = self._state == RUNNING  # in a worker's window, not started
            self._state = CANCELLED_AND_NOTIFIED
            for waiter in self._waiters:
                waiter.add_cancelled(self)
            self._condition.notify_all()
        if task is not None:
            task.skip_only = True
            task.cancelled = True
            if queued and self._stop is not None:
                self._stop(task)
        self.record.state = TaskState.CANCELLED
        self._invoke_callbacks()  # type: ignore[attr-defined]
        return True


def _forked_wait(owner: int) -> str:
    return (
        f"this future's task was submitted by process {owner}, and this process "
        f"({os.getpid()}) was forked from it while the task was pending: its result arrives "
        f"in process {owner} only, so waiting here would never end; wait for it there (and "
        f"send the result to this process), or submit the task from an Executor made here"
    )
