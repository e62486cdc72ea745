"""Functions and endpoints: register, get, list, delete, share; and ``whoami``."""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse
from pydantic import Base64Bytes, BaseModel, Field, field_validator
from starlette.concurrency import run_in_threadpool

from nimbus.errors import NotFound, PayloadTooLargeError, ServiceError
from nimbus.protocol import FUNCTION_MAX
from nimbus.service.context import AmbiguousName, ServiceContext
from nimbus.service.deps import context, current_user, environment_field
from nimbus.service.registry import Principal

__all__ = ["router"]

router = APIRouter(prefix="/v1")
User = Annotated[Principal, Depends(current_user)]
Ctx = Annotated[ServiceContext, Depends(context)]
Name = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.@-]+$")]


class FunctionIn(BaseModel):
    function: Base64Bytes = Field(description="the pickled function (nimbus.serialization)")
    name: str = Field(default="", max_length=200)
    python: str = Field(pattern=r"^\d+\.\d+$", description="Python minor version, e.g. 3.11")
    serializer: str = Field(min_length=1, max_length=64)
    environment: dict[str, Any] | None = Field(
        default=None,
        description="the environment its tasks run in unless a call gives another "
        "(Environment.to_dict()); null: as registered before, else the workers' own",
    )
    wraps: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="the SHA-256 of the pickle of a function of yours this one wraps: "
        "without environment and a registration of its own, it gets that one's environment",
    )

    @field_validator("environment", mode="before")
    @classmethod
    def _environment(cls, value: object) -> object:
        return environment_field(value)


class EndpointIn(BaseModel):
    name: Name


class ShareIn(BaseModel):
    users: list[Name] = Field(default_factory=list, max_length=1000)
    public: bool | None = None
    remove: list[Name] = Field(
        default_factory=list, max_length=1000, description="users to stop sharing with"
    )


@router.get("/whoami", tags=["auth"])
async def whoami(user: User) -> dict[str, Any]:
    return {"user_id": user.user_id, "name": user.user_name}


# ---------------------------------------------------------------- functions


@router.post("/functions", status_code=201, tags=["functions"])
async def register_function(body: FunctionIn, user: User, ctx: Ctx) -> dict[str, Any]:
    """Register a function (the same bytes again: the same id); 413 over FUNCTION_MAX
    bytes, 429 over the user's NIMBUS_MAX_FUNCTIONS."""
    if len(body.function) > FUNCTION_MAX:
        raise PayloadTooLargeError(
            f"function: its pickled body of {len(body.function)} bytes exceeds the limit of "
            f"{FUNCTION_MAX} bytes (nimbus.protocol.FUNCTION_MAX); pass large data "
            f"as arguments instead of capturing it in the function"
        )
    function_id = await run_in_threadpool(
        partial(
            ctx.registry.add_function,
            limit=ctx.settings.max_functions,
            environment=body.environment,
            wraps=body.wraps,
        ),
        user.user_id,
        body.name,
        body.function,
        body.python,
        body.serializer,
    )
    return {"function_id": function_id}


@router.get("/functions", tags=["functions"])
async def list_functions(user: User, ctx: Ctx) -> dict[str, Any]:
    infos = await run_in_threadpool(ctx.registry.functions, user.user_id)
    return {"functions": [info.as_dict() for info in infos]}


@router.get("/functions/{function_id}", tags=["functions"])
async def get_function(function_id: str, user: User, ctx: Ctx) -> dict[str, Any]:
    return (await ctx.function(user, function_id)).as_dict()


@router.delete("/functions/{function_id}", tags=["functions"])
async def delete_function(function_id: str, user: User, ctx: Ctx) -> dict[str, Any]:
    await ctx.function(user, function_id, own=True)
    await run_in_threadpool(ctx.registry.delete_function, function_id)
    ctx.forget_function(function_id)
    return {"function_id": function_id, "deleted": True}


@router.post("/functions/{function_id}/share", tags=["functions"])
async def share_function(function_id: str, body: ShareIn, user: User, ctx: Ctx) -> dict[str, Any]:
    await ctx.function(user, function_id, own=True)
    await _share(ctx, "function", function_id, body)
    ctx.forget_function(function_id)
    return (await ctx.function(user, function_id)).as_dict()


