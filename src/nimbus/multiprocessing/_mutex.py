"""Locks in this host's shared memory: ``Lock``, and the lock of Values and Arrays kept there.

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

``Lock()`` of such a program is a :class:`HostLock`: a process-shared POSIX
semaphore (as the stdlib's ``Lock``, so any thread or process may release it)
and the holder's (pid, thread id) in one word next to it, so an uncontended
acquire + release is two C calls and two stores, about a microsecond::

    block: [ sem_t | guard (robust mutex) | owner: pid << 32 | tid | moved ]

- **Owner death.** A blocked ``acquire`` wakes every 0.1 s (Ctrl-C); every
  ``_REAP_STEP`` it looks at the owner word, and if that process is gone (even
  SIGKILLed, or exited holding it) takes the lock over, under the guard, so
  that exactly one waiter does. A holder killed between its ``sem_trywait``
  and the write of the owner word (a few instructions) leaves a lock that no
  one reaps, as the stdlib's Lock always does.
- **Release by another process** (allowed for a Lock) and a second release
  (``ValueError``) take the guard; the holder's own release does not.
- **Moving to the store.** A process of the program that runs on another host
  cannot map the block, so before the lock is pickled for one (the program
  runs on a remote endpoint) it moves to the state store (:meth:`HostLock.to_store`):
  the mover takes the semaphore for good (waiting for the holder, unless that
  is the mover's own thread, which then holds the store's lock instead), the
  store's lock is created free (or held by that thread) and ``moved`` is set.
  From then on every acquire fails on the semaphore and, seeing ``moved``, goes
  to the store; so a holder is never counted twice, on either side.
"""

from __future__ import annotations

import _multiprocessing  # type: ignore[import-not-found]
import ctypes
import errno
import functools
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nimbus._lazy import lazy
from nimbus.multiprocessing import _heap
from nimbus.multiprocessing.synchronize import Lock, _Acquirable, _NotOwnedError
from nimbus.statestore import Keys, Program, current
from nimbus.statestore import link as _link

if TYPE_CHECKING:
    import psutil
else:  # imported when a lock's holder must be looked for (it may have died)
    psutil = lazy("psutil", globals())

__all__ = ["HostLock", "HostRLock", "available"]

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
    return ctypes.CDLL(None, use_errno=True)


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
            for name in (
                "pthread_mutexattr_setrobust",
                "pthread_mutex_consistent",
                "sem_init",
                "sem_timedwait",
                "sem_getvalue",
            )
        ) and hasattr(_multiprocessing, "SemLock")
    except (OSError, AttributeError):
        return False


def _init_mutex(mutex: Any, kind: int) -> None:
    """Initialise a process-shared robust mutex of ``kind`` (0: normal, 1: recursive)."""
    libc = _libc()
    attr = ctypes.create_string_buffer(64)  # pthread_mutexattr_t is 4 to 8 bytes
    libc.pthread_mutexattr_init(attr)
    try:
        libc.pthread_mutexattr_setpshared(attr, _PROCESS_SHARED)
        libc.pthread_mutexattr_setrobust(attr, _ROBUST)
        libc.pthread_mutexattr_settype(attr, kind)
        rc = libc.pthread_mutex_init(mutex, attr)
    finally:
        libc.pthread_mutexattr_destroy(attr)
    if rc:
        raise OSError(rc, f"pthread_mutex_init: {os.strerror(rc)}")


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
        _init_mutex(lock._mutex, _RECURSIVE)
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


# ---------------------------------------------------------------- HostLock

_SEM = 0  # offset of the sem_t (32 bytes on Linux)
_GUARD = 64  # of the guard mutex
_OWNER = 16  # index (of 8-byte words) of the owner word: pid << 32 | thread (0: not known)
_MOVED = 17  # of the moved flag: 1 once the lock lives in the store
_LOCK_SIZE = 144
_LOW = (1 << 32) - 1
_MOVED_OWNER = (1 << 64) - 1  # the owner word of a moved lock: no process's
_REAP_STEP = 0.5  # seconds a waiter blocks between looks at the owner
_SEMAPHORE = 1  # _multiprocessing.SemLock's kind for a (bounded) semaphore
_pid = os.getpid()
_me = _pid << 32


