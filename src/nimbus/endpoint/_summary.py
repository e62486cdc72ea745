"""What a daemon's heartbeat says of its runtime: blocks, managers, workers busy and idle.

::

    Scaler.statistics()["blocks"]   -> {kind: "block", id, state, nodes, managers, busy,
                                        walltime_left, message}
    Agent.statistics()["managers"]  -> {kind: "manager", name, node, block, workers, busy,
                                        accepting}
      a local manager's environments -> {kind: "workers", manager, environment, workers,
                                        busy, idle}  (one row per environment)
      a manager on another node     -> one "workers" row, environment "" (it reports
                                        its size and the tasks it holds, not per environment)

Maps of scalars only (``Beat.runtime``), at most ``MAX_RUNTIME`` rows; the service
keeps the last one it heard for the dashboard's endpoint page.
"""

from __future__ import annotations

import socket
from typing import Any

from nimbus.environments import pools
from nimbus.protocol import MAX_RUNTIME

__all__ = ["runtime_rows"]


def _manager_rows(manager: dict[str, Any]) -> list[dict[str, Any]]:
    name = str(manager.get("name", ""))
    node = str(manager.get("node") or socket.gethostname())  # none said: this process's
    workers = int(manager.get("workers") or 0)  # None from an old remote manager: 0
    if isinstance(manager.get("environments"), dict):  # in this process: per environment
        ready = [pool for pool in pools(manager) if pool["workers"]]
        rows = [
            {
                "kind": "workers",
                "manager": name,
                "environment": pool["name"],
                "workers": pool["workers"],
                "busy": max(0, pool["workers"] - pool["free"]),
                "idle": min(pool["free"], pool["workers"]),
            }
            for pool in ready
        ]
        busy_total = sum(row["busy"] for row in rows)
    else:  # on another node: its size, and how many of its workers the tasks it holds fill
        busy_total = min(workers, int(manager.get("inflight") or 0))
        rows = [
            {
                "kind": "workers",
                "manager": name,
                "environment": "",
                "workers": workers,
                "busy": busy_total,
                "idle": workers - busy_total,
            }
        ]
    head = {
        "kind": "manager",
        "name": name,
        "node": node,
        "block": str(manager.get("block", "")),
        "workers": workers,
        "busy": busy_total,
        "accepting": bool(manager.get("accepting", True)),
    }
    return [head, *rows]


def runtime_rows(agent: dict[str, Any], scaler: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The rows of ``Beat.runtime`` from an agent's and a scaler's ``statistics()``."""
    rows: list[dict[str, Any]] = []
    for block in (scaler or {}).get("blocks", []):
        rows.append(
            {
                "kind": "block",
                "id": str(block.get("id", "")),
                "state": str(block.get("state", "")),
                "nodes": int(block.get("nodes", 0)),
                "managers": int(block.get("managers", 0)),
                "busy": int(block.get("busy", 0)),
                "walltime_left": block.get("walltime_left"),
                "message": str(block.get("message", ""))[:200],
            }
        )
    for manager in agent.get("managers", []):
        rows.extend(_manager_rows(manager))
    return rows[:MAX_RUNTIME]
