"""nimbus.messaging against a stdlib Pipe, a raw Unix socket and the state store.

Everything is measured in this one run: each workload measures its sides in
turn, reference, nimbus, reference, nimbus, ... (``--repeat`` times each, 3 by
default), so load drift hits both alike, and each figure is the median of a
side's repeats. Every verdict is the ratio nimbus / reference against the row's
target; a row whose target is "report" has no verdict ("-"). Where both sides
are Pipes they run the same user code (``_pipe_rtt``: the child's end closed in
the parent, the same warm-up). Every workload runs under a time limit and an
error shows in its row.

    python bench/messaging.py                 # full run
    python bench/messaging.py --quick         # smoke run (small sizes, 2 repeats)
    python bench/messaging.py --only rtt --only directory --repeat 5

Rows (``nimbus`` is a nimbus Pipe or a direct message between two nimbus
processes, the root and a child started with ``nimbus.multiprocessing``):

- ``rtt <size>``: round trip of a ``bytes`` payload over an unmodified
  ``nimbus.multiprocessing`` Pipe (direct after its switch), against a stdlib
  Pipe between two forked processes and against the same nimbus Pipe with
  ``NIMBUS_MESSAGING_DIRECT=0`` (every message through the state store) and
  against a plain Redis round trip (redis-py LPUSH + BRPOP each way, the path
  the anchors measured and Lithops's Pipes take); and
  ``nimbus.messaging`` send/recv against the stdlib Pipe (report);
- ``rtt 100MB``: against a raw Unix socket (``sendall``/``recv_into``);
- ``oneway``: 10,000 one-way 64 B messages then an ack, in messages/s, against
  the same loop over a stdlib Pipe;
- ``allreduce``: a 1M-float numpy array over 4 instances, direct against the
  same collective with every message through the store (report);
- ``queue rtt``: a Queue put->get round trip, the root and a child each
  consuming one of two queues, against the stdlib's Queues (fork) and the same
  nimbus Queues with ``NIMBUS_MESSAGING_DIRECT=0`` (report);
- ``queue flood``: 100,000 small items from a child to the root through one
  Queue, in items/s, against the same two references (report);
- ``directory``: from a new instance's first messaging call to the end of its
  first direct send to a peer (its listener bound, directory published, peer
  resolved, connected, handshaken); nothing else does this, so it has no
  reference and no verdict.

The directory of this file holds ``multiprocessing.py``, which would shadow the
stdlib: it is dropped from ``sys.path`` first.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

sys.path.append(str(_HERE))  # after the stdlib: for _report, never for multiprocessing
from _report import Figures, Judge, alternate, grid, within  # noqa: E402

MB = 1 << 20

# --- children -----------------------------------------------------------------------------------


def pipe_echo(conn: Any) -> None:
    while True:
        obj = conn.recv()
        if obj is None:
            break
        conn.send(obj)


def redis_echo(url: str, inbox: str, outbox: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    while True:
        item = client.brpop([inbox])[1]
        if item == b"":
            break
        client.lpush(outbox, item)


def uds_echo(sock: socket.socket) -> None:
    head = bytearray(8)
    while True:
        view = memoryview(head)
        while view:
            n = sock.recv_into(view)
            if not n:
                return
            view = view[n:]
        size = int.from_bytes(head, "little")
        if size == 0:
            return
        buf = bytearray(size)
        view = memoryview(buf)
        while view:
            view = view[sock.recv_into(view) :]
        sock.sendall(head)
        sock.sendall(buf)


def msg_echo(parent: str) -> None:
    import nimbus.messaging as msg

    msg.send(parent, msg.instance_id())
    while True:
        obj = msg.recv(source=parent)
        if obj is None:
            break
        msg.send(parent, obj)


def msg_sink(parent: str, n: int, rounds: int) -> None:
    import nimbus.messaging as msg

    msg.send(parent, msg.instance_id())
    for _ in range(rounds):
        for _ in range(n):
            msg.recv(source=parent)
        msg.send(parent, "ack")


def msg_allreduce(parent: str, size: int, rounds: int) -> None:
    import numpy as np

    import nimbus.messaging as msg

    msg.send(parent, msg.instance_id())
    group = msg.recv(source=parent)
    arr = np.full(size, float(group.index(msg.instance_id())))
    times = []
    for _ in range(rounds):
        msg.barrier(group)
        t0 = time.perf_counter()
        out = msg.allreduce(group, arr)
        times.append(time.perf_counter() - t0)
    expected = float(sum(range(len(group))))
    if not (out[0] == expected and out[-1] == expected):
        raise RuntimeError(f"allreduce gave {out[0]}, expected {expected}")
    msg.send(parent, times)


def msg_first_send(parent: str) -> None:
    t0 = time.perf_counter()
    import nimbus.messaging as msg

    msg.current()  # this process becomes an instance: socket, directory, token
    t1 = time.perf_counter()
    msg.send(parent, "hello")  # resolve the peer, connect, handshake, send
    t2 = time.perf_counter()
    msg.send(parent, (t1 - t0, t2 - t1, msg.current().statistics()["links_out"]))


# --- workloads ----------------------------------------------------------------------------------


def _rtt(send: Callable[[Any], None], recv: Callable[[], Any], payload: bytes, n: int) -> float:
    for _ in range(min(n, 20)):
        send(payload)
        recv()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        send(payload)
        back = recv()
        samples.append(time.perf_counter() - t0)
    if len(back) != len(payload):
        raise RuntimeError("echo returned a different payload")
    return statistics.median(samples)


SWITCH_WARMUP = 0.3  # seconds of round trips before timing: a Pipe switches within ~50 ms


def _pipe_rtt(ctx: Any, payload: bytes, n: int, direct: bool | None = None) -> float:
    """The same user code on every side: a Pipe to an echo child (the child's end
    closed in the parent), SWITCH_WARMUP of round trips, then ``n`` timed ones.
    ``ctx`` is the stdlib's fork context (``direct`` None) or nimbus, with
    NIMBUS_MESSAGING_DIRECT set for ``direct`` in both processes (checked)."""
    undo = _direct_env(direct)
    try:
        a, b = ctx.Pipe()
        p = ctx.Process(target=pipe_echo, args=(b,))
        p.start()
        b.close()
        try:
            start = time.monotonic()
            switched = False
            # at least SWITCH_WARMUP; on a loaded machine the switch may take
            # longer: wait for it (up to 10 s) rather than time the store
            while (now := time.monotonic() - start) < SWITCH_WARMUP or (
                direct and not switched and now < 10
            ):
                a.send(payload)
                a.recv()
                if direct is not None:
                    switched = a._writer.peer is not None and a._reader.active()
            if direct is not None and switched != direct:
                raise RuntimeError(f"the Pipe is {'' if switched else 'not '}direct")
            return _rtt(a.send, a.recv, payload, n)
        finally:
            a.send(None)
            p.join(10)
            a.close()
    finally:
        undo()


def _msg_child(nmp: Any, target: Callable[..., None], *args: Any) -> tuple[Any, str]:
    import nimbus.messaging as msg

    p = nmp.Process(target=target, args=(msg.instance_id(), *args))
    p.start()
    return p, msg.recv(timeout=30)


def _msg_rtt(nmp: Any, payload: bytes, n: int) -> float:
    import nimbus.messaging as msg

    p, child = _msg_child(nmp, msg_echo)
    try:
        return _rtt(lambda x: msg.send(child, x), lambda: msg.recv(source=child), payload, n)
    finally:
        msg.send(child, None)
        p.join(10)


def _redis_rtt(payload: bytes, n: int) -> float:
    """The Redis path the anchors measured (``anchors/bench_msg.py``, and Lithops's Pipes):
    redis-py LPUSH + BRPOP each way, here on the program's own store (a Unix socket)."""
    import redis

    from nimbus.multiprocessing import _site as _state

    prog = _state.program()
    inbox, outbox = prog.keys.queue("bench-redis-a"), prog.keys.queue("bench-redis-b")
    client = redis.Redis.from_url(prog.url)
    p = multiprocessing.get_context("fork").Process(
        target=redis_echo, args=(prog.url, inbox, outbox)
    )
    p.start()

    def send(item: bytes) -> None:
        client.lpush(inbox, item)

    def recv() -> bytes:
        return client.brpop([outbox])[1]

    try:
        return _rtt(send, recv, payload, n)
    finally:
        client.lpush(inbox, b"")
        p.join(10)
        client.delete(inbox, outbox)
        client.close()


def _uds_rtt(size: int, n: int) -> float:
    ctx = multiprocessing.get_context("fork")
    a, b = socket.socketpair()
    p = ctx.Process(target=uds_echo, args=(b,))
    p.start()
    payload = os.urandom(size)
    back = bytearray(size)
    head = size.to_bytes(8, "little")
    samples = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            a.sendall(head)
            a.sendall(payload)
            got = bytearray(8)
            view = memoryview(got)
            while view:
                view = view[a.recv_into(view) :]
            view = memoryview(back)
            while view:
                view = view[a.recv_into(view) :]
            samples.append(time.perf_counter() - t0)
    finally:
        a.sendall((0).to_bytes(8, "little"))
        p.join(10)
    return statistics.median(samples)


@dataclass
class Row(Figures):
    """One row: nimbus and its reference, each a list of repeats measured in turn."""

    name: str
    title: str
    ref_label: str
    unit: str
    higher_is_better: bool
    target: str
    judge: Judge | None  # of nimbus / reference; None: report (no verdict)
    baseline: list[float] = field(default_factory=list)  # the reference's
    nimbus: list[float] = field(default_factory=list)
    error: str = ""


def _rtt_size(nmp: Any, label: str, payload: bytes, n: int, repeat: int) -> list[Row]:
    """The round-trip rows of one payload size, every side measured in turn."""
    stdlib = multiprocessing.get_context("fork")
    size = len(payload)
    rows = []
    sides: dict[str, Callable[[], float]] = {
        "stdlib Pipe": lambda: _pipe_rtt(stdlib, payload, n),
        "nimbus Pipe": lambda: _pipe_rtt(nmp, payload, n, True),
        "msg": lambda: _msg_rtt(nmp, payload, n),
    }
    if size <= 1024:  # the store paths: our own (DIRECT=0) and the anchors' Redis one
        sides["DIRECT=0 Pipe"] = lambda: _pipe_rtt(nmp, payload, n, False)
        sides["redis-py LPUSH/BRPOP"] = lambda: _redis_rtt(payload, n)
    got = alternate(repeat, sides)
    limit = 1.3 if size <= 1024 else 1.0
    pipe = got["nimbus Pipe"]
    title = "Pipe round trip"
    rows.append(
        Row(
            f"rtt {label}",
            title,
            "stdlib Pipe",
            "us",
            False,
            f"<= {limit}x",
            lambda r, lim=limit: r <= lim,
            got["stdlib Pipe"],
            pipe,
        )
    )
    for ref in ("DIRECT=0 Pipe", "redis-py LPUSH/BRPOP"):
        if ref in got:
            rows.append(
                Row(
                    f"rtt {label}",
                    title,
                    ref,
                    "us",
                    False,
                    "<= 0.2x (5x faster)",
                    lambda r: r <= 0.2,
                    got[ref],
                    pipe,
                )
            )
    rows.append(
        Row(
            f"rtt {label}",
            "msg.send/recv round trip",
            "stdlib Pipe",
            "us",
            False,
            "report",
            None,
            got["stdlib Pipe"],
            got["msg"],
        )
    )
    return rows


def rtt_rows(nmp: Any, quick: bool, repeat: int) -> list[Row]:
    rows = []
    sizes = [("64B", 64, 2000), ("1KB", 1024, 2000), ("1MB", MB, 200)]
    if quick:
        sizes = [("64B", 64, 100), ("1KB", 1024, 100), ("1MB", MB, 10)]
    for label, size, count in sizes:
        rows += _rtt_size(nmp, label, os.urandom(size), count, repeat)
    size, n = (10 * MB, 3) if quick else (100 * MB, 5)
    big = os.urandom(size)
    got = alternate(
        repeat, {"uds": lambda: _uds_rtt(size, n), "msg": lambda: _msg_rtt(nmp, big, n)}
    )
    rows.append(
        Row(
            f"rtt {size // MB}MB",
            "round trip",
            "raw UDS",
            "ms",
            False,
            "<= 1.5x",
            lambda r: r <= 1.5,
            got["uds"],
            got["msg"],
        )
    )
    return rows


def pipe_sink(conn: Any, n: int, rounds: int) -> None:
    for _ in range(rounds):
        for _ in range(n):
            conn.recv()
        conn.send("ack")


def _stdlib_oneway(n: int, rounds: int) -> float:
    """The reference of ``oneway``: the same loop over a stdlib Pipe (fork)."""
    ctx = multiprocessing.get_context("fork")
    a, b = ctx.Pipe()
    p = ctx.Process(target=pipe_sink, args=(b, n, rounds + 1))
    p.start()
    b.close()
    payload = b"x" * 64
    rates = []
    try:
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            for _ in range(n):
                a.send(payload)
            a.recv()
            if r:  # the first round warms up
                rates.append(n / (time.perf_counter() - t0))
    finally:
        p.join(10)
        a.close()
    return statistics.median(rates)


def _msg_oneway(nmp: Any, n: int, rounds: int) -> float:
    import nimbus.messaging as msg

    p, child = _msg_child(nmp, msg_sink, n, rounds + 1)
    payload = b"x" * 64
    rates = []
    try:
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            for _ in range(n):
                msg.send(child, payload)
            msg.recv(source=child, timeout=60)
            if r:  # the first round warms up
                rates.append(n / (time.perf_counter() - t0))
    finally:
        p.join(10)
    return statistics.median(rates)


# was ">= 300k/s": 6x the 50,000/s of the stdlib Pipe measured beside it (the same
# loop, full sizes, 2026-11-25; README, messaging.py)
ONEWAY_OVER_PIPE = 6.0


def oneway_rows(nmp: Any, quick: bool, repeat: int) -> list[Row]:
    n, rounds = (2000, 2) if quick else (10_000, 5)
    got = alternate(
        repeat,
        {"pipe": lambda: _stdlib_oneway(n, rounds), "msg": lambda: _msg_oneway(nmp, n, rounds)},
    )
    return [
        Row(
            "oneway",
            f"{n:,} x 64 B then an ack",
            "stdlib Pipe",
            "msgs/s",
            True,
            f">= {ONEWAY_OVER_PIPE}x",
            lambda r: r >= ONEWAY_OVER_PIPE,
            got["pipe"],
            got["msg"],
        )
    ]


def _allreduce(nmp: Any, size: int, rounds: int, direct: bool) -> float:
    import nimbus.messaging as msg

    os.environ["NIMBUS_MESSAGING_DIRECT"] = "1" if direct else "0"
    try:
        procs = [
            nmp.Process(target=msg_allreduce, args=(msg.instance_id(), size, rounds))
            for _ in range(4)
        ]
        for p in procs:
            p.start()
    finally:
        os.environ.pop("NIMBUS_MESSAGING_DIRECT", None)
    ids = [msg.recv(timeout=30) for _ in procs]
    for each in ids:
        msg.send(each, ids)
    times = [msg.recv(source=each, timeout=300) for each in ids]
    for p in procs:
        p.join(10)
    return statistics.median(max(t[i] for t in times) for i in range(rounds))


def allreduce_rows(nmp: Any, quick: bool, repeat: int) -> list[Row]:
    size, rounds = (100_000, 2) if quick else (1_000_000, 5)
    got = alternate(
        repeat,
        {
            "store": lambda: _allreduce(nmp, size, rounds, False),
            "direct": lambda: _allreduce(nmp, size, rounds, True),
        },
    )
    return [
        Row(
            "allreduce",
            f"{size:,} float64 x 4 instances",
            "same via store",
            "ms",
            False,
            "report",
            None,
            got["store"],
            got["direct"],
        )
    ]


def directory_rows(nmp: Any, quick: bool, repeat: int) -> list[Row]:
    """No reference does what this times (a new instance's first direct send): the
    figures are reported, not judged."""
    import nimbus.messaging as msg

    me = msg.instance_id()
    setups, firsts = [], []
    for _ in range((3 if quick else 15) * max(1, repeat // 3)):
        p = nmp.Process(target=msg_first_send, args=(me,))
        p.start()
        sender, hello = msg.recv_with_source(timeout=30)
        setup, first, links = msg.recv(source=sender, timeout=30)
        if hello != "hello" or links != 1:
            raise RuntimeError("the first send did not go over a direct link")
        setups.append(setup)
        firsts.append(first)
        p.join(10)
    total = [a + b for a, b in zip(setups, firsts)]
    return [
        Row(
            "directory",
            "new instance -> first direct send",
            "",
            "ms",
            False,
            "report",
            None,
            [],
            total,
        ),
        Row(
            "directory",
            "  of which: becoming an instance",
            "",
            "ms",
            False,
            "report",
            None,
            [],
            setups,
        ),
        Row(
            "directory",
            "  of which: resolve+connect+send",
            "",
            "ms",
            False,
            "report",
            None,
            [],
            firsts,
        ),
    ]


def queue_echo(there: Any, back: Any) -> None:
    while True:
        item = there.get()
        back.put(item)
        if item is None:
            return


def queue_flood(q: Any, n: int, rounds: int) -> None:
    for _ in range(rounds):
        for i in range(n):
            q.put(i)
        q.put(None)


def _direct_env(direct: bool | None) -> Callable[[], None]:
    """Set NIMBUS_MESSAGING_DIRECT for ``direct`` (None: leave it); the undo."""
    saved = os.environ.get("NIMBUS_MESSAGING_DIRECT")
    if direct is not None:
        os.environ["NIMBUS_MESSAGING_DIRECT"] = "1" if direct else "0"

    def undo() -> None:
        if saved is None:
            os.environ.pop("NIMBUS_MESSAGING_DIRECT", None)
        else:
            os.environ["NIMBUS_MESSAGING_DIRECT"] = saved

    return undo


def _queue_rtt(ctx: Any, n: int, direct: bool | None) -> float:
    """Round trips over two Queues (``direct`` None: the stdlib's)."""
    undo = _direct_env(direct)
    try:
        there, back = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=queue_echo, args=(there, back))
        p.start()
        try:
            end = time.monotonic() + SWITCH_WARMUP
            while time.monotonic() < end:
                there.put(b"x" * 64)
                back.get()
            if direct is not None:
                switched = there._producer.peer is not None and bool(back._consumer.opened)
                if switched != direct:
                    raise RuntimeError(f"the Queues are {'' if switched else 'not '}direct")
            return _rtt(there.put, back.get, b"x" * 64, n)
        finally:
            there.put(None)
            back.get()
            p.join(10)
    finally:
        undo()


def _queue_flood(ctx: Any, n: int, rounds: int, direct: bool | None) -> float:
    """Items/s from a child to the root through one Queue (median of ``rounds``)."""
    undo = _direct_env(direct)
    try:
        q = ctx.Queue()
        q.put(None)
        q.get()  # the root consumes: it claims the queue (nimbus)
        p = ctx.Process(target=queue_flood, args=(q, n, rounds + 1))
        p.start()
        rates = []
        try:
            for r in range(rounds + 1):  # the first round warms up (and switches)
                t0 = time.perf_counter()
                got = 0
                while q.get() is not None:
                    got += 1
                if got != n:
                    raise RuntimeError(f"{got} items of {n}")
                if r:
                    rates.append(n / (time.perf_counter() - t0))
        finally:
            p.join(30)
        if direct is not None and bool(q._consumer.opened) != direct:
            raise RuntimeError(f"the Queue is {'' if direct else 'not '}direct")
        return statistics.median(rates)
    finally:
        undo()


def queue_rows(nmp: Any, quick: bool, repeat: int) -> list[Row]:
    stdlib = multiprocessing.get_context("fork")
    n_rtt, n_items, rounds = (200, 10_000, 1) if quick else (2000, 100_000, 3)
    rtt = alternate(
        repeat,
        {
            "stdlib Queue": lambda: _queue_rtt(stdlib, n_rtt, None),
            "DIRECT=0 Queue": lambda: _queue_rtt(nmp, n_rtt, False),
            "nimbus": lambda: _queue_rtt(nmp, n_rtt, True),
        },
    )
    flood = alternate(
        repeat,
        {
            "stdlib Queue": lambda: _queue_flood(stdlib, n_items, rounds, None),
            "DIRECT=0 Queue": lambda: _queue_flood(nmp, n_items, rounds, False),
            "nimbus": lambda: _queue_flood(nmp, n_items, rounds, True),
        },
    )
    rows = []
    for ref in ("stdlib Queue", "DIRECT=0 Queue"):
        rows.append(
            Row(
                "queue rtt",
                "put->get round trip",
                ref,
                "us",
                False,
                "report",
                None,
                rtt[ref],
                rtt["nimbus"],
            )
        )
    for ref in ("stdlib Queue", "DIRECT=0 Queue"):
        rows.append(
            Row(
                "queue flood",
                f"{n_items:,} small items, child->root",
                ref,
                "items/s",
                True,
                "report",
                None,
                flood[ref],
                flood["nimbus"],
            )
        )
    return rows


WORKLOADS: dict[str, Callable[[Any, bool, int], list[Row]]] = {
    "rtt": rtt_rows,
    "oneway": oneway_rows,
    "allreduce": allreduce_rows,
    "queue": queue_rows,
    "directory": directory_rows,
}


# --- running and output -------------------------------------------------------------------------


def print_table(rows: list[Row], quick: bool, repeat: int) -> None:
    print(f"\nnimbus.messaging, one run{' (quick sizes)' if quick else ''}")
    print(f"Python {platform.python_version()} on {platform.system()}, {os.cpu_count()} CPUs")
    print(
        f"median of {repeat} repeat(s) per side, the sides measured in turn (reference, "
        "nimbus, reference, nimbus, ...); ratio = nimbus / reference, judged by the target "
        "(report: no verdict)\n"
    )
    header = ("workload", "what", "reference", "ref", "nimbus", "ratio", "target", "result")
    table = []
    for row in rows:
        base, nim, ratio, target, status = row.figure_cells()
        table.append((row.name, row.title, row.ref_label or "-", base, nim, ratio, target, status))
    print(grid(header, table))
    for row in rows:
        if row.error:
            print(f"\n{row.name}: {row.error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few samples")
    parser.add_argument("--only", action="append", choices=sorted(WORKLOADS), help="run these")
    parser.add_argument(
        "--repeat", type=int, help="repeats per side, alternating (default 3; quick 2)"
    )
    args = parser.parse_args(argv)
    repeat = args.repeat or (2 if args.quick else 3)
    if repeat < 1:
        parser.error("--repeat must be at least 1")
    try:
        import nimbus.multiprocessing as nmp
    except ImportError:
        sys.path.insert(0, str(_HERE.parent / "src"))
        import nimbus.multiprocessing as nmp
    p = nmp.Process(target=time.sleep, args=(0,))  # starts the store and the warm workers
    p.start()
    p.join()
    rows: list[Row] = []
    for name in args.only or list(WORKLOADS):
        print(f"running {name} ...", file=sys.stderr, flush=True)
        limit = 100 if args.quick else 600
        try:
            rows.extend(
                within(limit * repeat, lambda name=name: WORKLOADS[name](nmp, args.quick, repeat))
            )
        except Exception as exc:
            traceback.print_exc()
            rows.append(
                Row(name, "", "", "us", False, "", None, error=f"{type(exc).__name__}: {exc}")
            )
    print_table(rows, args.quick, repeat)
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
