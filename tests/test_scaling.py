"""Elastic blocks on a real (private) Slurm: NIMBUS_PROVIDER=slurm for the embedded runtime."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nimbus import Executor
from nimbus.backends.provided import ProvidedBackend
from nimbus.config import Settings
from nimbus.errors import ProviderError
from slurm_support import wait_for


def node_of(seconds: float) -> str:
    time.sleep(seconds)
    return os.environ.get("SLURMD_NODENAME", "?")


@pytest.fixture
def settings(slurm: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Settings:
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # blocks' output there
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


def _busy_on_two_blocks(ex: Executor) -> tuple[Any, list[Any], Any]:
    """Once both blocks' managers joined, 40 tasks of 0.3 s: the backend, their futures,
    and the first manager (running some of them)."""
    backend = backend_of(ex)
    wait_for(lambda: len(backend.agent.remote_managers()) == 2, 30, "two blocks to join")
    futures = [ex.submit(node_of, 0.3) for _ in range(40)]
    time.sleep(0.8)
    return backend, futures, backend.agent.remote_managers()[0]


def test_a_block_scancelled_from_outside_loses_no_task(settings: Settings, slurm: Any) -> None:
    with Executor(settings=_spread(settings)) as ex:
        backend, futures, victim = _busy_on_two_blocks(ex)
        slurm.run("scancel", victim.block)
        nodes = [f.result(timeout=60) for f in futures]
        assert len(nodes) == 40
        assert backend.agent.lost and backend.agent.lost[0][2] > 0  # it held tasks: requeued
        assert victim.node in nodes  # it ran some before it went


def test_a_killed_slurmd_requeues_its_tasks_elsewhere(settings: Settings, slurm: Any) -> None:
    with Executor(settings=_spread(settings)) as ex:
        backend, futures, victim = _busy_on_two_blocks(ex)
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


def stuck_the_first_time(marker: str) -> tuple[str, str]:
    """Hangs on its first run (until its block is killed); its next run answers at once."""
    with open(marker, "a") as f:
        f.write(os.environ.get("SLURM_JOB_ID", "?") + "\n")
    with open(marker) as f:
        if len(f.read().split()) == 1:
            time.sleep(600)
    return os.environ.get("SLURM_JOB_ID", "?"), os.environ.get("SLURMD_NODENAME", "?")


def test_a_block_killed_at_its_walltime_has_its_tasks_requeued_and_is_replaced(
    settings: Settings, slurm: Any, tmp_path: Any
) -> None:
    # walltime 30 s: the block takes no new task from 20 s on (its replacement is asked
    # for then, the stuck task is still work), and Slurm kills it at 30 s (slurmctld
    # looks at time limits every 30 s: up to a minute)
    s = settings.replace(walltime="00:00:30", max_blocks=1, max_idle=300.0)
    marker = tmp_path / "runs"
    with Executor(settings=s) as ex:
        backend = backend_of(ex)
        stuck = ex.submit(stuck_the_first_time, str(marker))
        first_block = wait_for(lambda: marker.exists() and marker.read_text().split(), 30, "a run")
        quick = [ex.submit(node_of, 0.05) for _ in range(20)]
        assert all(n.startswith("n") for n in (f.result(timeout=30) for f in quick))
        job, node = stuck.result(timeout=120)
        assert node.startswith("n")
        runs = marker.read_text().split()
        assert runs == [first_block[0], job] and job != first_block[0], runs  # once each block
        assert jobs(slurm)[first_block[0]] == "TIMEOUT"  # Slurm ended it, not the scaler
        assert backend.scaler.submitted >= 2  # the replacement
        lost = backend.agent.lost
        assert lost and lost[0][2] >= 1, lost  # the stuck task was requeued, not failed
        assert [f.exception() for f in quick] == [None] * 20
        assert stuck.exception() is None


def remote_node_of(seconds: float) -> str:  # sent by value to the endpoint
    import os
    import time

    time.sleep(seconds)
    return os.environ.get("SLURMD_NODENAME", "?")


def test_an_endpoint_on_slurm_grows_from_zero_blocks_and_shows_them(
    service: Any, alice: Any, slurm: Any
) -> None:
    import subprocess
    import sys

    from service_support import slurm_endpoint

    endpoint = slurm_endpoint(
        service, alice, "hpc", slurm, workers_per_node=2, max_blocks=2, max_idle=30.0
    )
    env = dict(service.env)  # with SLURM_CONF
    try:
        endpoint.start(alice)
        token = service.token("alice")
        with Executor(endpoint="hpc", settings=service.user_settings(token)) as ex:
            t0 = time.monotonic()
            assert ex.submit(remote_node_of, 0).result(timeout=60).startswith("n")
            first = time.monotonic() - t0
            assert all(n.startswith("n") for n in ex.map(remote_node_of, [0.01] * 50))
        time.sleep(1.2)  # the blocks file is written once a second
        shown = subprocess.run(
            [sys.executable, "-m", "nimbus", "endpoint", "status", "hpc"],
            env={**env, "NIMBUS_SERVICE_URL": service.url, "NIMBUS_TOKEN": token},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert re.search(r"provider slurm, [12] block\(s\)", shown.stdout), shown.stdout
        assert re.search(r"job \d+ +running +1 node\(s\), 1 manager\(s\)", shown.stdout)
        assert "service: online" in shown.stdout
    finally:
        endpoint.stop()
        del service.env["SLURM_CONF"]
    assert first < 15


def test_endpoint_configure_takes_the_provider_settings(service: Any, alice: Any) -> None:
    import subprocess
    import sys

    from nimbus.endpoint.config import EndpointConfig

    env = {
        **service.env,
        "NIMBUS_SERVICE_URL": service.url,
        "NIMBUS_TOKEN": service.token("alice"),
    }
    base = [sys.executable, "-m", "nimbus", "endpoint", "configure"]
    options = ["--provider", "slurm", "--partition", "debug", "--nodes-per-block", "2"]
    options += ["--min-blocks", "0", "--max-blocks", "4", "--init-blocks", "0"]
    options += ["--walltime", "00:30:00", "--max-idle", "60", "--exclusive"]
    options += ["--worker-init", 'module load python; source "$HOME/venv/bin/activate"']
    done = subprocess.run([*base, "hpc-cli", *options], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    old = os.environ.get("XDG_CONFIG_HOME")
    os.environ["XDG_CONFIG_HOME"] = service.env["XDG_CONFIG_HOME"]
    try:
        config = EndpointConfig.load("hpc-cli")
    finally:
        if old is None:
            del os.environ["XDG_CONFIG_HOME"]
        else:
            os.environ["XDG_CONFIG_HOME"] = old
    assert (config.provider, config.partition, config.nodes_per_block) == ("slurm", "debug", 2)
    assert (config.max_blocks, config.max_idle, config.exclusive) == (4, 60.0, True)
    assert config.worker_init == 'module load python; source "$HOME/venv/bin/activate"'
    bad = subprocess.run(
        [*base, "hpc-bad", "--walltime", "30m"], env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "walltime" in bad.stderr and "HH:MM:SS" in bad.stderr


MP_PROGRAM = """
import nimbus.multiprocessing as mp

