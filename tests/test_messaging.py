"""nimbus.messaging: instances, the directory, send/recv, faults and collectives.

Real processes (``nimbus.multiprocessing``), real sockets and the real embedded
state store; nothing is mocked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import operator
import os
import pickle
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

import nimbus.messaging as msg
import nimbus.multiprocessing as mp
from nimbus import telemetry
from nimbus.config import Settings
from nimbus.errors import (
    MessageDecodeError,
    MessagingError,
    MessagingTimeout,
    PeerExited,
    PeerLost,
    PeerRefused,
    PeerUnknown,
)
from nimbus.messaging import Directory, Entry, Instance, _peer
from nimbus.messaging._directory import EXITED, socket_dir, socket_path
from nimbus.messaging._receiving import BLOCK, HEARTBEAT, NOTHING, SPIN, SPIN_BACKOFF
from nimbus.messaging._sending import GOODBYE_WAIT
from nimbus.statestore import Program
from nimbus.wire import pack

pytestmark = pytest.mark.timeout(90)

# -- children (module level: found by reference) -----------------------------


def _echo(parent: str) -> None:
    msg.send(parent, msg.instance_id())
    while True:
        obj = msg.recv(source=parent)
        if obj is None:
            return
        msg.send(parent, obj)


def _listen_then_sleep(parent: str) -> None:
    msg.send(parent, msg.instance_id())
    time.sleep(60)


def _collectives(parent: str) -> None:
    me = msg.instance_id()
    msg.send(parent, me)
    group = msg.recv(source=parent)
    rank = group.index(me)
    p = len(group)
    out: dict[str, Any] = {}
    msg.barrier(group)
    out["bcast"] = msg.bcast(group, {"from": rank} if rank == 1 else None, root=1)
    out["scatter"] = msg.scatter(
        group, [f"part{i}" for i in range(p)] if rank == 2 else None, root=2
    )
    out["gather"] = msg.gather(group, rank * 10, root=0)
    out["reduce"] = msg.reduce(group, [rank], operator.add, root=p - 1)  # keeps rank order
    out["allreduce_small"] = msg.allreduce(group, rank + 1)
    rng = np.random.default_rng(rank)
    big = rng.standard_normal(50_000)  # 400 KB: the ring
    out["allreduce_big"] = msg.allreduce(group, big)
    out["allreduce_max"] = msg.allreduce(group, big, np.maximum)
    msg.barrier(group)
    msg.send(parent, (rank, out))


# -- fixtures -----------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _stop_being_an_instance() -> Iterator[None]:
    """The test process stops listening afterwards (its threads would use sockets)."""
    yield
    msg.close()


@pytest.fixture
def instances(program: Program) -> Iterator[Any]:
    """A factory of instances of one program, closed afterwards."""
    made: list[Instance] = []
    sockets = socket_dir(Settings.load().ensure_runtime_dir(), program.program_id)

    def make(
        token: bytes = b"secret",
        instance_id: str | None = None,
        sockets_in: Path | None = None,
        **kw: Any,
    ) -> Instance:
        ep = Instance(
            program.client,
            program.keys,
            token,
            sockets_in or sockets,
            instance_id=instance_id,
            ttl_ms=program.ttl_ms,
            **kw,
        )
        made.append(ep)
        return ep

    yield make
    for ep in made:
        ep.close()
    shutil.rmtree(sockets, ignore_errors=True)


def _start(target: Any, *args: Any) -> tuple[Any, str]:
    p = mp.Process(target=target, args=(msg.instance_id(), *args))
    p.start()
    return p, msg.recv_with_source(timeout=30)[0]


# -- between processes ---------------------------------------------------------


def test_send_recv_between_processes() -> None:
    p, child = _start(_echo)
    try:
        big = os.urandom(3_000_000)  # received straight into a new bytes object
        for obj in (1, "two", {"three": [3.0]}, big, bytearray(big), np.arange(100_000)):
            msg.send(child, obj)
            back = msg.recv(source=child, timeout=30)
            if isinstance(obj, np.ndarray):
                assert np.array_equal(back, obj) and back.flags.writeable  # as the stdlib's
            else:
                assert back == obj and type(back) is type(obj)
        stats = msg.current().statistics()
        assert stats["links_out"] >= 1 and stats["bytes_out"] > 2_000_000
    finally:
        msg.send(child, None)
        p.join(30)
    assert p.exitcode == 0


def test_collectives_match_numpy() -> None:
    procs = [mp.Process(target=_collectives, args=(msg.instance_id(),)) for _ in range(3)]
    for p in procs:
        p.start()
    group = [msg.recv(timeout=30) for _ in procs]
    for each in group:
        msg.send(each, group)
    results = dict(msg.recv(source=each, timeout=60) for each in group)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    bigs = [np.random.default_rng(r).standard_normal(50_000) for r in range(3)]
    for rank, out in results.items():
        assert out["bcast"] == {"from": 1}
        assert out["scatter"] == f"part{rank}"
        assert out["gather"] == ([0, 10, 20] if rank == 0 else None)
        assert out["reduce"] == ([0, 1, 2] if rank == 2 else None)
        assert out["allreduce_small"] == 6
        np.testing.assert_allclose(out["allreduce_big"], bigs[0] + bigs[1] + bigs[2])
        np.testing.assert_array_equal(out["allreduce_max"], np.maximum.reduce(bigs))


def test_peer_killed_mid_conversation_fails_fast() -> None:
    p, child = _start(_echo)
    for i in range(3):
        msg.send(child, i)
        assert msg.recv(source=child, timeout=30) == i
    p.kill()
    p.join(30)
    started = time.monotonic()
    with pytest.raises(PeerLost, match=child):
        msg.recv(source=child, timeout=30)
    assert time.monotonic() - started < HEARTBEAT + 0.5
    with pytest.raises(PeerLost):
        for _ in range(3):  # the first write may still land in the socket buffer
            msg.send(child, "anyone?")


def test_send_to_a_peer_that_exited_normally_is_peer_exited() -> None:
    p, child = _start(_echo)
    msg.send(child, 1)
    assert msg.recv(source=child, timeout=30) == 1
    msg.send(child, None)  # it returns: exit 0, its goodbye sent
    p.join(30)
    assert p.exitcode == 0
    with pytest.raises(PeerExited, match=f"instance {child} has exited .*only while it runs"):
        for _ in range(100):  # a send after a send is queued: a later one raises (within
            msg.send(child, "anyone?")  # 3 sends most times; under load it took more)
            time.sleep(0.1)  # the flusher writes it, finds the link closed


def test_send_or_recv_naming_no_instance_id_says_so() -> None:
    for bogus in ("bogus-id", "", "0123456789ABCDEF", 42, ["a"]):
        with pytest.raises(PeerUnknown, match=r"is not an instance id .*instance_id\(\)"):
            msg.send(bogus, 1)  # type: ignore[arg-type]
    with pytest.raises(PeerUnknown, match="'bogus-id' is not an instance id"):
        msg.recv(source="bogus-id", timeout=0.1)
    with pytest.raises(ValueError, match="'nope' is not"):  # a ValueError, as it is one
        msg.recv_with_source(source="nope", timeout=0.1)


def test_silent_peer_killed_is_noticed_within_a_heartbeat() -> None:
    p, child = _start(_listen_then_sleep)  # it never sends to us again
    p.kill()
    p.join(30)
    started = time.monotonic()
    with pytest.raises(PeerLost):
        msg.recv(source=child, timeout=30)
    assert time.monotonic() - started < 2 * HEARTBEAT + 0.5


def test_a_killed_peer_whose_socket_was_removed_is_not_alive() -> None:
    """A program starting on the host removes the sockets nobody listens on (those of
    killed processes): a killed peer then had only its directory entry, which still
    said alive, so a Queue's next reader never took over its claim (CI: the producer
    kept sending to a dead consumer). Its process is looked at now."""
    p, child = _start(_listen_then_sleep)
    me = msg.current()
    deadline = time.monotonic() + 10
    while me.directory.refresh(child) is None:  # published (for peers elsewhere)
        assert time.monotonic() < deadline, "never published"
        time.sleep(0.005)
    p.kill()
    p.join(30)
    socket_path(me._sockdir, child).unlink()  # as the starting program's sweep does
    assert me.directory.refresh(child).state == "alive"  # type: ignore[union-attr]
    assert not me.alive(child)


# -- one process, several instances ------------------------------------------------


def test_peer_never_starts_goes_to_the_store_then_times_out(
    instances: Any, program: Program
) -> None:
    a = instances()
    a.send("ghost", "hello")  # nobody listens: kept in the store for it
    assert program.client().llen(program.keys.inbox("ghost")) == 1
    started = time.monotonic()
    with pytest.raises(MessagingTimeout, match="ghost never became addressable"):
        a.recv(source="ghost", timeout=0.3)
    assert 0.25 < time.monotonic() - started < 2.0


def test_a_negative_timeout_is_refused_as_queue_get_refuses_it(instances: Any) -> None:
    """recv(timeout=-1): a ValueError, as ``queue.Queue.get``'s (stranger 7 F7: it waited
    and said "no message from any instance within -1 s")."""
    import queue

    with pytest.raises(ValueError, match="non-negative"):
        queue.Queue().get(timeout=-1)
    a = instances()
    with pytest.raises(ValueError, match=r"timeout must be a non-negative number, not -1"):
        a.recv(timeout=-1)
    with pytest.raises(MessagingTimeout, match="within 0 s"):  # 0: a look, no wait
        a.recv(timeout=0)


def test_switch_from_store_to_socket_keeps_order_exactly_once(instances: Any) -> None:
    a = instances()
    for i in range(100):
        a.send("late", i)  # "late" has no socket yet: through the store
    b = instances(instance_id="late")
    time.sleep(0.01)  # past the retry interval: the next send connects
    for i in range(100, 200):
        a.send("late", i)
    assert a.statistics()["links_out"] == 1
    got = [b.recv(source=a.id, timeout=10) for _ in range(200)]
    assert got == list(range(200))
    with pytest.raises(MessagingTimeout):
        b.recv(timeout=0.2)


def test_wrong_token_is_refused_and_logged(
    instances: Any, caplog: pytest.LogCaptureFixture
) -> None:
    b = instances(token=b"right")
    a = instances(token=b"wrong")
    with caplog.at_level(logging.WARNING, logger="nimbus.messaging"):
        with pytest.raises(PeerRefused, match="wrong auth token"):
            a.send(b.id, "let me in")
        deadline = time.monotonic() + 5
        while "wrong auth token" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    assert f"instance {b.id} refused a connection from '{a.id}'" in caplog.text
    with pytest.raises(MessagingTimeout):
        b.recv(timeout=0.2)


class _Unloadable:
    def __reduce__(self) -> tuple[Any, ...]:
        return (_refuse, ())


def _refuse() -> None:
    raise RuntimeError("cannot be rebuilt here")


def test_undecodable_message_names_sender_and_link_stays_usable(instances: Any) -> None:
    a, b = instances(), instances()
    a.send(b.id, "before")
    a.send(b.id, _Unloadable())
    a.send(b.id, "after")
    assert b.recv(timeout=10) == "before"
    with pytest.raises(MessageDecodeError, match=a.id) as info:
        b.recv(timeout=10)
    assert info.value.sender == a.id
    assert b.recv(timeout=10) == "after"
    a.send(b.id, "still fine")
    assert b.recv(source=a.id, timeout=10) == "still fine"


def test_undecodable_message_read_by_a_waiting_recv_names_its_sender(instances: Any) -> None:
    """A recv that waits in poll is handed the one message it reads (no mail): a
    message that cannot be unpickled still names its sender, and the link goes on."""
    a, b = instances(), instances()
    a.send(b.id, "hello")
    assert b.recv(source=a.id, timeout=10) == "hello"
    outcome: list[object] = []

    def wait() -> None:
        try:
            outcome.append(b.recv(source=a.id, timeout=10))
        except MessageDecodeError as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.1)  # b is waiting when the message arrives
    a.send(b.id, _Unloadable())
    waiter.join(15)
    assert len(outcome) == 1 and isinstance(outcome[0], MessageDecodeError)
    assert outcome[0].sender == a.id and a.id in str(outcome[0])
    a.send(b.id, "after")
    assert b.recv(source=a.id, timeout=10) == "after"


def test_burst_with_an_undecodable_message_mid_run_names_it_and_delivers_the_rest(
    instances: Any,
) -> None:
    """Runs of two tags interleaved (blocks of 50, each block a BATCH, a run at the
    receiver); one pickle in the middle of a run cannot be unpickled."""
    a, b = instances(), instances()
    a.send(b.id, "start")
    assert b.recv(source=a.id, timeout=10) == "start"
    for block in range(0, 2000, 50):
        for i in range(block, block + 50):
            a.send(b.id, _Unloadable() if i == 1010 else i)
        for i in range(block, block + 50):
            a.send(b.id, b"%d" % i, tag="raw")
    got = []
    for i in range(2000):
        if i == 1010:
            with pytest.raises(MessageDecodeError, match=a.id) as info:
                b.recv(source=a.id, timeout=10)
            assert info.value.sender == a.id
        else:
            got.append(b.recv(source=a.id, timeout=10))
    assert got == [i for i in range(2000) if i != 1010]
    raws = [b.recv_with_source(None, 10, "raw") for _ in range(2000)]
    assert raws == [(a.id, b"%d" % i) for i in range(2000)]
    assert b.statistics()["waiting"] == 0


def test_threads_waiting_for_different_tags_each_get_theirs_in_order_once(
    instances: Any,
) -> None:
    """Two threads wait on one instance, one per tag, while the messages trickle in."""
    a, b = instances(), instances()
    got: dict[int, list[int]] = {0: [], 1: []}

    def reader(tag: int) -> None:
        for _ in range(300):
            got[tag].append(b.recv(source=a.id, timeout=10, tag=tag))

    readers = [threading.Thread(target=reader, args=(tag,)) for tag in (0, 1)]
    for t in readers:
        t.start()
    for i in range(300):
        a.send(b.id, i, tag=i % 2)
        a.send(b.id, i, tag=1 - i % 2)
        if i % 25 == 0:
            time.sleep(0.005)  # the readers catch up and wait again
    for t in readers:
        t.join(30)
    assert got == {0: list(range(300)), 1: list(range(300))}


def _recv_next(ep: Instance, source: str, tag: Any, within: float = 10.0) -> Any:
    """``recv_next`` until it gives a message (NOTHING: none yet, or not its case: then
    ``recv_with_source`` takes it, as ``nimbus.multiprocessing`` does)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        got = ep.recv_next(source, tag, 0.05)
        if got is not NOTHING:
            return got
        try:
            return ep.recv_with_source(source, 0.01, tag)[1]
        except MessagingTimeout:
            continue
    raise AssertionError(f"nothing from {source} with tag {tag!r} within {within} s")


