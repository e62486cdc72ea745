"""Blocks as Slurm batch jobs: a generated script, ``sbatch``, one ``squeue``, ``scancel``.

::

    submit(cmd, N) --> <script_dir>/block-<n>.sh --sbatch --parsable--> job id
        #SBATCH --nodes=N --ntasks-per-node=1 --time=... --partition/account/qos
        export NIMBUS_...           (the block's environment: the agent's address, secret)
        <worker_init>
        srun --nodes=N ... <cmd>    (the launcher: one command per node)
    status([ids])  --> squeue -h --states=all -u <user>   (one call for all blocks)
    cancel([ids])  --> scancel id id ...                  (one call)

The script holds the block's secret, so it is written ``0600`` in a private
directory (``script_dir``, default ``~/.config/nimbus/blocks``: the home
directory is shared with the nodes on a cluster, and Slurm writes each block's
output, ``block-<job>.out``, there from the node) and removed once ``sbatch``
has taken it. Jobs that ``squeue`` no longer lists (older than ``MinJobAge``)
are ``UNKNOWN``. ``calls`` counts the scheduler commands run.
"""

from __future__ import annotations

import getpass
import itertools
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from nimbus.config import config_dir
from nimbus.errors import ProviderError
from nimbus.providers._base import BlockState, BlockStatus, Launcher, SrunLauncher

__all__ = ["SlurmProvider", "walltime_seconds"]

_STATES = {
    "PENDING": BlockState.PENDING,
    "CONFIGURING": BlockState.PENDING,
    "REQUEUED": BlockState.PENDING,
    "RESIZING": BlockState.PENDING,
    "RUNNING": BlockState.RUNNING,
    "COMPLETING": BlockState.RUNNING,
    "SUSPENDED": BlockState.RUNNING,
    "STOPPED": BlockState.RUNNING,
    "COMPLETED": BlockState.COMPLETED,
    "CANCELLED": BlockState.CANCELLED,
    "PREEMPTED": BlockState.CANCELLED,
    "REVOKED": BlockState.CANCELLED,
    "DEADLINE": BlockState.TIMEOUT,
    "TIMEOUT": BlockState.TIMEOUT,
}
_WALLTIME = re.compile(r"^(?:(\d+)-)?(\d+):(\d{1,2}):(\d{1,2})$")
_TIMEOUT = 30.0  # seconds a scheduler command may take


def walltime_seconds(walltime: str) -> int:
    """``[D-]HH:MM:SS`` as seconds; ProviderError naming the setting otherwise."""
    m = _WALLTIME.match(walltime.strip())
    if not m:
        raise ProviderError(
            f"walltime {walltime!r} is not [D-]HH:MM:SS (NIMBUS_WALLTIME), e.g. 00:30:00"
        )
    days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


