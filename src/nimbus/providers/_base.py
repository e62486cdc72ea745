"""The provider interface: where an endpoint's nodes come from.

::

    Provider.submit(command, nodes, env=...) -> block id     (one batch job / process group)
    Provider.status([block id, ...])   -> {block id: BlockStatus}   (ONE scheduler call)
    Provider.cancel([block id, ...])                                 (one scheduler call)

A *block* is the unit a provider grants: ``nodes`` nodes for a while, each
running ``command`` once (a launcher such as ``srun`` starts it on every node
of a multi-node block). The runtime never asks a provider about one block at
a time: ``status`` takes every block it watches, so the scheduler sees one
call per period whatever their number.

A provider for another scheduler (PBS, LSF, Kubernetes) is one small module
with these three methods: ``submit`` renders its job script (``qsub``,
``bsub``, a Pod spec) around the launched command and returns the job id;
``status`` maps one ``qstat -x``/``bjobs``/``list pods`` answer to
:class:`BlockState`; ``cancel`` is ``qdel``/``bkill``/``delete``. Add it to
:data:`nimbus.providers.PROVIDERS`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "BlockState",
    "BlockStatus",
    "Launcher",
    "Provider",
    "SingleNodeLauncher",
    "SrunLauncher",
]


class BlockState(str, enum.Enum):
    PENDING = "pending"  # asked for, not running yet: pending capacity, never lost
    RUNNING = "running"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"
    TIMEOUT = "timeout"  # hit its walltime
    UNKNOWN = "unknown"  # the scheduler no longer knows it

    @property
    def terminal(self) -> bool:
        return self not in (BlockState.PENDING, BlockState.RUNNING)


@dataclass(frozen=True)
class BlockStatus:
    state: BlockState
    message: str = ""  # the scheduler's reason (``Resources``, ``NodeFail``...)
    nodes: str = ""  # where it runs, in the scheduler's notation


class Provider(Protocol):
    """Gives blocks of nodes; see the module docstring."""

    def submit(self, command: str, nodes: int, *, env: Mapping[str, str] | None = None) -> str:
        """Start ``command`` on each of ``nodes`` nodes; the block's id.

        Raises :class:`~nimbus.errors.ProviderError` quoting the scheduler when it refuses.
        """
        ...

    def status(self, block_ids: Sequence[str]) -> dict[str, BlockStatus]:
        """The state of every block in ``block_ids``, from one scheduler call."""
        ...

    def cancel(self, block_ids: Sequence[str]) -> None:
        """Release these blocks (their processes are killed by the scheduler)."""
        ...


class Launcher(Protocol):
    """How a block's command starts on each of its nodes (inside the job)."""

    def __call__(self, command: str, nodes: int) -> str: ...


class SingleNodeLauncher:
    """The command as is: the batch script runs on the block's one node."""

    def __call__(self, command: str, nodes: int) -> str:
        return command


class SrunLauncher:
    """``srun`` the command once on each node of the block."""

    def __init__(self, overrides: str = "") -> None:
        self.overrides = overrides

    def __call__(self, command: str, nodes: int) -> str:
        if nodes == 1:
            return command
        extra = f" {self.overrides}" if self.overrides else ""
        return (
            f"srun --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 "
            f"--kill-on-bad-exit=0{extra} {command}"
        )
