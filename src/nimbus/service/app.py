"""The service's ASGI app: REST routes, the two WebSockets, errors, body limit.

``create_app(settings, redis_url)`` builds it; its lifespan opens the registry
(``Settings.registry_url``) and the Redis of the task queues, and puts back in
the queues the tasks that were in flight when the service last stopped; it
also sweeps the data store (``nimbus.service.data``, files in
``<runtime_dir>/service/data``) and, every second, looks for tokens revoked in
the registry: they stop working at once and their WebSockets are closed. The OpenAPI spec is at ``GET /openapi.json``.

While the task queues' Redis cannot be reached (``nimbus.service.server``
restarts an embedded one that died), ``GET /v1/health`` and every call that
needs it answer 503 with ``Retry-After``; clients retry. Request heads and
bodies are bounded at the edge (``nimbus.service.limits``: 431, 408).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import redis
import redis.asyncio as aioredis
from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

import nimbus
from nimbus.config import Settings
from nimbus.errors import PayloadTooLargeError, ServiceError
from nimbus.protocol import WS_AGENT, WS_CLIENT, too_large
from nimbus.service import data as data_routes
from nimbus.service import (
    dependencies,
    environments,
    local_history,
    metrics,
    routes,
    stores,
    tasks,
    wakeups,
)
from nimbus.service.context import ServiceContext
from nimbus.service.dashboard import router as dashboard_router
from nimbus.service.data import DataStore
from nimbus.service.flusher import Flusher
from nimbus.service.history import History
from nimbus.service.history_writer import Writer, separate
from nimbus.service.hub import Hub
from nimbus.service.limits import BodyTimeout
from nimbus.service.queues import TaskStore
from nimbus.service.registry import Registry
from nimbus.service.ws import agent_socket, client_socket
from nimbus.statestore import Keys, connect_async

__all__ = ["SERVICE_ID", "create_app"]

SERVICE_ID = "service"  # the Keys program id of the service's keys
QUEUE_RETRY_AFTER = 2  # seconds a client waits before retrying while the queue Redis is away
HEALTH_PING = 2.0  # seconds /v1/health waits for the queue Redis
SWEEP_SECONDS = 30.0
REVOCATION_POLL = 1.0  # seconds between looks for revoked tokens in the registry
REVOCATION_SLACK = 5.0
STOP_WAIT = 10.0  # seconds a stop waits for the background jobs to end once cancelled
log = logging.getLogger(__name__)
QUEUE_UNAVAILABLE = (
    "the service's task queues (Redis) are unavailable, being restarted perhaps; "
    "retry in a few seconds"
)


class BodyLimit:
    """Answer 413, naming the limit, to a request that says its body is too large."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                    detail = str(too_large("request body", int(value), self.limit))
                    await JSONResponse({"detail": detail}, 413)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


async def _every(seconds: float, job: Callable[[], Awaitable[object]], what: str) -> None:
    """Run ``job`` now and every ``seconds`` until cancelled (a failure is logged)."""
    while True:
        try:
            await job()
        except Exception:
            log.exception("%s failed", what)
        await asyncio.sleep(seconds)


class _Revocations:
    """Tokens revoked by `nimbus service token revoke` (another process) take effect here."""

    def __init__(self, ctx: ServiceContext, app_state: Any) -> None:
        self.ctx = ctx
        self.app_state = app_state
        self.since = time.time() - REVOCATION_SLACK
        self.seen: set[str] = set()

    async def __call__(self) -> None:
        rows = await run_in_threadpool(self.ctx.registry.revoked_since, self.since)
        new = {digest for digest, _, _ in rows} - self.seen
        if new:
            self.seen |= new
            await self.ctx.revoked(new)
            users = {user for digest, _, user in rows if digest in new and user}
            if users:  # a user's token may have fetched store URLs: those stop working
                await run_in_threadpool(stores.forget_users, self.app_state, users)
        # a clock's worth of slack: a revocation committed just now may bear an older time
        self.since = max([self.since, *(when - REVOCATION_SLACK for _, when, _ in rows)])


