"""What the endpoint daemon tells the service besides results: beats, and which tasks run.

::

    every heartbeat:  Beat(t, environments, runtime, orders)
        environments: what the nodes hold (every ENVIRONMENTS_EVERY beats, and when an
                      order ends), ``environments.held``
        runtime:      blocks, managers, workers busy or idle (``_summary.runtime_rows``),
                      when it changed (and every ENVIRONMENTS_EVERY beats)
        orders:       how the nodes do with environment orders (``_orders.Orders``);
                      while one is unfinished, a beat as soon as a node says how it went
    every RUNNING_AFTER: Running([task ids]): tasks a worker has started, still running
                      RUNNING_AFTER after they went to it (shorter ones go unreported)

:class:`Reports` is the daemon's: ``dispatched`` on the runtime's thread, the two
loops on the daemon's event loop for as long as a connection lasts.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Mapping
from typing import Any

from websockets.asyncio.client import ClientConnection

from nimbus import environments
from nimbus.endpoint._orders import Orders
from nimbus.endpoint._summary import runtime_rows
from nimbus.errors import NimbusError
from nimbus.protocol import MAX_ENVIRONMENTS, Beat, Running
from nimbus.runtime.agent import Agent
from nimbus.runtime.scaling import Scaler
from nimbus.runtime.task import Task

__all__ = ["Reports"]

log = logging.getLogger(__name__)
RUNNING_AFTER = 0.05  # seconds: shorter tasks go from dispatched to done unreported
ENVIRONMENTS_EVERY = 5  # heartbeats between two reports of the environments held
ORDER_POLL = 0.25  # seconds between beats while a node has not said how an order went


class Reports:
    """The beats and the running marks of one daemon's runtime."""

    def __init__(
        self, runtime: Agent, scaler: Scaler | None, orders: Orders, heartbeat: float
    ) -> None:
        self.runtime = runtime
        self.scaler = scaler
        self.orders = orders
        self.heartbeat = heartbeat
        self._dispatched: dict[str, float] = {}  # task id -> when a worker got it
        self._runtime_failed = False  # runtime() said why it could not: once

    def dispatched(self, tasks: list[Task]) -> None:
        """On the runtime's thread: ``tasks`` went to a worker now."""
        now = time.monotonic()
        for task in tasks:
            self._dispatched[task.record.task_id] = now

    async def beater(self, ws: ClientConnection) -> None:
        """Beat every heartbeat, sooner while an environment order is unfinished."""
        beats = 0
        said: list[dict[str, Any]] | None = None
        while True:
            envs = None
            orders = self.orders.changed()  # how the nodes do with environment orders
            if beats % ENVIRONMENTS_EVERY == 0 or self.orders.finished:  # what nodes hold
                self.orders.finished = False
                envs = await asyncio.to_thread(self.environments)
            runtime = self.runtime_rows()  # blocks, managers, workers: when it changed
            send = runtime if runtime != said or beats % ENVIRONMENTS_EVERY == 0 else None
            said = runtime
            beats += 1
            await ws.send(Beat(time.monotonic(), envs, send, orders).encode())
            if not self.orders.unfinished:
                await asyncio.sleep(self.heartbeat)
                continue
            for _ in range(max(1, round(self.heartbeat / ORDER_POLL))):  # say an end soon
                await asyncio.sleep(min(ORDER_POLL, self.heartbeat))
                if self.orders.rows() != self.orders.said:
                    break

    def runtime_rows(self) -> list[dict[str, Any]]:
        """``Beat.runtime``: the blocks, managers and workers busy or idle now."""
        try:
            scaler = self.scaler.statistics() if self.scaler is not None else None
            return runtime_rows(self.runtime.statistics(), scaler)
        except Exception as exc:  # shutting down, or a row it cannot read: said once
            if not self._runtime_failed:
                self._runtime_failed = True
                log.warning("cannot say the runtime in heartbeats: %r", exc, exc_info=True)
            return []

    def environments(self) -> list[dict[str, Any]]:
        """What the nodes hold, one row per node and environment (warm workers, build
        state, size, last use: ``nimbus.environments.held``), for ``nimbus
        environments list --endpoint``; remote managers report their own node's."""
        try:
            managers = self.runtime.statistics()["managers"]
        except Exception:  # the runtime is shutting down
            managers = []
        try:
            local = environments.cache().report()
        except (OSError, NimbusError) as exc:
            log.warning("cannot read this node's environments: %s", exc)
            local = []
        try:  # a heartbeat goes on whatever a manager's statistics say
            return environments.held(managers, socket.gethostname(), local)[:MAX_ENVIRONMENTS]
        except Exception as exc:
            log.warning("cannot say the nodes' environments in heartbeats: %r", exc)
            return []

    async def marker(self, ws: ClientConnection, held: Mapping[str, Task]) -> None:
        """Tell the service which tasks run: those a worker has started (not those waiting
        in a worker's window) of ``held`` still running RUNNING_AFTER after they went to it. Blocks'
        managers on other nodes do not say when a task starts: there, those sent on."""
        said_start = self.scaler is None  # the workers are this process's manager's
        while True:
            await asyncio.sleep(RUNNING_AFTER)
            now = time.monotonic()
            running = []
            for task_id, since in list(self._dispatched.items()):
                task = held.get(task_id)
                if task is None:
                    self._dispatched.pop(task_id, None)
                elif now - since >= RUNNING_AFTER and (task.started or not said_start):
                    running.append(task_id)
                    self._dispatched.pop(task_id, None)
            if running:
                await ws.send(Running(running).encode())
