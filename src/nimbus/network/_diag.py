"""TCP sockets of this network namespace and their ``TCP_INFO``, by sock_diag netlink.

One dump request (``SOCK_DIAG_BY_FAMILY``, IPv4 and IPv6, all states) returns
every TCP socket of the namespace with its ``struct tcp_info``: no ``ss``
process, no ``/proc`` walk. Also :func:`tcp_counters`, the namespace's
``RetransSegs`` and ``OutSegs`` from ``/proc/self/net/snmp``.
"""

from __future__ import annotations

import _socket
import os
import socket
import struct
from typing import NamedTuple

__all__ = ["Conn", "connections", "tcp_counters"]

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 1, 0x300
NLMSG_DONE, NLMSG_ERROR = 3, 2
INET_DIAG_INFO = 2
_STATES = 0xFFF & ~(1 << 10)  # every state but LISTEN


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


def _request(family: int) -> bytes:
    req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 0, _STATES)
    req += b"\0" * 48  # inet_diag_sockid: any
    return (
        struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
        + req
    )


def _parse(data: bytes, out: list[Conn]) -> bool:
    """Add the sockets in one netlink read; True once the dump is done."""
    pos = 0
    while pos + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, pos)
        if kind in (NLMSG_DONE, NLMSG_ERROR) or length < 16:
            return True
        msg = pos + 16
        state = data[msg + 1]
        sport, dport = struct.unpack_from("!HH", data, msg + 4)
        inode = struct.unpack_from("=I", data, msg + 68)[0]
        attr = msg + 72
        end = pos + length
        while attr + 4 <= end:
            alen, atype = struct.unpack_from("=HH", data, attr)
            if alen < 4:
                break
            if atype == INET_DIAG_INFO and alen - 4 >= 168:
                info = attr + 4
                rtt, min_rtt = struct.unpack_from("=I", data, info + 68)[0], 0
                total_retrans = struct.unpack_from("=I", data, info + 100)[0]
                acked, received = struct.unpack_from("=QQ", data, info + 120)
                min_rtt = struct.unpack_from("=I", data, info + 148)[0]
                rate = struct.unpack_from("=Q", data, info + 160)[0]
                out.append(
                    Conn(
                        sport,
                        dport,
                        state,
                        received,
                        acked,
                        total_retrans,
                        rtt,
                        min_rtt,
                        rate,
                        inode,
                    )
                )
            attr += (alen + 3) & ~3
        pos += (length + 3) & ~3
    return False


def connections() -> list[Conn]:
    """Every TCP socket (not listening) of this namespace, with its counters."""
    out: list[Conn] = []
    # a bare socket: its bytes are not the task's (nimbus.telemetry counts socket.socket)
    sock = _socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
    try:
        for family in (socket.AF_INET, socket.AF_INET6):
            sock.send(_request(family))
            while not _parse(sock.recv(65536), out):
                pass
    finally:
        sock.close()
    return out


def tcp_counters(fd: int) -> tuple[int, int]:
    """(RetransSegs, OutSegs) of this namespace; ``fd`` is ``/proc/self/net/snmp`` open."""
    lines = os.pread(fd, 8192, 0).split(b"\nTcp: ")
    names, values = lines[1].split(), lines[2].split(b"\n")[0].split()
    row = dict(zip(names, values, strict=False))
    return int(row[b"RetransSegs"]), int(row[b"OutSegs"])
