"""nimbus.multiprocessing.synchronize against a real Redis, in threads and processes."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nimbus.errors import StateStoreError
from nimbus.multiprocessing import _heap, _mutex
from nimbus.multiprocessing.sharedctypes import RawValue
from nimbus.multiprocessing.synchronize import (
    Barrier,
    BoundedSemaphore,
    Condition,
    Event,
    Lock,
    RLock,
    Semaphore,
)
from nimbus.statestore import EmbeddedRedis, Keys, Program

spawn = multiprocessing.get_context("spawn")


def _keys(prog: Program) -> list[str]:
    return sorted(k.decode() for k in prog.client().scan_iter(match=prog.keys.pattern()))


def _start(target: object, *args: object) -> multiprocessing.process.BaseProcess:
    proc = spawn.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


# ---------------------------------------------------------------- child process targets


def _hold(lock: Lock, held: Event, seconds: float) -> None:
    with lock:
        held.set()
        time.sleep(seconds)


def _hold_forever(lock: Lock, held: Event) -> None:
    lock.acquire()
    held.set()
    time.sleep(60)


def _release_twice(sem: Semaphore, ready: Event) -> None:
    ready.wait(10)
    sem.release()
    sem.release()


def _count_under_lock(lock: Lock, counter: Any, n: int) -> None:
    for _ in range(n):
        with lock:
            value = counter.value  # read, then write: only the lock keeps increments apart
            counter.value = value + 1


def _wait_barrier(barrier: Barrier) -> None:
    barrier.wait()


def _notify_when(cond: Condition, event: Event) -> None:
    event.wait(10)
    with cond:
        cond.notify_all()


# ---------------------------------------------------------------- Lock


@pytest.mark.timeout(10)
def test_lock_basics(program: Program) -> None:
    lock = Lock(program=program)
    assert lock.acquire()
    assert not lock.acquire(False)
    start = time.monotonic()
    assert not lock.acquire(True, 0.2)
    assert 0.15 < time.monotonic() - start < 2
    lock.release()
    with pytest.raises(ValueError, match="released too many times"):
        lock.release()
    with lock:
        assert not lock.acquire(block=False)
    assert lock.acquire(timeout=0.1)
    lock.release()


@pytest.mark.timeout(10)
def test_lock_released_by_another_thread_and_fifo_waiters(program: Program) -> None:
    lock = Lock(program=program)
    lock.acquire()
    order: list[int] = []

    def waiter(i: int) -> None:
        with lock:
            order.append(i)

    threads = [threading.Thread(target=waiter, args=(i,)) for i in range(3)]
    for i, thread in enumerate(threads):
        thread.start()
        time.sleep(0.1 + 0.05 * i)
    threading.Thread(target=lock.release).start()  # any thread may release a Lock
    for thread in threads:
        thread.join(5)
    assert order == [0, 1, 2]


@pytest.mark.timeout(10)
def test_a_release_after_another_threads_release_is_reported(program: Program) -> None:
    lock = Lock(program=program)
    lock.acquire()
    other = threading.Thread(target=lock.release)  # allowed: a Lock has no owner
    other.start()
    other.join()
    lock.release()  # the stdlib raises ValueError here; ours is sent without a reply...
    with pytest.raises(ValueError, match="another process had released it"):
        lock.acquire()  # ...and reported by this thread's next acquire of the lock
    assert lock.acquire(False)  # reported once; the lock works on
    assert lock.get_value() == 0
    lock.release()
    assert lock.get_value() == 1


@pytest.mark.timeout(10)
def test_lock_pickles_to_the_same_lock(program: Program) -> None:
    lock = Lock(program=program)
    copy = pickle.loads(pickle.dumps(lock))
    assert copy.acquire(False)
    assert not lock.acquire(False)
    lock.release()
    assert copy.acquire(False)


@pytest.mark.timeout(60)
def test_lock_excludes_across_processes_and_keeps_one_token(program: Program) -> None:
    lock = Lock(program=program)
    counter = RawValue("i", 0, program=program)
    procs = [_start(_count_under_lock, lock, counter, 150) for _ in range(3)]
    _count_under_lock(lock, counter, 150)
    for proc in procs:
        proc.join(50)
        assert proc.exitcode == 0
    assert counter.value == 600
    assert lock.get_value() == 1  # the one token is back in the lock's list
    assert not [k for k in _keys(program) if ":held:" in k]


# ---------------------------------------------------------------- RLock


@pytest.mark.timeout(10)
def test_rlock(program: Program) -> None:
    rlock = RLock(program=program)
    assert rlock.acquire()
    assert rlock.acquire(False)
    with rlock:
        pass
    other: list[bool] = []
    thread = threading.Thread(target=lambda: other.append(rlock.acquire(True, 0.1)))
    thread.start()
    thread.join()
    assert other == [False]
    errors: list[BaseException] = []

    def release() -> None:
        try:
            rlock.release()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=release)
    thread.start()
    thread.join()
    assert isinstance(errors[0], AssertionError) and isinstance(errors[0], RuntimeError)
    rlock.release()
    rlock.release()
    with pytest.raises(AssertionError):
        rlock.release()


# ---------------------------------------------------------------- semaphores


@pytest.mark.timeout(10)
def test_semaphore(program: Program) -> None:
    sem = Semaphore(2, program=program)
    assert sem.get_value() == 2
    assert sem.acquire() and sem.acquire()
    assert sem.get_value() == 0
    assert not sem.acquire(False)
    start = time.monotonic()
    assert not sem.acquire(timeout=0.2)
    assert time.monotonic() - start >= 0.15
    for _ in range(3):
        sem.release()  # an unbounded semaphore may go past its initial value
    assert sem.get_value() == 3
    with pytest.raises(ValueError):
        Semaphore(-1, program=program)


@pytest.mark.timeout(10)
def test_bounded_semaphore(program: Program) -> None:
    sem = BoundedSemaphore(1, program=program)
    with sem:
        assert sem.get_value() == 0
    with pytest.raises(ValueError, match="released too many times"):
        sem.release()
    zero = BoundedSemaphore(0, program=program)
    assert not zero.acquire(False)
    with pytest.raises(ValueError):
        zero.release()


@pytest.mark.timeout(20)
def test_semaphore_across_processes(program: Program) -> None:
    sem = Semaphore(0, program=program)
    ready = Event(program=program)
    proc = _start(_release_twice, sem, ready)
    ready.set()
    assert sem.acquire(timeout=10)
    assert sem.acquire(timeout=10)
    proc.join(10)
    assert proc.exitcode == 0


# ---------------------------------------------------------------- Event


@pytest.mark.timeout(10)
def test_event(program: Program) -> None:
    event = Event(program=program)
    assert not event.is_set()
    start = time.monotonic()
    assert event.wait(0.2) is False
    assert time.monotonic() - start >= 0.15
    threading.Timer(0.2, event.set).start()
    assert event.wait(5) is True
    assert event.is_set() and event.wait() and event.wait(0)
    event.clear()
    assert not event.is_set() and not event.wait(0)


@pytest.mark.timeout(10)
def test_event_wakes_every_waiter(program: Program) -> None:
    event = Event(program=program)
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(event.wait(5))) for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    event.set()
    for thread in threads:
        thread.join(5)
    assert results == [True] * 4
    assert not [k for k in _keys(program) if ":waiter" in k]  # wake-up lists are removed


# ---------------------------------------------------------------- Condition


@pytest.mark.timeout(10)
def test_condition_wait_notify(program: Program) -> None:
    cond = Condition(program=program)
    with pytest.raises(RuntimeError):
        cond.notify()
    with pytest.raises(AssertionError):
        cond.wait(0.1)
    with cond:
        assert cond.wait(0.1) is False
    woken: list[bool] = []

    def waiter() -> None:
        with cond:
            woken.append(cond.wait(5))

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    with cond:
        cond.notify()
    time.sleep(0.3)
    assert woken == [True]
    with cond:
        cond.notify_all()
    for thread in threads:
        thread.join(5)
    assert woken == [True] * 3


@pytest.mark.timeout(10)
def test_condition_with_rlock_held_twice_and_wait_for(program: Program) -> None:
    lock = RLock(program=program)
    cond = Condition(lock)
    state = {"n": 0}

    def bump() -> None:
        for _ in range(3):
            time.sleep(0.05)
            with cond:
                state["n"] += 1
                cond.notify()

    with lock, cond:  # held twice: wait releases both levels and restores them
        threading.Thread(target=bump).start()
        assert cond.wait_for(lambda: state["n"] == 3, timeout=5)
        assert cond.wait_for(lambda: state["n"] == 4, timeout=0.1) is False
    assert lock.acquire(False)  # fully released again: depth back to one, now ours
    lock.release()
    with pytest.raises(TypeError):
        Condition(Semaphore(program=program))  # type: ignore[arg-type]


@pytest.mark.timeout(20)
def test_condition_across_processes(program: Program) -> None:
    cond = Condition(program=program)
    go = Event(program=program)
    proc = _start(_notify_when, cond, go)
    with cond:
        go.set()  # the child can notify only once this wait has released the lock
        assert cond.wait(10)
    proc.join(10)
    assert proc.exitcode == 0


# ---------------------------------------------------------------- Barrier


@pytest.mark.timeout(10)
def test_barrier_threads_and_action(program: Program) -> None:
    ran: list[int] = []
    barrier = Barrier(3, action=lambda: ran.append(1), program=program)
    assert barrier.parties == 3 and barrier.n_waiting == 0 and not barrier.broken
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(barrier.wait(5))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert sorted(results) == [0, 1, 2] and ran == [1]
    with pytest.raises(ValueError):
        Barrier(0, program=program)


@pytest.mark.timeout(10)
def test_barrier_timeout_abort_reset(program: Program) -> None:
    barrier = Barrier(2, program=program)
    with pytest.raises(threading.BrokenBarrierError):
        barrier.wait(0.2)
    assert barrier.broken
    with pytest.raises(threading.BrokenBarrierError):
        barrier.wait()
    barrier.reset()
    assert not barrier.broken
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            barrier.wait(5)
        except threading.BrokenBarrierError as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    deadline = time.monotonic() + 5
    while barrier.n_waiting != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    barrier.abort()
    thread.join(5)
    assert len(errors) == 1 and barrier.broken


@pytest.mark.timeout(20)
def test_barrier_across_processes(program: Program) -> None:
    barrier = Barrier(3, timeout=10, program=program)
    procs = [_start(_wait_barrier, barrier) for _ in range(2)]
    assert barrier.wait() in (0, 1, 2)
    for proc in procs:
        proc.join(10)
        assert proc.exitcode == 0


# ---------------------------------------------------------------- faults


@pytest.mark.timeout(20)
def test_lock_of_a_sigkilled_holder_is_released(program: Program) -> None:
    lock = Lock(program=program)
    held = Event(program=program)
    proc = _start(_hold_forever, lock, held)
    assert held.wait(10)
    assert not lock.acquire(timeout=0.3)
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(5)
    start = time.monotonic()
    assert lock.acquire(timeout=5)  # the documented behaviour: released within ~0.5 s
    assert time.monotonic() - start < 2
    lock.release()
    with pytest.raises(ValueError):
        lock.release()


@pytest.mark.timeout(20)
def test_a_live_holder_keeps_its_lock(program: Program) -> None:
    lock = Lock(program=program)
    held = Event(program=program)
    proc = _start(_hold, lock, held, 1.5)
    assert held.wait(10)
    assert not lock.acquire(timeout=0.8)  # waited past a reap step: not taken from a live holder
    assert lock.acquire(timeout=10)
    proc.join(5)
    assert proc.exitcode == 0


@pytest.mark.timeout(20)
def test_store_killed_mid_run_is_a_clear_error(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path).start()
    try:
        prog = Program(server.url, Keys.program_id_new(), 30.0)
        lock = Lock(program=prog)
        sem = Semaphore(0, program=prog)
        lock.acquire()
        errors: list[BaseException] = []

        def blocked() -> None:
            try:
                sem.acquire()
            except StateStoreError as exc:
                errors.append(exc)

        thread = threading.Thread(target=blocked)
        thread.start()
        time.sleep(0.2)
    finally:
        server.stop()
    thread.join(5)
    assert not thread.is_alive()
    assert errors and server.url in str(errors[0])
    with pytest.raises(StateStoreError, match="is unreachable"):
        lock.acquire(timeout=1)


# ---------------------------------------------------------------- keys


@pytest.mark.timeout(10)
def test_keys_have_the_program_prefix_and_ttl(program: Program) -> None:
    lock, rlock = Lock(program=program), RLock(program=program)
    sem, event = Semaphore(3, program=program), Event(program=program)
    cond, barrier = Condition(program=program), Barrier(2, program=program)
    with lock, rlock, sem, cond:
        event.set()
        cond.wait(0.05)
    barrier.abort()
    client = program.client()
    keys = _keys(program)
    assert keys
    for key in keys:
        assert key.startswith(f"nimbus:{{{program.program_id}}}:")
        assert 0 < client.pttl(key) <= program.ttl_ms
    assert not [k for k in keys if ":waiter:" in k or ":held:" in k]  # no wait, no holder left


@pytest.mark.timeout(10)
def test_keys_expire_and_programs_do_not_collide(store_url: str) -> None:
    short = Program(store_url, Keys.program_id_new(), 0.3)
    other = Program(store_url, Keys.program_id_new(), 30.0)
    Lock(program=short).acquire()
    Event(program=short).set()
    Semaphore(2, program=short)
    assert Lock(program=other).acquire(False)  # separate programs never meet
    assert _keys(short)
    time.sleep(0.6)
    assert _keys(short) == []
    client = other.client()
    client.unlink(*[k.encode() for k in _keys(other)])


# ---------------------------------------------------------------- Lock in shared memory


@pytest.fixture
def on_host(program: Program, tmp_path: Path) -> Iterator[Program]:
    """The test's program, its processes all on this host (its objects in shared memory)."""
    if not _mutex.available():
        pytest.skip("no process-shared robust mutexes in this C library")
    shared = _heap.directory(tmp_path, program.program_id)
    yield dataclasses.replace(program, shared=shared)
    _heap.remove(shared)


