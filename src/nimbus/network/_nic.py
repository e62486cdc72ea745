"""The host NIC's traffic, sampled for every worker on the host (``record.colocated``).

::

    manager (root namespace)  --every 0.1 s-->  /run/nimbus-net/.tasks (seqlock)  <--  workers
      rx/tx_bytes of the NIC of the default route (sysfs), its rate, its speed

One sampler a host: a manager's :class:`NicSampler` holds an exclusive
``flock`` on ``/run/nimbus-net/.tasks.nic`` while it samples; the others retry
every second and take over when it goes. A NIC that goes away (its counters
cannot be read) is let go of: the lock released, and a second later the NIC
of the default route looked up again (unless one was named). A worker reads the sample at its
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

from nimbus.network._colocation import NIC, SEQ, open_map, open_shared
from nimbus.network._slots import DIR

__all__ = ["NicSampler", "host_nic"]

PERIOD = 0.1
LOCK = str(DIR / ".tasks.nic")


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
        self.named = nic is not None  # else the default route's, looked up again if it goes
        self.nic = nic or host_nic()
        self.period = period
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.nic is not None:
            self._thread = threading.Thread(target=self._run, name="nimbus-nic", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            lock = open_shared(LOCK)
        except OSError:
            return
        try:
            board = open_map()
        except OSError:
            os.close(lock)
            return
        try:
            while not self._stop.is_set():
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # another manager samples
                    self._stop.wait(1.0)
                    continue
                try:
                    self._sample(board)  # until stopped, or the NIC cannot be read
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)  # another manager's NIC may be there
                if self._stop.wait(1.0):
                    break
                if not self.named:
                    self.nic = host_nic()
        finally:
            os.close(lock)  # the lock goes with its descriptor
            board.close()

    def _sample(self, board: mmap.mmap) -> None:
        """Sample the NIC into ``board`` until stopped; returns if it cannot be read."""
        if self.nic is None:
            return
        stats = f"/sys/class/net/{self.nic}/statistics/"
        try:
            rx_fd = os.open(stats + "rx_bytes", os.O_RDONLY)
        except OSError:
            return
        try:
            tx_fd = os.open(stats + "tx_bytes", os.O_RDONLY)
        except OSError:
            os.close(rx_fd)
            return
        try:
            self._samples(board, rx_fd, tx_fd)
        finally:
            os.close(rx_fd)
            os.close(tx_fd)

    def _samples(self, board: mmap.mmap, rx_fd: int, tx_fd: int) -> None:
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
