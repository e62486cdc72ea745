"""An Executor's tasks are instances of one program: they message each other (issue 21).

Real workers, a real embedded Redis, real sockets; no mocks. Each test's Executor is
shut down by the test (its workers stopped with it).
"""

from __future__ import annotations

import atexit
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing import util
from pathlib import Path
from typing import Any

import pytest

import nimbus.data
import nimbus.messaging as msg
from nimbus import Executor, _joined, statestore
from nimbus.errors import PeerExited, StateStoreError

TOKEN_ENV = "NIMBUS_MESSAGING_TOKEN"
SRC = str(Path(__file__).resolve().parents[1] / "src")


# -- task functions (importable by the workers: tests/ is on their sys.path) --
def swap_halves(i: int, client: str) -> list[int]:
    """Tell the client who I am, learn my peer from it, swap halves with the peer."""
    msg.send(client, (i, msg.instance_id()))
    peers = msg.recv(client, timeout=10)
    other = peers[1 - i]
    half = list(range(i * 50, i * 50 + 50))
    msg.send(other, half)
    return sorted(half + msg.recv(other, timeout=10))


def where_am_i(fail: bool = False) -> tuple[int, str, str | None, str]:
    """This worker's pid, the task's program, the token in the environment, an instance id."""
    prog = statestore.current()
    token = os.environ.get(TOKEN_ENV)
    me = msg.instance_id()
    if fail:
        raise ValueError(me)
    return os.getpid(), prog.program_id if prog else "", token, me


def exit_counts() -> tuple[int, int, int]:
    """This worker's pid, its atexit callbacks and its multiprocessing finalizers, after
    the task made an instance."""
    msg.instance_id()
    return os.getpid(), atexit._ncallbacks(), len(util._finalizer_registry)  # type: ignore[attr-defined]


def break_leaving() -> int:
    """A task whose program cannot be left: a hook of it fails when it ends."""

    def broken(prog: statestore.Program) -> None:
        raise OSError(f"cannot let go of {prog.program_id}")

    statestore.on_leave(broken)
    return os.getpid()


def pair_up(i: int) -> tuple[int, list[int]]:
    """Two tasks find each other through their program's store (the client never used it)
    and swap halves; this worker's pid and the result."""
    prog = statestore.current()
    assert prog is not None
    store, key = prog.client(), f"nimbus:{{{prog.program_id}}}:test:ids"
    me = msg.instance_id()
    store.rpush(key, me)
    deadline = time.monotonic() + 10
    while store.llen(key) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    (other,) = {found.decode() for found in store.lrange(key, 0, -1)} - {me}
    half = list(range(i * 50, i * 50 + 50))
    msg.send(other, half)
    return os.getpid(), sorted(half + msg.recv(other, timeout=10))


def node_kv() -> str:
    """``nimbus.data.store()`` in a task: a value set and read back, and which store."""
    import nimbus.data

    kv = nimbus.data.store()
    kv.set("k", 1)
    return f"{kv.get('k')} {kv!r}"


def plain(x: int) -> int:
    return x + 1


def exchange(backend: str) -> tuple[list[list[int]], float]:
    """Two tasks of one map swap halves through the client's rendezvous; their results
    and the seconds it took."""
    began = time.monotonic()
    with Executor(2, backend=backend) as ex:
        client = msg.instance_id()
        futures = ex.map(swap_halves, range(2), [client] * 2)
        ids = dict(msg.recv(timeout=10) for _ in range(2))
        for task_id in ids.values():
            msg.send(task_id, ids)
        results = list(futures)
    return results, time.monotonic() - began


@pytest.mark.parametrize("backend", ["local", "forked"])
def test_two_tasks_of_a_map_exchange_halves_through_messaging(backend: str) -> None:
    results, seconds = exchange(backend)
    assert results == [list(range(100))] * 2
    assert seconds < 5.0


def test_a_worker_keeps_nothing_of_a_messaging_task_for_the_next() -> None:
    with Executor(1) as ex:
        pid, program_id, token, first = ex.submit(where_am_i).result()
        assert program_id == statestore.program().program_id  # the client's
        with pytest.raises(ValueError) as failed:
            ex.submit(where_am_i, fail=True).result()
        second = str(failed.value)
        pid2, program_id2, token2, third = ex.submit(where_am_i).result()
    assert pid2 == pid  # one warm worker ran the three
    assert program_id2 == program_id
    # the worker may have the client's token from its environment (of this program)
    assert token is None or token.startswith(program_id + ":")
    assert token2 is None  # each task's instance took its token away
    assert len({first, second, third}) == 3
    for gone in (first, second, third):  # each said goodbye as its task ended
        with pytest.raises(PeerExited):
            for _ in range(100):  # a send after a send is queued: a later one raises (the
                msg.send(gone, "anyone there?")  # first did not, 2 in 11 runs under load)
                time.sleep(0.1)


