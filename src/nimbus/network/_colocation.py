"""Which tasks run on this host now, and how busy its NIC is: a memory map its workers share.

::

    /run/nimbus-net/.tasks (root's: made with O_NOFOLLOW, 0644, where the slots are):
      [cell 0 .. cell 16383]            the worker of slot S: cell S = 1 while its task runs
      [u64 unused][u32 top: cells at or above it unused]
      [u64 seq][f64 when][u64 rx][u64 tx][f64 rx/s][f64 tx/s][f64 speed B/s]
                                        the host NIC, written by one sampler (``_nic``)

A worker's cell is its link's slot (``_slots``: unique on the host), found
from its address on ``nimbus0``; managers claim the lowest free slots and
write ``top`` (the highest in use + 1) as they claim and free them, so
counting is one ``count`` over a few bytes. Marking, unmarking, counting and
reading the NIC sample are memory operations, no system call; none is on
the latency path of a task shorter than 2 ms (``_meter``: its cell is marked once it
runs longer). A worker that dies mid-task
leaves its cell set; its manager clears it (:func:`clear`). ``top`` is
written without a lock: one lowered by a race between two managers is raised
again by the worker above it at its next sample. The NIC sample is a seqlock
(odd ``seq``: being written).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import struct
import time
from typing import NamedTuple

from nimbus.network._slots import DIR, SLOTS

__all__ = [
    "NIC",
    "PATH",
    "Board",
    "Sample",
    "clear",
    "open_map",
    "open_shared",
    "slot_of",
    "summary",
    "top_of",
]

PATH = str(DIR / ".tasks")  # (a dot: not a slot, as .tcp-table)
CELLS = SLOTS
TOP, SEQ = CELLS + 8, CELLS + 16
NIC = struct.Struct("=dQQddd")  # when (CLOCK_MONOTONIC), rx, tx bytes, rx/s, tx/s, speed B/s
SIZE = CELLS + 128
SIOCGIFADDR = 0x8915
STALE = 2.0  # seconds: a NIC sample older than this is not shown (no sampler runs)


def open_shared(path: str) -> int:
    """``path`` in root's ``/run/nimbus-net`` opened (made) for reading and writing; a
    link planted in its place is refused (O_NOFOLLOW), not followed."""
    DIR.mkdir(mode=0o755, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)


def open_map() -> mmap.mmap:
    fd = open_shared(PATH)
    try:
        if os.fstat(fd).st_size < SIZE:
            os.ftruncate(fd, SIZE)
        return mmap.mmap(fd, SIZE)
    finally:
        os.close(fd)


def slot_of(device: str) -> int:
    """The slot of this namespace's link, from ``device``'s address (10.213.x.y: ``_slots``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        answer = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", device.encode()))
    a, b = answer[22], answer[23]
    return (a * 256 + b) // 4


class Sample(NamedTuple):
    """What a worker saw at one moment: other tasks running, and the host NIC's counters."""

    others: int
    nic: tuple[float, int, int, float, float, float] | None  # NIC, unpacked; None: no sampler


def read_nic(board: mmap.mmap) -> tuple[float, int, int, float, float, float] | None:
    """The last NIC sample (a consistent one), or None if none was written lately."""
    for _ in range(4):
        seq = struct.unpack_from("=Q", board, SEQ)[0]
        sample = NIC.unpack_from(board, SEQ + 8)
        if not seq & 1 and struct.unpack_from("=Q", board, SEQ)[0] == seq:
            return sample if seq and sample[0] + STALE > time.monotonic() else None
    return None


class Board:
    """The host's running tasks, as the worker of slot ``cell`` sees them.

    ``cells[cell] = 1`` and ``= 0``: a task runs past 2 ms, and it ended (one memory
    write each, made by the worker's meter itself); :meth:`sample` is taken off the
    task's latency path where it can be (see ``_meter``).
    """

    def __init__(self, cell: int) -> None:
        self._map = self.cells = open_map()  # cells[cell] = 1 / 0: what mark / unmark do
        self._cell = self.cell = cell
        self.raise_top()

    def raise_top(self) -> None:
        if struct.unpack_from("=I", self._map, TOP)[0] <= self._cell:
            struct.pack_into("=I", self._map, TOP, self._cell + 1)

    def sample(self) -> Sample:
        """Tasks running on this host now, this worker's not counted; the NIC sample."""
        board = self._map
        top = struct.unpack_from("=I", board, TOP)[0]
        if top <= self._cell:  # lowered by a race with another manager: raised again
            self.raise_top()
            top = self._cell + 1
        running = board[:top].count(1) - board[self._cell]
        return Sample(running, read_nic(board))

    def close(self) -> None:
        self._map[self._cell] = 0
        self._map.close()


def summary(samples: list[Sample]) -> dict[str, float]:
    """``record.colocated`` from the samples of one task (the first taken just before it):
    others running (min, mean, max), the host NIC's bytes/s in and out over the samples
    (the last sample's rate if they span none) and its utilisation where its speed is known."""
    counts = [s.others for s in samples]
    out: dict[str, float] = {
        "min": min(counts),
        "mean": round(sum(counts) / len(counts), 3),
        "max": max(counts),
    }
    nics = [s.nic for s in samples if s.nic is not None]
    if nics:
        first, last = nics[0], nics[-1]
        if last[0] > first[0]:
            took = last[0] - first[0]
            rx, tx = (last[1] - first[1]) / took, (last[2] - first[2]) / took
        else:
            rx, tx = last[3], last[4]
        out["nic_in"], out["nic_out"] = round(rx), round(tx)
        if last[5]:
            out["nic_utilisation"] = round(max(rx, tx) / last[5], 4)
    return out


def top_of(numbers: list[int]) -> None:
    """The slots in use are ``numbers`` (a manager claimed or freed one): cells above are unused."""
    try:
        board = open_map()
    except OSError:
        return
    struct.pack_into("=I", board, TOP, max(numbers, default=-1) + 1)
    board.close()


def clear(cell: int) -> None:
    """The worker of slot ``cell`` is gone: it runs no task."""
    try:
        board = open_map()
    except OSError:
        return
    board[cell] = 0
    board.close()
