"""The MapReduce shuffle alone, small: W workers on W nodes exchange one partition with
each other, direct (``nimbus.messaging`` over TCP between the nodes) against the store
(``NIMBUS_MESSAGING_DIRECT=0``); first contact and warm, several repetitions, medians.

::

    python bench/_exchange.py [--workers 4] [--size 50000] [--reps 5] [--warm 5]
                              [--mbit 1000] [--trace]      (root: namespaces)

The nodes, the store and each worker are as in ``_mapreduce`` (``worker`` there): a
namespace behind a veth shaped to ``--mbit`` both ways, the worker moved into it
before anything else, listening on its node's address under a host id of its own
(its Unix socket unlinked), the state store a redis-server on the machine's 127.0.0.1
reached over the node's link. Each repetition starts fresh workers (as a MapReduce
run does: coordination with the parent only, then the shuffle), once per way,
alternated; then ``--warm`` more exchanges between the same workers. An exchange:
the parent sends "go" to each; each worker sends its ``--size`` bytes to each other
worker and receives W-1 (as ``_mapreduce.worker``); "exchange" is from the last
worker's start to the last worker's data all in (``_mapreduce.run``'s figure, the
map being nothing here). ``--trace``: each worker's timestamps (ms from the first
start) of each send's return and each receive, and its CPU, for the first contact;
with ``EXCHANGE_TRACE=1`` also each lookup, link opened, connect and store push.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def worker(
    parent: str, i: int, w: int, way: str, size: int, rounds: int, node: tuple[str, str]
) -> None:
    import _sharedfs

    _sharedfs.setns(node[0])
    os.environ["NIMBUS_MESSAGING_HOST"] = node[1]
    os.environ["NIMBUS_MESSAGING_HOST_ID"] = f"exchange-node-{i}-{node[1]}"
    from nimbus import statestore

    statestore.program().client().connection_pool.disconnect()  # as _mapreduce.worker
    if way == "store":
        os.environ["NIMBUS_MESSAGING_DIRECT"] = "0"
    import nimbus.messaging as msg

    if os.environ.get("EXCHANGE_TRACE"):
        _trace()
    me = msg.instance_id()
    unix = msg.current().entry.unix
    if unix:
        os.unlink(unix)
    msg.send(parent, (i, me))
    group = msg.recv(source=parent, timeout=60)
    parts = [os.urandom(size) for _ in range(w)]
    for _ in range(rounds):
        msg.recv(source=parent, timeout=60)  # go
        start = time.time()
        cpu = time.process_time()
        main_cpu = time.thread_time()
        marks = []
        for j in range(w):
            if j != i:
                msg.send(group[j], parts[j])
                marks.append(("sent", j, time.time()))
        for _ in range(w - 1):
            source, got = msg.current().recv_with_source(None, 60)
            assert len(got) == size
            marks.append(("got", group.index(source), time.time()))
        marks += [(n, -1, a) for n, a, b in TIMES if a >= start] + [
            (n + "-end", -1, b) for n, a, b in TIMES if a >= start
        ]
        marks.sort(key=lambda m: m[2])
        TIMES.clear()
        marks.append(("cpu_ms", round((time.process_time() - cpu) * 1e3, 1), time.time()))
        marks.append(("main_ms", round((time.thread_time() - main_cpu) * 1e3, 1), time.time()))
        msg.send(parent, (start, time.time(), marks))


TIMES: list[tuple[str, float, float]] = []


def _trace() -> None:
    """Record each directory read and connect (name, start, end) in TIMES."""
    from nimbus.messaging import _directory, _peer, _sending

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                TIMES.append((name, t, time.time()))

        return wrapper

    lookup = _directory.Directory.lookup

    def traced(self: Any, instance_id: str) -> Any:
        cached = instance_id in self._cache or instance_id in self.local
        return timed("lookup" if cached else "lookup-store", lookup)(self, instance_id)

    _directory.Directory.lookup = traced  # type: ignore[method-assign]
    _sending.Sender._open = timed("open", _sending.Sender._open)  # type: ignore[method-assign]
    _sending.Sender._push_store = timed("push", _sending.Sender._push_store)  # type: ignore[method-assign]
    _peer.connect = timed("connect", _peer.connect)
    _peer._one_frame = timed("frame", _peer._one_frame)


def exchange_once(way: str, w: int, size: int, rounds: int, nodes: list[Any]) -> list[Any]:
    """Fresh workers, ``rounds`` exchanges; each round's (exchange s, every worker's start
    and marks)."""
    import nimbus.messaging as msg
    import nimbus.multiprocessing as nmp

    me = msg.instance_id()
    procs = [
        nmp.Process(target=worker, args=(me, i, w, way, size, rounds, nodes[i])) for i in range(w)
    ]
    for p in procs:
        p.start()
    try:
        ids = [peer for _, peer in sorted(msg.recv(timeout=120) for _ in procs)]
        for peer in ids:
            msg.send(peer, ids)
        out = []
        for _ in range(rounds):
            time.sleep(0.2)  # the workers idle, waiting for "go" (as after a map)
            for peer in ids:
                msg.send(peer, "go")
            done = [msg.recv_with_source(timeout=120) for _ in procs]
            by = {s: d for s, d in done}
            rows = [by[peer] for peer in ids]
            out.append((max(r[1] for r in rows) - max(r[0] for r in rows), rows))
        return out
    finally:
        for p in procs:
            p.join(30)
            if p.exitcode is None:
                p.kill()
                p.join(10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--size", type=int, default=50_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--mbit", type=int, default=1000)
    ap.add_argument("--trace", action="store_true")
    a = ap.parse_args()
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE)]
    import _mapreduce

    from nimbus.network import Link
    from nimbus.network._slots import claim

    links = []
    with tempfile.TemporaryDirectory() as base, _mapreduce.machine_store(Path(base)):
        try:
            for k in range(a.workers):
                link = Link.create(claim(9300 + k), a.mbit * 1_000_000)
                links.append(link)
                with open(f"/proc/sys/net/ipv4/conf/{link.host_dev}/forwarding", "w") as f:
                    f.write("1")
            nodes = [(link.netns_path, link.worker_ip) for link in links]
            first: dict[str, list[float]] = {"direct": [], "store": []}
            warm: dict[str, list[float]] = {"direct": [], "store": []}
            for rep in range(a.reps):
                for way in ("store", "direct") if rep % 2 else ("direct", "store"):
                    got = exchange_once(way, a.workers, a.size, 1 + a.warm, nodes)
                    first[way].append(got[0][0])
                    warm[way].extend(g[0] for g in got[1:])
                    print(
                        f"rep {rep} {way:6s} first {got[0][0] * 1e3:7.1f} ms, warm "
                        + " ".join(f"{g[0] * 1e3:.1f}" for g in got[1:]),
                        flush=True,
                    )
                    if a.trace:
                        rows = got[0][1]
                        t0 = min(r[0] for r in rows)
                        for k, (start, _end, marks) in enumerate(rows):
                            print(
                                f"   w{k} start {(start - t0) * 1e3:6.1f} "
                                + " ".join(f"{m[0]}{m[1]}@{(m[2] - t0) * 1e3:.1f}" for m in marks)
                            )
            print(f"{a.workers} workers, {a.size} B a partition, {a.mbit} Mbit/s, load "
                  f"{os.getloadavg()[0]:.1f}")  # fmt: skip
            for name, figures in (("first contact", first), ("warm", warm)):
                d, s = statistics.median(figures["direct"]), statistics.median(figures["store"])
                print(
                    f"{name:14s} direct {d * 1e3:7.1f} ms  store {s * 1e3:7.1f} ms  "
                    f"direct is {s / d:.2f}x the store (n={len(figures['direct'])})"
                )
        finally:
            for link in reversed(links):
                link.close()


if __name__ == "__main__":
    main()
