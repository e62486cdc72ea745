"""What becomes of a task the service backend sent: the service's rows read into it.

::

    Results row --> outcome(task, row) --> an error        the task fails with it
                                       --> Result          delivered as it came
                                       --> DataRef         fetched, then stored():
                                                           delivered or failed
    Unknown ids --> lost(task_id, url)  (TaskLost)
    an input failed or was cancelled --> input_failed(task, inputs)  (InputFailed)

The connection and its bookkeeping (which task waits for which reply) are
``nimbus.backends.service``'s; this module only reads one task's row, so every
check of the service's answers has one home. A row of the wrong shape fails its
own task with a ProtocolError naming what was expected.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

from nimbus import serialization
from nimbus.errors import InputFailed, ProtocolError, ServiceError, TaskLost
from nimbus.protocol import DataRef, Malformed, Result, ResultRow
from nimbus.records import TaskRecord
from nimbus.runtime.messages import Status
from nimbus.runtime.task import Task

__all__ = ["fail", "input_failed", "lost", "outcome", "stored", "wrong_shape"]

_FIELDS = [f.name for f in dataclasses.fields(TaskRecord)]
_OURS = frozenset(("task_id", "state", "function", "submitted"))
_THEIRS = [i for i, name in enumerate(_FIELDS) if name not in _OURS]  # the worker's measures:
_THEIR_NAMES = [_FIELDS[i] for i in _THEIRS]  # a full record's are copied in one call
_pick_theirs = operator.itemgetter(*_THEIRS)
_STATUSES = frozenset(Status)


def fail(task: Task, error: BaseException) -> Task:
    """Mark ``task`` failed with ``error`` (what its future raises); returns it."""
    task.status, task.data = Status.ERROR, serialization.dumps_exception(error, "")
    return task


def outcome(task: Task, row: ResultRow | Malformed) -> Result | DataRef | BaseException:
    """Read ``row`` into ``task``'s record: its :class:`Result`, the :class:`DataRef` of a
    stored one, or the error the task fails with."""
    task_id = row.task_id
    error: BaseException | None = None
    result: Result | DataRef | None = None
    if isinstance(row, Malformed):
        error = wrong_shape(task_id, row.error)
    else:
        sent, record = row.result, row.record  # as sent, or packed when it comes
        if not isinstance(sent, bytes) and type(record) is list:  # from storage (a
            result = sent  # watch after a reconnect)
        else:
            try:
                result, record = row.unpacked()
            except ProtocolError as exc:
                error, record = wrong_shape(task_id, exc), None
        if record is not None:  # the worker's measures: keep our id, function,
            mine = task.record  # state, submit time
            if len(record) == len(_FIELDS):  # (TaskRecord: a plain dataclass)
                vars(mine).update(zip(_THEIR_NAMES, _pick_theirs(record)))
            else:  # an older or newer peer's record: the fields both know
                for name, value in zip(_FIELDS, record):
                    if name not in _OURS:
                        setattr(mine, name, value)
    if isinstance(result, Result):
        if result.status not in _STATUSES:
            error = wrong_shape(task_id, f"status {result.status!r}")
        elif result.status == Status.SKIPPED and not task.cancelled:
            error = ServiceError(
                f"task {task_id} was cancelled on the service (by the owner of its "
                f"endpoint, say) before it ran",
                409,
            )
    if error is not None or result is None:
        return error or wrong_shape(task_id, "no result")
    return result


def stored(task: Task, data_id: str, blob: bytes) -> None:
    """Set ``task``'s outcome from ``blob``, its result ``data_id`` fetched from the
    service's data store; a blob that is not a packed result fails the task."""
    try:
        result = Result.unpack(blob)
        if result.status not in _STATUSES:
            raise ValueError(f"status {result.status!r}")
        task.status, task.data, task.result_buffers = (
            result.status,
            result.data,
            list(result.buffers),
        )
    except ValueError as exc:  # not a packed result (ProtocolError is one too)
        fail(
            task,
            ProtocolError(
                f"task {task.record.task_id}: its result {data_id} in the service's data "
                f"store is not a packed result ({type(exc).__name__}: {exc})"
            ),
        )


def lost(task_id: str, url: str) -> TaskLost:
    """The error of a task the service at ``url`` says it does not know."""
    return TaskLost(
        f"task {task_id} was lost by the service at {url}: it no longer knows it "
        f"(its task queues restarted empty, or its result expired); it may or may "
        f"not have run: submit it again (a service started with --persist keeps "
        f"its tasks across such restarts)",
        410,
    )


def wrong_shape(task_id: str | None, why: object) -> ProtocolError:
    return ProtocolError(
        f"task {task_id}: the service sent a result of the wrong shape ({why}); "
        f"expected [status, data, buffers]"
    )


def input_failed(task: Task, inputs: list[Any]) -> InputFailed | None:
    """The error of a task whose input (a future) failed or was cancelled, or None."""
    for future in inputs:
        if not future.done():
            continue
        if future.cancelled():
            why: BaseException | None = None
            what = "was cancelled"
        else:
            why = future.exception()
            what = f"failed ({type(why).__name__}: {why})"
            if why is None:
                continue
        error = InputFailed(
            f"a task of {task.record.function} did not run: its input, task "
            f"{future.record.task_id}, {what}",
            future.record.task_id,
        )
        error.__cause__ = why
        return error
    return None
