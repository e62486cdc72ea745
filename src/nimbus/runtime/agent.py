"""The agent: one per endpoint; routes tasks to managers and results back.

::

    submit(tasks) --> Agent --route by free capacity--> Manager (node 1) --> workers
                        ^                          \\--> Manager (node 2) --> workers
    on_results(tasks) <-+------------- results -------------/

The embedded runtime (``nimbus.backends.local``) runs an Agent in the
caller's process; an endpoint started with ``nimbus endpoint start`` runs the
same class in its own process, fed by the service. Tasks run only in worker
processes, so a crashing task never takes the agent down.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nimbus.runtime.manager import Manager
from nimbus.runtime.task import Task

__all__ = ["Agent"]


class Agent:
    """Routes batches of tasks to its managers and forwards their results."""

    def __init__(
        self,
        *,
        on_results: Callable[[list[Task]], None],
        on_dispatch: Callable[[list[Task]], list[Task]] | None = None,
        on_notice: Callable[[Any], None] | None = None,
        name: str = "agent",
    ) -> None:
        self.name = name
        self._on_results = on_results
        self._on_dispatch = on_dispatch
        self._on_notice = on_notice
        self._managers: list[Manager] = []
        self._outstanding: dict[Manager, int] = {}
        self._lock = threading.Lock()

    def add_manager(
        self,
        workers: int,
        *,
        prefetch: int = 8,
        python: str | None = None,
        env: Mapping[str, str] | None = None,
        preload: Sequence[str] = (),
        fork: bool = False,
    ) -> Manager:
        """Start a manager with ``workers`` warm workers on this node."""
        manager = Manager(
            workers,
            on_results=self._results,
            on_dispatch=self._on_dispatch,
            on_notice=self._on_notice,
            prefetch=prefetch,
            python=python,
            env=env,
            preload=preload,
            name=f"{self.name}/m{len(self._managers)}",
            fork=fork,
        )
        with self._lock:
            self._managers.append(manager)
            self._outstanding[manager] = 0
        manager.start()
        return manager

    @property
    def capacity(self) -> int:
        """Workers across all managers."""
        return sum(m.size for m in self._managers)

    def submit(self, tasks: list[Task]) -> None:
        """Route tasks to managers, each given a share of its free capacity."""
        managers = self._managers
        if not managers:
            raise RuntimeError(f"{self.name} has no managers to run tasks on")
        if len(managers) == 1:
            manager = managers[0]
            for task in tasks:
                task.route = manager
            with self._lock:
                self._outstanding[manager] += len(tasks)
            manager.submit(tasks)
            return
        with self._lock:
            shares: dict[Manager, list[Task]] = {}
            for task in tasks:
                manager = min(managers, key=lambda m: self._outstanding[m] / m.size)
                self._outstanding[manager] += 1
                task.route = manager
                shares.setdefault(manager, []).append(task)
        for manager, share in shares.items():
            manager.submit(share)

    def cancel(self, task: Task) -> None:
        """Stop a task wherever it is (see ``Manager.cancel``)."""
        manager = task.route
        task.cancelled = True
        if manager is not None:
            manager.cancel(task)

    def _results(self, tasks: list[Task]) -> None:
        manager = tasks[0].route
        if manager is not None:
            with self._lock:
                self._outstanding[manager] -= len(tasks)
        self._on_results(tasks)

    def shutdown(self, wait: bool = True, *, kill: bool = False) -> None:
        for manager in self._managers:
            manager.shutdown(wait=False, kill=kill)
        if wait:
            for manager in self._managers:
                manager.shutdown(wait=True, kill=kill)

    def statistics(self) -> dict[str, Any]:
        return {"name": self.name, "managers": [m.statistics() for m in self._managers]}
