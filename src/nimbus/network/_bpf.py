"""A worker's counters in memory: two eBPF programs and a map the worker maps.

::

    counters = LinkCounters.attach("nimbus0")     # None where eBPF is not allowed
    counters = CgroupCounters.attach(directory)   # (a cgroup v2 directory: the same)
    counters.read()                               # in bytes, in packets, out, out, ...
    counters.close()                              # (or the worker exits: both detach)

**A link** (a worker in a namespace of its own, ``_link``): at the link's
``tcx`` ingress and egress hooks (Linux 6.6+) a program of seven
instructions adds each packet's length (Ethernet header included, a GSO
packet whole) and 1 to its direction's pair in a one-entry array map
(``BPF_F_MMAPABLE``), read with no system call. Coming in, the same bytes and
packets as ``/proc/self/net/dev`` has for the device; going out, the device
counts a few more header-only packets (pure ACKs: 6-8 of 66 bytes in a 700 kB
upload) that the egress hook does not see. They carry no payload, and the
record's bytes are payload (the bytes less 66 a packet): the same either way
(``test_link_counters_in_memory_are_the_devices``). Coming in, TCP payload that
crosses the link a second time (a duplicate segment, a peer's retransmit: below
the end of the furthest segment of its connection seen and in none of the gaps
below it, kept in an LRU hash map) is counted apart too, and the reader takes it
off: payload once, as a cgroup's (``test_a_duplicate_segment_in_is_counted_once``);
a segment that overtook another on the way, or was lost before the link and sent
again, fills a gap: new bytes (``test_segments_that_overtake_each_other_are_counted_once``).
Best effort past 16 gaps open at once in one connection (they merge: what crossed
between them counts twice if it comes again) and when two CPUs take segments of one
connection at the same moment (the map's entry is updated without a lock). Reading them cold (after a pause as between tasks) costs 2.8 us where the
pread of ``/proc/self/net/dev`` costs 10.7 (``bench/netvis.py``'s latency row).

**A cgroup** (a worker without a namespace, ``_cgcount``): ``cgroup_skb``
programs on the worker's cgroup v2 directory see every IP packet of every
socket its processes made (children included), at the socket, with no
device of its own on the way. They count payload itself: the packet's length
less its IP header and its TCP (data offset) or UDP header, read with
``bpf_skb_load_bytes`` (a GSO packet has one header for all its segments:
exact whatever the MTU); so the map holds payload bytes. What was sent again
(below the socket's ``snd_nxt``) and what came already (an IPv4 connection's
bytes as a link's above; IPv6 below ``rcv_nxt``) are counted apart, and the
reader takes them off (``_cgroup_program`` says why not by ``rcv_nxt`` alone).

The programs are attached by ``BPF_LINK_CREATE``: the links go with the last
descriptor, so a worker that dies takes them with it. Where ``bpf(2)`` is refused
(no ``CAP_BPF``, an older kernel without ``tcx``), :meth:`attach` returns None and
the worker reads ``/proc/self/net/dev`` as before (a cgroup's: the socket
counts, ``net_source`` "socket"; its manager tried the same before it chose
a cgroup, ``_cgcount.can_count``). An egress packet a shaping
qdisc drops afterwards has been counted (TCP sends it again and the record's
``tcp.retransmits`` says so).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import struct

__all__ = ["CgroupCounters", "LinkCounters"]

_SYS_BPF = {"x86_64": 321, "aarch64": 280}.get(os.uname().machine)
_MAP_CREATE, _PROG_LOAD, _LINK_CREATE = 0, 5, 28
_ARRAY, _MMAPABLE, _SCHED_CLS, _CGROUP_SKB = 2, 1 << 10, 3, 8
_TCX_INGRESS, _TCX_EGRESS = 46, 47
_CGROUP_INGRESS, _CGROUP_EGRESS = 0, 1
_TCX_NEXT = -1  # on to the next program, the link's qdiscs: the packet's way is unchanged
_PASS = 1  # a cgroup_skb program's "let it through"
_LOAD_BYTES = 26  # bpf_skb_load_bytes(skb, offset, to, len)
_VALUE = 48  # in bytes, in packets, out bytes, out packets; duplicates in (u64 each)
_CGROUP_VALUE = 64  # and: duplicates in (bytes, segments), retransmits out (bytes, segments)
_RCV_NXT, _SND_NXT = 16, 20  # in struct bpf_tcp_sock
_GAPS = 16  # gaps below a connection's furthest segment kept (bytes that have not crossed)
_STALE = 1 << 30  # a gap ending this far below the furthest is none (TCP's largest window)
_VALUE_FLOW = 4 + 8 * _GAPS  # the furthest segment's end; each gap's start and end
_MAP_LOOKUP, _MAP_UPDATE = 1, 2
_LRU_HASH, _FLOWS = 9, 4096  # connections a link keeps the furthest segment of


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, dst | src << 4, off, imm)


def _count(map_fd: int, offset: int, length: int) -> bytes:
    """value[offset] += r<length>; value[offset + 8] += 1 (r1, r2 clobbered)."""
    return b"".join(
        (
            _insn(0x18, 1, 2, 0, map_fd),  # r1 = the map's value (BPF_PSEUDO_MAP_VALUE) ...
            _insn(0, imm=offset),  # ... + offset
            _insn(0xDB, 1, length, 0, 0),  # lock *(u64 *)(r1 + 0) += r<length>
            _insn(0xB7, 2, 0, 0, 1),  # r2 = 1
            _insn(0xDB, 1, 2, 8, 0),  # lock *(u64 *)(r1 + 8) += r2
        )
    )


def _link_program(map_fd: int, offset: int) -> bytes:
    """r2 = skb->len; count it (a link's packets: the reader takes the headers off)."""
    return b"".join(
        (
            _insn(0x61, 2, 1),  # r2 = __sk_buff.len
            _count(map_fd, offset, 2),
            _insn(0xB7, 0, 0, 0, _TCX_NEXT),  # r0 = TCX_NEXT
            _insn(0x95),  # exit
        )
    )


def _link_ingress(map_fd: int, flows_fd: int) -> bytes:
    """As :func:`_link_program` coming in (at 0); and TCP payload that has crossed the link
    already (an IPv4 segment's bytes below the end of the furthest one seen of its
    connection and in none of the gaps below it: a duplicate, or a peer's retransmit of
    what had come) counted again at 32 (bytes, segments): the reader takes it off, as a
    cgroup's (``_cgroup_program``). A segment that fills a gap (one overtaken on the way,
    or lost before the link and sent again) is new bytes. The furthest end and up to
    ``_GAPS`` gaps per connection are kept in the hash map ``flows_fd``. By what crossed
    the link, not by the socket's ``rcv_nxt``: the link's hook sees a batch of packets
    before TCP has taken any of them."""
    asm = _Asm()
    asm(_insn(0xBF, 6, 1), _insn(0x61, 7, 6), _count(map_fd, 0, 7))  # r6 = skb; r7 = len
    _seen(asm, flows_fd, 14, map_fd, 32)
    asm.at("out")
    asm(_insn(0xB7, 0, 0, 0, _TCX_NEXT), _insn(0x95))
    return asm.code()


def _seen(asm: _Asm, flows_fd: int, l3: int, map_fd: int, again: int) -> None:
    """The IPv4 TCP segment in skb (r6; its IP header at ``l3``) against what its
    connection had (the hash map ``flows_fd``): the bytes of it that came already counted
    at ``again`` (bytes, segments); then to "out" (see :func:`_link_ingress`)."""
    asm(_insn(0x61, 7, 6))  # r7 = skb->len
    asm.load(1, "out", l3)  # version and IHL
    asm(_insn(0xBF, 3, 2), _insn(0x77, 3, imm=4))  # r3 = the version
    asm.jump(0x55, 3, "out", 4)  # IPv4 only
    asm(_insn(0x57, 2, imm=15), _insn(0x67, 2, imm=2), _insn(0xBF, 9, 2))  # r9 = IP header
    asm.load(1, "out", l3 + 9)  # the protocol
    asm.jump(0x55, 2, "out", 6)  # TCP only
    asm.load(1, "out", l3 + 12, reg=9)  # the data offset's byte
    asm(_insn(0x77, 2, imm=4), _insn(0x67, 2, imm=2))  # r2 = the TCP header
    asm(_insn(0xBF, 8, 2), _insn(0x0F, 8, 9), _insn(0x07, 8, imm=l3))  # r8 = all headers
    asm.load(1, "out", l3 + 13, reg=9)  # the flags
    asm(_insn(0x57, 2, imm=2), _insn(0x63, 10, 2, -32))  # *(u32 *)(fp - 32) = SYN
    asm.jump(0x55, 2, "syn", 0)  # a SYN: the connection starts (again, on a port reused)
    asm.jump(0xBD, 7, "out", src=8)  # if len <= headers goto out: no payload
    asm(_insn(0x1F, 7, 8))  # r7 = the payload
    asm.jump(0x05, 0, "key")
    asm.at("syn")
    asm(_insn(0xB7, 7, 0, 0, 1))  # r7 = 1: a SYN takes one sequence number
    asm.at("key")
    for offset, reg, size, at in ((l3 + 12, None, 8, -24), (l3, 9, 4, -16)):  # its key
        asm(_insn(0xBF, 1, 6))  # r1 = skb
        if reg is None:
            asm(_insn(0xB7, 2, 0, 0, offset))
        else:
            asm(_insn(0xBF, 2, reg), _insn(0x07, 2, imm=offset))
        asm(_insn(0xBF, 3, 10), _insn(0x07, 3, imm=at), _insn(0xB7, 4, 0, 0, size))
        asm(_insn(0x85, imm=_LOAD_BYTES))
        asm.jump(0x55, 0, "out")
    asm.load(4, "out", l3 + 4, reg=9)  # the sequence number
    asm(_insn(0xBF, 8, 2), _insn(0xDC, 8, imm=32))  # r8 = be32toh(r2)
    asm(_insn(0xBC, 9, 8), _insn(0x0C, 9, 7))  # w9 = seq + payload: the segment's end
    asm(_insn(0x61, 2, 10, -32))  # r2 = SYN
    asm.jump(0x55, 2, "new", 0)  # a SYN: its end kept, whatever was before
    asm(
        _insn(0x18, 1, 1, 0, flows_fd),  # r1 = the flows map (BPF_PSEUDO_MAP_FD)
        _insn(0),
        _insn(0xBF, 2, 10),
        _insn(0x07, 2, imm=-24),  # r2 = the key (saddr, daddr, sport, dport)
        _insn(0x85, imm=_MAP_LOOKUP),  # r0 = the end seen furthest, or NULL
    )
    asm.jump(0x15, 0, "new", 0)
    asm(_insn(0x61, 2, 0), _insn(0xBC, 4, 9), _insn(0x1C, 4, 2))  # w4 = end - furthest
    asm.jump(0xD6, 4, "behind", 0)  # if (s32) w4 <= 0 goto behind
    asm(_insn(0x63, 0, 9))  # the furthest = end
    asm(_insn(0xBC, 4, 8), _insn(0x1C, 4, 2))  # w4 = seq - the furthest before
    asm.jump(0xD6, 4, "behind", 0)  # if (s32) w4 <= 0 goto behind: no gap
    asm(_insn(0x63, 10, 2, -52), _insn(0x63, 10, 8, -48))  # a gap: [furthest, seq)
    asm.jump(0x05, 0, "place")
    asm.at("behind")
    asm(_insn(0x1C, 2, 8))  # w2 = furthest - seq: how much of it is below the furthest
    asm.jump(0xD6, 2, "out", 0)  # if (s32) w2 <= 0 goto out: new bytes
    asm(_insn(0x63, 10, 2, -56), _insn(0x62, 10, 0, -52, 0), _insn(0x62, 10, 0, -48, 0))
    asm(_insn(0xB7, 6, 0, 0, 0))  # r6 = 0: bytes of it that fill gaps (new)
    for i in range(_GAPS):
        _fill(asm, 4 + 8 * i, f"{i}")
    asm(_insn(0x61, 2, 10, -56))  # w2 = what is below the furthest
    asm.jump(0xBD, 2, "all", src=7)  # if r2 <= r7 goto all
    asm(_insn(0xBF, 2, 7))  # r2 = r7 (all of it)
    asm.at("all")
    asm(_insn(0x1F, 2, 6))  # r2 -= r6: what of it had crossed already
    asm.jump(0xD5, 2, "place", 0)  # if (s64) r2 <= 0 goto place
    asm(_insn(0xBF, 7, 2), _count(map_fd, again, 7))
    asm.at("place")  # a gap to keep (a new one, or the upper part of one filled inside)
    asm(_insn(0x61, 3, 10, -52), _insn(0x61, 5, 10, -48))  # w3, w5 = its start, end
    asm.jump(0x1D, 3, "out", src=5)  # if r3 == r5 goto out: none
    asm(_insn(0x61, 2, 0))  # w2 = the furthest
    for i in range(_GAPS):  # in the first free slot: none there, or one far behind
        at = 4 + 8 * i
        asm(_insn(0x61, 1, 0, at), _insn(0x61, 4, 0, at + 4))
        asm.jump(0x1D, 1, f"free{i}", src=4)  # if r1 == r4 goto free: none there
        asm(_insn(0xBC, 1, 2), _insn(0x1C, 1, 4))  # w1 = the furthest - its end
        asm.jump(0x66, 1, f"free{i}", _STALE)  # if (s32) w1 > _STALE goto free
        asm.jump(0x05, 0, f"taken{i}")
        asm.at(f"free{i}")
        asm(_insn(0x63, 0, 3, at), _insn(0x63, 0, 5, at + 4))
        asm.jump(0x05, 0, "out")
        asm.at(f"taken{i}")
    # none free: the last one grows to cover it (what crossed between them counts as new
    # if it comes again: more, never fewer, than the payload once)
    asm(_insn(0x61, 1, 0, 4 + 8 * (_GAPS - 1)), _insn(0x61, 4, 0, 8 + 8 * (_GAPS - 1)))
    asm(_insn(0xBC, 2, 3), _insn(0x1C, 2, 1))  # w2 = its start - the last's start
    asm.jump(0x76, 2, "low", 0)  # if (s32) w2 >= 0 goto low
    asm(_insn(0xBC, 1, 3))
    asm.at("low")
    asm(_insn(0xBC, 2, 5), _insn(0x1C, 2, 4))  # w2 = its end - the last's end
    asm.jump(0xD6, 2, "high", 0)  # if (s32) w2 <= 0 goto high
    asm(_insn(0xBC, 4, 5))
    asm.at("high")
    asm(_insn(0x63, 0, 1, 4 + 8 * (_GAPS - 1)), _insn(0x63, 0, 4, 8 + 8 * (_GAPS - 1)))
    asm.jump(0x05, 0, "out")
    asm.at("new")  # the connection's first segment seen (or its SYN): its end, no gaps
    value = -64 - _VALUE_FLOW  # on the stack below what is used above
    asm(_insn(0x63, 10, 9, value))  # *(u32 *)(fp + value) = w9
    for at in range(4, _VALUE_FLOW, 4):
        asm(_insn(0x62, 10, 0, value + at, 0))
    asm(
        _insn(0x18, 1, 1, 0, flows_fd),
        _insn(0),
        _insn(0xBF, 2, 10),
        _insn(0x07, 2, imm=-24),
        _insn(0xBF, 3, 10),
        _insn(0x07, 3, imm=value),
        _insn(0xB7, 4, 0, 0, 0),  # BPF_ANY
        _insn(0x85, imm=_MAP_UPDATE),
    )
    asm.jump(0x05, 0, "out")


def _fill(asm: _Asm, at: int, tag: str) -> None:
    """The gap at ``at`` in the flow's value (r0) against the segment [r8, r9): the bytes
    they share are new (added to r6) and leave the gap: its start moves up, its end
    down, or (the segment inside it) its upper part is kept at fp - 52 to be placed."""
    asm(_insn(0x61, 3, 0, at), _insn(0x61, 5, 0, at + 4))  # w3, w5 = its start, end
    asm.jump(0x1D, 3, f"next{tag}", src=5)  # if r3 == r5 goto next: none here
    asm(_insn(0xBC, 1, 8), _insn(0xBC, 4, 8), _insn(0x1C, 4, 3))  # w1 = seq; w4 = seq - s
    asm.jump(0x76, 4, f"lo{tag}", 0)  # if (s32) w4 >= 0 goto lo
    asm(_insn(0xBC, 1, 3))  # w1 = start
    asm.at(f"lo{tag}")  # w1 = the shared part's start
    asm(_insn(0xBC, 4, 9), _insn(0xBC, 2, 9), _insn(0x1C, 2, 5))  # w4 = end; w2 = end - e
    asm.jump(0xD6, 2, f"hi{tag}", 0)  # if (s32) w2 <= 0 goto hi
    asm(_insn(0xBC, 4, 5))  # w4 = the gap's end
    asm.at(f"hi{tag}")  # w4 = the shared part's end
    asm(_insn(0xBC, 2, 4), _insn(0x1C, 2, 1))  # w2 = its length
    asm.jump(0xD6, 2, f"next{tag}", 0)  # if (s32) w2 <= 0 goto next: nothing shared
    asm(_insn(0x0F, 6, 2))  # r6 += r2
    asm.jump(0x5D, 1, f"mid{tag}", src=3)  # if r1 != r3 goto mid: it starts inside
    asm(_insn(0x63, 0, 4, at))  # the gap starts at its end now (none left if that is e)
    asm.jump(0x05, 0, f"next{tag}")
    asm.at(f"mid{tag}")
    asm(_insn(0x63, 0, 1, at + 4))  # the gap ends at its start now
    asm.jump(0x1D, 4, f"next{tag}", src=5)  # if r4 == r5 goto next: up to the gap's end
    # the upper part: to place; widened to cover one kept already (overlapping gaps)
    asm(_insn(0x61, 1, 10, -52), _insn(0x61, 3, 10, -48))
    asm.jump(0x1D, 1, f"put{tag}", src=3)  # none pending
    asm(_insn(0xBC, 2, 4), _insn(0x1C, 2, 1))
    asm.jump(0xD6, 2, f"lo2{tag}", 0)
    asm(_insn(0xBC, 4, 1))
    asm.at(f"lo2{tag}")
    asm(_insn(0xBC, 2, 5), _insn(0x1C, 2, 3))
    asm.jump(0x76, 2, f"put{tag}", 0)
    asm(_insn(0xBC, 5, 3))
    asm.at(f"put{tag}")
    asm(_insn(0x63, 10, 4, -52), _insn(0x63, 10, 5, -48))
    asm.at(f"next{tag}")


class _Asm:
    """Instructions with forward jumps to labels (filled in by :meth:`code`)."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.labels: dict[str, int] = {}
        self.jumps: list[tuple[int, str]] = []

    def __call__(self, *insns: bytes) -> None:
        for insn in insns:
            self.out += insn

    def at(self, label: str) -> None:
        self.labels[label] = len(self.out) // 8

    def jump(self, code: int, dst: int, label: str, imm: int = 0, src: int = 0) -> None:
        self.jumps.append((len(self.out) // 8, label))
        self(_insn(code, dst, src, 0, imm))

    def load(self, size: int, fail: str, offset: int, reg: int | None = None) -> None:
        """r2 = the packet's ``size`` bytes at r<reg> + offset (or at ``offset``), as they
        are (network order); to ``fail`` if they cannot be read (r1-r5 clobbered)."""
        self(_insn(0xBF, 1, 6))  # r1 = skb
        if reg is None:
            self(_insn(0xB7, 2, 0, 0, offset))  # r2 = offset
        else:
            self(_insn(0xBF, 2, reg), _insn(0x07, 2, imm=offset))  # r2 = r<reg> + offset
        self(
            _insn(0xBF, 3, 10),  # r3 = fp
            _insn(0x07, 3, imm=-8),  # r3 -= 8
            _insn(0xB7, 4, 0, 0, size),  # r4 = size
            _insn(0x85, imm=_LOAD_BYTES),  # r0 = bpf_skb_load_bytes(r1, r2, r3, r4)
        )
        self.jump(0x55, 0, fail)  # if r0 != 0 goto fail
        self(_insn({1: 0x71, 4: 0x61}[size], 2, 10, -8))  # r2 = *(u8 or u32 *)(fp - 8)

    def code(self) -> bytes:
        out = bytearray(self.out)
        for at, label in self.jumps:
            struct.pack_into("<h", out, at * 8 + 2, self.labels[label] - at - 1)
        return bytes(out)


def _cgroup_program(map_fd: int, offset: int, nxt: int, flows_fd: int = -1) -> bytes:
    """Payload bytes of an IP packet at a cgroup's socket (at ``offset``: bytes, packets):
    skb->len less its IP header and its TCP (data offset) or UDP header; what cannot be
    read counts whole. TCP payload already sent or received is counted again at
    ``offset + 32`` (bytes, segments): going out (a retransmit), sequence numbers below
    the socket's ``snd_nxt`` (at ``nxt`` in ``struct bpf_tcp_sock``); coming in (a
    duplicate, a peer's retransmit), with ``flows_fd``, an IPv4 segment's bytes that
    had come already (:func:`_seen`, as a link's), an IPv6 one's below ``rcv_nxt``.
    Not by ``rcv_nxt`` alone: the hook is run before TCP takes the segment, which may
    wait in the socket's backlog (its owner busy) while the peer's timer sends it
    again, or be dropped there (the backlog full) and come again: both counted twice."""
    asm = _Asm()
    asm(
        _insn(0xBF, 6, 1),  # r6 = skb
        _insn(0x61, 7, 6),  # r7 = skb->len
        _insn(0xB7, 8, 0, 0, 0),  # r8 = 0: header bytes
        _insn(0xB7, 9, 0, 0, 0),  # r9 = 0: the IP header's length, where TCP
    )
    asm.load(1, "add", 0)  # version and IHL
    asm(_insn(0xBF, 3, 2), _insn(0x77, 3, imm=4))  # r3 = r2 >> 4: the version
    asm.jump(0x15, 3, "v6", 6)  # if r3 == 6 goto v6
    asm.jump(0x55, 3, "add", 4)  # if r3 != 4 goto add
    asm(_insn(0x57, 2, imm=15), _insn(0x67, 2, imm=2))  # r2 = (r2 & 15) << 2: IPv4 header
    asm(_insn(0xBF, 8, 2))  # r8 = r2
    asm.load(1, "add", 9)  # the IPv4 protocol
    asm.jump(0x05, 0, "proto")
    asm.at("v6")
    asm(_insn(0xB7, 8, 0, 0, 40))  # r8 = 40: the IPv6 header
    asm.load(1, "add", 6)  # its next header
    asm.at("proto")
    asm.jump(0x15, 2, "udp", 17)  # if r2 == 17 goto udp
    asm.jump(0x55, 2, "add", 6)  # if r2 != 6 goto add
    asm.load(1, "add", 12, reg=8)  # TCP: the data offset's byte
    asm(_insn(0x77, 2, imm=4), _insn(0x67, 2, imm=2))  # r2 = (r2 >> 4) << 2: TCP header
    asm(_insn(0xBF, 9, 8), _insn(0x0F, 8, 2))  # r9 = r8; r8 += r2
    asm.jump(0x05, 0, "add")
    asm.at("udp")
    asm(_insn(0x07, 8, imm=8))  # r8 += 8
    asm.at("add")
    asm.jump(0x3D, 7, "sub", src=8)  # if r7 >= r8 goto sub
    asm(_insn(0xBF, 8, 7))  # r8 = r7 (a malformed packet: no bytes, not below 0)
    asm.at("sub")
    asm(_insn(0x1F, 7, 8))  # r7 -= r8: the payload
    asm(_count(map_fd, offset, 7))
    asm.jump(0x15, 9, "out", 0)  # not TCP: done
    if flows_fd >= 0:
        asm.load(1, "out", 0)
        asm(_insn(0x77, 2, imm=4))  # r2 = the version
        asm.jump(0x55, 2, "v6tcp", 4)  # if r2 != 4 goto v6tcp
        _seen(asm, flows_fd, 0, map_fd, offset + 32)
        asm.at("v6tcp")
    asm.jump(0x15, 7, "out", 0)  # no payload: done
    asm.load(4, "out", 4, reg=9)  # the sequence number
    asm(_insn(0xBF, 8, 2), _insn(0xDC, 8, imm=32))  # r8 = be32toh(r2)
    asm(_insn(0x79, 1, 6, 168))  # r1 = skb->sk
    asm.jump(0x15, 1, "out", 0)
    asm(_insn(0x85, imm=95))  # r0 = bpf_sk_fullsock(r1)
    asm.jump(0x15, 0, "out", 0)
    asm(_insn(0xBF, 1, 0), _insn(0x85, imm=96))  # r0 = bpf_tcp_sock(r0)
    asm.jump(0x15, 0, "out", 0)
    asm(_insn(0x61, 2, 0, nxt))  # r2 = its snd_nxt or rcv_nxt
    asm(_insn(0x1C, 2, 8))  # w2 -= w8: how far below it the segment starts (mod 2^32)
    asm.jump(0xD6, 2, "out", 0)  # if (s32) w2 <= 0 goto out: new bytes
    asm.jump(0xBD, 2, "again", src=7)  # if r2 <= r7 goto again
    asm(_insn(0xBF, 2, 7))  # r2 = r7 (all of it)
    asm.at("again")
    asm(_insn(0xBF, 7, 2), _count(map_fd, offset + 32, 7))
    asm.at("out")
    asm(_insn(0xB7, 0, 0, 0, _PASS), _insn(0x95))  # r0 = 1 (let it through); exit
    return asm.code()


class _Loader:
    """``bpf(2)`` calls whose descriptors are kept (all closed if a later one fails)."""

    def __init__(self) -> None:
        self.fds: list[int] = []
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long
        self._license = ctypes.create_string_buffer(b"GPL")

    def call(self, cmd: int, attr: bytes) -> int:
        buf = ctypes.create_string_buffer(attr, 144)
        fd = self._libc.syscall(_SYS_BPF, cmd, buf, 144)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.fds.append(fd)
        return int(fd)

    def counted(
        self, map_fd: int, target: int, kind: int, hooks: tuple[tuple[int, bytes], ...]
    ) -> mmap.mmap:
        """A program of ``kind`` on each (hook, code) of ``target``; the map, mapped."""
        for hook, code_bytes in hooks:
            code = ctypes.create_string_buffer(code_bytes)
            insns = (len(code.raw) - 1) // 8  # (the buffer's own NUL)
            attr = struct.pack(
                "IIQQIIQII16sII", kind, insns, ctypes.addressof(code),
                ctypes.addressof(self._license), 0, 0, 0, 0, 0, b"nimbus_count", 0,
                hook if kind == _CGROUP_SKB else 0,
            )  # fmt: skip
            prog = self.call(_PROG_LOAD, attr)
            self.call(_LINK_CREATE, struct.pack("4I", prog, target, hook, 0))
        return mmap.mmap(map_fd, mmap.PAGESIZE)

    def new_map(self) -> int:
        return self.call(_MAP_CREATE, struct.pack("5I", _ARRAY, 4, _CGROUP_VALUE, 1, _MMAPABLE))

    def flows_map(self) -> int:
        """A hash map of TCP connections (12-byte IPv4 key) to u32 sequence numbers: the
        end of the furthest segment seen, and the start and end of each gap below it."""
        return self.call(_MAP_CREATE, struct.pack("5I", _LRU_HASH, 12, _VALUE_FLOW, _FLOWS, 0))

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


class LinkCounters:
    """Bytes and packets through one device, counted by eBPF into memory this process maps."""

    def __init__(self, fds: list[int], view: mmap.mmap) -> None:
        self._fds, self._view = fds, view

    @classmethod
    def attach(cls, device: str) -> LinkCounters | None:
        """Count ``device``'s packets from now on; None where the system does not allow it."""
        if _SYS_BPF is None:
            return None
        bpf = _Loader()
        try:
            ifindex = socket.if_nametoindex(device)
            map_fd = bpf.new_map()
            hooks = (
                (_TCX_INGRESS, _link_ingress(map_fd, bpf.flows_map())),
                (_TCX_EGRESS, _link_program(map_fd, 16)),
            )
            view = bpf.counted(map_fd, ifindex, _SCHED_CLS, hooks)
        except (OSError, ValueError):
            bpf.close()
            return None
        return cls(bpf.fds, view)

    def read(self) -> bytes:
        """The counts now (48 bytes, six native u64: in bytes, in packets, out bytes, out
        packets; of those in, TCP payload that came twice (bytes, segments))."""
        return self._view[:_VALUE]

    def close(self) -> None:
        self._view.close()
        for fd in self._fds:
            os.close(fd)
        self._fds = []


class CgroupCounters(LinkCounters):
    """Payload bytes and packets of every socket made in one cgroup v2 directory (and
    below it), counted by eBPF into memory this process maps (in, out: as a link's)."""

    @classmethod
    def attach(cls, device: str) -> CgroupCounters | None:
        """Count the sockets of the cgroup directory ``device`` from now on; None where
        the system does not allow it."""
        if _SYS_BPF is None:
            return None
        bpf = _Loader()
        try:
            directory = os.open(device, os.O_RDONLY | os.O_DIRECTORY)
            bpf.fds.append(directory)
            map_fd = bpf.new_map()
            hooks = (
                (_CGROUP_INGRESS, _cgroup_program(map_fd, 0, _RCV_NXT, bpf.flows_map())),
                (_CGROUP_EGRESS, _cgroup_program(map_fd, 16, _SND_NXT)),
            )
            view = bpf.counted(map_fd, directory, _CGROUP_SKB, hooks)
        except OSError:
            bpf.close()
            return None
        bpf.fds.remove(directory)  # the links hold the cgroup; the directory is not needed
        os.close(directory)
        return cls(bpf.fds, view)

    def read(self) -> bytes:
        """The counts now (64 bytes, eight native u64: payload in bytes, in packets, out
        bytes, out packets; of those, duplicates in (bytes, segments), retransmits out)."""
        return self._view[:_CGROUP_VALUE]