def test_recv_next_gives_one_writers_messages_in_order_once_and_times_out(
    instances: Any,
) -> None:
    """The reader of one writer: small bytes as they are, other objects, a burst, and
    a message with another tag left for ``recv``; with nothing sent, NOTHING soon."""
    a, b = instances(), instances()
    a.send(b.id, b"hello", tag="lane")
    assert _recv_next(b, a.id, "lane") == b"hello"
    got = []
    for i in range(200):
        b.recv_next(a.id, "other", 0.0)  # a read counts as a receive: replies go at once
        a.send(b.id, b"x%d" % i if i % 2 else {"i": i}, tag="lane")
        got.append(_recv_next(b, a.id, "lane"))
    assert got == [b"x%d" % i if i % 2 else {"i": i} for i in range(200)]
    for i in range(300):  # a burst: coalesced into batches, delivered through the mail
        a.send(b.id, i, tag="lane")
    a.send(b.id, "aside", tag="other")
    assert [_recv_next(b, a.id, "lane") for _ in range(300)] == list(range(300))
    assert b.recv(source=a.id, timeout=10, tag="other") == "aside"
    t0 = time.monotonic()
    assert b.recv_next(a.id, "lane", 0.2) is NOTHING
    assert time.monotonic() - t0 < 0.5  # the read waits at most BLOCK, a poll 0.2 s


