"""Environment orders at the endpoint daemon: the service's :class:`~nimbus.protocol.Order`
carried out on every node, and how each node does in the daemon's beats.

::

    service --Order{ref, build|remove, name, spec}--> daemon: Orders.take
        refused at once (Ordered{status, detail}: nothing is done): no node now, a spec
        that is not one, a name no node holds (404), tasks of it not done (409)
        else runtime.order() --> each manager (this node's; others over their link)
             Ordered{0, nodes asked}
    each beat: Orders.changed() --> Beat.orders [{ref, node, state, message, seconds}]
        (a node's managers merged: failed if one failed, built/removed when all are)

A node that joins after the order (a block that starts later) is not asked: it
builds an environment at its first task, as before.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

from nimbus import environments
from nimbus.endpoint.config import endpoint_dir
from nimbus.environments import Environment
from nimbus.errors import ConfigError, NimbusError
from nimbus.protocol import MAX_ORDERS, Order, Ordered
from nimbus.runtime.agent import Agent

__all__ = ["Orders"]

log = logging.getLogger(__name__)

KEPT = 32  # orders whose rows a daemon keeps saying
DONE = frozenset({"built", "removed", "failed"})


class Orders:
    """The environment orders given to the daemon of endpoint ``endpoint``."""

    def __init__(self, runtime: Agent, endpoint: str) -> None:
        self._runtime = runtime
        self._endpoint = endpoint
        self._here = socket.gethostname()
        self._orders: dict[str, tuple[str, list[Any]]] = {}  # ref -> action, managers asked
        self._lock = threading.Lock()  # take() runs on a thread, rows() on the loop
        self.said: list[dict[str, Any]] = []
        self.finished = False  # an order ended since the last beat: report the environments

    def answer(self, order: Order) -> Ordered:
        """:meth:`take`, or a 500 pointing at this daemon's log (where the traceback
        goes) for a failure no one foresaw: the connection to the service stays."""
        try:
            return self.take(order)
        except Exception as exc:
            log.exception(
                "environment order %s (%s %r) failed", order.ref, order.action, order.name
            )
            return Ordered(
                order.ref,
                500,
                f"endpoint {self._endpoint!r} failed to carry out the order to "
                f"{order.action} {order.name!r} ({type(exc).__name__}: {exc}); see the "
                f"endpoint daemon's log ({endpoint_dir(self._endpoint) / 'agent.log'} where "
                f"it runs); nothing more was done",
            )

    def take(self, order: Order) -> Ordered:
        """Carry out ``order`` on every node, or say why not (nothing done then)."""
        ref, name, where = order.ref, order.name, f"endpoint {self._endpoint!r}"
        env: Environment | None = None
        if order.action == "build":
            try:
                env = Environment.from_dict(dict(order.environment or {}))
            except (ConfigError, ValueError, TypeError) as exc:
                return Ordered(ref, 422, f"environment {name!r}: {exc}")
            if env.plain:
                return Ordered(ref, 422, f"environment {name!r} has nothing to build")
        managers = self._runtime.statistics()["managers"]
        if not managers:
            return Ordered(
                ref,
                409,
                f"{where} has no nodes now (its blocks are starting, or none are running): "
                f"try again when `nimbus endpoints list` shows its workers",
            )
        if order.action == "remove":
            if not self._known(name, managers):
                return Ordered(
                    ref,
                    404,
                    f"no environment named {name!r} on the nodes of {where}: `nimbus "
                    f"environments list --endpoint {self._endpoint}` shows those they hold",
                )
            busy = self._runtime.busy(name)
            if busy:
                said = ", ".join(
                    f"{n} queued" if m == "queued" else f"{n} on {m}" for m, n in busy.items()
                )
                return Ordered(
                    ref,
                    409,
                    f"environment {name!r} is busy on {where} (tasks of it not done: {said}); "
                    f"nothing was removed: remove it when they are done (or cancel them)",
                )
        asked = self._runtime.order(ref, order.action, name, env)
        with self._lock:
            self._orders[ref] = (order.action, asked)
            while len(self._orders) > KEPT:
                del self._orders[next(iter(self._orders))]
        return Ordered(ref, 0, "", sorted({self._node(m) for m in asked}))

    def _known(self, name: str, managers: list[dict[str, Any]]) -> bool:
        """Whether a node holds an environment ``name`` (or key): built, failed or warm."""
        try:
            rows = environments.cache().report()
        except (OSError, NimbusError):
            rows = []
        for manager in managers:
            rows.extend(manager.get("cache") or ())
            for tag, pool in (manager.get("environments") or {}).items():
                rows.append({"name": (pool or {}).get("name", ""), "key": tag.partition("@")[2]})
        return any(
            name == row.get("key") or name in str(row.get("name")).split(",") for row in rows
        )

    def _node(self, manager: Any) -> str:
        return str(getattr(manager, "node", "") or self._here)

    def rows(self) -> list[dict[str, Any]]:
        """One row per order and node: ``{ref, node, state, message, seconds}``; at most
        MAX_ORDERS (a beat's most), those not done first, then the newest."""
        out = []
        with self._lock:
            orders = list(self._orders.items())
        for ref, (action, managers) in orders:
            nodes: dict[str, list[dict[str, Any]]] = {}
            for manager in managers:
                said = manager.orders.get(ref) or {}
                stopped = getattr(manager, "stopped", None)  # this node's manager's loop
                if (
                    said.get("state") not in DONE
                    and isinstance(stopped, threading.Event)
                    and stopped.is_set()  # nothing will say how it went now
                ):
                    said = {
                        "state": "failed",
                        "message": f"the nimbus manager on {self._node(manager)} stopped "
                        "before it said how this went",
                    }
                nodes.setdefault(self._node(manager), []).append(said)
            start = "building" if action == "build" else "removing"
            for node, said in nodes.items():
                states = [str(s.get("state") or start) for s in said]
                failed = [s for s in said if s.get("state") == "failed"]
                if failed:
                    state, message = "failed", str(failed[0].get("message", ""))
                elif all(s in DONE for s in states):
                    state = states[0]
                    message = next((str(s["message"]) for s in said if s.get("message")), "")
                else:
                    state, message = next(s for s in states if s not in DONE), ""
                seconds = max(float(s.get("seconds") or 0.0) for s in said)
                out.append(
                    {
                        "ref": ref,
                        "node": node,
                        "state": state,
                        "message": message[:2000],
                        "seconds": round(seconds, 3),
                    }
                )
        if len(out) > MAX_ORDERS:
            newest = sorted(reversed(out), key=lambda row: row["state"] in DONE)
            out = newest[:MAX_ORDERS]
        return out

    def changed(self) -> list[dict[str, Any]] | None:
        """The rows if they changed since last said (for a beat), else None."""
        rows = self.rows()
        if rows == self.said:
            return None
        before = {(r["ref"], r["node"]): r["state"] for r in self.said}
        if any(
            r["state"] in DONE and before.get((r["ref"], r["node"])) != r["state"] for r in rows
        ):
            self.finished = True
        self.said = rows
        return rows

    @property
    def unfinished(self) -> bool:
        """Some node has not yet said how an order went."""
        return any(row["state"] not in DONE for row in self.rows())