def _forked() -> None:
    global _pid, _me
    _pid = os.getpid()
    _me = _pid << 32


os.register_at_fork(after_in_child=_forked)
_ident = threading.get_ident  # no system call, unlike get_native_id


def _owner_word() -> int:
    """This thread of this process, as the owner word holds it."""
    return _me | (_ident() >> 4 & _LOW)  # thread structures are 16-byte aligned at least


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # another user's, or not readable: not ours to take over


class HostLock(Lock):
    """A ``Lock`` in this host's shared memory (see the module doc); any process may release it.

    Made by ``Lock()`` in a program whose Values and Arrays are in shared
    memory; pickles as its block, program and name in the store. Its
    semaphore is driven by the stdlib's own C ``SemLock``, attached to the
    block (not a named semaphore: nothing to unlink).
    """

    _block: _heap.Block
    _base: Any
    _guard: Any
    _sem: Any
    _semlock: Any
    _try: Callable[..., bool]
    _post: Callable[[], None]
    _words: memoryview

    def __init__(self, *, ctx: object = None, program: Program | None = None) -> None:
        pass  # set up by new() or by unpickling (Lock.__new__ hands out a new one)

    @classmethod
    def new(cls, program: Program) -> HostLock:
        """A new unlocked lock in ``program``'s shared memory directory."""
        assert program.shared is not None
        block = _heap.Block.new(program.shared, _LOCK_SIZE)
        base = ctypes.c_char.from_buffer(block.map)
        if _libc().sem_init(ctypes.byref(base, _SEM), 1, 1):
            raise OSError(ctypes.get_errno(), "sem_init failed")
        _init_mutex(ctypes.byref(base, _GUARD), 0)
        del base
        return cls._attach(block, program, None)

    @classmethod
    def _attach(cls, block: _heap.Block, program: Program, name: str | None) -> HostLock:
        lock = object.__new__(cls)
        lock._setup(program, name if name is not None else lock._new_name())
        lock._block = block
        lock._base = base = ctypes.c_char.from_buffer(block.map)
        lock._guard = ctypes.byref(base, _GUARD)
        lock._sem = ctypes.byref(base, _SEM)
        lock._semlock = _multiprocessing.SemLock._rebuild(
            ctypes.addressof(base) + _SEM, _SEMAPHORE, 1, None
        )
        lock._try = lock._semlock.acquire
        lock._post = lock._semlock.release
        lock._words = memoryview(block.map).cast("Q")
        return lock

    @staticmethod
    def _new_name() -> str:
        return Keys.new_name()

    def __reduce__(self) -> Any:
        program = current()
        if program is not None and program.remote:  # pickled for a process elsewhere,
            self.to_store()  # which cannot map the block
        if self._words[_MOVED]:
            return (_stored, (self._program, self._name))
        return (HostLock._attach, (self._block, self._program, self._name))

    # ------------------------------------------------------------ the fast path

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        if self._try(False):
            self._words[_OWNER] = _me | (_ident() >> 4 & _LOW)
            return True
        if self._words[_MOVED]:
            return self._store().acquire(block, timeout)
        if not block:
            return False
        return self._block_until(timeout)

    def release(self) -> None:
        words = self._words
        if words[_OWNER] >> 32 == _pid:  # held by this process: the common case
            words[_OWNER] = 0
            self._post()
            return
        self._release_other()

    # ------------------------------------------------------------ the slow paths

    def _block_until(self, timeout: float | None) -> bool:
        """Block until the semaphore is ours, or the lock moved (then: the store's)."""
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        got = self._take(deadline)
        if got is None:  # moved while we waited
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            return self._store().acquire(True, remaining)
        return got

    def _take(self, deadline: float | None) -> bool | None:
        """Take the semaphore by ``deadline``; None: the lock moved to the store.

        The wait itself is the C ``SemLock``'s (Ctrl-C interrupts it); between
        waits of ``_REAP_STEP``, a dead holder's lock is taken over.
        """
        while True:
            if self._words[_MOVED]:
                return None
            step = _REAP_STEP
            if deadline is not None:
                step = min(step, deadline - time.monotonic())
                if step <= 0:
                    return False
            if self._try(True, step):
                self._words[_OWNER] = _owner_word()
                return True
            if self._take_over():
                return True

    def _lock_guard(self) -> None:
        rc = _libc().pthread_mutex_lock(self._guard)
        if rc == errno.EOWNERDEAD:  # died inside the guard: the words are whole anyway
            _quick().pthread_mutex_consistent(self._guard)
        elif rc:
            raise OSError(rc, f"cannot guard {self!r}: {os.strerror(rc)}")

    def _unlock_guard(self) -> None:
        _quick().pthread_mutex_unlock(self._guard)

    def _value(self) -> int:
        return max(int(self._semlock._get_value()), 0)

    def _take_over(self) -> bool:
        """Take the lock if its holder's process is gone (one waiter does, under the guard)."""
        owner = self._words[_OWNER]
        if not owner or owner == _MOVED_OWNER or _alive(owner >> 32):
            return False
        self._lock_guard()
        try:
            if self._words[_OWNER] != owner or self._value() or self._words[_MOVED]:
                return False  # released, moved or taken over meanwhile
            self._words[_OWNER] = _owner_word()
            return True
        finally:
            self._unlock_guard()

    def _release_other(self) -> None:
        """A release by a process that does not hold the lock, or a second one."""
        words = self._words
        if not words[_MOVED]:
            self._lock_guard()
            try:
                if not words[_MOVED]:
                    if self._value():
                        raise ValueError("semaphore or lock released too many times")
                    words[_OWNER] = 0
                    self._post()
                    return
            finally:
                self._unlock_guard()
        self._store().release()

    def _mine(self) -> bool:
        return bool(self._words[_OWNER] == _owner_word())

    # ------------------------------------------------------------ the store

    def _store(self) -> Lock:
        """The lock's store side (it has moved there)."""
        return _stored(self._program, self._name)

    def to_store(self) -> None:
        """Move the lock to the state store (before a process on another host gets it).

        Waits for a holder in another thread or process; if this thread holds
        it, it holds the store's lock instead.
        """
        if self._words[_MOVED]:
            return
        mine = self._mine()
        if not mine and not self._take(None):
            return  # another thread moved it meanwhile
        link = _link(self._program)
        self._lock_guard()
        try:
            if self._words[_MOVED]:  # moved by another thread while we took it: give it back
                self._post()
                return
            self._store()._create(link, held=mine)
            self._words[_OWNER] = _MOVED_OWNER
            self._words[_MOVED] = 1
        finally:
            self._unlock_guard()

    # ------------------------------------------------------------ as Condition uses a Lock

    def _acquire(self, link: Any, block: bool, timeout: float | None, depth: int) -> bool:
        if self._words[_MOVED]:
            return self._store()._acquire(link, block, timeout, depth)
        return self.acquire(block, timeout)

    def _release_all(self, link: Any) -> int:
        if self._words[_MOVED]:
            return self._store()._release_all(link)
        if not self._mine():
            raise _NotOwnedError("must acquire() condition before using wait()")
        self.release()
        return 1

    def _depth(self, link: Any) -> int:
        if self._words[_MOVED]:
            return self._store()._depth(link)
        return 1 if self._mine() else 0

    def get_value(self) -> int:
        if self._words[_MOVED]:
            return self._store().get_value()
        return self._value()

    def __repr__(self) -> str:
        return f"<nimbus.multiprocessing.Lock in shared memory {self._block.path}>"


def _stored(program: Program, name: str) -> Lock:
    """The store's ``Lock`` named ``name`` of ``program`` (its keys made by ``to_store``)."""
    lock = object.__new__(Lock)
    lock._setup(program, name)
    return lock
