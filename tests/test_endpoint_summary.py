"""What a daemon's heartbeat says of its runtime (``Beat.runtime``): blocks from a real
scaler with local process blocks, managers, and workers busy or idle per environment."""

from __future__ import annotations

import time

import pytest

from nimbus import Executor
from nimbus.backends.provided import ProvidedBackend
from nimbus.config import Settings
from nimbus.endpoint._summary import runtime_rows
from nimbus.errors import ProtocolError
from nimbus.protocol import MAX_RUNTIME, Beat, decode_message, pack, unpack
from nimbus.runtime.agent import Agent


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@pytest.fixture
def provided(provided: Settings) -> Settings:
    """conftest's, with two workers a block."""
    return provided.replace(workers_per_node=2)


def test_blocks_managers_and_busy_workers_of_a_scaled_runtime(provided: Settings) -> None:
    settings = provided.replace(max_blocks=1, init_blocks=1, min_blocks=1)
    with Executor(settings=settings, backend="provided") as ex:
        backend = ex._backend
        assert isinstance(backend, ProvidedBackend)
        futures = [ex.submit(nap, 1.5)]
        deadline = time.monotonic() + 30
        while True:
            rows = runtime_rows(backend.agent.statistics(), backend.scaler.statistics())
            managers = [r for r in rows if r["kind"] == "manager"]
            if managers and managers[0]["busy"] == 1:
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.05)
        [block] = [r for r in rows if r["kind"] == "block"]
        assert block["state"] == "running" and block["managers"] == 1 and block["nodes"] == 1
        assert block["busy"] == 1 and block["walltime_left"] > 0
        [manager] = managers
        assert manager["block"] == block["id"] and manager["workers"] == 2
        assert manager["accepting"] is True
        [pool] = [r for r in rows if r["kind"] == "workers"]
        assert (pool["manager"], pool["workers"], pool["busy"], pool["idle"]) == (
            manager["name"],
            2,
            1,
            1,
        )
        assert [f.result() for f in futures] == [1.5]
    beat = Beat(1.0, None, rows)  # as the daemon sends them, and the service reads them
    assert decode_message(unpack(beat.encode()), {"beat": Beat}) == beat


def test_a_local_manager_reports_its_workers_per_environment() -> None:
    agent = Agent(on_results=lambda tasks: None)
    try:
        agent.add_manager(3, prefetch=1)
        deadline = time.monotonic() + 30
        while True:
            rows = runtime_rows(agent.statistics(), None)
            pools = [r for r in rows if r["kind"] == "workers"]
            if pools and pools[0]["workers"] == 3:
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.05)
        assert pools == [
            {
                "kind": "workers",
                "manager": rows[0]["name"],
                "environment": "plain",
                "workers": 3,
                "busy": 0,
                "idle": 3,
            }
        ]
        assert not [r for r in rows if r["kind"] == "block"]
    finally:
        agent.shutdown()


def test_a_manager_row_with_counts_of_none_still_gives_rows() -> None:
    """The per-environment walk is nimbus.environments.pools, tolerant of None."""
    manager = {"name": "m", "node": "n", "workers": None, "environments": {
        "": {"name": "plain", "workers": 2, "free": None},
        "geo@k": {"name": "geo", "workers": None, "free": 1},
    }}  # fmt: skip
    rows = runtime_rows({"managers": [manager]}, None)
    assert rows[0]["kind"] == "manager" and (rows[0]["workers"], rows[0]["busy"]) == (0, 2)
    assert [(r["environment"], r["workers"], r["busy"], r["idle"]) for r in rows[1:]] == [
        ("plain", 2, 2, 0)
    ]


def test_a_beat_without_runtime_is_as_before_and_a_wrong_one_is_refused() -> None:
    assert Beat(1.5).encode() == pack({"op": "beat", "t": 1.5})
    assert Beat.decode({"op": "beat", "t": 1.5}).runtime is None  # an older daemon's
    for wrong in ("busy", [["m"]], [{"busy": [1]}], [{"k": 1}] * (MAX_RUNTIME + 1)):
        with pytest.raises(ProtocolError, match=r"beat\.runtime"):
            Beat.decode({"op": "beat", "t": 1.5, "runtime": wrong})
