"""A Pool's job and result queues when every process of the program is on this host.

::

    parent (the Pool's threads)                     pool processes (forked by warm workers)
    task handler  put --(wlock)--> OS pipe --(rlock)--> get   worker()
    result handler get <--(rlock)-- OS pipe <--(wlock)-- put   worker()

The stdlib's ``SimpleQueue`` on the same pieces: an OS pipe, a lock for its
readers and one for its writers (``_mutex.HostLock``, a semaphore in the
program's shared memory, so a holder that dies is taken over) and nimbus's
pickling (``_payload``: ``__main__`` by value where the stdlib's would not
import it). No state store, so no redis-py: a Pool of a local program costs
what the stdlib's does, a pipe write and a read per message.

A pool process is not forked by the process that made the queue, so it does
not inherit the pipe: it opens the same pipe through
``/proc/<maker>/fd/<n>`` (the pipe's inode is checked, so a descriptor
number reused meanwhile is refused). The maker keeps both ends open while the
queue lives. A process of the program on another host could not, so a
program that runs elsewhere (``NIMBUS_ENDPOINT``, a provider's nodes) keeps
the store's queues (:func:`usable` says which).
"""

from __future__ import annotations

import os
import stat
import sys
import types
import weakref
from typing import Any

from nimbus._install import real
from nimbus.errors import DeserializationError, SerializationError
from nimbus.multiprocessing import _mutex
from nimbus.multiprocessing._payload import pack, unpack
from nimbus.statestore import Program, current

__all__ = ["HostSimpleQueue", "usable"]


def usable(program: Program) -> bool:
    """Whether ``program``'s processes can share OS pipes and host locks (all local)."""
    return (
        sys.platform == "linux"
        and not program.remote
        and program.shared is not None
        and _mutex.available()
    )


def _end(fd: int, **kwargs: bool) -> Any:
    """An end of the pipe: the stdlib's pipe connection, pickling as nimbus does
    (``send``/``recv`` of objects are used by the stdlib Pool's clean-up, which drains
    the job queue). Its class is made on first use, from the stdlib's module whatever
    ``sys.modules`` then says (a child may first import this module while unpickling a
    queue, with ``multiprocessing`` standing for nimbus's)."""
    global _End
    if _End is None:
        with real():
            from multiprocessing.connection import Connection

        class End(Connection):
            def send(self, obj: Any) -> None:
                self.send_bytes(pack(obj))

            def recv(self) -> Any:
                return unpack(self.recv_bytes())

        _End = End
    return _End(fd, **kwargs)


_End: Any = None


class HostSimpleQueue:
    """``multiprocessing.SimpleQueue`` of this host's processes: a pipe and two locks."""

    def __init__(self, program: Program) -> None:
        read, write = os.pipe()
        rlock, wlock = _mutex.HostLock.new(program), _mutex.HostLock.new(program)
        self._setup(_end(read, writable=False), _end(write, readable=False), rlock, wlock)
        # the locks' files go with the queue (a program may make many Pools); mapped
        # copies stay valid, and no process attaches to a queue that is gone
        weakref.finalize(self, _remove, [rlock._block.path, wlock._block.path])

    def _setup(self, reader: Any, writer: Any, rlock: Any, wlock: Any) -> None:
        self._reader = reader
        self._writer = writer
        self._rlock = rlock
        self._wlock = wlock
        self._poll = reader.poll

    def __reduce__(self) -> tuple[Any, ...]:
        program = current()
        if program is not None and program.remote:
            raise SerializationError(
                "a Pool's job or result queue cannot go to a process on another host: it is "
                "an OS pipe of this one (a Pool made in a program that runs on an endpoint "
                "has queues in the state store: make the Pool there)"
            )
        ends = (self._reader.fileno(), self._writer.fileno())
        inode = os.fstat(ends[0]).st_ino
        return (_attach, (os.getpid(), ends, inode, self._rlock, self._wlock))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} pipe {self._reader.fileno()}>"

    def close(self) -> None:
        """Close this process's ends of the pipe."""
        self._reader.close()
        self._writer.close()

    def empty(self) -> bool:
        """True if there is nothing to get (looks, takes nothing)."""
        return not self._poll()

    def get(self) -> Any:
        """Remove and return an item, waiting for one."""
        with self._rlock:
            res = self._reader.recv_bytes()
        return unpack(res)  # after the lock: another reader goes on meanwhile

    def put(self, obj: object) -> None:
        """Put an item; an object that cannot be pickled raises here (before the lock)."""
        data = pack(obj)
        with self._wlock:
            self._writer.send_bytes(data)

    __class_getitem__: Any = classmethod(types.GenericAlias)


def _attach(
    maker: int, ends: tuple[int, int], inode: int, rlock: Any, wlock: Any
) -> HostSimpleQueue:
    """The queue in a process that did not make it: its pipe opened through ``/proc``."""
    if maker == os.getpid():
        read, write = os.dup(ends[0]), os.dup(ends[1])
    else:
        read = _open(maker, ends[0], inode, os.O_RDONLY)
        try:
            write = _open(maker, ends[1], inode, os.O_WRONLY)
        except BaseException:
            os.close(read)
            raise
    queue = HostSimpleQueue.__new__(HostSimpleQueue)
    queue._setup(_end(read, writable=False), _end(write, readable=False), rlock, wlock)
    return queue


def _remove(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass  # the program's directory went first, at exit


def _open(maker: int, fd: int, inode: int, flags: int) -> int:
    path = f"/proc/{maker}/fd/{fd}"
    try:
        opened = os.open(path, flags | os.O_CLOEXEC)
    except OSError as exc:
        raise DeserializationError(
            f"cannot open the Pool's queue {path} ({exc.strerror}): the process that made "
            f"the Pool (pid {maker}) is gone, or /proc does not show it to this one"
        ) from exc
    st = os.fstat(opened)
    if not stat.S_ISFIFO(st.st_mode) or st.st_ino != inode:
        os.close(opened)
        raise DeserializationError(
            f"the Pool's queue {path} is no longer its pipe: the Pool (pid {maker}) was "
            f"closed before this process started"
        )
    return opened
