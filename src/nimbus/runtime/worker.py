"""A warm worker: runs the tasks its manager sends, one at a time, in order.

::

    manager ==TASKS/CANCEL==> [queue] -> run one task -> [results] ==RESULTS==> manager
                                               |
                                     TaskGauge (cpu, memory, net bytes: nimbus.network)

Started by its manager with ``python -u -c WORKER_MAIN FD [MODULE ...]``, where
FD is its end of a socketpair with its manager and the modules are imported
before it says hello (the Executor's ``preload``). It reads every frame that is waiting,
runs the oldest queued task, and sends results in batches: at once when it
has nothing else queued or the task took long, otherwise up to 64 at a time
or after 2 ms. Before a task that may take long (its function is new to this
worker or was slow last time, or the manager asks) it sends what it holds
together with a *started* mark, so no result waits behind a long task and the
manager knows which task was running if the worker dies. While a task runs
longer than that, the flusher thread reads the channel in its place, so a
RECALL (another worker is idle: work stealing) is answered at once with the
queued tasks handed back, not after the running task. It exits when the
manager closes the channel or dies.
Standard output and error are the manager's, unbuffered, so what a task
prints appears at once and survives a crash.

A manager may fork its workers instead (``nimbus.runtime.popen_fork``): a process
that has imported what the workers need (a multiprocessing program's root) gets
one in milliseconds rather than a new interpreter's start and imports; it then
imports its preload only once it has been quiet a while (``main(preload_later=True)``).
"""

from __future__ import annotations

import _socket
import faulthandler
import functools
import importlib
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

from nimbus import _joined, serialization
from nimbus.errors import (
    DeserializationError,
    SerializationError,
    TaskInterrupted,
    VersionMismatchError,
)
from nimbus.network import SKIPPED, TaskGauge, apply_limits
from nimbus.runtime._idle import idle as _idle
from nimbus.runtime._idle import later as _later
from nimbus.runtime._idle import run_idle as _run_idle
from nimbus.runtime._idle import run_later as _run_later
from nimbus.runtime._idle import when_idle, when_quiet
from nimbus.runtime.messages import INLINE_LIMIT, PYTHON, START_STORE, Kind, Status
from nimbus.wire import Buffer, Channel, pack, unpack

__all__ = [
    "Worker",
    "close_in_child",
    "main",
    "notify",
    "when_idle",
    "when_quiet",
]

BATCH_RESULTS = 64
BATCH_SECONDS = 0.002
LONG_TASK = 0.001
PRELOAD_QUIET = 0.25  # seconds with no task before a forked worker imports its preload
_OUT: Any = object()  # run_one: the task joined no program (nimbus._joined)
WATCH_POLL = 0.25  # seconds between looks at the watched task (a pipe wakes sooner): still
# running? a co-location sample (nimbus.network)


