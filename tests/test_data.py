"""Data between functions (``nimbus.data``): references, kept results, the user's store.

On the real local runtime and on a real service on loopback with an endpoint.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import copy
import gc
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import nimbus
from nimbus import Client, Executor, serialization
from nimbus.data import NodeStore, Ref, Scope, Session, _carry, default_root, run, store
from nimbus.data._node import data_base, hold, release, sweep_all
from nimbus.data._serve import server_address
from nimbus.errors import (
    DataAccessError,
    DataError,
    InputFailed,
    PayloadTooLargeError,
    ReferenceLost,
    ServiceError,
)
from nimbus.protocol import MSGPACK, Batch, submit_row, unpack
from nimbus.service.app import SERVICE_ID
from nimbus.service.queues import TaskStore
from nimbus.service.registry import Registry
from nimbus.statestore import Keys, StateStore, connect, connect_async
from service_support import EndpointProcess, Service, free_port, service_env, two_services

MB = 1 << 20


def double(xs: list[int]) -> list[int]:
    return [x * 2 for x in xs]


def total(*parts: list[int]) -> int:
    return sum(sum(p) for p in parts)


def blob(i: int) -> bytes:
    return bytes([i % 256]) * MB


def small_blob(i: int) -> bytes:
    return bytes([i % 256]) * (MB // 4)


def mbytes(n: int) -> bytes:
    return os.urandom(n * MB)


def grow(b: bytes) -> bytes:
    return b + b"!"


def slow_double(xs: list[int]) -> list[int]:
    time.sleep(0.5)
    return double(xs)


def sizes(*blobs: bytes) -> list[int]:
    return [len(b) for b in blobs]


@nimbus.data.pure
def squares(n: int) -> list[int]:
    return [i * i for i in range(n)]


def fail(x: int) -> int:
    raise ValueError(f"no {x}")


def remember(key: str, value: int) -> int:
    s = store()
    s.set(key, value)
    return int(s.get(key)) + len(list(s.keys()))


def recall(key: str) -> object:
    return store().get(key, "missing")


@pytest.fixture(scope="module")
def ex() -> Iterator[Executor]:
    with Executor(2) as executor:
        yield executor


def _node() -> NodeStore:
    return nimbus.data.session(None).store  # type: ignore[return-value]


def on_endpoint(service: Service, namespace: str) -> NodeStore:
    """A user's store of the endpoints of ``service`` (their runtime: its runtime dir)."""
    return NodeStore(namespace, default_root(service.env["NIMBUS_RUNTIME_DIR"]))


# ---------------------------------------------------------------- the local runtime


def test_put_passes_one_object_to_many_tasks(ex: Executor) -> None:
    ref = nimbus.put(list(range(1000)))
    assert isinstance(ref, nimbus.Ref)
    assert [f.result() for f in [ex.submit(sum, ref) for _ in range(8)]] == [499500] * 8
    assert ex.submit(len, [ref, ref]).result() == 2  # in a list too
    assert ref.get() == list(range(1000))


def test_kept_results_feed_a_task_without_crossing_the_client(ex: Executor) -> None:
    before = ex.statistics()["bytes_received"]
    parts = ex.map(blob, range(8), keep=True)
    assert all(isinstance(p, nimbus.executor.KeptFuture) for p in parts)
    assert ex.submit(sizes, *parts).result() == [MB] * 8
    chained = ex.options(keep=True).submit(grow, parts[3])
    assert ex.submit(len, chained).result() == MB + 1
    # only references and the small results came back, not the 8 MB of the parts
    assert ex.statistics()["bytes_received"] - before < 64 * 1024
    assert parts[3].result() == bytes([3]) * MB  # fetched lazily, when asked
    assert isinstance(parts[3].ref(), Ref) and parts[3].ref().size > MB


def test_a_deferred_send_that_raises_fails_its_task_and_later_ones_are_still_sent(
    ex: Executor,
) -> None:
    """A task sent once its inputs are done goes from the path's sender thread; one whose
    send raised (a pure task made again after shutdown, an unpicklable argument) killed
    the thread, and every later dependent task was never sent: its client waited."""
    path = ex._path
    path.deferred(lambda: [][0])  # a send that raises (logged: no task to fail)
    first = ex.submit(slow_double, [1, 2, 3])
    dependent = ex.submit(len, first)  # sent by the sender thread once ``first`` is done
    assert not first.done()
    assert dependent.result(timeout=20) == 3
    victim: cf.Future[int] = cf.Future()
    path.deferred(lambda: [][0], victim)  # the task whose send raised fails with its error
    with pytest.raises(IndexError):
        victim.result(timeout=10)


