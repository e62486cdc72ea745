"""What a task used: CPU seconds, peak memory, network bytes.

A :class:`TaskMeter` lives in a worker and measures one task at a time
(``begin()`` then ``end()``). How each figure is taken, and its limits, is
written in ``nimbus.records``.

Network bytes are counted by wrapping the data methods of ``socket.socket``
(and of ``ssl.SSLSocket`` once ``ssl`` is imported, counting plaintext) in the
worker process. The runtime's own channel uses a bare ``_socket.socket`` and
is not counted.
"""

from __future__ import annotations

import functools
import os
import resource
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["COUNTS", "TaskMeter", "install_socket_counters", "socket_bytes"]

_counts = [0, 0]  # bytes in, bytes out through wrapped sockets of this process
COUNTS = _counts  # for code that calls the unwrapped methods and counts itself
_patched: set[type] = set()

_RECV_SIZE: dict[str, Callable[[Any], int]] = {
    "recv": len,
    "recvfrom": lambda r: len(r[0]),
    "recvmsg": lambda r: len(r[0]),
    "recv_into": int,
    "recvfrom_into": lambda r: int(r[0]),
    "recvmsg_into": lambda r: int(r[0]),
    "read": lambda r: r if isinstance(r, int) else len(r),
}
_SEND_SIZE: dict[str, Callable[[Any, tuple[Any, ...]], int]] = {
    "send": lambda r, a: int(r),
    "sendto": lambda r, a: int(r),
    "sendmsg": lambda r, a: int(r),
    "write": lambda r, a: int(r),
    "sendall": lambda r, a: memoryview(a[0]).nbytes,
}


_guard = threading.local()


def _wrap(method: Callable[..., Any], count: Callable[[Any, tuple[Any, ...]], None]) -> Any:
    """Count once per outermost call (SSL methods call each other)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_guard, "depth", 0)
        _guard.depth = depth + 1
        try:
            result = method(self, *args, **kwargs)
        finally:
            _guard.depth = depth
        if depth == 0:
            count(result, args)
        return result

    return wrapper


def _count_in(size: Callable[[Any], int]) -> Callable[[Any, tuple[Any, ...]], None]:
    def count(result: Any, args: tuple[Any, ...]) -> None:
        _counts[0] += size(result)

    return count


def _count_out(
    size: Callable[[Any, tuple[Any, ...]], int],
) -> Callable[[Any, tuple[Any, ...]], None]:
    def count(result: Any, args: tuple[Any, ...]) -> None:
        _counts[1] += size(result, args)

    return count


def _patch(cls: type) -> None:
    if cls in _patched:
        return
    _patched.add(cls)
    for name, recv_size in _RECV_SIZE.items():
        if name in cls.__dict__ or (cls is socket.socket and hasattr(cls, name)):
            setattr(cls, name, _wrap(getattr(cls, name), _count_in(recv_size)))
    for name, send_size in _SEND_SIZE.items():
        if name in cls.__dict__ or (cls is socket.socket and hasattr(cls, name)):
            setattr(cls, name, _wrap(getattr(cls, name), _count_out(send_size)))
    if "sendfile" in cls.__dict__:
        sendfile_size = _SEND_SIZE["send"]
        cls.sendfile = _wrap(cls.sendfile, _count_out(sendfile_size))  # type: ignore[attr-defined]


def install_socket_counters() -> None:
    """Count bytes through Python sockets of this process (idempotent)."""
    _patch(socket.socket)
    ssl = sys.modules.get("ssl")
    if ssl is not None:
        _patch(ssl.SSLSocket)


def socket_bytes() -> tuple[int, int]:
    """Bytes received and sent through counted sockets so far."""
    return _counts[0], _counts[1]


def _vm_hwm_kb(fd: int) -> int:
    """The peak resident set size (VmHWM) in /proc/self/status, in kB."""
    data = os.pread(fd, 8192, 0)
    start = data.index(b"VmHWM:") + 6
    return int(data[start : data.index(b"kB", start)])


class TaskMeter:
    """Measures the task running in this process, one at a time."""

    def __init__(self) -> None:
        install_socket_counters()
        self._clear_refs: int | None = None
        self._status: int | None = None  # /proc/self/status, when ru_maxrss cannot be reset
        try:
            self._clear_refs = os.open("/proc/self/clear_refs", os.O_WRONLY)
            os.write(self._clear_refs, b"5")
            status = os.open("/proc/self/status", os.O_RDONLY)
            # A process exec'd from a large parent keeps that parent's peak in ru_maxrss
            # (Linux folds the old address space's high-water mark into it), and no reset
            # clears it; VmHWM is this process's own, and clear_refs resets it.
            if resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 2 * _vm_hwm_kb(status):
                self._status = status
            else:
                os.close(status)
        except (OSError, ValueError):
            pass
        self._start: tuple[float, float, float, int, int] = (0.0, 0.0, 0.0, 0, 0)
        self._ssl_seen = False

    def begin(self) -> float:
        """Start measuring; returns the wall-clock start time."""
        if not self._ssl_seen and "ssl" in sys.modules:
            self._ssl_seen = True
            install_socket_counters()
        if self._clear_refs is not None:
            try:
                os.write(self._clear_refs, b"5")  # reset the peak RSS (VmHWM)
            except OSError:
                self._clear_refs = None
        usage = resource.getrusage(resource.RUSAGE_SELF)
        now = time.time()
        self._start = (now, usage.ru_utime, usage.ru_stime, _counts[0], _counts[1])
        return now

    def end(self) -> tuple[float, float, float, int, int, int]:
        """(ended, cpu_user, cpu_system, peak_memory, net_in, net_out) of the task."""
        usage = resource.getrusage(resource.RUSAGE_SELF)
        now = time.time()
        _, utime, stime, nin, nout = self._start
        return (
            now,
            usage.ru_utime - utime,
            usage.ru_stime - stime,
            (usage.ru_maxrss if self._status is None else _vm_hwm_kb(self._status)) * 1024,
            _counts[0] - nin,
            _counts[1] - nout,
        )
