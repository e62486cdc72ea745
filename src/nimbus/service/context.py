"""What every route and connection of the service shares: registry, queues, hub, auth.

Access rules live here, not in the routes: a function or endpoint is visible
to its owner, to the users it is shared with, and to everyone when public;
only the owner may delete or share it; a task is visible only to the user who
submitted it, and may be cancelled by them or by the owner of the endpoint it
was queued on (whoever shares an endpoint, its owner can clear its queue). Something a user may not see is "not found" (404); something
seen but not theirs to change is "forbidden" (403).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.concurrency import run_in_threadpool

from nimbus.config import Settings
from nimbus.errors import AuthError, NotFound, ServiceError
from nimbus.service.hub import Hub
from nimbus.service.queues import TaskStore
from nimbus.service.registry import EndpointInfo, FunctionInfo, Principal, Registry, hash_token

if TYPE_CHECKING:
    from nimbus.service.data import DataStore  # its routes need this module

__all__ = ["ServiceContext"]

TOKEN_CACHE_SECONDS = 10.0
CACHE_SECONDS = 2.0  # how long a change of sharing may take to reach a busy submitter


@dataclass
class ServiceContext:
    settings: Settings
    registry: Registry
    store: TaskStore
    hub: Hub
    data: DataStore

    def __post_init__(self) -> None:
        self._principals: dict[str, tuple[Principal | None, float]] = {}
        self._functions: dict[str, FunctionInfo] = {}
        self._bodies: dict[str, bytes] = {}
        self._endpoints: dict[str, tuple[EndpointInfo, float]] = {}
        self.versions: dict[str, tuple[str, str]] = {}  # endpoint id -> python, serializer

    # ------------------------------------------------------------ auth

    async def principal(self, token: str | None) -> Principal:
        """The owner of a bearer token; AuthError (401) when missing or unknown."""
        if not token:
            raise AuthError("missing bearer token: send 'Authorization: Bearer <token>'", 401)
        digest = hash_token(token)
        now = time.monotonic()
        cached = self._principals.get(digest)
        if cached is None or cached[1] < now:
            principal = await run_in_threadpool(self.registry.principal, token)
            cached = (principal, now + TOKEN_CACHE_SECONDS)
            if len(self._principals) > 10_000:
                self._principals.clear()
            self._principals[digest] = cached
        if cached[0] is None:
            raise AuthError("invalid token: ask the service admin for one", 401)
        return cached[0]

    async def revoked(self, digests: set[str]) -> None:
        """Tokens were revoked: forget them and close the connections made with them."""
        for digest in digests:
            self._principals.pop(digest, None)
        await self.hub.revoked(digests)

    async def user(self, token: str | None) -> Principal:
        """A user's principal; an endpoint's credential is refused (403)."""
        principal = await self.principal(token)
        if principal.endpoint_id is not None:
            raise AuthError(
                "this is an endpoint's token: it can only pull its own tasks and push "
                "their results; use a user token",
                403,
            )
        return principal

    # ------------------------------------------------------------ functions

    async def function(
        self, user: Principal, function_id: str, *, own: bool = False
    ) -> FunctionInfo:
        info = self._functions.get(function_id)
        if info is None:
            info = await run_in_threadpool(self.registry.function, function_id)
            if info is None:
                raise NotFound(f"function {function_id} not found", 404)
            self._functions[function_id] = info
        self._check(user, "function", function_id, info, own)
        return info

    def forget_function(self, function_id: str) -> None:
        self._functions.pop(function_id, None)
        self._bodies.pop(function_id, None)

    def forget_endpoint(self, endpoint_id: str) -> None:
        self._endpoints.pop(endpoint_id, None)

    async def function_body(self, function_id: str) -> bytes:
        body = self._bodies.get(function_id)
        if body is None:
            body = await run_in_threadpool(self.registry.function_body, function_id)
            if body is None:
                raise NotFound(f"function {function_id} not found", 404)
            self._bodies[function_id] = body
        return body

    # ------------------------------------------------------------ endpoints

    async def endpoint(
        self, user: Principal, endpoint_id: str, *, own: bool = False, cached: bool = False
    ) -> EndpointInfo:
        now = time.monotonic()
        hit = self._endpoints.get(endpoint_id) if cached else None
        if hit is not None and hit[1] > now:
            info: EndpointInfo | None = hit[0]
        else:
            info = await run_in_threadpool(self.registry.endpoint, endpoint_id)
            if info is not None:
                self._endpoints[endpoint_id] = (info, now + CACHE_SECONDS)
        if info is None:
            raise NotFound(f"endpoint {endpoint_id} not found", 404)
        self._check(user, "endpoint", endpoint_id, info, own)
        return info

    async def endpoint_status(self, info: EndpointInfo) -> dict[str, object]:
        status = await self.store.status(info.id)
        online = self.hub.online(info.id)
        return {
            **info.as_dict(),
            "online": online > 0,
            "agents": online,
            "workers": int(status.get("workers", 0)) if online else 0,
            "python": status.get("python", ""),
            "serializer": status.get("serializer", ""),
            "last_heartbeat": max(
                float(status.get("last_heartbeat", 0.0)), self.hub.beats.get(info.id, 0.0)
            ),
            "queued": await self.store.queue_length(info.id),
        }

    async def check_versions(self, fn: FunctionInfo, endpoint: EndpointInfo) -> None:
        """Refuse (409) a function pickled by another Python or serializer than the endpoint's."""
        versions = self.versions.get(endpoint.id)
        if versions is None:
            status = await self.store.status(endpoint.id)
            versions = (status.get("python", ""), status.get("serializer", ""))
            if versions[0]:
                self.versions[endpoint.id] = versions
        python, serializer = versions
        if not python:
            return  # never connected yet: its agent checks when it starts
        if python != fn.python or serializer != fn.serializer:
            raise ServiceError(
                f"version mismatch: function {fn.name!r} ({fn.id}) was registered from "
                f"Python {fn.python} with serializer {fn.serializer}, but endpoint "
                f"{endpoint.name!r} runs Python {python} with serializer {serializer}; "
                f"register the function from the same Python minor version as the endpoint",
                409,
            )

    # ------------------------------------------------------------ tasks

    async def task(self, user: Principal, task_id: str) -> dict[str, object]:
        [info] = await self.store.info([task_id])
        if info is None or info["owner"] != user.user_id:
            raise NotFound(f"task {task_id} not found", 404)
        return info

    async def may_cancel(self, user: Principal, info: dict[str, object]) -> bool:
        """Whether ``user`` may cancel this task: they submitted it, or own its endpoint."""
        if info["owner"] == user.user_id:
            return True
        endpoint_id = str(info["endpoint"])
        hit = self._endpoints.get(endpoint_id)
        if hit is not None and hit[1] > time.monotonic():
            endpoint: EndpointInfo | None = hit[0]
        else:
            endpoint = await run_in_threadpool(self.registry.endpoint, endpoint_id)
        return endpoint is not None and endpoint.owner_id == user.user_id

    async def cancellable_task(self, user: Principal, task_id: str) -> dict[str, object]:
        """A task ``user`` may cancel (:meth:`may_cancel`); NotFound (404) otherwise."""
        [info] = await self.store.info([task_id])
        if info is None or not await self.may_cancel(user, info):
            raise NotFound(f"task {task_id} not found", 404)
        return info

    @staticmethod
    def _check(
        user: Principal,
        kind: str,
        resource_id: str,
        info: FunctionInfo | EndpointInfo,
        own: bool,
    ) -> None:
        if info.owner_id == user.user_id:
            return
        visible = info.public or user.user_name in info.shared_with
        if not visible:
            raise NotFound(f"{kind} {resource_id} not found", 404)
        if own:
            raise AuthError(
                f"{kind} {resource_id} belongs to {info.owner}: only they may change it", 403
            )
