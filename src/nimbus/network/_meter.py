"""The worker's side: what one task moved, read from its namespace's counters.

::

    begin():  nimbus0 rx/tx bytes, co-location mark
    end():    the same again (and RetransSegs/OutSegs); the difference is the task's (payload: the link's
              bytes less 66 header bytes a packet), minus nimbus's own
              connections (the state store), whose TCP_INFO byte counts are read
              by sock_diag; TCP summary of the task's connections still open

A worker knows it has a namespace of its own by the device ``nimbus0`` in
``/proc/self/net/dev`` (see ``_link``); without one :meth:`TaskNet.here` is
None and the socket counts of ``nimbus.telemetry`` stay (``net_source``
"socket"). Co-location (``_colocation``): every running task holds a cell of
a map shared by the host's workers; their number at the task's start and end
(the others) gives min and mean; max is those at its start plus those started
during it (an upper bound: some may have ended before others began).
"""

from __future__ import annotations

import os
from typing import Any

from nimbus.network._colocation import Board, slot_of
from nimbus.network._diag import Conn, duplicates_received, open_connections, tcp_counters

__all__ = ["DEVICE", "TaskNet", "nimbus_port"]

DEVICE = "nimbus0"  # the worker side of its link (``_link``): its name tells a worker where it is

# Ethernet (14) + IPv4 (20) + TCP with timestamps (32) bytes of one packet; a veth
# packet is a whole GSO segment (up to 64 KiB), so a pure ACK counts 0 and a
# data packet its payload
HEADERS = 66
_own_ports: set[int] = set()
_KEY = f"\n{DEVICE}:".encode()  # its line in /proc/self/net/dev (names are right-aligned)


def nimbus_port(port: int) -> None:
    """Count TCP connections to ``port`` as nimbus's own (state store), not the task's."""
    _own_ports.add(port)


def _store_port() -> int | None:
    from nimbus.config import Settings

    url = Settings.lookup("redis_url")
    if not url:
        return None
    from urllib.parse import urlsplit

    try:
        return urlsplit(url).port or 6379
    except ValueError:
        return None


class TaskNet:
    """Counters of this worker's namespace, one task at a time."""

    def __init__(self, dev_fd: int, snmp_fd: int) -> None:
        self._dev, self._snmp = dev_fd, snmp_fd
        self._netstat = os.open("/proc/self/net/netstat", os.O_RDONLY)
        port = _store_port()
        if port:
            _own_ports.add(port)
        self._start = (0, 0, 0, 0, 0)
        self._tcp = (*tcp_counters(snmp_fd), duplicates_received(self._netstat))
        self._own: dict[int, Conn] = {}  # inode -> nimbus's own connections at begin
        self._look_own = True  # the last end found nimbus connections: baseline them
        self._board = Board(slot_of(DEVICE))
        self._others: list[int] = []

    @classmethod
    def here(cls) -> TaskNet | None:
        """A meter if this process is in a worker namespace (``nimbus0``), else None."""
        try:
            dev = os.open("/proc/self/net/dev", os.O_RDONLY)
        except OSError:
            return None
        if _KEY not in os.pread(dev, 65536, 0).replace(b" ", b"\n"):
            os.close(dev)
            return None
        return cls(dev, os.open("/proc/self/net/snmp", os.O_RDONLY))

    def _bytes(self) -> tuple[int, int]:
        """Payload received and sent so far: the link's bytes less headers per packet."""
        data = os.pread(self._dev, 65536, 0)
        at = data.index(_KEY[1:]) + len(_KEY) - 1
        f = data[at : data.index(b"\n", at)].split()
        return int(f[0]) - HEADERS * int(f[1]), int(f[8]) - HEADERS * int(f[9])

    def begin(self) -> None:
        self._others = [self._board.begin()]
        if self._look_own and _own_ports:
            self._own = {c.inode: c for c in open_connections() if c.remote_port in _own_ports}
        rin, rout = self._bytes()
        # the namespace's TCP counters as the last task's end left them (reading them
        # costs 0.1-0.3 ms: once a task, at its end, and only if it moved bytes)
        self._start = (rin, rout, *self._tcp)

    def end(self, seconds: float) -> tuple[int, int, dict[str, Any]]:
        """(bytes in, bytes out, the record's other network fields) of the task."""
        rin, rout = self._bytes()
        sin, sout, sretrans, ssegs, sdups = self._start
        nin, nout = rin - sin, rout - sout
        others_now, started_since = self._board.end()
        self._others.append(others_now)
        extra: dict[str, Any] = {"net_source": "netns"}
        others = self._others
        extra["colocated"] = {
            "min": min(others),
            "mean": sum(others) / len(others),
            "max": max(*others, others[0] + started_since),
        }
        if nin == 0 and nout == 0:
            return 0, 0, extra
        retrans, segs = tcp_counters(self._snmp)
        dups = duplicates_received(self._netstat)
        self._tcp = (retrans, segs, dups)
        conns = open_connections()  # its own: children's are not reachable here
        own_in = own_out = 0
        task_conns: list[Conn] = []
        own_seen = False
        for c in conns:
            if c.remote_port in _own_ports:
                own_seen = True
                before = self._own.get(c.inode)
                own_in += c.bytes_in - (before.bytes_in if before else 0)
                own_out += c.bytes_out - (before.bytes_out if before else 0)
                own_out += c.bytes_retrans - (before.bytes_retrans if before else 0)
            else:
                task_conns.append(c)
        self._look_own = own_seen
        # payload bytes of nimbus's connections; on the link they carry headers too
        own_in, own_out = min(own_in, nin), min(own_out, nout)
        extra["net_nimbus_in"], extra["net_nimbus_out"] = own_in, own_out
        tcp: dict[str, Any] = {
            "retransmits": retrans - sretrans,  # segments the task's side sent again
            "duplicates_in": dups - sdups,  # segments that came twice (the peer's retransmits)
            "segments_out": segs - ssegs,
            "connections": len(task_conns),
        }
        timed = [c for c in task_conns if c.rtt_us]
        if timed:
            tcp["rtt_ms"] = sum(c.rtt_us for c in timed) / len(timed) / 1000
            tcp["min_rtt_ms"] = min(c.min_rtt_us for c in timed) / 1000
            tcp["delivery_rate"] = max(c.delivery_rate for c in timed)
        extra["tcp"] = tcp
        return nin - own_in, nout - own_out, extra

    def close(self) -> None:
        for fd in (self._dev, self._snmp, self._netstat):
            os.close(fd)
        self._board.close()
