"""The host NIC's traffic, sampled for every worker on the host (``record.colocated``).

::

    manager (root namespace)  --every 0.1 s-->  /dev/shm/nimbus-tasks (seqlock)  <--  workers
      rx/tx_bytes of the NIC of the default route (sysfs), its rate, its speed

One sampler a host: a manager's :class:`NicSampler` holds an exclusive
``flock`` on ``/dev/shm/nimbus-tasks.nic`` while it samples; the others retry
every second and take over when it goes. A worker reads the sample at its
task's start and end (memory reads, no system call): the average of the
samples in between, or the last rate for a task shorter than a sample.
Sampling costs two ``pread`` of sysfs ten times a second.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
import time
from pathlib import Path

from nimbus.network._colocation import NIC, SEQ, open_map

__all__ = ["NicSampler", "host_nic"]

PERIOD = 0.1
LOCK = "/dev/shm/nimbus-tasks.nic"


def host_nic() -> str | None:
    """The interface of this namespace's default route, else the busiest one that is up
    (not the loopback, not a worker link); None if there is none."""
    try:
        for line in Path("/proc/net/route").read_text().splitlines()[1:]:
            f = line.split()
            if len(f) > 2 and f[1] == "00000000" and f[0] != "lo":
                return f[0]
    except OSError:
        pass
    best, most = None, -1
    for dev in Path("/sys/class/net").iterdir():
        if dev.name == "lo" or dev.name.startswith("nmb"):
            continue
        try:
            if (dev / "operstate").read_text().strip() != "up":
                continue
            moved = int((dev / "statistics/rx_bytes").read_text())
        except (OSError, ValueError):
            continue
        if moved > most:
            best, most = dev.name, moved
    return best


def _speed(nic: str) -> float:
    """The NIC's speed in bytes/s, 0 if it does not say (virtual devices)."""
    try:
        mbit = int(Path(f"/sys/class/net/{nic}/speed").read_text())
    except (OSError, ValueError):
        return 0.0
    return mbit * 1e6 / 8 if mbit > 0 else 0.0


class NicSampler:
    """Samples the host NIC into the shared map while this host has no other sampler."""

    def __init__(self, nic: str | None = None, period: float = PERIOD) -> None:
        self.nic = nic or host_nic()
        self.period = period
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.nic is not None:
            self._thread = threading.Thread(target=self._run, name="nimbus-nic", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        assert self.nic is not None
        stats = f"/sys/class/net/{self.nic}/statistics/"
        try:
            lock = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o666)
            rx, tx = (
                os.open(stats + "rx_bytes", os.O_RDONLY),
                os.open(stats + "tx_bytes", os.O_RDONLY),
            )
            board = open_map()
        except OSError:
            return
        try:
            while not self._stop.is_set():
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # another manager samples
                    self._stop.wait(1.0)
                    continue
                self._sample(board, rx, tx)
        finally:
            for fd in (lock, rx, tx):
                os.close(fd)  # the lock goes with its descriptor
            board.close()

    def _sample(self, board: mmap.mmap, rx_fd: int, tx_fd: int) -> None:
        speed = _speed(self.nic or "")
        last: tuple[float, int, int] | None = None
        while not self._stop.wait(0 if last is None else self.period):
            try:
                now, rx, tx = (
                    time.monotonic(),
                    int(os.pread(rx_fd, 32, 0)),
                    int(os.pread(tx_fd, 32, 0)),
                )
            except (OSError, ValueError):
                return
            rrate = trate = 0.0
            if last is not None and now > last[0]:
                rrate, trate = (rx - last[1]) / (now - last[0]), (tx - last[2]) / (now - last[0])
            last = (now, rx, tx)
            seq = struct.unpack_from("=Q", board, SEQ)[0]
            seq += 1 if not seq & 1 else 2  # odd: being written
            struct.pack_into("=Q", board, SEQ, seq)
            NIC.pack_into(board, SEQ + 8, now, rx, tx, rrate, trate, speed)
            struct.pack_into("=Q", board, SEQ, seq + 1)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
