"""Shared pytest configuration and fixtures for the nimbus tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nimbus.multiprocessing import _site as _state
from nimbus.statestore import Keys, Program


@pytest.fixture(scope="module")
def store_url() -> str:
    """The URL of this test process's embedded store, started (a program's store starts
    at its first connection through nimbus; these tests also connect with redis-py)."""
    program = _state.program()
    program.client().ping()
    return program.url


@pytest.fixture
def program(store_url: str) -> Iterator[Program]:
    """A fresh program (its own id) on the shared embedded store; its keys go afterwards."""
    prog = Program(store_url, Keys.program_id_new(), 30.0)
    yield prog
    client = prog.client()
    keys = list(client.scan_iter(match=prog.keys.pattern()))
    if keys:
        client.unlink(*keys)


@pytest.fixture
def provided(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Settings for ``Executor(backend="provided", settings=...)``: the agent's managers
    are local blocks of one worker each."""
    from nimbus.backends import BACKENDS
    from nimbus.backends.provided import ProvidedBackend
    from nimbus.config import Settings

    def factory(*, endpoint: object = None, **kwargs: Any) -> Any:
        del endpoint
        return ProvidedBackend(**kwargs)

    monkeypatch.setitem(BACKENDS, "provided", factory)
    return Settings.load().replace(
        provider="local", workers_per_node=1, agent_listen="127.0.0.1:0", max_idle=60.0
    )


class LockHolder:
    """Another process holding the lock file ``path`` (``nimbus._lockfile``) until
    :meth:`let_go` (a stuck process of the program)."""

    CODE = (
        "import sys\nfrom nimbus._lockfile import lock_file\n"
        "with lock_file(sys.argv[1], 5):\n"
        "    print('held', flush=True)\n    sys.stdin.readline()\n"
    )

    def __init__(self, path: Path) -> None:
        src = str(Path(__file__).resolve().parents[1] / "src")
        self.process = subprocess.Popen(
            [sys.executable, "-c", self.CODE, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ | {"PYTHONPATH": src},
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline() != "held\n":
            self.let_go()
            raise AssertionError(f"the holder of {path} did not take it")

    def let_go(self) -> None:
        """It lets go of the lock, and ends (again: nothing)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        if self.process.returncode is None:
            self.process.stdin.close()
            self.process.wait(10)
            self.process.stdout.close()


@pytest.fixture
def hold_lock() -> Iterator[Callable[[Path], LockHolder]]:
    """``hold_lock(path)``: a :class:`LockHolder` of ``path``, let go at the latest when
    the test ends."""
    holders: list[LockHolder] = []

    def hold(path: Path) -> LockHolder:
        holders.append(LockHolder(path))
        return holders[-1]

    yield hold
    for holder in holders:
        holder.let_go()


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP port on the host's loopback that accepts connections."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    yield server.getsockname()[1]
    server.close()


# ---------------------------------------------------------------- the service


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A real nimbus service (uvicorn on 127.0.0.1, SQLite, embedded Redis) for a module."""
    from service_support import serve

    yield from serve(tmp_path_factory)


@pytest.fixture(scope="module")
def alice(service: Any) -> Iterator[Any]:
    """A client of user alice on the module's service."""
    with service.client(service.token("alice")) as client:
        yield client


@pytest.fixture(scope="module")
def lab(service: Any, alice: Any) -> Iterator[Any]:
    """Alice's endpoint "lab": a real agent process with 2 workers, online."""
    from service_support import EndpointProcess

    endpoint = EndpointProcess(service, alice, "lab").start(alice)
    yield endpoint
    endpoint.stop()


# ---------------------------------------------------------------- Slurm


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A private Slurm cluster (munged, slurmctld, slurmd n1..n4) for the session."""
    from slurm_support import Cluster, unavailable

    why = unavailable()
    if why:
        pytest.skip(why)
    cluster = Cluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()
