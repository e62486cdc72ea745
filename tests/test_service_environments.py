"""``/v1/endpoints/{id}/environments`` (``nimbus.service.environments``, its orders in
``nimbus.service.orders``): ``nimbus environments build|remove NAME --endpoint X``
on every node of an endpoint, through a real service and real agents."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from environment_support import (
    environments_cli,
    environments_service,
    rows_until,
    task_record,
    wheel,
)
from nimbus import Client, Environment
from nimbus.protocol import Beat, unpack
from service_support import EndpointProcess, Service


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The module's service: its endpoints build environments in a directory of its own."""
    yield from environments_service(tmp_path_factory)


def orderpkg_version(x: int) -> tuple[int, str, str]:

    import orderpkg  # type: ignore[import-not-found]

    return x, orderpkg.VERSION, os.environ.get("NIMBUS_WORKER_ENVIRONMENT", "")


def slow_in_env(until: str) -> str:
    """Runs until the file ``until`` exists (at most 120 s): busy for as long as asked."""
    import time

    deadline = time.monotonic() + 120
    while not os.path.exists(until) and time.monotonic() < deadline:
        time.sleep(0.05)
    return os.environ.get("NIMBUS_WORKER_ENVIRONMENT", "")


@pytest.fixture(scope="module")
def shop(service: Service, alice: Client) -> Iterator[EndpointProcess]:
    endpoint = EndpointProcess(service, alice, "shop").start(alice)
    yield endpoint
    endpoint.stop()


def test_build_endpoint_builds_on_its_node_before_any_task_and_remove_removes_it(
    service: Service, alice: Client, shop: EndpointProcess, tmp_path: Path
) -> None:
    wheels = wheel(tmp_path / "wheels")
    spec = ["-r", "orderpkg==1.0", "--wheelhouse", wheels]
    out = environments_cli(service, alice.token, "build", "ordered", *spec, "--endpoint", "shop")
    assert out.returncode == 0, out.stdout + out.stderr
    node = socket.gethostname()
    env = Environment("ordered", requirements=["orderpkg==1.0"], wheelhouse=wheels)
    lines = out.stdout.splitlines()
    assert lines[0] == f"building ordered (key {env.key}) on 1 node of endpoint shop: {node}"
    assert lines[1].startswith(f"{node}: built in "), out.stdout
    # built there, as the endpoint reports it, before any task
    rows = rows_until(
        alice, "shop", lambda rs: any(r["key"] == env.key and r["state"] == "built" for r in rs), 20
    )
    assert [r["node"] for r in rows if r["key"] == env.key] == [node]
    # the first task starts in it with no build in its path
    (task_id,) = alice.batch_run(orderpkg_version, [(1,)], endpoint="shop", environment=env)
    assert alice.get_result(task_id, timeout=60) == (1, "1.0", "ordered")
    assert task_record(alice, task_id)["build_seconds"] == 0.0
    # again: nothing to build
    again = environments_cli(service, alice.token, "build", "ordered", *spec, "--endpoint", "shop")
    assert again.returncode == 0 and f"{node}: built (already)" in again.stdout, again.stdout
    # a short --timeout: a node that has not answered is not said to be "still building"
    quick = environments_cli(
        service, alice.token, "build", "ordered", *spec, "--endpoint", "shop", "--timeout", "0.01"
    )
    said = quick.stdout.splitlines()[1]
    assert said in (f"{node}: built (already)", f"{node}: no answer yet after 0.01 s: "
                    "`nimbus environments list --endpoint shop` shows when it ends"), quick.stdout  # fmt: skip
    # busy: a task of it runs, so nothing is removed
    done = tmp_path / "done"  # the task runs until the refusal is seen (a loaded CI)
    (slow,) = alice.batch_run(slow_in_env, [(str(done),)], endpoint="shop", environment=env)
    deadline = time.monotonic() + 30
    while alice.get_task(slow)["state"] != "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    busy = environments_cli(service, alice.token, "remove", "ordered", "--endpoint", "shop")
    assert busy.returncode == 2, busy.stdout + busy.stderr
    assert "is busy on endpoint 'shop'" in busy.stderr and "nothing was removed" in busy.stderr
    done.touch()
    assert alice.get_result(slow, timeout=60) == "ordered"
    # idle now: removed from its node, and its workers with it
    gone = environments_cli(service, alice.token, "remove", "ordered", "--endpoint", "shop")
    assert gone.returncode == 0, gone.stdout + gone.stderr
    assert gone.stdout.splitlines()[1] == f"{node}: removed", gone.stdout
    rows_until(alice, "shop", lambda rs: all(r["key"] != env.key for r in rs), 20)
    assert not (Path(service.env["NIMBUS_ENVIRONMENTS_DIR"]) / env.key).exists()
    # a task of it afterwards builds it again, as at any first use
    (task_id,) = alice.batch_run(orderpkg_version, [(2,)], endpoint="shop", environment=env)
    assert alice.get_result(task_id, timeout=60) == (2, "1.0", "ordered")
    assert task_record(alice, task_id)["build_seconds"] > 0


