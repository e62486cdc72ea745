"""nimbus.multiprocessing.sharedctypes in shared memory and in a real Redis, in several processes.

Most tests run twice: on a program that keeps its objects in this host's
shared memory (the local default) and on one that keeps them in the store.
"""

from __future__ import annotations

import ctypes
import dataclasses
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest

from nimbus.errors import ConfigError, StateStoreError
from nimbus.multiprocessing import _heap
from nimbus.multiprocessing._mutex import HostRLock
from nimbus.multiprocessing.sharedctypes import (
    Array,
    RawArray,
    RawValue,
    SharedArray,
    SharedValue,
    Synchronized,
    SynchronizedArray,
    SynchronizedString,
    Value,
    copy,
    synchronized,
)
from nimbus.multiprocessing.synchronize import Lock, RLock
from nimbus.statestore import Program

spawn = multiprocessing.get_context("spawn")


class Point(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_double)]


def _count(counter: Any, times: int) -> None:
    for _ in range(times):
        with counter.get_lock():
            counter.value += 1


def _fill(arr: Any, point: Any) -> None:
    arr[:] = list(range(10, 10 + len(arr)))
    point.x = 42
    point.y = 0.5


def _die_holding(value: Any) -> None:
    value.get_lock().acquire()
    value.value = 1
    os.kill(os.getpid(), signal.SIGKILL)


def _fill_in_place(points: Any, arr: Any) -> None:
    points[1].x = 5  # a field of an element, in place: shared memory only
    view = memoryview(arr).cast("B").cast("i")  # the buffer protocol, as np.frombuffer uses it
    view[2] = 99


@pytest.fixture(params=["memory", "store"])
def placed(request: pytest.FixtureRequest, program: Program, tmp_path: Path) -> Iterator[Program]:
    """The test's program, keeping its objects in shared memory or in the store."""
    if request.param == "store":
        yield program
        return
    shared = _heap.directory(tmp_path, program.program_id)
    yield dataclasses.replace(program, shared=shared)
    _heap.remove(shared)


def _raw_value_type(prog: Program) -> Any:
    return SharedValue if prog.shared is None else ctypes._SimpleCData


def _raw_array_type(prog: Program) -> Any:
    return SharedArray if prog.shared is None else ctypes.Array


# ---------------------------------------------------------------- values


@pytest.mark.timeout(10)
def test_value_types(placed: Program) -> None:
    for code, initial, new in [("i", 5, -7), ("d", 1.5, 2.25), ("c", b"a", b"z"), ("u", "x", "y")]:
        value = Value(code, initial, program=placed)
        assert isinstance(value, Synchronized)
        assert value.value == initial
        value.value = new
        assert value.value == new
    assert Value("q", program=placed).value == 0
    assert Value(ctypes.c_ubyte, 255, program=placed).value == 255
    with pytest.raises(TypeError):
        Value("i", program=placed).value = "no"
    with pytest.raises(TypeError):
        Value("?", program=placed)


@pytest.mark.timeout(10)
def test_value_locks(placed: Program) -> None:
    value = Value("i", 1, program=placed)
    assert isinstance(value.get_lock(), RLock if placed.shared is None else HostRLock)
    assert isinstance(value.get_obj(), _raw_value_type(placed))
    with value:
        value.value += 1  # the RLock is held: the access inside does not block
    assert value.acquire() and value.value == 2
    value.release()
    raw = Value("i", 3, lock=False, program=placed)
    assert isinstance(raw, _raw_value_type(placed)) and raw.value == 3
    lock = Lock(program=placed)
    mine = Value("i", 4, lock=lock, program=placed)
    assert mine.get_lock() is lock
    tlock = threading.Lock()  # any object with acquire/release works, as in the stdlib
    assert Value("i", 5, lock=tlock, program=placed).value == 5
    with pytest.raises(AttributeError, match="acquire"):
        Value("i", 6, lock=object(), program=placed)


