"""A re-entrant lock in this host's shared memory: the lock of Values and Arrays kept there.

``Value`` and ``Array`` of a program on the local runtime live in shared
memory (``_heap``); their default lock does too, so an access costs a function
call rather than a round trip to the store. It is a POSIX mutex in a block of
its own, initialised *process-shared*, *recursive* and *robust*:

- only the thread that holds it releases it, as the stdlib's ``RLock``;
- if its holder dies (a child killed inside ``with value.get_lock():``), the
  next ``acquire`` gets it (``EOWNERDEAD``, made consistent): no one waits for
  a dead process, and no expiry is needed;
- a blocked ``acquire`` wakes every 0.1 s, so Ctrl-C interrupts it.

Where the C library has no robust mutexes, ``available()`` is False and the
objects use the store's ``RLock``.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import time
from typing import Any

from nimbus.multiprocessing import _heap
from nimbus.multiprocessing.synchronize import _Acquirable, _NotOwnedError

__all__ = ["HostRLock", "available"]

_SIZE = 64  # bytes for one pthread_mutex_t (40 on x86-64, 48 on arm64)
_STEP = 0.1  # seconds a blocked acquire waits between checks for signals
_PROCESS_SHARED = 1  # PTHREAD_PROCESS_SHARED
_ROBUST = 1  # PTHREAD_MUTEX_ROBUST
_RECURSIVE = 1  # PTHREAD_MUTEX_RECURSIVE (Linux)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@functools.cache
def _libc() -> Any:
    """The C library; its calls release the GIL (for the ones that may block)."""
    return ctypes.CDLL(None)


@functools.cache
def _quick() -> Any:
    """The C library, called holding the GIL: cheaper, for the calls that never block."""
    return ctypes.PyDLL(None)


@functools.cache
def available() -> bool:
    """Whether this host's C library has process-shared robust mutexes."""
    if os.uname().sysname != "Linux":
        return False
    try:
        libc = _libc()
        return all(
            hasattr(libc, name)
            for name in ("pthread_mutexattr_setrobust", "pthread_mutex_consistent")
        )
    except (OSError, AttributeError):
        return False


class HostRLock(_Acquirable):
    """A robust, process-shared re-entrant lock in a block of shared memory."""

    def __init__(self, block: _heap.Block) -> None:
        self._block = block
        self._mutex = ctypes.byref(ctypes.c_char.from_buffer(block.map))
        quick = _quick()
        self._trylock = quick.pthread_mutex_trylock
        self._unlock = quick.pthread_mutex_unlock

    @classmethod
    def new(cls, directory: str) -> HostRLock:
        """A new unlocked lock in the program's shared memory ``directory``."""
        lock = cls(_heap.Block.new(directory, bytes(_SIZE)))
        libc = _libc()
        attr = ctypes.create_string_buffer(64)  # pthread_mutexattr_t is 4 to 8 bytes
        libc.pthread_mutexattr_init(attr)
        try:
            libc.pthread_mutexattr_setpshared(attr, _PROCESS_SHARED)
            libc.pthread_mutexattr_setrobust(attr, _ROBUST)
            libc.pthread_mutexattr_settype(attr, _RECURSIVE)
            rc = libc.pthread_mutex_init(lock._mutex, attr)
        finally:
            libc.pthread_mutexattr_destroy(attr)
        if rc:
            raise OSError(rc, f"pthread_mutex_init: {os.strerror(rc)}")
        return lock

    def __reduce__(self) -> tuple[type[HostRLock], tuple[_heap.Block]]:
        return (HostRLock, (self._block,))

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        rc = self._trylock(self._mutex)
        if rc == 0:
            return True
        if rc == errno.EBUSY and block:
            libc = _libc()
            deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
            while rc in (errno.EBUSY, errno.ETIMEDOUT):
                step = _STEP
                if deadline is not None:
                    step = min(step, deadline - time.monotonic())
                    if step <= 0:
                        return False
                until = time.time() + step
                spec = _Timespec(int(until), int(until % 1 * 1e9))
                rc = libc.pthread_mutex_timedlock(self._mutex, ctypes.byref(spec))
        if rc == 0:
            return True
        if rc == errno.EOWNERDEAD:  # its holder died: the lock is ours, its state fine
            _quick().pthread_mutex_consistent(self._mutex)
            return True
        if rc in (errno.EBUSY, errno.ETIMEDOUT):
            return False
        raise OSError(rc, f"cannot take {self!r}: {os.strerror(rc)}")

    def release(self) -> None:
        rc = self._unlock(self._mutex)
        if rc == errno.EPERM:
            raise _NotOwnedError("attempt to release recursive lock not owned by thread")
        if rc:
            raise OSError(rc, f"cannot release {self!r}: {os.strerror(rc)}")

    def __repr__(self) -> str:
        return f"<nimbus.multiprocessing.RLock in shared memory {self._block.path}>"
