"""A worker counted by its cgroup: no namespace, no veth, every socket of its processes.

::

    manager:  group = CountedGroup.create(slot)   # <cgroup2>/<its own>/nimbus-<slot>
              argv prefix writes the worker's pid to group.procs (before it runs anything)
    worker:   counting_group() -> the directory   # its own cgroup v2, named nimbus-<slot>
              CgroupCounters.attach(directory)     # eBPF on it (``_bpf``): payload in and out
    manager:  group.close()                        # what is left inside killed, rmdir, slot freed

For workers that need no link of their own (no bandwidth limit: ``tc`` shapes
a device, and only a namespace gives a worker one): ``cgroup_skb`` programs
on the worker's cgroup count the payload of every IP packet of every socket
made inside it, at the socket, children and C libraries included, while the
packet takes the node's own way (``lo`` for 127.0.0.1: no second device, no
route or socket lookup more; ``bench/netvis.py``'s packets row). The
directory is made in the cgroup v2 hierarchy wherever it is mounted (a
hybrid host's ``/sys/fs/cgroup/unified`` too: no controller is needed), under
this process's own cgroup, and named after the worker's slot (``_slots``:
unique on the host, and the worker's cell on the co-location board); the
worker knows it is counted by ``NIMBUS_NET_COUNTED`` in its environment (taken
out at once: its tasks' processes do not inherit it) and its cgroup's name. A dead manager's
directory is found by its slot and removed when the slot is taken over.
"""

from __future__ import annotations

import os
from pathlib import Path

from nimbus.errors import ConfigError
from nimbus.network._cgroup import empty
from nimbus.network._slots import Slot

__all__ = ["COUNTED", "CountedGroup", "can_count", "counting_group", "hierarchy", "named_group"]

PREFIX = "nimbus-"
COUNTED = "NIMBUS_NET_COUNTED"  # set for the worker its manager put in a counting cgroup


def hierarchy() -> Path | None:
    """This process's own cgroup v2 directory (where the v2 hierarchy is mounted), or None."""
    mount = root = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                sep = fields.index("-")
                if fields[sep + 1] == "cgroup2":
                    root, mount = fields[3], fields[4]
                    break
        with open("/proc/self/cgroup") as f:
            own = next((line[3:].strip() for line in f if line.startswith("0::")), None)
    except (OSError, ValueError):
        return None
    if mount is None or root is None or own is None:
        return None
    if root != "/" and (own + "/").startswith(root.rstrip("/") + "/"):
        own = own[len(root.rstrip("/")) :]
    return Path(mount) / own.lstrip("/")


def counting_group() -> tuple[str, int] | None:
    """(directory, slot) of this worker's counting cgroup, if its manager put it in one
    (``COUNTED``, taken out of the environment here: a manager that a task starts, and
    its workers, are in the same cgroup but not counted by it)."""
    if os.environ.pop(COUNTED, None) is None:
        return None
    return named_group()


def named_group() -> tuple[str, int] | None:
    """(directory, slot) of the counting cgroup this process is in (by its name), if any."""
    here = hierarchy()
    if here is None or not here.name.startswith(PREFIX) or not here.name[7:].isdigit():
        return None
    return str(here), int(here.name[7:])


def can_count() -> str | None:
    """None if workers here can be counted by their cgroup; else why not (one line)."""
    parent = hierarchy()
    if parent is None:
        return "no cgroup v2 hierarchy is mounted (see /proc/self/mountinfo)"
    probe = parent / f"{PREFIX}probe-{os.getpid()}"
    try:
        probe.mkdir(exist_ok=True)
    except OSError as exc:
        return f"cannot make a cgroup under {parent} ({exc.strerror})"
    try:
        # (imported only now: a manager without root, auto's usual case, needs no ctypes)
        from nimbus.network._bpf import CgroupCounters

        counters = CgroupCounters.attach(str(probe))
        if counters is None:
            return "eBPF cgroup_skb programs are refused here (CAP_BPF and CAP_NET_ADMIN needed)"
        counters.close()
        return None
    finally:
        empty(probe)


class CountedGroup:
    """One worker's counting cgroup; made by :meth:`create`, gone after :meth:`close`."""

    def __init__(self, slot: Slot, directory: Path) -> None:
        self.slot, self.directory = slot, directory

    @property
    def name(self) -> str:
        return self.directory.name

    @property
    def procs(self) -> str:
        """What the worker's pid is written to (before it runs anything)."""
        return str(self.directory / "cgroup.procs")

    @classmethod
    def create(cls, slot: Slot) -> CountedGroup:
        parent = hierarchy()
        if parent is None:
            raise ConfigError(
                "net_accounting=cgroup: no cgroup v2 hierarchy is mounted here; mount one "
                "(mount -t cgroup2 none /sys/fs/cgroup/unified) or set net_accounting=netns"
            )
        directory = parent / f"{PREFIX}{slot.number}"
        if slot.stale or directory.exists():  # a dead manager's worker: what it left goes
            empty(directory)  # first (a slot freed after a removal that timed out, too)
        try:
            directory.mkdir()
        except OSError as exc:
            slot.free()
            raise ConfigError(
                f"net_accounting=cgroup: cannot make the worker's cgroup {directory} "
                f"({exc.strerror}); run the endpoint as root, or set net_accounting=netns "
                "or socket"
            ) from None
        return cls(slot, directory)

    def close(self) -> None:
        """Kill what is left inside, remove the directory, free the slot."""
        empty(self.directory)
        self.slot.free()