@pytest.mark.timeout(10)
def test_access_waits_for_a_lock_held_elsewhere(placed: Program) -> None:
    value = Value("i", 0, program=placed)
    lock = value.get_lock()
    lock.acquire()
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(value.value))
    thread.start()
    thread.join(0.3)
    assert thread.is_alive() and not seen  # the reader waits for the holder
    value.value = 9
    lock.release()
    thread.join(5)
    assert seen == [9]


@pytest.mark.timeout(10)
def test_structures(placed: Program) -> None:
    point = Value(Point, 1, 2.5, program=placed)
    assert (point.x, point.y) == (1, 2.5)
    point.x = 10
    assert (point.x, point.y) == (10, 2.5)
    raw = RawValue(Point, 3, 4.0, program=placed)
    assert (raw.x, raw.y) == (3, 4.0)
    with pytest.raises(AttributeError):
        _ = raw.z
    with pytest.raises(AttributeError):
        _ = raw.value
    with pytest.raises(TypeError):
        RawValue(Point, "x", program=placed)
    points = RawArray(Point, 2, program=placed)
    points[1] = Point(5, 6.0)
    assert (points[1].x, points[1].y) == (5, 6.0)
    assert (points[0].x, points[0].y) == (0, 0.0)


# ---------------------------------------------------------------- arrays


@pytest.mark.timeout(10)
def test_array_indexing_and_slices(placed: Program) -> None:
    arr = Array("i", [1, 2, 3, 4, 5], program=placed)
    assert isinstance(arr, SynchronizedArray)
    assert len(arr) == 5 and list(arr) == [1, 2, 3, 4, 5]
    assert arr[0] == 1 and arr[-1] == 5
    assert arr[1:3] == [2, 3] and arr[::2] == [1, 3, 5] and arr[::-1] == [5, 4, 3, 2, 1]
    assert arr[4:2] == []
    arr[0] = 10
    arr[-1] = 50
    arr[1:3] = [20, 30]
    arr[::2] = [0, 0, 0]
    assert arr[:] == [0, 20, 0, 4, 0]
    with pytest.raises(IndexError):
        arr[5]
    with pytest.raises(IndexError):
        arr[-6] = 1
    with pytest.raises(ValueError):
        arr[0:2] = [1]
    with pytest.raises(TypeError):
        arr[0] = "x"
    zeros = RawArray("d", 3, program=placed)
    assert isinstance(zeros, _raw_array_type(placed)) and zeros[:] == [0.0, 0.0, 0.0]
    assert RawArray("i", 0, program=placed)[:] == []


@pytest.mark.timeout(10)
def test_char_arrays(placed: Program) -> None:
    text = Array("c", b"hello", program=placed)
    assert isinstance(text, SynchronizedString)
    assert text.value == b"hello" and text.raw == b"hello"
    text.value = b"hi"
    assert text.value == b"hi" and text.raw == b"hi\x00lo"
    text.raw = b"world"
    assert text.value == b"world" and text[1:3] == b"or" and text[0] == b"w"
    with pytest.raises(ValueError):
        text.value = b"too long!"
    raw = RawArray("c", 4, program=placed)
    raw.value = b"ab"
    assert raw.value == b"ab" and raw.raw == b"ab\x00\x00"
    wide = RawArray("u", "abc", program=placed)
    assert wide.value == "abc" and wide[1] == "b"
    with pytest.raises(AttributeError):
        _ = RawArray("i", 2, program=placed).value


@pytest.mark.timeout(10)
def test_copy_synchronized_and_pickle(placed: Program) -> None:
    raw = RawArray("i", [1, 2, 3], program=placed)
    dup = copy(raw)
    dup[0] = 100
    assert raw[0] == 1 and dup[:] == [100, 2, 3]
    wrapped = synchronized(raw)
    assert isinstance(wrapped, SynchronizedArray) and wrapped[:] == [1, 2, 3]
    with pytest.raises(TypeError):
        synchronized(wrapped)
    value = Value("d", 1.0, program=placed)
    again = ForkingPickler.loads(ForkingPickler.dumps(value))  # the program's pickler
    again.value = 3.0
    assert value.value == 3.0
    assert isinstance(copy(value), _raw_value_type(placed))
    with pytest.raises(TypeError, match="ctypes object"):
        synchronized(object())
    with pytest.raises(TypeError, match="copy"):
        copy(3)


