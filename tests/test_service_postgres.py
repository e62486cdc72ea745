"""The service on a real PostgreSQL registry (a private cluster started here).

Skipped only where this machine cannot have one (not root, no server binaries);
as root with apt, a PostgreSQL that is missing or does not start fails the run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nimbus import Executor
from nimbus.statestore import StateStore
from service_support import (
    EndpointProcess,
    Postgres,
    Service,
    assert_first_results,
    free_port,
    service_env,
    tokened_run,
)


def cube(x: int) -> int:
    return x**3


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    why = Postgres.unavailable()
    if why:
        if os.geteuid() == 0 and shutil.which("apt-get"):
            pytest.fail(
                f"PostgreSQL can run here (root, apt) but {why}; "
                "install it (.ci/run does: apt-get install -y postgresql-15)"
            )
        pytest.skip(f"PostgreSQL not available: {why}")
    root = Path(tempfile.mkdtemp(prefix="nimbus-pg-"))  # reachable by the postgres user
    os.chmod(root, 0o755)
    pg = Postgres(root / "cluster")
    try:
        pg.start()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        log = pg.root / "pg.log"
        said = log.read_text()[-2000:] if log.exists() else ""
        subprocess.run(["rm", "-rf", str(root)], check=False)
        pytest.fail(f"PostgreSQL could not be started: {Postgres.explain(exc)}\n{said}")
    yield pg
    pg.stop()
    subprocess.run(["rm", "-rf", str(root)], check=False)


def test_registry_on_postgres_survives_service_restart(postgres: Postgres, tmp_path: Path) -> None:
    store = StateStore.open(None, tmp_path / "redis")
    root = tmp_path / "svc"
    root.mkdir()
    env = service_env(root, NIMBUS_DATABASE_URL=postgres.url, NIMBUS_REDIS_URL=store.url)
    service = Service(root, env, port=free_port()).start()
    endpoint = None
    try:
        alice_token, bob_token = service.token("pg-alice"), service.token("pg-bob")
        with service.client(alice_token) as alice, service.http(bob_token) as bob:
            assert alice.whoami()["name"] == "pg-alice"
            endpoint = EndpointProcess(service, alice, "pg-lab").start(alice)
            fn = alice.register_function(cube)
            assert bob.get(f"/v1/functions/{fn}").status_code == 404
            assert bob.get(f"/v1/endpoints/{endpoint.endpoint_id}").status_code == 404
            assert alice.get_result(alice.run(cube, 3, endpoint="pg-lab"), timeout=30) == 27
            endpoint.stop()
            queued = alice.batch_run(cube, [(i,) for i in range(8)], endpoint="pg-lab")
            service.stop()
            service.start()  # users, tokens, functions, endpoints come back from PostgreSQL
            assert alice.get_function(fn)["name"] == "cube"
            endpoint.start(alice)
            assert [alice.get_result(i, timeout=30) for i in queued] == [i**3 for i in range(8)]
            states = {alice.get_task(i)["state"] for i in queued}
            assert states == {"success"}
    finally:
        if endpoint is not None:
            endpoint.stop()
        service.stop()
        store.close()


def test_service_killed_mid_run_restarts_from_postgres_and_its_persisted_redis(
    postgres: Postgres, tmp_path: Path
) -> None:
    """SIGKILL the service mid-batch; started again on the same data, every task of an
    Executor and of a Client ends with exactly one result, its first run's (agent and
    SDK reconnect; every run answers with a token of its own)."""
    root = tmp_path / "svc"
    root.mkdir()
    env = service_env(root, NIMBUS_DATABASE_URL=postgres.url)
    service = Service(root, env, port=free_port(), args=["--persist"]).start()
    runs = tmp_path / "runs.txt"
    n = 16
    endpoint = None
    try:
        token = service.token("pg-phoenix")
        with service.client(token) as client:
            endpoint = EndpointProcess(service, client, "pg-phoenix").start(client)
            with Executor(endpoint="pg-phoenix", settings=service.user_settings(token)) as ex:
                futures = [ex.submit(tokened_run, str(runs), i, 0.2) for i in range(n)]
                ids = client.batch_run(
                    tokened_run, [(str(runs), n + i, 0.2) for i in range(n)], endpoint="pg-phoenix"
                )
                deadline = time.monotonic() + 60
                while not runs.exists() or runs.read_text().count("end ") < 6:
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                assert service.proc is not None
                service.proc.kill()  # no shutdown at all: queues and results as they were
                service.proc.wait()
                service.start()  # same port and runtime dir: PostgreSQL and the Redis file
                streamed = [f.result(120) for f in futures]
                stored = [client.get_result(i, timeout=120) for i in ids]
            tasks = [client.get_task(i) for i in ids]
            assert {t["state"] for t in tasks} == {"success"}
            time.sleep(1.0)  # a late duplicate, if any, has arrived: nothing was replaced
            assert [client.get_result(i, timeout=5) for i in ids] == stored
        assert_first_results(runs, streamed + stored)
    finally:
        if endpoint is not None:
            endpoint.stop()
        service.stop()
