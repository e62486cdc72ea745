"""A worker's measurement of its tasks: what the worker calls around each one.

::

    started = gauge.begin()            # before the task: CPU, memory mark, co-location mark
    record = gauge.end(started)        # after it: the record's measured fields (see below)
    gauge.sample()                     # while it runs long: co-location (another thread)

``record`` is ``(started, ended, cpu_user, cpu_system, peak_memory, net_in,
net_out)`` and, in a worker namespace (:class:`TaskNet`), a dict of the other
network fields (``net_source``, ``tcp``, ``colocated``, ``net_nimbus_*``), or None
where they are those of the last record sent (the usual case: tasks back to back
that moved nothing; the manager keeps the last, ``Worker.net``), which costs
the wire ~4 us a task (pack + unpack of the dict).
Without a namespace the bytes are the socket counts of
:class:`nimbus.telemetry.TaskMeter`.
"""

from __future__ import annotations

from typing import Any

from nimbus.network._meter import TaskNet
from nimbus.telemetry import TaskMeter

__all__ = ["SKIPPED", "TaskGauge"]

SKIPPED: tuple[Any, ...] = (0.0, 0.0, 0.0, 0.0, 0, 0, 0)  # the record of a task never run


class TaskGauge:
    def __init__(self) -> None:
        self.meter = TaskMeter()
        self.net = TaskNet.here()  # a namespace of its own: every byte counted
        self._sent: dict[str, Any] | None = None  # the network fields last sent in full

    def begin(self) -> float:
        """Start measuring a task; its wall-clock start."""
        started = self.meter.begin()
        if self.net is not None:
            self.net.begin(started)
        return started

    def end(self, started: float) -> tuple[Any, ...]:
        """The measured fields of the task begun at ``started``."""
        measured = self.meter.end()
        if self.net is None:
            return (started, *measured)
        net_in, net_out, extra = self.net.end(measured[0])
        if extra is self._sent:  # unchanged since the last task's: the manager has them
            return (started, *measured[:4], net_in, net_out, None)
        self._sent = extra
        return (started, *measured[:4], net_in, net_out, extra)

    def sample(self) -> None:
        """The task runs long (the flusher thread looks): a co-location sample."""
        if self.net is not None:
            self.net.sample()
