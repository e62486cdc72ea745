"""The embedded runtime with its managers on a provider's nodes (``provider != "local"``).

::

    Executor / nimbus.multiprocessing (this process, a login node)
        Agent (embedded, as in ``local``) -- listens on ``agent_listen``
          ^ TCP (HMAC handshake)             Scaler -- Provider.submit/status/cancel
          |                                              |
        nimbus manager (each node of each block) <-------+ (a Slurm job, say)

No service: the agent is embedded as in the ``local`` backend; its managers
come from the provider named by the ``provider`` setting, as Slurm jobs. The
block's environment carries the agent's address, a fresh secret and this
process's ``PYTHONPATH``, so the nodes import what the caller imports (a
cluster's shared file system). ``nimbus.multiprocessing.files`` and the state
store need the same: files through a ``storage_dir`` on the shared file system,
the store through ``NIMBUS_REDIS_URL`` (a Redis the nodes reach; the embedded
one is a Unix socket of this host). See ``docs/providers.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from nimbus.backends import DispatchCallback, ResultCallback
from nimbus.runtime.agent import Agent
from nimbus.runtime.scaling import make_scaler
from nimbus.runtime.task import Task

__all__ = ["ProvidedBackend"]


class ProvidedBackend:
    """An embedded agent whose managers run in a provider's blocks."""

    remote = False  # the nodes share this machine's files (PYTHONPATH is passed on)

    def __init__(
        self,
        *,
        workers: int,
        prefetch: int,
        on_results: ResultCallback,
        on_dispatch: DispatchCallback | None = None,
        on_notice: Callable[[Any], None] | None = None,
        preload: Sequence[str] = (),
        settings: Any,
        name: str = "provided",
    ) -> None:
        del preload  # the nodes' workers import on first use
        self.agent = Agent(
            on_results=on_results, on_dispatch=on_dispatch, on_notice=on_notice, name=name
        )
        self.scaler = make_scaler(self.agent, settings, prefetch=prefetch)
        self.capacity = max(
            workers, settings.max_blocks * settings.nodes_per_block * self.scaler.workers_per_node
        )
        self.scaler.start()

    def submit(self, batch: list[Task]) -> None:
        self.agent.submit(batch)

    def cancel(self, task: Task) -> None:
        self.agent.cancel(task)

    def shutdown(self, wait: bool = True, *, kill: bool = False) -> None:
        try:
            self.agent.shutdown(wait=wait, kill=kill)
        finally:
            self.scaler.stop()

    def statistics(self) -> dict[str, Any]:
        return {**self.agent.statistics(), **self.scaler.statistics()}
