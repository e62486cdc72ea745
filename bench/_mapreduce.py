"""MapReduce WordCount and Sort, the shuffle through a shared directory, the endpoint's
store or direct messaging (``nimbus.messaging``); one run.

::

    W workers (nimbus.multiprocessing processes: the same for the three ways), each
    a mapper and a reducer:  make its shard (seeded) -> map -> W partitions
        shuffle: partition j of worker i to worker j, by the way measured
          shared   files <dir>/<job>/<i>-<j> (written, fsynced as a shared file system's
                   close does, renamed in), read by j once all W are there
          store    msg.send(peer j, bytes) with NIMBUS_MESSAGING_DIRECT=0: through the
                   state store (a Redis beside the endpoint, as funcX's), j recv()s W-1
          direct   msg.send(peer j, bytes); j recv()s W-1
    -> reduce (WordCount: counts merged; Sort: the keys sorted) -> checked

On nodes (``nodes``, from ``_sharedfs.Cluster``): worker i moves into node i's network
namespace before it does anything else, so every socket it makes is on that node's shaped
link; it listens for direct messages on its node's address under a host name of its own
(``NIMBUS_MESSAGING_HOST``/``_HOST_ID``: peers connect over TCP, not a Unix socket);
"shared" is the file server's export as node i mounts it (sshfs over its link); "store"
is the machine's state store, reached over the node's link. Without nodes (``--mr-local``)
all share this machine: a local directory, the state store and Unix sockets.

The time is from the start signal to the last reducer's end (map + shuffle + reduce);
"exchange" from the last map's end to the last worker's shuffle's end (its data all in);
coordination (the peers' ids, the start) goes through nimbus.messaging for all three.
Every wait, the workers' and the parent's, ends within ``limit`` seconds: a worker that
waited longer fails naming what it waited for, and the parent names the worker.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

WORDS = [f"w{i:05d}" for i in range(20000)]


def shard_text(i: int, size: int) -> bytes:
    import numpy as np

    rng = np.random.default_rng(i)
    picks = rng.zipf(1.3, size // 7) % len(WORDS)
    return " ".join(WORDS[k] for k in picks).encode()[:size]


def shard_keys(i: int, size: int) -> Any:
    import numpy as np

    return np.random.default_rng(1000 + i).integers(0, 2**63, size // 8, dtype=np.uint64)


def map_wordcount(text: bytes, w: int) -> list[bytes]:
    counts = Counter(text.split())
    parts: list[dict[bytes, int]] = [{} for _ in range(w)]
    for word, n in counts.items():
        parts[zlib.crc32(word) % w][word] = n
    return [pickle.dumps(p, protocol=5) for p in parts]


def map_sort(keys: Any, w: int) -> list[bytes]:
    import numpy as np

    bounds = np.linspace(0, 2**63, w + 1)[1:-1].astype(np.uint64)
    which = np.searchsorted(bounds, keys, side="right")
    return [keys[which == j].tobytes() for j in range(w)]


def reduce_wordcount(parts: list[bytes]) -> int:
    total: Counter[bytes] = Counter()
    for p in parts:
        total.update(pickle.loads(p))
    return sum(total.values())


def reduce_sort(parts: list[bytes]) -> int:
    import numpy as np

    keys = np.sort(np.concatenate([np.frombuffer(p, dtype=np.uint64) for p in parts]))
    assert bool((keys[1:] >= keys[:-1]).all())
    return int(keys.size)


class Stuck(Exception):
    """A wait longer than the run's limit (a hang), a worker's or the parent's."""


def _poll(want: list[Any], take: Any, end: float, what: str) -> list[Any]:
    """What ``take(item)`` gives for each item of ``want`` (None: not there yet, asked
    again), until all came or ``end`` (a monotonic time) passed: then :class:`Stuck`."""
    got = []
    while want:
        left = []
        for item in want:
            value = take(item)
            if value is None:
                left.append(item)
            else:
                got.append(value)
        want = left
        if want:
            if time.monotonic() > end:
                raise Stuck(f"{what}: {len(want)} never came ({want[:4]} ...)")
            time.sleep(0.002)
    return got