def test_build_endpoint_with_a_failing_spec_prints_the_cause_per_node(
    service: Service, alice: Client, shop: EndpointProcess, tmp_path: Path
) -> None:
    wheels = wheel(tmp_path / "wheels")
    args = ["build", "broken", "-r", "no-such-package-xyz", "--wheelhouse", wheels]
    out = environments_cli(service, alice.token, *args, "--endpoint", "shop")
    assert out.returncode == 1, out.stdout + out.stderr
    line = out.stdout.splitlines()[1]
    assert line.startswith(f"{socket.gethostname()}: failed: environment 'broken'"), out.stdout
    assert "no-such-package-xyz" in line
    # --no-wait returns once the nodes are asked; --timeout says who did not say in time
    quick = environments_cli(service, alice.token, *args, "--endpoint", "shop", "--no-wait")
    assert quick.returncode == 0 and "not waiting" in quick.stdout, quick.stdout
    late = environments_cli(service, alice.token, *args, "--endpoint", "shop", "--timeout", "0.01")
    assert late.returncode == 1, late.stdout + late.stderr
    assert f"{socket.gethostname()}: no answer yet after 0.01 s" in late.stdout, late.stdout
    assert "`nimbus environments list --endpoint shop`" in late.stdout


def test_build_and_remove_endpoint_refuse_wrong_input_doing_nothing(
    service: Service, alice: Client, shop: EndpointProcess
) -> None:
    def refused(*args: str, token: str = alice.token) -> str:
        out = environments_cli(service, token, *args)
        assert out.returncode == 2, out.stdout + out.stderr
        assert out.stdout == "" and len(out.stderr.strip().splitlines()) == 1, out.stderr
        return out.stderr

    sandbox = ("build", "jailed", "--sandbox", "--endpoint")
    said = refused(*sandbox, "no-such-endpoint")
    assert "no endpoint named 'no-such-endpoint'" in said and "`nimbus endpoints list`" in said
    alice.register_endpoint("sleepy")  # registered, never started
    said = refused(*sandbox, "sleepy")
    assert "endpoint 'sleepy' is offline" in said and "nimbus endpoint start sleepy" in said
    said = refused("build", "never-built-here", "--endpoint", "shop")
    assert "'never-built-here' is not built on this machine" in said and "-r REQUIREMENT" in said
    said = refused("remove", "never-built-anywhere", "--endpoint", "shop")
    assert "no environment named 'never-built-anywhere' on the nodes of endpoint 'shop'" in said
    bob = service.token("bob")  # shop is alice's, not shared with bob
    said = refused(*sandbox, "shop", token=bob)
    assert "no endpoint named 'shop' is visible to you" in said
    said = refused(*sandbox, shop.endpoint_id, token=bob)
    assert f"endpoint {shop.endpoint_id} not found" in said
    assert all(r["name"] != "jailed" for r in alice.get_endpoint("shop")["environments"])