@pytest.mark.timeout(10)
def test_a_gone_object_is_a_clear_error(program: Program) -> None:
    value = RawValue("i", 1, program=program)
    program.client().delete(value._key)
    with pytest.raises(StateStoreError, match="is gone"):
        _ = value.value


# ---------------------------------------------------------------- processes


@pytest.mark.timeout(30)
def test_counter_incremented_by_four_processes(placed: Program) -> None:
    counter = Value("i", 0, program=placed)
    procs = [spawn.Process(target=_count, args=(counter, 200)) for _ in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(20)
        assert proc.exitcode == 0
    assert counter.value == 800


@pytest.mark.timeout(20)
def test_writes_of_a_child_are_seen(placed: Program) -> None:
    arr = Array("i", 4, program=placed)
    point = RawValue(Point, program=placed)
    proc = spawn.Process(target=_fill, args=(arr, point))
    proc.start()
    proc.join(10)
    assert proc.exitcode == 0
    assert arr[:] == [10, 11, 12, 13]
    assert (point.x, point.y) == (42, 0.5)


@pytest.mark.timeout(10)
def test_keys_have_the_program_prefix_and_ttl(program: Program) -> None:
    Value("i", program=program)
    Array("c", b"xy", program=program)
    RawValue(Point, program=program)
    client = program.client()
    keys = list(client.scan_iter(match=program.keys.pattern()))
    assert len(keys) >= 3
    for key in keys:
        assert key.decode().startswith(f"nimbus:{{{program.program_id}}}:")
        assert 0 < client.pttl(key) <= program.ttl_ms


# ---------------------------------------------------------------- shared memory


@pytest.fixture
def in_memory(placed: Program) -> Program:
    if placed.shared is None:
        pytest.skip("shared memory only")
    return placed


@pytest.mark.parametrize("placed", ["memory"], indirect=True)
@pytest.mark.timeout(20)
def test_a_child_writes_in_place_through_the_buffer(in_memory: Program) -> None:
    points = RawArray(Point, 2, program=in_memory)
    arr = Array("i", 4, program=in_memory)
    assert len(memoryview(arr.get_obj()).cast("B")) == 16
    proc = spawn.Process(target=_fill_in_place, args=(points, arr.get_obj()))
    proc.start()
    proc.join(10)
    assert proc.exitcode == 0
    assert points[1].x == 5 and arr[:] == [0, 0, 99, 0]


@pytest.mark.parametrize("placed", ["memory"], indirect=True)
@pytest.mark.timeout(30)
def test_the_lock_of_a_child_killed_holding_it_is_taken_over(in_memory: Program) -> None:
    value = Value("i", 0, program=in_memory)
    proc = spawn.Process(target=_die_holding, args=(value,))
    proc.start()
    proc.join(20)
    assert proc.exitcode == -signal.SIGKILL
    assert value.get_lock().acquire(timeout=5)  # robust: the dead holder's lock is given over
    value.value += 1
    value.get_lock().release()
    assert value.value == 2


@pytest.mark.parametrize("placed", ["memory"], indirect=True)
@pytest.mark.timeout(10)
def test_the_shared_memory_lock_is_an_rlock(in_memory: Program) -> None:
    lock = Value("i", program=in_memory).get_lock()
    assert lock.acquire() and lock.acquire(False)  # re-entrant
    results: list[Any] = []

    def other() -> None:
        results.append(lock.acquire(False))
        results.append(lock.acquire(timeout=0.2))
        try:
            lock.release()
        except AssertionError as exc:  # as the stdlib's RLock
            results.append(str(exc))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(5)
    assert results == [False, False, "attempt to release recursive lock not owned by thread"]
    lock.release()
    lock.release()
    with pytest.raises(AssertionError):
        lock.release()
    thread = threading.Thread(target=lambda: results.append(lock.acquire(timeout=1)))
    thread.start()
    thread.join(5)
    assert results[-1] is True
    assert "shared memory" in repr(lock)


@pytest.mark.parametrize("placed", ["memory"], indirect=True)
@pytest.mark.timeout(10)
def test_plain_pickle_copies_and_the_programs_pickler_shares(in_memory: Program) -> None:
    value = RawValue("i", 1, program=in_memory)
    copied = pickle.loads(pickle.dumps(value))  # as ctypes pickles (the stdlib's too)
    arr = RawArray("i", [1, 2], program=in_memory)
    shared = ForkingPickler.loads(ForkingPickler.dumps(arr))
    arr[0] = 7
    value.value = 2
    assert copied.value == 1 and shared[:] == [7, 2]
    private = (ctypes.c_int * 2)(3, 4)  # of a type a shared array has: pickled as a copy
    assert ForkingPickler.loads(ForkingPickler.dumps(private))[:] == [3, 4]


@pytest.mark.parametrize("placed", ["memory"], indirect=True)
@pytest.mark.timeout(10)
def test_a_block_of_an_ended_program_is_a_clear_error(in_memory: Program) -> None:
    arr = RawArray("i", 3, program=in_memory)
    data = ForkingPickler.dumps(arr)
    _heap.remove(str(in_memory.shared))
    arr[0] = 1  # mapped here: still usable
    with pytest.raises(StateStoreError, match="is gone"):
        ForkingPickler.loads(data)
    with pytest.raises(StateStoreError, match="is gone"):
        RawValue("i", program=in_memory)


_MADE = "import nimbus.multiprocessing as mp\narr = mp.Array('i', 3)\n"


def _run_root(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A program of its own (a root process) that makes an Array, then runs ``script``."""
    return subprocess.run(
        [sys.executable, "-c", _MADE + script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )


@pytest.mark.timeout(120)
def test_blocks_go_at_exit_and_after_a_sigkill_of_the_root(tmp_path: Path) -> None:
    env = {"NIMBUS_RUNTIME_DIR": str(tmp_path)}
    show = "print(arr.get_obj()._block.path, flush=True)\n"
    done = _run_root(show, env)
    assert done.returncode == 0, done.stderr
    assert not Path(done.stdout.strip()).parent.exists()

    killed = _run_root(show + "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", env)
    assert killed.returncode == -signal.SIGKILL
    left = Path(killed.stdout.strip()).parent
    assert left.is_dir()  # nothing could remove it ...
    elsewhere = left.parent / f"1-{os.getpid()}-0-{left.name.split('-', 3)[3]}"
    elsewhere.mkdir(mode=0o700)  # a root in another pid namespace (a container)
    try:
        _heap.sweep(left.parent)  # ... until the next program starts on this host
        assert not left.exists()
        assert elsewhere.exists()  # its pids are not ours to judge
    finally:
        _heap.remove(str(elsewhere))


@pytest.mark.timeout(60)
def test_shared_memory_can_be_turned_off() -> None:
    check = (
        "from nimbus.multiprocessing.sharedctypes import SharedArray\n"
        "assert isinstance(arr.get_obj(), SharedArray), arr.get_obj()\n"
    )
    done = _run_root(check, {"NIMBUS_SHARED_MEMORY": "0"})
    assert done.returncode == 0, done.stderr


@pytest.mark.timeout(10)
def test_a_shared_directory_open_to_others_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "shm").mkdir(mode=0o700)
    (tmp_path / "shm").chmod(0o755)
    monkeypatch.setattr(_heap, "_SHM", tmp_path / "none")  # no /dev/shm: <runtime dir>/shm
    with pytest.raises(ConfigError, match="mode 0700"):
        _heap.directory(tmp_path, "p")