def test_recv_next_spins_for_a_prompt_reply_and_backs_off_while_none_comes(
    instances: Any,
) -> None:
    """A waiting ``recv_next`` first reads without waiting for up to SPIN (a reply that
    comes within microseconds is read without sleeping); each spin that finds
    nothing doubles the waits that go without one, up to SPIN_BACKOFF, and a spin
    that finds a message halves them. What comes is delivered in order either way."""
    a, b = instances(), instances()
    a.send(b.id, b"first", tag="lane")
    assert _recv_next(b, a.id, "lane") == b"first"
    link = b._from[a.id]
    assert link.spin_backoff == 0
    spins = 0
    t0 = time.monotonic()
    for _ in range(200):  # a silent writer: few spins, each at most SPIN
        spun = link.spin_skip == 0
        assert b.recv_next(a.id, "lane", 0.002) is NOTHING
        spins += spun
    assert link.spin_backoff == SPIN_BACKOFF
    assert spins <= 12, spins  # 1 + 2 + 4 + ... + 64 + 64 waits between them
    assert time.monotonic() - t0 < 200 * (BLOCK + SPIN) + 5
    got = []
    for i in range(8 * SPIN_BACKOFF):  # messages waiting: each spin finds one
        a.recv_next(b.id, "lane", 0.0)  # a read counts as a receive: replies go at once
        a.send(b.id, i, tag="lane")
        got.append(_recv_next(b, a.id, "lane"))
    assert got == list(range(8 * SPIN_BACKOFF))
    assert link.spin_backoff == 0


def test_recv_next_does_not_spin_on_a_large_message_already_coming(instances: Any) -> None:
    """A spin that reads part of a large message leaves the rest to the waiting reads
    (its bytes come as the writer writes them): it counts as no failed spin."""
    a, b = instances(), instances()
    a.send(b.id, b"first", tag="lane")
    assert _recv_next(b, a.id, "lane") == b"first"
    link = b._from[a.id]
    big = os.urandom(8 << 20)  # more than a socket holds: read in parts
    writer = threading.Thread(target=a.send, args=(b.id, big), kwargs={"tag": "lane"})
    writer.start()
    try:
        assert select.select([link.sock], [], [], 10)[0]  # its first bytes are here
        assert link.spin_skip == 0 and link.spin_backoff == 0
        assert _recv_next(b, a.id, "lane") == big
    finally:
        writer.join(30)
    assert link.spin_backoff == 0


def test_recv_next_does_not_starve_another_thread_reading(instances: Any) -> None:
    """While one thread waits in its writer's link, another thread's messages (another
    link) still arrive promptly: the wait is short, then every reader polls."""
    a, b, c = instances(), instances(), instances()
    a.send(b.id, b"first", tag="lane")
    assert _recv_next(b, a.id, "lane") == b"first"  # b reads a's link itself from here
    stop = threading.Event()

    def lane_reader() -> None:  # a writer that stays silent: recv_next waits and waits
        while not stop.is_set():
            b.recv_next(a.id, "lane", 0.05)

    reader = threading.Thread(target=lane_reader)
    reader.start()
    try:
        latencies = []
        for i in range(20):
            t0 = time.monotonic()
            c.send(b.id, i, tag="side")
            assert b.recv(source=c.id, timeout=10, tag="side") == i
            latencies.append(time.monotonic() - t0)
        assert sorted(latencies)[10] < 5 * BLOCK, latencies  # the median: a wait or so at most
        assert max(latencies) < 1.0, latencies
    finally:
        stop.set()
        reader.join(10)


def test_exited_peer(instances: Any) -> None:
    a, b = instances(), instances()
    b.send(a.id, "last words")
    a.send(b.id, "hi")
    assert b.recv(timeout=10) == "hi"
    b.close()
    assert a.recv(source=b.id, timeout=10) == "last words"
    with pytest.raises(PeerExited):
        a.recv(source=b.id, timeout=10)
    with pytest.raises(PeerExited, match="has exited"):
        for _ in range(3):  # a send after a send is queued: a later one raises
            a.send(b.id, "anyone?")
            time.sleep(0.1)
    c = instances()  # it never sent to a: no goodbye comes in, the directory says it
    a.send(c.id, "hi")
    assert c.recv(timeout=10) == "hi"
    c.close()
    with pytest.raises(PeerExited, match="has exited"):
        for _ in range(3):
            a.send(c.id, "anyone?")
            time.sleep(0.1)


def test_many_small_messages_coalesced_arrive_in_order(instances: Any) -> None:
    a, b = instances(), instances()
    for i in range(5000):
        a.send(b.id, i)  # a burst: coalesced, written by size or by the flusher
    assert [b.recv(source=a.id, timeout=10) for _ in range(5000)] == list(range(5000))


def test_small_and_large_messages_interleaved_keep_their_order(instances: Any) -> None:
    a, b = instances(), instances()
    sent: list[Any] = []
    for i in range(600):  # small frames share one buffer; a large one goes between them
        sent.append(np.full(50_000, float(i)) if i % 100 == 7 else i)
        a.send(b.id, sent[-1])
    got = [b.recv(source=a.id, timeout=10) for _ in range(600)]
    for want, have in zip(sent, got, strict=True):
        if isinstance(want, np.ndarray):
            np.testing.assert_array_equal(have, want)
        else:
            assert have == want


