"""The worker's side: what one task moved, read from its namespace's counters.

::

    begin():  note the task running (an attribute); the counters its start needs are
              those the last task's end read (see below); a co-location sample
              (``_colocation``) if the last is older than ``RESAMPLE``
    sample(): while the task runs long (the worker's flusher thread, from 2 ms on): its
              cell on the host's board marked (the first time), another sample
    end():    read the link's counters (a memory read, ``_bpf``; else one pread of
              /proc/self/net/dev); unmark if marked. Unchanged (the usual case for
              a task that moved nothing): no bytes, and nothing else is read. Else the
              difference of the nimbus0 lines is the task's (payload: the link's bytes
              less 66 header bytes a packet; in memory, less what came twice) and, once a task, RetransSegs/OutSegs,
              D-SACKs and TCP_INFO of the namespace's open connections (``_diag``:
              children's too): nimbus's own (the state store) are taken off, the
              task's summarized

On a task's latency path is a 32-byte read of memory the kernel's counting
programs write (``_bpf``: 2.8 us cold where the pread below costs 10.7); where
eBPF is refused, one ``pread`` instead. The board's cell (a page every counted
worker of the host writes) is not written for a task that ends within the
flusher's first look: others' samples do not see a task shorter than 2 ms,
which moves next to nothing meanwhile, and a no-op's round trip is not slowed
by a cache line the host's other workers write (``bench/netvis.py``'s latency
row). The end of
one task is the start of the next when it starts within ``FRESH`` (a worker
runs nothing between tasks: what moved in between was moved by something an
earlier task left running, and counts for the next); an idle worker's start
reads the counters again. Work done after a result is sent is no cheaper: on
a loaded host it takes the CPU the caller needs for that result
(``bench/netvis.py``: +25 us a round trip where the pread costs 13). A task
shorter than the flusher's first look (2 ms) has the latest sample, at most
``RESAMPLE`` old; a longer one has samples while it ran.

Before eBPF the pread was the cheapest exact read found (in a worker namespace, after a
200 us pause as between tasks; 100k back-to-back reads in brackets): this one
7.0 us (4.8); netlink ``RTM_GETSTATS`` (``IFLA_STATS_LINK_64``, the same
counts) 9.0 us (3.4): two system calls; ``RTM_GETLINK`` (6.4); sysfs
``statistics/*`` is not there (``nsenter --net`` keeps the node's ``/sys``)
and takes four reads for bytes and packets (6.0, under ``ip netns exec``).

A worker knows it has a namespace of its own by the device ``nimbus0`` in
``/proc/self/net/dev`` (see ``_link``), and that it is counted by its cgroup
by what its manager said and the cgroup's name (``_cgcount``): there the counters are its cgroup's
(``_bpf``: payload already, no header taken off), the TCP summary is of the
worker process's own connections (the node's socket table is shared: a dump
walks all of it); ``retransmits`` and ``duplicates_in`` are the cgroup's own,
counted by its programs, whose bytes are payload once (a segment sent again or
received twice is taken off: within 1 % of the payload under load too), and
``net_source`` is "cgroup". Without either :meth:`TaskNet.here` is None and
the socket counts of ``nimbus.telemetry`` stay (``net_source`` "socket").
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from nimbus.network._colocation import Board, Sample, slot_of, summary
from nimbus.network._diag import (
    Conn,
    duplicates_received,
    namespace_connections,
    open_connections,
    own_hash_table,
    tcp_counters,
)

__all__ = ["DEVICE", "TaskNet", "nimbus_port"]

DEVICE = "nimbus0"  # the worker side of its link (``_link``): its name tells a worker where it is

# Ethernet (14) + IPv4 (20) + TCP with timestamps (32) bytes of one packet; a veth
# packet is a whole GSO segment (up to 64 KiB), so a pure ACK counts 0 and a
# data packet its payload
HEADERS = 66
FRESH = 0.01  # seconds a read of the counters stands for a task's start
RESAMPLE = 0.1  # seconds a co-location sample stands for the next tasks' (back to back)
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
    """Counters of this worker's namespace or counting cgroup, one task at a time."""

    def __init__(self, dev_fd: int, snmp_fd: int, group: Any = None, slot: int = 0) -> None:
        """A namespace's meter (``dev_fd``, ``snmp_fd``: its /proc/self/net files), or with
        ``group`` (``_bpf.CgroupCounters``) a counting cgroup's (the worker of ``slot``)."""
        self._dev, self._snmp = dev_fd, snmp_fd
        self.source = "netns" if group is None else "cgroup"
        self._counters = group
        if group is None:
            # the link's counts in memory where eBPF is allowed (``_bpf``), else one pread
            from nimbus.network._bpf import LinkCounters  # (ctypes: only in a namespace)

            self._counters = LinkCounters.attach(DEVICE)
            slot = slot_of(DEVICE)
        self._fetch: Callable[[], bytes] = partial(os.pread, dev_fd, 4096, 0)
        self._parse = self._bytes
        if self._counters is not None:
            self._fetch = self._counters.read
            self._parse = self._mapped_bytes if group is None else self._payload
        self._netstat = os.open("/proc/self/net/netstat", os.O_RDONLY) if group is None else -1
        port = _store_port()
        if port:
            _own_ports.add(port)
        # the namespace's TCP counters (a cgroup's: none, the node's are everyone's)
        self._tcp = (
            (0, 0, 0) if group else (*tcp_counters(snmp_fd), duplicates_received(self._netstat))
        )
        self._start_tcp = self._tcp
        # the namespace's connections (children's too) where a dump is cheap, else its own
        dump = group is None and own_hash_table()
        self._connections = namespace_connections if dump else open_connections
        # nimbus's own connections (inode -> counts) as the last task's end left them
        self._own = {c.inode: c for c in self._connections() if c.remote_port in _own_ports}
        self._board = Board(slot)
        self._dev_read = self._start = b""
        self._cells, self._cell = self._board.cells, self._board.cell  # marked if it runs long
        self._running = self._marked = False
        self._read_at = self._sampled_at = -FRESH  # when (time.time()) last read, sampled
        self.samples: list[Sample] = []
        self._extra: dict[str, Any] = {}
        self._read(time.time())

    @classmethod
    def here(cls) -> TaskNet | None:
        """A meter if this process is in a worker namespace (``nimbus0``), else None."""
        try:
            dev = os.open("/proc/self/net/dev", os.O_RDONLY)
        except OSError:
            return None
        if _KEY not in os.pread(dev, 65536, 0).replace(b" ", b"\n"):
            os.close(dev)
            return cls.counted()
        return cls(dev, os.open("/proc/self/net/snmp", os.O_RDONLY))

    @classmethod
    def counted(cls) -> TaskNet | None:
        """A meter if this process is in a counting cgroup (``_cgcount``) whose counters it
        may attach, else None."""
        from nimbus.network._cgcount import counting_group

        group = counting_group()
        if group is None:
            return None
        from nimbus.network._bpf import CgroupCounters  # (ctypes: only in such a cgroup)

        counters = CgroupCounters.attach(group[0])
        if counters is None:
            return None
        try:
            return cls(-1, -1, counters, group[1])
        except OSError:  # (a sandbox's: the host's board out of reach, /run read-only)
            counters.close()
            return None  # its tasks' socket counts, as the record says

    def _read(self, now: float) -> bytes:
        self._dev_read = data = self._fetch()
        self._read_at = now
        return data

    @staticmethod
    def _bytes(data: bytes) -> tuple[int, int]:
        """Payload received and sent in ``data`` (a read of /proc/self/net/dev): the link's
        bytes less headers per packet."""
        at = data.index(_KEY) + len(_KEY)
        f = data[at : at + 240].split(None, 10)
        return int(f[0]) - HEADERS * int(f[1]), int(f[8]) - HEADERS * int(f[9])

    @staticmethod
    def _mapped_bytes(data: bytes) -> tuple[int, int]:
        """As :meth:`_bytes`, of a read of the link's counters in memory (``_bpf``): TCP
        payload that came twice (a peer's retransmit of what had come) is taken off, as
        a cgroup's (:meth:`_payload`): each byte once."""
        bin_, pin, bout, pout, dup, _ = struct.unpack("6Q", data)
        return bin_ - HEADERS * pin - dup, bout - HEADERS * pout

    @staticmethod
    def _payload(data: bytes) -> tuple[int, int]:
        """As :meth:`_bytes`, of a read of a cgroup's counters (``_bpf``: payload already,
        each byte once: what came twice or was sent again is taken off)."""
        bin_, _, bout, _, dup, _, again, _ = struct.unpack("8Q", data)
        return bin_ - dup, bout - again

    def _resample(self, now: float) -> None:
        self.samples = [self._board.sample()]
        self._sampled_at = now
        self._extra = {"net_source": self.source, "colocated": summary(self.samples)}

    def begin(self, now: float) -> None:
        """The task starts at ``now`` (``time.time()``, as its record's)."""
        self._running = True  # (its cell is marked once it runs long: :meth:`sample`)
        if not 0 <= now - self._read_at < FRESH:  # idle a while: what moved is no task's
            self._read(now)
        if not 0 <= now - self._sampled_at < RESAMPLE:
            self._resample(now)
        self._start, self._start_tcp = self._dev_read, self._tcp

    def sample(self) -> None:
        """The task runs long: its cell marked, one more co-location sample (from the
        flusher thread, while the main thread may end it: marked, then looked again)."""
        if not self._marked:
            self._marked = True
            self._cells[self._cell] = 1
            if not self._running:  # it ended meanwhile (its end may not have seen the mark)
                self._cells[self._cell] = 0
                self._marked = False
                return
        samples = self.samples
        samples.append(self._board.sample())

    def end(self, now: float) -> tuple[int, int, dict[str, Any]]:
        """(bytes in, bytes out, the record's other network fields) of the task ended ``now``."""
        data = self._read(now)
        self._running = False
        if self._marked:
            self._cells[self._cell] = 0
            self._marked = False
        extra = self._extra
        samples = self.samples
        if len(samples) > 1:  # the flusher sampled it while it ran
            extra = {"net_source": self.source, "colocated": summary(samples)}
            self.samples = [samples[-1]]  # if the next task comes at once: the latest
        if data == self._start:
            return 0, 0, extra  # the last task's while unchanged (the gauge sends it once)
        (sin, sout), (rin, rout) = self._parse(self._start), self._parse(data)
        nin, nout = rin - sin, rout - sout
        if nin == 0 and nout == 0:
            return 0, 0, extra
        extra = dict(extra)
        sretrans, ssegs, sdups = self._start_tcp
        if self._snmp >= 0:
            retrans, segs = tcp_counters(self._snmp)
            dups = duplicates_received(self._netstat)
            self._tcp = (retrans, segs, dups)
        own_in = own_out = own_again = 0
        task_conns: list[Conn] = []
        own: dict[int, Conn] = {}
        for c in self._connections():
            if c.remote_port in _own_ports:
                before = self._own.get(c.inode)
                own_in += c.bytes_in - (before.bytes_in if before else 0)
                own_out += c.bytes_out - (before.bytes_out if before else 0)
                own_again += c.bytes_retrans - (before.bytes_retrans if before else 0)
                own[c.inode] = c
            else:
                task_conns.append(c)
        self._own = own  # the next task's baseline (their counts move only with bytes)
        # payload bytes of nimbus's connections, each once; what they sent again under
        # load crossed the link twice (a cgroup's counts took it off already)
        own_in = min(own_in, nin)
        extra["net_nimbus_in"], extra["net_nimbus_out"] = own_in, min(own_out, nout)
        wire_out = min(own_out + own_again if self._snmp >= 0 else own_out, nout)
        tcp: dict[str, Any] = {"connections": len(task_conns)}
        if self._snmp >= 0:  # the namespace's counters
            tcp["retransmits"] = retrans - sretrans  # segments the task's side sent again
            tcp["duplicates_in"] = dups - sdups  # segments that came twice (the peer's retransmits)
            tcp["segments_out"] = segs - ssegs
        else:  # the cgroup's own (``_bpf``): segments sent again, and those that came twice
            start, now_ = struct.unpack("8Q", self._start), struct.unpack("8Q", data)
            tcp["retransmits"] = now_[7] - start[7]
            tcp["duplicates_in"] = now_[5] - start[5]
            tcp["bytes_retransmitted"] = now_[6] - start[6]
        timed = [c for c in task_conns if c.rtt_us]
        if timed:
            tcp["rtt_ms"] = sum(c.rtt_us for c in timed) / len(timed) / 1000
            tcp["min_rtt_ms"] = min(c.min_rtt_us for c in timed) / 1000
            tcp["delivery_rate"] = max(c.delivery_rate for c in timed)
        extra["tcp"] = tcp
        return nin - own_in, nout - wire_out, extra

    def close(self) -> None:
        if self._counters is not None:
            self._counters.close()
        for fd in (self._dev, self._snmp, self._netstat):
            if fd >= 0:
                os.close(fd)
        self._board.close()
