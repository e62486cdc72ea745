"""Finished tasks' history, in the SQL registry's database (SQLite or PostgreSQL).

::

    task_history  one row a finished task: ids, state, times, timeout, result, record
      keyset reads, newest first: (submitted, task_id) < the cursor's, LIMIT n
      indexes    (owner, submitted, id)     (submitted, id)
                 (endpoint, submitted, id)  (function, submitted, id)
                 only the tasks that did not succeed (partial):
                 (owner, state, submitted, id)  (state, submitted, id)

Rows arrive in bulk from :mod:`nimbus.service.flusher` (the finish and cancel
scripts append the ids they ended to a Redis stream; a flusher per service
process moves them here, from a process of its own: :mod:`nimbus.service.history_writer`). :meth:`History.write` is idempotent (a task's first
row wins), so a batch written twice, after a flusher died between its commit and
its acknowledgement, is stored once. Rows older than the service's
``history_days`` are deleted by the flushers too (:meth:`History.trim`, in
batches, every few minutes), never by a task's own path.

A page costs O(log n + the rows read) when an index leads with its filter (the
owner, endpoint or function; a state but success); filters combined (an owner's
tasks on one endpoint) walk the most selective index the database picks. The
successes, most of the rows, are found by walking the owner's or everyone's index:
an index of their own would make every write dearer (each index is a B-tree
insert a row, the most of what a write costs) for pages whose rows are dense there.
Calls are synchronous: the service runs them in a thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Column,
    Float,
    Index,
    LargeBinary,
    MetaData,
    String,
    Table,
    and_,
    func,
    select,
    tuple_,
)
from sqlalchemy.engine import Engine
from sqlalchemy.schema import CreateIndex

__all__ = ["FIELDS", "History", "Query"]

# the columns a row carries, in the order History.write takes them (the task hash's fields)
FIELDS = (
    "task_id",
    "owner",
    "endpoint",
    "function",
    "group",
    "state",
    "submitted",
    "dispatched",
    "ended",
    "timeout",
    "result",
    "record",
)

_meta = MetaData()
history = Table(
    "task_history",
    _meta,
    Column("task_id", String(64), primary_key=True),
    Column("owner_id", String(64), nullable=False),
    Column("endpoint_id", String(64), nullable=False),
    Column("function_id", String(64), nullable=False),
    Column("group_id", String(64), nullable=False),
    Column("state", String(32), nullable=False),
    Column("submitted", Float, nullable=False),
    Column("dispatched", Float, nullable=False),
    Column("ended", Float, nullable=False),
    Column("timeout", Float, nullable=True),
    Column("result", LargeBinary, nullable=False),
    Column("record", LargeBinary, nullable=False),
    Index("ix_history_owner", "owner_id", "submitted", "task_id"),
    Index("ix_history_all", "submitted", "task_id"),
    Index("ix_history_endpoint", "endpoint_id", "submitted", "task_id"),
    Index("ix_history_function", "function_id", "submitted", "task_id"),
    Index("ix_history_group", "group_id", "submitted", "task_id"),  # a batch Redis no longer holds
)
_UNSUCCESSFUL = history.c.state != "success"  # the partial indexes' rows (and the pages' term)
for _name, *_columns in (
    ("ix_history_owner_unsuccessful", "owner_id", "state", "submitted", "task_id"),
    ("ix_history_unsuccessful", "state", "submitted", "task_id"),
):
    Index(
        _name,
        *(history.c[column] for column in _columns),
        sqlite_where=_UNSUCCESSFUL,
        postgresql_where=_UNSUCCESSFUL,
    )
# indexes of earlier versions that every write paid for and no page needs (the state's
# index holds only the tasks that did not succeed)
_DROPPED = ("ix_history_owner_state", "ix_history_state")
_ROW = (
    history.c.task_id,
    history.c.submitted,
    history.c.state,
    history.c.endpoint_id,
    history.c.function_id,
    history.c.submitted,
    history.c.dispatched,
    history.c.ended,
)


@dataclass(frozen=True)
class Query:
    """What a page shows: ``owner`` None for everyone's tasks (the admin), else one user's."""

    owner: str | None
    state: str = ""
    endpoint: str = ""
    function: str = ""
    group: str = ""


def _number(value: Any) -> float:
    try:
        return float(value or 0)
    except (TypeError, ValueError):
        return 0.0


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value or "")


def _values(r: Sequence[Any]) -> tuple[Any, ...]:
    """A row's values as the table takes them."""
    try:  # the flusher's rows: bytes, in one step (most of a write's Python cost was here)
        task_id, owner, endpoint, fn, group, state, sub, disp, end, timeout, result, rec = r
        return (
            task_id.decode(), owner.decode(), endpoint.decode(), fn.decode(), group.decode(),
            state.decode(), float(sub or 0), float(disp or 0), float(end or 0),
            float(timeout or 0) or None, bytes(result or b""), bytes(rec or b""),
        )  # fmt: skip
    except (AttributeError, TypeError, ValueError):  # str, None, a number, broken text
        return (
            _text(r[0]), _text(r[1]), _text(r[2]), _text(r[3]), _text(r[4]), _text(r[5]),
            _number(r[6]), _number(r[7]), _number(r[8]), _number(r[9]) or None,
            bytes(r[10] or b""), bytes(r[11] or b""),
        )  # fmt: skip


