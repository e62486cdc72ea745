"""Elastic blocks on a real (private) Slurm: NIMBUS_PROVIDER=slurm for the embedded runtime."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest

from nimbus import Executor
from nimbus.backends.provided import ProvidedBackend
from nimbus.config import Settings
from nimbus.errors import ProviderError


def node_of(seconds: float) -> str:
    time.sleep(seconds)
    return os.environ.get("SLURMD_NODENAME", "?")


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def settings(slurm: Any, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    return Settings.load().replace(
        provider="slurm",
        partition=slurm.partition,
        workers_per_node=2,
        max_blocks=2,
        walltime="00:05:00",
        max_idle=2.0,
        agent_listen="127.0.0.1:0",
    )


def backend_of(ex: Executor) -> ProvidedBackend:
    backend = ex._backend
    assert isinstance(backend, ProvidedBackend)
    return backend


def jobs(slurm: Any) -> dict[str, str]:
    out = slurm.run("squeue", "-h", "--states=all", "-o", "%i %T").stdout
    return dict(line.split()[:2] for line in out.splitlines())


def test_first_task_submits_a_block_at_once_and_an_idle_block_goes(
    settings: Settings, slurm: Any
) -> None:
    with Executor(settings=settings) as ex:
        backend = backend_of(ex)
        assert backend.scaler.blocks == {}  # no block before work
        t0 = time.monotonic()
        assert ex.submit(node_of, 0).result(timeout=30).startswith("n")
        first = time.monotonic() - t0
        assert sum(ex.map(abs, range(-500, 0))) == 125250
        ids = list(backend.scaler.blocks)
        assert ids
        idle_from = time.monotonic()
        wait_for(lambda: not backend.scaler.blocks, settings.max_idle + 5 + 2, "idle blocks to go")
        gone = time.monotonic() - idle_from
        assert {jobs(slurm)[b] for b in ids} <= {"CANCELLED", "COMPLETED", "COMPLETING"}
        stats = backend.scaler.statistics()
        elapsed = time.monotonic() - t0
        # one status call per period at most, whatever the number of blocks
        assert stats["status_calls"] <= elapsed / backend.scaler.period + 1
    assert first < 10, f"first result took {first:.1f} s"
    assert gone <= settings.max_idle + 5


def test_sbatch_refusal_fails_the_futures_with_the_schedulers_message(
    settings: Settings,
) -> None:
    with Executor(settings=settings.replace(partition="nope")) as ex:
        future = ex.submit(node_of, 0)
        with pytest.raises(ProviderError, match="invalid partition specified: nope"):
            future.result(timeout=10)
        scaler = backend_of(ex).scaler
        assert "invalid partition" in scaler.statistics()["error"]
        time.sleep(1.5)
        assert scaler.submitted == 0 and scaler._backoff >= 1  # backing off, not looping


def _spread(settings: Settings) -> Settings:
    return settings.replace(exclusive=True, min_blocks=2, init_blocks=2, max_idle=60.0)


def test_a_block_scancelled_from_outside_loses_no_task(settings: Settings, slurm: Any) -> None:
    with Executor(settings=_spread(settings)) as ex:
        backend = backend_of(ex)
        wait_for(lambda: len(backend.agent.remote_managers()) == 2, 30, "two blocks to join")
        futures = [ex.submit(node_of, 0.3) for _ in range(40)]
        time.sleep(0.8)
        victim = backend.agent.remote_managers()[0]
        slurm.run("scancel", victim.block)
        nodes = [f.result(timeout=60) for f in futures]
        assert len(nodes) == 40
        assert backend.agent.lost and backend.agent.lost[0][2] > 0  # it held tasks: requeued
        assert victim.node in nodes  # it ran some before it went


def test_a_killed_slurmd_requeues_its_tasks_elsewhere(settings: Settings, slurm: Any) -> None:
    with Executor(settings=_spread(settings)) as ex:
        backend = backend_of(ex)
        wait_for(lambda: len(backend.agent.remote_managers()) == 2, 30, "two blocks to join")
        futures = [ex.submit(node_of, 0.3) for _ in range(40)]
        time.sleep(0.8)
        victim = backend.agent.remote_managers()[0]
        killed = time.monotonic()
        slurm.kill_slurmd(victim.node)
        try:
            wait_for(lambda: backend.agent.lost, 10, "the lost manager")
            detected = time.monotonic() - killed
            nodes = [f.result(timeout=60) for f in futures]
        finally:
            slurm.restart_slurmd(victim.node)
        assert len(nodes) == 40 and detected <= 10
        assert backend.agent.lost[0][2] > 0
    slurm.wait_idle(60)


def test_a_block_near_its_walltime_is_replaced_and_nothing_fails(settings: Settings) -> None:
    # walltime 20 s: a block stops taking tasks 10 s in, its replacement is asked for then
    with Executor(settings=settings.replace(walltime="00:00:20", max_blocks=1)) as ex:
        backend = backend_of(ex)
        t0 = time.monotonic()
        results = []
        while time.monotonic() - t0 < 14:
            results.extend(ex.map(node_of, [0.2] * 4))
        assert backend.scaler.submitted >= 2
        assert any(b.retiring for b in backend.scaler.blocks.values()) or backend.scaler.cancelled
    assert all(r.startswith("n") for r in results)
