"""What the nodes of an endpoint hold: one row per node and environment.

::

    Manager.statistics()["environments"]  {tag: {name, slots, workers, free}}  warm workers
    Cache.report()                        [{key, name, state, size, last_use, ...}]  built here
        local managers: the daemon's node and its cache;  remote managers (blocks,
        ``nimbus manager``): their heartbeats carry both (``RemoteManager.statistics()``)
                                 |
                       held(managers, here, local) --> rows for ``nimbus environments list
                                                       --endpoint`` (a daemon's Beat)

A row is ``{node, name, key, state, workers, free, slots, size, last_use,
build_seconds, message}`` of scalars: ``state`` is ``warm`` while the node has
ready workers of the environment, else its build state there (``built``,
``building``, ``failed``); ``workers``/``free``/``slots`` sum the node's managers.
The node's own Python has ``key`` "" and name ``plain``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["cause", "held", "pools"]


def pools(manager: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A manager's worker pools, one per environment (``statistics()["environments"]``):
    ``{tag, name, workers, free, slots}`` with ints, a missing or unreadable count (a
    remote manager's heartbeat may carry None) as 0; [] if it says none."""
    envs = manager.get("environments")
    if not isinstance(envs, Mapping):
        return []
    return [
        {
            "tag": str(tag),
            "name": str(env.get("name") or "plain"),
            "workers": _count(env.get("workers")),
            "free": _count(env.get("free")),
            "slots": _count(env.get("slots")),
        }
        for tag, env in envs.items()
        if isinstance(env, Mapping)
    ]


def _count(value: Any) -> int:
    try:
        return max(0, int(value))
    except (TypeError, ValueError, OverflowError):
        return 0


def held(
    managers: Iterable[Mapping[str, Any]], here: str, local: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Rows per node and environment from the managers' statistics (a remote one has
    ``node`` and its node's ``cache`` rows; a local one is on ``here``, whose cache
    rows are ``local``), warm ones first."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    caches: dict[str, list[dict[str, Any]]] = {here: local}
    for manager in managers:
        node = str(manager.get("node") or here)
        if manager.get("cache") is not None:
            caches.setdefault(node, list(manager["cache"]))
        for pool in pools(manager):
            workers, slots = pool["workers"], pool["slots"]
            if not workers and not slots:
                continue
            key = pool["tag"].partition("@")[2]
            row = rows.setdefault(
                (node, key), {"node": node, "name": pool["name"], "key": key, "state": ""}
            )
            row["workers"] = row.get("workers", 0) + workers
            row["free"] = row.get("free", 0) + pool["free"]
            row["slots"] = row.get("slots", 0) + slots
            if workers:
                row["state"] = "warm"
    for node, entries in caches.items():
        for entry in entries:
            key = str(entry.get("key", ""))
            row = rows.setdefault((node, key), {"node": node, "key": key, "workers": 0, "free": 0})
            for field in ("name", "size", "last_use", "build_seconds", "message"):
                if field in entry and (field != "name" or "name" not in row):
                    row[field] = entry[field]
            if row.get("state") != "warm":
                row["state"] = str(entry.get("state", ""))
    for row in rows.values():
        row["state"] = row["state"] or "starting"  # slots given, no worker ready yet
    return sorted(rows.values(), key=lambda r: (r["state"] != "warm", r["node"], r["name"]))


_DECORATION = " \t\u00d7\u2570\u2500\u25b6\u2502\u2503"  # the marks of uv's error tree


def cause(message: str, width: int = 300) -> str:
    """A failed build's message in one line: what failed and the builder's cause (uv's
    ``cause:`` line, else its first ``error`` line, else its first line), not the
    header alone ("uv failed (exit 1) installing X:")."""
    lines = [line.strip(_DECORATION) for line in message.splitlines()]
    head, said = lines[0].rstrip(":"), [line for line in lines[1:] if line]
    if not said:
        return head[:width]
    why = next((line for line in said if line.lower().startswith("cause:")), None) or next(
        (line for line in said if "error" in line.lower()), said[0]
    )
    if why.lower().startswith(("cause:", "error:")):
        why = why.split(":", 1)[1].strip()
    return f"{head}: {why}"[:width]