def test_a_forked_child_makes_its_own_session_and_frees_nothing_of_its_parents(
    ex: Executor,
) -> None:
    """A warm worker forked while another thread held the sessions' lock waited on it for
    ever at its first ``nimbus.put``; one forked after the session was made used it with
    no renewer running; a parent's Ref dropped in the child freed the parent's object."""
    from nimbus.data import _ref

    parent = nimbus.data.session(None)
    ref = nimbus.put(b"p" * 100)
    path = _node().path(ref.id)
    held, done = threading.Event(), threading.Event()

    def holding() -> None:
        with _ref._sessions_lock:
            held.set()
            done.wait(30)

    thread = threading.Thread(target=holding, daemon=True)
    thread.start()
    assert held.wait(10)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: says what it saw, then leaves at once
        try:
            os.close(r)
            mine = nimbus.data.session(None)
            made = nimbus.put(b"c" * 10)
            ok = mine is not parent and mine._thread is not None and mine._thread.is_alive()
            ok = ok and made.get() == b"c" * 10
            del ref
            gc.collect()
            os.write(w, b"ok" if ok and path.exists() else b"no")
        finally:
            os._exit(0)
    os.close(w)
    done.set()
    thread.join(10)
    try:
        import select

        ready, _, _ = select.select([r], [], [], 30)
        said = os.read(r, 10) if ready else b"hung"
    finally:
        os.close(r)
        if not said.startswith(b"ok"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert said == b"ok"
    assert path.exists() and ref.get() == b"p" * 100


def test_an_object_is_freed_when_nothing_holds_it(ex: Executor) -> None:
    ref = nimbus.put(b"x" * MB)
    path = _node().path(ref.id)
    assert path.exists()
    del ref
    gc.collect()
    assert not path.exists()
    kept = ex.options(keep=True).submit(blob, 1)
    path = _node().path(kept.ref().id)
    assert path.exists()
    del kept
    assert not path.exists()  # the future was the last holder: freed at once


def test_a_crashed_clients_objects_go_when_their_lease_runs_out() -> None:
    code = (
        "import os, nimbus\n"
        "nimbus.data.session(None).lease = 1.0\n"
        "ref = nimbus.put(b'y' * 1000)\n"
        "print(ref.id, flush=True)\n"
        "os._exit(9)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=60)
    assert done.returncode == 9, done.stderr
    path = _node().path(done.stdout.decode().strip())
    assert path.exists()  # nobody freed it: its holder died
    assert _node().sweep() >= 0 and path.exists()  # not before its lease runs out
    time.sleep(1.2)
    other = NodeStore(f"u-sweeper-{os.getpid()}")  # any user's write sweeps the node
    other.write("a" * 32, b"", time.time() + 60)
    assert not path.exists()
    shutil.rmtree(other.dir)


def test_a_held_object_outlives_its_lease_renewed() -> None:
    local = nimbus.data.session(None)
    lease, local.lease = local.lease, 3.0  # (the renewer may be in a 1 s wait of the old one)
    try:
        ref = nimbus.put(b"z" * 100)
        time.sleep(4.0)  # longer than the lease: its holder renewed it meanwhile
        _node().sweep()
        assert ref.get() == b"z" * 100
    finally:
        local.lease = lease


def _collected_under(lock: Any) -> bool:
    """Whether a collection run while ``lock`` is held (by a thread of its own) ends:
    the cyclic collector runs at any allocation, in any thread, whatever it holds."""

    def collect() -> None:
        with lock:
            gc.collect()

    thread = threading.Thread(target=collect, daemon=True)  # left blocked if it deadlocks
    thread.start()
    thread.join(10)
    return not thread.is_alive()


def test_a_ref_collected_while_its_session_holds_its_lock_is_freed(tmp_path: Path) -> None:
    """A Ref in a reference cycle goes when the collector runs, which may be inside the
    session's lock (the executor's thread adopting a kept result): its release must not
    wait for that lock (bench/dataflow.py hung in CI on it, for ever)."""
    session = Session("ns", "me", None, store=NodeStore("ns", tmp_path))
    gc.disable()  # the cycle below is freed by the collection under the lock, not before
    try:
        ref = session.put(b"x")
        path = session.store.path(ref.id)  # type: ignore[union-attr]
        cycle: list[Any] = [ref]
        cycle.append(cycle)
        del ref, cycle
        assert path.exists()
        assert _collected_under(session._lock), "the release waited for the session's lock"
    finally:
        gc.enable()
    assert not path.exists() and session.freed == 1


CHAINS = """
import gc, os, sys, threading, time
import nimbus
from nimbus import Executor

def seed(i):
    return bytes([i]) * 65536

def step(blob):
    return blob[1:] + blob[:1]

def litter():  # Refs that only the collector frees: at any allocation, in any thread
    while True:
        cycle = [nimbus.put(b"x")]
        cycle.append(cycle)
        time.sleep(0.001)

gc.set_threshold(50)  # the collector often: now and then inside the session's lock
with Executor(2) as ex:
    threading.Thread(target=litter, daemon=True).start()
    kept = ex.options(keep=True)
    for _ in range(int(sys.argv[1])):
        ends = []
        for c in range(4):
            f = kept.submit(seed, c)
            for _ in range(9):
                f = kept.submit(step, f)
            ends.append(f)
        for f in ends:
            try:
                f.result(timeout=20)
            except TimeoutError:
                print("hung", flush=True)
                os._exit(3)  # (its shutdown would wait for the hung thread)
print("done", flush=True)
"""


def test_kept_chains_end_while_the_collector_frees_refs(tmp_path: Path) -> None:
    """bench/dataflow.py's campaign (chains of kept tasks) with the collector run often
    and Refs in cycles: before, it hung for ever (a Ref freed by the collector inside the
    session's lock, in the thread that delivers results, waited for that lock)."""
    script = tmp_path / "chains.py"
    script.write_text(CHAINS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, str(script), "6"],
        capture_output=True,
        text=True,
        env=env,
        timeout=100,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0 and "done" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("kind", ["copy", "relay"])
def test_a_copy_let_go_while_the_copies_lock_is_held_is_dropped(kind: str) -> None:
    """The same for a Ref's copy on another endpoint (``_carry._copies``), and for a copy
    relayed from another endpoint (``_carry._relays``): let go by a finalizer, which may
    run inside its registry's lock, it is dropped at once all the same."""
    registry: Any = _carry._copies if kind == "copy" else _carry._relays
    made: Any = _carry.Copy() if kind == "copy" else ("2" * 32, object(), ("", 1, "", ""))
    key = ("0" * 32, "elsewhere")
    registry.put(key, made)
    done = threading.Event()

    def forget_under_lock() -> None:
        with registry._lock:
            registry.forget(key, made)
        done.set()

    threading.Thread(target=forget_under_lock, daemon=True).start()
    assert done.wait(10), f"letting a {kind} go waited for its registry's lock"
    assert registry.get(key) is None


def test_large_containers_pass_as_they_are(ex: Executor) -> None:
    big = list(range(nimbus.data.MAX_SCAN + 1))
    assert not nimbus.data.uses_data((big,), {})
    ref = nimbus.put(1)
    assert nimbus.data.uses_data(([ref],), {}) and nimbus.data.uses_data((), {"x": {"k": ref}})
    assert ex.submit(len, [*big, ref]).result() == len(big) + 1  # not looked into
    assert ex.submit(sum, [ref, ref, 2]).result() == 4  # looked into: read in the worker


def test_another_users_reference_is_refused_before_any_task_runs(
    ex: Executor, tmp_path: object
) -> None:
    theirs = Ref("0" * 32, "u-someone-else", "mallory", None, 10)
    marker = f"/tmp/nimbus-data-test-{os.getpid()}"
    with pytest.raises(DataAccessError, match="belongs to user 'mallory'"):
        ex.submit(open, marker, "w", theirs)
    with pytest.raises(DataAccessError, match="mallory"):
        ex.map(len, [theirs], keep=True)
    assert not os.path.exists(marker)
    assert ex.statistics()["outstanding"] == 0
    # in the worker too (a Ref smuggled inside an object the client does not look into)
    scope = Scope("u-me", "me", None, False, 60.0)
    with pytest.raises(DataAccessError, match="mallory"):
        run(len, scope, theirs)


def test_a_lost_reference_fails_its_dependents_naming_it(ex: Executor) -> None:
    ref = nimbus.put([1, 2, 3])
    _node().path(ref.id).unlink()  # its holder lost it
    with pytest.raises(ReferenceLost, match=ref.id[:12]) as caught:
        ex.submit(sum, ref).result()
    assert caught.value.ref_id == ref.id
    with pytest.raises(ReferenceLost):
        ref.get()


def test_a_lost_result_of_a_pure_task_is_made_again(ex: Executor) -> None:
    made = ex.options(keep=True).submit(squares, 10)
    first = made.ref().id
    _node().path(first).unlink()  # the node that kept it lost it
    assert ex.submit(sum, made).result(timeout=60) == 285  # ran squares again, then sum
    assert made.ref().id != first and _node().path(made.ref().id).exists()
    _node().path(made.ref().id).unlink()
    assert made.result(timeout=60) == squares(10)  # fetching it makes it again too
    impure = ex.options(keep=True).submit(double, [1])
    _node().path(impure.ref().id).unlink()
    with pytest.raises(ReferenceLost):
        ex.submit(sum, impure).result(timeout=60)  # not known to be pure: not run again


def test_a_failed_dependency_fails_the_task_that_waits_for_it(ex: Executor) -> None:
    bad = ex.options(keep=True).submit(fail, 7)
    after = ex.submit(total, bad)
    with pytest.raises(ValueError, match="no 7"):
        after.result(timeout=30)


def test_a_cancelled_input_fails_the_task_that_waits_for_it_naming_it(ex: Executor) -> None:
    """Stranger 7 F7: it failed with a CancelledError that said nothing of which input."""
    blocker = ex.submit(time.sleep, 1.0)  # (the cancelled one waits its turn behind it)
    cancelled = ex.options(keep=True).submit(slow_double, [1])
    after = ex.submit(total, [3], cancelled)
    assert cancelled.cancel()
    with pytest.raises(InputFailed, match=r"its input, task \S+ \(slow_double\), was cancelled"):
        after.result(timeout=30)
    assert after.exception().input_id == cancelled.record.task_id
    blocker.result(timeout=30)


def test_a_task_waits_for_the_futures_it_is_given(ex: Executor) -> None:
    slow = ex.options(keep=True).submit(lambda: (time.sleep(0.3), [5])[1])
    plain = ex.submit(lambda: [1, 2])  # not kept: its value is passed
    assert ex.submit(total, slow, plain).result(timeout=30) == 8


def test_store_is_the_users_on_this_node(ex: Executor) -> None:
    key = f"k{os.getpid()}-{time.monotonic_ns()}"
    assert ex.submit(remember, key, 41).result() >= 42
    assert ex.submit(recall, key).result() == 41
    assert store().get(key) == 41  # the same user, on the same node, outside a task
    other = Scope(f"u-other-{os.getpid()}", "other", None, False, 60.0)
    assert run(recall, other, key) == "missing"  # another user's tasks see other keys
    shutil.rmtree(NodeStore(other.namespace).dir)
    assert store().delete(key)
    with pytest.raises(DataError, match="key"):
        store().set("", 1)


def _in(runtime: Path, code: str) -> str:
    """Run ``code`` in a new Python whose NIMBUS_RUNTIME_DIR is ``runtime``; its output."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), NIMBUS_RUNTIME_DIR=str(runtime))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode().strip()


def test_a_write_that_fails_leaves_nothing_in_the_store(tmp_path: Path) -> None:
    """An object that does not fit (the memory store full: a large ``nimbus.put(obj,
    endpoint=)`` then goes through the service) leaves no part file behind: it stayed,
    as large as what fit, until a sweep an hour later (``PART_AGE``), keeping the
    store full. (A file size limit stands in for a full /dev/shm: the same OSError.)"""
    code = (
        "import resource, signal\n"
        "from pathlib import Path\n"
        "from nimbus.data import NodeStore\n"
        f"store = NodeStore('u', Path({str(tmp_path / 'data')!r}))\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
        "try:\n"
        "    store.write('a' * 32, b'x' * (3 << 20), 2e9)\n"
        "except OSError as exc:\n"
        "    print(type(exc).__name__, sorted(p.name for p in store.objects.iterdir()))\n"
    )
    assert _in(tmp_path / "rt", code) == "OSError []"


def test_two_runtimes_never_see_each_others_data(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    code = (
        "import nimbus\n"
        "from nimbus import Executor\n"
        "from nimbus.data import store\n"
        "def keep(k):\n"
        "    store().set(k, 1)\n"
        "    return sorted(store().keys())\n"
        "def keys():\n"
        "    return sorted(store().keys())\n"
        "with Executor(max_workers=1) as ex:\n"
        "    print(ex.submit(keep, {key!r}).result(60), sorted(store().keys()),\n"
        "          ex.submit(keys).result(60), flush=True)\n"
        "    print(nimbus.data.default_root(), flush=True)\n"
    )
    seen, root = _in(one, code.format(key="of-one")).splitlines()
    assert seen == "['of-one'] ['of-one'] ['of-one']"  # its tasks and its client agree
    seen2, root2 = _in(two, code.format(key="of-two")).splitlines()
    assert seen2 == "['of-two'] ['of-two'] ['of-two']"  # not of-one: another runtime
    assert root != root2 and Path(root).parent == Path(root2).parent == data_base()
    assert root == str(default_root(one)) and root2 == str(default_root(two))
    assert not Path(root).exists() and not Path(root2).exists()  # removed as they stopped


@pytest.fixture
def own_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data base of this test alone: a sweep with its clock ahead (a lease run out)
    must not sweep the live runtimes of the machine (other tests', a benchmark's)."""
    base = tmp_path / "base"
    monkeypatch.setattr("nimbus.data._node.data_base", lambda: base)
    return base


def test_a_sweep_with_a_clock_ahead_over_the_real_data_is_refused() -> None:
    with pytest.raises(DataError, match="give it its own base="):
        sweep_all(now=time.time() + 400)


def test_a_runtimes_data_goes_when_its_last_holder_stops(tmp_path: Path, own_base: Path) -> None:
    root = default_root(tmp_path / "rt")
    assert root.parent == own_base
    first, second = hold(root), hold(root)
    NodeStore("u-x", root).write("a" * 32, b"kept", time.time() + 60)
    assert not release(first) and (root / "u-x" / "obj" / ("a" * 32)).exists()
    assert release(second) and not root.exists()  # the last one: all of it goes
    dead = root / ".holders" / "999999999-0-0"  # a holder that was killed
    NodeStore("u-x", root).write("b" * 32, b"kept", time.time() + 60)
    dead.parent.mkdir()
    dead.touch()
    sweep_all()
    assert (root / "u-x" / "obj" / ("b" * 32)).exists()  # still leased: kept
    sweep_all(now=time.time() + 61)
    assert not root.exists()  # nobody alive holds it, nothing is leased: swept


def test_the_sweep_removes_expired_objects_of_killed_clients_and_unused_files(
    tmp_path: Path, own_base: Path
) -> None:
    root = default_root(tmp_path / "rt")
    assert root.parent == own_base
    mark = hold(root)  # a live runtime: its directory stays, its expired objects go
    node = NodeStore("u-y", root)
    node.write("c" * 32, b"old", time.time() - 1)
    node.write("d" * 32, b"new", time.time() + 60)
    (node.dir / "files").mkdir()
    (node.dir / "files" / "copy").write_bytes(b"f")
    sweep_all()  # (or the write of d: a write sweeps its runtime every 10 s)
    assert not node.exists("c" * 32) and node.exists("d" * 32)
    assert (node.dir / "files" / "copy").exists()  # used less than a lease ago
    sweep_all(now=time.time() + 400)
    assert not (node.dir / "files" / "copy").exists() and root.exists()
    assert release(mark) and not root.exists()


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a pid namespace of its own needs root and unshare(1)",
)
def test_a_process_of_another_pid_namespace_judges_no_holder_or_server_here_dead(
    tmp_path: Path, own_base: Path
) -> None:
    """A process in a pid namespace of its own that shares /dev/shm (a container, a
    sandbox) sees other pids: its sweep took every holder of this namespace for dead and
    removed its mark, so the next release here (one of two agents of a runtime stopping)
    removed the runtime's data in use by the other; its offer removed this namespace's
    server files (a copy staged then had no node to fetch it from). Now marks and server
    files name their pid namespace: those of another are judged there, not here."""
    from nimbus.data._serve import Server, server_address

    root = default_root(tmp_path / "rt")
    first, second = hold(root), hold(root)  # two agents of one runtime on this machine
    NodeStore("u-n", root).write("e" * 32, b"in use", time.time() + 60)
    server = Server(root, "127.0.0.1")
    try:
        code = (
            "import sys; from pathlib import Path\n"
            "from nimbus.data._node import sweep_all\n"
            "from nimbus.data._serve import server_address\n"
            "sweep_all(base=Path(sys.argv[1])); print(server_address(Path(sys.argv[2])))\n"
        )
        src = str(Path(nimbus.__file__).parent.parent)
        unshared = ["unshare", "--pid", "--fork", "--mount-proc"]
        seen = subprocess.run(
            [*unshared, sys.executable, "-c", code, str(own_base), str(root)],
            env=dict(os.environ, PYTHONPATH=src),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        assert seen.strip() == "None"  # not this namespace's server: not its to advertise
        assert first.exists() and second.exists(), "a sweep elsewhere dropped live holders"
        assert server_address(root) == server.address
        assert not release(first)  # the other agent still holds it: its data stays
        assert NodeStore("u-n", root).exists("e" * 32)
    finally:
        server.close()
    assert release(second) and not root.exists()


def test_an_agent_sweeps_what_a_killed_runtime_left_when_it_starts(tmp_path: Path) -> None:
    root = default_root(tmp_path / "killed")  # a runtime killed: no live holder
    node = NodeStore("u-z", root)
    node.write("e" * 32, b"x" * 1000, time.time() + 60)
    past = time.time() - 1
    os.utime(node.path("e" * 32), (past, past))  # its lease ran out since
    with Executor(max_workers=1) as ex:  # another runtime's agent: sweeps the node's
        deadline = time.monotonic() + 10
        while root.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not root.exists()
        assert ex.submit(len, b"ok").result(timeout=60) == 2


def test_a_local_executor_serves_no_node_data(ex: Executor) -> None:
    """The node's data server is for the other nodes of an endpoint: a local Executor
    (one node) listened on 127.0.0.1 for nothing (any local user could reach it)."""
    import psutil

    assert ex.submit(len, b"ok").result(timeout=60) == 2
    listening = [c.laddr for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN"]
    assert listening == []
    assert list(_node().dir.parent.glob(f".server-{os.getpid()}-*")) == []


def test_a_shutdown_without_waiting_releases_the_runtimes_data_once_its_workers_end() -> None:
    """``shutdown(wait=False)`` left the node's sweeper (its thread, its data server) and
    the hold on the runtime's data directory for the life of the process."""
    ex = Executor(1)
    assert ex.submit(len, b"ab").result(timeout=60) == 2
    agent = ex._backend.agent  # type: ignore[attr-defined]
    agent._data_thread.join(30)  # (the sweeper starts just after the agent)
    data = agent._data
    ex.shutdown(wait=False)
    deadline = time.monotonic() + 30
    while data.mark.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not data.mark.exists()  # released
    assert not data._thread.is_alive()


def test_the_local_runtime_leaves_nothing_behind(tmp_path: Path) -> None:
    code = (
        "import nimbus\n"
        "from nimbus import Executor\n"
        "def big(n):\n"
        "    return b'x' * n\n"
        "with Executor(max_workers=2) as ex:\n"
        "    kept = ex.map(big, [1 << 20] * 4, keep=True)\n"
        "    ref = nimbus.put(b'y' * 1000)\n"
        "    print(sum(ex.map(len, [f.ref() for f in kept] + [ref])), flush=True)\n"
        "    nimbus.data.store().set('k', 1)\n"
        "print(nimbus.data.default_root(), flush=True)\n"
    )
    total, root = _in(tmp_path / "rt", code).splitlines()
    assert total == str(4 * MB + 1000)
    assert not Path(root).exists()  # objects, keys: gone with the runtime


# ---------------------------------------------------------------- through the service


@pytest.fixture(scope="module")
def remote(service: Service, alice: Client, lab: EndpointProcess) -> Iterator[Executor]:
    settings = service.user_settings(alice.token)
    with Executor(endpoint="lab", settings=settings) as executor:
        yield executor


def _freed(path: Path) -> None:
    """Wait (30 s at most) for the object at ``path``, whose last Ref went, to be freed."""
    gc.collect()
    deadline = time.monotonic() + 30
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not path.exists()


def test_remote_references_stay_on_the_endpoint(
    service: Service, remote: Executor, lab: EndpointProcess
) -> None:
    ref = nimbus.put(list(range(100)), endpoint="lab")
    assert ref.endpoint == lab.endpoint_id
    assert remote.submit(sum, ref).result(timeout=60) == 4950
    before = remote.statistics()["bytes_received"]
    parts = remote.map(small_blob, range(8), keep=True)  # 2 MB that stays on lab
    assert remote.submit(sizes, *parts).result(timeout=60) == [MB // 4] * 8
    assert remote.statistics()["bytes_received"] - before < 64 * 1024
    assert parts[2].result(timeout=60) == bytes([2]) * (MB // 4)  # fetched through the service
    assert ref.get() == list(range(100))
    node = on_endpoint(service, nimbus.data.session(lab.endpoint_id).namespace)
    _serving(node.dir.parent)
    sent = remote.statistics()["bytes_sent"]
    big = nimbus.put(b"x" * (2 * MB), endpoint="lab")  # over the tests' NIMBUS_MAX_PAYLOAD (1M)
    assert big.holder is not None  # straight to lab's node (_place), not through the service
    assert remote.submit(len, big).result(timeout=60) == 2 * MB
    assert big.get() == b"x" * (2 * MB)  # straight from that node
    made = remote.options(keep=True).submit(mbytes, 2)  # a kept result of 2 MB: read
    assert len(made.result(timeout=60)) == 2 * MB  # straight from its node too (a task
    # that reads it through the service would be over NIMBUS_MAX_PAYLOAD)
    assert remote.statistics()["bytes_sent"] - sent < 64 * 1024
    path = node.path(big.id)
    assert path.exists()
    del big
    _freed(path)  # on its node with its pin, by the session's next batch
    with pytest.raises(  # (named as the user named it, not by its id: stranger 7 F7)
        DataAccessError, match=r"the local runtime, and these tasks run on lab; .*endpoint='lab'"
    ):
        remote.submit(len, nimbus.put([1]))  # a local Ref, to a task on lab
    with Executor() as local:  # a local kept future, the same (it was an AssertionError)
        (kept,) = local.map(len, [[1, 2]], keep=True)
        assert kept.result(timeout=60) == 2
        with pytest.raises(DataAccessError, match="kept on the local runtime, and these tasks"):
            remote.submit(len, kept).result(timeout=60)  # (its task never runs)


def test_with_data_direct_off_large_objects_go_through_the_service(
    remote: Executor, lab: EndpointProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``NIMBUS_DATA_DIRECT=0`` (the bytes in clear on a network not trusted): a large
    put and a large read go through the service (over NIMBUS_MAX_PAYLOAD: refused)."""
    monkeypatch.setenv("NIMBUS_DATA_DIRECT", "0")
    with pytest.raises(PayloadTooLargeError, match=r"^nimbus\.put\(obj, endpoint='lab'\)"):
        nimbus.put(b"x" * (2 * MB), endpoint="lab")
    made = remote.options(keep=True).submit(mbytes, 2)
    with pytest.raises(PayloadTooLargeError, match="NIMBUS_MAX_PAYLOAD"):
        made.result(timeout=60)  # (read through the service: over its limit)
    monkeypatch.setenv("NIMBUS_DATA_DIRECT", "1")
    assert len(made.result(timeout=60)) == 2 * MB


def test_a_large_put_goes_through_the_service_where_the_endpoints_node_serves_nothing(
    service: Service, alice: Client, tmp_path: Path
) -> None:
    """Where the endpoint's node cannot serve (its NIMBUS_DATA_HOST is not one of its
    addresses), a large put goes through the service, so over NIMBUS_MAX_PAYLOAD it is
    refused naming put and what to do; the session tries no more direct puts."""
    closed = EndpointProcess(service, alice, "closed")
    closed.service = copy.copy(service)
    closed.service.env = dict(  # its own node directory (lab's server not beside it)
        service.env, NIMBUS_RUNTIME_DIR=str(tmp_path / "rt"), NIMBUS_DATA_HOST="192.0.2.1"
    )  # (TEST-NET: not an address of this machine)
    closed.start(alice)
    try:
        with Executor(endpoint="closed", settings=service.user_settings(alice.token)):
            with pytest.raises(  # (it named the task's function, identity, not put)
                PayloadTooLargeError,
                match=r"^nimbus\.put\(obj, endpoint='closed'\): the object is larger .*"
                r"\(set NIMBUS_DATA_HOST on its agent",
            ):
                nimbus.put(b"x" * (2 * MB), endpoint="closed")
            later = nimbus.data.session(closed.endpoint_id).direct_after - time.monotonic()
            assert later > 5  # (no second try at once)
    finally:
        closed.stop()


def test_remote_references_are_freed_and_lost_ones_named(
    service: Service, remote: Executor, lab: EndpointProcess
) -> None:
    place = nimbus.data.session(lab.endpoint_id)
    node = on_endpoint(service, place.namespace)  # this machine, as this OS user
    ref = nimbus.put(b"q" * 1000, endpoint="lab")
    path = node.path(ref.id)
    assert path.exists()
    del ref
    _freed(path)  # by the session's next batch (a task on the endpoint)
    ref = nimbus.put([1, 2, 3], endpoint="lab")
    node.path(ref.id).unlink()
    with pytest.raises(ReferenceLost, match=ref.id[:12]):
        remote.submit(sum, ref).result(timeout=60)


def test_a_lost_remote_result_is_made_again_if_pure_else_its_dependents_fail_naming_it(
    service: Service, remote: Executor, lab: EndpointProcess
) -> None:
    """The issue's failure clause on an endpoint: a kept result whose holder lost it is
    made again when its task is known here and pure (then the dependent runs), else the
    dependent tasks fail with ``ReferenceLost`` naming it."""
    node = on_endpoint(service, nimbus.data.session(lab.endpoint_id).namespace)
    made = remote.options(keep=True).submit(squares, 10)
    first = made.ref(timeout=60).id
    node.path(first).unlink()  # the node that kept it lost it
    assert remote.submit(sum, made).result(timeout=60) == 285  # squares ran again first
    assert made.ref().id != first and node.path(made.ref().id).exists()
    impure = remote.options(keep=True).submit(double, [1, 2])
    lost_id = impure.ref(timeout=60).id
    node.path(lost_id).unlink()
    dependents = [remote.submit(sum, impure) for _ in range(2)]
    for dependent in dependents:
        with pytest.raises(ReferenceLost, match=lost_id[:12]) as caught:
            dependent.result(timeout=60)
        assert caught.value.ref_id == lost_id


def test_an_endpoint_leaves_nothing_behind_when_it_stops(
    service: Service, alice: Client, tmp_path: Path
) -> None:
    brief = EndpointProcess(service, alice, "brief")
    brief.service = copy.copy(service)  # its own runtime directory: its own data
    brief.service.env = dict(service.env, NIMBUS_RUNTIME_DIR=str(tmp_path / "rt"))
    root = default_root(tmp_path / "rt")
    brief.start(alice)
    try:
        with Executor(endpoint="brief", settings=service.user_settings(alice.token)) as ex:
            ref = nimbus.put(b"x" * 1000, endpoint="brief")
            kept = ex.options(keep=True).submit(mbytes, 1).ref(timeout=60)
            assert ex.submit(len, kept).result(timeout=60) == MB
            # both are there while it runs (with their pins: other nodes fetch them)
            assert len([p for p in root.glob("*/obj/*") if len(p.name) == 32]) == 2
            del ref, kept
    finally:
        brief.stop()
    assert not root.exists()  # the endpoint stopped: its objects went with it


def test_an_object_on_a_stopped_endpoint_fails_its_reads_and_dependents_naming_it(
    service: Service, alice: Client, remote: Executor, tmp_path: Path
) -> None:
    """Stranger 7 F3: after its endpoint stopped, ``Ref.get()`` of an object put there
    waited for ever, and so did a task on another endpoint given it: both fail at once
    with ``ReferenceLost`` naming the object and the endpoint (a stopped endpoint's
    objects are gone with it); ``get`` takes a timeout; the Executor of the stopped
    endpoint still shuts down (its reads were cancelled at the service)."""
    gone = EndpointProcess(service, alice, "gone")
    gone.service = copy.copy(service)  # its own runtime directory: its own data
    gone.service.env = dict(service.env, NIMBUS_RUNTIME_DIR=str(tmp_path / "rt"))
    gone.start(alice)
    try:
        with Executor(endpoint="gone", settings=service.user_settings(alice.token)) as there:
            ref = nimbus.put([1, 2, 3], endpoint="gone")
            assert ref.get(timeout=60) == [1, 2, 3]
            assert remote.submit(sum, ref).result(timeout=120) == 6  # copied to lab
            with pytest.raises(TimeoutError, match="was not read within 0 s"):
                ref.get(timeout=0)
            assert "on gone," in repr(ref)  # the name the user gave, not the id
            again = nimbus.put([4, 5], endpoint="gone")
            made = there.options(keep=True).submit(squares, 3)  # pure: made again if lost
            assert made.ref(timeout=60) is not None
            gone.stop()
            _offline(alice, gone)
            began = time.monotonic()
            with pytest.raises(ReferenceLost, match="endpoint 'gone', which keeps it, is offline"):
                again.get()  # (no timeout: it would have waited for ever)
            with pytest.raises(ReferenceLost, match=again.id[:12]) as caught:
                remote.submit(sum, again).result(timeout=60)
            assert "endpoint 'gone'" in str(caught.value)
            with pytest.raises(ReferenceLost, match="endpoint 'gone'"):
                made.result(timeout=60)  # not made again there: it would wait for ever
            assert time.monotonic() - began < 30
            del there  # (its shutdown does not wait for the reads queued there)
    finally:
        gone.stop()


def _offline(client: Client, endpoint: EndpointProcess) -> None:
    """Wait (30 s at most) for the service to say ``endpoint`` is offline."""
    deadline = time.monotonic() + 30
    while client.get_endpoint(endpoint.endpoint_id)["online"]:
        assert time.monotonic() < deadline, "the service did not see the endpoint go"
        time.sleep(0.1)


def _serving(root: Path) -> None:
    """The runtime whose data directory is ``root`` serves it: an endpoint's agent serves
    before it is online (it served 0.25 s after it started, so a large put or an out=
    file sent at once went through the service, or waited)."""
    assert server_address(root) is not None, "the agent is online and serves no data"


def test_objects_of_a_killed_endpoint_fail_at_once_and_come_back_with_it(
    service: Service, alice: Client, tmp_path: Path
) -> None:
    """Its agent and workers SIGKILLed (a lost node: no goodbye, its files left in
    memory), an endpoint's objects fail their reads at once, naming it, never hang.
    Started again on the same node within their lease, it finds them (the sweep keeps
    what is leased): kept results and a put object are read again, by tasks and by the
    client (the put object's node server moved: read through the service)."""
    crash = EndpointProcess(service, alice, "crash")
    crash.service = copy.copy(service)  # its own runtime directory: its own data
    crash.service.env = dict(service.env, NIMBUS_RUNTIME_DIR=str(tmp_path / "rt"))
    root = default_root(tmp_path / "rt")
    crash.start(alice)
    _serving(root)
    try:
        with Executor(endpoint="crash", settings=service.user_settings(alice.token)) as ex:
            made = ex.options(keep=True).submit(double, [1, 2])
            assert made.ref(timeout=60) is not None
            blob = os.urandom(2 * MB)
            big = nimbus.put(blob, endpoint="crash")
            assert big.holder is not None  # put straight to its node
            held = [p for p in root.glob("*/obj/*") if len(p.name) == 32]
            assert len(held) == 2
            crash.kill()
            _offline(alice, crash)
            began = time.monotonic()
            with pytest.raises(ReferenceLost, match="endpoint 'crash', which keeps it, is offline"):
                big.get()
            with pytest.raises(ReferenceLost, match="endpoint 'crash'"):
                made.ref().get()
            assert time.monotonic() - began < 30
            with pytest.raises(DataError, match="endpoint 'crash' is offline") as put:
                nimbus.put(blob, endpoint="crash")  # (a large put: no object to name)
            assert not isinstance(put.value, ReferenceLost)  # (was: "the object <a new id>
            # cannot be read ... make the object again (nimbus.put ...)", for a put)
            assert all(p.exists() for p in held)  # nobody removed them: killed
            crash.start(alice)
            _serving(root)
            assert ex.submit(sum, made).result(timeout=60) == 6
            assert ex.submit(len, big).result(timeout=60) == 2 * MB
            assert big.get(timeout=60) == blob
            assert made.ref().get(timeout=60) == [2, 4]
    finally:
        crash.stop()


def test_a_large_get_leaves_nothing_in_the_clients_store(
    service: Service, remote: Executor, lab: EndpointProcess
) -> None:
    """A large object read straight from its node goes through a file of the client's
    store, removed once read: nothing of it stays there (its fetch's lock file stayed,
    one per read, until a sweep an hour later or the process's end)."""
    _serving(on_endpoint(service, nimbus.data.session(lab.endpoint_id).namespace).dir.parent)
    local = nimbus.data.session(None).store
    assert local is not None
    before = set(os.listdir(local.objects))
    ref = nimbus.put(os.urandom(2 * MB), endpoint="lab")
    made = remote.options(keep=True).submit(mbytes, 2)
    for _ in range(3):
        assert len(ref.get(timeout=60)) == 2 * MB
        assert len(made.result(timeout=60)) == 2 * MB
    assert ref.holder is not None  # (read straight from its node: ``_place``)
    assert set(os.listdir(local.objects)) - before == set()


def sleep_for(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def test_a_read_honours_its_timeout_and_a_put_waits_for_busy_workers(
    service: Service, remote: Executor, lab: EndpointProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lab's workers all busy: a kept future's ``result(timeout=)`` of a large object
    raises TimeoutError in that time (its read waited for the workers, whatever the
    timeout); a large put waits for them as a small one does (it raised a bare
    TimeoutError once the task that expects the object waited ``_place.WAIT`` s)."""
    from nimbus.data import _place

    _serving(on_endpoint(service, nimbus.data.session(lab.endpoint_id).namespace).dir.parent)
    made = remote.options(keep=True).submit(mbytes, 2)
    assert made.ref(timeout=60).size >= 2 * MB
    busy = [remote.submit(sleep_for, 12) for _ in range(2)]  # (lab has 2 workers)
    try:
        time.sleep(1)  # (both taken)
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            made.result(timeout=2)
        assert time.monotonic() - began < 6
        monkeypatch.setattr(_place, "WAIT", 1.0)  # (120 s: a worker busy for 2 minutes)
        ref = nimbus.put(b"z" * (2 * MB), endpoint="lab")
        assert ref.holder is not None
        assert ref.get(timeout=60) == b"z" * (2 * MB)
    finally:
        for f in busy:
            f.result(timeout=60)


def test_a_busy_node_is_waited_for_not_taken_for_unreachable(
    service: Service, remote: Executor, lab: EndpointProcess
) -> None:
    """Lab's node serves all it may to this address (``PER_PEER`` connections: other
    clients behind one NAT, other puts of this one): a large put waits for a slot. It
    took the node for unreachable after 5 s (``CONNECT``), sent the object through the
    service (over NIMBUS_MAX_PAYLOAD: refused, "this client cannot reach the endpoint's
    node"), and every large object of the session for 5 minutes after."""
    from nimbus.data._fetch import request
    from nimbus.data._serve import PER_PEER

    where = nimbus.data.session(lab.endpoint_id)
    _serving(on_endpoint(service, where.namespace).dir.parent)
    held = nimbus.put(os.urandom(32 * MB), endpoint="lab")
    assert held.holder is not None
    host, port, secret, pin = held.holder
    header = {"op": "object", "namespace": where.namespace, "pin": pin}
    taken = [request((host, port, secret), header, "take a slot")[0] for _ in range(PER_PEER)]
    # (each: the node sends 32 MB nobody reads, its thread blocked until the link closes)
    release_at = threading.Timer(8.0, lambda: [s.close() for s in taken])
    release_at.start()
    try:
        began = time.monotonic()
        ref = nimbus.put(b"w" * (2 * MB), endpoint="lab")
        assert ref.holder is not None  # straight to the node, once it served another
        assert time.monotonic() - began >= 6
        assert where.direct_after <= time.monotonic()
        assert ref.get(timeout=60) == b"w" * (2 * MB)
    finally:
        release_at.cancel()
        for s in taken:
            s.close()
    path = on_endpoint(service, where.namespace).path(held.id)
    del held
    gc.collect()
    deadline = time.monotonic() + 30
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # (freed: the tests after count the large objects there)
    assert not path.exists()


def test_remote_reference_of_another_user_is_refused(
    service: Service, remote: Executor, lab: EndpointProcess, alice: Client
) -> None:
    ref = nimbus.put([1, 2], endpoint="lab")
    bob_token = service.token("bob")
    alice.share_endpoint(lab.endpoint_id, ["bob"])
    settings = service.user_settings(bob_token)
    with (
        Executor(endpoint=lab.endpoint_id, settings=settings) as bob,
        pytest.raises(DataAccessError, match="belongs to user 'alice'"),
    ):
        bob.submit(sum, ref)


@pytest.fixture(scope="module")
def hpc(service: Service, alice: Client) -> Iterator[EndpointProcess]:
    endpoint = EndpointProcess(service, alice, "hpc")
    endpoint.start(alice)
    yield endpoint
    endpoint.stop()


def test_a_reference_of_one_endpoint_is_copied_to_another_once_per_target(
    service: Service, alice: Client, remote: Executor, lab: EndpointProcess, hpc: EndpointProcess
) -> None:
    settings = service.user_settings(alice.token)
    with Executor(endpoint="hpc", settings=settings) as on_hpc:
        ref = remote.options(keep=True).submit(mbytes, 4).ref(timeout=60)  # kept on lab
        before = (remote.statistics()["bytes_sent"], on_hpc.statistics()["bytes_received"])
        results = [on_hpc.submit(sizes, ref) for _ in range(8)]
        assert [f.result(timeout=120) for f in results] == [[4 * MB]] * 8
        # a kept result of lab, passed before it is done, is copied once it is
        parts = remote.map(small_blob, range(2), keep=True)
        assert on_hpc.submit(sizes, *parts).result(timeout=120) == [MB // 4] * 2
        assert remote.statistics()["bytes_sent"] - before[0] < 64 * 1024  # not via the client
        assert on_hpc.statistics()["bytes_received"] - before[1] < 64 * 1024
        hpc_store = on_endpoint(service, nimbus.data.session(hpc.endpoint_id).namespace)
        copies = [p for p in hpc_store.objects.iterdir() if p.stat().st_size > 4 * MB]
        assert len(copies) == 2  # lab's and one copy for the 8 tasks (one machine: one store)
        del ref, results
        gc.collect()
        deadline = time.monotonic() + 30
        while any(p.exists() for p in copies) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(p.exists() for p in copies)  # the original and its copy are freed
        lost = nimbus.put(b"z" * 100, endpoint="lab")
        on_endpoint(service, nimbus.data.session(lab.endpoint_id).namespace).path(lost.id).unlink()
        with pytest.raises(ReferenceLost, match=lost.id[:12]):
            on_hpc.submit(len, lost).result(timeout=120)


def recall_beside(ref: object, key: str) -> object:
    """store() in a task of the data path (a Ref among its arguments)."""
    return store().get(key, "missing")


def claim(scope: Scope, key: str) -> object:
    """recall(key) in the data path with a scope the client chose."""
    return run(recall, scope, key)


def late_mbytes(n: int, seconds: float) -> bytes:
    time.sleep(seconds)
    return bytes([n]) * (n * MB)


def test_a_future_of_another_endpoint_is_waited_for_by_the_service_not_the_client(
    service: Service, alice: Client, remote: Executor, lab: EndpointProcess, hpc: EndpointProcess
) -> None:
    """A kept future of lab, not done, passed to tasks on hpc: hpc's node expects the
    object, a relay task on lab (held by the service until the future's task ran) sends
    it there, and the tasks on hpc are held by the service until the relay ran: sent at
    once, none waits in the client, and the 4 MB cross no client link."""
    settings = service.user_settings(alice.token)
    with Executor(endpoint="hpc", settings=settings) as on_hpc:
        before = [ex.statistics() for ex in (remote, on_hpc)]
        hpc_store = on_endpoint(service, nimbus.data.session(hpc.endpoint_id).namespace)
        pins_before = {p for p in hpc_store.objects.glob("*") if len(p.name) == 64}
        made = remote.options(keep=True).submit(late_mbytes, 4, 3.0)
        takers = [on_hpc.submit(sizes, made) for _ in range(4)]
        _accepted(on_hpc, *takers)
        assert not made.done()  # sent while their input runs on lab: held by the service
        assert {alice.get_task(t.record.task_id)["state"] for t in takers} == {
            "waiting-for-endpoint"
        }
        assert [t.result(timeout=120) for t in takers] == [[4 * MB]] * 4
        assert min(t.record.started for t in takers) >= made.record.ended - 0.05
        after = [ex.statistics() for ex in (remote, on_hpc)]
        for old, new in zip(before, after, strict=True):
            for key in ("bytes_sent", "bytes_received"):
                assert new[key] - old[key] < 64 * 1024, (key, old, new)
        copies = [p for p in hpc_store.objects.iterdir() if p.stat().st_size >= 4 * MB]
        assert len(copies) == 2  # lab's and one copy for the 4 tasks (one machine: one store)
        # its pin stays while the copy is held: the endpoint's other nodes fetch it so
        # (lab's result has one of its own, in the one store of this machine)
        pins = {p for p in hpc_store.objects.iterdir() if len(p.name) == 64} - pins_before
        assert len({p for p in pins if p.name[:32] != made.ref().id}) == 1, pins
        # its input failing: the relay does not run, nor the tasks on hpc (InputFailed)
        failing = remote.options(keep=True).submit(fail_after, 5.0)
        late = on_hpc.submit(sizes, failing)
        _accepted(on_hpc, late)
        with pytest.raises(InputFailed, match="did not run: its input"):
            late.result(timeout=60)


def test_a_task_taking_another_endpoints_future_is_submitted_at_once_while_its_endpoint_is_busy(
    service: Service, alice: Client, remote: Executor, lab: EndpointProcess, hpc: EndpointProcess
) -> None:
    """Review 7: ``submit`` of such a task waited for a task (the target's node expecting
    the object) to run on the target endpoint, behind its whole queue (600 s and a bare
    TimeoutError when offline). It returns at once; the task runs once the relay did."""
    settings = service.user_settings(alice.token)
    with Executor(endpoint="hpc", settings=settings) as on_hpc:
        assert on_hpc.submit(len, b"ab").result(timeout=60) == 2  # (warm)
        made = remote.options(keep=True).submit(late_mbytes, 1, 0.5)
        fillers = [on_hpc.submit(time.sleep, 6.0) for _ in range(6)]  # a queue on hpc
        _accepted(on_hpc, *fillers)
        start = time.monotonic()
        taker = on_hpc.submit(sizes, made)
        took = time.monotonic() - start
        assert took < 2.0, f"submit waited {took:.1f} s for hpc's queue"
        assert taker.result(timeout=120) == [MB]
        for filler in fillers:
            filler.result(timeout=120)


def test_on_an_endpoint_the_store_is_the_owners_whichever_token(
    service: Service, remote: Executor, lab: EndpointProcess, alice: Client
) -> None:
    """The store is named from the task's owner, as the service sends it: a second token
    of alice finds what the first stored (in plain tasks and in the data path), bob does
    not, and a client that claims another user's namespace still gets its own."""
    assert remote.submit(remember, "shared", 7).result(timeout=60) >= 8
    alices = nimbus.data.session("lab").namespace
    other = service.user_settings(service.token("alice"))  # a second token of alice
    with Executor(endpoint="lab", settings=other) as again:
        assert again.submit(recall, "shared").result(timeout=60) == 7
        ref = nimbus.put(1, endpoint="lab")
        assert again.submit(recall_beside, ref, "shared").result(timeout=60) == 7
    alice.share_endpoint(lab.endpoint_id, ["bob"])
    bob = service.user_settings(service.token("bob"))
    with Executor(endpoint=lab.endpoint_id, settings=bob) as as_bob:
        assert as_bob.submit(recall, "shared").result(timeout=60) == "missing"
        claimed = Scope(alices, "bob", lab.endpoint_id, False, 300.0)
        assert as_bob.submit(claim, claimed, "shared").result(timeout=60) == "missing"


def where_stored(key: str, value: object, ttl: float) -> str:
    """Set ``key`` for ``ttl`` s in this task's store; which store that is (its repr)."""
    kv = store()
    kv.set(key, value, ttl=ttl)
    return repr(kv)


def test_on_an_endpoint_the_store_is_the_users_there_not_the_nodes(
    service: Service, alice: Client, remote: Executor, lab: EndpointProcess, hpc: EndpointProcess
) -> None:
    """funcX's Redis beside the endpoint: the keys live in the store the service hands out
    (every node of the endpoint reaches it), under alice's prefix and lab's id, not in
    the node's files; another Executor of hers finds them, a task on hpc does not."""
    key = f"kv-{os.getpid()}-{time.monotonic_ns()}"
    said = remote.submit(where_stored, key, {"n": 1}, 60.0).result(timeout=60)
    assert f"on endpoint {lab.endpoint_id}" in said
    program = remote._backend.program.program()  # the store handed out, as alice's ACL user
    assert program is not None and program.endpoint == lab.endpoint_id
    prefix = program.program_id.rpartition(".")[0]
    name = Keys(f"{prefix}.kv-{lab.endpoint_id}").kv(key)
    client = connect(program.url)
    assert client.exists(name) == 1
    node = on_endpoint(service, nimbus.data.session(lab.endpoint_id).namespace)
    assert not (node.dir / "kv" / key.encode().hex()).exists()
    settings = service.user_settings(alice.token)
    with Executor(endpoint="lab", settings=settings) as again:
        assert again.submit(recall, key).result(timeout=60) == {"n": 1}
    with Executor(endpoint="hpc", settings=settings) as on_hpc:
        assert on_hpc.submit(recall, key).result(timeout=60) == "missing"
        said = on_hpc.submit(where_stored, key, "of hpc", 60.0).result(timeout=60)
        assert f"on endpoint {hpc.endpoint_id}" in said
    assert remote.submit(recall, key).result(timeout=60) == {"n": 1}  # lab's, unchanged
    remote.submit(where_stored, key, 2, 0.3).result(timeout=60)  # a short life
    time.sleep(0.6)
    assert remote.submit(recall, key).result(timeout=60) == "missing"
    assert client.exists(name) == 0  # gone from the store, not only hidden


def test_the_client_reads_and_sets_the_keys_of_its_tasks_on_an_endpoint(
    remote: Executor, lab: EndpointProcess, ex: Executor
) -> None:
    """``Executor.store()``: the keys its tasks' ``nimbus.data.store()`` is (a map's
    results looked at, an input set for the tasks), without a task to carry them."""
    key = f"client-{os.getpid()}-{time.monotonic_ns()}"
    remote.submit(where_stored, key, {"n": 3}, 60.0).result(timeout=60)
    kv = remote.store()
    assert repr(kv).endswith(f" on endpoint {lab.endpoint_id}>")
    assert kv[key] == {"n": 3} and key in kv and key in list(kv.keys())
    kv.set(f"{key}-in", [1, 2], ttl=60)
    assert remote.submit(recall, f"{key}-in").result(timeout=60) == [1, 2]
    del kv[key]
    assert remote.submit(recall, key).result(timeout=60) == "missing"
    assert repr(ex.store()) == repr(store())  # locally: this runtime's, as outside a task


def test_a_write_into_a_full_endpoint_store_names_the_limit(tmp_path: Path) -> None:
    """The service's stores Redis, full (its maxmemory, noeviction): the write fails
    naming NIMBUS_STORE_MAXMEMORY, what was stored stays, a delete makes room."""
    from nimbus.config import Settings
    from nimbus.data import EndpointKeyValue
    from nimbus.service.stores import StoreServer

    server = StoreServer(Settings(runtime_dir=tmp_path / "rt", store_maxmemory=16 << 20))
    try:
        url = server.store("fay", "127.0.0.1")["url"]
        kv = EndpointKeyValue(connect(url, own=True), Keys("u-fay.kv-ep"), "ep", "fay")
        with pytest.raises(DataError, match=r"could not set 'k[0-9]+'.*NIMBUS_STORE_MAXMEMORY"):
            for i in range(64):  # 32 MiB into 16
                kv.set(f"k{i}", b"m" * (512 << 10))
        assert kv["k0"] == b"m" * (512 << 10) and len(list(kv.keys())) > 8
        for key in list(kv.keys()):
            assert kv.delete(key)
        kv["k0"] = "fits again"
        assert list(kv.keys()) == ["k0"] and "k0" in kv and repr(kv).endswith("endpoint ep>")
    finally:
        server.close()


def test_a_node_store_key_lives_its_ttl() -> None:
    key = f"ttl-{os.getpid()}-{time.monotonic_ns()}"
    kv = store()
    kv.set(key, [1], ttl=0.2)
    assert kv[key] == [1] and key in kv and key in list(kv.keys())
    time.sleep(0.4)
    assert key not in kv and kv.get(key, "gone") == "gone" and key not in list(kv.keys())
    assert not kv.delete(key)  # the file went as it was read
    for bad in (0, -1, float("inf"), "1"):
        with pytest.raises(DataError, match="ttl"):
            kv.set(key, 1, ttl=bad)  # type: ignore[arg-type]


# ------------------------------------------- dependencies held by the service


def slow(value: object, seconds: float) -> object:
    time.sleep(seconds)
    return value


def fail_after(seconds: float) -> int:
    time.sleep(seconds)
    raise ValueError(f"no value after {seconds} s")


def plus_one(x: int) -> int:
    return x + 1


def _accepted(ex: Executor, *futures: object, timeout: float = 30) -> None:
    """Wait until the service accepted these tasks (they have its task ids)."""
    backend = ex._backend
    deadline = time.monotonic() + timeout
    while not all(f.record.task_id in backend._by_id or f.done() for f in futures):  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "not accepted in time"
        time.sleep(0.01)


def test_a_task_given_a_future_is_held_by_the_service_and_runs_after_it(
    remote: Executor, alice: Client
) -> None:
    first = remote.options(keep=True).submit(slow, [1, 2, 3], 2.0)
    second = remote.submit(sum, first)
    _accepted(remote, second)
    assert not first.done()  # sent while its input runs: not held by the client
    assert alice.get_task(second.record.task_id)["state"] == "waiting-for-endpoint"
    assert second.result(timeout=60) == 6
    assert second.record.started >= first.record.ended - 0.05  # after it, not beside it
    chain = remote.options(keep=True).submit(slow, 0, 0.5)
    for _ in range(5):  # a chain, sent whole while its first link runs
        chain = remote.options(keep=True).submit(plus_one, chain)
    last = remote.submit(plus_one, chain)
    _accepted(remote, last)
    assert not chain.done()
    assert last.result(timeout=60) == 6
    assert chain.result(timeout=60) == 5  # a kept input's value is still there


def test_a_task_given_another_executors_future_is_held_by_the_service(
    remote: Executor, service: Service, alice: Client
) -> None:
    """A kept future of another Executor of the same user, on the same endpoint through
    the same service, is named by its task id as the executor's own: the dependent is
    sent at once and held by the service, not by this client."""
    first = remote.options(keep=True).submit(slow, [1, 2, 3], 3.0)
    _accepted(remote, first)
    with Executor(endpoint="lab", settings=service.user_settings(alice.token)) as other:
        second = other.submit(sum, first)
        _accepted(other, second)
        assert not first.done()  # sent while its input runs: not held by the client
        assert alice.get_task(second.record.task_id)["state"] == "waiting-for-endpoint"
        assert second.result(timeout=60) == 6
        assert second.record.started >= first.record.ended - 0.05
        failing = remote.options(keep=True).submit(fail_after, 1.0)
        _accepted(remote, failing)
        late = other.submit(plus_one, failing)
        with pytest.raises(InputFailed, match=f"its input, task {failing.record.task_id}, fail"):
            late.result(timeout=60)


def test_a_failed_or_cancelled_input_fails_its_dependents_naming_it(remote: Executor) -> None:
    first = remote.options(keep=True).submit(fail_after, 1.0)
    second = remote.options(keep=True).submit(plus_one, first)
    third = remote.submit(plus_one, second)  # the failure goes down the chain
    _accepted(remote, first, second, third)
    with pytest.raises(InputFailed, match=f"its input, task {first.record.task_id}, failed"):
        second.result(timeout=60)
    with pytest.raises(InputFailed, match=f"its input, task {second.record.task_id}, failed"):
        third.result(timeout=60)
    assert second.exception().input_id == first.record.task_id  # type: ignore[union-attr]
    assert isinstance(first.exception(), ValueError)
    late = remote.submit(plus_one, first)  # an input that failed before: the same
    with pytest.raises(InputFailed, match=first.record.task_id) as caught:
        late.result(timeout=60)
    assert isinstance(caught.value.__cause__, ValueError)

    running = remote.options(keep=True).submit(slow, 1, 60.0)
    waiting = remote.submit(plus_one, running)
    _accepted(remote, running, waiting)
    assert running.cancel()
    with pytest.raises(InputFailed, match=f"task {running.record.task_id}, was cancelled"):
        waiting.result(timeout=60)


CHAIN = """
import os, sys, time
from nimbus import Executor

def inc(x):
    return x + 1

ex = Executor(endpoint="lab")
kept = ex.options(keep=True)
f = kept.submit(time.sleep, 1.0)
f = kept.submit(lambda _: 0, f)
for _ in range(8):
    f = kept.submit(inc, f)
last = ex.submit(inc, f)
backend = ex._backend
while backend._unsent or backend._blocked:  # every task accepted by the service
    time.sleep(0.01)
print(last.record.task_id, flush=True)
os._exit(0)  # no shutdown, no result waited for
"""


def test_a_chain_completes_after_its_client_exits(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    settings = service.user_settings(alice.token)
    env = os.environ | service.env | {"NIMBUS_SERVICE_URL": settings.service_url}
    env |= {"NIMBUS_TOKEN": alice.token, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", CHAIN], capture_output=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    task_id = done.stdout.decode().split()[-1]
    assert alice.get_result(task_id, timeout=60) == 9  # by its task id, as any task's


def test_a_dependency_on_another_owners_task_is_refused(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    [theirs] = alice.batch_run(plus_one, [(1,)], endpoint="lab")
    bob_token = service.token("bob")
    alice.share_endpoint(lab.endpoint_id, ["bob"])
    with service.client(bob_token) as bob:
        function_id = bob.register_function(plus_one)
        data, buffers = serialization.dumps(((1,), {}))
        payload = bob.payload(data, buffers)
        for after, status, why in (
            ([theirs], 403, f"task {theirs} is not yours"),
            (["0" * 32], 404, "is not known"),
            ([0], 422, "not the place of an earlier task"),
        ):
            row = submit_row(function_id, payload, None, None, after)
            body = Batch(lab.endpoint_id, [row]).encode()
            with pytest.raises(ServiceError, match=why) as caught:
                bob.request(
                    "POST", "/v1/tasks/batch", content=body, headers={"Content-Type": MSGPACK}
                )
            assert caught.value.status == status


def test_deleting_an_endpoint_fails_the_tasks_held_there(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    """A task held on a second endpoint for an input running on lab is one of that
    endpoint's tasks: deleting it fails the task at once, naming it, and the input's
    success later queues nothing there (the task does not wait for ever)."""
    [first] = alice.batch_run(slow, [(1, 3.0)], endpoint="lab")
    other = alice.register_endpoint("held-target")["endpoint_id"]
    held = _submit_after(alice, other, first)
    assert alice.get_task(held)["state"] == "waiting-for-endpoint"
    alice.delete_endpoint(other)
    assert alice.get_task(held)["state"] == "failed"  # before its input ended
    with pytest.raises(ServiceError, match=f"endpoint held-target \\({other}\\) .* was deleted"):
        alice.get_result(held, timeout=30)
    assert alice.get_result(first, timeout=60) == 1
    time.sleep(0.5)
    assert alice.get_task(held)["state"] == "failed"


def _submit_after(client: Client, endpoint_id: str, input_id: str) -> str:
    """A task of ``plus_one`` held until task ``input_id`` ends (the batch API)."""
    function_id = client.register_function(plus_one)
    data, buffers = serialization.dumps(((1,), {}))
    row = submit_row(function_id, client.payload(data, buffers), None, None, [input_id])
    response = client.request(
        "POST", "/v1/tasks/batch", content=Batch(endpoint_id, [row]).encode(),
        headers={"Content-Type": MSGPACK},
    )  # fmt: skip
    [task_id] = unpack(response.content)["task_ids"]
    return str(task_id)


def test_a_held_task_whose_input_ended_while_no_service_ran_fails_at_the_next_start(
    tmp_path: Path,
) -> None:
    """The input of a held task is cancelled in the queue Redis while the service is
    down (as if it crashed between the script that ended the input and failing its
    dependents): the next start fails the held task, naming its input."""
    redis = StateStore.open(None, tmp_path / "redis")
    root = tmp_path / "svc"
    root.mkdir()
    service = Service(root, service_env(root, NIMBUS_REDIS_URL=redis.url), port=free_port())
    try:
        service.start()
        token = service.token("ida")
        with service.client(token) as client:
            endpoint_id = client.register_endpoint("idle")["endpoint_id"]  # no agent
            [first] = client.batch_run(plus_one, [(1,)], endpoint="idle")
            held = _submit_after(client, endpoint_id, first)
        service.stop()

        async def cancel() -> None:
            store = TaskStore(connect_async(redis.url), Keys(SERVICE_ID), result_ttl=60)
            try:
                assert await store.cancel(first, endpoint_id) is not None
            finally:
                await store.redis.aclose()

        asyncio.run(cancel())
        service.start()
        failed = pytest.raises(InputFailed, match=f"its input, task {first}, was cancelled")
        with service.client(token) as client, failed:
            client.get_result(held, timeout=30)
    finally:
        service.stop()
        redis.close()


def test_a_user_who_loses_an_endpoint_has_the_tasks_held_there_failed(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    """Bob's task held on alice's second endpoint for his input running on lab fails
    when alice stops sharing that endpoint with him (it would have run there after)."""
    other = alice.register_endpoint("held-shared")["endpoint_id"]
    token = service.token("bob")
    alice.share_endpoint(lab.endpoint_id, ["bob"])
    alice.share_endpoint(other, ["bob"])
    with service.client(token) as bob:
        [first] = bob.batch_run(slow, [(1, 3.0)], endpoint=lab.endpoint_id)
        held = _submit_after(bob, other, first)
        alice.share_endpoint(other, remove=["bob"])
        assert bob.get_task(held)["state"] == "failed"  # before its input ended
        with pytest.raises(ServiceError, match="is no longer shared with you"):
            bob.get_result(held, timeout=30)
        assert bob.get_result(first, timeout=60) == 1


def test_a_held_task_released_onto_an_endpoint_deleted_meanwhile_fails_naming_it(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    """An endpoint deleted in the registry while a task is held there (a deletion that
    raced with the task's submit, so its sweep missed it): the input's success fails
    the task, naming the endpoint, instead of queueing it where no agent will come."""
    [first] = alice.batch_run(slow, [(1, 3.5)], endpoint="lab")
    other = alice.register_endpoint("held-race")["endpoint_id"]
    held = _submit_after(alice, other, first)
    registry = Registry(service.settings().registry_url)
    try:
        registry.delete_endpoint(other)  # not through the service: nothing failed yet
    finally:
        registry.close()
    assert alice.get_task(held)["state"] == "waiting-for-endpoint"
    with pytest.raises(ServiceError, match=f"endpoint {other} was deleted before"):
        alice.get_result(held, timeout=60)
    assert alice.get_result(first, timeout=60) == 1


@pytest.mark.timeout(300)  # two services and two agents start: slow on a loaded machine
def test_a_held_task_queued_on_one_service_process_runs_at_once_on_the_other(
    tmp_path: Path,
) -> None:
    """Two service processes: the input's agent is connected to the first, the held
    task's endpoint's agent to the second. The second's dispatcher is woken when the
    first queues the held task (not at its idle poll, IDLE_POLL = 5 s later)."""
    agents: list[EndpointProcess] = []
    with two_services(tmp_path) as (first, second, _redis):
        try:
            token = first.token("hal")
            with first.client(token) as client, second.client(token) as there:
                agents.append(EndpointProcess(first, client, "near").start(client))
                agents.append(EndpointProcess(second, there, "far").start(there))
                far = agents[1].endpoint_id
                waits = []
                for _ in range(3):
                    [one] = client.batch_run(slow, [(1, 0.5)], endpoint="near")
                    held = _submit_after(client, far, one)
                    assert client.get_result(held, timeout=60) == 2
                    ended = float(client.get_task(one)["ended"])
                    waits.append(float(client.get_task(held)["dispatched"]) - ended)
                assert max(waits) < 1.5, waits
        finally:
            for agent in agents:
                agent.stop()


def test_a_copy_whose_endpoint_does_not_answer_fails_naming_the_ref_and_both_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_carry._transfer``: a step that does not end within ``TIMEOUT`` (the target
    endpoint offline) fails the copy with a DataError naming the Ref and both endpoints
    as the user named them, not an empty ``TimeoutError``."""
    from nimbus.data._ref import register

    monkeypatch.setattr(_carry, "TIMEOUT", 0.2)
    never: list[cf.Future[Any]] = []

    def call(fn: Any, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        never.append(cf.Future())  # (an endpoint that never runs the task)
        return never[-1]

    source = Session("ns", "me", "src-id", call=call, name="lab")
    where = Session("ns", "me", "dst-id", call=call, name="hpc")
    register("src-id", source)
    try:
        ref = Ref("9" * 32, "ns", "me", "src-id", 10)
        copy = _carry.Copy()
        _carry._transfer(ref, where, copy)
        error = copy.exception(timeout=10)
        assert type(error) is DataError, repr(error)
        said = str(error)
        assert "9" * 12 in said and "endpoint lab" in said and "endpoint hpc" in said
        assert "the task of endpoint hpc that takes it" in said
    finally:
        register("src-id", None, source)


def test_a_forked_child_copies_with_threads_of_its_own() -> None:
    """Review 8: a forked child had its parent's copy pool (no threads there) and its
    pending copies: a copy made in the child never ran."""
    from nimbus.data import _carry

    _carry._pool.submit(lambda: None).result(30)  # the parent's pool has a thread
    pid = os.fork()
    if pid == 0:
        try:
            ok = _carry._pool.submit(lambda: 7).result(5) == 7 and not _carry._relaying
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
