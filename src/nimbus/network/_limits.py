"""Limits of one task: ``ex.options(bandwidth="200Mbit", memory="512M", cpus=0.5)``.

::

    client:  options(...) -> TaskLimits.parse (units checked as the endpoint's worker_*)
             submit(fn)   -> payload (args, kwargs, limits.row())   (fn sent as it is:
                             pickled once, its digest and registration unchanged)
    worker:  apply(limits) sets its link's rates (tc, both ends) and its cgroup's
             cpu/memory -> fn(*args) -> undo(): the worker's own limits back (worker_* or none)

A limit half set (the cgroup's, then its link's failed) is taken back before
the task fails with the error; a limit that cannot be put back is handed to
``failed`` (the worker logs it and retires: no later task inherits it).

The worker sets them on itself, as its task starts, and puts its own back
when the task ends (a task queued behind it is not slowed). Bandwidth needs a
worker in a namespace of its own (``net_accounting`` netns, or a worker bandwidth
limit; as root: cgroup and auto count without one);
CPU and memory a worker cgroup: the endpoint's (``worker_cpus``/``_memory``),
else one the worker makes and joins for the first such task (its manager
removes it with the worker's link; made at every worker's start, a loopback
bulk download lost 29-33 % of the rate without namespaces here, against
11-18 % with the namespace alone as it was then, with DNAT in it). A
task over its memory limit is killed with its worker and fails with
``MemoryLimitExceeded`` naming the limit it had.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

from nimbus.errors import ConfigError

__all__ = ["TaskLimits", "apply"]


@dataclass(frozen=True)
class TaskLimits:
    cpus: float | None = None
    memory: int | None = None  # bytes
    bandwidth: int | None = None  # bits/s, each way

    @classmethod
    def parse(cls, cpus: Any = None, memory: Any = None, bandwidth: Any = None) -> TaskLimits:
        """Checked as ``nimbus endpoint configure --worker-*`` checks them (``500M`` is
        refused for a bandwidth: bits or bytes?); a ConfigError naming the option."""
        from nimbus import config

        out: dict[str, Any] = {}
        for name, value, check in (
            ("cpus", cpus, config.optional_cpus),
            ("memory", memory, config.optional_size),
            ("bandwidth", bandwidth, config.optional_bandwidth),
        ):
            try:
                out[name] = check(value)
            except config.Bad as exc:
                raise ConfigError(f"options({name}={value!r}): expected {exc}") from None
        return cls(**out)

    def __bool__(self) -> bool:
        return self != TaskLimits()

    def row(self) -> tuple[float | None, int | None, int | None]:
        """What a task's payload carries (``TaskLimits(*row)`` where it runs)."""
        return astuple(self)


def _cgroup_dirs() -> dict[str, Path]:
    """This worker's own cgroup directories by controller ("" for v2), if it has them."""
    from nimbus.network._cgroup import ROOT, _unified

    found: dict[str, Path] = {}
    v2 = _unified()  # (a hybrid host's v2 line is a counting cgroup's: no controllers)
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _id, names, path = line.split(":", 2)
        if not Path(path).name.startswith("nimbus-") or (not names and not v2):
            continue
        for ctl in names.split(",") if names else [""]:
            if ctl in ("cpu", "memory", ""):
                found[ctl] = ROOT / ctl / path.lstrip("/") if ctl else ROOT / path.lstrip("/")
    return found


def _own_cgroup() -> dict[str, Path]:
    """Make this worker a cgroup of its own and join it (its manager removes it with the
    worker's link or counting cgroup: it has their name); {} where it has neither."""
    from nimbus.network._cgcount import named_group
    from nimbus.network._cgroup import Cgroup
    from nimbus.network._colocation import slot_of
    from nimbus.network._meter import DEVICE

    try:
        name = f"nimbus-{slot_of(DEVICE)}"
    except OSError:
        group = named_group()
        if group is None:
            return {}
        name = f"nimbus-{group[1]}"
    cgroup = Cgroup(name, None, None, every=True)
    for procs in cgroup.procs_files():
        _write(Path(procs), str(os.getpid()))
    return _cgroup_dirs()


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise ConfigError(f"task limits: cannot write {value} to {path} ({exc})") from None


