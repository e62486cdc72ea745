"""nimbus.messaging against a stdlib Pipe, a raw Unix socket and the state store.

Everything is measured in this one run, so the ratios compare like with like
on whatever load the machine has now. Each figure is the median of its
samples; every workload runs under a time limit and an error shows in its row.

    python bench/messaging.py                 # full run
    python bench/messaging.py --quick         # smoke run (small sizes, few samples)
    python bench/messaging.py --only rtt --only directory

Rows (``nimbus`` is a nimbus Pipe or a direct message between two nimbus
processes, the root and a child started with ``nimbus.multiprocessing``):

- ``rtt <size>``: round trip of a ``bytes`` payload over an unmodified
  ``nimbus.multiprocessing`` Pipe (direct after its switch), against a stdlib
  Pipe between two forked processes and against the same nimbus Pipe with
  ``NIMBUS_MESSAGING_DIRECT=0`` (every message through the state store) and
  against a plain Redis round trip (redis-py LPUSH + BRPOP each way, the path
  the anchors measured and Lithops's Pipes take); and
  ``nimbus.messaging`` send/recv against the stdlib Pipe;
- ``rtt 100MB``: against a raw Unix socket (``sendall``/``recv_into``);
- ``oneway``: 10,000 one-way 64 B messages then an ack, in messages/s;
- ``allreduce``: a 1M-float numpy array over 4 instances, direct against the
  same collective with every message through the store;
- ``queue rtt``: a Queue put->get round trip, the root and a child each
  consuming one of two queues, against the stdlib's Queues (fork) and the same
  nimbus Queues with ``NIMBUS_MESSAGING_DIRECT=0``;
- ``queue flood``: 100,000 small items from a child to the root through one
  Queue, in items/s, against the same two references;
- ``directory``: from a new instance's first messaging call to the end of its
  first direct send to a peer (its listener bound, directory published, peer
  resolved, connected, handshaken).

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
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

sys.path.append(str(_HERE))  # after the stdlib: for _report, never for multiprocessing
from _report import grid, within  # noqa: E402

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


def _stdlib_pipe_rtt(payload: bytes, n: int) -> float:
    ctx = multiprocessing.get_context("fork")
    a, b = ctx.Pipe()
    p = ctx.Process(target=pipe_echo, args=(b,))
    p.start()
    try:
        return _rtt(a.send, a.recv, payload, n)
    finally:
        a.send(None)
        p.join(10)


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


def _nimbus_pipe_rtt(nmp: Any, payload: bytes, n: int, direct: bool) -> float:
    """An unmodified nimbus Pipe between the root and a child: direct after its switch,
    or with NIMBUS_MESSAGING_DIRECT=0 (in both processes) through the store."""
    saved = os.environ.get("NIMBUS_MESSAGING_DIRECT")
    os.environ["NIMBUS_MESSAGING_DIRECT"] = "1" if direct else "0"
    try:
        a, b = nmp.Pipe()
        p = nmp.Process(target=pipe_echo, args=(b,))
        p.start()
        b.close()
        try:
            end = time.monotonic() + SWITCH_WARMUP
            while time.monotonic() < end:
                a.send(payload)
                a.recv()
            switched = a._writer.peer is not None and a._reader.source is not None
            if switched != direct:
                raise RuntimeError(f"the Pipe is {'' if switched else 'not '}direct")
            return _rtt(a.send, a.recv, payload, n)
        finally:
            a.send(None)
            p.join(10)
            a.close()
    finally:
        if saved is None:
            os.environ.pop("NIMBUS_MESSAGING_DIRECT", None)
        else:
            os.environ["NIMBUS_MESSAGING_DIRECT"] = saved


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

    from nimbus.multiprocessing import _state

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
class Row:
    name: str
    what: str
    ref_label: str
    ref: float | None
    value: float | None
    unit: str
    target: str
    passes: Callable[[float], bool] | None
    error: str = ""

    @property
    def ratio(self) -> float | None:
        if self.ref is None or self.value is None:
            return None
        return self.value / self.ref

    @property
    def status(self) -> str:
        if self.error:
            return "ERROR"
        if self.passes is None:
            return "report"
        measured = self.ratio if self.ref is not None else self.value
        if measured is None:
            return "-"
        return "PASS" if self.passes(measured) else "MISS"


def rtt_rows(nmp: Any, quick: bool) -> list[Row]:
    rows = []
    sizes = [("64B", 64, 2000), ("1KB", 1024, 2000), ("1MB", MB, 200)]
    if quick:
        sizes = [("64B", 64, 100), ("1KB", 1024, 100), ("1MB", MB, 10)]
    for label, size, n in sizes:
        payload = os.urandom(size)
        std = _stdlib_pipe_rtt(payload, n)
        pipe = _nimbus_pipe_rtt(nmp, payload, n, True)
        direct = _msg_rtt(nmp, payload, n)
        limit = 1.3 if size <= 1024 else 1.0
        rows.append(
            Row(
                f"rtt {label}",
                "Pipe round trip",
                "stdlib Pipe",
                std,
                pipe,
                "us",
                f"<= {limit}x",
                lambda r, lim=limit: r <= lim,
            )
        )
        if size <= 1024:  # the store paths: our own (DIRECT=0) and the anchors' Redis one
            stores = [
                ("DIRECT=0 Pipe", _nimbus_pipe_rtt(nmp, payload, n, False)),
                ("redis-py LPUSH/BRPOP", _redis_rtt(payload, n)),
            ]
            for ref_label, ref in stores:
                rows.append(
                    Row(
                        f"rtt {label}",
                        "Pipe round trip",
                        ref_label,
                        ref,
                        pipe,
                        "us",
                        "<= 0.2x (5x faster)",
                        lambda r: r <= 0.2,
                    )
                )
        rows.append(
            Row(
                f"rtt {label}",
                "msg.send/recv round trip",
                "stdlib Pipe",
                std,
                direct,
                "us",
                "report",
                None,
            )
        )
    size, n = (10 * MB, 3) if quick else (100 * MB, 5)
    label = f"{size // MB}MB"
    uds = _uds_rtt(size, n)
    direct = _msg_rtt(nmp, os.urandom(size), n)
    rows.append(
        Row(
            f"rtt {label}",
            "round trip",
            "raw UDS",
            uds,
            direct,
            "ms",
            "<= 1.5x",
            lambda r: r <= 1.5,
        )
    )
    return rows


def oneway_rows(nmp: Any, quick: bool) -> list[Row]:
    import nimbus.messaging as msg

    n, rounds = (2000, 2) if quick else (10_000, 5)
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
    return [
        Row(
            "oneway",
            f"{n:,} x 64 B then an ack",
            "",
            None,
            statistics.median(rates),
            "msgs/s",
            ">= 300k/s",
            lambda v: v >= 300_000,
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


def allreduce_rows(nmp: Any, quick: bool) -> list[Row]:
    size, rounds = (100_000, 2) if quick else (1_000_000, 5)
    direct = _allreduce(nmp, size, rounds, True)
    store = _allreduce(nmp, size, rounds, False)
    return [
        Row(
            "allreduce",
            f"{size:,} float64 x 4 instances",
            "same via store",
            store,
            direct,
            "ms",
            "report",
            None,
        )
    ]


def directory_rows(nmp: Any, quick: bool) -> list[Row]:
    import nimbus.messaging as msg

    me = msg.instance_id()
    setups, firsts = [], []
    for _ in range(3 if quick else 15):
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
            None,
            statistics.median(total),
            "ms",
            "<= 10 ms",
            lambda v: v <= 0.010,
        ),
        Row(
            "directory",
            "  of which: becoming an instance",
            "",
            None,
            statistics.median(setups),
            "ms",
            "report",
            None,
        ),
        Row(
            "directory",
            "  of which: resolve+connect+send",
            "",
            None,
            statistics.median(firsts),
            "ms",
            "report",
            None,
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


def queue_rows(nmp: Any, quick: bool) -> list[Row]:
    stdlib = multiprocessing.get_context("fork")
    n_rtt, n_items, rounds = (200, 10_000, 1) if quick else (2000, 100_000, 3)
    rtt = {k: _queue_rtt(ctx, n_rtt, k) for k, ctx in ((None, stdlib), (True, nmp), (False, nmp))}
    flood = {
        k: _queue_flood(ctx, n_items, rounds, k)
        for k, ctx in ((None, stdlib), (True, nmp), (False, nmp))
    }
    rows = []
    for label, ref in (("stdlib Queue", None), ("DIRECT=0 Queue", False)):
        rows.append(
            Row(
                "queue rtt", "put->get round trip", label, rtt[ref], rtt[True], "us", "report", None
            )
        )
    for label, ref in (("stdlib Queue", None), ("DIRECT=0 Queue", False)):
        rows.append(
            Row(
                "queue flood",
                f"{n_items:,} small items, child->root",
                label,
                flood[ref],
                flood[True],
                "items/s",
                "report",
                None,
            )
        )
    return rows


WORKLOADS: dict[str, Callable[[Any, bool], list[Row]]] = {
    "rtt": rtt_rows,
    "oneway": oneway_rows,
    "allreduce": allreduce_rows,
    "queue": queue_rows,
    "directory": directory_rows,
}


# --- running and output -------------------------------------------------------------------------


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "us":
        return f"{value * 1e6:,.1f} us"
    if unit == "ms":
        return f"{value * 1e3:,.2f} ms"
    return f"{value:,.0f}/s"


def print_table(rows: list[Row], quick: bool) -> None:
    print(f"\nnimbus.messaging, one run{' (quick sizes)' if quick else ''}")
    print(f"Python {platform.python_version()} on {platform.system()}, {os.cpu_count()} CPUs")
    print("ratio = nimbus / reference (lower is better)\n")
    header = ("workload", "what", "reference", "ref", "nimbus", "ratio", "target", "result")
    table = [header]
    for row in rows:
        table.append(
            (
                row.name,
                row.what,
                row.ref_label or "-",
                fmt(row.ref, row.unit),
                fmt(row.value, row.unit),
                f"{row.ratio:.2f}x" if row.ratio is not None else "-",
                row.target,
                row.status,
            )
        )
    print(grid(table[0], table[1:]))
    for row in rows:
        if row.error:
            print(f"\n{row.name}: {row.error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few samples")
    parser.add_argument("--only", action="append", choices=sorted(WORKLOADS), help="run these")
    args = parser.parse_args(argv)
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
            rows.extend(within(limit, lambda name=name: WORKLOADS[name](nmp, args.quick)))
        except Exception as exc:
            traceback.print_exc()
            rows.append(
                Row(name, "", "", None, None, "us", "", None, f"{type(exc).__name__}: {exc}")
            )
    print_table(rows, args.quick)
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
