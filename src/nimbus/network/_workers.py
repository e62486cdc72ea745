"""The manager's side: give each worker its network and limits, take them back.

::

    manager._spawn:  argv = networks.command(name, argv)   # a prefix: join cgroup, enter netns
    worker dies:     networks.release(name)                 # namespace, veth, cgroup removed
    its task:        networks.lost(name)                    # MemoryLimitExceeded, or None
    manager stops:   networks.close()

The prefix composes with any other (an environment's ``Prepared.command``):
``networks.command(name, prepared.command(argv))``. With ``net_accounting``
``socket`` and no limits it is the identity and costs nothing.

Which context a worker gets (``net_accounting``, and ``worker_bandwidth``):

=============  ==========================  =====================================
 setting        no bandwidth limit          a bandwidth limit
=============  ==========================  =====================================
 socket         none (Python sockets)       a namespace (``tc`` needs its link)
 cgroup         a counting cgroup          a namespace
 netns          a namespace                 a namespace
 auto           cgroup, else socket         a namespace, else a ConfigError
                (what is allowed)
=============  ==========================  =====================================

A counting cgroup (``_cgcount``) counts every byte as a namespace does, at a
fraction of the CPU per packet (no veth: ``bench/netvis.py``'s packets row);
a namespace is what a task's own ``options(bandwidth=...)`` and a TCP summary
of its children's connections need (``netns``).
"""

from __future__ import annotations

import os
import shlex
import threading
from dataclasses import dataclass

from nimbus.config import Settings
from nimbus.errors import ConfigError, MemoryLimitExceeded
from nimbus.network import _sys
from nimbus.network._cgcount import COUNTED, CountedGroup, can_count
from nimbus.network._cgroup import Cgroup
from nimbus.network._colocation import clear, top_of
from nimbus.network._link import Link
from nimbus.network._nic import NicSampler
from nimbus.network._slots import claim, in_use

__all__ = ["Limits", "WorkerNetworks"]


@dataclass(frozen=True)
class Limits:
    """What one worker may use; None: no limit."""

    cpus: float | None = None
    memory: int | None = None
    bandwidth: int | None = None  # bits/s, each way

    @classmethod
    def configured(cls, settings: Settings | None = None) -> Limits:
        """As ``settings`` say (an Executor's), else this process's environment and file."""
        if settings is not None:
            return cls(settings.worker_cpus, settings.worker_memory, settings.worker_bandwidth)
        return cls(
            Settings.lookup("worker_cpus"),
            Settings.lookup("worker_memory"),
            Settings.lookup("worker_bandwidth"),
        )

    def environ(self, accounting: str) -> dict[str, str]:
        """These limits and ``accounting`` as the variables a worker reads (the limits
        it puts back after a task's own are its settings': ``_limits``): those that
        differ from what a worker reads anyway (this process's environment and file; set,
        they would also override the file of a nimbus program a task starts)."""

        def text(value: object, unit: str = "") -> str:
            return "" if value is None else f"{value}{unit}"  # "": no limit

        given = {
            "net_accounting": (accounting, accounting),
            "worker_cpus": (self.cpus, text(self.cpus)),
            "worker_memory": (self.memory, text(self.memory)),
            "worker_bandwidth": (self.bandwidth, text(self.bandwidth, "bit")),
        }
        return {
            Settings.env_var(name): shown
            for name, (value, shown) in given.items()
            if value != Settings.lookup(name)
        }


class _Held:
    __slots__ = ("cgroup", "counted", "link")

    def __init__(
        self, link: Link | None, cgroup: Cgroup | None, counted: CountedGroup | None
    ) -> None:
        self.link, self.cgroup, self.counted = link, cgroup, counted


