"""``nimbus.Executor``: a ``concurrent.futures.Executor`` on warm workers.

::

    submit(fn, *args) -> pickle (fn once, args each time) -> Task -> backend
                                                                       |
    Future.set_result / set_exception  <-- unpickle <-- on_results <---+

``Executor()`` runs an embedded runtime (``nimbus.backends.local``) with one
warm worker per core. Futures are ``concurrent.futures.Future`` objects, so
``wait`` and ``as_completed`` work unchanged; each carries its
:class:`~nimbus.records.TaskRecord` as ``future.record``.

Data between tasks (``nimbus.data``): ``map(..., keep=True)`` and
``options(keep=True)`` keep results where they were made (a
:class:`KeptFuture` holds a ``nimbus.Ref``; its ``result()`` fetches the
object); Refs and futures passed as arguments are resolved where the task runs.
A task given futures of kept tasks on an endpoint is sent at once and held by
the service until they succeed; otherwise it waits for the futures it is given
before it is sent: that path is ``nimbus.data._submit`` (``DataPath``, one per executor).

Four parts of it have modules of their own: its arguments' checks (``nimbus._arguments``),
``map``'s ordered results and what is cancelled when they are left early or on a
Ctrl-C (``nimbus._mapping``), the views ``options()`` returns (``nimbus._options``),
and the program its tasks are instances of: ``messaging()``, ``store()``
(``nimbus._tasks_program``).
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import functools
import itertools
import os
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures._base import RUNNING  # read without the lock on the hot path
from typing import Any, TypeVar

from nimbus import _arguments, _mapping, data, local_history, serialization
from nimbus._future import Future
from nimbus._options import Options
from nimbus._tasks_program import UNMADE, TasksProgram, notice
from nimbus.backends import BACKENDS, Backend
from nimbus.config import Settings
from nimbus.data import DataPath, KeptFuture
from nimbus.environments import Environment
from nimbus.errors import (
    ConfigError,
    DataError,
    InputFailed,
    PayloadTooLargeError,
    RemoteTraceback,
)
from nimbus.records import TaskRecord, TaskState
from nimbus.runtime.messages import Status
from nimbus.runtime.task import Task

__all__ = ["Executor", "Future", "KeptFuture"]

T = TypeVar("T")

_live: weakref.WeakSet[Executor] = weakref.WeakSet()


def _forked() -> None:
    """In a forked child: the pending futures of its parent's executors fail here with a
    ``RuntimeError`` naming whose they are (their results arrive in that process only:
    ``result()``, ``concurrent.futures.wait`` and ``as_completed`` here never ended), as
    the stdlib's pool fails its pending futures when it breaks. The parent's are untouched."""
    for ex in list(_live):
        for future in list(ex._futures.values()):
            future.orphan(ex._pid)


os.register_at_fork(after_in_child=_forked)
_SAME: Any = object()  # options(): keep the executor's own
_PLAIN = frozenset((int, float, str, bytes, bool, type(None)))  # arguments with no data in them


class Executor(_mapping.Mapper, TasksProgram):
    """Run callables on warm worker processes.

    ``max_workers`` defaults to ``Settings.workers`` (the number of cores); more than
    the node can start (``nimbus.runtime.limits``: memory, RLIMIT_NPROC, RLIMIT_NOFILE)
    is refused with a ``ConfigError``, as every worker starts at once.
    ``task_timeout`` (seconds) stops any task that runs longer: its worker
    is killed and replaced and its future raises
    :class:`~nimbus.errors.TaskTimeoutError`. ``settings`` defaults to
    ``Settings.load()`` (``NIMBUS_*`` environment variables). ``on_notice`` is
    called, on the runtime's thread, with what task code sends with
    ``nimbus.runtime.worker.notify`` (progress, events). ``preload`` names
    modules every worker imports when it starts, before it takes a task (as
    ``multiprocessing.set_forkserver_preload``; one this Python cannot find is
    refused with a ``ConfigError``, one that fails to import is skipped and
    imported again by the task that needs it). ``endpoint``
    (default ``Settings.endpoint``, ``NIMBUS_ENDPOINT``) runs the tasks on that
    remote endpoint through the nimbus service (the ``service`` backend) instead.
    An executor not shut down is shut down at interpreter exit, as the stdlib's
    are (after a Ctrl-C its queued tasks are cancelled and only the running ones
    waited for; a second Ctrl-C stops its workers before the process exits),
    unless ``shutdown_at_exit=False``: then its owner does (after work of
    its own that still needs it, as ``nimbus.multiprocessing`` joins its processes).
    ``environment`` (a :class:`~nimbus.Environment`; default
    ``Settings.environment``, ``NIMBUS_ENVIRONMENT``, else the workers' own
    Python) is what the tasks run in: workers of that environment, built once
    per node; ``options(environment=...)`` chooses per call.
    """

    def __init__(
        self,
        max_workers: int | None = None,
        *,
        task_timeout: float | None = None,
        settings: Settings | None = None,
        backend: str | None = None,
        endpoint: str | None = None,
        on_notice: Callable[[Any], None] | None = None,
        preload: Sequence[str] = (),
        shutdown_at_exit: bool = True,
        environment: Environment | None = None,
        _program: bool = True,
    ) -> None:
        self.settings = settings if settings is not None else Settings.load()
        self._environment, self._env = (
            _arguments.check_environment(self.settings.environment)
            if environment is None
            else _arguments.check_environment(environment, "environment")
        )
        if endpoint is not None and not isinstance(endpoint, str):
            raise TypeError(
                f"endpoint must be an endpoint's name or id (a str), not {endpoint!r}; "
                "see nimbus endpoint list"
            )
        given = "max_workers"
        if max_workers is None:
            max_workers, given = self.settings.workers, "NIMBUS_WORKERS"
        here = backend in (None, "local") and not (endpoint or self.settings.endpoint)
        _arguments.check_workers(max_workers, given, here=here)
        if task_timeout is None:
            task_timeout = self.settings.task_timeout
        self._timeout = _arguments.check_timeout(task_timeout, "task_timeout")
        if isinstance(preload, str) or not all(isinstance(name, str) for name in preload):
            raise TypeError(f"preload must be a list of module names, not {preload!r}")
        if backend is None:
            endpoint = endpoint or self.settings.endpoint
            backend = "service" if endpoint else "local"
            if backend == "local":  # (an endpoint's workers may have modules this has not;
                _arguments.check_preload(
                    preload
                )  # nimbus.multiprocessing's, stdlib-like, are skipped)
        if backend not in BACKENDS:
            raise ConfigError(f"unknown backend {backend!r}; known: {', '.join(sorted(BACKENDS))}")
        self._max_workers = max_workers
        self._pid = os.getpid()  # its runtime's threads and workers are this process's
        self._seq = itertools.count()
        self._prefix = uuid.uuid4().int & ~((1 << 64) - 1)
        head = f"{self._prefix:032x}"  # str(UUID(int=prefix | seq)) is head + seq's 16 digits
        self._id_head = f"{head[:8]}-{head[8:12]}-{head[12:16]}-"
        self._futures: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._endpoint = endpoint if backend == "service" else None
        self._path = DataPath(self)  # tasks with Refs and futures as arguments
        self._bytes_sent = 0
        self._bytes_received = 0
        self._shutdown = False
        self._closing = False  # shutdown() began
        self._closed = threading.Event()  # shutdown() ended
        # a local run's finished records, kept for `nimbus dashboard` (local_history.py)
        self._history: local_history.LocalHistory | None = None
        if backend == "local" and local_history.enabled(self.settings):
            self._history = local_history.LocalHistory(self.settings)
        self._keep = None if self._history is None else self._history.add
        self._backend: Backend = BACKENDS[backend](
            workers=max_workers,
            prefetch=self.settings.prefetch,
            on_results=self._on_results,
            on_dispatch=self._on_dispatch,
            on_notice=functools.partial(notice, on_notice),
            preload=list(preload),
            settings=self.settings,
            endpoint=endpoint,
        )
        self._stop_task = self._backend.cancel  # each future's _stop (one bound method)
        # a remote backend's workers cannot import the caller's own modules
        self._remote = bool(getattr(self._backend, "remote", False))
        self._functions = serialization.FunctionCache(by_value=self._remote)
        # nimbus.put(obj, endpoint=...) goes through it, by the endpoint's name or id
        self._places: set[str] = {
            p for p in (endpoint, getattr(self._backend, "endpoint_id", None)) if p
        }
        for place in self._places if self._endpoint is not None else ():
            data.register(place, None, opener=self._path.open)
        # its tasks are instances of one program (nimbus.messaging): made at the first
        # task; none for nimbus.multiprocessing's own (its processes adopt their program)
        self._row: Any = UNMADE if _program else None
        self._instance: Any = None  # messaging(): the client's instance on an endpoint
        program = getattr(self._backend, "program", None)
        if _program and program is not None:  # an endpoint's: asked for now, on a thread
            program.start()
        if shutdown_at_exit:
            _live.add(self)

    @property
    def max_workers(self) -> int:
        return self._max_workers

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> cf.Future[T]:
        """Schedule ``fn(*args, **kwargs)``; returns a :class:`Future`."""
        if not kwargs and _PLAIN.issuperset(map(type, args)):  # as _submit: nothing to stage
            return self._launch(
                fn, args, kwargs, self._timeout, environment=self._environment, env=self._env
            )
        return self._submit(
            fn, args, kwargs, self._timeout, environment=self._environment, env=self._env
        )

    def options(
        self,
        *,
        timeout: Any = _SAME,
        environment: Any = _SAME,
        keep: bool = False,
        **limits: Any,
    ) -> Options:
        """A view of this executor whose tasks have their own timeout or environment;
        ``keep``: their results stay where they were made (:class:`KeptFuture`);
        ``bandwidth``, ``memory``, ``cpus``: limits of each task (``nimbus.network``)."""
        if timeout is not _SAME:
            timeout = _arguments.check_timeout(timeout, "timeout")
        else:
            timeout = self._timeout
        if environment is not _SAME:
            env, tag = _arguments.check_environment(environment, "environment")
        else:
            env, tag = self._environment, self._env
        own = None  # a task's own limits, with its arguments
        if limits:
            from nimbus.network import task_limits

            own = task_limits(**limits)
        return Options(
            self._submit,
            self._cancel_queued,
            timeout,
            env,
            tag,
            keep=bool(keep),
            limits=own,
            staged_items=self._staged_items,
        )

    def _submit(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        keep: bool = False,
        environment: Environment | None = None,
        env: str = "",
        limits: Any = None,
    ) -> Future:
        if os.getpid() != self._pid:  # (before a future of the owner's is waited for)
            raise RuntimeError(_forked_use(self._pid))
        plain = not kwargs and _PLAIN.issuperset(map(type, args))  # no File, Ref, future
        if not plain and data.has_files(args, kwargs):  # checked now, staged before the task
            args, kwargs = data.stage_files(self, args, kwargs)
        if keep or (not plain and data.uses_data(args, kwargs)):
            return self._path.submit(fn, args, kwargs, timeout, keep, environment, env, limits)
        return self._launch(
            fn, args, kwargs, timeout, environment=environment, env=env, limits=limits
        )

    def _launch(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        future: Future | None = None,
        label: Callable[..., Any] | None = None,
        *,
        environment: Environment | None = None,
        env: str = "",
        limits: Any = None,
    ) -> Future:
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")
        if os.getpid() != self._pid:
            raise RuntimeError(_forked_use(self._pid))
        if not callable(fn):
            raise TypeError(f"{serialization.describe(fn)} is not callable; pass a function")
        fn_key, fn_bytes = self._functions.get(fn)
        # a task's own limits and its executor's program travel with its arguments: fn
        # is sent as it is (nimbus._joined)
        row = self._made_row()
        payload, buffers = serialization.dumps(
            (args, kwargs, limits.row() if limits else None, row)
            if row is not None
            else ((args, kwargs, limits.row()) if limits else (args, kwargs))
        )
        size = len(payload) + sum(b.raw().nbytes for b in buffers)
        named = fn if label is None else label
        if size > self.settings.max_payload:
            raise PayloadTooLargeError(
                f"the arguments of {serialization.describe(named)} pickle to {size} bytes, more "
                f"than the limit of {self.settings.max_payload} bytes (NIMBUS_MAX_PAYLOAD)"
            )
        self._bytes_sent += size
        seq = next(self._seq)
        digits = f"{seq:016x}"  # the id: str(uuid.UUID(int=self._prefix | seq)), made cheaply
        record = TaskRecord(
            self._id_head + digits[:4] + "-" + digits[4:]
            if len(digits) == 16
            else str(uuid.UUID(int=self._prefix | seq)),
            function=getattr(named, "__qualname__", type(named).__qualname__),
            submitted=time.time(),
        )
        if future is None:
            future = Future()
        future.record = record
        task = Task(
            seq,
            fn_key,
            fn_bytes,
            payload,
            buffers or (),  # (no empty list a task for the collector to walk)
            record,
            timeout=timeout,
            owner=future,
            environment=environment,
            env=env,
            wraps="" if label is None else self._path.wraps(label),
        )
        future._task = task
        future._stop = self._stop_task
        self._futures[seq] = future
        self._backend.submit([task])
        return future

    def _staged_items(self, items: list[tuple[Any, ...]]) -> list[tuple[Any, ...]] | None:
        """map's items with their Files checked and made ready, all before any task is
        sent (a missing file of the tenth item ran nine tasks first); None if none has one."""
        file = data.File
        if not any(type(value) is file for args in items for value in args):
            return None
        return [data.stage_files(self, args, {})[0] for args in items]

    def _map_kept(
        self, fn: Callable[..., Any], items: list[tuple[Any, ...]]
    ) -> list[Any]:  # map(keep=True): as a view that keeps does
        return self.options(keep=True)._map_kept(fn, items)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking tasks; with ``cancel_futures`` drop those not yet running.

        In a process forked from its owner it only stops taking tasks: the runtime's
        threads, workers and connections are the owner's (a child that leaves a ``with``
        block or exits normally must not wait for them, nor stop them under the owner)."""
        if os.getpid() != self._pid:  # (its lock may have been held by another thread)
            self._shutdown = True
            _live.discard(self)
            return
        with self._lock:
            self._shutdown = True
            first, self._closing = not self._closing, True
        if cancel_futures:  # as the stdlib: those not running are cancelled, the others finish
            self._cancel_queued(list(self._futures.values()))
        if not first:  # being shut down already (by another thread, or wait=False's)
            if wait:
                self._closed.wait()
            return
        if not wait:  # as the stdlib: returns now, and the pending futures still complete
            # (a service's connection stays up for their results, their messaging program
            # for them to use); the interpreter's exit waits for them (a non-daemon thread)
            threading.Thread(target=self._close, name="nimbus-shutdown").start()
            return
        self._close()

    def _close(self) -> None:
        """The end of :meth:`shutdown`, once the pending futures are done."""
        if self._endpoint is not None:
            session = self._path.session
            if session is not None:
                session.close()  # what was released is freed while tasks still run
            for place in self._places:
                data.register(place, None, session, opener=self._path.open)
        try:
            self._backend.shutdown(wait=True)
        except KeyboardInterrupt:  # a (second) Ctrl-C while it waits: stop the workers
            self._backend.shutdown(wait=True, kill=True)
            raise
        finally:
            data.close_sources(self)  # (after the tasks: files staged in, out= carried)
            self._close_program()
            if self._history is not None:
                self._history.close()
            _live.discard(self)
            self._closed.set()

    def _cancel_queued(self, futures: list[Any]) -> None:
        """Cancel the tasks of ``futures`` not running yet; the running ones finish."""
        # a local runtime knows which tasks a worker has started; of other backends,
        # those sent on (RUNNING) are left to finish
        known = getattr(self._backend, "tells_started", False)
        for future in futures:
            if known:
                future.cancel_unstarted()
            elif not future.running():
                future.cancel()

    def statistics(self) -> dict[str, Any]:
        """What this executor holds: ``outstanding`` tasks (not finished), ``running`` (the
        tasks a worker runs now: ``task_id``, ``function``, ``dispatched`` time) and the
        local ``runtime``'s managers and workers."""
        stats = getattr(self._backend, "agent", None)
        running = []
        for future in list(self._futures.values()):
            task = future._task
            if task is not None and task.started and not future.done():
                record = task.record
                running.append(
                    {
                        "task_id": record.task_id,
                        "function": record.function,
                        "dispatched": record.dispatched,
                    }
                )
        return {
            "outstanding": len(self._futures),
            "running": running,
            "bytes_sent": self._bytes_sent,  # pickled arguments given to the backend
            "bytes_received": self._bytes_received,  # pickled results it gave back
            "runtime": stats.statistics() if stats is not None else {},
        }

    # -- called on the runtime's loop thread --------------------------
    def _on_dispatch(self, tasks: list[Task]) -> list[Task]:
        out = []
        for task in tasks:
            future: Future = task.owner
            if future.cancelled():
                self._futures.pop(task.seq, None)
                continue
            if task.attempts == 0 and future._state == RUNNING:  # (no lock: set here only)
                pass  # sent again: a reference it reads was lost and made again
            elif task.attempts == 0:
                try:
                    if not future.set_running_or_notify_cancel():
                        self._futures.pop(task.seq, None)
                        continue
                except RuntimeError:  # cancelled meanwhile
                    continue
                task.record.state = TaskState.RUNNING
            elif future.done():
                continue
            out.append(task)
        return out

    def _on_results(self, tasks: list[Task]) -> None:
        futures = self._futures
        keep = self._keep
        for task in tasks:
            future: Future = task.owner
            futures.pop(task.seq, None)
            record = task.record
            try:
                if task.status == Status.OK:
                    self._bytes_received += len(task.data)
                    if task.result_buffers:
                        self._bytes_received += sum(
                            memoryview(b).nbytes for b in task.result_buffers
                        )
                    value = serialization.loads(task.data, task.result_buffers)
                    if type(future) is KeptFuture:
                        value = self._path.kept(future, value)
                    record.state = TaskState.SUCCESS
                    future.set_result(value)
                elif task.status == Status.ERROR:
                    error, tb = serialization.loads(task.data)
                    if tb:
                        error.__cause__ = RemoteTraceback(tb)
                    if isinstance(error, DataError) and self._path.recover(future, error):
                        continue  # its producer runs again, then it does (or its files go)
                    if type(error) is InputFailed:
                        DataPath.explain(future, error)
                    record.state = TaskState.FAILED
                    future.set_exception(error)
            except cf.InvalidStateError:
                pass  # cancelled while the result was on its way
            except Exception as exc:  # a result that cannot be unpickled here
                record.state = TaskState.FAILED
                try:
                    future.set_exception(exc)
                except cf.InvalidStateError:
                    pass
            task.data = b""
            task.result_buffers = ()
            if keep is not None:
                keep(record)
            if type(future) is not Future:  # the data path: its Refs go when it does
                DataPath.done(future)


def _forked_use(owner: int) -> str:
    return (
        f"this Executor belongs to process {owner}, and this process ({os.getpid()}) was "
        f"forked from it: its runtime (threads, workers, connections) did not come along, "
        f"so its tasks' results could never arrive here; make an Executor in this process "
        f"(or use nimbus.multiprocessing, whose processes may each have their own)"
    )


@atexit.register
def _shutdown_live() -> None:
    """Finish the work of executors the program never shut down, as the stdlib does.

    After a Ctrl-C (the program ended on ``KeyboardInterrupt``) the queued tasks are
    cancelled and only the running ones are waited for; a second Ctrl-C while they
    run stops the workers (killed, waited for) before the process exits.
    """
    interrupted = getattr(sys, "last_type", None) is KeyboardInterrupt
    try:
        for executor in list(_live):
            executor.shutdown(wait=True, cancel_futures=interrupted)
    except KeyboardInterrupt:
        for executor in list(_live):
            executor._backend.shutdown(wait=True, kill=True)
            _live.discard(executor)
        raise