class Worker:
    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.gauge = TaskGauge()
        self.functions: dict[str, Callable[..., Any]] = {}
        self.function_bytes: dict[str, bytes] = {}
        self.queue: deque[tuple[list[Any], list[Buffer], str | None]] = deque()
        self.skip: set[int] = set()
        self.rows: list[list[Any]] = []
        self.buffers: list[Any] = []
        self.first_result = 0.0
        self.send_lock = threading.Lock()
        self.quick: dict[str, bool] = {}  # function key -> its last run was quick
        self.current: int | None = None  # the task running now
        self.current_since = 0.0  # when it started (monotonic)
        self.announced: int | None = None  # the last task sent as started
        self.armed = False
        self.wake = threading.Event()
        self.read_lock = threading.Lock()  # one reader of the channel at a time
        self.queue_lock = threading.Lock()  # a task is either started or handed back
        self.watching = False  # the flusher reads the channel while a task runs
        self.retire = False  # a task's limits could not be put back: exit after its result
        self.task_done_r, self.task_done_w = os.pipe()
        os.set_blocking(self.task_done_r, False)
        threading.Thread(target=self.flusher, name="nimbus-flusher", daemon=True).start()

    def serve(self) -> None:
        channel = self.channel
        channel.send(
            Kind.HELLO, pack({"pid": os.getpid(), "python": PYTHON, "host": socket.gethostname()})
        )
        channel.flush()
        while True:
            idle = not self.queue and not self.rows
            with self.read_lock:
                frames = channel.receive(block=idle and not _idle and not _later)
                if frames is None:
                    return
                for frame in frames:
                    self.accept(frame.kind, frame.meta, frame.buffers)
            if idle and not frames and _idle:
                _run_idle()  # nothing to do now: the work that waited for that
                continue
            if idle and not frames and _later:
                # quiet for a while (no task came): the work that waited for that
                if not select.select([channel.sock], [], [], _later[0][0])[0]:
                    _run_later()
                continue
            if self.queue:
                started = time.monotonic()
                seq, fn_key = self.run_one()
                long_task = time.monotonic() - started > LONG_TASK
                self.quick[fn_key] = not long_task
                if (
                    long_task
                    or seq == self.announced  # said to be running: say it ended
                    or not self.queue
                    or len(self.rows) >= BATCH_RESULTS
                    or started - self.first_result > BATCH_SECONDS
                    or self.retire
                ):
                    self.flush()
                if self.retire:  # its manager starts another; the queued tasks go back
                    return
            elif self.rows:
                self.flush()

    def accept(self, kind: int, meta: bytes, buffers: list[Buffer]) -> None:
        if kind == Kind.TASKS:
            python, rows = unpack(meta)
            refusal = None
            if python != PYTHON:
                refusal = (
                    f"this worker runs Python {PYTHON} but the task was sent from Python "
                    f"{python}; run the caller and the workers on the same Python minor version"
                )
            position = 0
            for row in rows:
                if row[2] is not None:
                    self.function_bytes[row[1]] = row[2]
                nbufs = row[4]
                self.queue.append((row, buffers[position : position + nbufs], refusal))
                position += nbufs
        elif kind == Kind.CANCEL:
            self.skip.update(unpack(meta))
        elif kind == Kind.RECALL:
            self.hand_back(set(unpack(meta)))

    def hand_back(self, recalled: set[int]) -> None:
        """Drop the recalled tasks not started yet and tell the manager which.

        A cancelled one stays, to be answered SKIPPED in its turn.
        """
        with self.queue_lock:
            kept = []
            back: list[int] = []
            for item in self.queue:
                seq = item[0][0]
                if seq in recalled and seq not in self.skip:
                    back.append(seq)
                else:
                    kept.append(item)
            if back:
                self.queue.clear()
                self.queue.extend(kept)
        with self.send_lock:
            self.channel.send(Kind.HANDBACK, pack(back))
            self.channel.flush()

    def run_one(self) -> tuple[int, str]:
        """Run the oldest queued task; returns its number and its function's key."""
        with self.queue_lock:  # out of the queue: started, never handed back
            row, buffers, refusal = self.queue.popleft()
        seq, fn_key, _fn_bytes, payload, _nbufs, notify_start = row
        seq, fn_key = int(seq), str(fn_key)
        if seq in self.skip:
            self.skip.discard(seq)
            self.add_result(seq, Status.SKIPPED, b"", [], SKIPPED)
            return seq, fn_key
        # before the arming: the flusher's sleep starts after it, so a task it finds
        # still running has run BATCH_SECONDS at least
        self.current_since = time.monotonic()
        if notify_start or not self.quick.get(fn_key, False):
            self.flush(started=seq)
        if not self.armed:
            # a quick task may turn out long: the flusher tells; while any task runs
            # long, the flusher reads the channel (a RECALL is answered at once)
            self.armed = True
            self.wake.set()
        self.current = seq
        started = self.gauge.begin()
        status = Status.OK
        out: list[Any] = []
        result: Any = None
        args: Any = None
        kwargs: Any = None
        undo: Callable[[], None] | None = None
        before: Any = _OUT
        try:
            if refusal is not None:
                raise VersionMismatchError(refusal)
            fn = self.functions.get(fn_key)
            if fn is None:
                fn_bytes = self.function_bytes.get(fn_key)
                if fn_bytes is None:
                    raise DeserializationError(f"function {fn_key} was never sent to this worker")
                fn = serialization.loads(fn_bytes)
                self.functions[fn_key] = fn
                del self.function_bytes[fn_key]
            if payload is None:
                payload, buffers = buffers[0], buffers[1:]
            loaded = serialization.loads(payload, buffers)
            args, kwargs = loaded[0], loaded[1]
            if len(loaded) > 2:
                if loaded[2] is not None:  # its own limits (options(bandwidth=, memory=, cpus=))
                    undo = apply_limits(loaded[2], self.not_restored)
                if len(loaded) > 3:  # its executor's program: its tasks message each other
                    before = _joined.join(loaded[3])
            result = fn(*args, **kwargs)
        except (SystemExit, KeyboardInterrupt) as exc:
            status, data, out = Status.ERROR, self.interrupted(exc), []
        except BaseException as exc:
            status, out = Status.ERROR, []
            data = serialization.dumps_exception(exc, traceback.format_exc())
        else:
            try:
                data, out = serialization.dumps(result)
            except SerializationError as exc:
                error = SerializationError(f"the task's result could not be sent back: {exc}")
                status, data, out = Status.ERROR, serialization.dumps_exception(error, ""), []
        del result, args, kwargs, buffers
        if before is not _OUT:  # (before its result: its messages go out first)
            try:
                _joined.leave(before)
            except Exception as exc:  # what the task made for its program may stay here
                self.not_restored(exc, "what a task made for its program (messaging)")
        if undo is not None:
            undo()  # the worker's own limits back (a failure: not_restored)
        self.current = None
        if self.watching:  # the flusher reads the channel: it is the main thread's again
            os.write(self.task_done_w, b"x")
        self.add_result(seq, status, data, out, self.gauge.end(started))
        return seq, fn_key

    def not_restored(self, exc: BaseException, what: str = "a task's limit") -> None:
        """A task's limit (or ``what``) stays on this worker: said, and the worker retires
        after the task's result (no later task inherits it)."""
        print(
            f"nimbus worker {os.getpid()}: {what} could not be taken back ({exc}); "
            "this worker exits after its result and its manager starts another",
            file=sys.stderr,
        )
        self.retire = True

    @staticmethod
    def interrupted(exc: BaseException) -> bytes:
        if isinstance(exc, SystemExit):
            error = TaskInterrupted(f"the task raised SystemExit({exc.code!r})", exc.code)
        else:
            error = TaskInterrupted("the task raised KeyboardInterrupt")
        return serialization.dumps_exception(error, traceback.format_exc())

    def add_result(
        self, seq: int, status: int, data: bytes, out: list[Any], record: tuple[Any, ...]
    ) -> None:
        with self.send_lock:
            if not self.rows:
                self.first_result = time.monotonic()
            if len(data) > INLINE_LIMIT:
                self.rows.append([seq, status, None, len(out) + 1, *record])
                self.buffers.append(data)
            else:
                self.rows.append([seq, status, data, len(out), *record])
            self.buffers.extend(out)

    def flush(self, started: int | None = None) -> None:
        """Send the results held, and ``started``: the task about to run."""
        with self.send_lock:
            self._send_results(started)

    def _send_results(self, started: int | None) -> None:
        if started is not None:
            self.announced = started
        self.channel.send(Kind.RESULTS, pack([self.rows, started]), self.buffers)
        self.rows, self.buffers = [], []
        self.channel.flush()

    def flusher(self) -> None:
        """Within ``BATCH_SECONDS`` of a task's start, send what is held and mark it started.

        Batches of quick tasks stay batches; a task that turns out long does
        not hold earlier results back, and the manager learns it is running.
        """
        while True:
            self.wake.wait()
            self.wake.clear()
            time.sleep(BATCH_SECONDS)
            with self.send_lock:
                self.armed = False
                current, since = self.current, self.current_since
                if current is not None and current != self.announced:
                    try:
                        self._send_results(current)
                    except OSError:
                        return
            if current is None:
                continue
            # watch a task that has run a while, not one of a run of tiny ones just
            # begun (it did not arm this thread: it began before ``armed`` was cleared)
            rest = since + BATCH_SECONDS - time.monotonic()
            if rest > 0:
                time.sleep(rest)
                if self.current != current:
                    continue  # the next one armed this thread, or will
            try:
                self.watch(current)
            except OSError:
                return

    def watch(self, seq: int) -> None:
        """While task ``seq`` runs, read the channel in the main thread's place.

        Tasks and cancels join the queue; a RECALL is answered at once. The
        main thread reads again as soon as the task ends (the pipe wakes this).
        """
        sock, done = self.channel.sock, self.task_done_r
        self.watching = True  # before the check: the main thread writes the pipe after it
        try:
            self.gauge.sample()
            while self.current == seq:
                readable = select.select([sock, done], [], [], WATCH_POLL)[0]
                if not readable:
                    self.gauge.sample()
                    continue
                if done in readable:
                    while True:
                        try:
                            if not os.read(done, 64):
                                return
                        except BlockingIOError:
                            break
                if sock not in readable or not self.read_lock.acquire(blocking=False):
                    continue
                try:
                    if self.current != seq:
                        return
                    frames = self.channel.receive()
                    if frames is None:
                        return  # the manager is gone: the main thread finds out
                    for frame in frames:
                        self.accept(frame.kind, frame.meta, frame.buffers)
                finally:
                    self.read_lock.release()
        finally:
            self.watching = False

    def notify(self, payload: object) -> None:
        with self.send_lock:
            self.channel.send(Kind.NOTICE, pack(payload))
            self.channel.flush()


