"""Task states and the record every task carries.

A :class:`TaskRecord` is filled in by each layer a task passes through::

    caller          submitted        (time.time() at submit)
    manager         dispatched       (sent to a worker), build_seconds (the
                    time the task waited for its environment to be built on
                    the node; never counted against its timeout)
    worker          started, ended, cpu_user, cpu_system, peak_memory,
                    net_bytes_in, net_bytes_out, worker, host, pid

How the worker measures (see ``nimbus.telemetry``):

* CPU seconds: ``resource.getrusage(RUSAGE_SELF)`` before and after the task,
  so threads the task started count while they run inside the task.
* ``peak_memory``: the worker's peak resident set size during the task, in
  bytes. On Linux the high-water mark is reset before each task
  (``/proc/self/clear_refs``), so it is the task's own peak (including the
  worker's resident baseline, about 20 MB); it is read from ``getrusage`` or,
  where that carries the peak of the process the worker was started from,
  from ``VmHWM`` in ``/proc/self/status``. Elsewhere it is the worker's peak so far.
* ``net_bytes_in``/``net_bytes_out``: bytes the task moved through Python
  ``socket.socket`` objects (send*, recv*, sendfile) while it ran. Traffic
  made by C libraries on their own sockets (libcurl, gRPC) and by child
  processes is not counted; nor is the worker's own channel to the runtime.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

__all__ = ["TaskRecord", "TaskState"]


class TaskState(str, enum.Enum):
    """Where a task is in its life."""

    RECEIVED = "received"
    WAITING = "waiting-for-endpoint"
    DISPATCHED = "dispatched"
    RUNNING = "running"
    SUCCESS = "success"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def done(self) -> bool:
        return self in (TaskState.SUCCESS, TaskState.FAILED, TaskState.CANCELLED)


@dataclass
class TaskRecord:
    """Timings and resource use of one task (timestamps are ``time.time()``)."""

    task_id: str
    state: TaskState = TaskState.RECEIVED
    function: str = ""
    worker: str = ""
    host: str = ""
    pid: int = 0
    submitted: float = 0.0
    dispatched: float = 0.0
    started: float = 0.0
    ended: float = 0.0
    cpu_user: float = 0.0
    cpu_system: float = 0.0
    peak_memory: int = 0
    net_bytes_in: int = 0
    net_bytes_out: int = 0
    build_seconds: float = 0.0

    @property
    def queued_seconds(self) -> float:
        """Time from submit to dispatch to a worker."""
        return max(0.0, self.dispatched - self.submitted) if self.dispatched else 0.0

    @property
    def run_seconds(self) -> float:
        """Wall time the task ran on its worker."""
        return max(0.0, self.ended - self.started) if self.ended else 0.0

    def to_wire(self) -> list[object]:
        """A compact list for msgpack (the state as its value)."""
        row = [getattr(self, name) for name in _NAMES]  # astuple deep-copies: 15x slower
        row[1] = self.state.value
        return row

    @classmethod
    def from_wire(cls, row: list[object]) -> TaskRecord:
        record = cls(*row)  # type: ignore[arg-type]
        record.state = TaskState(record.state)
        return record

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["state"] = self.state.value
        return out


_NAMES = tuple(f.name for f in fields(TaskRecord))
