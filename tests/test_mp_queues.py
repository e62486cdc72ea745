"""nimbus.multiprocessing.queues: Queue, SimpleQueue and JoinableQueue over a real state store."""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import threading
import time

import pytest

from nimbus.multiprocessing.queues import JoinableQueue, Queue, SimpleQueue
from nimbus.statestore import program

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def spawn() -> multiprocessing.context.SpawnContext:
    program()
    return multiprocessing.get_context("spawn")


def _produce(q: Queue, n: int) -> None:
    for i in range(n):
        q.put(i)
    q.close()
    q.join_thread()


def _consume_joinable(q: JoinableQueue, out: Queue) -> None:
    while True:
        item = q.get()
        if item is None:
            q.task_done()
            break
        out.put(item * 2)
        q.task_done()


def _simple_worker(inq: SimpleQueue, outq: SimpleQueue) -> None:
    while (item := inq.get()) is not None:
        outq.put(item + 1)


def test_put_get_fifo_and_nowait() -> None:
    q = Queue()
    for i in range(100):
        q.put(i)
    assert [q.get(timeout=5) for _ in range(100)] == list(range(100))
    with pytest.raises(queue.Empty):
        q.get_nowait()
    q.put_nowait("x")
    assert q.get() == "x"


def test_a_tight_loop_of_gets_pops_items_in_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIMBUS_MESSAGING_DIRECT", "0")  # the store path
    q = Queue()
    for i in range(2000):
        q.put(i)
    client = program().client()
    deadline = time.monotonic() + 10
    while client.llen(q._key) < 2000 and time.monotonic() < deadline:
        time.sleep(0.01)  # the feeder thread pushes them

    def pops() -> int:
        stats = client.info("commandstats")
        return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("blpop", "lpop"))

    before = pops()
    assert [q.get(timeout=5) for _ in range(2000)] == list(range(2000))
    assert pops() - before < 400  # not one round trip per item (other tests' threads: a few)


def test_get_timeouts() -> None:
    q = Queue()
    start = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.2)
    assert 0.15 < time.monotonic() - start < 2
    with pytest.raises(queue.Empty):
        q.get(timeout=-1)  # the stdlib: Empty at once
    with pytest.raises(queue.Empty):
        q.get(False)


def test_qsize_empty_full_and_maxsize() -> None:
    q = Queue(2)
    assert q.empty() and not q.full() and q.qsize() == 0
    q.put(1)
    q.put(2)
    assert q.full() and q.qsize() == 2
    with pytest.raises(queue.Full):
        q.put_nowait(3)
    with pytest.raises(queue.Full):
        q.put(3, timeout=0.1)
    with pytest.raises(queue.Full):
        q.put(3, timeout=-1)
    assert q.get() == 1
    assert q.qsize() == 1 and not q.full()
    q.put(3)
    assert [q.get(), q.get()] == [2, 3]
    assert q.empty()


def test_blocking_put_waits_for_a_slot() -> None:
    q = Queue(1)
    q.put("a")
    threading.Timer(0.2, q.get).start()
    start = time.monotonic()
    q.put("b", timeout=5)
    assert time.monotonic() - start >= 0.15
    assert q.get(timeout=5) == "b"


def test_unbounded_qsize_counts_buffered_items() -> None:
    q = Queue()
    for i in range(10):
        q.put(i)
    assert q.qsize() == 10 and not q.empty() and not q.full()
    q.get()
    assert q.qsize() == 9


def test_closed_queue() -> None:
    q = Queue()
    q.put(1)
    q.close()
    q.join_thread()
    with pytest.raises(ValueError):
        q.put(2)
    with pytest.raises(ValueError):
        q.get()
    with pytest.raises(AssertionError):
        Queue().join_thread()  # not closed
    q2 = Queue()
    q2.put(1)
    q2.cancel_join_thread()
    q2.close()


def test_held_items_go_back_on_close() -> None:
    q = Queue()
    for i in range(50):
        q.put(i)
    other = pickle.loads(pickle.dumps(q))
    assert [q.get(timeout=5) for _ in range(5)] == list(range(5))
    q.close()  # anything prefetched goes back to the head
    assert [other.get(timeout=5) for _ in range(45)] == list(range(5, 50))


