"""Blocks as local process groups: what the embedded runtime has, behind the interface.

Each node of a block is one process group running the command on this machine;
``cancel`` kills the groups. Its ids are ``local-<n>``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence

from nimbus.errors import ProviderError
from nimbus.providers._base import BlockState, BlockStatus

__all__ = ["LocalProvider"]


class LocalProvider:
    """``nodes`` process groups per block, on this machine."""

    def __init__(self, *, worker_init: str = "", **_: object) -> None:
        self.worker_init = worker_init
        self._blocks: dict[str, list[subprocess.Popen[bytes]]] = {}
        self._cancelled: set[str] = set()
        self._ids = itertools.count(1)

    def submit(self, command: str, nodes: int, *, env: Mapping[str, str] | None = None) -> str:
        if nodes < 1:
            raise ProviderError(f"a block needs at least one node, not {nodes}")
        script = f"{self.worker_init}\n{command}" if self.worker_init else command
        block_id = f"local-{next(self._ids)}"
        full_env = {**os.environ, **(env or {}), "NIMBUS_BLOCK_ID": block_id}
        procs = []
        try:
            for i in range(nodes):
                procs.append(
                    subprocess.Popen(
                        ["/bin/sh", "-c", script],
                        env={**full_env, "NIMBUS_NODE": f"{block_id}/{i}"},
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
        except OSError as exc:
            for proc in procs:
                _kill(proc)
            raise ProviderError(f"the local provider could not start /bin/sh: {exc}") from exc
        self._blocks[block_id] = procs
        return block_id

    def status(self, block_ids: Sequence[str]) -> dict[str, BlockStatus]:
        out = {}
        for block_id in block_ids:
            procs = self._blocks.get(block_id)
            if procs is None:
                out[block_id] = BlockStatus(BlockState.UNKNOWN)
                continue
            codes = [p.poll() for p in procs]
            if any(c is None for c in codes):
                out[block_id] = BlockStatus(BlockState.RUNNING, nodes=str(len(procs)))
            elif block_id in self._cancelled:
                out[block_id] = BlockStatus(BlockState.CANCELLED)
            elif all(c == 0 for c in codes):
                out[block_id] = BlockStatus(BlockState.COMPLETED)
            else:
                out[block_id] = BlockStatus(BlockState.FAILED, f"exit codes {codes}")
        return out

    def cancel(self, block_ids: Sequence[str]) -> None:
        for block_id in block_ids:
            self._cancelled.add(block_id)
            for proc in self._blocks.get(block_id, []):
                _kill(proc)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
