"""``nimbus netbench --offline``: hosts in namespaces, a shaped host link, a sweep.

::

    ns <tag>s (server) srv0 10.214.0.1 ==== 1 Gbit/s (htb both ways) ==== hub0 10.214.0.2
                                                                           ns <tag>h (the host:
    ns <tag>1 (worker 1) w 10.214.1.2 ======= unshaped veth ======= 10.214.1.1   a router)
    ...
    ns <tag>8 (worker 8) w 10.214.8.2 ======= unshaped veth ======= 10.214.8.1

The host link is the bottleneck every worker shares, as a function host's NIC
is: the seed's co-location experiment. As a host's NIC queueing does, it shares
fairly among its workers: under the cap's htb class each worker has a class of
its own (told by its address) that may borrow the whole link (:meth:`Offline.shaping`). For each concurrency ``n`` the first
``n`` workers each download (or upload) for ``seconds`` at once; every task's
bytes are read twice, by the client and on its worker's link (``/proc/
thread-self/net/dev`` from a thread inside the namespace: what
``nimbus.network`` records).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

from nimbus.network import _sys
from nimbus.network._link import _burst
from nimbus.network._traffic import enter, serve, transfer

__all__ = ["Offline", "Point"]

PORT = 5201


@dataclass
class Point:
    """One task of one run: who, which way, with how many others, what it moved."""

    direction: str
    concurrency: int
    task: int
    bytes: int
    seconds: float
    link_bytes: int  # on its worker's link (payload: less 66 header bytes a packet)

    @property
    def mbit(self) -> float:
        return self.bytes * 8 / self.seconds / 1e6 if self.seconds else 0.0


@dataclass
class Offline:
    """The namespaces of one offline bench; :meth:`close` removes them all."""

    workers: int = 8
    cap: int = 1_000_000_000  # bits/s of the shared host link
    tag: str = ""
    spaces: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        import os

        why = _sys.can_manage()
        if why is not None:
            raise _sys.ConfigError(f"netbench --offline: {why}; run it as root")
        self.tag = self.tag or f"nb{os.getpid() % 100000}"

    def ns(self, name: str) -> str:
        return f"{self.tag}{name}"

    def build(self) -> Offline:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _add(self, name: str) -> str:
        ns = self.ns(name)
        _sys.run("ip", "netns", "add", ns)
        self.spaces.append(ns)
        return ns

    def _pair(self, left: str, ldev: str, laddr: str, right: str, rdev: str, raddr: str) -> None:
        _sys.run("ip", "link", "add", ldev, "netns", left, "type", "veth", "peer", "name", rdev,
                 "netns", right)  # fmt: skip
        for ns, dev, addr in ((left, ldev, laddr), (right, rdev, raddr)):
            _sys.run("ip", "-n", ns, "-batch", "-", stdin=(
                f"addr add {addr}/24 dev {dev}\nlink set {dev} up\nlink set lo up\n"
            ))  # fmt: skip

    def _build(self) -> None:
        server, hub = self._add("s"), self._add("h")
        self._pair(server, "srv0", "10.214.0.1", hub, "hub0", "10.214.0.2")
        _sys.run("ip", "-n", server, "route", "add", "default", "via", "10.214.0.2")
        _sys.run("ip", "netns", "exec", hub, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        # down leaves the server by srv0 (a worker's packets told by their destination),
        # up leaves the host by hub0 (by their source)
        for ns, dev, match in ((server, "srv0", "dst"), (hub, "hub0", "src")):
            _sys.run("tc", "-n", ns, "-batch", "-", stdin=self.shaping(dev, match))
        for i in range(1, self.workers + 1):
            ns = self._add(str(i))
            self._pair(hub, f"hw{i}", f"10.214.{i}.1", ns, "w", f"10.214.{i}.2")
            _sys.run("ip", "-n", ns, "route", "add", "default", "via", f"10.214.{i}.1")

    def shaping(self, dev: str, match: str) -> str:
        """The ``tc -batch`` lines that shape ``dev`` as a host's NIC: one class holding
        the cap, under it a class a worker (told by its address's ``match``: src or dst)
        and one for anything else (ARP, the host's own). A worker is guaranteed an equal
        part of the cap and may borrow the rest up to all of it: htb lends what a class
        leaves unused to the classes that want more in turns of ``quantum`` bytes, so
        ``n`` busy workers get cap / n each, where one FIFO class let a few flows crowd
        out others (an upload got 4 Mbit/s of 1 Gbit/s at 8 tasks). Its part, not more:
        a class within its own rate sends without asking its parent, so the parts add up
        to the cap and the cap is exact."""
        cap = self.cap
        other = max(cap // 1000, 8000)  # the rest: guaranteed a little, may borrow all
        part = (cap - other) // self.workers

        def each(rate: int) -> str:  # (a class's own burst sent past the cap at every
            # start: its part's 10 ms, not the cap's; borrowing is the parent's to allow)
            return (
                f"htb rate {rate}bit ceil {cap}bit burst {_burst(rate)}b "
                f"cburst {_burst(cap)}b quantum 65536"
            )

        lines = [
            f"qdisc replace dev {dev} root handle 1: htb default 2",
            f"class replace dev {dev} parent 1: classid 1:1 {each(cap)}",
            f"class replace dev {dev} parent 1:1 classid 1:2 {each(other)}",
        ]
        for i in range(1, self.workers + 1):
            minor = f"{0x10 + i:x}"
            lines += [
                f"class replace dev {dev} parent 1:1 classid 1:{minor} {each(part)}",
                f"filter add dev {dev} parent 1: protocol ip prio 1 u32 "
                f"match ip {match} 10.214.{i}.2/32 flowid 1:{minor}",
            ]
        return "".join(line + "\n" for line in lines)

    def close(self) -> None:
        for ns in reversed(self.spaces):
            _sys.try_run("ip", "netns", "del", ns)
        self.spaces.clear()

    def __enter__(self) -> Offline:
        return self.build()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- traffic
    def run(self, direction: str, concurrency: int, seconds: float) -> list[Point]:
        """``concurrency`` workers move data ``direction`` at once for ``seconds``."""
        if not 1 <= concurrency <= self.workers:
            raise _sys.ConfigError(
                f"netbench: concurrency {concurrency} is more than the {self.workers} "
                f"workers built; use --workers {concurrency} or a smaller --concurrency"
            )
        stop = threading.Event()
        ready = threading.Event()
        box: list[socket.socket] = []
        errors: list[BaseException] = []  # of the threads: raised here, not printed there

        def server() -> None:
            try:
                enter(self.ns("s"))
                listener = socket.create_server(("10.214.0.1", PORT), backlog=64)
                box.append(listener)
                ready.set()
                serve(listener, stop)
            except BaseException as exc:  # handed to the main thread
                if not stop.is_set():
                    errors.append(exc)
                ready.set()

        threading.Thread(target=server, daemon=True).start()
        ready.wait(10)
        points: list[Point | None] = [None] * concurrency
        start = threading.Barrier(concurrency)

        def client(i: int) -> None:
            try:
                enter(self.ns(str(i + 1)))
                with open("/proc/thread-self/net/dev", "rb") as dev:
                    start.wait()
                    before = _link_bytes(dev.read(), direction)
                    dev.seek(0)
                    moved, took = transfer(("10.214.0.1", PORT), direction, seconds)
                    after = _link_bytes(dev.read(), direction)
                points[i] = Point(direction, concurrency, i + 1, moved, took, after - before)
            except BaseException as exc:  # handed to the main thread
                start.abort()
                if not stop.is_set():  # not one cut short by an interrupt
                    errors.append(exc)

        # daemon threads: an interrupt (Ctrl-C, SIGTERM) returns at once to the caller,
        # which removes the namespaces; the threads end with them, silently
        threads = [
            threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)
        ]
        try:
            if errors:
                raise errors[0]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            stop.set()
            for listener in box:
                listener.close()
        if errors:
            raise errors[0]
        time.sleep(0.3)  # the server's threads see their clients go
        return [p for p in points if p is not None]


def _link_bytes(data: bytes, direction: str) -> int:
    """Payload on device ``w`` one way (received for ``down``), less headers a packet."""
    for line in data.splitlines():
        name, _, rest = line.partition(b":")
        if name.strip() == b"w":
            f = rest.split()
            return int(f[0]) - 66 * int(f[1]) if direction == "down" else int(f[8]) - 66 * int(f[9])
    return 0
