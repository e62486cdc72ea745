"""nimbus.multiprocessing.sharedctypes against a real Redis, in one and several processes."""

from __future__ import annotations

import ctypes
import multiprocessing
import pickle
import threading
from typing import Any

import pytest

from nimbus.errors import StateStoreError
from nimbus.multiprocessing._state import Program
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


# ---------------------------------------------------------------- values


@pytest.mark.timeout(10)
def test_value_types(program: Program) -> None:
    for code, initial, new in [("i", 5, -7), ("d", 1.5, 2.25), ("c", b"a", b"z"), ("u", "x", "y")]:
        value = Value(code, initial, program=program)
        assert isinstance(value, Synchronized)
        assert value.value == initial
        value.value = new
        assert value.value == new
    assert Value("q", program=program).value == 0
    assert Value(ctypes.c_ubyte, 255, program=program).value == 255
    with pytest.raises(TypeError):
        Value("i", program=program).value = "no"
    with pytest.raises(TypeError):
        Value("?", program=program)


@pytest.mark.timeout(10)
def test_value_locks(program: Program) -> None:
    value = Value("i", 1, program=program)
    assert isinstance(value.get_lock(), RLock)
    assert isinstance(value.get_obj(), SharedValue)
    with value:
        value.value += 1  # the RLock is held: the access inside does not block
    assert value.acquire() and value.value == 2
    value.release()
    raw = Value("i", 3, lock=False, program=program)
    assert isinstance(raw, SharedValue) and raw.value == 3
    lock = Lock(program=program)
    mine = Value("i", 4, lock=lock, program=program)
    assert mine.get_lock() is lock
    tlock = threading.Lock()  # any object with acquire/release works, as in the stdlib
    assert Value("i", 5, lock=tlock, program=program).value == 5
    with pytest.raises(AttributeError, match="acquire"):
        Value("i", 6, lock=object(), program=program)


@pytest.mark.timeout(10)
def test_access_waits_for_a_lock_held_elsewhere(program: Program) -> None:
    value = Value("i", 0, program=program)
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
def test_structures(program: Program) -> None:
    point = Value(Point, 1, 2.5, program=program)
    assert (point.x, point.y) == (1, 2.5)
    point.x = 10
    assert (point.x, point.y) == (10, 2.5)
    raw = RawValue(Point, 3, 4.0, program=program)
    assert (raw.x, raw.y) == (3, 4.0)
    with pytest.raises(AttributeError):
        _ = raw.z
    with pytest.raises(AttributeError):
        _ = raw.value
    points = RawArray(Point, 2, program=program)
    points[1] = Point(5, 6.0)
    assert (points[1].x, points[1].y) == (5, 6.0)
    assert (points[0].x, points[0].y) == (0, 0.0)


# ---------------------------------------------------------------- arrays


@pytest.mark.timeout(10)
def test_array_indexing_and_slices(program: Program) -> None:
    arr = Array("i", [1, 2, 3, 4, 5], program=program)
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
    zeros = RawArray("d", 3, program=program)
    assert isinstance(zeros, SharedArray) and zeros[:] == [0.0, 0.0, 0.0]
    assert RawArray("i", 0, program=program)[:] == []


@pytest.mark.timeout(10)
def test_char_arrays(program: Program) -> None:
    text = Array("c", b"hello", program=program)
    assert isinstance(text, SynchronizedString)
    assert text.value == b"hello" and text.raw == b"hello"
    text.value = b"hi"
    assert text.value == b"hi" and text.raw == b"hi\x00lo"
    text.raw = b"world"
    assert text.value == b"world" and text[1:3] == b"or" and text[0] == b"w"
    with pytest.raises(ValueError):
        text.value = b"too long!"
    raw = RawArray("c", 4, program=program)
    raw.value = b"ab"
    assert raw.value == b"ab" and raw.raw == b"ab\x00\x00"
    wide = RawArray("u", "abc", program=program)
    assert wide.value == "abc" and wide[1] == "b"
    with pytest.raises(AttributeError):
        _ = RawArray("i", 2, program=program).value


@pytest.mark.timeout(10)
def test_copy_synchronized_and_pickle(program: Program) -> None:
    raw = RawArray("i", [1, 2, 3], program=program)
    dup = copy(raw)
    dup[0] = 100
    assert raw[0] == 1 and dup[:] == [100, 2, 3]
    wrapped = synchronized(raw)
    assert isinstance(wrapped, SynchronizedArray) and wrapped[:] == [1, 2, 3]
    with pytest.raises(TypeError):
        synchronized(wrapped)
    value = Value("d", 1.0, program=program)
    again = pickle.loads(pickle.dumps(value))
    again.value = 3.0
    assert value.value == 3.0
    assert isinstance(copy(value), SharedValue)


@pytest.mark.timeout(10)
def test_a_gone_object_is_a_clear_error(program: Program) -> None:
    value = RawValue("i", 1, program=program)
    program.client().delete(value._key)
    with pytest.raises(StateStoreError, match="is gone"):
        _ = value.value


# ---------------------------------------------------------------- processes


@pytest.mark.timeout(30)
def test_counter_incremented_by_four_processes(program: Program) -> None:
    counter = Value("i", 0, program=program)
    procs = [spawn.Process(target=_count, args=(counter, 200)) for _ in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(20)
        assert proc.exitcode == 0
    assert counter.value == 800


@pytest.mark.timeout(20)
def test_writes_of_a_child_are_seen(program: Program) -> None:
    arr = Array("i", 4, program=program)
    point = RawValue(Point, program=program)
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
