"""A worker's counters in memory: two eBPF programs and a map the worker maps.

::

    counters = LinkCounters.attach("nimbus0")     # None where eBPF is not allowed
    counters = CgroupCounters.attach(directory)   # (a cgroup v2 directory: the same)
    counters.read()                               # 32 bytes: in bytes, in packets, out, out
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
(``test_link_counters_in_memory_are_the_devices``). Reading them cold (after a pause as between tasks) costs 2.8 us where the
pread of ``/proc/self/net/dev`` costs 10.7 (``bench/netvis.py``'s latency row).

**A cgroup** (a worker without a namespace, ``_cgcount``): ``cgroup_skb``
programs on the worker's cgroup v2 directory see every IP packet of every
socket its processes made (children included), at the socket, with no
device of its own on the way. They count payload itself: the packet's length
less its IP header and its TCP (data offset) or UDP header, read with
``bpf_skb_load_bytes`` (a GSO packet has one header for all its segments:
exact whatever the MTU); so the map holds payload bytes, and the reader
subtracts nothing.

The programs are attached by ``BPF_LINK_CREATE``: the links go with the last
descriptor, so a worker that dies takes them with it. Where ``bpf(2)`` is refused
(no ``CAP_BPF``, an older kernel without ``tcx``), :meth:`attach` returns None and
the worker reads ``/proc/self/net/dev`` as before. An egress packet a shaping
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
_VALUE = 32  # in bytes, in packets, out bytes, out packets (u64 each)


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, dst | src << 4, off, imm)


def _add(map_fd: int, offset: int, length: int, verdict: int) -> bytes:
    """value[offset] += r<length>; value[offset + 8] += 1; return ``verdict``."""
    return b"".join(
        (
            _insn(0x18, 1, 2, 0, map_fd),  # r1 = the map's value (BPF_PSEUDO_MAP_VALUE) ...
            _insn(0, imm=offset),  # ... + offset
            _insn(0xDB, 1, length, 0, 0),  # lock *(u64 *)(r1 + 0) += r<length>
            _insn(0xB7, 2, 0, 0, 1),  # r2 = 1
            _insn(0xDB, 1, 2, 8, 0),  # lock *(u64 *)(r1 + 8) += r2
            _insn(0xB7, 0, 0, 0, verdict),  # r0 = verdict
            _insn(0x95),  # exit
        )
    )


def _link_program(map_fd: int, offset: int) -> bytes:
    """r2 = skb->len; count it (a link's packets: the reader takes the headers off)."""
    return _insn(0x61, 2, 1) + _add(map_fd, offset, 2, _TCX_NEXT)  # r2 = __sk_buff.len


def _byte_at(offset_reg: int | None, offset: int = 0) -> bytes:
    """r2 = the packet's byte at r<offset_reg> + offset (or at ``offset``); r0 != 0: none."""
    at = (
        _insn(0xB7, 2, 0, 0, offset)  # r2 = offset
        if offset_reg is None
        else _insn(0xBF, 2, offset_reg) + _insn(0x07, 2, imm=offset)  # r2 = r<reg> + offset
    )
    return b"".join(
        (
            _insn(0xBF, 1, 6),  # r1 = skb
            at,
            _insn(0xBF, 3, 10),  # r3 = fp
            _insn(0x07, 3, imm=-8),  # r3 -= 8
            _insn(0xB7, 4, 0, 0, 1),  # r4 = 1
            _insn(0x85, imm=_LOAD_BYTES),  # r0 = bpf_skb_load_bytes(r1, r2, r3, r4)
            _insn(0x71, 2, 10, -8),  # r2 = *(u8 *)(fp - 8) (read after r0 is looked at)
        )
    )


def _cgroup_program(map_fd: int, offset: int) -> bytes:
    """Payload bytes of an IP packet at a cgroup's socket: skb->len less its IP header
    and its TCP (data offset) or UDP header; what cannot be read counts whole."""
    out: list[bytes] = []
    labels: dict[str, int] = {}
    jumps: list[tuple[int, str, int, int, int]] = []  # (at, label, code, dst, imm)

    def emit(chunk: bytes) -> None:
        out.append(chunk)

    def here() -> int:
        return sum(len(c) for c in out) // 8

    def jump(code: int, dst: int, imm: int, label: str) -> None:
        jumps.append((here(), label, code, dst, imm))
        emit(_insn(code, dst, 0, 0, imm))  # (its offset is filled in below)

    def load(offset_reg: int | None, offset: int = 0) -> None:
        chunk = _byte_at(offset_reg, offset)
        emit(chunk[:-8])  # up to the call
        jump(0x55, 0, 0, "add")  # if r0 != 0 goto add
        emit(chunk[-8:])  # r2 = the byte

    emit(_insn(0xBF, 6, 1))  # r6 = skb
    emit(_insn(0x61, 7, 6))  # r7 = skb->len
    emit(_insn(0xB7, 8, 0, 0, 0))  # r8 = 0: header bytes
    load(None, 0)  # version and IHL
    emit(_insn(0xBF, 3, 2))  # r3 = r2
    emit(_insn(0x77, 3, imm=4))  # r3 >>= 4: the version
    jump(0x15, 3, 6, "v6")  # if r3 == 6 goto v6
    jump(0x55, 3, 4, "add")  # if r3 != 4 goto add
    emit(_insn(0x57, 2, imm=15))  # r2 &= 15
    emit(_insn(0x67, 2, imm=2))  # r2 <<= 2: the IPv4 header's length
    emit(_insn(0xBF, 8, 2))  # r8 = r2
    load(None, 9)  # the IPv4 protocol
    jump(0x05, 0, 0, "proto")
    labels["v6"] = here()
    emit(_insn(0xB7, 8, 0, 0, 40))  # r8 = 40: the IPv6 header
    load(None, 6)  # its next header
    labels["proto"] = here()
    jump(0x15, 2, 17, "udp")  # if r2 == 17 goto udp
    jump(0x55, 2, 6, "add")  # if r2 != 6 goto add
    load(8, 12)  # TCP: the data offset's byte
    emit(_insn(0x77, 2, imm=4))  # r2 >>= 4
    emit(_insn(0x67, 2, imm=2))  # r2 <<= 2: the TCP header's length
    emit(_insn(0x0F, 8, 2))  # r8 += r2
    jump(0x05, 0, 0, "add")
    labels["udp"] = here()
    emit(_insn(0x07, 8, imm=8))  # r8 += 8
    labels["add"] = here()
    jump(0x3D, 7, 0, "sub")  # (patched below: if r7 >= r8 goto sub)
    emit(_insn(0xBF, 8, 7))  # r8 = r7 (a malformed packet: no bytes, not below 0)
    labels["sub"] = here()
    emit(_insn(0x1F, 7, 8))  # r7 -= r8
    emit(_add(map_fd, offset, 7, _PASS))
    code = bytearray(b"".join(out))
    for at, label, op, dst, imm in jumps:
        src = 8 if op == 0x3D else 0  # the one register compare: r7 >= r8
        struct.pack_into("<BBhi", code, at * 8, op, dst | src << 4, labels[label] - at - 1, imm)
    return bytes(code)


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
        return self.call(_MAP_CREATE, struct.pack("5I", _ARRAY, 4, _VALUE, 1, _MMAPABLE))

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
                (_TCX_INGRESS, _link_program(map_fd, 0)),
                (_TCX_EGRESS, _link_program(map_fd, 16)),
            )
            view = bpf.counted(map_fd, ifindex, _SCHED_CLS, hooks)
        except (OSError, ValueError):
            bpf.close()
            return None
        return cls(bpf.fds, view)

    def read(self) -> bytes:
        """The counts now (32 bytes, four native u64: in bytes, in packets, out bytes, out packets)."""
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
                (_CGROUP_INGRESS, _cgroup_program(map_fd, 0)),
                (_CGROUP_EGRESS, _cgroup_program(map_fd, 16)),
            )
            view = bpf.counted(map_fd, directory, _CGROUP_SKB, hooks)
        except OSError:
            bpf.close()
            return None
        bpf.fds.remove(directory)  # the links hold the cgroup; the directory is not needed
        os.close(directory)
        return cls(bpf.fds, view)