def test_a_worker_that_cannot_leave_a_program_retires_after_the_result() -> None:
    with Executor(1) as ex:
        broke = ex.submit(break_leaving).result(timeout=60)  # its result still comes
        after = ex.submit(os.getpid).result(timeout=60)
    assert after != broke  # its manager started another worker for the next task


def test_a_task_leaves_its_program_behind_it() -> None:
    prog = statestore.Program("unix:///nowhere/redis.sock", "p-" + "0" * 32, 30.0)
    before = statestore.current()
    joined = _joined.join(prog.row())
    try:
        assert statestore.current() == prog
        assert statestore.program() == prog
        assert not statestore.is_root()
    finally:
        _joined.leave(joined)
    assert statestore.current() == before
    assert statestore.is_root()
    refused = _joined.join("no store for you: because")
    try:
        assert statestore.current() is None
        with pytest.raises(StateStoreError, match="because"):
            statestore.program()
    finally:
        _joined.leave(refused)
    assert statestore.current() == before


def test_a_row_of_a_client_before_program_endpoint_joins_as_no_endpoints() -> None:
    """A client of the nimbus before ``Program.endpoint`` sends rows of 6 fields: its tasks
    join its program (no endpoint: store() is the node's), where unpacking them raised
    ValueError (not enough values to unpack) in each task using the store."""
    row = pickle.dumps(("unix:///nowhere/redis.sock", "p-" + "1" * 32, 30.0, False, 0, 0.0), 5)
    joined = _joined.join(row)
    try:
        prog = statestore.current()
        assert prog is not None and prog.program_id == "p-" + "1" * 32 and prog.endpoint == ""
    finally:
        _joined.leave(joined)


def test_a_thousand_messaging_tasks_leave_no_exit_handlers_behind() -> None:
    with Executor(1) as ex:
        counts = [f.result() for f in [ex.submit(exit_counts) for _ in range(1000)]]
    assert len({pid for pid, _, _ in counts}) == 1
    assert {count[1:] for count in counts} == {counts[0][1:]}  # flat


