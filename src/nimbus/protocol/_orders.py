"""Orders: the service asks an endpoint daemon to build or remove an environment on
every node of its endpoint (``nimbus environments build|remove NAME --endpoint X``).

::

    service -> daemon   Order {ref, action: "build" | "remove", name, environment}
    daemon  -> service  Ordered {ref, status: 0 | HTTP status, detail, nodes}
    daemon  -> service  Beat {..., orders: [{ref, node, state, message, seconds}, ...]}

A daemon says it understands orders in its Hello (``can: ["orders"]``); the service
sends none to a daemon that does not (an older one closes a connection on an op it
does not know). ``Ordered`` answers at once: status 0 and the nodes asked, or why
nothing was done (404: no node holds that name, 409: its workers are busy, 422: the
spec does not build here); each node's progress comes back in the daemon's beats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from nimbus.errors import ProtocolError
from nimbus.protocol._codec import WRONG_SHAPE, brief
from nimbus.protocol._messages import Message
from nimbus.protocol._rows import check_environment

__all__ = ["ACTIONS", "ORDERS", "Order", "Ordered"]

ORDERS = "orders"  # what a daemon that understands them says in its Hello's ``can``
ACTIONS = ("build", "remove")


def _text(field: str, value: object, most: int) -> str:
    if type(value) is not str or len(value) > most:
        raise ProtocolError(
            f"{field}: expected a string of at most {most} characters, got {brief(value)}",
            WRONG_SHAPE,
        )
    return value


@dataclass(frozen=True, slots=True)
class Order(Message):
    """Build ``environment`` (its ``to_dict()``) on every node, or remove every build
    named ``name`` (or whose key it is); ``ref`` names the order in the answers."""

    op: ClassVar[str] = "order"
    ref: str
    action: str
    name: str
    environment: dict[str, Any] | None = None

    def wire(self) -> dict[str, Any]:
        return {
            "op": "order",
            "ref": self.ref,
            "action": self.action,
            "name": self.name,
            "environment": self.environment,
        }

    @classmethod
    def decode(cls, msg: dict[str, Any]) -> Order:
        ref = _text("order.ref", msg.get("ref"), 64)
        action = msg.get("action")
        if action not in ACTIONS:
            raise ProtocolError(
                f"order.action: expected one of {', '.join(ACTIONS)}, got {brief(action)}",
                WRONG_SHAPE,
            )
        name = _text("order.name", msg.get("name"), 200)
        env = check_environment(msg.get("environment"), "order.environment")
        if action == "build" and env is None:
            raise ProtocolError("order.environment: a build needs the spec", WRONG_SHAPE)
        return cls(ref, str(action), name, env)


@dataclass(frozen=True, slots=True)
class Ordered(Message):
    """A daemon's answer to an :class:`Order`: ``status`` 0 and the ``nodes`` it asked,
    or the HTTP status the service answers with and ``detail``, what to do."""

    op: ClassVar[str] = "ordered"
    ref: str
    status: int = 0
    detail: str = ""
    nodes: list[str] = field(default_factory=list)

    def wire(self) -> dict[str, Any]:
        return {
            "op": "ordered",
            "ref": self.ref,
            "status": self.status,
            "detail": self.detail,
            "nodes": self.nodes,
        }

    @classmethod
    def decode(cls, msg: dict[str, Any]) -> Ordered:
        ref = _text("ordered.ref", msg.get("ref"), 64)
        status = msg.get("status")
        if type(status) is not int or not 0 <= status <= 999:
            raise ProtocolError(f"ordered.status: expected 0-999, got {brief(status)}", WRONG_SHAPE)
        detail = _text("ordered.detail", msg.get("detail", ""), 4000)
        nodes = msg.get("nodes", [])
        if type(nodes) is not list or len(nodes) > 10_000:
            raise ProtocolError(f"ordered.nodes: expected a list, got {brief(nodes)}", WRONG_SHAPE)
        return cls(ref, status, detail, [_text("ordered.nodes[]", n, 256) for n in nodes])