class WorkerNetworks:
    """Namespaces, links and cgroups of one manager's workers."""

    def __init__(self, accounting: str = "socket", limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        wants_ns = accounting == "netns" or self.limits.bandwidth is not None
        wants_cg = self.limits.cpus is not None or self.limits.memory is not None
        counting = accounting in ("cgroup", "auto") and not wants_ns
        # looked for only when asked for (five PATH searches on every manager's start)
        why = _sys.can_manage() if wants_ns or wants_cg else None
        if why is not None and (wants_ns or wants_cg):
            what = "worker limits" if self.limits != Limits() else f"net_accounting={accounting}"
            raise ConfigError(f"{what}: {why}; {_sys.FIX}")
        self.counted = False  # a counting cgroup a worker (``_cgcount``), no namespace
        if counting:  # (root, a cgroup v2 mount and cgroup_skb programs: tried, not guessed)
            why_not = can_count()
            if why_not is None:
                self.counted = True
            elif accounting == "cgroup":
                raise ConfigError(
                    f"net_accounting=cgroup: {why_not}; run the endpoint as root where cgroup v2 "
                    "is mounted, or set net_accounting=netns (a namespace per worker) or socket"
                )
        # auto never takes a namespace: its workers would reach nothing beyond the node
        # (no forwarding or masquerade is set up: see _link), which they reach with socket
        self.netns = wants_ns
        self.cgroups = wants_cg  # (a task's own limits make one on first use: ``_limits``)
        self._held: dict[str, _Held] = {}
        self._oom: dict[str, int | None] = {}  # worker -> the memory limit it was killed at
        self._lock = threading.Lock()
        self._nic: NicSampler | None = None  # the host NIC for record.colocated, once netns

    @classmethod
    def configured(cls, settings: Settings | None = None) -> WorkerNetworks:
        """As the settings say (``net_accounting``, ``worker_cpus/memory/bandwidth``):
        ``settings`` given (an Executor's), else this process's environment and file."""
        if settings is not None:
            return cls(settings.net_accounting, Limits.configured(settings))
        return cls(Settings.lookup("net_accounting"), Limits.configured())

    @property
    def active(self) -> bool:
        return self.netns or self.cgroups or self.counted

    def command(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` started inside worker ``name``'s cgroup and namespace (made now)."""
        if not self.active:
            return argv
        link: Link | None = None
        cgroup: Cgroup | None = None
        counted: CountedGroup | None = None
        try:
            if self.netns or self.counted:
                slot = claim()  # the lowest free: the co-location cells in use stay few
                top_of(in_use())
                if self.netns:
                    link = Link.create(slot, self.limits.bandwidth)
                else:
                    counted = CountedGroup.create(slot)
                with self._lock:  # (two workers started at once: one sampler)
                    if self._nic is None:
                        self._nic = NicSampler()
            if self.cgroups:
                tag = link.ns if link else counted.name if counted else None
                tag = tag or f"nimbus-{os.getpid()}-{len(self._held)}"
                cgroup = Cgroup(tag, self.limits.cpus, self.limits.memory, every=True)
        except BaseException:
            if link is not None:
                link.close()
            if counted is not None:
                counted.close()
            raise
        with self._lock:
            self._held[name] = _Held(link, cgroup, counted)
        procs = cgroup.procs_files() if cgroup else []
        if counted is not None and counted.procs not in procs:  # (v2: the same directory)
            procs.append(counted.procs)
        script = "".join(f"echo $$ > {shlex.quote(f)} && " for f in procs)
        enter = f'exec nsenter --net={shlex.quote(link.netns_path)} "$@"' if link else 'exec "$@"'
        if counted is not None:  # the worker itself (its children and tasks do not inherit it)
            enter = f"export {COUNTED}=1 && {enter}"
        return ["/bin/sh", "-c", script + enter, "nimbus-worker", *argv]

    def link(self, name: str) -> Link | None:
        held = self._held.get(name)
        return held.link if held else None

    def release(self, name: str) -> None:
        """Worker ``name`` is gone: note a memory kill, remove what it had."""
        with self._lock:
            held = self._held.pop(name, None)
        if held is None:
            return
        owner = held.link or held.counted
        if owner is not None:
            clear(owner.slot.number)  # it may have died mid-task: it runs nothing now
            if held.cgroup is None:  # made by the worker for a task's own limits, if it was
                held.cgroup = Cgroup.existing(f"nimbus-{owner.slot.number}")
        if held.cgroup is not None:
            if held.cgroup.oom_kills():
                self._oom[name] = held.cgroup.memory_limit()
            held.cgroup.remove()
        if owner is not None:
            owner.close()
            top_of(in_use())

    def lost(self, name: str) -> MemoryLimitExceeded | None:
        """Why worker ``name`` (released) died, if it was its memory limit."""
        if name not in self._oom:
            return None
        limit = self._oom.pop(name) or self.limits.memory or 0
        return MemoryLimitExceeded(
            f"the task used more than its memory limit of {limit >> 20} MiB (its "
            f"options(memory=...), else the endpoint's worker_memory) and was killed; raise "
            f"it (e.g. options(memory='{max(2 * limit >> 20, 64)}M') or nimbus endpoint "
            f"configure NAME --worker-memory {max(2 * limit >> 20, 64)}M) or use less memory"
        )

    def close(self) -> None:
        for name in list(self._held):
            self.release(name)
        with self._lock:
            nic, self._nic = self._nic, None
        if nic is not None:
            nic.close()
