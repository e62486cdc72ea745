"""``Pool``: the stdlib's pool, its processes on warm workers, its queues pipes or the store.

Pool processes are long-lived nimbus processes (forked by warm workers, so
creating a Pool starts no interpreter) fed from a job queue; results come
back through a second one. In a program whose processes are all on this host
both are OS pipes with host locks (``_hostqueue``: no store, no redis-py, as
the stdlib's); where its processes run elsewhere (``NIMBUS_ENDPOINT``, a
provider's nodes) they are lists in the state store. ``chunksize``,
``maxtasksperchild``, ``initializer``, ``imap`` (lazy) and ``imap_unordered``
(completion order) are the stdlib's own code. ``ThreadPool`` stays local threads.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import socket
import time
from multiprocessing import pool as stdlib_pool
from multiprocessing.pool import (  # noqa: F401
    CLOSE,
    INIT,
    RUN,
    TERMINATE,
    ApplyResult,
    AsyncResult,
    ExceptionWithTraceback,
    IMapIterator,
    IMapUnorderedIterator,
    MapResult,
    MaybeEncodingError,
    RemoteTraceback,
    ThreadPool,
)
from typing import Any

from nimbus import local_history
from nimbus.errors import DeserializationError
from nimbus.multiprocessing import _hostqueue, _site, popen_nimbus
from nimbus.multiprocessing.context import NimbusContext
from nimbus.records import TaskRecord, TaskState

__all__ = [
    "ApplyResult",
    "AsyncResult",
    "IMapIterator",
    "IMapUnorderedIterator",
    "MapResult",
    "MaybeEncodingError",
    "Pool",
    "ThreadPool",
]


_HOST = socket.gethostname()


class _PoolContext(NimbusContext):
    """Our context, except that the pool's own wake-up queue is a local pipe.

    The stdlib pool creates its job and result queues in ``_setup_queues`` and
    then a "change notifier" that only its own threads use, and that it waits
    on together with the processes' sentinels; a local pipe serves that best.
    """

    def __init__(self, base: NimbusContext) -> None:
        super().__init__(base._name)
        self._base = base
        # the base's class (ForkProcess ...): its workers are named as the stdlib's,
        # ForkPoolWorker-N under fork (the default), SpawnPoolWorker-N under spawn
        self.Process = base.Process

    def SimpleQueue(self) -> Any:
        return multiprocessing.get_context("fork").SimpleQueue()


class Pool(stdlib_pool.Pool):
    """``multiprocessing.Pool`` with nimbus processes; its queues pipes here, else the store's."""

    def __init__(
        self,
        processes: int | None = None,
        initializer: Any = None,
        initargs: tuple[Any, ...] = (),
        maxtasksperchild: int | None = None,
        context: NimbusContext | None = None,
    ) -> None:
        if context is None:
            from nimbus.multiprocessing.context import _default_context

            context = _default_context.get_context()
        super().__init__(processes, initializer, initargs, maxtasksperchild, _PoolContext(context))

    @staticmethod
    def Process(ctx: Any, *args: Any, **kwds: Any) -> Any:
        if kwds.get("target") is stdlib_pool.worker:
            kwds["target"] = _worker
        process = ctx.Process(*args, **kwds)
        process._nimbus_pool = True  # long-lived, started in a burst (popen_nimbus, _forking)
        return process

    def _setup_queues(self) -> None:
        _site.refuse_in_sandbox()  # its processes could not reach the queues, either kind
        program = _site.program()
        self._inqueue: Any
        self._outqueue: Any
        if _hostqueue.usable(program):  # every process here: OS pipes, no store (no redis-py)
            popen_nimbus.site()  # first: the warm workers it forks then hold no copy of them
            self._inqueue = _hostqueue.HostSimpleQueue(program)
            self._outqueue = _hostqueue.HostSimpleQueue(program)
        else:
            from nimbus.multiprocessing.queues import SimpleQueue

            self._inqueue = SimpleQueue()
            self._outqueue = SimpleQueue()
        self._quick_put = self._inqueue.put
        self._quick_get = self._outqueue.get

    def _get_sentinels(self) -> list[Any]:
        return [self._change_notifier._reader]


