"""Every byte a task moves, and what a worker may use: nimbus's network layer.

Two sides (see each module's drawing):

* the manager's, :class:`WorkerNetworks`: each worker gets a network namespace
  joined to the node by a veth pair (``_link``: counters, ``tc`` bandwidth
  limits, the node's loopback kept reachable) and a cgroup (``_cgroup``: CPU and
  memory limits); ``command(name, argv)`` is the start prefix that puts it there;
* the worker's, :class:`TaskNet`: the namespace's counters read at a task's
  start and end (``_meter``), its TCP summary (``_diag``) and co-location.

Why a namespace and not eBPF cgroup counters: the veth is needed anyway for the
bandwidth limits, its counters are exact for everything in the namespace (C
libraries and children included) at the cost of two ``pread`` per task, and it
needs no BPF toolchain. Without root, ``net_accounting=auto`` falls back to the
socket counts of ``nimbus.telemetry`` (``net_source`` says which); asking for
``netns`` or a limit without root is a ``ConfigError`` naming the fix.
"""

from __future__ import annotations

from nimbus.network._link import DEVICE, Link
from nimbus.network._meter import TaskNet, nimbus_port
from nimbus.network._workers import Limits, WorkerNetworks

__all__ = ["DEVICE", "Limits", "Link", "TaskNet", "WorkerNetworks", "nimbus_port"]
