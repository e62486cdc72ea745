"""Which tasks run on this host now: one byte per worker in a shared memory map.

::

    /dev/shm/nimbus-tasks:  [cell 0 .. cell 16383][u64 tasks started, ever]
    the worker of slot S:   cell S = 1 while its task runs, else 0

A worker's cell is its link's slot (``_slots``: unique on the host), found
from its address on ``nimbus0``. Marking, unmarking and counting are memory
operations (no system call per task: files made and listed cost some 0.2 ms
a task under load; counting is ``find`` over the map, one call per running
task). A worker that dies mid-task leaves its cell set; its manager clears it
(:func:`clear`). The started count is incremented without a lock: two starts
at the same instant may count once.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import struct

from nimbus.network._slots import SLOTS

__all__ = ["PATH", "Board", "clear", "slot_of"]

PATH = "/dev/shm/nimbus-tasks"
CELLS = SLOTS
SIZE = CELLS + 8
SIOCGIFADDR = 0x8915


def _open() -> mmap.mmap:
    fd = os.open(PATH, os.O_RDWR | os.O_CREAT, 0o666)
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


class Board:
    """The host's running tasks, as the worker of slot ``cell`` sees them."""

    def __init__(self, cell: int) -> None:
        self._map = _open()
        self._cell = cell
        self._started = 0

    def running(self) -> int:
        """Tasks running on this host now, this worker's not counted."""
        count, at, find = 0, -1, self._map.find
        while (at := find(b"\x01", at + 1, CELLS)) >= 0:
            count += at != self._cell
        return count

    def started(self) -> int:
        return int(struct.unpack_from("=Q", self._map, CELLS)[0])

    def begin(self) -> int:
        """Mark this worker's task running; the others running now."""
        self._map[self._cell] = 1
        self._started = self.started() + 1
        struct.pack_into("=Q", self._map, CELLS, self._started)
        return self.running()

    def end(self) -> tuple[int, int]:
        """Unmark; (the others running now, how many tasks started since :meth:`begin`)."""
        others, since = self.running(), self.started() - self._started
        self._map[self._cell] = 0
        return others, since

    def close(self) -> None:
        self._map[self._cell] = 0
        self._map.close()


def clear(cell: int) -> None:
    """The worker of slot ``cell`` is gone: it runs no task."""
    try:
        board = _open()
    except OSError:
        return
    board[cell] = 0
    board.close()
