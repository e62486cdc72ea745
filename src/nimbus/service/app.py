"""The service's ASGI app: REST routes, the two WebSockets, errors, body limit.

``create_app(settings, redis_url)`` builds it; its lifespan opens the registry
(``Settings.registry_url``) and the Redis of the task queues, and puts back in
the queues the tasks that were in flight when the service last stopped. The
OpenAPI spec is at ``GET /openapi.json``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

import nimbus
from nimbus.config import Settings
from nimbus.errors import PayloadTooLargeError, ServiceError
from nimbus.keys import Keys
from nimbus.service import routes, stores, tasks
from nimbus.service.context import ServiceContext
from nimbus.service.hub import Hub
from nimbus.service.protocol import WS_AGENT, WS_CLIENT
from nimbus.service.queues import TaskStore
from nimbus.service.registry import Registry
from nimbus.service.ws import agent_socket, client_socket

__all__ = ["SERVICE_ID", "create_app"]

SERVICE_ID = "service"  # the Keys program id of the service's keys


class BodyLimit:
    """Answer 413, naming the limit, to a request that says its body is too large."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                    detail = (
                        f"request body of {int(value)} bytes exceeds the limit of {self.limit} "
                        f"bytes (NIMBUS_MAX_PAYLOAD on the service)"
                    )
                    await JSONResponse({"detail": detail}, 413)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def create_app(settings: Settings, redis_url: str) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        registry = await run_in_threadpool(Registry, settings.registry_url)
        client = aioredis.Redis.from_url(redis_url, driver_info=None)
        store = TaskStore(client, Keys(SERVICE_ID), result_ttl=settings.result_ttl)
        await store.requeue_all()
        app.state.ctx = ServiceContext(settings, registry, store, Hub())
        try:
            yield
        finally:
            await client.aclose()
            registry.close()

    app = FastAPI(
        title="nimbus service",
        version=nimbus.__version__,
        description="Functions as a service on nimbus endpoints.",
        lifespan=lifespan,
    )
    app.include_router(routes.router)
    app.include_router(tasks.router)
    app.include_router(stores.router)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse({"detail": str(exc)}, exc.status or 500, headers=headers)

    @app.exception_handler(PayloadTooLargeError)
    async def too_large(request: Request, exc: PayloadTooLargeError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, 413)

    @app.get("/v1/health", tags=["service"])
    async def health() -> dict[str, Any]:
        return {"status": "ok", "version": nimbus.__version__}

    @app.websocket(WS_AGENT)
    async def agent_ws(websocket: WebSocket) -> None:
        await agent_socket(websocket.app.state.ctx, websocket)

    @app.websocket(WS_CLIENT)
    async def client_ws(websocket: WebSocket) -> None:
        await client_socket(websocket.app.state.ctx, websocket)

    app.add_middleware(BodyLimit, limit=settings.max_payload)
    return app
