"""Pipes that switch to direct messaging between nimbus processes, and fall back.

Real ``nimbus.multiprocessing`` processes, real sockets and the real embedded
state store. Each test checks what the user sees (every message once, in
order, then EOF) and, through the ends' private state, which path was taken.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from typing import Any

import numpy as np
import pytest

import nimbus.multiprocessing as mp
from nimbus.multiprocessing import connection
from nimbus.statestore import link

pytestmark = pytest.mark.timeout(120)

N = 5000


# -- children (module level: found by reference) -----------------------------


def _echo(conn: connection.Connection) -> None:
    while True:
        try:
            conn.send_bytes(conn.recv_bytes())  # objects travel as their pickles
        except EOFError:
            return


def _flood(w: connection.Connection, start: int, n: int, report: bool) -> None:
    for i in range(start, start + n):
        w.send(i)
        if i % 500 == 0:
            time.sleep(0.005)  # let the writer look at the holder mid-flood
    if report:
        w.send(("switched", w._writer is not None and w._writer.peer is not None))
    w.close()


def _switch_then_flood(w: connection.Connection, start: int, n: int) -> None:
    """Send "warm" until the writer has switched (its reader must claim the lane first:
    it does when it waits on it), then flood as above: every number goes directly."""
    deadline = time.monotonic() + 30
    while w._writer is not None and w._writer.peer is None and time.monotonic() < deadline:
        w.send("warm")
        time.sleep(0.005)
    _flood(w, start, n, True)


def _read_all(r: connection.Connection, out: connection.Connection) -> None:
    got = _drain(r)
    out.send((got, r._reader is not None and r._reader.active()))
    out.close()


def _send_hand_over_send(w: connection.Connection, signal: connection.Connection) -> None:
    for i in range(100):
        w.send(i)
        time.sleep(0.001)
    switched = w._writer is not None and w._writer.peer is not None
    q = mp.Process(target=_flood, args=(w, 1000, 100, False))
    q.start()  # pickling the end reverts it: "R" directly, then the store
    q.join()
    for i in range(200, 210):
        w.send(i)
    w.close()
    signal.send(switched)


def _converse(a: connection.Connection, start: int, n: int, out: connection.Connection) -> None:
    got = []
    for i in range(start, start + n):
        a.send(i)
        got.append(a.recv())
    out.send(got)
    a.close()


def _send_then_hang(w: connection.Connection) -> None:
    for i in range(50):
        w.send(i)
        time.sleep(0.002)
    w.send(("switched", w._writer is not None and w._writer.peer is not None))
    time.sleep(60)


def _recv_one_then_hang(r: connection.Connection) -> None:
    r.recv()
    time.sleep(60)


# -- helpers -----------------------------------------------------------------


def _drain(r: connection.Connection) -> list[Any]:
    got = []
    while True:
        try:
            got.append(r.recv())
        except EOFError:
            return got


def _start(target: Any, *args: Any) -> Any:
    p = mp.Process(target=target, args=args)
    p.start()
    return p


def _hand_to_reader(r: connection.Connection) -> tuple[Any, connection.Connection]:
    """A child that reads ``r`` to its end (this copy closed), and where its list comes."""
    out_r, out_w = mp.Pipe(duplex=False)
    p = _start(_read_all, r, out_w)  # pickling a held end gives the claim up
    r.close()
    out_w.close()
    return p, out_r


# -- tests -------------------------------------------------------------------


def _echo_child(rounds: int) -> tuple[connection.Connection, Any]:
    """A Pipe end to an echoing child, after ``rounds`` round trips."""
    a, b = mp.Pipe()
    p = _start(_echo, b)
    b.close()
    for i in range(rounds):
        a.send(i)
        assert a.recv() == i
    assert a._writer is not None and a._writer.peer is not None  # parent -> child: direct
    return a, p


def test_echo_goes_direct_in_both_directions_and_ends_with_eof() -> None:
    a, p = _echo_child(300)
    assert a._reader is not None and a._reader.active()  # child -> parent: direct
    a.send_bytes(b"raw")
    buf = bytearray(10)
    assert a.recv_bytes_into(buf, 2) == 3 and buf[2:5] == b"raw"
    assert not a.poll(0)
    a.send([1, 2])
    assert a.poll(10)
    assert a.recv() == [1, 2]
    a.close()  # the child's recv ends with EOF (sent directly), and it exits
    p.join(30)
    assert p.exitcode == 0


def test_a_direct_round_trip_takes_the_common_case_and_leaves_nothing_pending() -> None:
    """The per-message fast path: one switched writer (``solo``), and a writer's entry
    leaves ``pending`` once delivered, so nothing is left to look at per message."""
    a, p = _echo_child(300)
    reader = a._reader
    assert reader is not None and reader.solo is not None and reader.solo in reader.opened
    assert reader.pending == {}
    for _ in range(200):
        a.send(b"x" * 1024)
        assert a.recv() == b"x" * 1024
    assert reader.pending == {} and reader.solo is not None
    a.close()
    p.join(30)
    assert p.exitcode == 0


def _echo_and_time_waits(conn: connection.Connection) -> None:
    """Echo; ("sleep", s) is answered after s seconds; "cpu" with the CPU seconds this
    process (all its threads) spent while it waited for that "cpu"."""
    before = time.process_time()
    while True:
        obj = conn.recv()
        waited = time.process_time() - before
        if obj is None:
            return
        if isinstance(obj, tuple):
            time.sleep(obj[1])
        conn.send(waited if obj == "cpu" else obj)
        before = time.process_time()


def test_an_idle_direct_pipe_costs_no_cpu_on_either_side() -> None:
    """A reader's spin before it sleeps (``messaging._receiving._spin``) is bounded and
    backs off: a direct Pipe that waits 1.5 s costs its reader (parent or child)
    next to no CPU, after a ping-pong that spins."""
    a, b = mp.Pipe()
    p = _start(_echo_and_time_waits, b)
    for i in range(500):
        a.send(i)
        assert a.recv() == i
    assert a._reader is not None and a._reader.active()
    assert a._writer is not None and a._writer.peer is not None
    t0, c0 = time.monotonic(), time.process_time()
    a.send(("sleep", 1.5))  # this process waits in recv for 1.5 s
    assert a.recv() == ("sleep", 1.5)
    parent_cpu, waited = time.process_time() - c0, time.monotonic() - t0
    time.sleep(1.5)  # the child waits in recv for 1.5 s
    a.send("cpu")
    child_cpu = a.recv()
    a.send(None)
    p.join(30)
    assert p.exitcode == 0
    assert waited >= 1.5
    assert parent_cpu < 0.1, parent_cpu  # measured: ~0.01 s
    assert child_cpu < 0.1, child_cpu


def test_large_objects_and_arrays_travel_directly_unframed() -> None:
    r, w = mp.Pipe(duplex=False)
    p, out_r = _hand_to_reader(r)
    deadline = time.monotonic() + 30
    while w._writer is not None and w._writer.peer is None:  # until the switch
        assert time.monotonic() < deadline, "the writer never switched"
        w.send("warm")
        time.sleep(0.005)
    big = os.urandom(300_000)
    arr = np.arange(100_000, dtype=np.float64)
    w.send((big, arr, "tail"))
    w.send_bytes(pickle.dumps(arr, protocol=5))  # a pickle sent as bytes, read as an object
    w.close()
    got, direct = out_r.recv()  # back over a pipe that switched too: large, unframed
    p.join(30)
    assert direct
    assert set(got[:-2]) == {"warm"}
    assert got[-2][0] == big and got[-2][2] == "tail"
    assert np.array_equal(got[-2][1], arr)
    assert np.array_equal(got[-1], arr)


def test_flood_keeps_order_and_exactly_once_across_the_switch() -> None:
    r, w = mp.Pipe(duplex=False)
    p = _start(_flood, w, 0, N, True)
    w.close()
    got = _drain(r)
    p.join(30)
    assert got[:-1] == list(range(N))
    assert got[-1] == ("switched", True)
    with pytest.raises(EOFError):  # end of stream stays
        r.recv()


def test_many_writers_to_one_reader_through_the_store() -> None:
    r, w = mp.Pipe(duplex=False)
    procs = [_start(_flood, w, k * 1000, 1000, False) for k in range(3)]
    w.close()
    got = _drain(r)
    for p in procs:
        p.join(30)
    assert sorted(got) == list(range(3000))
    for k in range(3):  # each writer's messages in its order
        mine = [x for x in got if k * 1000 <= x < (k + 1) * 1000]
        assert mine == sorted(mine)
    # while several copies of the writing end are open, it stays in the store; the
    # last one left may switch (that is fine: it is then the only writer)


def test_wait_over_direct_and_store_connections() -> None:
    """wait() over three pipes read directly and one read through the store.

    A writer switches only once its reader has claimed the lane, which this
    process does when it first waits, after starting all three writers and
    closing its copies. A writer that had sent its 1000 numbers by then (30 to
    150 ms of flood) never switched, and the test failed with ('switched',
    False): alone, each child first imports this module (hundreds of ms, time
    enough to claim), but in a full run the warm workers have imported it
    already and flood at once, so a reader a little late to its first wait
    lost. So each writer sends "warm" until it has switched, then its numbers.
    """
    pipes = [mp.Pipe(duplex=False) for _ in range(3)]
    procs = [_start(_switch_then_flood, w, k * 1000, 1000) for k, (_, w) in enumerate(pipes)]
    for _, w in pipes:
        w.close()
    a, b = mp.Pipe()  # stays in the store: written and read here
    b.send("local")
    readers = [r for r, _ in pipes]
    got: dict[int, list[Any]] = {k: [] for k in range(3)}
    local = []
    open_ = [*readers, a]
    while open_:
        for conn in connection.wait(open_, 30):
            try:
                item = conn.recv()
            except EOFError:
                open_.remove(conn)
                continue
            if conn is a:
                local.append(item)
                a.close()
                open_.remove(a)
            else:
                got[readers.index(conn)].append(item)
    for p in procs:
        p.join(30)
    assert local == ["local"]
    for k in range(3):
        warm = got[k].count("warm")
        assert got[k][:warm] == ["warm"] * warm
        assert got[k][warm:-1] == list(range(k * 1000, (k + 1) * 1000))
        assert got[k][-1] == ("switched", True)


def test_reader_handed_to_another_process_mid_stream() -> None:
    r, w = mp.Pipe(duplex=False)
    writer = _start(_flood, w, 0, N, True)
    w.close()
    first = [r.recv() for _ in range(1500)]
    assert r._reader is not None and r._reader.claim is not None  # read directly so far
    reader, out_r = _hand_to_reader(r)
    rest, _ = out_r.recv()
    writer.join(30)
    reader.join(30)
    assert first + rest[:-1] == list(range(N))
    assert rest[-1][0] == "switched"  # the writer may or may not switch to the new reader


def test_writer_reverts_while_the_reader_hands_its_end_over() -> None:
    r, w = mp.Pipe(duplex=False)
    signal_r, signal_w = mp.Pipe(duplex=False)
    writer = _start(_send_hand_over_send, w, signal_w)
    w.close()
    signal_w.close()
    first = [r.recv() for _ in range(10)]  # claims; the rest waits here, unread
    assert signal_r.recv() is True  # the writer had switched, then reverted
    reader, out_r = _hand_to_reader(r)
    rest, _ = out_r.recv()
    writer.join(30)
    reader.join(30)
    assert first + rest == [*range(100), *range(1000, 1100), *range(200, 210)]


def test_writer_handed_to_another_process() -> None:
    a, p = _echo_child(200)
    assert a._writer is not None
    r, w = mp.Pipe(duplex=False)
    q = _start(_flood, a, 1000, 500, False)  # a second writer: it switches too
    assert a._writer.peer is not None  # a copy handed on is no use of this one
    w.close()
    got = [a.recv() for _ in range(500)]
    assert got == list(range(1000, 1500))
    q.join(30)
    a.send("last")
    assert a.recv() == "last"
    a.close()
    p.join(30)
    r.close()


def test_both_ends_of_a_duplex_conversation_handed_over() -> None:
    a, p = _echo_child(300)  # both directions direct
    assert a._reader is not None and a._reader.active()
    out_r, out_w = mp.Pipe(duplex=False)
    q = _start(_converse, a, 1000, 500, out_w)  # pickling gives up one, reverts the other
    a.close()
    out_w.close()
    assert out_r.recv() == list(range(1000, 1500))
    q.join(30)
    p.join(30)  # the echo child saw EOF when the conversation's end closed
    assert p.exitcode == 0


def test_competing_readers_share_the_stream() -> None:
    r, w = mp.Pipe(duplex=False)
    outs = [mp.Pipe(duplex=False) for _ in range(2)]
    procs = [_start(_read_all, r, ow) for _, ow in outs]
    r.close()
    for _, ow in outs:
        ow.close()
    for i in range(2000):
        w.send(i)
    w.close()
    results = [orr.recv() for orr, _ in outs]
    for p in procs:
        p.join(30)
    lists = [got for got, _ in results]
    assert sorted(lists[0] + lists[1]) == list(range(2000))
    for got in lists:
        assert got == sorted(got)


def test_writer_killed_mid_conversation_gives_eof() -> None:
    r, w = mp.Pipe(duplex=False)
    p = _start(_send_then_hang, w)
    w.close()
    assert [r.recv() for _ in range(50)] == list(range(50))
    assert r.recv() == ("switched", True)
    p.kill()
    with pytest.raises(EOFError):  # the only writer is gone (the store alone would hang)
        r.recv()
    p.join(30)


def test_reader_killed_sends_fall_back() -> None:
    r, w = mp.Pipe(duplex=False)
    p = _start(_recv_one_then_hang, r)
    r.close()
    deadline = time.monotonic() + 30
    while w._writer is not None and w._writer.peer is None:
        assert time.monotonic() < deadline, "the writer never switched"
        w.send(0)
        time.sleep(0.005)
    p.kill()
    p.join(30)
    for i in range(200):  # a send to a gone reader is dropped, as before: no error
        w.send(i)
        time.sleep(0.001)
    assert w._writer.peer is None
    w.close()


def _sleep_send_close(child: connection.Connection) -> None:
    time.sleep(0.5)
    child.send(123)
    child.close()


def test_a_default_socket_timeout_changes_nothing() -> None:
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(0.1)  # as CPython's TestTimeouts does, before the first recv
    try:
        parent, child = mp.Pipe()
        p = _start(_sleep_send_close, child)
        child.close()
        assert parent.recv() == 123
        with pytest.raises(EOFError):
            parent.recv()
        parent.close()
        p.join(30)
    finally:
        socket.setdefaulttimeout(old)


def test_direct_off_keeps_everything_in_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIMBUS_MESSAGING_DIRECT", "0")
    r, w = mp.Pipe(duplex=False)
    p = _start(_flood, w, 0, 1000, True)
    w.close()
    got = _drain(r)
    p.join(30)
    assert got == [*range(1000), ("switched", False)]
    assert r._reader is not None and r._reader.claim is None


# -- the stdlib documentation's idiom: the parent keeps its copy of the child's end --


def _read_k_then_exit(b: connection.Connection, k: int) -> None:
    got = [b.recv() for _ in range(k)]
    b.send(("read", got))  # and exits: its copy closes


def test_the_documentation_idiom_goes_direct_both_ways() -> None:
    a, b = mp.Pipe()
    p = _start(_echo, b)  # no b.close(): the parent keeps a copy it never uses
    deadline = time.monotonic() + 30
    while not (a._writer.peer is not None and a._reader.active()):
        assert time.monotonic() < deadline, "the idiom never went direct"
        a.send("warm")
        assert a.recv() == "warm"
    store = link(a._program)
    lists = [a._read_key, a._write_key]
    for i in range(300):
        a.send(i)
        assert a.recv() == i
    assert store.call(*(("LLEN", key) for key in lists)) == [0, 0]  # nothing went there
    assert a._reader.opened  # the child's messages came over its socket
    a.close()  # a's only copy: end-of-stream to the child, directly
    p.join(30)
    assert p.exitcode == 0
    b.close()


def test_the_parent_later_reads_its_copy_in_order() -> None:
    a, b = mp.Pipe()
    p = _start(_read_k_then_exit, b, 300)
    for i in range(1000):  # direct to the child once it claimed its direction
        a.send(i)
    tag, got = a.recv()
    assert tag == "read" and got == list(range(300))
    p.join(30)
    rest = [b.recv() for _ in range(700)]  # the parent's copy reads on, in order
    assert rest == list(range(300, 1000))
    assert not b.poll(0.2)
    a.close()
    b.close()


def test_the_parent_later_writes_on_its_copy_in_order() -> None:
    a, b = mp.Pipe()
    p = _start(_flood, b, 0, 2000, True)  # the child writes to a through b ...
    got: list[Any] = []
    for i in range(500):  # ... and so does the parent, on its copy, meanwhile
        b.send(("parent", i))
    while len(got) < 2501:
        got.append(a.recv())
    p.join(30)
    mine = [x[1] for x in got if isinstance(x, tuple) and x[0] == "parent"]
    theirs = [x for x in got if isinstance(x, int)]
    assert mine == list(range(500))
    assert theirs == list(range(2000))
    a.close()
    b.close()


def _take_turns(barrier: Any, lock: Any, w: connection.Connection, passes: int) -> None:
    for i in range(passes):
        barrier.wait()
        with lock:
            w.send(i)


def test_writers_taking_turns_keep_the_order_of_their_turns() -> None:
    """Several processes write one direction in turns (a barrier between passes):
    the reader sees every pass before the next, as through an OS pipe. A second
    writing process takes the direction back to the store, in order."""
    r, w = mp.Pipe(duplex=False)
    n, passes = 3, 150
    barrier, lock = mp.Barrier(n), mp.Lock()
    procs = [_start(_take_turns, barrier, lock, w, passes) for _ in range(n)]
    w.close()
    got = [r.recv() for _ in range(n * passes)]
    for p in procs:
        p.join(30)
    assert got == [i for i in range(passes) for _ in range(n)]


def _echo_then_idle(conn: connection.Connection, idle: Any) -> None:
    """Echo until None, then stay alive without writing (a switched writer that is
    silent) until ``idle`` is set."""
    while (obj := conn.recv()) is not None:
        conn.send(obj)
    idle.wait(60)


def _round_trips(a: connection.Connection, n: int = 100) -> float:
    """Seconds that ``n`` 1 KB round trips on ``a`` take (stalls count)."""
    msg = b"x" * 1024
    t0 = time.perf_counter()
    for _ in range(n):
        a.send(msg)
        assert a.recv() == msg
    return time.perf_counter() - t0


def _documentation_pipe() -> tuple[connection.Connection, connection.Connection, Any]:
    a, b = mp.Pipe()
    p = _start(_echo, b)  # no b.close(), as in the stdlib documentation
    deadline = time.monotonic() + 30
    while not (a._writer.peer is not None and a._reader.active()):
        assert time.monotonic() < deadline, "the idiom never went direct"
        a.send(b"warm")
        assert a.recv() == b"warm"
    return a, b, p


@pytest.mark.parametrize("first", ["finished", "silent"])
def test_closing_another_pipes_end_leaves_a_direct_pipe_fast(first: str) -> None:
    """Closing (or dropping) the parent's end of another direct Pipe gives its claim up
    and forwards what its writer still sends directly; that must not slow a live
    Pipe's round trips (issue 16: 1.6-2.7 ms against 60-120 us, for as long as the
    forwarder waited: it held the sockets in 0.1 s polls, the Pipe's reads waited). The other Pipe's
    child has exited (``finished``: nothing to wait for), or lives and is silent."""
    idle = mp.Event()
    a1, b1 = mp.Pipe()
    p1 = _start(_echo_then_idle, b1, idle)
    for _ in range(50):
        a1.send(b"warm")
        assert a1.recv() == b"warm"
    assert a1._reader.active()  # the child writes to the parent's claim directly
    a1.send(None)
    if first == "finished":
        idle.set()
        p1.join(30)
    a2, b2, p2 = _documentation_pipe()
    before = min(_round_trips(a2) for _ in range(3))
    a1.close()  # its claim given up, with the child's writer switched to it
    after = _round_trips(a2)  # at once: a forwarder of a finished Pipe lived 0.5 s
    a2.close()
    idle.set()
    for p in (p1, p2):
        p.join(30)
        assert p.exitcode == 0
    b1.close()
    b2.close()
    # 100 round trips measured 0.2-1.6 s after (stalls of up to 0.1 s), 2-10 ms before
    assert after < 3 * before + 0.03, (before, after)
