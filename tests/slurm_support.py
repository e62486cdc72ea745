"""A private Slurm cluster on this machine: munged, slurmctld and four slurmd nodes.

::

    tmp/munge/{munge.key, munge.socket}      munged --socket ... --key-file ...
    tmp/slurm.conf                           SLURM_CONF for every slurm command
    tmp/state/                               slurmctld (StateSaveLocation)
    tmp/spool/nX/                            slurmd -N nX (SlurmdSpoolDir)

Every node is ``NodeAddr=127.0.0.1`` with its own port; ``SlurmdParameters=
config_overrides`` lets four slurmd share this machine's cores. No cgroups
(``proctrack/linuxproc``, ``task/none``), no accounting (``squeue`` shows ended jobs
for ``MinJobAge`` seconds). Every daemon is stopped by its pid afterwards.
:func:`wait_for` is how the tests of blocks on it (providers, scaling) wait for a state.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

NODES = ("n1", "n2", "n3", "n4")
CPUS = 4  # per node, as slurm.conf claims (config_overrides: not checked)


def wait_for(check: Callable[[], Any], timeout: float = 30, what: str = "") -> Any:
    """``check()``'s first true value, polled every 0.1 s; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what or check}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def unavailable() -> str | None:
    """Why this machine cannot run the private cluster (None: it can)."""
    if os.geteuid() != 0:
        return "the private Slurm cluster needs root (slurmd runs jobs as their user)"
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch") if not shutil.which(b)]
    if missing:
        return f"{', '.join(missing)} not installed: apt-get install slurm-wlm munge (.ci/run does)"
    return None


class Cluster:
    """munged + slurmctld + slurmd n1..n4 in ``root``; ``env`` points slurm CLIs at it."""

    def __init__(self, root: Path, partition: str = "debug") -> None:
        self.root = root
        self.partition = partition
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.pids: dict[str, int] = {}  # daemons that fork: their pid files
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------ start
    def start(self, timeout: float = 60) -> Cluster:
        try:
            self._munge()
            self._write_conf()
            self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            for node in NODES:
                self._daemon(node, ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
            self.wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _munge(self) -> None:
        d = self.root / "munge"
        d.mkdir(mode=0o700)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        err = open(d / "munged.err", "wb")  # noqa: SIM115 - closed once the child has it
        with err:
            proc = subprocess.Popen(
                [
                    "munged",
                    "--foreground",
                    "--force",
                    f"--socket={self.munge_socket}",
                    f"--key-file={key}",
                    f"--pid-file={d / 'munged.pid'}",
                    f"--log-file={d / 'munged.log'}",
                    f"--seed-file={d / 'munged.seed'}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
            )
        self.procs["munged"] = proc
        deadline = time.monotonic() + 15
        while not self.munge_socket.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self._tail(d / 'munged.log')}")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        r = self.root
        for sub in ("state", "log", *(f"spool/{n}" for n in NODES)):
            (r / sub).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        ports = {n: free_port() for n in NODES}
        nodes = "\n".join(
            f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname={host} Port={ports[n]} "
            f"CPUs={CPUS} RealMemory=1000 State=UNKNOWN"
            for n in NODES
        )
        self.conf.write_text(
            f"""ClusterName=nimbus
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}/%n
SlurmctldPidFile={r / "slurmctld.pid"}
SlurmdPidFile={r / "spool"}/%n/slurmd.pid
SlurmctldLogFile={r / "log" / "slurmctld.log"}
SlurmdLogFile={r / "log"}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
EnforcePartLimits=ALL
MpiDefault=none
MinJobAge=300
SlurmdTimeout=10
SlurmctldTimeout=10
InactiveLimit=0
KillWait=2
SchedulerParameters=sched_interval=1
{nodes}
PartitionName={self.partition} Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _daemon(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 - the child keeps it
        with log:
            self.procs[name] = subprocess.Popen(
                cmd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _tail(self, path: Path, lines: int = 20) -> str:
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return str(exc)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{self._tail(p)}" for p in sorted((self.root / "log").glob("*"))
        )

    # ------------------------------------------------------------ use
    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, check=check, timeout=30
        )

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
        return dict(line.split()[:2] for line in out.splitlines() if line.strip())

    def wait_idle(self, timeout: float = 60, nodes: tuple[str, ...] = NODES) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}\n{self.logs()}")
            states = self.node_states()
            if all(states.get(n, "").rstrip("*") == "idle" for n in nodes):
                return
            time.sleep(0.3)
        raise RuntimeError(f"Slurm nodes not idle after {timeout} s: {states}\n{self.logs()}")

    def kill_slurmd(self, node: str) -> None:
        """Kill a node's slurmd, its jobs' slurmstepd and their processes (a node that died)."""
        jobs = self.run("squeue", "-h", "-w", node, "-o", "%i", check=False).stdout.split()
        proc = self.procs.pop(node)
        proc.kill()
        proc.wait()
        for pid in _stepds(jobs):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for pid in _with_env(f"SLURMD_NODENAME={node}".encode()):
            if _with_conf(pid, self.conf):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)

    def restart_slurmd(self, node: str) -> None:
        self._daemon(node, ["slurmd", "-D", "-N", node, "-f", str(self.conf)])

    # ------------------------------------------------------------ stop
    def stop(self) -> None:
        """Cancel every job, then stop every daemon by its pid (slurmd first)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--user", "root", check=False)
        for name in [*NODES, "slurmctld", "munged"]:
            proc = self.procs.pop(name, None)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        # a slurmstepd (and its job) outlives its slurmd: find them by our SLURM_CONF
        for pid in _with_env(f"SLURM_CONF={self.conf}".encode()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _children_of(pid: int) -> list[int]:
    """Every descendant pid of ``pid`` (through /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _with_env(marker: bytes) -> list[int]:
    """Pids whose environment holds ``marker`` (our SLURM_CONF=...): stepds and jobs."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    out.append(int(entry))
        except OSError:
            continue
    return out


def _with_conf(pid: int, conf: Path) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"SLURM_CONF={conf}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def _stepds(jobs: list[str]) -> list[int]:
    """Pids of the slurmstepd of these jobs (``slurmstepd: [<job>.<step>]``)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if cmd.startswith("slurmstepd") and any(f"[{job}." in cmd for job in jobs):
            out.append(int(entry))
    return out