# ---------------------------------------------------------------- endpoints


@router.post("/endpoints", status_code=201, tags=["endpoints"])
async def register_endpoint(body: EndpointIn, user: User, ctx: Ctx) -> dict[str, Any]:
    """Register endpoint ``name`` (or find yours) and issue its agent a new token; the
    older tokens are revoked and the agents connected with them are closed at once."""
    endpoint_id, created, token = await ctx.new_endpoint_token(user, body.name)
    return {"endpoint_id": endpoint_id, "name": body.name, "token": token, "created": created}


@router.get("/endpoints", tags=["endpoints"])
async def list_endpoints(
    user: User,
    ctx: Ctx,
    name: Annotated[str | None, Query(max_length=200)] = None,
    owner: Annotated[str | None, Query(max_length=200)] = None,
) -> dict[str, Any]:
    """Endpoints you can use (yours first), those called ``name``, those of ``owner``."""
    infos = await run_in_threadpool(ctx.registry.endpoints, user.user_id, name, owner)
    return {"endpoints": [await ctx.endpoint_status(info) for info in infos]}


@router.get(
    "/endpoints/resolve",
    tags=["endpoints"],
    responses={409: {"description": "the name matches several endpoints: detail, choices"}},
)
async def resolve_endpoint(
    user: User, ctx: Ctx, name: Annotated[str, Query(min_length=1, max_length=401)]
) -> Any:
    """The endpoint ``name`` means to you: an id, ``OWNER/NAME``, or a bare name (your
    own endpoint of that name, else the only one of that name you can use). 409 with
    the ``OWNER/NAME`` choices when several match."""
    try:
        info = await ctx.resolve_endpoint(user, name)
    except AmbiguousName as exc:
        return JSONResponse({"detail": str(exc), "choices": exc.choices}, 409)
    return await ctx.endpoint_status(info)


@router.get("/endpoints/{endpoint_id}", tags=["endpoints"])
async def get_endpoint(endpoint_id: str, user: User, ctx: Ctx) -> dict[str, Any]:
    return await ctx.endpoint_status(await ctx.endpoint(user, endpoint_id))


@router.delete("/endpoints/{endpoint_id}", tags=["endpoints"])
async def delete_endpoint(endpoint_id: str, user: User, ctx: Ctx) -> dict[str, Any]:
    """Delete your endpoint: its agents are told and stop, its tasks not yet done fail."""
    await ctx.delete_endpoint(await ctx.endpoint(user, endpoint_id, own=True))
    return {"endpoint_id": endpoint_id, "deleted": True}


@router.post("/endpoints/{endpoint_id}/share", tags=["endpoints"])
async def share_endpoint(endpoint_id: str, body: ShareIn, user: User, ctx: Ctx) -> dict[str, Any]:
    """Share with ``users``, stop sharing with ``remove``, make public or not; the
    tasks not yet done of those who may no longer use it fail (they are told why)."""
    await ctx.endpoint(user, endpoint_id, own=True)
    await _share(ctx, "endpoint", endpoint_id, body)
    ctx.forget_endpoint(endpoint_id)
    info = await ctx.endpoint(user, endpoint_id)
    if body.remove or body.public is False:
        await ctx.withdraw_endpoint(info)
    return await ctx.endpoint_status(info)


async def _share(ctx: ServiceContext, kind: str, resource_id: str, body: ShareIn) -> None:
    both = set(body.users) & set(body.remove)
    if both:
        raise ServiceError(f"users, remove: {', '.join(sorted(both))} in both", 422)
    ids = await run_in_threadpool(ctx.registry.user_ids, [*body.users, *body.remove])
    unknown = sorted({*body.users, *body.remove} - set(ids))
    if unknown:
        raise NotFound(f"users: no such user(s) {', '.join(unknown)}", 404)
    await run_in_threadpool(
        ctx.registry.share,
        kind,
        resource_id,
        [ids[name] for name in body.users],
        body.public,
        [ids[name] for name in body.remove],
    )