@contextlib.contextmanager
def _bare_agent(
    service: Service, client: Client, name: str, *, orders: bool = True
) -> Iterator[tuple[str, list[str]]]:
    """A bare agent for ``client``'s new endpoint ``name``, on ``service``'s WebSocket: it
    beats and, with ``orders``, answers every order as built on node n1 (never saying
    a node is done); without, it says nothing of orders, as an older agent. Yields,
    once the endpoint is online, its id and the ops the service sent it."""
    from nimbus.protocol import ORDERS, WS_AGENT, Hello, Order, Ordered
    from service_support import ws_connect

    registered = client.register_endpoint(name)
    heard: list[str] = []
    with ws_connect(service, WS_AGENT, registered["token"]) as ws:
        ws.send(Hello("3.11", "x", 1, 1024, [], (ORDERS,) if orders else ()).encode())
        stop = threading.Event()

        def agent() -> None:
            while not stop.is_set():
                ws.send(Beat(time.monotonic()).encode())
                with contextlib.suppress(TimeoutError):
                    msg = unpack(ws.recv(timeout=0.1))
                    heard.append(msg["op"])
                    if orders and msg["op"] == "order":
                        ws.send(Ordered(Order.decode(msg).ref, 0, "", ["n1"]).encode())

        answering = threading.Thread(target=agent, daemon=True)
        answering.start()
        try:
            deadline = time.monotonic() + 10
            while not client.get_endpoint(name)["online"]:
                assert time.monotonic() < deadline, f"endpoint {name} not online"
                time.sleep(0.05)
            yield registered["endpoint_id"], heard
        finally:
            stop.set()
            answering.join(timeout=5)


