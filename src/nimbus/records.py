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
* ``net_bytes_in``/``net_bytes_out``: with ``net_source`` "netns" (a worker in
  a network namespace of its own, ``net_accounting``; see ``nimbus.network``),
  every byte the task's processes moved over IP, C libraries and children
  included, as counted on the worker's link less 66 bytes of Ethernet, IPv4
  and TCP headers a packet (TCP payload; a pure ACK counts 0), less ``net_nimbus_in``/``_out``: the
  payload of nimbus's own connections (the state store) meanwhile, each byte once
  (what they sent again is taken off the task's bytes too). With
  "cgroup" (a worker counted by eBPF on a cgroup of its own, no namespace) the
  same bytes counted at its sockets: IP, TCP and UDP headers taken off exactly,
  and TCP payload once (a segment sent again or received twice is in ``tcp``:
  ``retransmits``, ``duplicates_in``, ``bytes_retransmitted``, the cgroup's
  own). With
  "socket" (``net_accounting=socket``, and ``auto``'s without root): bytes the
  task moved through Python ``socket.socket`` objects (send*, recv*, sendfile)
  while it ran; C libraries and child processes are not counted. Never the
  worker's own channel to the runtime (a Unix socket).
* ``tcp`` ("netns" and "cgroup", when the task moved bytes): ``retransmits`` and
  ``segments_out`` of its namespace during the task; ``connections``,
  ``rtt_ms``, ``min_rtt_ms`` and ``delivery_rate`` (bytes/s) from ``TCP_INFO``
  of the namespace's connections still open at its end, its children's
  included (where the kernel gives the namespace a socket table of its own,
  Linux 6.1+; else the worker process's only).
* ``colocated`` ("netns" and "cgroup"): other tasks running on the host
  (``min``/``mean``/``max`` of samples: one just before the task, and every
  0.25 s while it runs past 2 ms), and the host NIC's ``nic_in``/``nic_out``
  bytes/s over those samples (``nic_utilisation`` where the NIC states its speed).
"""

from __future__ import annotations

import enum
import operator
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
    # -- issue 19 (nimbus.network): where the net bytes come from, and what else was seen
    net_source: str = "socket"
    net_nimbus_in: int = 0
    net_nimbus_out: int = 0
    tcp: dict[str, float] | None = None
    colocated: dict[str, float] | None = None
    build_seconds: float = 0.0

    @property
    def net_throughput_in(self) -> float:
        """Bytes per second the task received, over its run time."""
        return self.net_bytes_in / self.run_seconds if self.run_seconds else 0.0

    @property
    def net_throughput_out(self) -> float:
        """Bytes per second the task sent, over its run time."""
        return self.net_bytes_out / self.run_seconds if self.run_seconds else 0.0

    def network(self) -> dict[str, object]:
        """The network fields beyond the byte counts, as :meth:`add_network` takes them."""
        return {name: getattr(self, name) for name in _NETWORK}

    def add_network(self, extra: dict[str, object]) -> None:
        """The worker's network fields beyond the byte counts (``net_source``, ``tcp``...),
        a dict among them copied (a worker's fields stand for many records: each its own)."""
        for name, value in extra.items():
            if name in _NETWORK_NAMES:
                setattr(self, name, value.copy() if type(value) is dict else value)

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
        row = list(_VALUES(self))  # one C call; astuple deep-copies: 15x slower
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
_VALUES = operator.attrgetter(*_NAMES)  # every field's value, in order (to_wire)
_NETWORK = ("net_source", "net_nimbus_in", "net_nimbus_out", "tcp", "colocated")
_NETWORK_NAMES = frozenset(_NETWORK)