def worker(
    parent: str,
    i: int,
    w: int,
    job: str,
    way: str,
    size: int,
    shared: str,
    limit: float,
    node: tuple[str, str, str] | None = None,
) -> None:
    if node is not None:  # (its namespace, its address there, the shared mount)
        import _sharedfs

        _sharedfs.setns(node[0])
        os.environ["NIMBUS_MESSAGING_HOST"] = node[1]
        os.environ["NIMBUS_MESSAGING_HOST_ID"] = f"mapreduce-node-{i}-{node[1]}"
        if way == "shared":
            shared = str(Path(node[2]) / shared)
        from nimbus import statestore

        # the store's connections made before (in the machine's namespace) closed: the
        # next ones are this thread's, or its new threads', so on the node's link
        statestore.program().client().connection_pool.disconnect()
    if way == "store":
        os.environ["NIMBUS_MESSAGING_DIRECT"] = "0"  # every message through the store
    import nimbus.messaging as msg

    end = time.monotonic() + limit
    me = msg.instance_id()
    if node is not None:
        # its Unix socket is a file another node could not see: peers find it by its
        # TCP address on the node (it still listens there; close() minds it gone)
        unix = msg.current().entry.unix
        if unix:
            os.unlink(unix)
    msg.send(parent, (i, me))
    group = msg.recv(source=parent, timeout=limit)  # every worker's id, then the start
    data: Any = shard_text(i, size) if job == "wordcount" else shard_keys(i, size)
    msg.send(parent, "ready")
    msg.recv(source=parent, timeout=max(1.0, end - time.monotonic()))
    start = time.time()
    parts = map_wordcount(data, w) if job == "wordcount" else map_sort(data, w)
    mapped = time.time()
    mine: list[bytes] = [parts[i]]
    sent = sum(len(p) for j, p in enumerate(parts) if j != i)
    if way == "shared":
        top = Path(shared)
        for j, p in enumerate(parts):
            if j != i:
                tmp = top / f".{i}-{j}"
                with open(tmp, "wb") as f:  # a shared file system's close: on its server
                    f.write(p)
                    os.fsync(f.fileno())
                tmp.rename(top / f"{i}-{j}")
        want = [top / f"{k}-{i}" for k in range(w) if k != i]
        mine += _poll(want, lambda p: p.read_bytes() if p.exists() else None, end, "files")
    else:  # direct, or store (the same calls: NIMBUS_MESSAGING_DIRECT=0 above)
        for j, p in enumerate(parts):
            if j != i:
                msg.send(group[j], p)
        for _ in range(w - 1):
            mine.append(msg.recv(timeout=max(1.0, end - time.monotonic())))
    shuffled = time.time()
    del parts, data
    out = reduce_wordcount(mine) if job == "wordcount" else reduce_sort(mine)
    msg.send(parent, (start, shuffled, time.time(), out, sent, shuffled - mapped, mapped))


def _answer(procs: list[Any], limit: float, what: str) -> Any:
    """The next worker's answer (``what``: for the error); a worker that died instead is
    named at once (RuntimeError), and none within ``limit`` s is :class:`Stuck`."""
    import nimbus.messaging as msg
    from nimbus.errors import MessagingTimeout

    end = time.monotonic() + limit
    while True:
        try:
            return msg.recv(timeout=2.0)
        except MessagingTimeout:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                codes = ", ".join(f"{p.name}: {p.exitcode}" for p in dead)
                raise RuntimeError(f"a MapReduce worker died before {what} ({codes})") from None
            if time.monotonic() > end:
                raise Stuck(f"no worker sent {what} within {limit:.0f} s (none died)") from None


