"""TCP connections of this process and their ``TCP_INFO``; the namespace's TCP counters.

:func:`open_connections` reads ``TCP_INFO`` of every TCP socket this process
holds (``getsockopt`` on each descriptor of ``/proc/self/fd``);
:func:`tcp_counters` the namespace's ``RetransSegs`` and ``OutSegs`` from
``/proc/self/net/snmp`` (children's connections included).
"""

from __future__ import annotations

import os
import socket
import struct
from typing import NamedTuple

__all__ = ["Conn", "open_connections", "tcp_counters"]


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


def _conn(sock: socket.socket, inode: int) -> Conn | None:
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
        local, remote = sock.getsockname()[1], sock.getpeername()[1]
    except OSError:  # not TCP, not connected
        return None
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
