"""``nimbus.endpoint.daemon``: tasks with an environment, sent through a real service,
run on a real endpoint in workers of that environment (built on first use)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from environment_support import environments_service, needs_bwrap, task_record
from nimbus import Client, Environment, Executor
from nimbus.errors import EnvironmentBuildError
from service_support import EndpointProcess, Service


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The module's service: its endpoints build environments in a directory of its own."""
    yield from environments_service(tmp_path_factory)


def square(x: int) -> int:
    return x * x


def connect(port: int) -> str:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            return "connected"
    except OSError as exc:
        return type(exc).__name__


def test_a_named_environment_runs_in_workers_of_its_own(
    alice: Client, lab: EndpointProcess
) -> None:
    plain = alice.batch_run(square, [(i,) for i in range(4)], endpoint="lab")
    named = alice.batch_run(
        square, [(i,) for i in range(4)], endpoint="lab", environment=Environment("named")
    )
    assert [alice.get_result(t, timeout=60) for t in plain + named] == [0, 1, 4, 9] * 2
    plain_workers = {task_record(alice, t)["worker"] for t in plain}
    named_workers = {task_record(alice, t)["worker"] for t in named}
    assert plain_workers and named_workers and not plain_workers & named_workers


@needs_bwrap
def test_a_sandboxed_task_through_the_service_has_no_network(
    service: Service, alice: Client, lab: EndpointProcess, listener: int
) -> None:
    settings = service.user_settings(alice.token)
    with Executor(endpoint="lab", settings=settings) as ex:
        assert ex.submit(connect, listener).result(timeout=60) == "connected"
        jailed = ex.options(environment=Environment("jail", sandbox=True))
        assert jailed.submit(connect, listener).result(timeout=120) == "ConnectionRefusedError"


def test_a_failed_build_fails_the_task_within_seconds(
    alice: Client, lab: EndpointProcess, tmp_path: Path
) -> None:
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    env = Environment("bad", requirements=["no-such-package-xyz"], wheelhouse=str(wheelhouse))
    started = time.monotonic()
    (task_id,) = alice.batch_run(square, [(3,)], endpoint="lab", environment=env)
    with pytest.raises(EnvironmentBuildError) as info:
        alice.get_result(task_id, timeout=60)
    assert time.monotonic() - started < 30
    assert "no-such-package-xyz" in str(info.value)
    assert alice.get_task(task_id)["state"] == "failed"
    assert alice.get_result(alice.run(square, 5, endpoint="lab"), timeout=30) == 25
