"""The embedded backend: the runtime's agent, in this process, with one manager.

This is the same :class:`~nimbus.runtime.agent.Agent` an endpoint runs; here it
lives in the caller's process and its workers are local processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from nimbus.backends import DispatchCallback, ResultCallback
from nimbus.runtime.agent import Agent
from nimbus.runtime.task import Task

if TYPE_CHECKING:
    from nimbus.config import Settings

__all__ = ["LocalBackend"]


class LocalBackend:
    """An embedded runtime: one agent, one manager, ``workers`` warm workers.

    ``fork``: the workers are forks of this process (which has imported what
    they need: a multiprocessing program's root), not new interpreters.
    """

    tells_started = True  # task.started: its worker said it runs it (shutdown(cancel_futures))

    def __init__(
        self,
        *,
        workers: int,
        prefetch: int,
        on_results: ResultCallback,
        on_dispatch: DispatchCallback | None = None,
        on_notice: Callable[[Any], None] | None = None,
        preload: Sequence[str] = (),
        name: str = "local",
        fork: bool = False,
        settings: Settings | None = None,
    ) -> None:
        self.capacity = workers
        self.agent = Agent(  # one node: no other fetches its files (no data server)
            on_results=on_results,
            on_dispatch=on_dispatch,
            on_notice=on_notice,
            name=name,
            serve_data=False,
        )
        # the workers' network accounting and limits: the Executor's settings, also in
        # the variables its workers read (Settings.replace(...) is not the environment)
        networks = env = None
        if settings is not None:
            from nimbus.network import WorkerNetworks

            networks = WorkerNetworks.configured(settings)
            env = networks.limits.environ(settings.net_accounting)
        self.agent.add_manager(
            workers, prefetch=prefetch, preload=preload, fork=fork, env=env, networks=networks
        )

    def submit(self, batch: list[Task]) -> None:
        self.agent.submit(batch)

    def cancel(self, task: Task) -> None:
        self.agent.cancel(task)

    def shutdown(self, wait: bool = True, *, kill: bool = False) -> None:
        self.agent.shutdown(wait=wait, kill=kill)
