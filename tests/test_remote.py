"""Managers on other nodes: handshake, heartbeats, loss and requeue (local process blocks)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from nimbus import Executor
from nimbus.backends.provided import ProvidedBackend
from nimbus.config import Settings
from nimbus.data import NodeStore, default_root
from nimbus.data._node import HOLDERS, SWEEP_EVERY
from nimbus.runtime.agent import Agent
from nimbus.runtime.node import ADDRESS_ENV, MAIN, SECRET_ENV, NodeManager


def where(seconds: float) -> tuple[int, int]:
    """Sleep, then say which manager (its pid: the worker's parent) and worker ran it."""
    time.sleep(seconds)
    return os.getppid(), os.getpid()


def test_a_manager_with_a_wrong_secret_is_refused() -> None:
    agent = Agent(on_results=lambda tasks: None)
    address = agent.listen("right", host="127.0.0.1")
    try:
        node = NodeManager(address, "wrong", workers=1)
        with pytest.raises(ConnectionError):
            node.connect()
        deadline = time.monotonic() + 5
        while agent._listener is not None and not agent._listener.refused:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert agent.remote_managers() == []
    finally:
        agent.shutdown()


def test_a_fake_agent_cannot_feed_a_manager() -> None:
    """The manager checks the agent's proof too: a listener without the secret is left."""
    agent = Agent(on_results=lambda tasks: None)
    address = agent.listen("the agent's", host="127.0.0.1")
    try:
        with pytest.raises(ConnectionError):
            NodeManager(address, "the block's", workers=1).connect()
    finally:
        agent.shutdown()


def test_tasks_run_on_block_managers_and_blocks_go_at_shutdown(provided: Settings) -> None:
    settings = provided.replace(max_blocks=2, init_blocks=2, min_blocks=2)
    with Executor(settings=settings, backend="provided") as ex:
        results = list(ex.map(where, [0.05] * 20))
        backend = ex._backend
        assert isinstance(backend, ProvidedBackend)
        managers = {m.pid for m in backend.agent.remote_managers()}
        assert {parent for parent, _ in results} <= managers
        assert len(managers) == 2
        blocks = [b.id for b in backend.scaler.blocks.values()]
    states = backend.scaler.provider.status(blocks)
    assert all(s.state.terminal for s in states.values())


def test_a_silent_manager_is_lost_within_10s_and_its_tasks_run_elsewhere_once(
    provided: Settings,
) -> None:
    settings = provided.replace(max_blocks=2, init_blocks=2, min_blocks=2)
    with Executor(settings=settings, backend="provided") as ex:
        backend = ex._backend
        assert isinstance(backend, ProvidedBackend)
        ex.submit(where, 0).result(timeout=30)
        deadline = time.monotonic() + 30
        while len(backend.agent.remote_managers()) < 2:
            assert time.monotonic() < deadline, "two managers did not join"
            time.sleep(0.05)
        futures = [ex.submit(where, 0.3) for _ in range(12)]
        time.sleep(0.5)
        frozen = backend.agent.remote_managers()[0]
        os.kill(frozen.pid, signal.SIGSTOP)  # a node that stops answering (no FIN, no RST)
        stopped = time.monotonic()
        try:
            results = [f.result(timeout=60) for f in futures]
            lost_after = time.monotonic() - stopped
            assert backend.agent.lost, "the frozen manager was not declared lost"
            _, why, requeued = backend.agent.lost[0]
            assert "sent nothing" in why and requeued > 0
        finally:
            with contextlib.suppress(ProcessLookupError):  # its block was cancelled: gone
                os.kill(frozen.pid, signal.SIGCONT)
    assert len(results) == 12  # every task exactly one result, though some ran twice
    assert lost_after < 10 + 12 * 0.3


def test_pending_tasks_wait_for_a_block_and_nothing_is_lost(provided: Settings) -> None:
    settings = provided.replace(max_blocks=1)  # no block until the first task
    with Executor(settings=settings, backend="provided") as ex:
        t0 = time.monotonic()
        assert ex.submit(where, 0).result(timeout=30)
        first = time.monotonic() - t0
        futures = [ex.submit(where, 0.01) for _ in range(50)]
        assert len({f.result(timeout=30) for f in futures}) >= 1
    assert first < 10


def test_parallelism_sizes_the_blocks_to_the_work(provided: Settings) -> None:
    # 8 tasks, 1 worker a block: parallelism 0.5 asks for ceil(0.5 * 8 / 1) = 4 blocks
    settings = provided.replace(max_blocks=8, parallelism=0.5, max_idle=1.0)
    with Executor(settings=settings, backend="provided") as ex:
        results = list(ex.map(where, [0.5] * 8))
        backend = ex._backend
        assert isinstance(backend, ProvidedBackend)
        assert backend.scaler.submitted == 4
    assert len(results) == 8


def test_a_block_manager_holds_and_sweeps_its_nodes_data(tmp_path: Path) -> None:
    """A block's manager, as the agent on its node: holds the runtime's data directory
    while it runs and sweeps what a killed runtime left, at its start (not only when
    the agent's next sweep, 10 s on, comes)."""
    agent = Agent(on_results=lambda tasks: None)  # sweeps this node now, then in 10 s
    address = agent.listen("block secret", host="127.0.0.1")
    time.sleep(0.5)  # (its first sweep is done)
    root = default_root(tmp_path / "killed")  # a runtime killed on the block's node
    node = NodeStore("u-m", root)
    node.write("f" * 32, b"x" * 1000, time.time() + 60)
    past = time.time() - 1
    os.utime(node.path("f" * 32), (past, past))  # its lease ran out since
    started = time.monotonic()
    env = dict(os.environ, **{SECRET_ENV: "block secret", ADDRESS_ENV: address})
    manager = subprocess.Popen([sys.executable, "-c", MAIN, "--workers", "1"], env=env)
    try:
        while root.exists() and time.monotonic() - started < SWEEP_EVERY:
            time.sleep(0.05)
        assert not root.exists()
        assert time.monotonic() - started < SWEEP_EVERY - 1  # the manager's sweep
        holders = default_root() / HOLDERS
        deadline = time.monotonic() + 30
        while not any(m.name.startswith(f"{manager.pid}-") for m in holders.iterdir()):
            assert time.monotonic() < deadline, "the manager does not hold the node's data"
            time.sleep(0.05)
    finally:
        agent.shutdown()
        manager.wait(30)
    # let go of: its hold gone, or the whole directory with the runtime's last holder
    assert not holders.exists() or not any(
        m.name.startswith(f"{manager.pid}-") for m in holders.iterdir()
    )


def test_a_node_too_old_for_orders_fails_them_at_once_saying_why() -> None:
    """A manager whose JOIN says nothing of orders (an older nimbus on the node) is sent
    none: its order fails at once, naming the upgrade, instead of never ending."""
    import socket

    from nimbus.runtime.remote import RemoteManager
    from nimbus.wire import Channel

    mine, theirs = socket.socketpair()
    manager = RemoteManager(
        Channel(mine),
        {"workers": 2, "node": "n9"},
        prefetch=2,
        on_results=lambda tasks: None,
        on_lost=lambda m, tasks, why: None,
    )
    try:
        manager.order("r1", "remove", "geo")
        said = manager.orders["r1"]
        assert said["state"] == "failed" and "nimbus manager on n9 is older" in said["message"]
        theirs.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing was sent to it
            theirs.recv(1)
    finally:
        mine.close()
        theirs.close()


def test_orders_of_a_manager_that_goes_away_fail_saying_so() -> None:
    """A manager's link ends while it builds: its order fails naming the node (instead of
    "building" forever), and an order after that fails at once, nothing sent."""
    import socket
    import threading

    from nimbus.environments import Environment
    from nimbus.runtime.remote import RemoteManager
    from nimbus.wire import Channel

    mine, theirs = socket.socketpair()
    lost = threading.Event()
    manager = RemoteManager(
        Channel(mine),
        {"workers": 2, "node": "n7", "can": ["orders"]},
        prefetch=2,
        on_results=lambda tasks: None,
        on_lost=lambda m, tasks, why: lost.set(),
    )
    manager.start()
    try:
        manager.order("r1", "build", "geo", Environment("geo", requirements=["x==1"]))
        assert manager.orders["r1"]["state"] == "building"
        theirs.close()  # the node goes away
        assert lost.wait(10)
        said = manager.orders["r1"]
        assert said["state"] == "failed" and "manager on n7 went away" in said["message"]
        manager.order("r2", "remove", "geo")
        assert manager.orders["r2"]["state"] == "failed"
        assert "manager on n7 is stopping" in manager.orders["r2"]["message"]
    finally:
        manager.shutdown(kill=True)
        mine.close()


def test_an_endpoints_order_rows_fit_a_beat_unfinished_and_newest_first() -> None:
    """32 orders on 40 nodes are more rows than a beat carries: the daemon says those
    not done first, then the newest, and the beat is one the service accepts."""
    import socket

    from nimbus.endpoint._orders import KEPT, Orders
    from nimbus.protocol import MAX_ORDERS, Beat, decode_message, unpack
    from nimbus.runtime.agent import Agent
    from nimbus.runtime.remote import RemoteManager
    from nimbus.wire import Channel

    pairs = [socket.socketpair() for _ in range(40)]
    managers = [
        RemoteManager(
            Channel(mine),
            {"workers": 1, "node": f"n{i:02}", "can": ["orders"]},
            prefetch=1,
            on_results=lambda tasks: None,
            on_lost=lambda m, tasks, why: None,
        )
        for i, (mine, _) in enumerate(pairs)
    ]
    try:
        orders = Orders(Agent(on_results=lambda tasks: None), "wide")
        for k in range(KEPT):
            ref = f"r{k:02}"
            for manager in managers:
                state = "building" if k == 0 else "built"  # the oldest is not done
                manager.orders[ref] = {"state": state, "message": "", "seconds": 1.0}
            orders._orders[ref] = ("build", managers)
        rows = orders.rows()
        assert len(rows) == MAX_ORDERS
        assert [r["ref"] for r in rows[:40]] == ["r00"] * 40  # not done: first
        assert rows[40]["ref"] == f"r{KEPT - 1:02}"  # then the newest
        assert {r["ref"] for r in rows[40:]} == {
            f"r{k:02}" for k in range(KEPT - 1, KEPT - 25, -1)
        }  # 24 x 40
        beat = Beat(1.0, None, None, rows)
        assert decode_message(unpack(beat.encode()), {"beat": Beat}) == beat
    finally:
        for mine, theirs in pairs:
            mine.close()
            theirs.close()


def test_an_order_that_fails_unforeseen_is_answered_500_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """take() raising what no one foresaw answers 500 pointing at the daemon's log (the
    traceback is there) instead of dropping the daemon's connection to the service."""
    from nimbus.endpoint._orders import Orders
    from nimbus.protocol import Order
    from nimbus.runtime.agent import Agent

    class Broken(Agent):
        def statistics(self) -> dict[str, Any]:
            raise KeyError("managers")  # a bug, say

    orders = Orders(Broken(on_results=lambda tasks: None), "lab")
    answer = orders.answer(Order("r1", "remove", "geo"))
    assert answer.status == 500 and answer.ref == "r1"
    assert "KeyError" in answer.detail and "see the endpoint daemon's log" in answer.detail
    assert "agent.log" in answer.detail
    assert any(r.exc_info and "environment order r1" in r.getMessage() for r in caplog.records)


def test_an_order_on_a_manager_that_stopped_fails_in_the_rows() -> None:
    """This node's manager stops with an order not done: its row fails, saying so,
    instead of "building" forever."""
    from nimbus.endpoint._orders import Orders
    from nimbus.runtime.agent import Agent
    from nimbus.runtime.manager import Manager

    manager = Manager(1, on_results=lambda tasks: None, name="m1")
    manager.start()
    orders = Orders(Agent(on_results=lambda tasks: None), "lab")
    manager.orders["r1"] = {"state": "building", "message": "", "seconds": 0.0}
    orders._orders["r1"] = ("build", [manager])
    assert orders.rows()[0]["state"] == "building"
    manager.shutdown(kill=True)
    assert manager.stopped.wait(30)
    (row,) = orders.rows()
    assert row["state"] == "failed" and "stopped before it said how this went" in row["message"]
