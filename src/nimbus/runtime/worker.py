"""A warm worker: runs the tasks its manager sends, one at a time, in order.

::

    manager ==TASKS/CANCEL==> [queue] -> run one task -> [results] ==RESULTS==> manager
                                               |
                                          TaskMeter (cpu, memory, net bytes)

Started by its manager with ``python -u -c WORKER_MAIN FD``, where FD is its
end of a socketpair with its manager. It reads every frame that is waiting,
runs the oldest queued task, and sends results in batches: at once when it
has nothing else queued or the task took long, otherwise up to 64 at a time
or after 2 ms. It exits when the manager closes the channel or dies.
Standard output and error are the manager's, unbuffered, so what a task
prints appears at once and survives a crash.
"""

from __future__ import annotations

import _socket
import os
import socket
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

from nimbus import serialization
from nimbus.errors import (
    DeserializationError,
    SerializationError,
    TaskInterrupted,
    VersionMismatchError,
)
from nimbus.runtime.messages import INLINE_LIMIT, PYTHON, Kind, Status
from nimbus.telemetry import TaskMeter
from nimbus.wire import Buffer, Channel, pack, unpack

__all__ = ["Worker", "close_in_child", "main", "notify"]

BATCH_RESULTS = 64
BATCH_SECONDS = 0.002
LONG_TASK = 0.001


class Worker:
    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.meter = TaskMeter()
        self.functions: dict[str, Callable[..., Any]] = {}
        self.function_bytes: dict[str, bytes] = {}
        self.queue: deque[tuple[list[Any], list[Buffer], str | None]] = deque()
        self.skip: set[int] = set()
        self.rows: list[list[Any]] = []
        self.buffers: list[Any] = []
        self.first_result = 0.0
        self.send_lock = threading.Lock()

    def serve(self) -> None:
        channel = self.channel
        channel.send(
            Kind.HELLO, pack({"pid": os.getpid(), "python": PYTHON, "host": socket.gethostname()})
        )
        channel.flush()
        while True:
            frames = channel.receive(block=not self.queue and not self.rows)
            if frames is None:
                return
            for frame in frames:
                self.accept(frame.kind, frame.meta, frame.buffers)
            if self.queue:
                started = time.monotonic()
                self.run_one()
                long_task = time.monotonic() - started > LONG_TASK
                if (
                    long_task
                    or not self.queue
                    or len(self.rows) >= BATCH_RESULTS
                    or started - self.first_result > BATCH_SECONDS
                ):
                    self.flush()
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

    def run_one(self) -> None:
        row, buffers, refusal = self.queue.popleft()
        seq, fn_key, _fn_bytes, payload, _nbufs, notify_start = row
        if seq in self.skip:
            self.skip.discard(seq)
            self.add_result(seq, Status.SKIPPED, b"", [], (0.0, 0.0, 0.0, 0.0, 0, 0, 0))
            return
        if notify_start:
            with self.send_lock:
                self.channel.send(Kind.STARTED, pack(seq))
                self.channel.flush()
        started = self.meter.begin()
        status = Status.OK
        result: Any = None
        args: Any = None
        kwargs: Any = None
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
            args, kwargs = serialization.loads(payload, buffers)
            result = fn(*args, **kwargs)
            data, out = serialization.dumps(result)
        except (SystemExit, KeyboardInterrupt) as exc:
            status, data, out = Status.ERROR, self.interrupted(exc), []
        except BaseException as exc:
            if isinstance(exc, SerializationError):
                exc = SerializationError(f"the task's result could not be sent back: {exc}")
            status, out = Status.ERROR, []
            data = serialization.dumps_exception(exc, traceback.format_exc())
        del result, args, kwargs, buffers
        self.add_result(seq, status, data, out, (started, *self.meter.end()))

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
        if not self.rows:
            self.first_result = time.monotonic()
        if len(data) > INLINE_LIMIT:
            self.rows.append([seq, status, None, len(out) + 1, *record])
            self.buffers.append(data)
        else:
            self.rows.append([seq, status, data, len(out), *record])
        self.buffers.extend(out)

    def flush(self) -> None:
        with self.send_lock:
            self.channel.send(Kind.RESULTS, pack(self.rows), self.buffers)
            self.rows, self.buffers = [], []
            self.channel.flush()

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


def _watch_parent(parent: int) -> None:
    """End this worker when its manager's process is gone, even mid-task."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(
            "usage: python -c 'from nimbus.runtime.worker import main; main()' FD", file=sys.stderr
        )
        return 2
    fd = int(args[0])
    sock = _socket.socket(fileno=fd)  # a bare socket: not counted as task traffic
    sock.setblocking(True)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    global _worker
    worker = _worker = Worker(Channel(sock))
    try:
        worker.serve()
    except (ConnectionError, BrokenPipeError):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