def test_plain_tasks_start_no_store(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import os, sys
        sys.path.insert(0, sys.argv[1])
        from nimbus import Executor, statestore
        from test_executor_messaging import plain
        with Executor(2) as ex:
            assert list(ex.map(plain, range(100))) == list(range(1, 101))
        url = statestore.program().url
        assert url.startswith("unix://"), url
        print(os.path.exists(url[len("unix://"):]))
        """
    )
    env = os.environ | {"NIMBUS_RUNTIME_DIR": str(tmp_path), "PYTHONPATH": SRC}
    env.pop("NIMBUS_REDIS_URL", None)
    done = subprocess.run(
        [sys.executable, "-c", script, str(Path(__file__).parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"  # no redis-server made its socket


# ---------------------------------------------------------------- on an endpoint


def left_behind() -> dict[str, object]:
    """What a task on an endpoint finds of earlier tasks in its worker, then its own."""
    from nimbus.statestore import _connect, _program

    cached = _program._joined  # (before this task's program replaces it)
    prog = statestore.current()
    found = {
        "cached": cached[1].url if cached is not None else None,
        "pid": os.getpid(),
        "token": os.environ.get(TOKEN_ENV),
        "clients": sorted(url for _, url in _connect._clients),
        "url": prog.url if prog is not None else None,
        "program_id": prog.program_id if prog is not None else None,
    }
    found["id"] = msg.instance_id()
    kv = nimbus.data.store()  # (after "clients": it connects to this task's store)
    found["kv"] = sorted(kv)
    kv.set(f"left-by-{os.getpid()}", found["program_id"], ttl=60)
    return found


def reach_kv(program_id: str) -> str:
    """Try to read the key-value store of another user (``program_id``'s) on this endpoint
    through this task's store."""
    from nimbus.data import EndpointKeyValue
    from nimbus.errors import DataError

    prog = statestore.current()
    assert prog is not None and prog.endpoint
    theirs = statestore.Keys(f"{program_id.rpartition('.')[0]}.kv-{prog.endpoint}")
    try:
        return f"reached: {list(EndpointKeyValue(prog.client(), theirs, prog.endpoint))}"
    except DataError as exc:
        return f"refused: {exc}"


def reach(program_id: str) -> str:
    """Try to message in another program of this task's store (another user's)."""
    prog = statestore.current()
    assert prog is not None
    other = statestore.Program(prog.url, program_id, prog.key_ttl, remote=True)
    try:
        msg.instance_for(other).close()
    except StateStoreError as exc:
        return f"refused: {exc}"
    return "reached"


def endpoint_exchange(ex: Executor) -> list[list[int]]:
    client = ex.messaging()
    futures = ex.map(swap_halves, range(2), [client.id] * 2)
    ids = dict(client.recv(timeout=30) for _ in range(2))
    for task_id in ids.values():
        client.send(task_id, ids)
    return list(futures)


def test_two_tasks_on_an_endpoint_exchange_halves(service: Any, alice: Any, lab: Any) -> None:
    settings = service.user_settings(alice.token)
    with Executor(2, endpoint="lab", settings=settings) as ex:
        ex.submit(plain, 0).result(timeout=60)  # (the workers warm)
        began = time.monotonic()
        assert endpoint_exchange(ex) == [list(range(100))] * 2
        seconds = time.monotonic() - began
        prog = ex.messaging()
        program = ex._backend.program.program()
        program_id = program.program_id
    assert seconds < 5.0
    assert program_id.startswith("u-")  # under alice's prefix, in the service's store
    keys = program.keys.pattern()
    with service.client(alice.token) as again:  # its keys went with the executor
        handed = again.store("lab")
    import redis

    with redis.Redis.from_url(handed["url"]) as client:
        assert list(client.scan_iter(match=keys)) == []
    del prog


def later_where(seconds: float) -> tuple[int, str, str | None, str]:
    time.sleep(seconds)
    return where_am_i()


def test_shutdown_without_waiting_lets_an_endpoints_tasks_finish(
    service: Any, alice: Any, lab: Any
) -> None:
    """As the stdlib's: ``shutdown(wait=False)`` returns at once and the pending futures
    still complete. An endpoint Executor's never did (its connection to the service
    closed at once), and its program's keys went under its running tasks."""
    ex = Executor(2, endpoint="lab", settings=service.user_settings(alice.token))
    ex.submit(plain, 0).result(timeout=60)  # (the workers warm)
    futures = [ex.submit(later_where, 1.0) for _ in range(3)]  # one waits for a worker
    began = time.monotonic()
    ex.shutdown(wait=False)
    assert time.monotonic() - began < 0.5
    with pytest.raises(RuntimeError, match="shutdown"):
        ex.submit(plain, 1)
    program = ex._backend.program.program()
    assert [f.result(timeout=30)[1] for f in futures] == [program.program_id] * 3
    ex.shutdown(wait=True)  # (waits for the thread that ends it)
    assert not any(t.name == "nimbus-shutdown" for t in threading.enumerate())
    with service.client(alice.token) as again:
        handed = again.store("lab")
    import redis

    with redis.Redis.from_url(handed["url"]) as client:  # its keys went after the tasks
        assert list(client.scan_iter(match=program.keys.pattern())) == []


def test_the_next_user_on_a_shared_worker_finds_nothing_of_the_last(
    service: Any, alice: Any
) -> None:
    from service_support import EndpointProcess

    solo = EndpointProcess(service, alice, "solo", workers=1).start(alice)
    try:
        bob_token = service.token("bob")
        alice.share_endpoint(solo.endpoint_id, ["bob"])
        with Executor(1, endpoint="solo", settings=service.user_settings(alice.token)) as ex:
            hers = ex.submit(left_behind).result(timeout=60)
        with Executor(
            1, endpoint=solo.endpoint_id, settings=service.user_settings(bob_token)
        ) as ex:
            his = ex.submit(left_behind).result(timeout=60)
            refused = ex.submit(reach, hers["program_id"]).result(timeout=60)
            refused_kv = ex.submit(reach_kv, hers["program_id"]).result(timeout=60)
    finally:
        solo.stop()
    assert his["pid"] == hers["pid"]  # one worker ran both
    assert hers["url"] and his["url"] and his["url"] != hers["url"]
    assert his["token"] is None
    assert hers["url"] not in his["clients"]
    assert his["cached"] is None  # (her URL holds her store's password)
    assert str(his["program_id"]).split(".")[0] != str(hers["program_id"]).split(".")[0]
    assert refused.startswith("refused:")
    # nimbus.data.store(): each user's own keys on solo, whichever worker; hers refused
    assert hers["kv"] == [] and his["kv"] == []
    assert refused_kv.startswith("refused:") and "no permissions" in refused_kv, refused_kv


def test_without_a_store_plain_tasks_run_and_messaging_ones_say_why(tmp_path: Path) -> None:
    from service_support import EndpointProcess, Service, service_env

    # a service told to listen for stores on an address not this machine's: no store
    svc = Service(tmp_path, service_env(tmp_path, NIMBUS_STORE_LISTEN="192.0.2.1:0")).start()
    try:
        token = svc.token("carol")
        with svc.client(token) as carol:
            far = EndpointProcess(svc, carol, "far").start(carol)
            try:
                with Executor(2, endpoint="far", settings=svc.user_settings(token)) as ex:
                    assert list(ex.map(plain, range(4))) == [1, 2, 3, 4]
                    said = ex.submit(node_kv).result(timeout=60)  # the node's, as it can
                    assert said.startswith("1 <nimbus.data.store of ") and " at /" in said
                    with pytest.raises(StateStoreError, match="NIMBUS_STORE_LISTEN"):
                        ex.submit(where_am_i).result(timeout=60)
                    with pytest.raises(StateStoreError, match="NIMBUS_STORE_LISTEN"):
                        ex.messaging()
                    with pytest.raises(StateStoreError, match="NIMBUS_STORE_LISTEN"):
                        ex.store()  # (its tasks' keys are on the node: out of reach)
            finally:
                far.stop()
    finally:
        svc.stop()


@pytest.mark.parametrize("backend", ["local", "forked"])
def test_tasks_start_their_programs_store_when_the_client_never_did(
    tmp_path: Path, backend: str
) -> None:
    script = textwrap.dedent(
        """
        import json, sys
        sys.path.insert(0, sys.argv[1])
        from nimbus import Executor
        from test_executor_messaging import pair_up
        with Executor(2, backend=sys.argv[3]) as ex:
            results = list(ex.map(pair_up, range(2)))
        assert [r for _, r in results] == [list(range(100))] * 2, results
        assert results[0][0] != results[1][0]  # two workers
        print(json.dumps([str(p) for p in __import__("pathlib").Path(sys.argv[2]).glob("redis-*.json")]))
        """
    )
    env = os.environ | {"NIMBUS_RUNTIME_DIR": str(tmp_path), "PYTHONPATH": SRC}
    env.pop("NIMBUS_REDIS_URL", None)
    done = subprocess.run(
        [sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path), backend],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    # the client started its store when a worker asked (one a worker started would have
    # ended with that worker's cgroup); it stopped with the client
    deadline = time.monotonic() + 10
    while list(tmp_path.glob("redis-*.sock")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list(tmp_path.glob("redis-*.sock"))


def socket_dirs() -> tuple[str, list[str]]:
    """This task's instance id, and the socket directories in its worker's runtime dir."""
    from nimbus.config import Settings

    me = msg.instance_id()
    return me, sorted(p.name for p in Settings.load().ensure_runtime_dir().glob("m-*"))


def test_no_socket_directory_of_an_executors_program_stays_after_it(
    service: Any, alice: Any, lab: Any
) -> None:
    import hashlib

    settings = service.user_settings(alice.token)
    with Executor(2, endpoint="lab", settings=settings) as ex:
        ex.submit(socket_dirs).result(timeout=60)
        assert ex.messaging().id  # (the client an instance too)
        program_id = ex._backend.program.program().program_id
    with Executor(2, endpoint="lab", settings=settings) as ex:
        _, later = ex.submit(socket_dirs).result(timeout=60)
    # its directory's name (messaging._directory.socket_dir, which would make it here)
    gone = "m-" + hashlib.blake2b(program_id.encode(), digest_size=12).hexdigest()
    assert gone not in later, later  # the workers'
    assert not (settings.ensure_runtime_dir() / gone).exists()  # the client's (ex.messaging())


def _stores_redis(service: Any) -> int:
    """The pid of the service's stores Redis (the one it hands out)."""
    from service_support import service_redis

    return service_redis(service, stores=True)


def test_plain_tasks_do_not_wait_for_a_store_that_does_not_answer(
    service: Any, alice: Any, lab: Any
) -> None:
    import signal

    settings = service.user_settings(alice.token)
    with Executor(2, endpoint="lab", settings=settings) as ex:
        ex.submit(plain, 0).result(timeout=60)  # (the service has handed out its store)
    import threading

    pid = _stores_redis(service)
    os.kill(pid, signal.SIGSTOP)  # it takes connections and answers nothing
    resumed = threading.Timer(40, os.kill, (pid, signal.SIGCONT))  # (if the test hangs)
    resumed.start()
    try:
        with Executor(2, endpoint="lab", settings=settings) as ex:
            began = time.monotonic()
            assert ex.submit(plain, 1).result(timeout=60) == 2
            seconds = time.monotonic() - began
            with pytest.raises(StateStoreError, match="cannot reach the state store"):
                ex.messaging()  # (after the PING from here timed out)
            closing = time.monotonic()
        closed = time.monotonic() - closing  # its keys deleted: given a reply's timeout
    finally:
        resumed.cancel()
        os.kill(pid, signal.SIGCONT)
    assert seconds < 2.5  # not the 5 s a PING of the store waits (2026-11: 5.04 s)
    assert closed < 20  # not until the store answers again (2026-11: 40 s, the timer's)
