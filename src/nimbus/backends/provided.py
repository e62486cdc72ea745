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
store need the same: the store is reached over TCP (``store_listen`` /
``NIMBUS_REDIS_URL``), files through a shared ``storage_dir``.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any

from nimbus.backends import DispatchCallback, ResultCallback
from nimbus.errors import ConfigError
from nimbus.providers import PROVIDERS, walltime_seconds
from nimbus.runtime.agent import Agent
from nimbus.runtime.manager import worker_environment
from nimbus.runtime.node import ADDRESS_ENV, SECRET_ENV
from nimbus.runtime.remote import new_secret
from nimbus.runtime.scaling import Scaler
from nimbus.runtime.task import Task

__all__ = ["ProvidedBackend", "make_scaler"]


def make_scaler(agent: Agent, settings: Any, *, prefetch: int) -> Scaler:
    """Listen for managers and build the scaler of ``settings``' provider (not started)."""
    if settings.provider not in PROVIDERS:
        raise ConfigError(
            f"provider {settings.provider!r} is unknown (NIMBUS_PROVIDER); "
            f"known: {', '.join(sorted(PROVIDERS))}"
        )
    if settings.min_blocks > settings.max_blocks:
        raise ConfigError(
            f"min_blocks ({settings.min_blocks}) is more than max_blocks ({settings.max_blocks})"
        )
    provider = PROVIDERS[settings.provider](
        partition=settings.partition,
        account=settings.account,
        qos=settings.qos,
        walltime=settings.walltime,
        exclusive=settings.exclusive,
        scheduler_options=settings.scheduler_options,
        worker_init=settings.worker_init,
    )
    host, _, port = settings.agent_listen.rpartition(":")
    secret = new_secret()
    address = agent.listen(secret, host=host.strip("[]"), port=int(port), prefetch=prefetch)
    workers = settings.workers_per_node
    command = f"{shlex.quote(sys.executable)} -m nimbus manager --prefetch {prefetch}"
    if workers:
        command += f" --workers {workers}"
    env = {
        ADDRESS_ENV: address,
        SECRET_ENV: secret,
        "PYTHONPATH": worker_environment()["PYTHONPATH"],
    }
    scaler = Scaler(
        agent,
        provider,
        command=command,
        env=env,
        nodes_per_block=settings.nodes_per_block,
        workers_per_node=workers or os.cpu_count() or 1,
        min_blocks=settings.min_blocks,
        max_blocks=settings.max_blocks,
        init_blocks=settings.init_blocks,
        parallelism=settings.parallelism,
        walltime=walltime_seconds(settings.walltime),
        max_idle=settings.max_idle,
    )
    agent.on_demand = scaler.wake
    agent.on_change = scaler.wake
    return scaler


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