class History:
    """The ``task_history`` table on ``engine`` (made if missing)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        _meta.create_all(engine)
        with engine.begin() as connection:  # a table an earlier version made: its indexes now
            for name in _DROPPED:
                connection.exec_driver_sql(f"DROP INDEX IF EXISTS {name}")
            for index in history.indexes:  # (IF NOT EXISTS: processes may start together)
                connection.execute(CreateIndex(index, if_not_exists=True))
        mark = "?" if engine.dialect.paramstyle == "qmark" else "%s"
        self._insert = (
            f"INSERT INTO task_history ({', '.join(c.name for c in history.columns)}) "
            f"VALUES ({', '.join([mark] * len(history.columns))}) "
            "ON CONFLICT (task_id) DO NOTHING"
        )

    def write(self, rows: Iterable[Sequence[Any]]) -> int:
        """Store finished tasks, each a sequence in :data:`FIELDS` order (bytes or str;
        a task already stored is kept as it was); how many rows were given."""
        values = [_values(r) for r in rows]
        if values:  # the driver's executemany: a third of SQLAlchemy's cost a row
            with self.engine.begin() as connection:
                connection.exec_driver_sql(self._insert, values)
        return len(values)

    def page(
        self, query: Query, after: tuple[float, str] | None, size: int
    ) -> tuple[list[tuple[Any, ...]], str]:
        """Up to ``size`` rows ``(task_id, score, state, endpoint, function, submitted,
        dispatched, ended)`` newest first, after the keyset cursor ``after``; and the cursor
        to go on from ('' when nothing older is left)."""
        c = history.c
        where = []
        if query.owner is not None:
            where.append(c.owner_id == query.owner)
        for column, value in (
            (c.state, query.state),
            (c.endpoint_id, query.endpoint),
            (c.group_id, query.group),
            (c.function_id, query.function),
        ):
            if value:
                where.append(column == value)
        if query.state and query.state != "success":
            where.append(_UNSUCCESSFUL)  # implies the partial indexes' condition (SQLite)
        if after is not None:
            where.append(tuple_(c.submitted, c.task_id) < tuple_(after[0], after[1]))
        order = (c.submitted.desc(), c.task_id.desc())
        with self.engine.connect() as connection:
            rows = connection.execute(
                select(*_ROW).where(and_(True, *where)).order_by(*order).limit(size)
            ).all()
        out = [tuple(row) for row in rows]
        return out, (f"{out[-1][1]!r}~{out[-1][0]}" if len(out) == size else "")

    def info(self, task_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The stored tasks among ``task_ids``, as ``TaskStore.info`` gives them, by id."""
        c = history.c
        ids = list(task_ids)
        if not ids:
            return {}
        rows: list[Any] = []
        with self.engine.connect() as connection:
            for at in range(0, len(ids), 500):  # SQLite's bound parameters are limited
                rows += connection.execute(
                    select(
                        c.task_id, c.state, c.owner_id, c.endpoint_id, c.function_id, c.group_id,
                        c.submitted, c.dispatched, c.ended, c.record, c.timeout, c.result,
                    ).where(c.task_id.in_(ids[at : at + 500]))
                ).all()  # fmt: skip
        out = {}
        for task_id, state, owner, endpoint, fn, group, sub, disp, end, rec, tmo, res in rows:
            out[task_id] = {
                "task_id": task_id,
                "state": state,
                "owner": owner,
                "endpoint": endpoint,
                "function": fn,
                "group": group,
                "submitted": repr(sub),
                "dispatched": repr(disp) if disp else "",
                "ended": repr(end) if end else "",
                "record": rec or None,
                "timeout": tmo,
                "result": res,
            }
        return out

    def trim(self, before: float, limit: int) -> int:
        """Delete up to ``limit`` of the oldest tasks submitted before ``before`` (a Unix
        time), in one short transaction (walking the ``submitted`` index); how many went."""
        c = history.c
        oldest = select(c.task_id).where(c.submitted < before).order_by(c.submitted).limit(limit)
        with self.engine.begin() as connection:
            ids = list(connection.scalars(oldest))
            if ids:
                connection.execute(history.delete().where(c.task_id.in_(ids)))
        return len(ids)

    def count(self) -> int:
        with self.engine.connect() as connection:
            return int(connection.scalar(select(func.count()).select_from(history)) or 0)