def _release_it(lock: Lock) -> None:
    lock.release()


@pytest.mark.timeout(10)
def test_lock_of_a_program_on_this_host_is_in_shared_memory(on_host: Program) -> None:
    lock = Lock(program=on_host)
    assert isinstance(lock, _mutex.HostLock) and isinstance(lock, Lock)
    assert lock.acquire()
    assert not lock.acquire(False)
    start = time.monotonic()
    assert not lock.acquire(True, 0.2)
    assert 0.15 < time.monotonic() - start < 2
    assert lock.get_value() == 0
    lock.release()
    assert lock.get_value() == 1
    with pytest.raises(ValueError, match="released too many times"):
        lock.release()
    with lock:
        assert not lock.acquire(block=False)
    assert not _keys(on_host)  # the store was never asked
    assert not isinstance(RLock(program=on_host), _mutex.HostLock)  # RLock: the store's


@pytest.mark.timeout(10)
def test_shared_memory_lock_is_fast(on_host: Program) -> None:
    lock = Lock(program=on_host)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(2000):
            lock.acquire()
            lock.release()
        best = min(best, (time.perf_counter() - start) / 2000)
    assert best < 10e-6  # about 1 us here; the store's lock takes a round trip (30 us)


@pytest.mark.timeout(30)
def test_shared_memory_lock_across_processes_threads_and_pickles(on_host: Program) -> None:
    lock = Lock(program=on_host)
    copy = pickle.loads(pickle.dumps(lock))
    assert isinstance(copy, _mutex.HostLock) and copy.acquire(False)
    assert not lock.acquire(False)
    lock.release()  # any thread or process may release a Lock
    lock.acquire()
    releaser = _start(_release_it, lock)
    releaser.join(10)
    assert releaser.exitcode == 0
    assert lock.acquire(False)
    threading.Thread(target=lock.release).start()
    assert lock.acquire(timeout=5)
    lock.release()
    counter = RawValue("i", 0, program=on_host)
    procs = [_start(_count_under_lock, lock, counter, 300) for _ in range(3)]
    _count_under_lock(lock, counter, 300)
    for proc in procs:
        proc.join(20)
        assert proc.exitcode == 0
    assert counter.value == 1200
    assert lock.get_value() == 1


