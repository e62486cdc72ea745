"""A worker's CPU and memory limits: a cgroup of its own (v2 where mounted, else v1).

The cgroup is made under this process's own (so the node's limits still
hold), the worker joins it before it runs anything (the start prefix writes
its pid), and everything the worker starts stays in it. A worker over its
memory limit is killed by the kernel; :meth:`Cgroup.oom_kills` tells the
manager so, and the task fails with ``MemoryLimitExceeded``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from nimbus.errors import ConfigError
from nimbus.network._sys import FIX

__all__ = ["Cgroup"]

ROOT = Path("/sys/fs/cgroup")
PERIOD = 100_000  # µs: the CFS period the CPU quota is a share of


def _own(controller: str) -> str:
    """This process's cgroup path in ``controller``'s hierarchy ('' for v2)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _id, names, path = line.split(":", 2)
        if controller in names.split(","):
            return path
    raise ConfigError(
        f"worker limits: no {controller or 'cgroup2'} hierarchy here; {FIX}"
    ) from None


def _unified() -> bool:
    return (ROOT / "cgroup.controllers").exists()


class Cgroup:
    """One worker's cgroup(s); :meth:`procs_files` are what its pid is written to."""

    def __init__(
        self, name: str, cpus: float | None, memory: int | None, *, every: bool = False
    ) -> None:
        """``every``: the cpu and memory controllers even without a limit (a task's own
        limits are set there while it runs: ``_limits``)."""
        self.cpus, self.memory, self.every = cpus, memory, every
        self.dirs: list[Path] = []
        self.v2 = _unified()
        try:
            if self.v2:
                self._make_v2(name)
            else:
                self._make_v1(name)
        except OSError as exc:
            self.remove()
            raise ConfigError(
                f"worker limits: cannot set up cgroup {name!r} ({exc}); {FIX}"
            ) from None
        except BaseException:
            self.remove()
            raise

    @classmethod
    def existing(cls, name: str) -> Cgroup | None:
        """The cgroup ``name`` under this process's, if a worker made it (``_limits``)."""
        found = cls.__new__(cls)
        found.cpus = found.memory = None
        found.every, found.v2 = True, _unified()
        try:
            if found.v2:
                candidates = [ROOT / _own("").lstrip("/") / name]
            else:
                candidates = [ROOT / c / _own(c).lstrip("/") / name for c in ("cpu", "memory")]
        except ConfigError:
            return None
        found.dirs = [d for d in candidates if d.is_dir()]
        return found if found.dirs else None

    def _mkdir(self, path: Path) -> Path:
        path.mkdir(exist_ok=True)
        self.dirs.append(path)
        return path

    def _make_v2(self, name: str) -> None:
        parent = ROOT / _own("").lstrip("/")
        wanted = {"cpu"} if self.cpus or self.every else set()
        if self.memory or self.every:
            wanted.add("memory")
        offered = set((parent / "cgroup.controllers").read_text().split())
        if wanted - offered:
            raise ConfigError(
                f"worker limits: the cgroup v2 hierarchy at {parent} has no "
                f"{' or '.join(sorted(wanted - offered))} controller (it offers "
                f"{', '.join(sorted(offered)) or 'none'}; a controller mounted as cgroup v1 "
                "is not offered here: see /proc/cgroups); enable it for this cgroup, or "
                "give no CPU or memory limits"
            )
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
        for ctl in wanted - enabled:
            (parent / "cgroup.subtree_control").write_text(f"+{ctl}")
        d = self._mkdir(parent / name)
        if self.cpus:
            (d / "cpu.max").write_text(f"{int(self.cpus * PERIOD)} {PERIOD}")
        if self.memory:
            (d / "memory.max").write_text(str(self.memory))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")

    def _make_v1(self, name: str) -> None:
        if self.cpus or self.every:
            d = self._mkdir(ROOT / "cpu" / _own("cpu").lstrip("/") / name)
            if self.cpus:
                (d / "cpu.cfs_period_us").write_text(str(PERIOD))
                (d / "cpu.cfs_quota_us").write_text(str(int(self.cpus * PERIOD)))
        if self.memory or self.every:
            d = self._mkdir(ROOT / "memory" / _own("memory").lstrip("/") / name)
            if self.memory:
                (d / "memory.limit_in_bytes").write_text(str(self.memory))
                if (d / "memory.memsw.limit_in_bytes").exists():  # no escape into swap
                    (d / "memory.memsw.limit_in_bytes").write_text(str(self.memory))

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def oom_kills(self) -> int:
        """How many processes the kernel killed here for going over the memory limit."""
        name = "memory.events" if self.v2 else "memory.oom_control"
        for d in self.dirs:
            try:
                for line in (d / name).read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
            except OSError:
                continue
        return 0

    def memory_limit(self) -> int | None:
        """The memory limit in force now (a task's own may differ from the worker's)."""
        name = "memory.max" if self.v2 else "memory.limit_in_bytes"
        for d in self.dirs:
            try:
                value = (d / name).read_text().strip()
            except OSError:
                continue
            return int(value) if value.isdigit() and int(value) < 1 << 60 else None
        return None

    def remove(self) -> None:
        """Kill what is left inside (a worker's orphans) and remove the directories."""
        for d in reversed(self.dirs):
            empty(d)
        self.dirs.clear()


def empty(directory: Path) -> None:
    """Kill what is left inside ``directory`` (a worker's orphans) and remove it, with the
    cgroups inside it (a task's own Executor's workers', left when its worker died)."""
    for _ in range(50):
        try:
            pids = [int(p) for p in (directory / "cgroup.procs").read_text().split()]
            inner = [d for d in directory.iterdir() if d.is_dir()]  # (only cgroups here)
        except OSError:
            return  # gone already
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for child in inner:
            empty(child)
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)
