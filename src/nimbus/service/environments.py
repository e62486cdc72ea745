"""``/v1/endpoints/{id}/environments``: build or remove an environment on every node of an
endpoint (``nimbus environments build|remove NAME --endpoint X``), and follow it.

Whoever may use the endpoint may order a build (as for its tasks), at most
:data:`~nimbus.service.orders.USER_ORDERS` orders of theirs not done at a time; only
its owner may order a removal. The endpoint must be online, its agent new enough to
know orders, and the agent refuses what it cannot do before doing any of it (see
``nimbus.service.orders``); each node runs a few ordered builds at a time, the others
wait their turn there.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field, field_validator

from nimbus.errors import AuthError, ServiceError
from nimbus.protocol import Order
from nimbus.service.context import ServiceContext
from nimbus.service.deps import context, current_user, environment_field
from nimbus.service.orders import new_order_id
from nimbus.service.registry import Principal
from nimbus.service.ws import BEAT_SAVE_SECONDS

__all__ = ["router"]

# an agent whose heartbeat another process saved this recently is connected there
ELSEWHERE_SECONDS = 2 * BEAT_SAVE_SECONDS + 5.0

router = APIRouter(prefix="/v1")
User = Annotated[Principal, Depends(current_user)]
Ctx = Annotated[ServiceContext, Depends(context)]


class OrderIn(BaseModel):
    action: Literal["build", "remove"]
    name: str = Field(min_length=1, max_length=200, description="the environment's name (or key)")
    environment: dict[str, Any] | None = Field(
        default=None, description="build: the spec (Environment.to_dict()), required"
    )

    @field_validator("environment", mode="before")
    @classmethod
    def _environment(cls, value: object) -> object:
        return environment_field(value)


@router.post(
    "/endpoints/{endpoint_id}/environments",
    status_code=202,
    tags=["endpoints"],
    responses={
        403: {"description": "remove: the endpoint is not yours"},
        404: {"description": "no such endpoint you may use, or (remove) no node holds the name"},
        409: {"description": "the endpoint is offline, too old, has no nodes, or (remove) busy"},
        429: {"description": "you have USER_ORDERS orders not done yet"},
        504: {"description": "its agent did not answer in time"},
    },
)
async def order_environment(endpoint_id: str, body: OrderIn, user: User, ctx: Ctx) -> Any:
    """Build (or remove) an environment on every node of the endpoint now: 202 with the
    order's id and the nodes asked; 409 when the endpoint is offline, its agent too old,
    or the environment busy (remove); 404 when no node holds the name (remove)."""
    info = await ctx.endpoint(user, endpoint_id)
    if body.action == "build" and body.environment is None:
        raise ServiceError("environment: a build needs the spec (Environment.to_dict())", 422)
    if body.action == "remove" and info.owner_id != user.user_id:
        raise AuthError(
            f"endpoint {info.name!r} belongs to {info.owner}: only they may remove "
            f"environments from its nodes (you may build one there); nothing was done",
            403,
        )
    agents = [
        peer
        for conn_id in list(ctx.hub.endpoint_agents.get(info.id, ()))
        if (peer := ctx.hub.agents.get(conn_id)) is not None and not peer.closed
    ]
    if not agents:
        status = await ctx.store.status(info.id)
        beat = float(status.get("last_heartbeat", 0.0) or 0.0)
        if time.time() - beat < ELSEWHERE_SECONDS and beat > ctx.hub.beats.get(info.id, 0.0):
            raise ServiceError(
                f"endpoint {info.name!r} is online, but its agent is connected to another "
                f"process of this service (its heartbeat reached that one "
                f"{max(0.0, time.time() - beat):.0f} s ago), and an order goes through that "
                f"process only: ask again (behind a load balancer another attempt may reach "
                f"it), or set NIMBUS_SERVICE_URL to the address the endpoint connects to; "
                f"nothing was done",
                409,
            )
        raise ServiceError(
            f"endpoint {info.name!r} is offline: start it where it is configured (`nimbus "
            f"endpoint start {info.name}`), then ask again; nothing was done",
            409,
        )
    order = Order(new_order_id(), body.action, body.name, body.environment)
    return await ctx.orders.place(info.id, info.name, user.user_id, agents, order)


@router.get("/endpoints/{endpoint_id}/environments/{order_id}", tags=["endpoints"])
async def environment_order(endpoint_id: str, order_id: str, user: User, ctx: Ctx) -> Any:
    """How each node does with your order: ``{order_id, action, name, nodes:
    [{node, state, message, seconds}], done}``."""
    info = await ctx.endpoint(user, endpoint_id)
    return ctx.orders.status(info.id, user.user_id, order_id)