def node(x):
    with open("/proc/self/environ", "rb") as f:  # the node's, whatever os.environ says
        env = dict(v.split(b"=", 1) for v in f.read().split(b"\\0") if b"=" in v)
    return env.get(b"SLURMD_NODENAME", b"?").decode(), x * x

if __name__ == "__main__":
    with mp.Pool(4) as pool:
        out = pool.map(node, range(40))
    assert [square for _, square in out] == [x * x for x in range(40)]
    p = mp.Process(target=print, args=("child says hi",))
    p.start()
    p.join()
    print("nodes", sorted({n for n, _ in out}), "exitcode", p.exitcode)
"""


def test_multiprocessing_on_slurm_with_no_service(slurm: Any, tmp_path: Any) -> None:
    import subprocess
    import sys

    program = tmp_path / "prog.py"
    program.write_text(MP_PROGRAM)
    env = {
        **os.environ,
        "SLURM_CONF": str(slurm.conf),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "NIMBUS_PROVIDER": "slurm",
        "NIMBUS_PARTITION": slurm.partition,
        "NIMBUS_WORKERS_PER_NODE": "2",
        "NIMBUS_EXCLUSIVE": "yes",
        "NIMBUS_INIT_BLOCKS": "2",
        "NIMBUS_MAX_BLOCKS": "2",
        "NIMBUS_AGENT_LISTEN": "127.0.0.1:0",
    }
    done = subprocess.run(
        [sys.executable, str(program)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "child says hi" in done.stdout
    nodes = re.search(r"nodes \[(.*)\] exitcode 0", done.stdout)
    assert nodes, done.stdout
    assert all(n.strip(" '").startswith("n") for n in nodes.group(1).split(","))
    assert "'?'" not in nodes.group(1)
    # the program's exit cancelled its blocks
    out = slurm.run("squeue", "-h", "-o", "%i %T").stdout
    assert "RUNNING" not in out and "PENDING" not in out, out


STORE_PROGRAM = """
import nimbus.multiprocessing as mp
from nimbus import statestore

