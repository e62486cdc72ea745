"""The endpoint daemon's intake: a task row from the service made a runtime Task.

::

    TaskRow(task_id, function_id, body?, payload, timeout, environment?, owner?)
        learn(row): the function's bytes, kept (sent once per function and connection)
        task(row) -> Task(seq, function key, function, arguments, record, environment)
                  -> the error the task fails with here: its function unknown (RemoteError),
                     its arguments undecodable (DeserializationError), its environment
                     not one (ProtocolError)
                  -> None: its arguments are in the service's data store (fetch, then again)

A task run as its owner (``row.owner``: ``nimbus.owners``) has a function key of its
own, made once per function and user.
"""

from __future__ import annotations

import itertools

from nimbus import owners
from nimbus.environments import Environment
from nimbus.errors import ConfigError, DeserializationError, ProtocolError, RemoteError
from nimbus.protocol import DataRef, TaskRow, unpack_payload
from nimbus.records import TaskRecord, TaskState
from nimbus.runtime.task import Task, environment_tag

__all__ = ["Intake"]

OWNED_MAX = 4096  # functions run as their owner kept made; more: made again on use


class Intake:
    """The functions the service sent this daemon, and the Tasks made of its rows."""

    def __init__(self) -> None:
        self._seq = itertools.count()
        self._functions: dict[str, bytes] = {}
        self._owned: dict[tuple[str, str], tuple[str, bytes]] = {}  # (function, owner) -> key, fn

    def learn(self, row: TaskRow) -> None:
        """Keep the function ``row`` carries, if it carries one."""
        if row.body is not None:
            self._functions[row.function_id] = row.body

    def task(self, row: TaskRow) -> Task | Exception | None:
        """``row``'s Task; the error it fails with; None if its arguments are to be fetched."""
        task_id, function_id, payload = row.task_id, row.function_id, row.payload
        fn_bytes = self._functions.get(function_id)
        if not fn_bytes:
            return RemoteError(f"function {function_id} is not registered (deleted?)")
        if isinstance(payload, DataRef):  # its arguments are in the data store
            return None
        try:
            data, buffers = unpack_payload(payload)
        except ValueError as exc:
            return DeserializationError(
                f"the arguments of task {task_id} could not be decoded ({exc}); "
                f"they must be pack_payload(pickle, buffers)"
            )
        environment: Environment | None = None
        if row.environment is not None:
            try:
                environment = Environment.from_dict(row.environment)
            except ConfigError as exc:
                return ProtocolError(f"task {task_id}: its environment: {exc}")
        fn_key = function_id
        if row.owner is not None:  # run as its owner: their data scope in the worker
            fn_key, fn_bytes = self._as_owner(function_id, row.owner, fn_bytes)
        record = TaskRecord(task_id, TaskState.RUNNING, function=function_id)
        return Task(
            next(self._seq),
            fn_key,
            fn_bytes,
            data,
            buffers,
            record,
            timeout=row.timeout,
            environment=environment,
            env="" if environment is None else environment_tag(environment),
        )

    def _as_owner(self, function_id: str, owner: str, fn_bytes: bytes) -> tuple[str, bytes]:
        """The function ``function_id`` run as the user ``owner`` (``nimbus.owners``):
        a function key of its own, made once per function and user."""
        found = self._owned.get((function_id, owner))
        if found is None:
            if len(self._owned) >= OWNED_MAX:  # bounded: made again on use
                self._owned.clear()
            found = (f"{function_id}:{owner}", owners.owned(owner, fn_bytes))
            self._owned[function_id, owner] = found
        return found
