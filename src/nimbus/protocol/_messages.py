"""The WebSocket messages of the service, its endpoint daemons and the SDK, as dataclasses.

Each message is a msgpack map with an ``op``; its rows are positional lists::

    daemon  -> service  Hello {python, serializer, workers, window, held, can?}
                        Results {results: [ResultRow, ...]}
                        Running {ids}  (tasks on a worker for 50 ms or more)
                        Beat {t, environments?, runtime?, orders?}
                        Ordered {ref, status, detail, nodes}  (its answer to an Order)
    service -> daemon   Tasks {tasks: [TaskRow, ...]}  (a function's body comes once per
                        connection)
                        Ack {ids}  (results stored: the daemon may forget them)
                        Cancel {ids}   Beat {t} (the echo of a heartbeat)
                        Order {ref, action, name, environment}  (build or remove an
                        environment on every node: only to a daemon whose Hello can "orders")
    client  -> service  Submit {ref, endpoint_id, tasks: [SubmitRow, ...]}
                        (Batch {endpoint_id, tasks}: the same by POST /v1/tasks/batch)
                        Watch {ids}   Cancel {ids}
    service -> client   Accepted {ref, ids, group} | Refused {ref, status, detail}
                        Results {results: [ResultRow, ...]}  (as the daemon sent them or,
                        from storage, result and record as msgpack bytes)
                        Unknown {ids}  (watched tasks the service does not know: lost
                        when its queues restarted empty without --persist, or expired)

    TaskRow    [task_id, function_id, body | None, payload | {"data": id}, timeout, environment]
    SubmitRow  [function_id, payload | {"data": id}, timeout, environment]
    ResultRow  [task_id, state, [status, data, [buffer, ...]] | {"data": id} | packed, record]

The rows are :mod:`nimbus.protocol._rows`' (named tuples: msgpack packs them as
they are). ``message.encode()`` gives the bytes on the wire; ``Cls.decode(map)``
reads a map that :func:`~nimbus.protocol.decode_frame` let through and raises
:class:`~nimbus.errors.ProtocolError` (close code 1008) naming the field that is
wrong; a row that cannot be read is a :class:`~nimbus.protocol.Malformed` in its
message, failing its task alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from nimbus.errors import ProtocolError
from nimbus.protocol._codec import WRONG_SHAPE, brief, pack, unpack
from nimbus.protocol._rows import SUBMIT_ROW, Malformed, ResultRow, SubmitRow, TaskRow

__all__ = [
    "Accepted",
    "Ack",
    "Batch",
    "Beat",
    "Cancel",
    "Hello",
    "Message",
    "Refused",
    "Results",
    "Running",
    "Submit",
    "Tasks",
    "Unknown",
    "Watch",
    "decode_message",
]

MAX_WINDOW = 1_000_000  # tasks a daemon may ask to have in flight


def _wrong(field: str, expected: str, value: object) -> ProtocolError:
    return ProtocolError(f"{field}: expected {expected}, got {brief(value)}", WRONG_SHAPE)


def _int_in(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _endpoint_id(value: object) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= 64:
        raise ProtocolError(
            f"endpoint_id: expected an endpoint id, not {brief(value)}", WRONG_SHAPE
        )
    return value


def _ids(msg: dict[str, Any], field: str, name: str = "ids") -> list[str]:
    value = msg.get(name)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ProtocolError(
            f"{field}.{name}: expected a list of strings, got {brief(value)}", WRONG_SHAPE
        )
    return value


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


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """A daemon's first message on each connection; ``can`` names what it understands
    beyond tasks (``"orders"``: :class:`~nimbus.protocol.Order`); an older daemon says
    nothing, and is sent none."""

    op: ClassVar[str] = "hello"
    python: str
    serializer: str
    workers: int
    window: int
    held: list[str]
    can: tuple[str, ...] = ()

    def wire(self) -> dict[str, Any]:
        msg = {
            "op": "hello",
            "python": self.python,
            "serializer": self.serializer,
            "workers": self.workers,
            "window": self.window,
            "held": self.held,
        }
        if self.can:
            msg["can"] = list(self.can)
        return msg

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
        can = _ids(msg, "hello", "can") if "can" in msg else []
        return cls(python, serializer, workers, window, held, tuple(can[:32]))


@dataclass(frozen=True, slots=True)
class Results(Message):
    """Finished tasks: a daemon's to the service, the service's to a client."""

    op: ClassVar[str] = "results"
    results: list[ResultRow | Malformed]

    def wire(self) -> dict[str, Any]:
        return {"op": "results", "results": self.results}  # rows pack as they are

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


@dataclass(frozen=True, slots=True)
class Tasks(Message):
    """Tasks for a daemon (a row it cannot read fails alone)."""

    op: ClassVar[str] = "tasks"
    tasks: list[TaskRow | Malformed]

    def wire(self) -> dict[str, Any]:
        return {"op": "tasks", "tasks": self.tasks}

    @classmethod
    def decode(cls, msg: dict[str, Any]) -> Tasks:
        rows = msg.get("tasks")
        if not isinstance(rows, list):
            raise ProtocolError("tasks.tasks: expected a list of task rows", WRONG_SHAPE)
        read = TaskRow.read
        return cls([read(row, i) for i, row in enumerate(rows)])


@dataclass(frozen=True, slots=True)
class _Ids(Message):
    """A message that names tasks: ``{op, ids}``."""

    ids: list[str]

    def wire(self) -> dict[str, Any]:
        return {"op": self.op, "ids": self.ids}

    @classmethod
    def decode(cls, msg: dict[str, Any]) -> _Ids:
        return cls(_ids(msg, cls.op))


@dataclass(frozen=True, slots=True)
class Running(_Ids):
    """Tasks a daemon's workers have run for RUNNING_AFTER or more."""

    op: ClassVar[str] = "running"

    @classmethod
    def decode(cls, msg: dict[str, Any]) -> Running:
        return cls(_ids(msg, cls.op) if "ids" in msg else [])