def _set_cgroup(dirs: dict[str, Path], cpus: float | None, memory: int | None) -> None:
    from nimbus.network._cgroup import PERIOD

    if "" in dirs:  # v2
        d = dirs[""]
        _write(d / "cpu.max", f"{int(cpus * PERIOD) if cpus else 'max'} {PERIOD}")
        _write(d / "memory.max", str(memory) if memory else "max")
        return
    if "cpu" in dirs:
        _write(dirs["cpu"] / "cpu.cfs_quota_us", str(int(cpus * PERIOD)) if cpus else "-1")
    if "memory" in dirs:
        d = dirs["memory"]
        limit, swap = d / "memory.limit_in_bytes", d / "memory.memsw.limit_in_bytes"
        # memory+swap is never below memory: raised first, lowered last
        up = not memory or memory > int(limit.read_text())
        for path in [swap, limit] if up else [limit, swap]:
            if path.exists():
                _write(path, str(memory) if memory else "-1")


def _own_limits() -> tuple[float | None, int | None, int | None]:
    from nimbus.config import Settings

    return (
        Settings.lookup("worker_cpus"),
        Settings.lookup("worker_memory"),
        Settings.lookup("worker_bandwidth"),
    )


def _link() -> Callable[[int | None], None]:
    """What sets this worker's link's rates (both ends); a ConfigError if it has none."""
    from nimbus.network._colocation import slot_of
    from nimbus.network._link import Link
    from nimbus.network._meter import DEVICE
    from nimbus.network._slots import Slot

    try:
        slot = slot_of(DEVICE)
    except OSError:
        raise ConfigError(_no_own("options(bandwidth=...)", "network namespace")) from None
    # the node side of the link is in the namespace of the manager that made it
    node = ("nsenter", f"--net=/proc/{os.getppid()}/ns/net")
    link = Link(Slot(slot, stale=False))
    return lambda rate: link.shape(rate, rate, node=node)


def _no_own(option: str, what: str) -> str:
    """Why a task's ``option`` cannot be applied here, and the endpoint setting that fixes it."""
    from nimbus.config import Settings

    root = "" if os.geteuid() == 0 else "run the endpoint as root and "
    return (
        f"{option}: this worker has no {what} of its own (net_accounting is "
        f"{Settings.lookup('net_accounting')}); {root}give its workers namespaces of their own: "
        "for a local Executor, NIMBUS_NET_ACCOUNTING=netns in its environment (or "
        "Executor(settings=Settings.load().replace(net_accounting='netns'))); for an "
        "endpoint's, `nimbus endpoint configure NAME --net-accounting netns`, then "
        "restart the endpoint"
    )


def _undo(steps: list[Callable[[], None]], failed: Callable[[BaseException], None]) -> None:
    """Run ``steps`` last first, each whatever the others did; a failure to ``failed``."""
    for step in reversed(steps):
        try:
            step()
        except Exception as exc:
            failed(exc)


def apply(limits: TaskLimits, failed: Callable[[BaseException], None]) -> Callable[[], None]:
    """Set ``limits`` on this worker; returns what puts the worker's own back.

    Each change is undone if a later one fails (then the error is raised); a
    change that cannot be undone goes to ``failed``, never in place of the
    task's own result or error."""
    cpus, memory, bandwidth = _own_limits()
    steps: list[Callable[[], None]] = []
    try:
        if limits.cpus is not None or limits.memory is not None:
            dirs = _cgroup_dirs()
            needed = {"cpu"} if limits.cpus is not None else set()
            if limits.memory is not None:
                needed.add("memory")
            if "" not in dirs and not needed <= set(dirs):
                dirs = _own_cgroup()
            if "" not in dirs and not needed <= set(dirs):
                raise ConfigError(_no_own("options(cpus=..., memory=...)", "cgroup"))
            # before the writes: one of several written is put back too
            steps.append(lambda: _set_cgroup(dirs, cpus, memory))
            _set_cgroup(dirs, limits.cpus or cpus, limits.memory or memory)
        if limits.bandwidth is not None:
            shape = _link()
            steps.append(lambda: shape(bandwidth))
            shape(limits.bandwidth)
    except BaseException:
        _undo(steps, failed)
        raise
    return lambda: _undo(steps, failed)