def run(
    job: str,
    way: str,
    w: int,
    size: int,
    root: Path,
    limit: float = 600.0,
    nodes: list[tuple[str, str, str]] | None = None,
) -> dict[str, Any]:
    """One job, ``w`` workers of ``size`` bytes of input each; its times and result.
    Each wait ends within ``limit`` s (a hang fails, naming what it waited for).
    ``root``: the shared directory as this process reaches it; ``nodes``: worker i's
    (namespace path, address, the shared directory as it mounts it), or all here."""
    import nimbus.messaging as msg
    import nimbus.multiprocessing as nmp

    tag = f"{job}-{way}-{os.getpid()}-{time.monotonic_ns()}"
    here = root / tag
    if way == "shared":
        os.makedirs(here)
    shared = tag if nodes else str(here)
    me = msg.instance_id()
    procs = [
        nmp.Process(
            target=worker,
            args=(me, i, w, job, way, size, shared, limit, nodes[i] if nodes else None),
        )
        for i in range(w)
    ]
    for p in procs:
        p.start()
    try:
        ids = [peer for _, peer in sorted(_answer(procs, limit, "its id") for _ in procs)]
        for peer in ids:
            msg.send(peer, ids)
        for _ in procs:
            _answer(procs, limit, "ready")
        begin = time.time()
        for peer in ids:
            msg.send(peer, "go")
        done = [_answer(procs, limit, "its result") for _ in procs]
    except BaseException:  # (a SIGTERM, a worker that died): the others stopped at once
        for p in procs:
            if p.exitcode is None:
                p.kill()
        raise
    finally:
        for p in procs:
            p.join(min(60.0, limit))
            if p.exitcode is None:
                p.kill()  # stuck: a hang is an error of this run, not of the next
                p.join(10)
        if way == "shared":
            shutil.rmtree(here, ignore_errors=True)
    end = max(d[2] for d in done)
    return {
        "seconds": end - begin,
        "shuffle": max(d[5] for d in done),  # the slowest worker's, from its map's end
        # from the last map's end to the last worker's data all in: the exchange alone,
        # without the wait for a slower mapper (4 workers on 2 loaded cores end apart)
        "exchange": max(d[1] for d in done) - max(d[6] for d in done),
        "result": sum(d[3] for d in done),
        "shuffled_bytes": sum(d[4] for d in done),
    }


# ---------------------------------------------------------------- the row, on nodes


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def machine_store(base: Path) -> Iterator[int]:
    """A redis-server on the machine's 127.0.0.1 over TCP (the endpoint's, beside it:
    nodes reach it over their links), this program's state store (``NIMBUS_REDIS_URL``)
    while in the block; started and stopped (by its pid) here. Yields its port."""
    import subprocess

    import redis

    from nimbus.statestore import redis_server_binary

    port = _free_port()
    store = subprocess.Popen(
        [
            str(redis_server_binary()), "--port", str(port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--protected-mode", "no",
            "--dir", str(base), "--loglevel", "warning",
        ],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        os.environ["NIMBUS_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=port).ping()
                break
            except redis.ConnectionError:
                if store.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {port} did not start") from None
                time.sleep(0.05)
        yield port
    finally:
        store.terminate()
        try:
            store.wait(10)
        except subprocess.TimeoutExpired:
            store.kill()
            store.wait()


def on_nodes(
    jobs: list[str], w: int, total: int, rounds: int, rate: int, server_rate: int, base: Path,
    limit: float, report: Any,
) -> None:  # fmt: skip
    """The row's runs on ``w`` nodes (``_sharedfs.Cluster``) in this process, which is
    a program of its own: its state store a redis-server on the machine's 127.0.0.1 over
    TCP (the endpoint's, beside it: nodes reach it over their links), started and
    stopped here. ``report(dict)`` gets each run's figures, with the bytes on the links.
    Call before anything of nimbus made this process's program."""
    import _sharedfs

    with machine_store(base), _sharedfs.Cluster(w, rate, server_rate, base) as cluster:
        nodes = [(n.path, n.ip, str(n.mount)) for n in cluster.nodes]
        for job in jobs:
            for _ in range(rounds):
                for way in ("shared", "store", "direct"):
                    report({"start": f"{job}, the shuffle through {way}"})
                    before = cluster.counted()
                    one = run(job, way, w, total // w, cluster.export, limit, nodes)
                    after = cluster.counted()
                    one |= {
                        "job": job,
                        "way": way,
                        "node_links_bytes": after[0] - before[0],
                        "server_link_bytes": after[1] - before[1],
                    }
                    report(one)


if __name__ == "__main__":  # python bench/_mapreduce.py '<json of on_nodes' arguments>'
    import json
    import signal
    import sys

    here = Path(__file__).resolve().parent  # after the stdlib: bench/multiprocessing.py
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here] + [str(here)]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally clauses run
    a = json.loads(sys.argv[1])
    a["base"] = Path(a["base"])
    for unit in ("rate", "server_rate"):  # (1000 meant as Mbit/s hung sshfs on a 1 kbit/s link)
        if a[unit] < 1_000_000:
            sys.exit(f"{unit} is in bits/s (1 Gbit/s: 1000000000), not {a[unit]}: below 1 Mbit/s")

    def report(figures: dict[str, Any]) -> None:
        print(json.dumps(figures), flush=True)

    on_nodes(**a, report=report)
