"""One conformance suite for the switch to direct messaging, run on Pipes and Queues.

A Pipe's direction and a Queue are the same thing seen from here: writers put
items, readers take them, and under the hood the one reader may be sent to
directly while the state store holds everything else. Whatever path each item
takes, a user sees the same: every item once, each writer's items in order,
across the switch, across a reader exiting or being killed, across a second
reader or writer appearing, and timeouts that time out. Real processes, real
sockets, the real embedded store; nothing is mocked.

Each test takes a ``kind`` ("pipe" or "queue") and builds one direction with
:func:`_make`: ``(rx, tx)``, the reading and the writing side (the same Queue
twice). The children below speak to both through :func:`_put` and :func:`_get`.
"""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Iterator
from typing import Any

import pytest

import nimbus.multiprocessing as mp
from nimbus.multiprocessing import connection

pytestmark = pytest.mark.timeout(180)

KINDS = ["pipe", "queue"]
N = 3000
NOTHING = object()  # nothing came in time
END = object()  # end of stream (a Pipe whose writers are all closed)


# -- one direction, two kinds ------------------------------------------------


def _make(kind: str) -> tuple[Any, Any]:
    if kind == "pipe":
        return mp.Pipe(duplex=False)
    q = mp.Queue()
    return q, q


def _put(tx: Any, item: Any) -> None:
    if isinstance(tx, connection.Connection):
        tx.send(item)
    else:
        tx.put(item)


def _get(rx: Any, timeout: float | None = 30.0) -> Any:
    """The next item, NOTHING if none came within ``timeout``, END at end of stream."""
    try:
        if isinstance(rx, connection.Connection):
            if not rx.poll(timeout):
                return NOTHING
            return rx.recv()
        return rx.get(timeout=timeout)
    except EOFError:
        return END
    except queue.Empty:
        return NOTHING


def _switched(tx: Any) -> bool:
    """Whether this process's writing side sends directly now."""
    if isinstance(tx, connection.Connection):
        return tx._writer is not None and tx._writer.peer is not None
    return tx._producer is not None and tx._producer.peer is not None


def _close_here(end: Any) -> None:
    """Close this process's copy of a Pipe end (a Queue has no copies to close)."""
    if isinstance(end, connection.Connection):
        end.close()


def _drop_copy(kind: str, end: Any) -> None:
    """After handing ``end`` to a child: the parent's copy goes where a test wants the
    child's to be the only one (the stdlib documentation's idiom keeps it: see
    test_mp_direct's tests of the idiom)."""
    if kind == "pipe":
        end.close()


# -- children (module level: found by reference) -----------------------------


def _flood(tx: Any, start: int, n: int, tag: Any) -> None:
    """``n`` numbers (tagged, if ``tag``), then whether it went direct, then None."""
    for i in range(start, start + n):
        _put(tx, i if tag is None else (tag, i))
        if i % 200 == 0:
            time.sleep(0.003)  # let the writer look at the claim mid-flood
    _put(tx, ("switched", _switched(tx)))
    _put(tx, None)


def _flood_forever(tx: Any) -> None:
    i = 0
    while True:
        _put(tx, i)
        i += 1
        time.sleep(0.0005)


def _read_some_then_exit(rx: Any, k: int, out: connection.Connection) -> None:
    got = [_get(rx) for _ in range(k)]
    out.send(got)
    out.close()


def _read_some_then_hang(rx: Any, k: int, out: connection.Connection) -> None:
    got = [_get(rx) for _ in range(k)]
    out.send(got)
    time.sleep(120)


def _read_to_none(rx: Any, out: connection.Connection) -> None:
    got = []
    while True:
        item = _get(rx)
        if item is None or item is END or item is NOTHING:
            break
        got.append(item)
    out.send(got)
    out.close()


def _warm_then_wait(tx: Any, hold: connection.Connection) -> None:
    """Put "warm" until switched, say so, then stay (switched, silent) until told."""
    deadline = time.monotonic() + 30
    while not _switched(tx) and time.monotonic() < deadline:
        _put(tx, "warm")
        time.sleep(0.005)
    _put(tx, ("switched", _switched(tx)))
    hold.poll(60)


# -- helpers -----------------------------------------------------------------


@pytest.fixture(autouse=True)
def _stop_leftover_children() -> Iterator[None]:
    """A failed test leaves no child running: all are killed, then each is joined."""
    yield
    leftover = mp.active_children()
    for child in leftover:
        child.kill()
    for child in leftover:
        child.join(30)


def _start(target: Any, *args: Any) -> Any:
    p = mp.Process(target=target, args=args)
    p.start()
    return p


def _read_until_none(rx: Any) -> tuple[list[Any], list[Any]]:
    """The numbers read up to None, and the reports (tuples) among them."""
    got, reports = [], []
    while True:
        item = _get(rx)
        assert item is not NOTHING, f"stalled after {len(got)} items"
        if item is None:
            return got, reports
        (reports if isinstance(item, tuple) else got).append(item)


def _increasing(seq: list[int]) -> bool:
    return all(a < b for a, b in itertools.pairwise(seq))


# -- the protocol ------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_order_and_once_across_the_switch(kind: str) -> None:
    rx, tx = _make(kind)
    assert _get(rx, 0.05) is NOTHING  # this process reads: it claims the direction
    p = _start(_flood, tx, 0, N, None)
    _drop_copy(kind, tx)
    got, reports = _read_until_none(rx)
    assert got == list(range(N))
    assert reports == [("switched", True)]  # the writer went direct mid-flood
    p.join(30)
    assert p.exitcode == 0


