"""nimbus.multiprocessing: contexts, start methods, the module's names, programs and their keys."""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.dummy
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis

import nimbus.multiprocessing as mp
from nimbus.statestore import EmbeddedRedis

# -- targets (module level) -----------------------------------------------------


def _put_method(q: Any) -> None:
    q.put(("child", os.getpid()))


# -- contexts and start methods ------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_get_context_runs_a_process(method: str) -> None:
    ctx = mp.get_context(method)
    assert ctx.get_start_method() == method
    q = ctx.Queue()
    p = ctx.Process(target=_put_method, args=(q,))
    p.start()
    assert q.get(timeout=30) == ("child", p.pid)
    p.join(20)
    assert p.exitcode == 0
    assert p.pid != os.getpid()


@pytest.mark.timeout(10)
def test_get_context_unknown_method() -> None:
    with pytest.raises(ValueError):
        mp.get_context("nope")


@pytest.mark.timeout(10)
def test_start_methods() -> None:
    assert set(mp.get_all_start_methods()) >= {"spawn", "fork", "forkserver"}
    saved = mp.get_start_method(allow_none=True)
    try:
        mp.set_start_method("spawn", force=True)
        assert mp.get_start_method() == "spawn"
        with pytest.raises(RuntimeError):
            mp.set_start_method("fork")
        mp.set_start_method("forkserver", force=True)
        assert mp.get_start_method() == "forkserver"
        mp.set_start_method(None, force=True)
        assert mp.get_start_method(allow_none=True) is None
        assert mp.get_start_method() in mp.get_all_start_methods()  # sets the default
        with pytest.raises(RuntimeError):
            mp.set_start_method("spawn")
    finally:
        mp.set_start_method(saved, force=True)
    assert mp.get_start_method(allow_none=True) == saved


@pytest.mark.timeout(10)
def test_a_context_registered_where_the_stdlib_keeps_them_is_found() -> None:
    """A library's own context (loky's), put in the stdlib's registry, is what
    ``get_context`` gives, as under the stdlib; an unknown name is a ValueError."""
    from multiprocessing import context as stdlib_context

    class Library(stdlib_context.BaseContext):
        _name = "library"

    ctx = Library()
    stdlib_context._concrete_contexts["library"] = ctx  # type: ignore[attr-defined]
    try:
        assert mp.get_context("library") is ctx
        assert mp.get_context("spawn").get_context("library") is ctx
    finally:
        del stdlib_context._concrete_contexts["library"]  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="cannot find context for 'library'"):
        mp.get_context("library")


@pytest.mark.timeout(10)
def test_cpu_count(monkeypatch: pytest.MonkeyPatch) -> None:
    n = mp.cpu_count()
    assert isinstance(n, int) and n >= 1
    monkeypatch.setenv("NIMBUS_WORKERS", "3")
    assert mp.cpu_count() == 3


# -- the module's names ------------------------------------------------------------


@pytest.mark.timeout(10)
def test_all_is_superset_of_stdlib_and_resolves() -> None:
    stdlib_public = {n for n in multiprocessing.__all__ if not n.startswith("_")}
    assert stdlib_public <= set(mp.__all__), stdlib_public - set(mp.__all__)
    for name in mp.__all__:
        assert getattr(mp, name) is not None, name
    for name in ("SUBDEBUG", "SUBWARNING"):
        assert getattr(mp, name) == getattr(multiprocessing, name)
    namespace: dict[str, Any] = {}
    exec("from nimbus.multiprocessing import *", namespace)  # a star import works
    assert set(mp.__all__) <= set(namespace)


@pytest.mark.timeout(10)
def test_reducer_is_the_reduction_module_as_in_stdlib() -> None:
    # stdlib: multiprocessing.reducer is the `reduction` module (BaseContext.reducer)
    assert multiprocessing.reducer is multiprocessing.reduction
    assert mp.reducer is mp.get_context().reducer
    assert mp.reducer is multiprocessing.reduction


@pytest.mark.timeout(10)
def test_shared_objects_are_nimbus_ones() -> None:
    from nimbus.multiprocessing import queues, synchronize

    assert isinstance(mp.Queue(), queues.Queue)
    assert isinstance(mp.Lock(), synchronize.Lock)
    assert mp.Process is mp.context.Process
    assert mp.current_process() is multiprocessing.current_process()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "name",
    [
        "pool",
        "queues",
        "connection",
        "synchronize",
        "sharedctypes",
        "managers",
        "process",
        "context",
        "util",
        "dummy",
        "reduction",
        "heap",
        "shared_memory",
        "resource_tracker",
        "spawn",
    ],
)
def test_submodules_import(name: str) -> None:
    module = importlib.import_module(f"nimbus.multiprocessing.{name}")
    assert isinstance(module, ModuleType)
    assert getattr(mp, name) is module


@pytest.mark.timeout(10)
def test_dummy_stays_threads() -> None:
    import nimbus.multiprocessing.dummy as dummy

    assert dummy is multiprocessing.dummy
    seen: list[tuple[int, int]] = []
    p = dummy.Process(target=lambda: seen.append((os.getpid(), threading.get_ident())))
    p.start()
    p.join(5)
    assert seen and seen[0][0] == os.getpid() and seen[0][1] != threading.get_ident()
    with dummy.Pool(2) as pool:
        assert pool.map(abs, [-1, -2]) == [1, 2]


# -- programs in one Redis -----------------------------------------------------------

_PROGRAM = """
import os, sys, time
from pathlib import Path
import redis
import nimbus.multiprocessing as mp

def child(q):
    q.put("from-child")

if __name__ == "__main__":
    me, url, rendezvous, with_child = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    q, lock, v = mp.Queue(), mp.Lock(), mp.Value("i", 0)
    a, b = mp.Pipe()
    q.put(me)
    v.value = int(me)
    a.send(me)
    assert lock.acquire(timeout=5), "the other program's lock?"
    if with_child == "1":
        p = mp.Process(target=child, args=(q,))
        p.start()
        p.join(30)
        assert p.exitcode == 0
    keys = redis.Redis.from_url(url).keys("nimbus:*")
    assert keys, "no keys in the given Redis"
    (rendezvous / me).touch()
    deadline = time.monotonic() + 30
    while len(list(rendezvous.iterdir())) < 2:  # both programs hold their objects now
        assert time.monotonic() < deadline, "the other program never came"
        time.sleep(0.05)
    assert q.get(timeout=5) == me
    if with_child == "1":
        assert q.get(timeout=5) == "from-child"
    assert q.empty()
    assert v.value == int(me)
    assert b.recv() == me and not b.poll(0)
    lock.release()
    print("ok", me, len(keys), flush=True)
"""


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path / "rt").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(90)
def test_two_programs_share_a_redis_and_leave_no_keys(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(_PROGRAM))
    rendezvous = tmp_path / "rendezvous"
    rendezvous.mkdir()
    env = {**os.environ, "NIMBUS_REDIS_URL": redis_server.url}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), me, redis_server.url, str(rendezvous), child],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for me, child in (("1", "1"), ("2", "0"))
    ]
    outputs = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err
        assert out.startswith("ok"), (out, err)
    client = redis.Redis.from_url(redis_server.url)
    assert sorted(client.keys("nimbus:*")) == []
