"""A service result row read into its task (``nimbus.backends._outcomes``): the worker's
record kept beside the client's own fields, every wrong shape failing the task with a
ProtocolError naming it, a result from the data store, a task lost, an input failed."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses

import pytest

from nimbus import serialization
from nimbus.backends._outcomes import fail, input_failed, lost, outcome, stored
from nimbus.errors import InputFailed, ProtocolError, ServiceError, TaskLost
from nimbus.protocol import DataRef, Malformed, Result, ResultRow, pack
from nimbus.records import TaskRecord, TaskState
from nimbus.runtime.messages import Status
from nimbus.runtime.task import Task


def _task(task_id: str = "t1") -> Task:
    record = TaskRecord(task_id, function="square", submitted=1.0)
    return Task(0, "key", b"fn", b"payload", [], record)


def _worker_record(task_id: str) -> list[object]:
    theirs = TaskRecord(task_id, function="theirs", host="node7", pid=42, started=5.0)
    return [getattr(theirs, f.name) for f in dataclasses.fields(TaskRecord)]


def test_a_result_keeps_the_clients_fields_and_takes_the_workers_measures() -> None:
    task = _task()
    row = ResultRow("t1", TaskState.SUCCESS, Result(Status.OK, b"data"), _worker_record("x"))
    assert outcome(task, row) == Result(Status.OK, b"data")
    assert (task.record.task_id, task.record.function, task.record.submitted) == (
        "t1",
        "square",
        1.0,
    )
    assert (task.record.host, task.record.pid, task.record.started) == ("node7", 42, 5.0)
    shorter = _worker_record("x")[:7]  # an older peer's record: the fields both know
    task = _task()
    assert outcome(task, row._replace(record=shorter)) == Result(Status.OK, b"data")
    assert (task.record.host, task.record.pid, task.record.function) == ("node7", 42, "square")


def test_a_stored_result_and_record_are_unpacked() -> None:
    task = _task()
    packed = Result(Status.OK, b"data", [b"buf"]).pack()
    row = ResultRow("t1", TaskState.SUCCESS, packed, pack(_worker_record("t1")))
    result = outcome(task, row)
    assert isinstance(result, Result) and result.data == b"data"
    assert list(result.buffers) == [b"buf"] and task.record.host == "node7"
    ref = DataRef("d1")
    assert outcome(_task(), ResultRow("t1", TaskState.SUCCESS, ref, None)) == ref


@pytest.mark.parametrize(
    ("row", "said"),
    [
        (Malformed("t1", "", ProtocolError("results.results[0].state: a task state")), "state"),
        (ResultRow("t1", TaskState.SUCCESS, b"not msgpack \xc1", None), "not msgpack"),
        (ResultRow("t1", TaskState.SUCCESS, Result(999, b""), None), "status 999"),
    ],
)
def test_a_row_of_the_wrong_shape_fails_its_task_naming_it(
    row: ResultRow | Malformed, said: str
) -> None:
    error = outcome(_task(), row)
    assert isinstance(error, ProtocolError)
    assert "task t1: the service sent a result of the wrong shape" in str(error)
    assert said in str(error) and "expected [status, data, buffers]" in str(error)


def test_a_task_skipped_on_the_service_fails_unless_it_was_cancelled_here() -> None:
    row = ResultRow("t1", TaskState.CANCELLED, Result(Status.SKIPPED, b""), None)
    error = outcome(_task(), row)
    assert isinstance(error, ServiceError) and error.status == 409
    assert "was cancelled on the service" in str(error)
    task = _task()
    task.cancelled = True
    assert outcome(task, row) == Result(Status.SKIPPED, b"")


def test_a_result_fetched_from_the_data_store_is_unpacked_or_fails_the_task() -> None:
    task = _task()
    stored(task, "d1", Result(Status.OK, b"data", [b"b"]).pack())
    assert (task.status, task.data, task.result_buffers) == (Status.OK, b"data", [b"b"])
    task = _task()
    stored(task, "d1", b"\xc1 not a result")
    assert task.status == Status.ERROR
    error, _ = serialization.loads(task.data)  # as dumps_exception packs it
    assert isinstance(error, ProtocolError)
    assert "its result d1 in the service's data store is not a packed result" in str(error)


def test_lost_and_failed_inputs_say_what_to_do() -> None:
    error = lost("t9", "http://svc")
    assert isinstance(error, TaskLost) and error.status == 410
    assert "task t9 was lost by the service at http://svc" in str(error)
    assert "submit it again" in str(error)
    task = fail(_task(), error)
    assert task.status == Status.ERROR and isinstance(serialization.loads(task.data)[0], TaskLost)


def test_an_input_that_failed_or_was_cancelled_fails_its_dependent() -> None:
    pending, failed, cancelled = cf.Future(), cf.Future(), cf.Future()
    for future, task_id in ((pending, "p"), (failed, "f"), (cancelled, "c")):
        future.record = TaskRecord(task_id)  # type: ignore[attr-defined]
    failed.set_exception(ValueError("bad"))
    cancelled.cancel()
    assert input_failed(_task(), [pending]) is None
    error = input_failed(_task(), [pending, failed])
    assert isinstance(error, InputFailed) and isinstance(error.__cause__, ValueError)
    assert "a task of square did not run: its input, task f, failed (ValueError: bad)" in str(error)
    error = input_failed(_task(), [cancelled])
    assert isinstance(error, InputFailed) and "task c, was cancelled" in str(error)