class SlurmProvider:
    """Blocks of ``nodes_per_block`` nodes as Slurm jobs (see the module docstring)."""

    def __init__(
        self,
        *,
        partition: str | None = None,
        account: str | None = None,
        qos: str | None = None,
        walltime: str = "00:30:00",
        exclusive: bool = False,
        scheduler_options: str = "",
        worker_init: str = "",
        launcher: Launcher | None = None,
        script_dir: Path | None = None,
        **_: object,
    ) -> None:
        self.sbatch = shutil.which("sbatch")
        if self.sbatch is None:
            raise ProviderError(
                "sbatch is not on PATH, and the provider setting is 'slurm' (NIMBUS_PROVIDER, "
                "or --provider): run on a Slurm login node, put Slurm's commands on PATH, "
                "or set provider to 'local'"
            )
        self.partition = partition
        self.account = account
        self.qos = qos
        self.walltime = walltime
        self.walltime_seconds = walltime_seconds(walltime)
        self.exclusive = exclusive
        self.scheduler_options = scheduler_options
        self.worker_init = worker_init
        self.launcher: Launcher = launcher or SrunLauncher()
        self.script_dir = script_dir or config_dir() / "blocks"
        self.script_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.calls = 0  # scheduler commands run
        self._user = getpass.getuser()
        self._ids = itertools.count(1)

    def script(self, command: str, nodes: int, env: Mapping[str, str] | None = None) -> str:
        """The batch script of a block."""
        out = self.script_dir / "block-%j.out"
        lines = [
            "#!/bin/bash",
            "#SBATCH --job-name=nimbus-block",
            f"#SBATCH --nodes={nodes}",
            "#SBATCH --ntasks-per-node=1",
            f"#SBATCH --time={self.walltime}",
            f"#SBATCH --output={out}",
        ]
        for flag, value in (("partition", self.partition), ("account", self.account)):
            if value:
                lines.append(f"#SBATCH --{flag}={value}")
        if self.qos:
            lines.append(f"#SBATCH --qos={self.qos}")
        if self.exclusive:
            lines.append("#SBATCH --exclusive")
        for option in self.scheduler_options.splitlines():
            if option.strip():
                option = option.strip()
                lines.append(option if option.startswith("#SBATCH") else f"#SBATCH {option}")
        lines += [f"export {k}={shlex.quote(v)}" for k, v in (env or {}).items()]
        lines.append('export NIMBUS_BLOCK_ID="$SLURM_JOB_ID"')
        if self.worker_init:
            lines.append(self.worker_init)
        lines.append(self.launcher(command, nodes))
        return "\n".join(lines) + "\n"

    def _run(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        self.calls += 1
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT)
        except FileNotFoundError as exc:
            raise ProviderError(
                f"{cmd[0]} is not on PATH (provider 'slurm', NIMBUS_PROVIDER): put Slurm's "
                f"commands on PATH or set provider to 'local'"
            ) from exc
        except subprocess.TimeoutExpired as exc:
            raise ProviderError(f"{cmd[0]} did not answer within {_TIMEOUT:.0f} s") from exc

    def submit(self, command: str, nodes: int, *, env: Mapping[str, str] | None = None) -> str:
        if nodes < 1:
            raise ProviderError(f"a block needs at least one node, not {nodes} (nodes_per_block)")
        path = self.script_dir / f"block-{os.getpid()}-{next(self._ids)}.sh"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.script(command, nodes, env))
        try:
            done = self._run("sbatch", "--parsable", str(path))
        finally:
            path.unlink(missing_ok=True)  # Slurm keeps its copy; the secret is not left here
        if done.returncode != 0:
            said = " ".join(done.stderr.split()) or f"exit code {done.returncode}"
            raise ProviderError(
                f"Slurm refused the block: {said} (check partition, account, qos, walltime, "
                f"nodes_per_block, scheduler_options)"
            )
        job = done.stdout.strip().split(";")[0]
        if not job.isdigit():
            raise ProviderError(f"sbatch gave no job id: {done.stdout!r} {done.stderr!r}")
        return job

    def status(self, block_ids: Sequence[str]) -> dict[str, BlockStatus]:
        if not block_ids:
            return {}
        done = self._run("squeue", "-h", "--states=all", "-u", self._user, "-o", "%i|%T|%R|%N")
        if done.returncode != 0:
            raise ProviderError(f"squeue failed: {' '.join(done.stderr.split())}")
        known: dict[str, BlockStatus] = {}
        for line in done.stdout.splitlines():
            parts = line.split("|")
            if len(parts) < 4:
                continue
            job, state, reason, nodes = (p.strip() for p in parts[:4])
            state = state.split()[0] if state else ""
            known[job] = BlockStatus(_STATES.get(state, BlockState.FAILED), reason, nodes)
        return {
            b: known.get(b, BlockStatus(BlockState.UNKNOWN, "not in squeue")) for b in block_ids
        }

    def cancel(self, block_ids: Sequence[str]) -> None:
        if not block_ids:
            return
        done = self._run("scancel", *block_ids)
        errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
        # a job that ended since the last status is what cancel wants anyway
        gone = ("already completing or completed", "Invalid job id specified")
        real = [line for line in errors if not any(g in line for g in gone)]
        if done.returncode != 0 and (real or not errors):
            raise ProviderError(f"scancel failed: {' '.join(done.stderr.split())}")