def test_unpicklable_put_is_reported_by_the_feeder(capfd: pytest.CaptureFixture[str]) -> None:
    q = Queue(5)
    q.put(threading.Lock())
    q.put("after")
    assert q.get(timeout=5) == "after"
    time.sleep(0.1)
    assert "cannot pickle" in capfd.readouterr().err
    assert q.qsize() == 0  # the failed items gave their slots back


def test_simple_queue_unpicklable_raises_at_once() -> None:
    sq = SimpleQueue()
    with pytest.raises(pickle.PicklingError):
        sq.put(threading.Lock())
    assert sq.empty()
    sq.put([1, 2])
    assert not sq.empty()
    assert sq.get() == [1, 2]
    sq.close()
    with pytest.raises(OSError):
        sq.get()


def test_joinable_task_done_and_join(spawn: multiprocessing.context.SpawnContext) -> None:
    q = JoinableQueue()
    with pytest.raises(ValueError):
        q.task_done()
    out = Queue()
    for i in range(20):
        q.put(i)
    q.put(None)
    p = spawn.Process(target=_consume_joinable, args=(q, out))
    p.start()
    q.join()
    assert sorted(out.get(timeout=5) for _ in range(20)) == [i * 2 for i in range(20)]
    with pytest.raises(ValueError):
        q.task_done()
    p.join(20)
    assert p.exitcode == 0


def test_join_returns_at_once_when_nothing_is_unfinished() -> None:
    q = JoinableQueue()
    q.put(1)
    assert q.get(timeout=5) == 1
    q.task_done()
    q.join()


def test_ordering_across_processes(spawn: multiprocessing.context.SpawnContext) -> None:
    q = Queue()
    p = spawn.Process(target=_produce, args=(q, 10_000))
    p.start()
    assert [q.get(timeout=10) for _ in range(10_000)] == list(range(10_000))
    p.join(20)
    assert p.exitcode == 0


def test_simple_queue_across_processes(spawn: multiprocessing.context.SpawnContext) -> None:
    inq, outq = SimpleQueue(), SimpleQueue()
    workers = [spawn.Process(target=_simple_worker, args=(inq, outq)) for _ in range(2)]
    for w in workers:
        w.start()
    for i in range(200):
        inq.put(i)
    for _ in workers:
        inq.put(None)
    assert sorted(outq.get() for _ in range(200)) == list(range(1, 201))
    for w in workers:
        w.join(20)
        assert w.exitcode == 0


def _take_two_then_wait(q: SimpleQueue, got: SimpleQueue, release: multiprocessing.Event) -> None:
    got.put([q.get(), q.get()])  # a tight loop: a Pipe reader would prefetch here
    release.wait(20)


def test_simple_queue_consumer_takes_only_what_it_gets(
    spawn: multiprocessing.context.SpawnContext,
) -> None:
    # several processes share a SimpleQueue (a Pool's job queue): none may hoard items
    q, got = SimpleQueue(), SimpleQueue()
    for i in range(10):
        q.put(i)
    release = spawn.Event()
    p = spawn.Process(target=_take_two_then_wait, args=(q, got, release))
    p.start()
    try:
        assert got.get() == [0, 1]
        assert [q.get() for _ in range(8)] == list(range(2, 10))  # not held by the other
    finally:
        release.set()
        p.join(20)


def test_pool_private_attributes() -> None:
    sq = SimpleQueue()
    sq._writer.send(("task", 1))
    assert sq._reader.poll(5)
    assert sq._reader.recv() == ("task", 1)
    assert sq._rlock.acquire()
    sq._rlock.release()


def test_threads_that_come_and_go_do_not_run_out_of_connections() -> None:
    # every thread has its own link to the store; a long-lived program whose threads
    # come and go (a Pool's handler threads, a ThreadPool ...) makes links without
    # end, beyond the 100 connections a redis-py pool lets itself make
    q = SimpleQueue()

    def put(i: int) -> None:
        q.put(i)

    for i in range(150):
        thread = threading.Thread(target=put, args=(i,))
        thread.start()
        thread.join()
    assert [q.get() for _ in range(150)] == list(range(150))
