"""Queues whose items go straight to their one consumer, and back to the store.

Real ``nimbus.multiprocessing`` processes, real sockets and the real embedded
state store. Each test checks what the user sees (every item once, each
producer's items in order) and, through the queue's private state, which path
was taken (see ``nimbus.multiprocessing._qdirect``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from queue import Empty
from typing import Any

import pytest

import nimbus.multiprocessing as mp
from nimbus.multiprocessing import connection, queues

pytestmark = pytest.mark.timeout(180)

STOP = "stop"


# -- children (module level: found by reference) -----------------------------


def _produce(q: queues.Queue, who: int, n: int, out: queues.SimpleQueue | None) -> None:
    """Put (who, 0..n-1), now and then pausing (the feeder looks at the claim)."""
    switched = False
    for i in range(n):
        q.put((who, i))
        if i % 200 == 0:
            time.sleep(0.01)
            switched = switched or _switched(q)
    q.close()
    q.join_thread()
    if out is not None:
        out.put((who, switched or _switched(q)))


def _produce_forever(q: queues.Queue, who: int) -> None:
    i = 0
    while True:
        q.put((who, i))
        i += 1
        if i % 100 == 0:
            time.sleep(0.002)


def _consume_until_stop(
    q: queues.Queue, out: connection.Connection, ready: Any, after: int
) -> None:
    got: list[Any] = []
    claimed = False
    while True:
        item = q.get(timeout=60)
        claimed = claimed or (q._consumer is not None and q._consumer.claim is not None)
        if item == STOP:
            break
        got.append(item)
        if len(got) == after:
            ready.set()
    out.send((got, claimed))
    out.close()


def _consume_forever(q: queues.Queue, out: connection.Connection) -> None:
    while True:
        out.send(q.get())


def _consume_some(q: queues.Queue, n: int, out: connection.Connection) -> None:
    got = [q.get(timeout=60) for _ in range(n)]
    out.send((got, q._consumer is not None and q._consumer.claim is not None))
    out.close()  # and exit: the claim goes, what came directly goes back to the list


def _get_one_then_sleep(q: queues.Queue, out: connection.Connection, wake: Any) -> None:
    out.send(q.get(timeout=60))
    wake.wait(120)  # busy elsewhere: no get while a second consumer comes
    out.send(q._consumer is not None and q._consumer.claim is not None)
    out.close()


def _echo(inq: queues.Queue, outq: queues.Queue) -> None:
    while True:
        item = inq.get()
        if item is None:
            return
        outq.put(item)


def _square_into(q: queues.Queue, x: int) -> int:
    q.put(x * x)
    return x


def _join_worker(q: queues.JoinableQueue, out: queues.Queue) -> None:
    while True:
        item = q.get()
        if item is None:
            q.task_done()
            return
        out.put(item + 1)
        q.task_done()


# -- helpers -----------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_children_left() -> Any:
    """A failed test leaves no child running (the process would wait for it at exit)."""
    yield
    for p in mp.active_children():
        p.kill()
        p.join(30)


def _switched(q: queues.Queue) -> bool:
    return q._producer is not None and q._producer.peer is not None


def _start(target: Callable[..., Any], *args: Any) -> Any:
    p = mp.Process(target=target, args=args)
    p.start()
    return p


def _check_per_producer(items: list[tuple[int, int]]) -> dict[int, list[int]]:
    """Each producer's items in the order received, asserting that order holds."""
    seqs: dict[int, list[int]] = {}
    for who, i in items:
        seqs.setdefault(who, []).append(i)
    for who, seq in seqs.items():
        assert seq == sorted(seq), f"producer {who}: out of order"
        assert len(seq) == len(set(seq)), f"producer {who}: an item came twice"
    return seqs