@dataclass(frozen=True, slots=True)
class Ack(_Ids):
    """Results the service stored: the daemon may forget them."""

    op: ClassVar[str] = "ack"


@dataclass(frozen=True, slots=True)
class Cancel(_Ids):
    """Cancel these tasks (a client's to the service, the service's to a daemon)."""

    op: ClassVar[str] = "cancel"


@dataclass(frozen=True, slots=True)
class Watch(_Ids):
    """A client asks for the results of these tasks (again, after a reconnect)."""

    op: ClassVar[str] = "watch"


@dataclass(frozen=True, slots=True)
class Unknown(_Ids):
    """Watched tasks the service does not know."""

    op: ClassVar[str] = "unknown"


MAX_ENVIRONMENTS = 1000  # rows of a beat's environments
MAX_RUNTIME = 1000  # rows of a beat's runtime
MAX_ORDERS = 1000  # rows of a beat's orders


def _scalar_rows(field: str, rows: object, most: int) -> list[dict[str, Any]] | None:
    """``rows`` if it is None or at most ``most`` maps of names to scalars; else ProtocolError."""
    if rows is not None and not (
        type(rows) is list
        and len(rows) <= most
        and all(
            type(e) is dict
            and len(e) <= 16
            and all(
                type(k) is str and (v is None or type(v) in (str, int, float, bool))
                for k, v in e.items()
            )
            for e in rows
        )
    ):
        raise ProtocolError(
            f"beat.{field}: expected at most {most} maps of names to scalars, got {brief(rows)}",
            WRONG_SHAPE,
        )
    return rows


@dataclass(frozen=True, slots=True)
class Beat(Message):
    """A daemon's heartbeat (``t``: its monotonic clock), echoed by the service.

    ``environments`` (a daemon's beat only, left out when None): what its nodes hold,
    one map per node and environment ``{node, name, key, state, workers, size,
    last_use}`` (scalars), for ``nimbus environments list --endpoint``.
    ``runtime`` (a daemon's beat only, left out when None): its blocks, managers and
    workers now, maps of scalars with a ``kind``: ``{kind: "block", id, state, nodes,
    managers, busy, walltime_left, message}``, ``{kind: "manager", name, node, block,
    workers, busy, accepting}``, ``{kind: "workers", manager, environment, workers,
    busy, idle}`` (for the dashboard's endpoint page; an older service ignores it).
    ``orders`` (a daemon's beat, left out when None): how each node carries out the
    recent :class:`~nimbus.protocol.Order` s, ``{ref, node, state, message, seconds}``
    (state ``building``, ``built``, ``removing``, ``removed``, ``failed``)."""

    op: ClassVar[str] = "beat"
    t: Any
    environments: list[dict[str, Any]] | None = None
    runtime: list[dict[str, Any]] | None = None
    orders: list[dict[str, Any]] | None = None

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": "beat", "t": self.t}
        if self.environments is not None:
            out["environments"] = self.environments
        if self.runtime is not None:
            out["runtime"] = self.runtime
        if self.orders is not None:
            out["orders"] = self.orders
        return out

    @classmethod
    def decode(cls, msg: dict[str, Any]) -> Beat:
        envs = _scalar_rows("environments", msg.get("environments"), MAX_ENVIRONMENTS)
        runtime = _scalar_rows("runtime", msg.get("runtime"), MAX_RUNTIME)
        orders = _scalar_rows("orders", msg.get("orders"), MAX_ORDERS)
        return cls(msg.get("t"), envs, runtime, orders)

    def seconds(self) -> float:
        """``t`` as a number; ProtocolError otherwise (what a daemon checks of an echo)."""
        t = self.t
        if isinstance(t, bool) or not isinstance(t, int | float):
            raise ProtocolError(f"beat.t: expected a number, got {t!r:.40}", WRONG_SHAPE)
        return float(t)


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
            "tasks": self.tasks,
        }

    @classmethod
    def decode(cls, msg: dict[str, Any]) -> Submit:
        endpoint_id = _endpoint_id(msg.get("endpoint_id", ""))
        return cls(msg.get("ref"), endpoint_id, SubmitRow.decode_all(msg.get("tasks")))


@dataclass(frozen=True, slots=True)
class Batch:
    """The body of ``POST /v1/tasks/batch`` (msgpack, not a WebSocket message): a client's
    tasks for one endpoint, ``{endpoint_id, tasks: [SubmitRow, ...]}``; the service
    answers ``{group_id, task_ids}``."""

    endpoint_id: str
    tasks: list[SubmitRow]

    def encode(self) -> bytes:
        return pack({"endpoint_id": self.endpoint_id, "tasks": self.tasks})

    @classmethod
    def decode(cls, body: bytes) -> Batch:
        """A request body; ProtocolError naming what is wrong (not msgpack, not the map,
        the endpoint id, the first bad row)."""
        try:
            msg = unpack(body)
        except Exception as exc:
            msg = exc
        if not isinstance(msg, dict) or "endpoint_id" not in msg or "tasks" not in msg:
            raise ProtocolError(
                f"body: expected a msgpack map {{endpoint_id, tasks: [{SUBMIT_ROW}, ...]}}, "
                f"not {brief(msg)}",
                WRONG_SHAPE,
            )
        return cls(_endpoint_id(msg["endpoint_id"]), SubmitRow.decode_all(msg["tasks"]))


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
