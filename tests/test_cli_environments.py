"""``nimbus environments list --endpoint X`` (``nimbus.cli.environments``): what an
endpoint's nodes hold, as its agent reports it with its beats."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from environment_support import environments_cli, environments_service, needs_bwrap, rows_until
from nimbus import Client, Environment
from service_support import EndpointProcess, Service


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The module's service: its endpoints build environments in a directory of its own."""
    yield from environments_service(tmp_path_factory)


def square(x: int) -> int:
    return x * x


def test_environments_list_endpoint_shows_what_its_nodes_hold(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    named = Environment("shown")
    ids = alice.batch_run(square, [(i,) for i in range(2)], endpoint="lab", environment=named)
    assert [alice.get_result(t, timeout=60) for t in ids] == [0, 1]
    deadline = time.monotonic() + 20  # reported every 5 beats (0.3 s each here)
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        rows = alice.get_endpoint("lab")["environments"]
        if any(r["name"] == "shown" and r["state"] == "warm" for r in rows):
            break
        time.sleep(0.3)
    warm = [r for r in rows if r["name"] == "shown" and r["state"] == "warm"]
    assert warm and warm[0]["workers"] >= 1 and warm[0]["key"] == named.key, rows
    out = environments_cli(service, alice.token, "list", "--endpoint", "lab", "--json")
    assert out.returncode == 0, out.stderr
    assert any(r["name"] == "shown" for r in json.loads(out.stdout))
    table = environments_cli(service, alice.token, "list", "--endpoint", "lab")
    assert table.returncode == 0 and "shown" in table.stdout and "warm" in table.stdout
    unknown = environments_cli(service, alice.token, "list", "--endpoint", "no-such-endpoint")
    assert unknown.returncode == 1  # not found, as for every command
    assert "no endpoint 'no-such-endpoint'" in unknown.stderr, unknown.stderr
    assert "`nimbus endpoints list`" in unknown.stderr and unknown.stderr.count("(") == 1


def on_node(x: int) -> tuple[int, str]:

    return x, os.environ.get("SLURMD_NODENAME", "?")


@needs_bwrap
def test_environments_list_endpoint_shows_what_remote_managers_hold(
    service: Service, alice: Client, slurm: Any
) -> None:
    from service_support import slurm_endpoint

    endpoint = slurm_endpoint(
        service,
        alice,
        "hpc",
        slurm,
        workers_per_node=2,
        min_blocks=1,
        init_blocks=1,
        max_blocks=1,
        max_idle=60.0,
    )
    jail = Environment("remote-jail", sandbox=True)
    try:
        endpoint.start(alice)
        ids = alice.batch_run(on_node, [(i,) for i in range(4)], endpoint="hpc", environment=jail)
        nodes = {node for _, node in (alice.get_result(t, timeout=120) for t in ids)}
        assert len(nodes) == 1 and next(iter(nodes)).startswith("n"), nodes
        node = nodes.pop()

        def shown(rows: list[dict[str, Any]]) -> bool:
            return any(
                r["node"] == node
                and r["name"] == jail.name
                and r["state"] == "warm"
                # its node's cache said it is built (every 5th beat; a build still under
                # way there, its lock not yet let go, has a row with no build_seconds)
                and "build_seconds" in r
                for r in rows
            )

        rows = rows_until(alice, "hpc", shown, 30)
        mine = [r for r in rows if r["node"] == node and r["key"] == jail.key]
        assert len(mine) == 1, rows  # one row per node and environment
        row = mine[0]
        assert row["workers"] >= 1 and 0 <= row["free"] <= row["workers"], row
        # from its node's cache: built there (a sandbox has no files of its own: size 0)
        assert row["size"] == 0 and row["build_seconds"] >= 0, row
        assert time.time() - 600 < row["last_use"] <= time.time(), row
        assert all(r["message"] for r in rows if r["state"] == "failed")  # the builder's words
        out = environments_cli(service, alice.token, "list", "--endpoint", "hpc")
        assert out.returncode == 0, out.stderr
        line = next(x for x in out.stdout.splitlines() if x.startswith(node) and "remote-" in x)
        assert "warm" in line and "free" in line, out.stdout
    finally:
        endpoint.stop()
        del service.env["SLURM_CONF"]
