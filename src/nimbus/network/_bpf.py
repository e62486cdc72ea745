"""A worker link's counters in memory: two eBPF programs and a map the worker maps.

::

    counters = LinkCounters.attach("nimbus0")   # None where eBPF is not allowed
    counters.read()                             # 32 bytes: in bytes, in packets, out, out
    counters.close()                            # (or the worker exits: both detach)

At the link's ``tcx`` ingress and egress hooks (Linux 6.6+) a program of seven
instructions adds each packet's length (Ethernet header included, a GSO
packet whole) and 1 to its direction's pair in a one-entry array map
(``BPF_F_MMAPABLE``), read with no system call. Coming in, the same bytes and
packets as ``/proc/self/net/dev`` has for the device; going out, the device
counts a few more header-only packets (pure ACKs: 6-8 of 66 bytes in a 700 kB
upload) that the egress hook does not see. They carry no payload, and the
record's bytes are payload (the bytes less 66 a packet): the same either way
(``test_link_counters_in_memory_are_the_devices``). Reading them cold (after a pause as between tasks) costs 2.8 us where the
pread of ``/proc/self/net/dev`` costs 10.7 (``bench/netvis.py``'s latency row).

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

__all__ = ["LinkCounters"]

_SYS_BPF = {"x86_64": 321, "aarch64": 280}.get(os.uname().machine)
_MAP_CREATE, _PROG_LOAD, _LINK_CREATE = 0, 5, 28
_ARRAY, _MMAPABLE, _SCHED_CLS = 2, 1 << 10, 3
_TCX_INGRESS, _TCX_EGRESS = 46, 47
_TCX_NEXT = -1  # on to the next program, the link's qdiscs: the packet's way is unchanged
_VALUE = 32  # in bytes, in packets, out bytes, out packets (u64 each)


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, dst | src << 4, off, imm)


def _program(map_fd: int, offset: int) -> bytes:
    """r2 = skb->len; r1 = &value[offset]; value[offset] += r2; value[offset + 8] += 1."""
    return b"".join(
        (
            _insn(0x61, 2, 1),  # r2 = *(u32 *)(r1 + 0): __sk_buff.len
            _insn(0x18, 1, 2, 0, map_fd),  # r1 = the map's value (BPF_PSEUDO_MAP_VALUE) ...
            _insn(0, imm=offset),  # ... + offset
            _insn(0xDB, 1, 2, 0, 0),  # lock *(u64 *)(r1 + 0) += r2
            _insn(0xB7, 2, 0, 0, 1),  # r2 = 1
            _insn(0xDB, 1, 2, 8, 0),  # lock *(u64 *)(r1 + 8) += r2
            _insn(0xB7, 0, 0, 0, _TCX_NEXT),  # r0 = TCX_NEXT
            _insn(0x95),  # exit
        )
    )


class LinkCounters:
    """Bytes and packets through one device, counted by eBPF into memory this process maps."""

    def __init__(self, fds: list[int], view: mmap.mmap) -> None:
        self._fds, self._view = fds, view

    @classmethod
    def attach(cls, device: str) -> LinkCounters | None:
        """Count ``device``'s packets from now on; None where the system does not allow it."""
        if _SYS_BPF is None:
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        fds: list[int] = []

        def bpf(cmd: int, attr: bytes) -> int:
            buf = ctypes.create_string_buffer(attr, 144)
            fd = libc.syscall(_SYS_BPF, cmd, buf, 144)
            if fd < 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
            fds.append(fd)
            return int(fd)

        try:
            ifindex = socket.if_nametoindex(device)
            map_fd = bpf(_MAP_CREATE, struct.pack("5I", _ARRAY, 4, _VALUE, 1, _MMAPABLE))
            view = mmap.mmap(map_fd, mmap.PAGESIZE)
            license_ = ctypes.create_string_buffer(b"GPL")
            for offset, hook in ((0, _TCX_INGRESS), (16, _TCX_EGRESS)):
                code = ctypes.create_string_buffer(_program(map_fd, offset))
                insns = (len(code.raw) - 1) // 8  # (the buffer's own NUL)
                attr = struct.pack(
                    "IIQQIIQII16s", _SCHED_CLS, insns, ctypes.addressof(code),
                    ctypes.addressof(license_), 0, 0, 0, 0, 0, b"nimbus_count",
                )  # fmt: skip
                prog = bpf(_PROG_LOAD, attr)
                bpf(_LINK_CREATE, struct.pack("4I", prog, ifindex, hook, 0))
        except (OSError, ValueError):
            for fd in fds:
                os.close(fd)
            return None
        return cls(fds, view)

    def read(self) -> bytes:
        """The counts now (32 bytes, four native u64: in bytes, in packets, out bytes, out packets)."""
        return self._view[:_VALUE]

    def close(self) -> None:
        self._view.close()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