def on_a_node(counter, queue):
    url = statestore.current().url
    with counter.get_lock():
        counter.value += 1
    peer = statestore.current().client().client_info()  # this connection, as the server sees it
    with open("/proc/self/environ", "rb") as f:  # the node's, whatever os.environ says
        env = dict(v.split(b"=", 1) for v in f.read().split(b"\\0") if b"=" in v)
    queue.put((env.get(b"SLURMD_NODENAME", b"?").decode(), url, peer["laddr"]))

if __name__ == "__main__":
    counter, queue = mp.Value("i", 0), mp.Queue()
    procs = [mp.Process(target=on_a_node, args=(counter, queue)) for _ in range(4)]
    for p in procs:
        p.start()
    seen = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join()
    print("COUNTER", counter.value)
    for node, url, laddr in seen:
        print("SEEN", node, url, laddr)
"""


def test_multiprocessing_on_slurm_reaches_its_store_over_tcp_with_a_password(
    slurm: Any, tmp_path: Any
) -> None:
    import subprocess
    import sys

    import redis

    program = tmp_path / "prog.py"
    program.write_text(STORE_PROGRAM)
    env = {
        **os.environ,
        "SLURM_CONF": str(slurm.conf),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "NIMBUS_RUNTIME_DIR": str(tmp_path / "run"),
        "NIMBUS_PROVIDER": "slurm",
        "NIMBUS_PARTITION": slurm.partition,
        "NIMBUS_WORKERS_PER_NODE": "4",
        "NIMBUS_MAX_BLOCKS": "1",
        "NIMBUS_AGENT_LISTEN": "127.0.0.1:0",
    }
    env.pop("NIMBUS_REDIS_URL", None)
    done = subprocess.run(
        [sys.executable, str(program)], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "COUNTER 4" in done.stdout, done.stdout
    seen = re.findall(r"SEEN (\S+) (\S+) (\S+)", done.stdout)
    assert len(seen) == 4 and all(node.startswith("n") for node, _, _ in seen), seen
    urls = {url for _, url, _ in seen}
    assert len(urls) == 1, urls
    url = urls.pop()
    m = re.fullmatch(r"redis://:([\w-]{40,})@127\.0\.0\.1:(\d+)/0", url)
    assert m, url  # TCP, on agent_listen's host, with a generated password
    assert {laddr for _, _, laddr in seen} == {f"127.0.0.1:{m.group(2)}"}  # not the socket
    with pytest.raises(redis.exceptions.ConnectionError):  # the program's end stopped it
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()


def test_the_store_for_nodes_refuses_a_client_without_its_password(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis

    from nimbus.providers import store_for_nodes

    monkeypatch.delenv("NIMBUS_REDIS_URL", raising=False)
    s = Settings.load().replace(
        provider="slurm", agent_listen="127.0.0.1:0", runtime_dir=tmp_path / "run"
    )
    store = store_for_nodes(s)
    try:
        assert store.client().ping()
        url = redis.connection.parse_url(store.url)
        anonymous = redis.Redis(host=url["host"], port=url["port"], socket_connect_timeout=2)
        with pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.set("k", "v")
        wrong = redis.Redis(host=url["host"], port=url["port"], password="guess")
        with pytest.raises(redis.exceptions.AuthenticationError):
            wrong.ping()
    finally:
        store.close()


def test_blocks_that_die_before_a_manager_joins_fail_the_tasks_not_loop(
    settings: Settings,
) -> None:
    with Executor(settings=settings.replace(worker_init="exit 3")) as ex:
        future = ex.submit(node_of, 0)
        with pytest.raises(ProviderError, match=r"before any manager joined.*worker_init"):
            future.result(timeout=60)
        scaler = backend_of(ex).scaler
        assert scaler.submitted == 3  # with backoff between them, then it told the user


def test_a_block_holding_a_task_is_never_cancelled_as_idle(settings: Settings) -> None:
    with Executor(settings=settings.replace(max_idle=1.0, max_blocks=1)) as ex:
        scaler = backend_of(ex).scaler
        assert ex.submit(node_of, 4).result(timeout=60).startswith("n")  # 4 s > max_idle
        assert scaler.cancelled == 0 and scaler.submitted == 1
        wait_for(lambda: scaler.cancelled == 1, 1 + 5 + 1, "the idle block to go")


def test_a_two_node_block_has_a_manager_on_each_node(settings: Settings) -> None:
    s = settings.replace(nodes_per_block=2, exclusive=True, init_blocks=1, min_blocks=1)
    with Executor(settings=s) as ex:
        backend = backend_of(ex)
        wait_for(lambda: len(backend.agent.remote_managers()) == 2, 30, "two managers")
        managers = backend.agent.remote_managers()
        assert managers[0].block == managers[1].block  # one Slurm job, srun on each node
        nodes = set(ex.map(node_of, [0.2] * 16))
        assert nodes == {m.node for m in managers} and len(nodes) == 2


def test_blocks_pending_in_the_queue_are_capacity_not_lost(settings: Settings) -> None:
    # 5 whole-node blocks on 4 nodes: one waits in Slurm's queue
    s = settings.replace(exclusive=True, init_blocks=5, min_blocks=5, max_blocks=5)
    with Executor(settings=s) as ex:
        backend = backend_of(ex)
        wait_for(lambda: len(backend.agent.remote_managers()) == 4, 30, "four managers")
        assert sum(ex.map(abs, range(-100, 0))) == 5050
        time.sleep(2.5)  # a status period: the fifth is seen pending
        blocks = backend.scaler.statistics()["blocks"]
        assert sorted(b["state"] for b in blocks) == ["pending"] + ["running"] * 4
        assert backend.scaler.submitted == 5 and backend.scaler.cancelled == 0
        assert not backend.agent.lost and backend.scaler.error == ""


def holders_here() -> tuple[int, list[str]]:
    """The pid of this worker's manager and who holds this runtime's data on this node."""
    from nimbus.data import default_root
    from nimbus.data._node import HOLDERS

    return os.getppid(), [mark.name for mark in (default_root() / HOLDERS).iterdir()]


def test_a_slurm_blocks_manager_holds_and_sweeps_its_nodes_data(settings: Settings) -> None:
    """Its manager holds the runtime's data directory on its node while it runs (and so
    sweeps the node's expired objects and unused file copies, as the agent does on its
    own: ``nimbus.data.Sweeper``); the mark goes with the block."""
    with Executor(settings=settings) as ex:
        manager, holders = ex.submit(holders_here).result(timeout=60)
        assert any(mark.startswith(f"{manager}-") for mark in holders), (manager, holders)
        assert manager != os.getpid()  # a block's manager, not this agent


def staged_here(path: Any) -> tuple[str, str, int, str]:
    """Which node (its data directory's runtime) ran it, and the staged file it got."""
    import hashlib

    time.sleep(0.5)  # the other node's worker takes the next task
    body = path.read_bytes()
    return os.environ["NIMBUS_RUNTIME_DIR"], str(path), len(body), hashlib.sha256(body).hexdigest()


def test_a_file_staged_to_one_node_is_fetched_by_tasks_on_the_other_nodes(
    settings: Settings, tmp_path: Any
) -> None:
    """A file sent endpoint to endpoint lands in the cache of the one node whose task
    offered to take it; tasks that run on the endpoint's other nodes fetch it from that
    node's manager (``nimbus.data._serve``). Each block here has a data directory of its
    own (as separate machines have: ``/dev/shm`` is per machine)."""
    import hashlib

    from nimbus.data._direct import _send, offer
    from nimbus.data._file import Staged
    from nimbus.data._ref import Ref, new_id

    s = settings.replace(
        workers_per_node=1,
        init_blocks=2,
        min_blocks=2,
        max_blocks=2,
        exclusive=True,  # two nodes
        worker_init=f'export NIMBUS_RUNTIME_DIR="{tmp_path}/node-$NIMBUS_BLOCK_ID"',
    )
    body = os.urandom(3 * 1024 * 1024 + 11)
    (tmp_path / "run42.h5").write_bytes(body)
    with Executor(settings=s) as ex:
        backend = backend_of(ex)
        wait_for(lambda: len(backend.agent.remote_managers()) == 2, 60, "two managers")
        # what nimbus.data._staging._direct does, with this process as the source endpoint
        where = ex._path.open()
        key = "f" * 32
        name, pin = f"{key}-run42.h5", key + new_id()
        answer = ex._path.call(offer, "file", name, time.time() + 300, pin).result(60)
        host, port, secret, holder = answer
        assert holder is not None, "the node that took the copy serves no cache"
        size, sha = _send(tmp_path / "run42.h5", host, port, secret, None)
        held = where.adopt(Ref(pin, where.namespace, where.user, where.endpoint, 0))
        staged = Staged((), key, "run42.h5", size, sha, held, tuple(holder))
        futures = [ex.submit(staged_here, staged) for _ in range(8)]
        results = [f.result(timeout=120) for f in futures]
    nodes = {node for node, _, _, _ in results}
    assert len(nodes) == 2, results  # tasks ran on both nodes
    assert {(size, digest) for _, _, size, digest in results} == {
        (len(body), hashlib.sha256(body).hexdigest())
    }
    from nimbus.data import default_root

    for node, path, _, _ in results:  # each in its own node's cache
        assert path.startswith(f"{default_root(node)}/") and path.endswith(f"/files/{name}")


def remote_staged_here(path: Any) -> tuple[str, str, int, str]:  # sent by value
    import hashlib
    import os
    import time

    time.sleep(0.5)
    body = path.read_bytes()
    return os.environ["NIMBUS_RUNTIME_DIR"], str(path), len(body), hashlib.sha256(body).hexdigest()


@contextlib.contextmanager
def vault_and_two_nodes(
    service: Any, alice: Any, slurm: Any, tmp_path: Path, vault_name: str, hpc_name: str
) -> Iterator[Any]:
    """Endpoint ``vault_name`` exporting ``tmp_path/exported`` and endpoint ``hpc_name``
    of two Slurm nodes, one worker each, each its own data directory (as separate
    machines): both started (vault's ``EndpointProcess`` given); stopped after."""
    import dataclasses

    from service_support import EndpointProcess

    vault = EndpointProcess(service, alice, vault_name)
    vault.config = dataclasses.replace(vault.config, exports=str(tmp_path / "exported"))
    old = dict(os.environ)
    os.environ["XDG_CONFIG_HOME"] = service.env["XDG_CONFIG_HOME"]
    try:
        vault.config.save()
    finally:
        os.environ.clear()
        os.environ.update(old)
    try:
        vault.start(alice)
        with two_nodes(service, alice, slurm, tmp_path, hpc_name):
            yield vault
    finally:
        vault.stop()


@contextlib.contextmanager
def two_nodes(service: Any, alice: Any, slurm: Any, tmp_path: Path, name: str) -> Iterator[Any]:
    """Endpoint ``name`` of two Slurm nodes, one worker each, each its own data directory
    (as separate machines): started, stopped after."""
    from service_support import slurm_endpoint

    hpc = slurm_endpoint(
        service,
        alice,
        name,
        slurm,
        workers_per_node=1,
        init_blocks=2,
        min_blocks=2,
        max_blocks=2,
        exclusive=True,
        max_idle=60.0,
        worker_init=f'export NIMBUS_RUNTIME_DIR="{tmp_path}/node-$NIMBUS_BLOCK_ID"',
    )
    try:
        hpc.start(alice)
        yield hpc
    finally:
        hpc.stop()
        del service.env["SLURM_CONF"]


def test_a_file_of_another_endpoint_reaches_tasks_on_every_node_of_a_slurm_endpoint(
    service: Any, alice: Any, slurm: Any, tmp_path: Any
) -> None:
    """``nimbus.File("vault:...")`` used by tasks of an endpoint of two Slurm nodes (each
    its own data directory, as separate machines): vault sends it to the one node whose
    task offered to take it; the tasks on the other node fetch it from that node."""
    import hashlib

    import nimbus
    from nimbus.data import default_root

    exported = tmp_path / "exported"
    exported.mkdir()
    body = os.urandom(2 * 1024 * 1024 + 3)
    (exported / "run42.h5").write_bytes(body)
    with (
        vault_and_two_nodes(service, alice, slurm, tmp_path, "vault-nodes", "hpc-nodes"),
        Executor(endpoint="hpc-nodes", settings=service.user_settings(alice.token)) as ex,
    ):
        file = nimbus.File(f"vault-nodes:{exported}/run42.h5")
        futures = [ex.submit(remote_staged_here, file) for _ in range(8)]
        results = [f.result(timeout=180) for f in futures]
    assert len({node for node, _, _, _ in results}) == 2, results  # both nodes ran tasks
    assert {(size, digest) for _, _, size, digest in results} == {
        (len(body), hashlib.sha256(body).hexdigest())
    }
    for node, path, _, _ in results:  # each in its own node's cache
        assert path.startswith(f"{default_root(node)}/") and path.endswith("-run42.h5")


def busy_if_holding(pin: str, seconds: float) -> bool:  # sent by value
    import time

    from nimbus.data import default_root

    if not any(default_root().glob(f"*/obj/{pin}")):
        return False
    time.sleep(seconds)
    return True


def test_a_staged_files_pin_is_renewed_on_its_node_whichever_node_runs_the_renewal(
    service: Any, alice: Any, slurm: Any, tmp_path: Any
) -> None:
    """The client renews a staged copy's pin with an ordinary task, which either node of
    the endpoint runs: one on the other node forwards it to the holding node's server.
    With a lease of 3 s for 15 s (five leases) while the holding node's only worker is
    busy (so the renewals run on the other node), the pin stays leased on its node, and a
    task on the other node whose cache lost the copy fetches it from there again."""
    import hashlib

    import nimbus
    from nimbus.data import default_root

    exported = tmp_path / "exported"
    exported.mkdir()
    body = os.urandom(1024 * 1024 + 7)
    (exported / "run7.h5").write_bytes(body)
    lease = 3.0
    with (
        vault_and_two_nodes(service, alice, slurm, tmp_path, "vault-lease", "hpc-lease"),
        Executor(endpoint="hpc-lease", settings=service.user_settings(alice.token)) as ex,
    ):
        where = ex._path.open()
        where.lease = lease  # renewed every second, by a task on either node
        file = nimbus.File(f"vault-lease:{exported}/run7.h5")
        first = [
            f.result(timeout=180) for f in [ex.submit(remote_staged_here, file) for _ in range(8)]
        ]
        nodes = {node for node, _, _, _ in first}
        assert len(nodes) == 2, first
        objects = [default_root(node) / where.namespace / "obj" for node in nodes]
        pins = [p for o in objects for p in o.iterdir() if len(p.name) == 64]
        assert len(pins) == 1, pins  # on the node that took the copy
        (pin,) = pins
        # the holding node's only worker kept busy: renewals run on the other node
        busy = [ex.submit(busy_if_holding, pin.name, 5 * lease + 1) for _ in range(2)]
        time.sleep(1.0)
        started = time.monotonic()
        seen = []
        while time.monotonic() - started < 5 * lease:
            mtime = pin.stat().st_mtime if pin.exists() else 0.0  # 0: swept (ran out)
            seen.append((time.time(), mtime))
            time.sleep(0.25)
        assert sorted(f.result(timeout=60) for f in busy) == [False, True]
        late = [(round(t - seen[0][0], 2), round(m - t, 2)) for t, m in seen if m <= t]
        assert not late, f"the pin's lease ran out on its node at {late}"
        for _, path, _, _ in first:  # the other node's cache loses its fetched copy
            if not path.startswith(str(pin.parent.parent.parent)):
                Path(path).unlink(missing_ok=True)
        later = [
            f.result(timeout=180) for f in [ex.submit(remote_staged_here, file) for _ in range(8)]
        ]
    assert len({node for node, _, _, _ in later}) == 2, later
    digest = hashlib.sha256(body).hexdigest()
    assert {(n, d) for _, _, n, d in first + later} == {(len(body), digest)}


def made_late(size: int, seconds: float) -> bytes:  # sent by value
    import time

    time.sleep(seconds)
    return bytes(range(256)) * (size // 256) + b"end"


def relayed_on_node(value: bytes) -> tuple[str, int, str]:  # sent by value
    import hashlib
    import os
    import time

    time.sleep(0.3)
    return os.environ["NIMBUS_RUNTIME_DIR"], len(value), hashlib.sha256(value).hexdigest()


@pytest.mark.timeout(600)
def test_a_relayed_object_reaches_tasks_on_every_node_of_a_slurm_endpoint(
    service: Any, alice: Any, slurm: Any, tmp_path: Any
) -> None:
    """A kept future of vault, not done, passed to tasks of an endpoint of two Slurm
    nodes (each its own data directory, as separate machines): the relay sends the
    object to the one node that expected it, and the tasks on the other node fetch it
    from that node (its pin's secret, sha256 checked) instead of failing with
    ``ReferenceLost``; once its Refs are gone, the pin and the object go on the holder."""
    import gc
    import hashlib

    from nimbus.data import default_root

    (tmp_path / "exported").mkdir()
    size = 2 * 1024 * 1024
    body = bytes(range(256)) * (size // 256) + b"end"
    settings = service.user_settings(alice.token)
    with (
        vault_and_two_nodes(service, alice, slurm, tmp_path, "vault-relay", "hpc-relay"),
        Executor(endpoint="vault-relay", settings=settings) as on_vault,
        Executor(endpoint="hpc-relay", settings=settings) as ex,
    ):
        namespace = ex._path.open().namespace
        made = on_vault.options(keep=True).submit(made_late, size, 3.0)
        takers = [ex.submit(relayed_on_node, made) for _ in range(8)]
        results = [f.result(timeout=180) for f in takers]
        assert len({node for node, _, _ in results}) == 2, results  # both nodes ran tasks
        assert {(n, d) for _, n, d in results} == {(len(body), hashlib.sha256(body).hexdigest())}
        objects = [default_root(node) / namespace / "obj" for node, _, _ in results]
        pins = {p for o in set(objects) for p in o.iterdir() if len(p.name) == 64}
        assert len(pins) == 1, pins  # held on the node the relay sent it to, while used
        (pin,) = pins
        assert (pin.parent / pin.name[:32]).stat().st_size >= len(body)
        del takers, made
        gc.collect()
        wait_for(lambda: not pin.exists(), 30, "the pin freed on its node")
        assert not (pin.parent / pin.name[:32]).exists()  # the relayed object with it


@pytest.mark.timeout(600)
def test_a_kept_result_or_put_object_reaches_tasks_on_every_node_of_a_slurm_endpoint(
    service: Any, alice: Any, slurm: Any, tmp_path: Any
) -> None:
    """A kept result and an object placed with ``nimbus.put`` stay on the node of an
    endpoint of two Slurm nodes (each its own data directory, as separate machines) that
    made them; tasks that take them on the other node fetch them from that node (a pin's
    secret, sha256 checked) instead of failing with ``ReferenceLost``: taken once done,
    and taken before (the service holds the task until its input is made). Once their
    Refs are gone, the pins and the objects go on the holder."""
    import gc
    import hashlib

    import nimbus
    from nimbus.data import default_root

    size = 768 * 1024  # (nimbus.put sends it through the service: NIMBUS_MAX_PAYLOAD)
    body = bytes(range(256)) * (size // 256) + b"end"
    digest = hashlib.sha256(body).hexdigest()
    with (
        two_nodes(service, alice, slurm, tmp_path, "hpc-kept"),
        Executor(endpoint="hpc-kept", settings=service.user_settings(alice.token)) as ex,
    ):
        namespace = ex._path.open().namespace
        kept = ex.options(keep=True).submit(made_late, size, 0.0)
        placed = nimbus.put(body, endpoint="hpc-kept")
        kept.ref(timeout=120)
        takers = [ex.submit(relayed_on_node, kept) for _ in range(8)]
        takers += [ex.submit(relayed_on_node, placed) for _ in range(8)]
        ahead = ex.options(keep=True).submit(made_late, size, 2.0)  # taken before made
        takers += [ex.submit(relayed_on_node, ahead) for _ in range(8)]
        results = [f.result(timeout=180) for f in takers]
        assert {(n, d) for _, n, d in results} == {(len(body), digest)}
        for part in (results[:8], results[8:16], results[16:]):
            assert len({node for node, _, _ in part}) == 2, results  # both nodes ran tasks
        for _ in range(4):  # read by a task on either node
            assert kept.result(timeout=60) == body and placed.get(timeout=60) == body
        objects = {default_root(node) / namespace / "obj" for node, _, _ in results}
        pins = {p for o in objects for p in o.iterdir() if len(p.name) == 64}
        assert {p.name[:32] for p in pins} == {kept.ref().id, placed.id, ahead.ref().id}
        del takers, kept, placed, ahead
        gc.collect()
        wait_for(lambda: not any(p.exists() for p in pins), 30, "the pins freed on their node")
        assert not any((p.parent / p.name[:32]).exists() for p in pins)  # the objects too


@pytest.mark.timeout(600)
def test_a_kept_result_of_one_node_is_copied_to_another_endpoint_from_any_node(
    service: Any, alice: Any, slurm: Any, tmp_path: Any
) -> None:
    """A kept result (done) of an endpoint of two Slurm nodes passed to a task of another
    endpoint: the task that sends it there runs on the node that does not hold it (the
    holder's only worker kept busy) and fetches it from the holder first."""
    import hashlib

    (tmp_path / "exported").mkdir()
    size = 1024 * 1024
    body = bytes(range(256)) * (size // 256) + b"end"
    settings = service.user_settings(alice.token)
    with (
        vault_and_two_nodes(service, alice, slurm, tmp_path, "vault-copy", "hpc-copy"),
        Executor(endpoint="vault-copy", settings=settings) as on_vault,
        Executor(endpoint="hpc-copy", settings=settings) as ex,
    ):
        up = [ex.submit(relayed_on_node, b"") for _ in range(8)]  # both nodes' workers up
        assert len({f.result(timeout=120)[0] for f in up}) == 2
        kept = ex.options(keep=True).submit(made_late, size, 0.0)
        ref_id = kept.ref(timeout=120).id
        busy = [ex.submit(busy_if_holding, ref_id, 8.0) for _ in range(2)]
        time.sleep(1.0)  # the holder's worker busy: the send runs on the other node
        taken = on_vault.submit(relayed_on_node, kept)
        _, n, digest = taken.result(timeout=120)
        assert (n, digest) == (len(body), hashlib.sha256(body).hexdigest())
        assert sorted(f.result(timeout=60) for f in busy) == [False, True]


def staged_on_node(path: Any, *_: Any) -> tuple[str, str, int, str]:  # sent by value
    import hashlib
    import os
    import time

    time.sleep(0.3)
    body = path.read_bytes()
    return os.environ["NIMBUS_RUNTIME_DIR"], str(path), len(body), hashlib.sha256(body).hexdigest()


def holding_node(namespace: str) -> tuple[Path, int]:
    """The data directory of the live node holding a staged copy's pin (of this test's
    user, ``namespace``), and the pid of the process serving it (its block's manager)."""
    from nimbus.data._node import data_base

    found = []
    for space in data_base().glob(f"r*/{namespace}"):
        root = space.parent
        pids = [int(p.read_text().split()[2]) for p in root.glob(".server-*")]
        live = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
        if live and any(len(p.name) == 64 for p in (root / namespace / "obj").glob("*")):
            found.append((root, live[0]))
    assert len(found) == 1, found
    return found[0]


def stop_holder(namespace: str, results: list[Any]) -> Path:
    """The node holding the staged copy stopped (its manager killed by pid), the copies
    fetched by the other nodes removed (as if they had not fetched it before): the
    holder's data directory."""
    import signal

    root, pid = holding_node(namespace)
    for _, path, _, _ in results:
        if not path.startswith(f"{root}/"):
            Path(path).unlink(missing_ok=True)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), 10, "the holder's manager to die")
    time.sleep(1.0)  # its agent saw its link close: no task goes to it
    return root


@pytest.mark.timeout(600)
def test_a_staged_file_whose_holding_node_left_is_staged_again_for_its_tasks(
    service: Any, alice: Any, slurm: Any, tmp_path: Any
) -> None:
    """The node that took a copy sent endpoint to endpoint stops (its block's manager
    killed) before the endpoint's other nodes fetched it: their tasks find it gone
    (``ReferenceLost`` naming its pin) and the client stages the file again from its
    endpoint and sends them again: they run. With its endpoint stopped too, no source
    is left: the tasks fail with the staging's error, naming it, never a hang."""
    import concurrent.futures as cf
    import hashlib

    import nimbus
    from nimbus.data._staging import _cache
    from nimbus.errors import DataError

    exported = tmp_path / "exported"
    exported.mkdir()
    body = os.urandom(1024 * 1024 + 5)
    (exported / "run9.h5").write_bytes(body)
    digest = hashlib.sha256(body).hexdigest()
    with (
        vault_and_two_nodes(service, alice, slurm, tmp_path, "vault-gone", "hpc-gone") as vault,
        Executor(endpoint="hpc-gone", settings=service.user_settings(alice.token)) as ex,
    ):
        namespace = ex._path.open().namespace
        file = nimbus.File(f"vault-gone:{exported}/run9.h5")
        first = [f.result(timeout=180) for f in [ex.submit(staged_on_node, file) for _ in range(8)]]
        assert len({node for node, _, _, _ in first}) == 2, first
        (key,) = [k for k in _cache if k[2] == str(exported / "run9.h5")]
        old_pin = _cache[key].result().pin
        gone = stop_holder(namespace, first)
        started = time.monotonic()
        later = [f.result(timeout=180) for f in [ex.submit(staged_on_node, file) for _ in range(8)]]
        took = time.monotonic() - started
        assert {(n, d) for _, _, n, d in later} == {(len(body), digest)}
        assert not any(path.startswith(f"{gone}/") for _, path, _, _ in later)
        new_pin = _cache[key].result().pin  # staged again (not by a renewal: 100 s apart)
        assert old_pin is not None and new_pin is not None and new_pin.id != old_pin.id
        assert took < 120, took
        # no source left: tasks submitted (staged: the copy is there), then the file's
        # endpoint stopped and the new copy's node too, then the tasks sent (the gate)
        gate: cf.Future[None] = cf.Future()
        failing = [ex.submit(staged_on_node, file, gate) for _ in range(4)]
        vault.stop()
        wait_for(lambda: not alice.get_endpoint(vault.endpoint_id)["online"], 60, "vault offline")
        stop_holder(namespace, later)
        started = time.monotonic()
        gate.set_result(None)
        for future in failing:
            with pytest.raises(DataError, match="offline"):
                future.result(timeout=120)
        assert time.monotonic() - started < 120
