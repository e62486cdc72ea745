"""The rows inside the WebSocket messages: tasks, submitted tasks, results, references.

Each row is a :class:`~typing.NamedTuple` in the field order of its wire list,
so msgpack packs it as that list with no conversion (rows travel by the
thousand per message, at every hop); a :class:`DataRef` among them packs as
``{"data": data_id}`` (the codec's ``pack`` calls its ``wire``), and a
result's out-of-band buffers as bytes::

    TaskRow    [task_id, function_id, body | None, payload | {"data": id}, timeout, environment,
                owner]
    SubmitRow  [function_id, payload | {"data": id}, timeout, environment, after]
    ResultRow  [task_id, state, [status, data, [buffer, ...]] | {"data": id} | packed, record]
    Result     [status, data, [buffer, ...]]

``environment`` is the task's :class:`~nimbus.Environment` as its ``to_dict()``, or None
(the workers' own Python); a row without it (five or three fields, from an older
peer) reads as None. A submitted row's ``after`` (left out when it has none) names
the tasks whose results it takes: their task ids, or the places of earlier rows of the
same message (ints); the service holds it until they succeed. A task row's ``owner`` is the id of the user who submitted it
(the service sets it, never the client: the endpoint keeps that user's data apart by
it, see ``nimbus.owners``); a row of six or five fields reads as None.

Reading checks every field: the usual row takes one fast path (its types
checked, then the tuple made in one call), any other goes through the checks
that name the field that is wrong (:class:`~nimbus.errors.ProtocolError`,
close code 1008). A row whose own fields are wrong does not sink its message:
it is read as :class:`Malformed` (its task id, when that much could be read,
and the error), so that the receiver fails that task alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from nimbus.config import MAX_TIMEOUT, check_timeout
from nimbus.errors import ProtocolError
from nimbus.protocol._codec import WRONG_SHAPE, brief, is_result, pack, unpack
from nimbus.records import TaskState

__all__ = [
    "SUBMIT_ROW",
    "DataRef",
    "Malformed",
    "Result",
    "ResultRow",
    "SubmitRow",
    "TaskRow",
    "check_environment",
    "check_owner",
    "inputs_of",
    "new_row",
    "submit_row",
]

SUBMIT_ROW = '[function_id, payload | {"data": data_id}, timeout, environment | None, after?]'
MAX_AFTER = 256  # inputs of one task (the data path looks at no more arguments than this)
ENVIRONMENT = (
    "None or an environment {name, requirements, wheelhouse, image, sandbox} "
    "(Environment.to_dict())"
)
OWNER = "None or a user id (1-64 characters, no '/')"
_ENV_FIELDS = {"name", "requirements", "wheelhouse", "image", "sandbox"}
_TASK_ROW = "[task_id, function_id, body | None, payload, timeout, environment, owner]"
_STATES = {state.value: state for state in TaskState}
_new = tuple.__new__  # a row from a list already checked, in one call
new_row = tuple.__new__
"""``new_row(TaskRow, (task_id, ...))``: a row in one call, for the paths that make one per
task (calling the class goes through NamedTuple's generated ``__new__``, 2-3x slower)."""


def _wrong(field: str, expected: str, value: object) -> ProtocolError:
    return ProtocolError(f"{field}: expected {expected}, got {brief(value)}", WRONG_SHAPE)


def _after(value: object, field: str) -> list[str | int] | None:
    """A submitted row's inputs: None, or a list of task ids and places of earlier rows."""
    if value is None:
        return None
    if type(value) is not list or not 0 < len(value) <= MAX_AFTER:
        raise _wrong(field, f"a list of 1 to {MAX_AFTER} task ids or row places", value)
    for item in value:
        if not (
            (type(item) is str and 0 < len(item) <= 64)
            or (type(item) is int and 0 <= item < 1 << 20)
        ):
            raise _wrong(field, "task ids (strings) or places of earlier rows (ints)", item)
    return value


def check_environment(value: object, field: str) -> dict[str, Any] | None:
    """``value`` if it is None or an environment's ``to_dict()``; ProtocolError naming
    ``field`` (and the key that is wrong) otherwise."""
    if value is None:
        return None
    if type(value) is not dict or not value.keys() <= _ENV_FIELDS:
        raise _wrong(field, ENVIRONMENT, value)
    name = value.get("name")
    if type(name) is not str or not 0 < len(name) <= 64:
        raise _wrong(f"{field}.name", "a name of 1-64 characters", name)
    reqs = value.get("requirements", [])
    if (
        type(reqs) is not list
        or len(reqs) > 1000
        or not all(type(r) is str and 0 < len(r) <= 1000 for r in reqs)
    ):
        raise _wrong(f"{field}.requirements", "a list of requirement strings", reqs)
    for key in ("wheelhouse", "image"):
        item = value.get(key)
        if item is not None and (type(item) is not str or not 0 < len(item) <= 4096):
            raise _wrong(f"{field}.{key}", "a string or None", item)
    if type(value.get("sandbox", False)) is not bool:
        raise _wrong(f"{field}.sandbox", "true or false", value.get("sandbox"))
    return value


def check_owner(value: object, field: str) -> str | None:
    """``value`` if it is None or a user id; ProtocolError naming ``field`` otherwise."""
    if value is None or (type(value) is str and 0 < len(value) <= 64 and "/" not in value):
        return value
    raise _wrong(field, OWNER, value)


@dataclass(frozen=True, slots=True)
class DataRef:
    """A payload or result in the service's data store: ``{"data": data_id}``."""

    data_id: str

    def wire(self) -> dict[str, str]:
        return {"data": self.data_id}

    @classmethod
    def read(cls, value: object) -> DataRef | None:
        """The reference ``value`` is, or None (an inline value)."""
        if isinstance(value, dict):
            ref = value.get("data")
            if isinstance(ref, str):
                return cls(ref)
        return None


class Result(NamedTuple):
    """What a worker sent back: ``[status, data, [buffer, ...]]`` (status: runtime Status)."""

    status: int
    data: bytes
    buffers: Sequence[Any] = ()

    def pack(self) -> bytes:
        """The packed result (what the data store and the service's storage hold)."""
        return pack(self)

    @classmethod
    def decode(cls, value: object, field: str = "result") -> Result:
        if not is_result(value):
            raise _wrong(field, "[status, data, [buffer, ...]]", value)
        assert isinstance(value, list)
        return _new(cls, value)

    @classmethod
    def unpack(cls, blob: bytes, field: str = "result") -> Result:
        """A packed result; ProtocolError naming ``field`` if it is not one."""
        try:
            value = unpack(blob)
        except Exception as exc:
            raise ProtocolError(f"{field}: not msgpack ({type(exc).__name__})") from None
        return cls.decode(value, field)


@dataclass(frozen=True, slots=True)
class Malformed:
    """A row that could not be read: its task id (None when not even that could be) and
    the error naming what was wrong."""

    task_id: str | None
    function_id: str
    error: ProtocolError


class TaskRow(NamedTuple):
    """A task the service sends a daemon; ``body`` is the function's, once per connection."""

    task_id: str
    function_id: str
    body: bytes | None
    payload: bytes | DataRef
    timeout: float | None
    environment: dict[str, Any] | None = None
    owner: str | None = None

    @classmethod
    def read(cls, row: object, index: int) -> TaskRow | Malformed:
        """Row ``index`` of a Tasks message."""
        if type(row) is not list or not 5 <= len(row) <= 7 or type(row[0]) is not str:
            field = f"tasks.tasks[{index}]"
            error = _wrong(field, _TASK_ROW, row)
            return Malformed(None, "", error)
        if len(row) < 7:
            row = [*row, None] if len(row) == 6 else [*row, None, None]
        task_id, function_id, body, payload, timeout, environment, owner = row
        if (  # the usual row, quickly
            type(function_id) is str
            and (body is None or type(body) is bytes)
            and type(payload) is bytes
            and (timeout is None or (type(timeout) is float and 0 < timeout <= MAX_TIMEOUT))
            and environment is None
            and (
                owner is None or (type(owner) is str and 0 < len(owner) <= 64 and "/" not in owner)
            )
        ):
            return _new(cls, row)
        field = f"tasks.tasks[{index}]"
        try:
            check_environment(environment, f"{field}.environment")
            check_owner(owner, f"{field}.owner")
            if not isinstance(function_id, str):
                raise _wrong(f"{field}.function_id", "a string", function_id)
            if body is not None and not isinstance(body, bytes):
                raise _wrong(f"{field}.body", "bytes or None", body)
            ref = DataRef.read(payload)
            if not isinstance(payload, bytes) and ref is None:
                raise _wrong(f"{field}.payload", 'bytes or {"data": data_id}', payload)
            try:
                check_timeout(timeout, f"{field}.timeout")
            except ValueError as exc:
                raise ProtocolError(str(exc), WRONG_SHAPE) from None
        except ProtocolError as exc:
            return Malformed(task_id, str(function_id), exc)
        return cls(
            task_id, function_id, body, payload if ref is None else ref, timeout, environment, owner
        )


class SubmitRow(NamedTuple):
    """A task a client submits: ``[function_id, payload | {"data": id}, timeout,
    environment]``, and a fifth item, ``after``, when it has inputs: such a row is made
    with :func:`submit_row` and read with :func:`inputs_of` (a row without inputs packs
    to the four items of before)."""

    function_id: str
    payload: bytes | DataRef
    timeout: float | None
    environment: dict[str, Any] | None = None

    @classmethod
    def decode(cls, row: object, field: str) -> SubmitRow:
        """A row, its frame and types checked (its timeout and payload framing are the
        service's to check); ProtocolError naming the field otherwise."""
        if (  # the usual row, quickly
            type(row) is list
            and len(row) == 4
            and type(row[0]) is str
            and 0 < len(row[0]) <= 64
            and type(row[1]) is bytes
            and row[3] is None
        ):
            return _new(cls, row)
        if not isinstance(row, list | tuple) or not 3 <= len(row) <= 5:
            raise ProtocolError(f"{field}: expected {SUBMIT_ROW}, not {brief(row)}", WRONG_SHAPE)
        function_id, payload, timeout, *rest = row
        environment = check_environment(rest[0] if rest else None, f"{field}.environment")
        after = _after(rest[1] if len(rest) > 1 else None, f"{field}.after")
        if not isinstance(function_id, str) or not 0 < len(function_id) <= 64:
            raise ProtocolError(
                f"{field}.function_id: expected a function id, not {brief(function_id)}",
                WRONG_SHAPE,
            )
        if isinstance(payload, dict):
            ref = DataRef.read(payload)
            if ref is None or len(payload) != 1 or not 0 < len(ref.data_id) <= 64:
                raise ProtocolError(
                    f'{field}.payload: a reference to the data store is {{"data": data_id}}, '
                    f"not {brief(payload)}",
                    WRONG_SHAPE,
                )
            return submit_row(function_id, ref, timeout, environment, after)
        if not isinstance(payload, bytes):
            raise ProtocolError(
                f'{field}.payload: expected bytes (pack_payload) or {{"data": data_id}}, '
                f"not {brief(payload)}",
                WRONG_SHAPE,
            )
        return submit_row(function_id, payload, timeout, environment, after)

    @classmethod
    def decode_all(cls, rows: object, field: str = "tasks") -> list[SubmitRow]:
        if not isinstance(rows, list):
            raise ProtocolError(
                f"{field}: expected a list of {SUBMIT_ROW} rows, not {type(rows).__name__}",
                WRONG_SHAPE,
            )
        decode = cls.decode
        return [decode(row, f"{field}[%d]" % i) for i, row in enumerate(rows)]


def submit_row(
    function_id: str,
    payload: bytes | DataRef,
    timeout: float | None,
    environment: dict[str, Any] | None,
    after: list[str | int] | None,
) -> SubmitRow:
    """A submitted row, with ``after`` (the inputs it names) as its fifth item if any."""
    if after:
        return _new(SubmitRow, (function_id, payload, timeout, environment, after))
    return _new(SubmitRow, (function_id, payload, timeout, environment))


def inputs_of(row: SubmitRow) -> list[str | int] | None:
    """The inputs a submitted row names (its fifth item), or None."""
    return row[4] if len(row) > 4 else None


class ResultRow(NamedTuple):
    """A finished task: ``result`` as sent (a Result or a DataRef) or as stored (packed
    bytes); ``record`` the TaskRecord's wire list, as stored (packed bytes, b"" for
    none), or None."""

    task_id: str
    state: TaskState  # a str Enum: msgpack packs its value
    result: Result | DataRef | bytes
    record: list[Any] | bytes | None

    @classmethod
    def read(cls, row: list[Any], index: int) -> ResultRow | Malformed:
        """Row ``index`` of a Results message, its frame (a list of four, a task id)
        checked by the caller."""
        task_id, state, result, record = row
        read_state = _STATES.get(state) if type(state) is str else None
        if (  # the usual row, quickly: a finished task's result without buffers
            read_state is not None
            and type(result) is list
            and len(result) == 3
            and type(result[0]) is int
            and -1 <= result[0] <= 255
            and type(result[1]) is bytes
            and result[2] == []
            and (record is None or type(record) is list or type(record) is bytes)
        ):
            return _new(
                cls, (task_id, read_state, _new(Result, (result[0], result[1], ())), record)
            )
        field = f"results.results[{index}]"
        try:
            if read_state is None:
                raise _wrong(f"{field}.state", "a task state", state)
            value: Result | DataRef | bytes
            if isinstance(result, bytes):
                value = result
            elif isinstance(result, dict):
                ref = DataRef.read(result)
                if ref is None:
                    raise _wrong(f"{field}.result", '{"data": data_id}', result)
                value = ref
            else:
                value = Result.decode(result, f"{field}.result")
            if record is not None and not isinstance(record, list | bytes):
                raise _wrong(f"{field}.record", "a record list, packed bytes or None", record)
        except ProtocolError as exc:
            return Malformed(task_id, "", exc)
        return cls(task_id, read_state, value, record)

    def unpacked(self) -> tuple[Result | DataRef, list[Any] | None]:
        """The result and record, unpacked when they come as stored; ProtocolError naming
        the result when it is not one."""
        result = self.result
        if isinstance(result, bytes):
            result = Result.unpack(result, f"task {self.task_id}: result")
        record = self.record
        if isinstance(record, bytes):
            try:
                record = unpack(record) if record else None
            except Exception:
                record = None
        return result, record if isinstance(record, list) else None
