"""Elastic blocks: the agent's nodes come and go with its work.

::

    agent.on_demand / on_change --> Scaler.wake() --> step():
        status     one provider.status(every block) per ``period`` (never one per block)
        grow       wanted = ceil(parallelism * work / slots per block), within
                   [min_blocks, max_blocks]; pending blocks count as capacity
        walltime   a block near its end stops taking tasks (its replacement is asked
                   for now if work remains); what it still runs is requeued when it ends
        idle       a block idle ``max_idle`` s is drained (its managers confirm they hold
                   nothing), then cancelled; never while a manager holds a task
        refused    a provider error is kept in ``error``; retried with backoff; with no
                   block alive, the pending tasks fail with it (the user sees it at once)

Event-driven: a task that finds no free capacity wakes the scaler at once;
the loop also wakes every ``tick`` seconds for idle and walltime checks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nimbus.errors import ConfigError, ProviderError
from nimbus.providers import PROVIDERS, BlockState, Provider, walltime_seconds
from nimbus.runtime.manager import worker_environment
from nimbus.runtime.node import ADDRESS_ENV, SECRET_ENV
from nimbus.runtime.node import MAIN as NODE_MAIN
from nimbus.runtime.remote import new_secret

__all__ = ["Block", "Scaler", "make_scaler"]

log = logging.getLogger(__name__)


@dataclass
class Block:
    id: str
    nodes: int
    submitted: float
    state: BlockState = BlockState.PENDING
    started: float | None = None  # when its first manager joined
    idle_since: float | None = None
    draining: bool = False
    retiring: bool = False  # near its walltime: takes no new tasks
    cancelled: bool = False
    had_managers: bool = False
    message: str = ""
    managers: list[Any] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return not (self.state.terminal or self.draining or self.retiring or self.cancelled)


class Scaler:
    """Keeps an agent's blocks between ``min_blocks`` and ``max_blocks`` by its work."""

    def __init__(
        self,
        agent: Any,
        provider: Provider,
        *,
        command: str,
        env: Mapping[str, str],
        nodes_per_block: int = 1,
        workers_per_node: int = 1,
        min_blocks: int = 0,
        max_blocks: int = 1,
        init_blocks: int = 0,
        parallelism: float = 1.0,
        walltime: float = 1800.0,
        max_idle: float = 120.0,
        period: float = 2.0,
        tick: float = 0.5,
        status_file: Path | None = None,
    ) -> None:
        if not min_blocks <= max_blocks:
            raise ProviderError(f"min_blocks ({min_blocks}) is more than max_blocks ({max_blocks})")
        self.agent = agent
        self.provider = provider
        self.command = command
        self.env = dict(env)
        self.nodes_per_block = nodes_per_block
        self.workers_per_node = workers_per_node
        self.min_blocks = min_blocks
        self.max_blocks = max_blocks
        self.init_blocks = min(max(init_blocks, min_blocks), max_blocks)
        self.parallelism = parallelism
        self.walltime = walltime
        self.margin = max(10.0, min(120.0, 0.15 * walltime))  # stop taking tasks this early
        self.max_idle = max_idle
        self.period = period
        self.tick = tick
        self.status_file = status_file  # statistics() as JSON, for ``nimbus endpoint status``
        self._written = 0.0
        self.blocks: dict[str, Block] = {}
        self.error: str = ""  # the provider's last refusal
        self.status_calls = 0
        self.submitted = 0
        self.cancelled = 0
        self._backoff = 0.0
        self._retry_at = 0.0
        self._young_deaths = 0  # blocks in a row that ended before a manager joined
        self._last_status = 0.0
        self._event = threading.Event()
        self._stop = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="nimbus-scaler", daemon=True)

    # -- called from any thread -----------------------------------------
    def start(self) -> None:
        for _ in range(self.init_blocks):
            self._submit()
        self._thread.start()

    def wake(self) -> None:
        self._event.set()

    def stop(self) -> None:
        """Stop scaling and cancel every block still known."""
        self._stop = True
        self._event.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        live = [b.id for b in self.blocks.values() if not b.state.terminal and not b.cancelled]
        if live:
            try:
                self.provider.cancel(live)
            except ProviderError as exc:
                log.warning("nimbus scaler: cancelling blocks at shutdown failed: %s", exc)

    def statistics(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "blocks": [
                {
                    "id": b.id,
                    "state": b.state.value,
                    "nodes": b.nodes,
                    "managers": len(b.managers),
                    "busy": sum(self.agent.outstanding(m) for m in b.managers),
                    "draining": b.draining,
                    "retiring": b.retiring,
                    "walltime_left": (
                        round(b.started + self.walltime - now) if b.started is not None else None
                    ),
                    "message": b.message,
                }
                for b in self.blocks.values()
            ],
            "error": self.error,
            "status_calls": self.status_calls,
            "submitted": self.submitted,
            "cancelled": self.cancelled,
        }

    # -- the scaler thread -------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            self._event.wait(self.tick)
            self._event.clear()
            if self._stop:
                return
            try:
                self.step()
            except Exception:
                log.exception("nimbus scaler: a step failed")

    def step(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._poll(now)
            self._attach(now)
            self._retire(now)
            self._grow(now)
            self._shrink(now)
        if self.status_file is not None and now - self._written >= 1.0:
            self._written = now
            tmp = self.status_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.statistics()))
            tmp.replace(self.status_file)

    def _poll(self, now: float) -> None:
        watched = [b.id for b in self.blocks.values() if not b.state.terminal]
        if not watched or now - self._last_status < self.period:
            return
        self._last_status = now
        self.status_calls += 1
        try:
            states = self.provider.status(watched)
        except ProviderError as exc:
            log.warning("nimbus scaler: %s", exc)
            return
        for block_id, status in states.items():
            block = self.blocks[block_id]
            if block.state is BlockState.RUNNING and status.state is BlockState.PENDING:
                continue  # a manager said it runs; the scheduler lags
            block.state, block.message = status.state, status.message
            if block.state.terminal and not block.had_managers and not block.cancelled:
                self._died_young(block, status.message)

    def _died_young(self, block: Block, message: str) -> None:
        """A block ended before any manager joined: its command or worker_init is wrong,
        or its managers cannot reach the agent. Back off; after 3 in a row, tell the user."""
        where = getattr(self.provider, "script_dir", None)
        self.error = (
            f"block {block.id} ended {block.state.value} before any manager joined "
            f"({message or 'no reason given'}); see its output"
            + (f" in {where}" if where else "")
            + " (check worker_init, and that the nodes reach agent_listen)"
        )
        self._young_deaths += 1
        self._backoff = min(60.0, max(1.0, self._backoff * 2))
        self._retry_at = time.monotonic() + self._backoff
        if self._young_deaths >= 3 and not any(b.active for b in self.blocks.values()):
            failed = self.agent.fail_pending(ProviderError(self.error))
            log.warning("nimbus scaler: %s (%d waiting tasks failed)", self.error, failed)

    def _attach(self, now: float) -> None:
        by_block: dict[str, list[Any]] = {}
        for manager in self.agent.remote_managers():
            by_block.setdefault(manager.block, []).append(manager)
        for block in self.blocks.values():
            block.managers = by_block.get(block.id, [])
            if block.managers:
                block.had_managers = True
                self._young_deaths = 0
                if block.started is None:
                    block.started = now
                if block.state is BlockState.PENDING:
                    block.state = BlockState.RUNNING
            elif block.had_managers and not block.state.terminal and not block.cancelled:
                # every manager of a running block is lost (its node died, the job was
                # killed): its tasks are requeued; let the scheduler have it back
                self._cancel(block, "its managers were lost")
        for block_id in [b.id for b in self.blocks.values() if b.state.terminal and not b.managers]:
            del self.blocks[block_id]

    def _retire(self, now: float) -> None:
        for block in self.blocks.values():
            start = block.started
            if (
                start is not None
                and not block.retiring
                and now >= start + self.walltime - self.margin
            ):
                block.retiring = True
                for manager in block.managers:
                    manager.accepting = False

    def _work(self) -> int:
        return int(
            self.agent.pending
            + sum(self.agent.outstanding(m) for m in self.agent.remote_managers())
        )

    def _wanted(self) -> int:
        """Blocks the work asks for: ceil(parallelism * work / slots), within min..max."""
        work = self._work()
        slots = max(1, self.nodes_per_block * self.workers_per_node)
        wanted = math.ceil(self.parallelism * work / slots) if work else 0
        return min(self.max_blocks, max(self.min_blocks, wanted))

    def _grow(self, now: float) -> None:
        wanted = self._wanted()
        active = [b for b in self.blocks.values() if b.active]
        # a retiring block still holds scheduler resources; it does not count as capacity
        held = len([b for b in self.blocks.values() if not b.state.terminal and not b.cancelled])
        room = self.max_blocks + sum(1 for b in self.blocks.values() if b.retiring) - held
        for _ in range(min(wanted - len(active), room)):
            if now < self._retry_at:
                return
            if not self._submit():
                return

    def _submit(self) -> bool:
        try:
            block_id = self.provider.submit(self.command, self.nodes_per_block, env=self.env)
        except ProviderError as exc:
            self.error = str(exc)
            self._backoff = min(60.0, max(1.0, self._backoff * 2))
            self._retry_at = time.monotonic() + self._backoff
            alive = [b for b in self.blocks.values() if b.active]
            if not alive:  # nothing will ever run the waiting tasks: tell the user now
                failed = self.agent.fail_pending(exc)
                log.warning("nimbus scaler: %s (%d waiting tasks failed)", exc, failed)
            return False
        if not self._young_deaths:  # blocks that die young keep their backoff
            self._backoff = 0.0
            self.error = ""
        self.submitted += 1
        self.blocks[block_id] = Block(block_id, self.nodes_per_block, time.monotonic())
        return True

    def _shrink(self, now: float) -> None:
        pending = self.agent.pending
        active = [b for b in self.blocks.values() if b.active]
        # a block with nothing while others hold queued work is not surplus: draining it
        # would only have the work ask for it again
        wanted = self._wanted()
        for block in self.blocks.values():
            if block.cancelled or block.state.terminal or not block.managers:
                continue
            busy = any(self.agent.outstanding(m) for m in block.managers)
            if block.draining and pending and not block.retiring:  # work came back: keep it
                block.draining = False
                for manager in block.managers:
                    manager.accepting = True
                continue
            if block.draining:
                if busy:
                    continue
                if all(m.drained.is_set() and m.held == 0 for m in block.managers):
                    self._cancel(block, f"idle for {self.max_idle:.0f} s")
                continue
            if busy or pending:
                block.idle_since = None
                continue
            if block.retiring:  # near its end with nothing to do: release it now
                self._drain(block)
                continue
            if block.idle_since is None:
                block.idle_since = now
            elif now - block.idle_since >= self.max_idle and len(active) > wanted:
                self._drain(block)
                active.remove(block)

    def _drain(self, block: Block) -> None:
        block.draining = True
        for manager in block.managers:
            manager.drain()
        self._event.set()

    def _cancel(self, block: Block, why: str) -> None:
        block.cancelled = True
        block.message = why
        for manager in block.managers:
            manager.shutdown(wait=False)
        try:
            self.provider.cancel([block.id])
        except ProviderError as exc:
            log.warning("nimbus scaler: %s", exc)
        self.cancelled += 1
        block.state = BlockState.CANCELLED


def make_scaler(
    agent: Any, settings: Any, *, prefetch: int, status_file: Path | None = None
) -> Scaler:
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
    # nimbus manager, without the CLI's imports (node.MAIN): it joins sooner
    command = f"{shlex.quote(sys.executable)} -c {shlex.quote(NODE_MAIN)} --prefetch {prefetch}"
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
        status_file=status_file,
    )
    agent.on_demand = scaler.wake
    agent.on_change = scaler.wake
    return scaler