@pytest.mark.timeout(20)
def test_shared_memory_lock_of_a_sigkilled_holder_is_taken_over(on_host: Program) -> None:
    lock = Lock(program=on_host)
    held = Event(program=on_host)
    proc = _start(_hold_forever, lock, held)
    assert held.wait(10)
    assert not lock.acquire(timeout=0.8)  # a live holder keeps it past a look at the owner
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(5)
    start = time.monotonic()
    assert lock.acquire(timeout=5)
    assert time.monotonic() - start < 2
    assert not lock.acquire(False)
    lock.release()
    with pytest.raises(ValueError):
        lock.release()


@pytest.mark.timeout(20)
def test_condition_and_barrier_over_a_shared_memory_lock(on_host: Program) -> None:
    cond = Condition(Lock(program=on_host))
    with pytest.raises(AssertionError):
        cond.wait(0.01)  # not acquired
    event = Event(program=on_host)
    proc = _start(_notify_when, cond, event)
    with cond:
        event.set()
        assert cond.wait(10)
    proc.join(10)
    assert proc.exitcode == 0
    barrier = Barrier(2, program=on_host)
    assert isinstance(barrier._cond._lock, _mutex.HostLock)
    proc = _start(_wait_barrier, barrier)
    barrier.wait(10)
    proc.join(10)
    assert proc.exitcode == 0