def _wait_for(condition: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


# -- tests -------------------------------------------------------------------


def test_flood_from_several_producers_switches_keeping_order_and_exactly_once() -> None:
    q: queues.Queue = mp.Queue()
    reports = mp.SimpleQueue()
    n, producers = 3000, 3
    with pytest.raises(Empty):
        q.get(timeout=0.05)  # the first get claims the queue for this process
    assert q._consumer is not None and q._consumer.claim is not None
    procs = [_start(_produce, q, who, n, reports) for who in range(producers)]
    got = [q.get(timeout=60) for _ in range(n * producers)]
    seqs = _check_per_producer(got)
    assert seqs == {who: list(range(n)) for who in range(producers)}
    switched = dict(reports.get() for _ in range(producers))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert all(switched.values()), switched
    assert q._consumer.opened  # their items came directly
    assert q.empty() and q.qsize() == 0
    with pytest.raises(Empty):
        q.get(timeout=0.1)
    q.close()


def test_round_trip_over_two_queues_goes_direct_both_ways() -> None:
    there: queues.Queue = mp.Queue()
    back: queues.Queue = mp.Queue()
    p = _start(_echo, there, back)
    for i in range(300):
        there.put(i)
        assert back.get(timeout=60) == i
    assert _switched(there)  # the child holds "there", this process "back"
    assert back._consumer is not None and back._consumer.opened
    big = bytes(range(256)) * 4096
    there.put(big)
    assert back.get(timeout=60) == big
    there.put(None)
    p.join(30)
    assert p.exitcode == 0


def _put_until(
    q: queues.Queue, done: Callable[[], bool], i: int, deadline: float, pause: float, why: str
) -> int:
    """Put (0, i), (0, i + 1) ... a ``pause`` apart until ``done()``; the next i."""
    while not done():
        assert time.monotonic() < deadline, why
        q.put((0, i))
        i += 1
        time.sleep(pause)
    return i


def test_a_second_consumer_mid_stream_shares_the_queue() -> None:
    q: queues.Queue = mp.Queue()
    ready, b_ready = mp.Event(), mp.Event()
    outs = [mp.Pipe(duplex=False) for _ in range(2)]
    a = _start(_consume_until_stop, q, outs[0][1], ready, 50)
    deadline = time.monotonic() + 60
    # A holds the queue; we send to it
    i = _put_until(q, lambda: _switched(q) and ready.is_set(), 0, deadline, 0.002, "never switched")
    for _ in range(1000):
        q.put((0, i))
        i += 1
    b = _start(_consume_until_stop, q, outs[1][1], b_ready, 1)
    # until B got an item: it found A's claim
    i = _put_until(q, b_ready.is_set, i, deadline, 0.001, "B got nothing")
    for _ in range(2000):
        q.put((0, i))
        i += 1
        if i % 100 == 0:
            time.sleep(0.005)
    n = i
    q.put(STOP)
    q.put(STOP)
    (got_a, claimed_a), (got_b, claimed_b) = (r.recv() for r, _ in outs)
    for p in (a, b):
        p.join(30)
        assert p.exitcode == 0
    assert claimed_a  # A held the queue
    assert not claimed_b  # B found A's claim: shared, through the store
    _check_per_producer(got_a)
    _check_per_producer(got_b)
    assert sorted(got_a + got_b) == [(0, i) for i in range(n)]
    time.sleep(2 * 0.02)
    q.put("last")  # the producer's next look finds the claim gone: the list, for good
    assert q.get(timeout=10) == "last"
    assert not _switched(q)
    assert q._consumer is not None and q._consumer.claim is None


def test_a_busy_holder_gives_its_claim_up_from_a_thread() -> None:
    q: queues.Queue = mp.Queue()
    out_r, out_w = mp.Pipe(duplex=False)
    wake = mp.Event()
    a = _start(_get_one_then_sleep, q, out_w, wake)
    q.put((0, 0))
    assert out_r.recv() == (0, 0)  # A holds the queue, and gets no more
    i = 1
    deadline = time.monotonic() + 60
    while not _switched(q):
        assert time.monotonic() < deadline, "never switched"
        q.put((0, i))
        i += 1
        time.sleep(0.002)
    for _ in range(2000):  # straight to A, which is not reading
        q.put((0, i))
        i += 1
    got = [q.get(timeout=60) for _ in range(i - 1)]  # the second consumer: this process
    assert got == [(0, k) for k in range(1, i)]
    wake.set()
    assert out_r.recv() is False  # A's thread gave the claim up
    a.join(30)
    assert a.exitcode == 0
    with pytest.raises(Empty):
        q.get(timeout=0.2)


def test_put_never_waits_for_a_consumer_that_does_not_read() -> None:
    q: queues.Queue = mp.Queue()
    out_r, out_w = mp.Pipe(duplex=False)
    wake = mp.Event()
    a = _start(_get_one_then_sleep, q, out_w, wake)
    q.put(0)
    assert out_r.recv() == 0
    _wait_for(lambda: q.put(0) is None and _switched(q), "never switched")
    blob = b"x" * 65536
    for i in range(400):  # 26 MB for a holder that reads nothing: more than its socket takes
        q.put((i, blob))
    wake.set()  # only now: the puts above returned without it
    assert out_r.recv() is True
    a.join(30)  # A exits holding the claim: what it did not read goes back to the list
    got = []
    while True:
        try:
            got.append(q.get(timeout=5))
        except Empty:
            break
    assert got[0] == 0 and all(g == 0 for g in got[: got.index((0, blob))])
    assert [g for g in got if g != 0] == [(i, blob) for i in range(400)]


def test_holder_exiting_normally_gives_back_what_came_directly() -> None:
    q: queues.Queue = mp.Queue()
    out_r, out_w = mp.Pipe(duplex=False)
    p = _start(_consume_some, q, 100, out_w)
    n = 3000
    for i in range(n):
        q.put((0, i))
        if i % 100 == 0:
            time.sleep(0.005)
    got, claimed = out_r.recv()
    p.join(30)
    assert claimed and p.exitcode == 0
    rest = []
    while True:
        try:
            rest.append(q.get(timeout=2))
        except Empty:
            break
    _check_per_producer(got + rest)
    assert sorted(got + rest) == [(0, i) for i in range(n)]


def test_killed_consumer_loses_only_what_it_held_and_the_next_one_takes_over() -> None:
    q: queues.Queue = mp.Queue()
    out_r, out_w = mp.Pipe(duplex=False)
    a = _start(_consume_forever, q, out_w)
    i = 0
    while not _switched(q):  # this producer now sends straight to A
        q.put((0, i))
        i += 1
        time.sleep(0.002)
    for _ in range(200):
        q.put((0, i))
        i += 1
    a.kill()
    a.join(30)
    got_a = []
    while out_r.poll(0.5):
        got_a.append(out_r.recv())
    cut = i
    for _ in range(500):  # the feeder finds A gone, and goes back to the list
        q.put((0, i))
        i += 1
        time.sleep(0.001)
    _wait_for(lambda: not _switched(q), "the producer kept sending to a dead consumer")
    time.sleep(0.5)
    tail = i
    for _ in range(200):
        q.put((0, i))
        i += 1
    rest = []
    while True:  # this process, the next consumer, replaces the dead claim
        try:
            rest.append(q.get(timeout=2))
        except Empty:
            break
    assert q._consumer is not None and q._consumer.claim is not None
    _check_per_producer(got_a)
    _check_per_producer(rest)
    assert not set(got_a) & set(rest)  # nothing twice
    assert {(0, k) for k in range(tail, i)} <= set(rest)  # everything after the fall-back
    lost = {(0, k) for k in range(cut)} - set(got_a) - set(rest)
    assert len(lost) <= cut  # what A held when it was killed (the stdlib's would be 1)
    q.close()


def test_killed_producers_leave_ordered_prefixes() -> None:
    q: queues.Queue = mp.Queue()
    with pytest.raises(Empty):
        q.get(timeout=0.05)  # claimed here
    procs = [_start(_produce_forever, q, who) for who in range(3)]
    got = [q.get(timeout=60) for _ in range(3000)]
    deadline = time.monotonic() + 60
    while not (q._consumer and len(q._consumer.opened) == 3):  # all three go direct
        assert time.monotonic() < deadline, "not all switched"
        got.append(q.get(timeout=60))
    got.extend(q.get(timeout=60) for _ in range(3000))
    for p in procs:
        p.kill()
    for p in procs:
        p.join(30)
    while True:
        try:
            got.append(q.get(timeout=2))
        except Empty:
            break
    seqs = _check_per_producer(got)
    for who, seq in seqs.items():
        assert seq == list(range(len(seq))), f"producer {who}: a gap"
    q.put("after")
    assert q.get(timeout=10) == "after"


def test_queue_passed_to_pool_workers() -> None:
    q: queues.Queue = mp.Queue()
    with pytest.raises(Empty):
        q.get(timeout=0.05)
    with mp.Pool(2) as pool:
        assert sorted(pool.starmap(_square_into, [(q, x) for x in range(200)])) == list(range(200))
        got = sorted(q.get(timeout=60) for _ in range(200))
    assert got == sorted(x * x for x in range(200))
    with pytest.raises(Empty):
        q.get(timeout=0.2)


def test_joinable_queue_counts_across_the_switch() -> None:
    jobs: queues.JoinableQueue = mp.JoinableQueue()
    results: queues.Queue = mp.Queue()
    p = _start(_join_worker, jobs, results)
    for i in range(500):
        jobs.put(i)
        if i % 100 == 0:
            time.sleep(0.01)
    jobs.put(None)
    jobs.join()
    got = [results.get(timeout=10) for _ in range(500)]
    assert got == [i + 1 for i in range(500)]
    p.join(30)
    assert p.exitcode == 0


def test_bounded_queues_stay_in_the_store() -> None:
    q: queues.Queue = mp.Queue(maxsize=3)
    assert q._consumer is None and q._producer is None
    q.put(1)
    assert q.get(timeout=5) == 1


def test_direct_off_keeps_everything_in_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIMBUS_MESSAGING_DIRECT", "0")
    q: queues.Queue = mp.Queue()
    reports = mp.SimpleQueue()
    p = _start(_produce, q, 0, 1000, reports)
    got = [q.get(timeout=60) for _ in range(1000)]
    assert got == [(0, i) for i in range(1000)]
    assert reports.get() == (0, False)
    p.join(30)
    assert q._consumer is not None and q._consumer.claim is None
