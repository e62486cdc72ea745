"""The program an Executor's tasks are instances of: they message each other through it
(``nimbus.messaging``), and their ``nimbus.data.store()`` is on its endpoint.

::

    Executor's first task --> _made_row(): this process's own program (statestore), or
        the one the service hands out for the endpoint (backends._program), as the row
        each task carries (nimbus._joined), or why there is none
    ex.messaging() --> the client's instance of it;  ex.store() --> its tasks' store
    a worker's START_STORE notice --> notice(): this process's deferred store started
    Executor.shutdown --> _close_program(): the client's instance, the program's keys

:class:`TasksProgram` is a part of :class:`nimbus.Executor` (its other base is
``_mapping.Mapper``), used by ``nimbus.executor`` alone; ``tests/test_layers.py`` pins
what it imports and who imports it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from nimbus import data
from nimbus.errors import StateStoreError
from nimbus.runtime.messages import START_STORE

__all__ = ["UNMADE", "TasksProgram", "notice"]

UNMADE: Any = object()  # Executor._row before its first task


class TasksProgram:
    """``messaging()``, ``store()`` and the row of an Executor's tasks' program."""

    # set by the executor
    _backend: Any
    _row: Any  # UNMADE, the program's row, why there is none (str), or None: no program
    _instance: Any  # messaging(): the client's instance on an endpoint
    _lock: Any
    settings: Any

    def _made_row(self) -> Any:
        """The row each task carries, made at the first task (or ``messaging()``)."""
        if self._row is UNMADE:
            self._row = self._program_row()
        return self._row

    def _program_row(self) -> Any:
        """The program this executor's tasks join (``statestore.Program.row()``), or why
        there is none (a task that uses the store or messaging raises StateStoreError
        with it; the others run): this process's own program, so the client is an
        instance of it too (the state store starts at its first use, not here)."""
        from nimbus import statestore

        program = getattr(self._backend, "program", None)
        if program is not None:  # the store the service hands out for the endpoint
            return program.row()
        try:
            return statestore.program(self.settings).row()
        except StateStoreError as exc:
            return f"this executor's tasks have no state store: {exc}"

    def messaging(self) -> Any:
        """This process's instance of the program its tasks are instances of: its
        ``send``, ``recv``, ``recv_with_source`` and ``id`` reach them (an instance id
        each task gets from ``nimbus.messaging.instance_id()``). Locally, that is
        ``nimbus.messaging.current()``; for an endpoint's tasks, an instance closed at
        :meth:`shutdown`. Raises ``StateStoreError`` when they have no program."""
        from nimbus import messaging

        row = self._made_row()
        if row is None or type(row) is str:
            raise StateStoreError(row or "this executor's tasks are not instances of a program")
        program = getattr(self._backend, "program", None)
        if program is None:
            return messaging.current()
        with self._lock:
            if self._instance is None:
                self._instance = messaging.instance_for(program.program())
            return self._instance

    def store(self) -> Any:
        """The key-value store its tasks' ``nimbus.data.store()`` is: on an endpoint, your
        keys there (read what the tasks set, set what they read); locally, this runtime's.
        Raises ``StateStoreError`` when the service handed out no store for the endpoint."""
        program = getattr(self._backend, "program", None)
        if program is None:
            return data.store()
        made = program.program()  # (raises when this process cannot reach it)
        if made is None:
            raise StateStoreError(str(program.row()))
        return data.endpoint_store(made)

    def _close_program(self) -> None:
        """The client's instance of an endpoint's program, then the program's keys."""
        if self._instance is not None:
            self._instance.close()
        program = getattr(self._backend, "program", None)
        if program is not None:
            program.close()


def notice(on_notice: Callable[[Any], None] | None, payload: Any) -> None:
    """A worker's notice: for ``on_notice``, or asking this process to start the store of
    its tasks' program (its own, deferred: ``runtime.messages.START_STORE``)."""
    if type(payload) is list and len(payload) == 2 and payload[0] == START_STORE:
        from nimbus import statestore

        threading.Thread(target=statestore.start_asked, args=(payload[1],), daemon=True).start()
    elif on_notice is not None:
        on_notice(payload)
