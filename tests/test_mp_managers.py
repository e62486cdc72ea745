"""nimbus.multiprocessing managers: the stdlib's server as a nimbus process, proxies in children."""

from __future__ import annotations

import multiprocessing.managers
import os
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

import nimbus.multiprocessing as mp
from nimbus.multiprocessing.managers import BaseManager, SyncManager

# -- targets and registered types (module level) --------------------------------


def _use_proxies(d: Any, lst: Any, ns: Any, q: Any, lock: Any, v: Any, arr: Any, ev: Any) -> None:
    d["child"] = os.getpid()
    d["sum"] = d["a"] + d["b"]
    lst.append("from-child")
    lst[0] = "changed"
    ns.y = ns.x * 2
    with lock:
        v.value += 10
    for i in range(len(arr)):
        arr[i] = arr[i] * 10
    q.put(("queued", os.getpid()))
    ev.set()


def _barrier_party(barrier: Any, lst: Any) -> None:
    index = barrier.wait(20)
    lst.append(index)


def _increment_many(lock: Any, v: Any, n: int) -> None:
    for _ in range(n):
        with lock:
            v.value += 1


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.n = start

    def inc(self, by: int = 1) -> int:
        self.n += by
        return self.n

    def value(self) -> int:
        return self.n

    def hidden(self) -> str:
        return "should not be reachable"

    def child_counter(self) -> Counter:
        return Counter(self.n * 100)


class CounterManager(BaseManager):
    pass


CounterManager.register(
    "Counter",
    Counter,
    exposed=("inc", "value", "child_counter"),
    method_to_typeid={"child_counter": "CounterRef"},
)
# the typeid of objects returned by methods: no callable, so the server keeps the result
CounterManager.register(
    "CounterRef", exposed=("inc", "value", "child_counter"), create_method=False
)


class RemoteCounterClient(BaseManager):
    pass


RemoteCounterClient.register("get_counter")

_SHARED = Counter(5)


def _shared_counter() -> Counter:
    return _SHARED


class ServedManager(BaseManager):
    pass


ServedManager.register("get_counter", callable=_shared_counter)


def _bump_counter(counter: Any) -> None:
    counter.inc(1000)


@pytest.fixture(scope="module")
def manager() -> Iterator[SyncManager]:
    with mp.Manager() as m:
        yield m


# -- SyncManager proxies ------------------------------------------------------------


@pytest.mark.timeout(30)
def test_manager_is_nimbus_sync_manager(manager: SyncManager) -> None:
    assert isinstance(manager, multiprocessing.managers.SyncManager)
    assert isinstance(manager, SyncManager)
    assert manager._process.pid != os.getpid()


@pytest.mark.timeout(30)
def test_proxies_used_from_child(manager: SyncManager) -> None:
    d = manager.dict({"a": 1, "b": 2})
    lst = manager.list(["orig"])
    ns = manager.Namespace()
    ns.x = 21
    q = manager.Queue()
    lock = manager.Lock()
    v = manager.Value("i", 5)
    arr = manager.Array("i", [1, 2, 3])
    ev = manager.Event()
    p = mp.Process(target=_use_proxies, args=(d, lst, ns, q, lock, v, arr, ev))
    p.start()
    assert ev.wait(20)
    p.join(20)
    assert p.exitcode == 0
    assert d["sum"] == 3 and d["child"] == p.pid
    assert list(lst) == ["changed", "from-child"]
    assert ns.y == 42
    assert v.value == 15
    assert list(arr) == [10, 20, 30]
    assert q.get(timeout=5) == ("queued", p.pid)
    assert ev.is_set()


@pytest.mark.timeout(30)
def test_manager_lock_and_value_across_processes(manager: SyncManager) -> None:
    lock = manager.Lock()
    v = manager.Value("i", 0)
    procs = [mp.Process(target=_increment_many, args=(lock, v, 50)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(20)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert v.value == 150


@pytest.mark.timeout(30)
def test_barrier_proxy(manager: SyncManager) -> None:
    barrier = manager.Barrier(3)
    lst = manager.list()
    procs = [mp.Process(target=_barrier_party, args=(barrier, lst)) for _ in range(2)]
    for p in procs:
        p.start()
    lst.append(barrier.wait(20))
    for p in procs:
        p.join(20)
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(lst) == [0, 1, 2]


# -- BaseManager.register -----------------------------------------------------------


@pytest.mark.timeout(30)
def test_register_custom_class_exposed_and_method_to_typeid() -> None:
    with CounterManager() as m:
        c = m.Counter(3)
        assert c.inc() == 4
        assert c.inc(by=6) == 10
        assert c.value() == 10
        with pytest.raises(AttributeError):
            c.hidden()  # not in `exposed`
        child = c.child_counter()  # a proxy, as `method_to_typeid` says
        assert isinstance(child, multiprocessing.managers.BaseProxy)
        assert child.value() == 1000
        assert child.inc() == 1001
        assert c.value() == 10
        p = mp.Process(target=_bump_counter, args=(c,))
        p.start()
        p.join(20)
        assert p.exitcode == 0
        assert c.value() == 1010


@pytest.mark.timeout(30)
def test_address_authkey_and_connect_then_shutdown() -> None:
    authkey = secrets.token_bytes(16)
    server = ServedManager(address=("127.0.0.1", 0), authkey=authkey)
    server.start()
    try:
        host, port = server.address
        assert port != 0
        client = RemoteCounterClient(address=(host, port), authkey=authkey)
        client.connect()
        counter = client.get_counter()
        assert counter.inc(1) == 6
        assert server.get_counter().value() == 6  # the same object on the server
        bad = RemoteCounterClient(address=(host, port), authkey=b"wrong-key")
        with pytest.raises(multiprocessing.AuthenticationError):
            bad.connect()
        del counter
    finally:
        server.shutdown()
    assert server._process.exitcode == 0
    with pytest.raises((ConnectionError, EOFError, OSError)):
        RemoteCounterClient(address=(host, port), authkey=authkey).connect()


@pytest.mark.timeout(30)
def test_manager_shutdown_ends_server_process() -> None:
    m = mp.Manager()
    d = m.dict(x=1)
    assert d["x"] == 1
    proc = m._process
    assert proc.is_alive()
    m.shutdown()
    proc.join(10)
    assert not proc.is_alive()
    assert proc.exitcode == 0
    with pytest.raises((ConnectionError, EOFError, OSError)):
        d["x"]
