"""The WebSocket messages of the service, its endpoint daemons and the SDK, as dataclasses.

Each message is a msgpack map with an ``op``; its rows are positional lists::

    daemon  -> service  Hello {python, serializer, workers, window, held}
                        Results {results: [ResultRow, ...]}
                        Running {ids}  (tasks on a worker for 50 ms or more)
                        Beat {t}
    service -> daemon   Tasks {tasks: [TaskRow, ...]}  (a function's body comes once per
                        connection)
                        Ack {ids}  (results stored: the daemon may forget them)
                        Cancel {ids}   Beat {t} (the echo of a heartbeat)
    client  -> service  Submit {ref, endpoint_id, tasks: [SubmitRow, ...]}
                        Watch {ids}   Cancel {ids}
    service -> client   Accepted {ref, ids, group} | Refused {ref, status, detail}
                        Results {results: [ResultRow, ...]}  (as the daemon sent them or,
                        from storage, result and record as msgpack bytes)
                        Unknown {ids}  (watched tasks the service does not know: lost
                        when its queues restarted empty without --persist, or expired)

    TaskRow    [task_id, function_id, body | None, payload | {"data": id}, timeout]
    SubmitRow  [function_id, payload | {"data": id}, timeout]
    ResultRow  [task_id, state, [status, data, [buffer, ...]] | {"data": id} | packed, record]

``message.encode()`` gives the bytes on the wire; ``Cls.decode(map)`` reads a
map that :func:`~nimbus.protocol.decode_frame` let through and raises
:class:`~nimbus.errors.ProtocolError` (close code 1008) naming the field that is
wrong. A row whose own fields are wrong does not sink its message: it is read
as :class:`Malformed` (its task id, when that much could be read, and the
error), so that the receiver fails that task alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from nimbus.config import MAX_TIMEOUT, check_timeout
from nimbus.errors import ProtocolError
from nimbus.protocol._codec import WRONG_SHAPE, brief, is_result, pack, unpack
from nimbus.records import TaskState

__all__ = [
    "Accepted",
    "Ack",
    "Beat",
    "Cancel",
    "DataRef",
    "Hello",
    "Malformed",
    "Message",
    "Refused",
    "Result",
    "ResultRow",
    "Results",
    "Running",
    "Submit",
    "SubmitRow",
    "TaskRow",
    "Tasks",
    "Unknown",
    "Watch",
    "decode_message",
]

MAX_WINDOW = 1_000_000  # tasks a daemon may ask to have in flight
_STATES = {state.value: state for state in TaskState}
_T = TypeVar("_T")


def _quick(cls: type[_T]) -> type[_T]:
    """Give a frozen, slotted dataclass an ``__init__`` that fills its slots directly.

    The generated one goes through ``object.__setattr__`` field by field, two to three
    times slower; rows are built by the thousand per message at every hop. The class
    stays frozen (its ``__setattr__`` still refuses), equal and hashable as before.
    """
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    scope: dict[str, Any] = {f"_set_{f.name}": getattr(cls, f.name).__set__ for f in fields}
    params = []
    for f in fields:
        if f.default is dataclasses.MISSING:
            params.append(f.name)
        else:
            scope[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
    body = "".join(f"\n    _set_{f.name}(self, {f.name})" for f in fields) or "\n    pass"
    exec(f"def __init__(self, {', '.join(params)}):{body}", scope)
    init = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init  # type: ignore[method-assign]
    return cls


def _wrong(field: str, expected: str, value: object) -> ProtocolError:
    return ProtocolError(f"{field}: expected {expected}, got {brief(value)}", WRONG_SHAPE)


def _int_in(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _ids(msg: dict[str, Any], field: str, name: str = "ids") -> list[str]:
    value = msg.get(name)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ProtocolError(
            f"{field}.{name}: expected a list of strings, got {brief(value)}", WRONG_SHAPE
        )
    return value


@_quick
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


@_quick
@dataclass(frozen=True, slots=True)
class Result:
    """What a worker sent back: ``[status, data, [buffer, ...]]`` (status: runtime Status)."""

    status: int
    data: bytes
    buffers: Sequence[Any] = ()

    def wire(self) -> list[Any]:
        buffers = self.buffers
        return [self.status, self.data, [memoryview(b) for b in buffers] if buffers else []]

    def pack(self) -> bytes:
        """The packed result (what the data store and the service's storage hold)."""
        return pack(self.wire())

    @classmethod
    def decode(cls, value: object, field: str = "result") -> Result:
        if not is_result(value):
            raise _wrong(field, "[status, data, [buffer, ...]]", value)
        assert isinstance(value, list)
        return cls(value[0], value[1], value[2])

    @classmethod
    def read(cls, value: object, field: str) -> Result:
        """:meth:`decode`, quicker for the usual result (no buffers)."""
        if (
            type(value) is list
            and len(value) == 3
            and type(value[0]) is int
            and -1 <= value[0] <= 255
            and type(value[1]) is bytes
            and value[2] == []
        ):
            return cls(value[0], value[1], ())
        return cls.decode(value, field)

    @classmethod
    def unpack(cls, blob: bytes, field: str = "result") -> Result:
        """A packed result; ProtocolError naming ``field`` if it is not one."""
        try:
            value = unpack(blob)
        except Exception as exc:
            raise ProtocolError(f"{field}: not msgpack ({type(exc).__name__})") from None
        return cls.decode(value, field)


@_quick
@dataclass(frozen=True, slots=True)
class Malformed:
    """A row that could not be read: its task id (None when not even that could be) and
    the error naming what was wrong."""

    task_id: str | None
    function_id: str
    error: ProtocolError


@_quick
@dataclass(frozen=True, slots=True)
class TaskRow:
    """A task the service sends a daemon; ``body`` is the function's, once per connection."""

    task_id: str
    function_id: str
    body: bytes | None
    payload: bytes | DataRef
    timeout: float | None

    def wire(self) -> list[Any]:
        payload = self.payload
        if type(payload) is DataRef:
            return [self.task_id, self.function_id, self.body, payload.wire(), self.timeout]
        return [self.task_id, self.function_id, self.body, payload, self.timeout]

    @classmethod
    def read(cls, row: object, index: int) -> TaskRow | Malformed:
        """Row ``index`` of a Tasks message."""
        field = "tasks.tasks[%d]"
        if type(row) is not list or len(row) != 5 or type(row[0]) is not str:
            field %= index
            error = _wrong(field, "[task_id, function_id, body | None, payload, timeout]", row)
            return Malformed(None, "", error)
        task_id, function_id, body, payload, timeout = row
        if (  # the usual row, quickly
            type(function_id) is str
            and (body is None or type(body) is bytes)
            and type(payload) is bytes
            and (timeout is None or (type(timeout) is float and 0 < timeout <= MAX_TIMEOUT))
        ):
            return cls(task_id, function_id, body, payload, timeout)
        field %= index
        try:
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
        return cls(task_id, function_id, body, payload if ref is None else ref, timeout)


@_quick
@dataclass(frozen=True, slots=True)
class SubmitRow:
    """A task a client submits: ``[function_id, payload | {"data": id}, timeout]``."""

    function_id: str
    payload: bytes | DataRef
    timeout: float | None

    ROW: ClassVar[str] = '[function_id, payload | {"data": data_id}, timeout]'

    def wire(self) -> list[Any]:
        payload = self.payload
        if type(payload) is DataRef:
            return [self.function_id, payload.wire(), self.timeout]
        return [self.function_id, payload, self.timeout]

    @classmethod
    def decode(cls, row: object, field: str) -> SubmitRow:
        """A row, its frame and types checked (its timeout and payload framing are the
        service's to check); ProtocolError naming the field otherwise."""
        if not isinstance(row, list | tuple) or len(row) != 3:
            raise ProtocolError(f"{field}: expected {cls.ROW}, not {brief(row)}", WRONG_SHAPE)
        function_id, payload, timeout = row
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
            return cls(function_id, ref, timeout)
        if not isinstance(payload, bytes):
            raise ProtocolError(
                f'{field}.payload: expected bytes (pack_payload) or {{"data": data_id}}, '
                f"not {brief(payload)}",
                WRONG_SHAPE,
            )
        return cls(function_id, payload, timeout)

    @classmethod
    def decode_all(cls, rows: object, field: str = "tasks") -> list[SubmitRow]:
        if not isinstance(rows, list):
            raise ProtocolError(
                f"{field}: expected a list of {cls.ROW} rows, not {type(rows).__name__}",
                WRONG_SHAPE,
            )
        return [cls.decode(row, f"{field}[{i}]") for i, row in enumerate(rows)]


@_quick
@dataclass(frozen=True, slots=True)
class ResultRow:
    """A finished task: ``result`` as sent (a Result or a DataRef) or as stored (packed
    bytes); ``record`` the TaskRecord's wire list, as stored (packed bytes, b"" for
    none), or None."""

    task_id: str
    state: TaskState
    result: Result | DataRef | bytes
    record: list[Any] | bytes | None

    def wire(self) -> list[Any]:
        result = self.result  # the state is a str Enum: msgpack packs its value
        if type(result) is bytes:
            return [self.task_id, self.state, result, self.record]
        return [self.task_id, self.state, result.wire(), self.record]  # type: ignore[union-attr]

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
            return cls(task_id, read_state, Result(result[0], result[1], ()), record)
        field = f"results.results[{index}]"
        try:
            if read_state is None:
                raise _wrong(f"{field}.state", "a task state", state)
            value: Result | DataRef | bytes
            if type(result) is list:
                value = Result.read(result, f"{field}.result")
            elif isinstance(result, bytes):
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


class Message:
    """A WebSocket message: ``encode()`` gives its bytes, ``decode(map)`` reads it."""

    __slots__ = ()
    op: ClassVar[str]

    def wire(self) -> dict[str, Any]:
        raise NotImplementedError

    def encode(self) -> bytes:
        return pack(self.wire())

    @classmethod
    def decode(cls, msg: dict[str, Any]) -> Message:
        raise NotImplementedError


@_quick
@dataclass(frozen=True, slots=True)
class Hello(Message):
    """A daemon's first message on each connection."""

    op: ClassVar[str] = "hello"
    python: str
    serializer: str
    workers: int
    window: int
    held: list[str]

    def wire(self) -> dict[str, Any]:
        return {
            "op": "hello",
            "python": self.python,
            "serializer": self.serializer,
            "workers": self.workers,
            "window": self.window,
            "held": self.held,
        }

    @classmethod
    def decode(cls, msg: dict[str, Any]) -> Hello:
        python, serializer = msg.get("python", ""), msg.get("serializer", "")
        workers, window = msg.get("workers", 0), msg.get("window", 1)
        for name, value, ok in (
            ("python", python, isinstance(python, str) and len(python) <= 64),
            ("serializer", serializer, isinstance(serializer, str) and len(serializer) <= 64),
            ("workers", workers, _int_in(workers, 0, 1 << 20)),
            ("window", window, _int_in(window, 1, MAX_WINDOW)),
        ):
            if not ok:
                raise ProtocolError(f"hello.{name}: {value!r:.40} is not accepted", WRONG_SHAPE)
        held = _ids(msg, "hello", "held") if "held" in msg else []
        return cls(python, serializer, workers, window, held)


@_quick
@dataclass(frozen=True, slots=True)
class Results(Message):
    """Finished tasks: a daemon's to the service, the service's to a client."""

    op: ClassVar[str] = "results"
    results: list[ResultRow | Malformed]

    def wire(self) -> dict[str, Any]:
        rows = []
        for row in self.results:  # ResultRow.wire, inlined: thousands of rows a message
            assert type(row) is ResultRow
            result: Any = row.result
            if type(result) is Result and not result.buffers:
                result = [result.status, result.data, []]
            elif type(result) is not bytes:
                result = result.wire()
            rows.append([row.task_id, row.state, result, row.record])
        return {"op": "results", "results": rows}

    @classmethod
    def decode(cls, msg: dict[str, Any]) -> Results:
        rows = msg.get("results")
        if not isinstance(rows, list):
            raise _wrong("results.results", "[[task_id, state, result, record], ...]", rows)
        out: list[ResultRow | Malformed] = []
        read = ResultRow.read
        for i, row in enumerate(rows):
            if type(row) is not list or len(row) != 4 or type(row[0]) is not str:
                raise _wrong(f"results.results[{i}]", "[task_id, state, result, record]", row)
            out.append(read(row, i))
        return cls(out)

    def rows(self) -> list[ResultRow]:
        """Every row, read: ProtocolError (the first malformed row's) otherwise."""
        for row in self.results:
            if isinstance(row, Malformed):
                raise row.error
        return self.results  # type: ignore[return-value]


@_quick
@dataclass(frozen=True, slots=True)
class Tasks(Message):
    """Tasks for a daemon (a row it cannot read fails alone)."""

    op: ClassVar[str] = "tasks"
    tasks: list[TaskRow | Malformed]

    def wire(self) -> dict[str, Any]:
        return {"op": "tasks", "tasks": [row.wire() for row in self.tasks]}  # type: ignore[union-attr]

    @classmethod
    def decode(cls, msg: dict[str, Any]) -> Tasks:
        rows = msg.get("tasks")
        if not isinstance(rows, list):
            raise ProtocolError("tasks.tasks: expected a list of task rows", WRONG_SHAPE)
        read = TaskRow.read
        return cls([read(row, i) for i, row in enumerate(rows)])


@_quick
@dataclass(frozen=True, slots=True)
class _Ids(Message):
    """A message that names tasks: ``{op, ids}``."""

    ids: list[str]

    def wire(self) -> dict[str, Any]:
        return {"op": self.op, "ids": self.ids}

    @classmethod
    def decode(cls, msg: dict[str, Any]) -> _Ids:
        return cls(_ids(msg, cls.op))


@_quick
@dataclass(frozen=True, slots=True)
class Running(_Ids):
    """Tasks a daemon's workers have run for RUNNING_AFTER or more."""

    op: ClassVar[str] = "running"

    @classmethod
    def decode(cls, msg: dict[str, Any]) -> Running:
        return cls(_ids(msg, cls.op) if "ids" in msg else [])


@_quick
@dataclass(frozen=True, slots=True)
class Ack(_Ids):
    """Results the service stored: the daemon may forget them."""

    op: ClassVar[str] = "ack"


@_quick
@dataclass(frozen=True, slots=True)
class Cancel(_Ids):
    """Cancel these tasks (a client's to the service, the service's to a daemon)."""

    op: ClassVar[str] = "cancel"


@_quick
@dataclass(frozen=True, slots=True)
class Watch(_Ids):
    """A client asks for the results of these tasks (again, after a reconnect)."""

    op: ClassVar[str] = "watch"


@_quick
@dataclass(frozen=True, slots=True)
class Unknown(_Ids):
    """Watched tasks the service does not know."""

    op: ClassVar[str] = "unknown"


@_quick
@dataclass(frozen=True, slots=True)
class Beat(Message):
    """A daemon's heartbeat (``t``: its monotonic clock), echoed by the service."""

    op: ClassVar[str] = "beat"
    t: Any

    def wire(self) -> dict[str, Any]:
        return {"op": "beat", "t": self.t}

    @classmethod
    def decode(cls, msg: dict[str, Any]) -> Beat:
        return cls(msg.get("t"))

    def seconds(self) -> float:
        """``t`` as a number; ProtocolError otherwise (what a daemon checks of an echo)."""
        t = self.t
        if isinstance(t, bool) or not isinstance(t, int | float):
            raise ProtocolError(f"beat.t: expected a number, got {t!r:.40}", WRONG_SHAPE)
        return float(t)


@_quick
@dataclass(frozen=True, slots=True)
class Submit(Message):
    """A client's batch of tasks for one endpoint; ``ref`` names it in the reply."""

    op: ClassVar[str] = "submit"
    ref: Any
    endpoint_id: str
    tasks: list[SubmitRow]

    def wire(self) -> dict[str, Any]:
        return {
            "op": "submit",
            "ref": self.ref,
            "endpoint_id": self.endpoint_id,
            "tasks": [row.wire() for row in self.tasks],
        }

    @classmethod
    def decode(cls, msg: dict[str, Any]) -> Submit:
        endpoint_id = msg.get("endpoint_id", "")
        if not isinstance(endpoint_id, str) or not 0 < len(endpoint_id) <= 64:
            raise ProtocolError(
                f"endpoint_id: expected an endpoint id, not {brief(endpoint_id)}", WRONG_SHAPE
            )
        return cls(msg.get("ref"), endpoint_id, SubmitRow.decode_all(msg.get("tasks")))


@_quick
@dataclass(frozen=True, slots=True)
class Accepted(Message):
    """The service queued batch ``ref`` as tasks ``ids`` (in its order), in ``group``."""

    op: ClassVar[str] = "accepted"
    ref: Any  # the submit's, as it was sent (the SDK's are ints)
    ids: list[str]
    group: str | None = None

    def wire(self) -> dict[str, Any]:
        msg = {"op": "accepted", "ref": self.ref, "ids": self.ids}
        if self.group is not None:
            msg["group"] = self.group
        return msg

    @classmethod
    def decode(cls, msg: dict[str, Any]) -> Accepted:
        ref, ids, group = msg.get("ref"), _ids(msg, "accepted"), msg.get("group")
        if not isinstance(ref, int):
            raise _wrong("accepted.ref", "an int", ref)
        if group is not None and not isinstance(group, str):
            raise _wrong("accepted.group", "a group id", group)
        return cls(ref, ids, group)


@_quick
@dataclass(frozen=True, slots=True)
class Refused(Message):
    """The service refused batch ``ref``: the HTTP ``status`` it would answer, and why."""

    op: ClassVar[str] = "refused"
    ref: Any
    status: int
    detail: str

    def wire(self) -> dict[str, Any]:
        return {"op": "refused", "ref": self.ref, "status": self.status, "detail": self.detail}

    @classmethod
    def decode(cls, msg: dict[str, Any]) -> Refused:
        ref, status, detail = msg.get("ref"), msg.get("status"), msg.get("detail")
        for name, value, ok in (
            ("ref", ref, isinstance(ref, int)),
            ("status", status, _int_in(status, 0, 999)),
            ("detail", detail, isinstance(detail, str)),
        ):
            if not ok:
                raise _wrong(f"refused.{name}", "{ref: int, status: int, detail: str}", value)
        assert isinstance(status, int) and isinstance(detail, str)
        return cls(ref, status, detail)


def decode_message(msg: dict[str, Any], kinds: dict[str, type[Message]]) -> Message:
    """The message of a map whose ``op`` :func:`~nimbus.protocol.decode_frame` checked
    to be one of ``kinds`` (op -> class)."""
    return kinds[msg["op"]].decode(msg)
