"""The service on a real PostgreSQL registry (a private cluster started here).

Skipped only where this machine cannot have one (not root, no server binaries);
as root with apt, a PostgreSQL that is missing or does not start fails the run.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nimbus import Executor
from nimbus.statestore import StateStore
from service_support import (
    EndpointProcess,
    Postgres,
    Runs,
    Service,
    assert_first_results,
    free_port,
    postgres_cluster,
    process_tree,
    service_env,
    service_redis,
    tokened_run,
)


def cube(x: int) -> int:
    return x**3


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    with postgres_cluster() as pg:
        yield pg


def _persisted_service(postgres: Postgres, tmp_path: Path) -> Service:
    """A ``--persist`` service (its queue Redis saved in its runtime directory) on the
    PostgreSQL registry, started."""
    root = tmp_path / "svc"
    root.mkdir()
    env = service_env(root, NIMBUS_DATABASE_URL=postgres.url)
    return Service(root, env, port=free_port(), args=["--persist"]).start()


def _wait_ended(runs: Path, count: int) -> None:
    """Until ``count`` runs have ended (``tokened_run`` writes an ``end`` line for each)."""
    deadline = time.monotonic() + 60
    while not runs.exists() or runs.read_text().count("end ") < count:
        assert time.monotonic() < deadline, f"fewer than {count} runs ended in 60 s"
        time.sleep(0.01)


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
    service = _persisted_service(postgres, tmp_path)
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
                _wait_ended(runs, 6)
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


# ---------------------------------------------------------------- the kill matrix


def _postmaster(postgres: Postgres) -> int:
    return int((postgres.data / "postmaster.pid").read_text().split()[0])


def _queue_redis(service: Service) -> int:
    """The service's embedded queue Redis."""
    return service_redis(service)


def _running_worker(runs: Path, agent: int) -> int:
    """The pid of a worker of ``agent`` that is running a task now."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        started: dict[str, int] = {}
        for line in runs.read_text().splitlines():
            kind, token = line.split()
            if kind == "start":
                started[token] = int(token.split(":")[1])
            else:
                started.pop(token, None)
        tree = process_tree(agent)
        busy = [pid for pid in started.values() if pid in tree]
        if busy:
            return busy[-1]
        time.sleep(0.01)
    raise AssertionError("no worker of the agent is running a task")


@pytest.mark.parametrize("victim", ["worker", "agent", "queue-redis", "registry", "service"])
def test_kill_matrix(postgres: Postgres, tmp_path: Path, victim: str) -> None:
    """SIGKILL one part (a worker, the agent, the queue Redis, PostgreSQL, the service) in
    the middle of an Executor map on a --persist service with a PostgreSQL registry.

    Every task ends with exactly one result, its first run's; only the task a killed
    worker was running fails, with WorkerLost (as in the stdlib's process pool, a task
    is not run again behind the caller's back). Each part comes back: a worker, the
    queue Redis and the service's connections to PostgreSQL by themselves; an agent, the
    service or PostgreSQL when their supervisor starts them again (here, the test), and
    the others reconnect to it. Afterwards a new map runs, and the logs stay small.
    """
    from nimbus.errors import WorkerLost

    service = _persisted_service(postgres, tmp_path)
    runs = tmp_path / "runs.txt"
    n = 40
    endpoint = None
    name = f"km-{victim}"
    try:
        token = service.token(name)
        with service.client(token) as client:
            endpoint = EndpointProcess(service, client, name).start(client)
            assert endpoint.proc is not None
            settings = service.user_settings(token)
            with Executor(endpoint=name, settings=settings) as ex:
                futures = [ex.submit(tokened_run, str(runs), i, 0.1) for i in range(n)]
                _wait_ended(runs, 8)
                lost: set[int] = set()
                if victim == "worker":
                    pid = _running_worker(runs, endpoint.proc.pid)
                    lost.add(pid)
                    os.kill(pid, signal.SIGKILL)
                elif victim == "agent":
                    lost = process_tree(endpoint.proc.pid)
                    endpoint.kill()
                    endpoint.start()  # its supervisor starts it again, with the same token
                elif victim == "queue-redis":
                    os.kill(_queue_redis(service), signal.SIGKILL)  # the service restarts it
                elif victim == "registry":
                    os.kill(_postmaster(postgres), signal.SIGKILL)
                    time.sleep(1.0)
                    postgres.restart()
                else:
                    assert service.proc is not None
                    service.proc.kill()
                    service.proc.wait()
                    service.start()  # same port, runtime dir and PostgreSQL
                outcomes: list[str | BaseException] = []
                for future in futures:
                    try:
                        outcomes.append(future.result(120))
                    except WorkerLost as exc:
                        outcomes.append(exc)
                failed = [i for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
                if victim == "worker":
                    assert len(failed) == 1, outcomes
                    (i,) = failed
                    assert [Runs.pid(t) for t in Runs(runs).started[i]] == [*lost]
                else:
                    assert failed == [], outcomes
                    assert_first_results(runs, [str(o) for o in outcomes], lost)
                # back: a new map on the same executor and a new client call both run
                again = list(ex.map(cube, range(20)))
                assert again == [i**3 for i in range(20)]
            assert client.get_result(client.run(cube, 5, endpoint=name), timeout=60) == 125
            with service.http() as http:
                assert http.get("/v1/health").status_code == 200
        for log in (service.log, endpoint.log):
            size = log.stat().st_size
            assert size < 256 * 1024, f"{log.name}: {size} bytes\n{log.read_text()[-3000:]}"
    finally:
        if endpoint is not None:
            endpoint.stop()
        service.stop()
