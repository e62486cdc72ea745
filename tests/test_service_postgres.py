"""The service on a real PostgreSQL registry (a private cluster started here, or skipped)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from nimbus.statestore import StateStore
from service_support import EndpointProcess, Postgres, Service, free_port, service_env


def cube(x: int) -> int:
    return x**3


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    why = Postgres.unavailable()
    if why:
        pytest.skip(f"PostgreSQL not available: {why}")
    root = Path(tempfile.mkdtemp(prefix="nimbus-pg-"))  # reachable by the postgres user
    os.chmod(root, 0o755)
    pg = Postgres(root / "cluster")
    try:
        pg.start()
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"PostgreSQL could not be started: {exc}")
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
