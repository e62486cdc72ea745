"""TCP connections of the namespace and their ``TCP_INFO``; the namespace's TCP counters.

:func:`namespace_connections` dumps every TCP connection of this network
namespace with its ``TCP_INFO`` (sock_diag netlink: children's and C
libraries' connections included). A dump walks the namespace's socket hash
table: some 40 us where the namespace has a table of its own (``_link``
makes one of 1024 buckets, ``net.ipv4.tcp_child_ehash_entries`` of the template
namespace it is made from, Linux 6.1+),
20 ms on the node's shared one; there :func:`open_connections` reads this
process's own sockets instead (``getsockopt`` on each descriptor of
``/proc/self/fd``). :func:`tcp_counters` the namespace's ``RetransSegs`` and
``OutSegs`` from ``/proc/self/net/snmp``.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import NamedTuple

__all__ = ["Conn", "namespace_connections", "open_connections", "own_hash_table", "tcp_counters"]


class Conn(NamedTuple):
    local_port: int
    remote_port: int
    state: int
    bytes_in: int  # tcpi_bytes_received
    bytes_out: int  # tcpi_bytes_acked
    retrans: int  # tcpi_total_retrans
    rtt_us: int
    min_rtt_us: int
    delivery_rate: int  # bytes/s
    inode: int
    bytes_retrans: int = 0  # tcpi_bytes_retrans: sent again (on the link twice)


def _from_info(info: bytes, local: int, remote: int, inode: int) -> Conn | None:
    if len(info) < 168:
        return None
    rtt = struct.unpack_from("=I", info, 68)[0]
    total_retrans = struct.unpack_from("=I", info, 100)[0]
    acked, received = struct.unpack_from("=QQ", info, 120)
    min_rtt = struct.unpack_from("=I", info, 148)[0]
    rate = struct.unpack_from("=Q", info, 160)[0]
    again = struct.unpack_from("=Q", info, 208)[0] if len(info) >= 216 else 0
    return Conn(
        local, remote, info[0], received, acked, total_retrans, rtt, min_rtt, rate, inode, again
    )


def _conn(sock: socket.socket, inode: int) -> Conn | None:
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
        local, remote = sock.getsockname()[1], sock.getpeername()[1]
    except OSError:  # not TCP, not connected
        return None
    return _from_info(info, local, remote, inode)


def own_hash_table() -> bool:
    """Whether this namespace has a TCP socket table of its own (a dump walks only it)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_ehash_entries") as f:
            return 0 < int(f.read()) <= 1 << 16
    except (OSError, ValueError):
        return False


NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY, INET_DIAG_INFO = 4, 20, 2
NLM_F_DUMP_REQUEST = 0x301
NLMSG_ERROR, NLMSG_DONE = 2, 3
_STATES = 0xFFF & ~(1 << 10) & ~(1 << 6)  # all but LISTEN and TIME_WAIT (no TCP_INFO)


def namespace_connections() -> list[Conn]:
    """Every TCP connection of this namespace now (IPv4 and IPv6), with its ``TCP_INFO``."""
    out: list[Conn] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as nl:
        for family in (socket.AF_INET, socket.AF_INET6):
            body = struct.pack(
                "=BBBBI", family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 0, _STATES
            ) + bytes(48)
            nl.send(struct.pack("=IHHII", 16 + len(body), SOCK_DIAG_BY_FAMILY,
                                NLM_F_DUMP_REQUEST, 1, 0) + body)  # fmt: skip
            while _parse_dump(nl.recv(1 << 16), out):
                pass
    return out


def _parse_dump(data: bytes, out: list[Conn]) -> bool:
    """Add the connections of one netlink read to ``out``; False at the dump's end."""
    at = 0
    while at + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, at)
        if kind == NLMSG_DONE:
            return False
        if kind == NLMSG_ERROR:
            raise OSError(f"sock_diag: error {struct.unpack_from('=i', data, at + 16)[0]}")
        msg = at + 16  # inet_diag_msg: family, state, timer, retrans, sockid (48), 5 x u32
        sport, dport = struct.unpack_from(">HH", data, msg + 4)
        inode = struct.unpack_from("=I", data, msg + 68)[0]
        attr, end = msg + 72, at + length
        while attr + 4 <= end:
            alen, atype = struct.unpack_from("=HH", data, attr)
            if alen < 4:
                break
            if atype == INET_DIAG_INFO:
                conn = _from_info(data[attr + 4 : attr + alen], sport, dport, inode)
                if conn is not None:
                    out.append(conn)
            attr += (alen + 3) & ~3
        at += (length + 3) & ~3
    return True


def open_connections() -> list[Conn]:
    """The TCP connections this process holds open now, with their ``TCP_INFO``.

    By ``getsockopt`` on each socket descriptor: microseconds. (A sock_diag
    netlink dump would also see the sockets of child processes, but takes some
    50 ms a dump on this kernel: too much for every task.)
    """
    out: list[Conn] = []
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not target.startswith("socket:"):
            continue
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                conn = _conn(sock, int(target[8:-1]))
                if conn is not None:
                    out.append(conn)
        finally:
            sock.close()
    return out


def tcp_counters(fd: int) -> tuple[int, int]:
    """(RetransSegs, OutSegs) of this namespace; ``fd`` is ``/proc/self/net/snmp`` open."""
    lines = os.pread(fd, 8192, 0).split(b"\nTcp: ")
    names, values = lines[1].split(), lines[2].split(b"\n")[0].split()
    row = dict(zip(names, values, strict=False))
    return int(row[b"RetransSegs"]), int(row[b"OutSegs"])


def duplicates_received(fd: int) -> int:
    """Segments this namespace received twice (a sender's retransmit of what had come):
    the D-SACKs it sent, from ``TcpExt`` of ``/proc/self/net/netstat`` open on ``fd``."""
    ext = [
        line.split()[1:]
        for line in os.pread(fd, 16384, 0).splitlines()
        if line.startswith(b"TcpExt:")
    ]
    if len(ext) < 2:
        return 0
    row = dict(zip(ext[0], ext[1], strict=False))
    return int(row.get(b"TCPDSACKOldSent", 0)) + int(row.get(b"TCPDSACKOfoSent", 0))