@pytest.mark.parametrize("kind", KINDS)
def test_writer_exiting_at_once_loses_nothing(kind: str) -> None:
    """The writer's last direct items are still on their way as it exits."""
    rx, tx = _make(kind)
    assert _get(rx, 0.05) is NOTHING
    for round_ in range(3):
        p = _start(_flood, tx, round_ * N, N, None)
        got, _ = _read_until_none(rx)
        assert got == list(range(round_ * N, (round_ + 1) * N))
        p.join(30)
    _drop_copy(kind, tx)


@pytest.mark.parametrize("kind", KINDS)
def test_reader_exiting_mid_stream_hands_the_rest_on(kind: str) -> None:
    """A reader that exits normally while a writer sends to it directly: what came to
    it and was not read goes back (at exit), and the next reader reads on, in order."""
    rx, tx = _make(kind)
    writer = _start(_flood, tx, 0, N, None)
    _drop_copy(kind, tx)
    out_r, out_w = mp.Pipe(duplex=False)
    reader = _start(_read_some_then_exit, rx, 500, out_w)
    out_w.close()
    first = out_r.recv()
    reader.join(30)
    assert reader.exitcode == 0
    rest, _ = _read_until_none(rx)  # this process's copy of the reading end reads on
    assert first + rest == list(range(N))
    writer.join(30)


@pytest.mark.parametrize("kind", KINDS)
def test_killed_writer_leaves_an_ordered_prefix(kind: str) -> None:
    rx, tx = _make(kind)
    assert _get(rx, 0.05) is NOTHING
    p = _start(_flood_forever, tx)
    _drop_copy(kind, tx)
    got = [_get(rx) for _ in range(500)]
    p.kill()
    p.join(30)
    while True:  # what it sent arrives; then end of stream (a Pipe) or nothing more
        item = _get(rx, 3.0)
        if item is END or item is NOTHING:
            break
        got.append(item)
    assert got == list(range(len(got)))


@pytest.mark.parametrize("kind", KINDS)
def test_killed_reader_the_next_reader_reads_on(kind: str) -> None:
    """A killed reader loses at most what it held; nothing comes twice and the writer's
    later items reach the next reader, in order."""
    rx, tx = _make(kind)
    writer = _start(_flood_forever, tx)
    _drop_copy(kind, tx)
    out_r, out_w = mp.Pipe(duplex=False)
    reader = _start(_read_some_then_hang, rx, 300, out_w)
    out_w.close()
    first = out_r.recv()
    assert first == list(range(300))
    reader.kill()
    reader.join(30)
    rest = [_get(rx) for _ in range(300)]
    assert NOTHING not in rest, "the next reader got stuck"
    assert rest[0] >= 300 and _increasing(rest)
    writer.kill()
    writer.join(30)


@pytest.mark.parametrize("kind", KINDS)
def test_a_second_reader_shares_the_stream(kind: str) -> None:
    """A second process reading mid-stream: every item once, each reader in order."""
    rx, tx = _make(kind)
    out_r, out_w = mp.Pipe(duplex=False)
    reader = _start(_read_to_none, rx, out_w)
    out_w.close()
    writer = _start(_flood, tx, 0, N, None)
    mine: list[Any] = []
    time.sleep(0.3)  # the first reader (and maybe the switch) had time
    while True:  # up to the writer's None, or until the other reader took it
        item = _get(rx, 5.0)
        if item is None or item is NOTHING:
            break
        mine.append(item)
    writer.join(30)
    _put(tx, None)  # this process writes too: the other reader's None (if it still reads)
    _drop_copy(kind, tx)
    theirs = out_r.recv() if out_r.poll(30) else None
    assert theirs is not None, "the first reader never finished"
    writer.join(30)
    reader.join(30)
    both = [x for x in mine + theirs if isinstance(x, int)]
    assert sorted(both) == list(range(N))
    for seq in (mine, theirs):
        nums = [x for x in seq if isinstance(x, int)]
        assert _increasing(nums)


@pytest.mark.parametrize("kind", KINDS)
def test_a_second_writer_keeps_each_writers_order(kind: str) -> None:
    rx, tx = _make(kind)
    assert _get(rx, 0.05) is NOTHING
    a = _start(_flood, tx, 0, N, "a")
    time.sleep(0.2)  # "a" is sending (and switched, most likely)
    for i in range(500):
        _put(tx, ("b", i))
    _put(tx, None)
    _drop_copy(kind, tx)
    per: dict[str, list[int]] = {"a": [], "b": []}
    nones = 0
    while nones < 2:
        item = _get(rx)
        assert item is not NOTHING
        if item is None:
            nones += 1
        elif item[0] in per:
            per[item[0]].append(item[1])
    assert per == {"a": list(range(N)), "b": list(range(500))}
    a.join(30)


@pytest.mark.parametrize("kind", KINDS)
def test_a_timeout_on_a_direct_reader_times_out(kind: str) -> None:
    rx, tx = _make(kind)
    assert _get(rx, 0.05) is NOTHING
    hold_r, hold_w = mp.Pipe(duplex=False)
    p = _start(_warm_then_wait, tx, hold_r)
    _drop_copy(kind, tx)
    while (item := _get(rx)) == "warm":
        pass
    assert item == ("switched", True)
    for timeout in (0.0, 0.2, 0.6):
        t0 = time.monotonic()
        assert _get(rx, timeout) is NOTHING
        elapsed = time.monotonic() - t0
        assert timeout <= elapsed + 0.01 and elapsed < timeout + 1.0
    hold_w.send(None)
    p.join(30)
    assert p.exitcode == 0