@pytest.mark.timeout(20)
def test_a_shared_memory_lock_moves_to_the_store_held_by_its_holder(on_host: Program) -> None:
    lock = Lock(program=on_host)
    other = pickle.loads(pickle.dumps(lock))  # a copy in this host's memory, as a child has
    lock.acquire()
    lock.to_store()  # as before it goes to a process on another host
    remote = pickle.loads(pickle.dumps(lock))
    assert type(remote) is Lock  # the store's: a process elsewhere cannot map the block
    assert not remote.acquire(False)  # held by this thread, now in the store
    assert not other.acquire(False)
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(other.acquire(timeout=10)))
    waiter.start()
    time.sleep(0.3)
    lock.release()
    waiter.join(10)
    assert got == [True]  # the waiter of the shared memory copy got it from the store
    assert not lock.acquire(False) and not remote.acquire(False)
    other.release()
    assert remote.acquire(False)
    assert not lock.acquire(False)
    remote.release()
    with pytest.raises(ValueError, match="released too many times"):
        lock.release()
    assert [k for k in _keys(on_host) if ":lock:" in k]


@pytest.mark.timeout(20)
def test_a_shared_memory_lock_moves_to_the_store_after_its_holder_releases(
    on_host: Program,
) -> None:
    lock = Lock(program=on_host)
    lock.acquire()
    mover = threading.Thread(target=lock.to_store)
    mover.start()
    time.sleep(0.3)
    assert mover.is_alive()  # waits for the holder: never two holders
    lock.release()
    mover.join(10)
    assert not mover.is_alive()
    assert lock.get_value() == 1  # free, in the store
    remote = pickle.loads(pickle.dumps(lock))
    assert type(remote) is Lock and remote.acquire(False)
    assert not lock.acquire(False)
    remote.release()
    with lock:
        assert not remote.acquire(False)