def _worker(inqueue: Any, outqueue: Any, *rest: Any) -> None:
    """The stdlib's pool worker, but a task it cannot unpickle (a function the child does
    not find) fails that task with the error, as a task that raises does, instead of
    ending the worker: the stdlib's pool would wait for its result for ever."""
    tasks = _Tasks(inqueue)
    if local_history.active():  # Pool.terminate(): records handed over first
        signal.signal(signal.SIGTERM, _terminated)
    stdlib_pool.worker(tasks, _Results(outqueue, tasks), *rest)


def _terminated(signum: int, frame: Any) -> None:
    """SIGTERM in a pool worker (``Pool.terminate``, the end of ``with Pool()``): its
    tasks' records handed over, then the signal's default action, as without this. A
    worker that got the pool's sentinel ends by itself as the SIGTERM comes: this may
    interrupt its last hand-over (``_child.run``), which finishes first (``ended(then)``)."""
    signal.signal(signum, signal.SIG_IGN)  # a second one does not interrupt the hand-over
    local_history.ended(then=functools.partial(_default_action, signum))


def _default_action(signum: int) -> None:
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


class _Tasks:
    """The pool's task queue, its undecodable tasks made tasks that raise the error; the
    task taken last (its function's name, when it was taken) for its record."""

    def __init__(self, inqueue: Any) -> None:
        self._inqueue = inqueue
        self.taken: tuple[str, float] = ("", 0.0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inqueue, name)

    def get(self) -> Any:
        try:
            task = self._inqueue.get()
        except DeserializationError as exc:
            task = _undecodable_task(exc)
            if task is None:
                raise
        if task is not None:
            func, args = task[2], task[3]
            if func in (stdlib_pool.mapstar, stdlib_pool.starmapstar) and args:
                func = args[0][0]  # a map's chunk: the mapped function
            self.taken = (getattr(func, "__qualname__", "") or repr(func), time.time())
        return task


class _Results:
    """The pool's result queue; each result put keeps its task's record for ``nimbus
    dashboard`` (``local_history``: a no-op without a service in the runtime directory)."""

    def __init__(self, outqueue: Any, tasks: _Tasks) -> None:
        self._outqueue, self._tasks = outqueue, tasks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._outqueue, name)

    def put(self, result: Any) -> None:
        name, taken = self._tasks.taken
        if taken and local_history.wanted():  # kept before the result goes: the pool
            # may terminate this worker right after
            self._tasks.taken = ("", 0.0)
            ok = isinstance(result, tuple) and len(result) == 3 and result[2][0]
            record = TaskRecord(local_history.new_id(), TaskState.SUCCESS if ok else
                                TaskState.FAILED, name, f"pool/{os.getpid()}", _HOST,
                                os.getpid(), taken, taken, taken, time.time())  # fmt: skip
            local_history.keep(record, soon=True)
        self._outqueue.put(result)


def _undecodable_task(exc: DeserializationError) -> tuple[Any, ...] | None:
    """``(job, i, raiser, (), {})`` for a task message that failed to unpickle, read again
    with its missing classes and functions left out; None if even that fails."""
    import io
    import pickle

    message = getattr(exc, "message", None)
    if message is None:
        return None

    class Lenient(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            try:
                return super().find_class(module, name)
            except Exception:
                return None

    data, buffers = message if isinstance(message, tuple) else (message, ())
    try:
        task = Lenient(io.BytesIO(bytes(data)), buffers=buffers).load()
        job, i = task[0], task[1]
    except Exception:
        return None

    def raiser() -> None:
        raise exc

    return (job, i, raiser, (), {})