def test_burst_past_the_coalescing_threshold_keeps_order_types_and_tags(instances: Any) -> None:
    a, b = instances(), instances()
    sent: list[tuple[Any, Any]] = []
    for i in range(12_000):  # ~700 KB: many BATCH frames, more than one read buffer
        obj: Any = (b"%d" % i) * 5 if i % 3 else (f"s{i}" if i % 2 else i)  # bytes, str, int
        tag = "t" if (i // 50) % 4 == 3 else 0  # runs of another tag inside the burst
        a.send(b.id, obj, tag)
        sent.append((tag, obj))
    for tag in (0, "t"):
        want = [obj for t, obj in sent if t == tag]
        got = [b.recv(a.id, 10, tag) for _ in want]
        assert got == want
        assert [type(x) for x in got] == [type(x) for x in want]  # bytes stay bytes
    with pytest.raises(MessagingTimeout):
        b.recv(timeout=0.2)


def test_burst_interleaved_with_large_messages_keeps_order(instances: Any) -> None:
    a, b = instances(), instances()
    big = os.urandom(512 << 10)  # all of it fits in the socket: nobody reads b meanwhile
    sent: list[Any] = []
    for i in range(3000):  # a large message goes between queued small ones
        sent.append(big if i % 1000 == 500 else i.to_bytes(4, "little"))
        a.send(b.id, sent[-1])
    assert [b.recv(source=a.id, timeout=10) for _ in sent] == sent


def _burst_forever(parent: str) -> None:
    msg.send(parent, msg.instance_id())
    for i in itertools.count():
        msg.send(parent, i.to_bytes(8, "little"))
        if i % 1000 == 999:
            time.sleep(0.001)  # bursts of 1,000: killed in the middle of one


def test_threads_sending_at_once_each_arrive_in_order_exactly_once(instances: Any) -> None:
    receiver = instances()
    senders = [instances() for _ in range(2)]

    def burst(ep: Instance, who: int) -> None:
        for i in range(3000):
            ep.send(receiver.id, (who, i))

    threads = [threading.Thread(target=burst, args=(senders[w // 2], w)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got: dict[int, list[int]] = {w: [] for w in range(4)}
    for _ in range(4 * 3000):
        who, i = receiver.recv(timeout=10)
        got[who].append(i)
    assert all(seq == list(range(3000)) for seq in got.values())
    with pytest.raises(MessagingTimeout):
        receiver.recv(timeout=0.2)


def test_sender_killed_mid_burst_leaves_an_ordered_prefix_then_peer_lost() -> None:
    p, child = _start(_burst_forever)
    got = [int.from_bytes(msg.recv(source=child, timeout=30), "little") for _ in range(3000)]
    p.kill()
    with pytest.raises(PeerLost, match=child):
        while True:  # what was written before it died, then the typed error
            got.append(int.from_bytes(msg.recv(source=child, timeout=30), "little"))
    p.join(30)
    assert got == list(range(len(got)))


def test_messages_count_in_the_task_network_bytes(instances: Any) -> None:
    a, b = instances(), instances()
    a.send(b.id, b"warm")  # connect first
    b.recv(source=a.id, timeout=10)
    bytes_in, bytes_out = telemetry.socket_bytes()
    a.send(b.id, b"x" * 1000)  # a send after a send: written by a's flusher thread
    assert b.recv(source=a.id, timeout=10) == b"x" * 1000
    deadline = time.monotonic() + 10  # that thread may count its write after b has read it
    while telemetry.socket_bytes()[1] - bytes_out < 1000 and time.monotonic() < deadline:
        time.sleep(0.001)
    now_in, now_out = telemetry.socket_bytes()
    assert now_in - bytes_in >= 1000
    assert now_out - bytes_out >= 1000


def test_arrays_arrive_writable_as_sent_on_both_paths(instances: Any) -> None:
    a = instances()
    small, big = np.arange(10), np.arange(100_000)  # small and large out-of-band buffers
    frozen = np.arange(10)
    frozen.flags.writeable = False
    for obj in (small, big, frozen):
        a.send("later", obj)  # through the store: "later" does not listen yet
    b = instances(instance_id="later")
    time.sleep(0.01)
    for obj in (small, big, frozen):
        a.send(b.id, obj)  # over the socket
    for _ in range(2):
        for sent in (small, big, frozen):
            got = b.recv(source=a.id, timeout=10)
            assert np.array_equal(got, sent)
            assert got.flags.writeable == sent.flags.writeable


def test_large_bytes_to_several_peers_go_out_together_an_arrays_before_its_send_returns(
    instances: Any,
) -> None:
    """An exchange (sends in a row of large partitions to each peer, then receives): a
    send of a large ``bytes`` returns before its peer reads it, what the socket did not
    take written behind it, so the next peers' links are busy at once (each link took
    its turn: 2-2.5x the wire time of a 4-node Sort shuffle). An array, which the
    caller may change once ``send`` returns, is written whole before it returns."""
    a, b, c = instances(), instances(), instances()
    for peer in (b, c):  # (links open)
        a.send(peer.id, b"hello")
        assert peer.recv(source=a.id, timeout=10) == b"hello"
    parts = {b.id: os.urandom(24 << 20), c.id: os.urandom(24 << 20)}
    sending = threading.Thread(target=lambda: [a.send(p, parts[p]) for p in parts], daemon=True)
    sending.start()
    sending.join(20)  # neither b nor c reads yet
    assert not sending.is_alive(), "a large send waited for its peer to read it"
    assert c.recv(source=a.id, timeout=30) == parts[c.id]  # (the later one first)
    assert b.recv(source=a.id, timeout=30) == parts[b.id]
    array = np.ones(8 << 20)  # 64 MiB: more than a socket holds
    got: list[Any] = []
    reader = threading.Thread(
        target=lambda: (time.sleep(0.5), got.append(b.recv(timeout=30))), daemon=True
    )
    reader.start()
    a.send(b.id, array)
    array[:] = 0  # (after the send: what was sent is what it was)
    reader.join(30)
    assert got and bool((got[0] == 1).all())


def test_a_large_bytes_written_behind_goes_out_whole_at_close_whoever_writes_it(
    instances: Any,
) -> None:
    """A close while the flusher writes a large message behind its send (the link out of
    ``_dirty``, in the flusher's hands) waits for it as for one still queued: it went
    out whole, not cut off after the goodbye's wait (the peer read a broken link)."""
    a, b = instances(), instances()
    a.send(b.id, b"hello")
    assert b.recv(source=a.id, timeout=10) == b"hello"
    data = os.urandom(48 << 20)  # (more than the sockets hold)

    def send_then_close() -> None:
        a.send(b.id, data)
        time.sleep(0.1)  # the flusher took the link
        a.close()

    closing = threading.Thread(target=send_then_close, daemon=True)
    closing.start()
    time.sleep(GOODBYE_WAIT + 1.0)  # b reads only after a goodbye's wait
    assert b.recv(source=a.id, timeout=30) == data
    closing.join(30)
    assert not closing.is_alive()


def test_a_receive_writes_what_the_flusher_writes_behind_as_fast_as_a_send_would(
    instances: Any,
) -> None:
    """A receive that waits while the flusher writes a large message behind its send
    polls that link too: the flusher is not left one socket buffer per wait for the
    receiving thread's lock (a request's round trip 3-6x an array's, which its send
    writes whole). Compared with an array of the same size, in the same run."""
    a, b = instances(), instances()
    a.send(b.id, b"hello")
    assert b.recv(source=a.id, timeout=10) == b"hello"
    b.send(a.id, b"hi")
    assert a.recv(source=b.id, timeout=10) == b"hi"
    size = 96 << 20
    data, array = os.urandom(size), np.ones(size // 8)
    rounds = 5

    def echo() -> None:
        for _ in range(2 * rounds):
            got = b.recv(source=a.id, timeout=60)
            b.send(a.id, len(got) if type(got) is bytes else got.nbytes)

    echoing = threading.Thread(target=echo, daemon=True)
    echoing.start()
    took = {"bytes": 0.0, "array": 0.0}  # (the sum of the round trips: the stalls vary)
    for _ in range(rounds):
        for kind, obj in (("bytes", data), ("array", array)):
            start = time.monotonic()
            a.send(b.id, obj)
            time.sleep(0.02)  # (the caller does something: the flusher takes the link)
            assert a.recv(source=b.id, timeout=60) == size
            took[kind] += time.monotonic() - start
    echoing.join(10)
    assert took["bytes"] < 1.8 * took["array"] + 0.1, took  # (0.65x; 2-2.5x before the fix)


def test_a_receive_keeps_its_timeout_while_a_peer_does_not_read_what_went_behind(
    instances: Any,
) -> None:
    """A receive writes what went behind sends before it waits, but no longer than its
    timeout: a peer that reads nothing (busy) makes it wait, not miss its timeout. And
    a link that waits for its peer costs next to no CPU (polled, not spun)."""
    a, b = instances(), instances()
    a.send(b.id, b"hello")
    assert b.recv(source=a.id, timeout=10) == b"hello"
    data = os.urandom(48 << 20)  # (more than the sockets hold)
    a.send(b.id, data)
    time.sleep(0.1)  # the flusher took the link
    raised: list[BaseException] = []

    def receive() -> None:
        try:
            a.recv(timeout=0.5)
        except BaseException as exc:
            raised.append(exc)

    c0, t0 = time.process_time(), time.monotonic()
    receiving = threading.Thread(target=receive, daemon=True)
    receiving.start()
    receiving.join(5.0)
    took, cpu = time.monotonic() - t0, time.process_time() - c0
    waited = receiving.is_alive()  # (it waited for b to read: forever)
    assert b.recv(source=a.id, timeout=30) == data  # (written all the same)
    receiving.join(10)
    assert not waited, "a receive waited past its timeout for a peer to read"
    assert len(raised) == 1 and type(raised[0]) is MessagingTimeout, raised
    assert cpu < 0.25 * took + 0.05, (cpu, took)


def test_a_write_behind_a_send_that_broke_is_logged_at_close_if_no_send_raised_it(
    instances: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A large message written behind its send to a peer that closed before reading it:
    the send returned, so the error is not lost: it is raised at the next send to that
    peer, or (none) logged at close, naming the peer."""
    a, b, c = instances(), instances(), instances()
    for peer in (b, c):
        a.send(peer.id, b"hello")
        assert peer.recv(source=a.id, timeout=10) == b"hello"
    a.send(b.id, os.urandom(48 << 20))  # returns: the sockets hold a part
    a.send(c.id, os.urandom(48 << 20))
    b.close()  # never read it
    c.close()
    with pytest.raises(MessagingTimeout):
        a.recv(timeout=0.1)  # (before its wait, what went behind is written: both broke)
    with pytest.raises(PeerExited):
        a.send(b.id, b"more")
    with caplog.at_level(logging.WARNING, logger="nimbus.messaging"):
        a.close()
    assert f"instance {c.id} has exited" in caplog.text
    assert "not written whole" in caplog.text
    assert f"instance {b.id}" not in caplog.text  # (raised already)


def test_instance_is_a_transport(instances: Any) -> None:
    a, b = instances(), instances()
    transport: msg.Transport = a
    assert isinstance(a, msg.Transport)
    transport.send(b.id, "via the protocol")
    assert b.recv(timeout=10) == "via the protocol"


def test_socket_directory_is_private(instances: Any) -> None:
    a = instances()
    path = a.entry.unix
    assert path is not None and a.directory.local[a.id].state == "alive"
    assert os.stat(os.path.dirname(path)).st_mode & 0o077 == 0


def _published(ep: Instance, peer: Instance) -> None:
    deadline = time.monotonic() + 10
    while ep.directory.refresh(peer.id) is None:
        assert time.monotonic() < deadline, "never published"
        time.sleep(0.005)


def _sent_and_called_back(
    instances: Any, elsewhere: Path, message: str
) -> tuple[Instance, Instance, _peer.Peer]:
    """Instances a and b on two hosts (TCP), once a sent ``message`` to b and b opened its
    link back to a: (a, b, that link)."""
    a = instances(host="host-a", tcp_host="127.0.0.1")
    b = instances(host="host-b", tcp_host="127.0.0.1", sockets_in=elsewhere)
    _published(a, b)
    a.send(b.id, message)
    assert b.recv(source=a.id, timeout=10) == message
    return a, b, _called_back(b, a)


def _called_back(ep: Instance, peer: Instance) -> _peer.Peer:
    """The link ``ep`` opened back to ``peer`` (which sent to it over TCP), once it has."""
    deadline = time.monotonic() + 10
    while (link := ep._out.get(peer.id) or ep._opening.get(peer.id)) is None:
        assert time.monotonic() < deadline, f"{ep.id} never opened a link back to {peer.id}"
        time.sleep(0.005)
    return link


@pytest.fixture
def elsewhere(program: Program) -> Iterator[Path]:
    """The socket directory of "another host": one the local instances do not see."""
    root = Path(tempfile.mkdtemp(prefix="nbh-"))  # short: Unix socket paths are limited
    yield socket_dir(root, program.program_id)
    shutil.rmtree(root, ignore_errors=True)


def test_peers_on_other_hosts_talk_over_tcp(instances: Any, elsewhere: Path) -> None:
    a = instances(host="host-a", tcp_host="127.0.0.1")
    b = instances(host="host-b", tcp_host="127.0.0.1", sockets_in=elsewhere)
    _published(a, b)
    _published(b, a)
    a.send(b.id, {"over": "tcp"})
    assert b.recv(source=a.id, timeout=10) == {"over": "tcp"}
    b.send(a.id, np.arange(300_000))
    assert np.array_equal(a.recv(source=b.id, timeout=10), np.arange(300_000))
    (link,) = [*a._out.values(), *a._opening.values()]  # (its answer read or not yet)
    assert link.sock.family == socket.AF_INET
    a.send(b.id, "again")  # the second send reads the answer
    assert b.recv(source=a.id, timeout=10) == "again"
    assert list(a._out.values()) == [link] and not link.unanswered


def test_first_message_over_tcp_follows_the_hello_before_its_answer(
    instances: Any, program: Program
) -> None:
    """A first send to a peer on another host waits for the TCP connect only, not for
    the peer's process to answer the HELLO: here nothing ever answers (a listening
    socket no one accepts on), and the send returns with HELLO and message written."""
    listener = socket.create_server(("127.0.0.1", 0))
    there = Directory(program.client, program.keys, program.ttl_ms)
    silent = "5" * 16
    there.set_local(silent, Entry("host-x", 1, None, listener.getsockname()))
    there.publish()
    a = instances(host="host-a")
    try:
        start = time.monotonic()
        a.send(silent, "hello there")
        assert time.monotonic() - start < _peer.HANDSHAKE_TIMEOUT / 2
        assert a.statistics()["links_out"] == 1
        conn, _ = listener.accept()
        with conn:
            channel = _peer.Stream(conn)
            frames: list[Any] = []
            while len(frames) < 2:
                assert select.select([conn], [], [], 10)[0]
                frames += channel.receive() or []
        assert [f.kind for f in frames] == [_peer.HELLO, _peer.PICKLE]
        assert pickle.loads(frames[1].buffers[0]) == "hello there"
    finally:
        listener.close()


def test_messages_read_with_the_hello_are_delivered(instances: Any, program: Program) -> None:
    b = instances(host="host-b", tcp_host="127.0.0.1")
    early = "e" * 16
    with socket.create_connection(b.entry.tcp) as sock:
        channel = _peer.Stream(sock)  # HELLO and a message in one write
        channel.send(_peer.HELLO, pack((_peer.PROTOCOL, program.program_id, b"secret", early)))
        channel.queue_message(_peer.PICKLE, 0, pack(0), pickle.dumps("early"))
        assert channel.flush()
        assert b.recv(source=early, timeout=10) == "early"


def test_a_peer_that_connected_is_answered_without_a_lookup(
    instances: Any, elsewhere: Path, program: Program
) -> None:
    """The HELLO tells where its sender listens: b replies to a over TCP even with the
    directory gone from the store (before, b looked a up: not found, so the store)."""
    a = instances(host="host-a", tcp_host="127.0.0.1")
    b = instances(host="host-b", tcp_host="127.0.0.1", sockets_in=elsewhere)
    _published(a, b)
    a.send(b.id, "ping")
    assert b.recv(source=a.id, timeout=10) == "ping"
    program.client().delete(program.keys.directory())
    b.send(a.id, "pong")
    assert a.recv(source=b.id, timeout=10) == "pong"
    assert b.statistics()["links_out"] == 1


def test_first_lookup_over_tcp_makes_no_store_connection(
    instances: Any, elsewhere: Path, program: Program, store_url: str
) -> None:
    """An instance on TCP leaves a store connection ready beside its inbox's: its first
    lookup (in the path of its first message to another host) does not connect then."""
    probe = redis.Redis.from_url(store_url)  # a pool of its own: counts, uses none of theirs
    try:
        a = instances(host="host-a", tcp_host="127.0.0.1")
        b = instances(host="host-b", tcp_host="127.0.0.1", sockets_in=elsewhere)
        deadline = time.monotonic() + 10
        while not (
            probe.hexists(program.keys.directory(), b.id)
            and sum(c["cmd"] == "blpop" for c in probe.client_list()) >= 2
        ):
            assert time.monotonic() < deadline, "never published, or no inbox waits"
            time.sleep(0.005)
        before = probe.info("clients")["connected_clients"]
        assert a.directory.lookup(b.id) == b.entry
        assert probe.info("clients")["connected_clients"] == before
    finally:
        probe.close()


def test_wrong_token_over_tcp_is_refused_at_the_next_send(
    instances: Any, elsewhere: Path, caplog: pytest.LogCaptureFixture
) -> None:
    b = instances(token=b"right", host="host-b", tcp_host="127.0.0.1", sockets_in=elsewhere)
    a = instances(token=b"wrong", host="host-a")
    _published(a, b)
    with caplog.at_level(logging.WARNING, logger="nimbus.messaging"):
        a.send(b.id, "let me in")  # written behind the HELLO: not taken
        with pytest.raises(PeerRefused, match="wrong auth token"):
            a.send(b.id, "again")
    assert f"instance {b.id} refused a connection from '{a.id}'" in caplog.text
    with pytest.raises(MessagingTimeout):
        b.recv(timeout=0.2)


def test_unreachable_peer_falls_back_to_the_store(instances: Any, elsewhere: Path) -> None:
    a = instances(host="host-a")
    b = instances(host="host-b", tcp_host="127.0.0.1", sockets_in=elsewhere)
    _published(a, b)
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    b.directory.set_local(b.id, dataclasses.replace(b.entry, tcp=dead.getsockname()))
    b.directory.publish()
    a.directory.invalidate(b.id)
    try:
        for i in range(50):
            a.send(b.id, i)
        assert a.statistics()["links_out"] == 0
        assert [b.recv(source=a.id, timeout=10) for _ in range(50)] == list(range(50))
    finally:
        dead.close()


# -- directory -------------------------------------------------------------------


def test_directory_publishes_only_changes_and_resolves_on_demand(program: Program) -> None:
    here = Directory(program.client, program.keys, program.ttl_ms)
    there = Directory(program.client, program.keys, program.ttl_ms)
    assert there.lookup("i1") is None  # not started: a cached miss, for a short while
    entry = Entry("host-a", 123, None, ("10.0.0.1", 4000))
    here.set_local("i1", entry)
    assert here.publish() == {"i1": entry}
    assert here.publish() == {}  # nothing changed, nothing sent
    time.sleep(0.05)  # past the negative cache
    assert there.lookup("i1") == entry
    gone = Entry("host-a", 123, None, ("10.0.0.1", 4000), EXITED)
    here.set_local("i1", gone)
    assert here.publish() == {"i1": gone}
    assert there.lookup("i1") == entry  # cached until invalidated
    there.invalidate("i1")
    assert there.lookup("i1") == gone
    here.set_local("i1", None)
    assert here.publish() == {"i1": None}
    assert there.refresh("i1") is None


def test_directory_lookup_reads_a_small_directory_whole(program: Program) -> None:
    """An all-to-all exchange's first sends: the first lookup (one round trip) brings
    the other peers' entries too, so theirs take none (each was a round trip through
    the store, in series, before the first byte to that peer)."""
    here = Directory(program.client, program.keys, program.ttl_ms)
    there = Directory(program.client, program.keys, program.ttl_ms)
    entries = {f"i{k}": Entry("host-a", k, None, ("10.0.0.1", 4000 + k)) for k in range(3)}
    for name, entry in entries.items():
        here.set_local(name, entry)
    here.publish()
    assert there.lookup("i0") == entries["i0"]
    program.client().delete(program.keys.directory())  # the store knows them no more
    assert there.lookup("i1") == entries["i1"]  # read with i0's
    assert there.lookup("i2") == entries["i2"]
    there.invalidate("i2")
    assert there.lookup("i2") is None  # invalidated: asked again
    here.set_local("i3", entries["i0"])
    here.publish()  # (i3 only: the others were published before)
    assert there.lookup("i3") == entries["i0"]


def test_public_names() -> None:
    assert set(msg.__all__) == {
        "ANY",
        "Directory",
        "Instance",
        "NOTHING",
        "Entry",
        "Transport",
        "allreduce",
        "barrier",
        "bcast",
        "close",
        "current",
        "direct_enabled",
        "gather",
        "instance_for",
        "instance_id",
        "recv",
        "recv_with_source",
        "reduce",
        "scatter",
        "send",
    }


def test_root_removes_the_socket_directory_at_exit(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import os
        import nimbus.messaging as msg
        ep = msg.current()
        print(os.path.dirname(ep.entry.unix), flush=True)
        """
    )
    env = {**os.environ, "NIMBUS_RUNTIME_DIR": tempfile.mkdtemp(prefix="nbr-")}
    try:
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        sockets = Path(out.stdout.strip())
        assert sockets.name.startswith("m-") and not sockets.exists()
    finally:
        shutil.rmtree(env["NIMBUS_RUNTIME_DIR"], ignore_errors=True)


def test_a_first_message_followed_by_the_goodbye_reaches_its_peer(
    instances: Any, elsewhere: Path
) -> None:
    """A small first message over TCP goes out before its HELLO's answer is read, and
    the sender closes at once: the goodbye reads the answer before it closes (a socket
    closed with input unread is reset, not closed; its peer's read then breaks)."""
    a = instances(host="host-a", tcp_host="127.0.0.1")
    b = instances(host="host-b", tcp_host="127.0.0.1", sockets_in=elsewhere)
    _published(a, b)
    small = np.arange(20_000)  # 160 kB: follows its HELLO
    a.send(b.id, small)
    (link,) = a._opening.values()
    assert link.unanswered
    a.close()
    assert np.array_equal(b.recv(source=a.id, timeout=10), small)
    with pytest.raises(PeerExited):  # its goodbye came in whole
        b.recv(source=a.id, timeout=10)


def test_a_large_first_message_over_tcp_waits_for_the_answer(
    instances: Any, elsewhere: Path
) -> None:
    a = instances(host="host-a", tcp_host="127.0.0.1")
    b = instances(host="host-b", tcp_host="127.0.0.1", sockets_in=elsewhere)
    _published(a, b)
    big = np.arange(1_000_000)  # 8 MB: the round trip is nothing beside it
    a.send(b.id, big)
    assert not a._opening and not a._out[b.id].unanswered
    a.close()
    assert np.array_equal(b.recv(source=a.id, timeout=10), big)


def test_the_answer_to_a_hello_with_a_message_waits_for_all_of_it(
    instances: Any, program: Program
) -> None:
    """A listening instance answers a HELLO that says a message follows only once it
    has read that message whole: the answer can then never reach a sender that went
    (exited, killed) while its socket still held part of it, which the answer would
    reset, dropping that part (before: answered at once)."""
    b = instances(host="host-b", tcp_host="127.0.0.1")
    early = "f" * 16
    hello = pack((_peer.PROTOCOL, program.program_id, b"secret", early, None, True))

    def hello_and_message(channel: _peer.Stream) -> None:
        channel.send(_peer.HELLO, hello)
        channel.queue_message(_peer.PICKLE, 0, pack(0), pickle.dumps(b"x" * 100_000))

    wire = bytes(_written(hello_and_message))
    with socket.create_connection(b.entry.tcp) as sock:
        sock.sendall(wire[:-1000])  # the HELLO and most of the message
        assert not select.select([sock], [], [], 0.5)[0], "answered before the message"
        sock.sendall(wire[-1000:])
        assert select.select([sock], [], [], 10)[0]
        frames = _peer.Stream(sock).receive(block=True) or []
        assert [f.kind for f in frames] == [_peer.WELCOME]
        assert b.recv(source=early, timeout=10) == b"x" * 100_000


# -- review of the first message over TCP (rev21x) ------------------------------


def _stall_after_connect(ep: Instance, seconds: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first link ``ep`` opens stalls ``seconds`` between its HELLO and its first
    message: what a thread switch to another thread holding the GIL (a long C call)
    does there. The code is the real one, only slowed at that point."""
    opened = ep._open
    stalled: list[bool] = []

    def open_then_stall(peer: str, follows: bool = False) -> Any:
        link = opened(peer, follows)
        if not stalled and link is not None:
            stalled.append(True)
            time.sleep(seconds)
        return link

    monkeypatch.setattr(ep, "_open", open_then_stall)


def test_two_threads_sending_while_the_link_opens_neither_waits_nor_fails(
    instances: Any, elsewhere: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: thread 1's first send opened the link (HELLO written, its message not
    yet); thread 2's send found the link in ``_opening`` and read its answer holding
    the link's lock. The peer answers only once the first message is in, which thread
    1 wrote only with that lock: both waited HANDSHAKE_TIMEOUT, then both sends failed
    (PeerLost) though the peer was alive. Now HELLO and message go in one write
    before another thread sees the link."""
    a = instances(host="host-a", tcp_host="127.0.0.1")
    b = instances(host="host-b", tcp_host="127.0.0.1", sockets_in=elsewhere)
    _published(a, b)
    _stall_after_connect(a, 0.5, monkeypatch)
    errors: list[BaseException] = []

    def first() -> None:
        try:
            a.send(b.id, "one")
        except MessagingError as exc:  # said below
            errors.append(exc)

    thread = threading.Thread(target=first)
    thread.start()
    deadline = time.monotonic() + 10
    while not a._opening:
        assert time.monotonic() < deadline and thread.is_alive(), "no link opened"
        time.sleep(0.001)
    start = time.monotonic()
    try:
        a.send(b.id, "two")
    except MessagingError as exc:
        errors.append(exc)
    took = time.monotonic() - start
    thread.join(10)
    assert not errors, errors
    assert took < _peer.HANDSHAKE_TIMEOUT / 2, f"the second send waited {took:.1f} s"
    assert {b.recv(source=a.id, timeout=10), b.recv(source=a.id, timeout=10)} == {"one", "two"}


def test_a_sender_that_stalls_between_its_hello_and_first_message_loses_nothing(
    instances: Any, elsewhere: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The acceptor waits HANDSHAKE_TIMEOUT for the message a HELLO says follows, then
    drops the connection. Before, the HELLO went out alone: a sender stalled that long
    after it (another thread in a long C call holding the GIL) wrote the message into
    a closed connection: lost; the next send raised PeerLost for a live peer, and every
    later message was held by the peer behind the lost one, for ever. Now HELLO and
    message go in one write."""
    a = instances(host="host-a", tcp_host="127.0.0.1")
    b = instances(host="host-b", tcp_host="127.0.0.1", sockets_in=elsewhere)
    _published(a, b)
    _stall_after_connect(a, _peer.HANDSHAKE_TIMEOUT + 0.5, monkeypatch)
    a.send(b.id, "one")
    sent = ["one"]
    try:
        a.send(b.id, "two")
        sent.append("two")
    except PeerLost:
        a.send(b.id, "two again")  # the link is opened anew: a fresh link, the next number
        sent.append("two again")
    got = []
    try:
        for _ in sent:
            got.append(b.recv(source=a.id, timeout=3))
    except MessagingTimeout:
        pass
    assert (sent, got) == (["one", "two"], ["one", "two"])


def _written(write: Callable[[_peer.Stream], None]) -> bytearray:
    """The bytes a sender's stream puts on the wire for ``write(stream)``, as they are
    (taken through a socketpair)."""
    wire = bytearray()
    left, right = socket.socketpair()
    with left, right:
        stream = _peer.Stream(left)
        write(stream)
        assert stream.flush()
        while len(wire) < stream.bytes_out:
            wire += right.recv(1 << 20)
    return wire


@contextlib.contextmanager
def _said_hello(
    b: Instance, program: Program, me: str, entry: Any, follows: bool
) -> Iterator[tuple[socket.socket, _peer.Stream]]:
    """A raw connection to ``b`` over TCP, as instance ``me``, its HELLO queued (the
    caller writes it, with what follows it): (the socket, its stream)."""
    with socket.create_connection(b.entry.tcp) as sock:
        channel = _peer.Stream(sock)
        hello = pack((_peer.PROTOCOL, program.program_id, b"secret", me, entry, follows))
        channel.send(_peer.HELLO, hello)
        yield sock, channel


def _b_still_accepts(b: Instance, program: Program) -> None:
    """A well-formed connection (HELLO, then a message) is still taken by ``b``."""
    late = "c" * 16
    with _said_hello(b, program, late, None, False) as (_, channel):
        channel.queue_message(_peer.PICKLE, 0, pack(0), pickle.dumps("still here"))
        assert channel.flush()
        assert b.recv(source=late, timeout=10) == "still here"


def test_a_malformed_entry_in_a_hello_does_not_stop_the_acceptor(
    instances: Any, program: Program
) -> None:
    """``Directory.learn`` promises a malformed entry is ignored; one whose TCP address
    has one element (or is a map) raises IndexError (KeyError). Before, nothing caught
    it: the acceptor thread died and the instance took no connection ever again."""
    b = instances(host="host-b", tcp_host="127.0.0.1")
    odd = "d" * 16
    entry = pack(["host-x", 1, None, ["127.0.0.1"], "alive"])  # no port
    with _said_hello(b, program, odd, entry, False) as (sock, channel):
        assert channel.flush()
        assert select.select([sock], [], [], 10)[0]
        assert [f.kind for f in _peer.Stream(sock).receive(block=True) or []] == [_peer.WELCOME]
    _b_still_accepts(b, program)


def test_garbage_after_a_hello_that_says_a_message_follows_does_not_stop_the_acceptor(
    instances: Any, program: Program
) -> None:
    """What follows such a HELLO is read by the acceptor before it answers; a frame
    header announcing an impossible size raises OverflowError there (the acceptor
    caught only OSError and ProtocolError): the acceptor thread died."""
    b = instances(host="host-b", tcp_host="127.0.0.1")
    odd = "g" * 16
    with _said_hello(b, program, odd, None, True) as (sock, channel):
        assert channel.flush()
        # a real frame header, its length then changed
        header = _written(lambda probe: probe.send(_peer.MSG, pack((0, 0)), [b"x" * 100_000]))
        cut = len(header) - 100_000 - len(pack((0, 0))) - 8
        header[cut : cut + 8] = (2**64 - 1).to_bytes(8, "little")
        sock.sendall(bytes(header[: cut + 8 + len(pack((0, 0)))]))  # up to its data
        select.select([sock], [], [], 2)
    _b_still_accepts(b, program)


def test_a_frame_of_impossible_size_instead_of_a_hello_does_not_stop_the_acceptor(
    instances: Any, program: Program
) -> None:
    """(Older than the first-contact change, and with no token needed.) The HELLO was
    read with OSError, ProtocolError, ValueError and TypeError caught; a frame header
    whose buffer length cannot be allocated raises OverflowError: the acceptor thread
    died. Now the acceptor drops whatever connection raises, and goes on."""
    b = instances(host="host-b", tcp_host="127.0.0.1")
    meta = pack((0, 0))
    frame = _written(lambda probe: probe.send(_peer.HELLO, meta, [b"x"]))
    cut = len(frame) - 1 - len(meta) - 8  # where the buffer's length is
    frame[cut : cut + 8] = (2**64 - 1).to_bytes(8, "little")
    with socket.create_connection(b.entry.tcp) as sock:
        sock.sendall(bytes(frame[:-1]))
        select.select([sock], [], [], 2)
    _b_still_accepts(b, program)


def test_a_peer_that_refused_is_not_sent_the_next_message_behind_a_new_hello(
    instances: Any, elsewhere: Path
) -> None:
    """A send to a peer on another host that refuses (here a wrong token) raises
    PeerRefused at the next send. The send after that opened a new link, wrote its
    message behind the HELLO and returned as if sent: every other message to a peer
    known to refuse was lost without an error. Now a peer that refused gets no message
    before its answer."""
    b = instances(token=b"right", host="host-b", tcp_host="127.0.0.1", sockets_in=elsewhere)
    a = instances(token=b"wrong", host="host-a")
    _published(a, b)
    a.send(b.id, "let me in")  # written behind the HELLO: not taken (as designed)
    with pytest.raises(PeerRefused):
        a.send(b.id, "again")
    with pytest.raises(PeerRefused):
        a.send(b.id, "and again")  # known refused: not silently dropped


def test_a_connection_still_in_its_handshake_at_close_is_not_taken_after_it(
    instances: Any, program: Program
) -> None:
    """A HELLO that says a message follows keeps the acceptor waiting (up to
    HANDSHAKE_TIMEOUT) for that message; the instance closes meanwhile. The acceptor
    then answered WELCOME and handed the link to a closed instance: nobody read or
    closed it (an fd kept for ever; its wake-up write went to a closed, maybe reused,
    descriptor). Now the link is closed, not handed over."""
    b = instances(host="host-b", tcp_host="127.0.0.1")
    late = "h" * 16
    with _said_hello(b, program, late, None, True) as (sock, channel):
        assert channel.flush()
        time.sleep(0.3)  # the acceptor has read the HELLO: it waits for the message
        b.close()
        channel.queue_message(_peer.PICKLE, 0, pack(0), pickle.dumps("too late"))
        assert channel.flush()
        frames: list[Any] = []
        while True:  # what comes back before the connection ends
            assert select.select([sock], [], [], 6)[0], f"left open; it said {frames}"
            try:
                got = channel.receive()
            except ConnectionResetError:
                break
            if got is None:
                break
            frames += [f.kind for f in got]
        assert not b._new_in  # (the connection ended: the acceptor closed it)


def test_a_peer_on_another_host_that_sent_to_us_is_called_back(
    instances: Any, elsewhere: Path
) -> None:
    """An instance that accepts a link over TCP opens one back to its peer (off the
    acceptor's thread): its first reply to that peer goes over a link already open, not
    through a connect and the peer's acceptor in the reply's path (before: no link back
    until the first reply)."""
    a, b, back = _sent_and_called_back(instances, elsewhere, "ping")
    assert back.sock.family == socket.AF_INET
    b.send(a.id, "pong")
    assert a.recv(source=b.id, timeout=10) == "pong"
    assert list(b._out.values()) == [back] and not b._opening  # the reply took it
    assert a.statistics()["links_in"] == 1 and b.statistics()["links_out"] == 1
    a.send(b.id, "again")  # a's own link: a did not call b back (it has a link to b)
    assert b.recv(source=a.id, timeout=10) == "again"
    assert a.statistics()["links_out"] == 1 and b.statistics()["links_in"] == 1


@pytest.mark.parametrize(
    "told",
    [
        ["h", 1, None, ["127.0.0.1"], "alive"],  # no port in its TCP pair: IndexError
        ["h", 1, None, {"x": 1}, "alive"],  # a map for the pair: KeyError
        ["h", 1, None, ["127.0.0.1", "port"], "alive"],  # ValueError
        ["h", 1],  # too short
        7,  # not a list: TypeError
    ],
)
def test_a_malformed_entry_told_in_a_hello_is_ignored(program: Program, told: Any) -> None:
    """``Directory.learn`` ignores whatever a peer told as its entry (before: an
    IndexError or KeyError escaped it, and only the acceptor's catch-all held)."""
    directory = Directory(program.client, program.keys, program.ttl_ms)
    directory.learn("m" * 16, pack(told))
    directory.learn("m" * 16, b"\xc1not msgpack")
    assert "m" * 16 not in directory._cache


def test_links_made_while_an_instance_closes_are_closed(instances: Any, elsewhere: Path) -> None:
    """A link back opened, or a link in accepted, once its instance has closed is closed,
    not kept (before: its socket was never closed, as a call back racing a goodbye)."""
    a = instances(host="host-a", tcp_host="127.0.0.1")
    b = instances(host="host-b", tcp_host="127.0.0.1", sockets_in=elsewhere)
    _published(b, a)
    b.close()
    b._call_back(a.id)  # (as its thread would, having started before the close)
    assert not b._out and not b._opening
    left, right = socket.socketpair()
    with right:
        link = _peer.Peer(left, _peer.Stream(left), a.id)
        b._link_in(link)
        assert left.fileno() == -1, "a link in taken by a closed instance"


def test_a_first_reply_to_a_peer_on_another_host_that_exited_is_peer_exited(
    instances: Any, elsewhere: Path
) -> None:
    """A link opened back to a peer that has exited since (its end closed) is not used:
    the first reply raises PeerExited, as with no link back (before: it was written
    into the closed link and lost, no error; only a later send raised)."""
    a, b, _ = _sent_and_called_back(instances, elsewhere, "last words")
    a.close()
    with pytest.raises(PeerExited, match="has exited"):
        b.send(a.id, "reply")
    assert not b._out and not b._opening


def test_a_link_back_opened_as_its_instance_closes_says_goodbye(
    instances: Any, elsewhere: Path
) -> None:
    """A link back that ``_connect`` opened just after its instance closed is closed with
    a goodbye: its peer's ``recv`` from it raises PeerExited, as after a close (before:
    it was closed with nothing said, and the peer took it for lost: PeerLost)."""
    a = instances(host="host-a", tcp_host="127.0.0.1")
    b = instances(host="host-b", tcp_host="127.0.0.1", sockets_in=elsewhere)
    _published(b, a)
    b.close()
    assert b._connect(a.id, None, back=True) == (None, False)  # (its thread, past its check)
    assert not b._out and not b._opening
    with pytest.raises(PeerExited):
        a.recv(source=b.id, timeout=10)


@pytest.mark.parametrize("end", ["exits", "dies"])
def test_links_back_to_peers_that_ended_are_not_kept(
    instances: Any, elsewhere: Path, end: str
) -> None:
    """An instance that only receives over TCP (a collector) keeps no link back to a peer
    once that peer exited or died (before: one unused socket per peer that ever sent to
    it, until it closed: its descriptors ran out with many short-lived peers)."""
    a = instances(host="host-a", tcp_host="127.0.0.1", sockets_in=elsewhere)
    for i in range(5):
        c = instances(host="host-c", tcp_host="127.0.0.1")
        _published(c, a)
        c.send(a.id, i)
        assert a.recv(source=c.id, timeout=10) == i
        back = _called_back(a, c)
        if end == "exits":
            c.close()
        else:  # its sockets end as its process's do when it is killed: no goodbye
            deadline = time.monotonic() + 10
            while not c._new_in:  # (the link back, accepted)
                assert time.monotonic() < deadline, "c never accepted the link back"
                time.sleep(0.005)
            links = [*c._new_in, *c._out.values(), *c._opening.values()]
            for link in links:
                link.sock.shutdown(socket.SHUT_RDWR)
        with pytest.raises(PeerExited if end == "exits" else PeerLost):
            a.recv(source=c.id, timeout=10)  # (its link in ended)
        assert back.sock.fileno() == -1
    assert a.statistics()["links_out"] == 0


def test_a_link_back_to_a_peer_that_lives_on_is_kept(instances: Any, elsewhere: Path) -> None:
    """A link back is kept when its peer's link in ends but the peer lives on (it dropped
    that link, and may open another): closed, it would tell the peer that this instance
    ended."""
    a, b, _ = _sent_and_called_back(instances, elsewhere, "hi")
    (link,) = [*a._out.values(), *a._opening.values()]
    a._drop_out(link)  # (as when its answer did not come in time)
    with pytest.raises(PeerLost):
        b.recv(source=a.id, timeout=10)  # (its link in ended)
    assert a.id in b._opening
    b.send(a.id, "still there?")
    assert a.recv(source=b.id, timeout=10) == "still there?"


@pytest.mark.parametrize("first", ["small", "small, after a refusal", "large"])
def test_a_first_message_sent_as_its_instance_closes_is_delivered_once(
    instances: Any, elsewhere: Path, first: str
) -> None:
    """A first message over TCP whose send an instance's close overtook (its link was
    opened once the goodbyes were said) is delivered once, then the goodbye (before: a
    small one was written with its HELLO, the link closed, and the message sent again
    through the store: the peer received it twice; with a goodbye before a store copy,
    the copy waited for the goodbye's number forever)."""
    a = instances(host="host-a", tcp_host="127.0.0.1")
    b = instances(host="host-b", tcp_host="127.0.0.1", sockets_in=elsewhere)
    _published(b, a)
    obj = os.urandom(300_000) if first == "large" else b"once" * 100
    if first == "small, after a refusal":
        b._no_follow.add(a.id)  # (written after the answer, not with its HELLO)
    b.close()
    b.send(a.id, obj)  # (as a send whose connect the close overtook)
    assert a.recv(source=b.id, timeout=10) == obj
    with pytest.raises(MessagingTimeout):
        a.recv(timeout=1)  # (nothing else: no second copy through the store ...)
    assert not a._mailbox._held  # (... not even one held for a number never sent)
    with pytest.raises(PeerExited):  # (its goodbye came after it)
        a.recv(source=b.id, timeout=10)


def test_an_acceptor_that_cannot_start_a_call_back_goes_on(instances: Any, elsewhere: Path) -> None:
    """A link back that no thread could be started for (threads ran out) is given up, and
    the acceptor goes on accepting (before: the RuntimeError ended the acceptor, and the
    instance took no link in again)."""
    a = instances(host="host-a", tcp_host="127.0.0.1")
    b = instances(host="host-b", tcp_host="127.0.0.1", sockets_in=elsewhere)
    c = instances(host="host-c", tcp_host="127.0.0.1")
    _published(a, b)
    _published(c, b)
    threading.stack_size(2**44)  # a real failure to start a thread: no memory for its stack
    try:
        a.send(b.id, "first")
        assert b.recv(source=a.id, timeout=10) == "first"
        time.sleep(0.2)  # (the acceptor tried to start the call back meanwhile)
    finally:
        threading.stack_size(0)
    assert a.id not in b._opening
    c.send(b.id, "next")
    assert b.recv(source=c.id, timeout=10) == "next"