def _renderable(value: Any) -> Any:
    """``value`` with what strict JSON cannot carry (NaN, infinities, lone surrogates,
    bytes, other objects) replaced by its repr."""
    if isinstance(value, dict):
        return {str(_renderable(k)): _renderable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_renderable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return value.encode(errors="backslashreplace").decode()
        return value
    if value is None or isinstance(value, bool | int):
        return value
    return _renderable(repr(value))


def create_app(settings: Settings, redis_url: str) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        registry = await run_in_threadpool(Registry, settings.registry_url)
        client = connect_async(redis_url)
        keys = Keys(SERVICE_ID)
        store = TaskStore(client, keys, result_ttl=settings.result_ttl)
        data = DataStore(client, keys, settings.service_dir / "data", limit=settings.max_payload)
        await store.requeue_all()
        store.history = history = await run_in_threadpool(History, registry.engine)
        app.state.queue_redis = client
        ctx = app.state.ctx = ServiceContext(settings, registry, store, Hub(), data)
        dependencies.held_by(ctx)  # tasks held for their inputs: released, or failed
        keep = settings.history_days * 86400.0 or None
        writer = (  # the SQL writes in a process of their own (history_writer.py says why)
            Writer(settings.registry_url, redis_url, SERVICE_ID, keep).run()
            if separate(settings.registry_url)
            else Flusher(store, history, keep).run()  # (an in-memory registry)
        )
        jobs = [
            asyncio.create_task(writer),
            asyncio.create_task(dependencies.fail_held(ctx)),  # held tasks whose input failed
            # held tasks queued, tasks ended: told by the other service processes
            asyncio.create_task(wakeups.listen(ctx)),
            asyncio.create_task(
                _every(
                    local_history.INGEST_EVERY,
                    lambda: local_history.ingest_and_tell(settings, history, store),
                    "keeping local tasks in the history",
                )
            ),
            asyncio.create_task(_every(SWEEP_SECONDS, data.sweep, "sweeping the data store")),
            asyncio.create_task(
                _every(REVOCATION_POLL, _Revocations(ctx, app.state), "revoking tokens")
            ),
        ]
        try:
            yield
        finally:
            for job in jobs:
                job.cancel()
            # bounded: a job's last commands (the flusher's drain) on a queue Redis that
            # went silent never return; what it did not acknowledge, the next start claims
            ended, late = await asyncio.wait(jobs, timeout=STOP_WAIT)
            for job in ended:  # (their errors were logged where they happened)
                if not job.cancelled():
                    job.exception()
            if late:
                log.warning(
                    "stopping without waiting for %d background job(s) after %s s: the "
                    "queue Redis does not answer (the next start takes up what they left)",
                    len(late),
                    STOP_WAIT,
                )
            await client.aclose()
            registry.close()

    app = FastAPI(
        title="nimbus service",
        version=nimbus.__version__,
        description="Functions as a service on nimbus endpoints.",
        lifespan=lifespan,
    )
    app.include_router(routes.router)
    app.include_router(environments.router)
    app.include_router(tasks.router)
    app.include_router(stores.router)
    app.include_router(data_routes.router)
    app.include_router(metrics.router)
    app.include_router(dashboard_router)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse({"detail": str(exc)}, exc.status or 500, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes the input, and a NaN or a lone surrogate in it
        # cannot be rendered as JSON (a 500): each error keeps only what can be
        return JSONResponse({"detail": [_renderable(error) for error in exc.errors()]}, 422)

    @app.exception_handler(PayloadTooLargeError)
    async def payload_too_large(request: Request, exc: PayloadTooLargeError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, 413)

    @app.exception_handler(redis.ConnectionError)
    @app.exception_handler(redis.TimeoutError)
    async def queue_unavailable(request: Request, exc: Exception) -> JSONResponse:
        # the queue Redis is away (restarting, or loading its file): retryable, no traceback
        return JSONResponse(
            {"detail": QUEUE_UNAVAILABLE},
            503,
            headers={"Retry-After": str(QUEUE_RETRY_AFTER)},
        )

    @app.get(
        "/v1/health",
        tags=["service"],
        responses={503: {"description": "the task queues (Redis) are unavailable"}},
    )
    async def health(request: Request) -> JSONResponse:
        """200 while the service can use its task queues; 503 (Retry-After) while not."""
        body: dict[str, Any] = {"status": "ok", "version": nimbus.__version__}
        client: aioredis.Redis | None = getattr(request.app.state, "queue_redis", None)
        try:
            if client is None:
                raise redis.ConnectionError("not open yet")
            await asyncio.wait_for(client.ping(), HEALTH_PING)
        except (redis.RedisError, OSError, TimeoutError) as exc:
            body |= {"status": "unavailable", "detail": f"{QUEUE_UNAVAILABLE} ({exc})"}
            return JSONResponse(body, 503, headers={"Retry-After": str(QUEUE_RETRY_AFTER)})
        return JSONResponse(body)

    @app.websocket(WS_AGENT)
    async def agent_ws(websocket: WebSocket) -> None:
        await agent_socket(websocket.app.state.ctx, websocket)

    @app.websocket(WS_CLIENT)
    async def client_ws(websocket: WebSocket) -> None:
        await client_socket(websocket.app.state.ctx, websocket)

    app.add_middleware(BodyLimit, limit=settings.max_payload)
    app.add_middleware(BodyTimeout, timeout=settings.body_timeout)
    return app
