"""FastAPI dependencies: the service context and the caller's identity."""

from __future__ import annotations

from typing import Annotated, cast

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from nimbus.errors import ProtocolError
from nimbus.protocol import check_environment
from nimbus.service.context import ServiceContext
from nimbus.service.registry import Principal

__all__ = ["context", "current_principal", "current_user", "environment_field"]

_bearer = HTTPBearer(auto_error=False, description="a token from `nimbus service token create`")


def context(request: Request) -> ServiceContext:
    return cast(ServiceContext, request.app.state.ctx)


async def current_user(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The user a request's bearer token belongs to (401 without one, 403 for an endpoint's)."""
    return await context(request).user(credentials.credentials if credentials else None)


async def current_principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """Whoever a request's bearer token belongs to: a user or an endpoint's agent (401 if none)."""
    return await context(request).principal(credentials.credentials if credentials else None)


def environment_field(value: object) -> object:
    """A request's ``environment`` field checked as the wire checks it (``ValueError``:
    pydantic's 422 naming the field), for every model that takes one."""
    try:
        return check_environment(value, "environment")
    except ProtocolError as exc:
        raise ValueError(str(exc)) from None
