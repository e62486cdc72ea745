"""A worker's own network: a namespace joined to the node by a veth pair.

::

    node (root namespace)                         worker namespace nimbus-<slot>
    127.0.0.1 services  <------ nmb<slot>h  ====veth====  nimbus0  <-rule- 127.0.0.0/8
                               10.213.x.1/30              10.213.x.2/30   (the node's loopback)
                               tc htb: to the worker      tc htb: from the worker

Everything the worker's processes send or receive over IP crosses ``nimbus0``,
so its counters are the worker's traffic, children and C libraries included.
The namespace's loopback is the node's: a rule ahead of the local table routes
127.0.0.0/8 over the link (from an address of its own, ``LOOP_NET``;
``route_localnet`` on both ends lets such packets cross it), so a database on
the node's 127.0.0.1 answers as before, with no address rewritten on the way
(rewriting them with DNAT and SNAT in the namespace cost a loopback bulk
transfer 11-18 % of its rate: conntrack on every packet). The node's own
conntrack still saw every such packet (its nat rule below loads it): a raw
``NOTRACK`` for that source address leaves it out: the worker's extra CPU per
GB over a worker without a namespace went from a median of +7.7 % (9 rounds)
to +3.6 % (12 rounds), its throughput loss in full runs from 3.8 / 6.6 % to
1.7 / 2.7 % (bench/netvis.py, interleaved; a round varies by +-3 points; GRO on
the veth ends changed nothing, +3.9 % against +3.8 %; the qdisc is noqueue and
the MTU 64K already).
Traffic to the node's link address keeps its own source and conntrack, which
its rewrite needs. A process in the namespace can still bind
127.0.0.1 (lo keeps it) but reaches the node's there, as it did before. The node
side's address is rewritten to 127.0.0.1 on the node (DNAT) for what connects
to it by that address. Unix sockets (the
worker's channel, direct messaging) do not care about namespaces.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager

from nimbus.network import _sys
from nimbus.network._meter import DEVICE
from nimbus.network._slots import Slot, addresses

__all__ = ["DEVICE", "Link"]


# the link's MTU: the loopback's, so traffic to the node's 127.0.0.1 moves in as few
# packets as it did on lo (beyond the node, path MTU discovery finds the smaller one)
MTU = 65535
FRAME, PAYLOAD = MTU + 14, MTU - 52  # bytes of a full TCP packet on the link, its payload


def _burst(rate: int) -> int:
    """htb burst for ``rate`` bits/s: 10 ms of it, at least a 64 KiB GSO packet and more."""
    return max(rate // 8 // 100, 96 * 1024)


# where the worker's source address for the node's loopback is (one /32 a slot)
LOOP_NET = "10.214."
LOOPBACK_TABLE = 127  # the worker namespace's routing table for the node's loopback
TCP_TABLE = 1024  # buckets of a worker namespace's own TCP socket table (``_diag``)
_CHILD_TABLE = "/proc/sys/net/ipv4/tcp_child_ehash_entries"
TEMPLATE = "nimbus-template"  # the namespace worker namespaces are made from
_LOCK = "/run/nimbus-net/.tcp-table"


@contextmanager
def _locked() -> Iterator[None]:
    """One manager at a time makes or removes a namespace (and the template with it)."""
    try:
        lock = os.open(_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
    finally:
        os.close(lock)  # the lock goes with it


def _from_template() -> tuple[str, ...]:
    """The prefix that makes a namespace inside the template, made now if it is not there:
    a namespace made from a namespace whose ``tcp_child_ehash_entries`` is set gets a TCP
    socket table of its own (Linux 6.1+), and the node's setting is never touched. ()
    where the kernel has no such setting (the namespace shares the node's table; the TCP
    summary reads the worker's own sockets only). Called holding ``_locked``."""
    path = f"/run/netns/{TEMPLATE}"
    enter = ("nsenter", f"--net={path}")
    if os.path.exists(path):
        if _entered(path):
            return enter
        # a file without its namespace: made in another mount namespace (a manager under
        # ``ip netns exec``: its mounts do not reach this one's) or left by a crash; remade
        # here (the other one remakes its own in turn: both hold ``_locked`` meanwhile)
        _sys.try_run("ip", "netns", "del", TEMPLATE)
    if not os.path.exists(_CHILD_TABLE):
        return ()
    if not _sys.try_run("ip", "netns", "add", TEMPLATE):
        return ()
    if not _sys.try_run(*enter, "sh", "-c", f"echo {TCP_TABLE} > {_CHILD_TABLE}"):
        _sys.try_run("ip", "netns", "del", TEMPLATE)
        return ()
    return enter


def _entered(path: str) -> bool:
    """Whether ``path`` is a network namespace in this mount namespace (not only its file)."""
    try:
        return os.stat(path).st_dev == os.stat("/proc/self/ns/net").st_dev
    except OSError:
        return False


def _drop_template() -> None:
    """The template goes with the last worker namespace (called holding ``_locked``)."""
    try:
        names = os.listdir("/run/netns")
    except OSError:
        return
    if TEMPLATE in names and not any(n.startswith("nimbus-") and n[7:].isdigit() for n in names):
        _sys.try_run("ip", "netns", "del", TEMPLATE)


class Link:
    """A namespace and its veth to the node, made by :meth:`create`, gone after :meth:`close`."""

    def __init__(self, slot: Slot) -> None:
        self.slot = slot
        self.ns = f"nimbus-{slot.number}"
        self.host_dev = f"nmb{slot.number}h"
        self.node_ip, self.worker_ip = addresses(slot.number)
        self._nat = ("-i", self.host_dev, "-d", self.node_ip, "-j", "DNAT")
        # the worker's source address for the node's loopback: its own, so the node can
        # leave that traffic (and only it) out of conntrack; same slot octets in LOOP_NET
        self.loop_ip = LOOP_NET + self.worker_ip.split(".", 2)[2]
        self._untracked = (
            ("PREROUTING", "-i", self.host_dev, "-s", self.loop_ip),
            ("OUTPUT", "-d", self.loop_ip),
        )

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.ns}"

    @classmethod
    def create(cls, slot: Slot, rate: int | None = None) -> Link:
        """Make the namespace, the veth and the loopback rewrite; shape at ``rate`` bits/s."""
        link = cls(slot)
        if slot.stale:
            link.close(free=False)
        try:
            link._create()
            if rate is not None:
                link.shape(rate, rate)
        except BaseException:
            link.close()
            raise
        return link

    def _create(self) -> None:
        ns, host, node_ip, worker_ip = self.ns, self.host_dev, self.node_ip, self.worker_ip
        with _locked():
            _sys.run(*_from_template(), "ip", "netns", "add", ns)
        _sys.run(
            "ip",
            "-batch",
            "-",
            stdin=(
                f"link add {host} mtu {MTU} type veth peer name {DEVICE} mtu {MTU} netns {ns}\n"
                f"addr add {node_ip}/30 dev {host}\n"
                f"link set {host} up\n"
                f"route add {self.loop_ip}/32 via {worker_ip} dev {host}\n"
            ),
        )
        _sys.run(
            "ip",
            "-n",
            ns,
            "-batch",
            "-",
            stdin=(
                f"addr add {worker_ip}/30 dev {DEVICE}\n"
                f"addr add {self.loop_ip}/32 dev {DEVICE}\n"
                f"link set {DEVICE} up\n"
                "link set lo up\n"
                f"route add default via {node_ip}\n"
                # 127.0.0.0/8 is the node's: routed over the link before the local table
                # is looked at (no address rewritten: no conntrack in the namespace)
                f"route add 127.0.0.0/8 via {node_ip} dev {DEVICE} src {self.loop_ip} "
                f"table {LOOPBACK_TABLE}\n"
                f"rule add pref 50 to 127.0.0.0/8 lookup {LOOPBACK_TABLE}\n"
                "rule add pref 100 lookup local\n"
                "rule del pref 0 lookup local\n"
            ),
        )
        with open(f"/proc/sys/net/ipv4/conf/{host}/route_localnet", "w") as f:
            f.write("1")
        _sys.run(
            "iptables",
            "-w",
            "-t",
            "nat",
            "-A",
            "PREROUTING",
            *self._nat,
            "--to-destination",
            "127.0.0.1",
        )
        for chain, *match in self._untracked:
            _sys.run("iptables", "-w", "-t", "raw", "-A", chain, *match, "-j", "NOTRACK")
        script = (
            "echo 1 > /proc/sys/net/ipv4/conf/all/route_localnet && "
            f"echo 1 > /proc/sys/net/ipv4/conf/{DEVICE}/route_localnet"
        )
        _sys.run("nsenter", f"--net={self.netns_path}", "sh", "-c", script)

    def shape(self, egress: int | None, ingress: int | None, *, node: tuple[str, ...] = ()) -> None:
        """Hold the worker's outgoing and incoming rates (bits/s; None: unlimited).

        A rate is what the worker's TCP payload gets: htb counts every packet's
        headers too (66 bytes a packet), so the link is given that much more.
        ``node``: the prefix that runs a command in the node's namespace (from a worker's).
        """
        for dev, rate, before, prefix in (
            (DEVICE, egress, (), ("-n", self.ns)),
            (self.host_dev, ingress, node, ()),
        ):
            if rate is None:
                _sys.try_run(*before, "tc", *prefix, "qdisc", "del", "dev", dev, "root")
                continue
            rate = rate * FRAME // PAYLOAD
            burst = _burst(rate)
            _sys.run(
                *before,
                "tc",
                *prefix,
                "-batch",
                "-",
                stdin=(
                    f"qdisc replace dev {dev} root handle 1: htb default 1\n"
                    f"class replace dev {dev} parent 1: classid 1:1 htb rate {rate}bit "
                    f"ceil {rate}bit burst {burst}b cburst {burst}b quantum 65536\n"
                ),
            )

    def close(self, *, free: bool = True) -> None:
        """Remove the namespace, the veth (with it) and the node's rewrite rule."""
        while _sys.try_run(
            "iptables",
            "-w",
            "-t",
            "nat",
            "-D",
            "PREROUTING",
            *self._nat,
            "--to-destination",
            "127.0.0.1",
        ):
            pass
        for chain, *match in self._untracked:
            while _sys.try_run("iptables", "-w", "-t", "raw", "-D", chain, *match, "-j", "NOTRACK"):
                pass
        with _locked():
            _sys.try_run("ip", "netns", "del", self.ns)
            _drop_template()
        _sys.try_run("ip", "link", "del", self.host_dev)  # gone with the namespace, normally
        if free:
            self.slot.free()
