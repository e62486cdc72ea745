"""``nimbus.Future``: a ``concurrent.futures.Future`` whose ``cancel()`` stops its task."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from concurrent.futures._base import (  # the states Future.cancel must set
    CANCELLED,
    CANCELLED_AND_NOTIFIED,
    FINISHED,
    RUNNING,
)
from typing import Any

from nimbus.records import TaskRecord, TaskState

__all__ = ["Future"]


class Future(cf.Future[Any]):
    """A ``concurrent.futures.Future`` whose ``cancel()`` also stops running tasks.

    ``record`` is the task's :class:`~nimbus.records.TaskRecord`, complete
    once the future is done.
    """

    record: TaskRecord
    _task: Any = None  # its nimbus.runtime.task.Task (a floor above this module)
    _stop: Callable[[Any], None] | None = None
    _after: list[cf.Future[Any]] | None = None  # the futures of the tasks whose results it takes

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