def test_an_older_agent_is_not_sent_an_order(service: Service, alice: Client) -> None:
    with _bare_agent(service, alice, "elder", orders=False) as (_, heard):
        args = ("build", "jailed", "--sandbox", "--endpoint", "elder")
        out = environments_cli(service, alice.token, *args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "endpoint 'elder' runs an older nimbus" in out.stderr, out.stderr
    assert "nimbus endpoint start elder" in out.stderr
    assert "beat" in heard and "order" not in heard  # sent nothing it would not understand


def env_node(x: int) -> tuple[int, str, str]:

    import orderpkg  # type: ignore[import-not-found]

    return x, orderpkg.VERSION, os.environ.get("SLURMD_NODENAME", "?")


def test_build_and_remove_endpoint_reach_a_slurm_blocks_manager(
    service: Service, alice: Client, slurm: Any, tmp_path: Path
) -> None:
    from service_support import slurm_endpoint

    endpoint = slurm_endpoint(
        service, alice, "hpc-orders", slurm,
        workers_per_node=2, min_blocks=1, init_blocks=1, max_blocks=1, max_idle=60.0,
    )  # fmt: skip
    wheels = wheel(tmp_path / "wheels", version="2.0")
    env = Environment("blocked", requirements=["orderpkg==2.0"], wheelhouse=wheels)
    spec = ["-r", "orderpkg==2.0", "--wheelhouse", wheels, "--endpoint", "hpc-orders"]
    try:
        endpoint.start(alice)
        deadline = time.monotonic() + 90
        while True:  # until the block's manager has joined the agent
            out = environments_cli(service, alice.token, "build", "blocked", *spec)
            if "has no nodes now" not in out.stderr or time.monotonic() > deadline:
                break
            assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
            time.sleep(1)
        assert out.returncode == 0, out.stdout + out.stderr
        head, line = out.stdout.splitlines()[:2]
        node = head.rpartition(": ")[2]
        assert node.startswith("n") and "on 1 node of endpoint hpc-orders" in head, out.stdout
        assert line.startswith(f"{node}: built in "), out.stdout
        rows = rows_until(
            alice,
            "hpc-orders",
            lambda rs: any(r["node"] == node and r["key"] == env.key for r in rs),
            30,
        )
        mine = [r["state"] for r in rows if r["key"] == env.key and r["node"] == node]
        assert mine == ["built"], rows  # (the agent's machine shares this test's cache)
        ids = alice.batch_run(env_node, [(1,)], endpoint="hpc-orders", environment=env)
        assert alice.get_result(ids[0], timeout=120) == (1, "2.0", node)
        assert task_record(alice, ids[0])["build_seconds"] == 0.0  # built before: no build
        gone = environments_cli(
            service, alice.token, "remove", "blocked", "--endpoint", "hpc-orders"
        )
        assert gone.returncode == 0 and f"{node}: removed" in gone.stdout, gone.stdout + gone.stderr
    finally:
        endpoint.stop()
        del service.env["SLURM_CONF"]


def test_only_the_owner_removes_and_a_user_has_a_few_orders_in_flight(
    service: Service, alice: Client
) -> None:
    """On a public endpoint another user may order builds, at most USER_ORDERS not done
    at a time (429 naming the limit), and no removal (403 naming the owner)."""
    import httpx

    from nimbus.service.orders import USER_ORDERS

    carol = service.token("carol")
    spec = Environment("jailed", sandbox=True).to_dict()
    with _bare_agent(service, alice, "depot") as (depot, _):
        headers = {"Authorization": f"Bearer {alice.token}"}
        with httpx.Client(base_url=service.url, headers=headers, timeout=30) as http:
            http.post(f"/v1/endpoints/{depot}/share", json={"public": True}).raise_for_status()
            url = f"/v1/endpoints/{depot}/environments"
            theirs = {"Authorization": f"Bearer {carol}"}
            removal = {"action": "remove", "name": "jailed"}
            said = http.post(url, json=removal, headers=theirs)
            assert said.status_code == 403, said.text
            assert "belongs to alice: only they may remove" in said.json()["detail"]
            build = {"action": "build", "name": "jailed", "environment": spec}
            for _ in range(USER_ORDERS):
                placed = http.post(url, json=build, headers=theirs)
                assert placed.status_code == 202, placed.text
            said = http.post(url, json=build, headers=theirs)
            assert said.status_code == 429, said.text
            assert f"at most {USER_ORDERS} at a time" in said.json()["detail"]
            assert http.post(url, json=build).status_code == 202  # alice's own count
            assert http.post(url, json=removal).status_code == 202  # the owner's


def test_an_order_to_another_service_process_says_where_the_agent_is(tmp_path: Path) -> None:
    """Two service processes: an order asked of the one the endpoint's agent is not
    connected to says so and what to do (not "offline"); the other one takes it."""
    import httpx

    from service_support import two_services

    with (
        two_services(tmp_path) as (first, second, _),
        first.client(first.token("alice")) as alice,
        _bare_agent(first, alice, "twin") as (twin, _),
    ):
        spec = Environment("jailed", sandbox=True).to_dict()
        body = {"action": "build", "name": "jailed", "environment": spec}
        url = f"/v1/endpoints/{twin}/environments"
        headers = {"Authorization": f"Bearer {alice.token}"}
        said = httpx.post(second.url + url, json=body, headers=headers, timeout=30)
        assert said.status_code == 409, said.text
        detail = said.json()["detail"]
        assert "is online, but its agent is connected to another process" in detail
        assert "ask again" in detail and "offline" not in detail
        placed = httpx.post(first.url + url, json=body, headers=headers, timeout=30)
        assert placed.status_code == 202, placed.text
        order_id = placed.json()["order_id"]
        got = httpx.get(f"{second.url}{url}/{order_id}", headers=headers, timeout=30)
        assert got.status_code == 404
        assert "the service process the endpoint's agent" in got.json()["detail"]
