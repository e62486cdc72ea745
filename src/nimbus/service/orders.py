"""Environment orders at the service: sent to an endpoint's agents, followed per node.

::

    POST /v1/endpoints/{id}/environments {action, name, environment}
        place(): every agent of the endpoint must say it knows orders (its Hello's
        ``can``), else 409 naming the upgrade; Order --> each agent; each answers
        (``Ordered``) within ANSWER_SECONDS: refused (its status, its detail: nothing
        was done) or the nodes it asked --> 202 {order_id, nodes}
    Beat.orders --> heard(): each node's state, message, seconds
    GET /v1/endpoints/{id}/environments/{order_id} --> status(): per node, and done
        (every node built, removed or failed); an agent that goes away fails its nodes
        not done yet

Orders live in this process (the one the agents are connected to), at most
:data:`KEPT` of them, each for :data:`KEEP_SECONDS`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from nimbus.errors import NotFound, QuotaExceeded, ServiceError
from nimbus.protocol import ORDERS, Order, Ordered
from nimbus.service.hub import Peer

__all__ = ["ANSWER_SECONDS", "USER_ORDERS", "OrderBook"]

ANSWER_SECONDS = 15.0  # an agent answers an order at once: it only asks its managers
KEPT = 1000
KEEP_SECONDS = 3600.0
USER_ORDERS = 8  # orders of one user not done yet (each node runs a few builds at a time)
DONE = frozenset({"built", "removed", "failed"})


@dataclass
class _Order:
    endpoint_id: str
    user_id: str
    action: str
    name: str
    conns: set[str]
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    created: float = field(default_factory=time.time)


class OrderBook:
    """The orders placed through this service process, and what each agent can do."""

    def __init__(self) -> None:
        self._can: dict[str, frozenset[str]] = {}  # agent connection -> its Hello's can
        self._orders: dict[str, _Order] = {}
        self._answers: dict[tuple[str, str], asyncio.Future[Ordered]] = {}  # (ref, conn)
        self._placing: dict[str, int] = {}  # user -> orders sent, not answered yet

    def joined(self, conn_id: str, can: tuple[str, ...]) -> None:
        self._can[conn_id] = frozenset(can)

    def left(self, conn_id: str) -> None:
        """An agent's connection ended: its unanswered orders and its nodes not done fail."""
        self._can.pop(conn_id, None)
        for (_ref, conn), future in list(self._answers.items()):
            if conn == conn_id and not future.done():
                future.set_exception(
                    ServiceError("the endpoint's agent disconnected before it answered", 503)
                )
        for order in self._orders.values():
            if conn_id in order.conns:
                order.conns.discard(conn_id)
                for row in order.nodes.values():
                    if row["state"] not in DONE:
                        row.update(
                            state="failed",
                            message="the endpoint's agent disconnected before this node said "
                            "how it went: `nimbus environments list --endpoint` shows what the "
                            "node holds once it is back",
                        )

    async def place(
        self,
        endpoint_id: str,
        endpoint: str,
        user_id: str,
        agents: list[Peer],
        order: Order,
    ) -> dict[str, Any]:
        """Send ``order`` to every agent of the endpoint and wait for their answers."""
        old = [peer for peer in agents if ORDERS not in self._can.get(peer.conn_id, ())]
        if old:
            raise ServiceError(
                f"endpoint {endpoint!r} runs an older nimbus that cannot build or remove "
                f"environments on request: upgrade nimbus where it runs and start it again "
                f"(`nimbus endpoint stop {endpoint}; nimbus endpoint start {endpoint}`); "
                f"meanwhile its nodes build an environment at its first task",
                409,
            )
        self._trim()
        mine = [
            o
            for o in self._orders.values()
            if o.user_id == user_id and not all(r["state"] in DONE for r in o.nodes.values())
        ]
        if len(mine) + self._placing.get(user_id, 0) >= USER_ORDERS:
            raise QuotaExceeded(
                f"you have {len(mine) + self._placing.get(user_id, 0)} environment orders not done yet (at most {USER_ORDERS} "
                f"at a time): wait for them (`nimbus environments build|remove` waits for its "
                f"order), then ask again; nothing was done",
                429,
            )
        ref = order.ref
        loop = asyncio.get_running_loop()
        futures = {}
        for peer in agents:
            futures[peer.conn_id] = self._answers[ref, peer.conn_id] = loop.create_future()
        self._placing[user_id] = self._placing.get(user_id, 0) + 1
        try:
            for peer in agents:
                await peer.send(order.encode())
            _, waiting = await asyncio.wait(futures.values(), timeout=ANSWER_SECONDS)
        finally:
            for conn_id in futures:
                self._answers.pop((ref, conn_id), None)
            if self._placing[user_id] > 1:
                self._placing[user_id] -= 1
            else:
                del self._placing[user_id]
        if waiting:
            raise ServiceError(
                f"endpoint {endpoint!r} did not answer within {ANSWER_SECONDS:.0f} s (its agent "
                f"may be overloaded, or its connection broken); try again",
                504,
            )
        answers = [future.result() for future in futures.values()]  # raises a disconnect
        refused = [a for a in answers if a.status]
        if refused:
            raise ServiceError(refused[0].detail, refused[0].status)
        start = "building" if order.action == "build" else "removing"
        placed = _Order(endpoint_id, user_id, order.action, order.name, set(futures))
        for answer in answers:
            for node in answer.nodes:
                placed.nodes[node] = {"node": node, "state": start, "message": "", "seconds": 0.0}
        self._orders[ref] = placed
        return self._view(ref, placed)

    def answered(self, conn_id: str, answer: Ordered) -> None:
        future = self._answers.get((answer.ref, conn_id))
        if future is not None and not future.done():
            future.set_result(answer)

    def heard(self, endpoint_id: str, rows: list[dict[str, Any]]) -> None:
        """A beat's ``orders`` rows: each node's progress."""
        for row in rows:
            order = self._orders.get(str(row.get("ref")))
            if order is None or order.endpoint_id != endpoint_id:
                continue
            node = str(row.get("node", "?"))
            order.nodes[node] = {
                "node": node,
                "state": str(row.get("state", "")),
                "message": str(row.get("message") or ""),
                "seconds": float(row.get("seconds") or 0.0),
            }

    def status(self, endpoint_id: str, user_id: str, order_id: str) -> dict[str, Any]:
        order = self._orders.get(order_id)
        if order is None or order.endpoint_id != endpoint_id or order.user_id != user_id:
            raise NotFound(
                f"environment order {order_id} not found (orders are kept for "
                f"{KEEP_SECONDS / 60:.0f} minutes by the service process the endpoint's agent "
                f"is connected to: with several processes behind one address, ask again, "
                f"another attempt may reach that one)",
                404,
            )
        return self._view(order_id, order)

    @staticmethod
    def _view(order_id: str, order: _Order) -> dict[str, Any]:
        nodes = [dict(row) for _, row in sorted(order.nodes.items())]
        return {
            "order_id": order_id,
            "action": order.action,
            "name": order.name,
            "nodes": nodes,
            "done": all(row["state"] in DONE for row in nodes),
        }

    def _trim(self) -> None:
        old = time.time() - KEEP_SECONDS
        for ref in [r for r, o in self._orders.items() if o.created < old]:
            del self._orders[ref]
        while len(self._orders) >= KEPT:
            del self._orders[next(iter(self._orders))]


def new_order_id() -> str:
    return uuid.uuid4().hex