_worker: Worker | None = None  # the worker this process is, if it is one


def notify(payload: object) -> None:
    """Send ``payload`` (msgpack-able) to this worker's manager, from any thread.

    For task code that must report before it returns, or after (from a
    thread it started). Raises ``RuntimeError`` outside a nimbus worker.
    """
    if _worker is None:
        raise RuntimeError("nimbus.runtime.worker.notify() works only inside a nimbus worker")
    _worker.notify(payload)


def close_in_child() -> None:
    """In a process forked from a worker: let go of the worker's channel.

    The manager detects a dead worker by the end of its channel, so a forked
    child must not keep a copy of it open.
    """
    global _worker
    if _worker is not None:
        _worker.channel.close()
        _worker = None


def _ask_root(worker: Worker, url: str) -> None:
    """Ask the executor's process to start its program's store (``nimbus._joined``)."""
    worker.notify([START_STORE, url])


def _preload(names: list[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:  # as the stdlib's forkserver preload: the task imports it again
            pass


def _watch_parent(parent: int) -> None:
    """End this worker when its manager's process is gone, even mid-task."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def main(argv: list[str] | None = None, *, preload_later: bool = False) -> int:
    """Serve the manager on the channel FD (``argv``: FD [MODULE ...]) until it closes.

    ``preload_later``: import the modules once the worker is idle, not before
    its hello (a forked worker, whose first task should not wait for them).
    """
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(
            "usage: python -c 'from nimbus.runtime.worker import main; main()' FD [MODULE ...]",
            file=sys.stderr,
        )
        return 2
    fd = int(args[0])
    if preload_later:
        when_quiet(functools.partial(_preload, args[1:]), PRELOAD_QUIET)
    else:  # preloaded before the hello: this worker's first task starts warm
        _preload(args[1:])
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid>: show stacks
    sock = _socket.socket(fileno=fd)  # a bare socket: not counted as task traffic
    sock.setblocking(True)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    global _worker
    worker = _worker = Worker(Channel(sock))
    _joined.ask_root = functools.partial(_ask_root, worker)
    try:
        worker.serve()
    except (ConnectionError, BrokenPipeError):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
