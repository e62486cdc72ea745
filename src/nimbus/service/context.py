"""What every route and connection of the service shares: registry, queues, hub, auth.

Access rules live here, not in the routes: a function or endpoint is visible
to its owner, to the users it is shared with, and to everyone when public;
only the owner may delete or share it; a task is visible only to the user who
submitted it, and may be cancelled by them or by the owner of the endpoint it
was queued on (whoever shares an endpoint, its owner can clear its queue). Something a user may not see is "not found" (404); something
seen but not theirs to change is "forbidden" (403).

What an owner decides takes effect at once: a new endpoint token (registering
it again) revokes the old ones and closes their agents; deleting an endpoint
closes its agents and fails its tasks not yet done; sharing it with fewer users
fails the tasks of those who lost it. An endpoint name resolves to the user's
own endpoint of that name, else the only one they can see; ``OWNER/NAME`` picks
one; several matches are an error listing them (409), never a guess.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool

from nimbus.config import Settings
from nimbus.errors import AuthError, NotFound, ServiceError
from nimbus.protocol import DELETED, REPLACED, REVOKED, Cancel, ResultRow, is_uuid, pack
from nimbus.records import TaskState
from nimbus.service.hub import Hub
from nimbus.service.orders import OrderBook
from nimbus.service.queues import TaskStore
from nimbus.service.registry import EndpointInfo, FunctionInfo, Principal, Registry, hash_token

if TYPE_CHECKING:
    from nimbus.service.data import DataStore  # its routes need this module

__all__ = ["AmbiguousName", "ServiceContext"]

TOKEN_CACHE_SECONDS = 10.0
CACHE_SECONDS = 2.0  # how long a change of sharing may take to reach a busy submitter
STATUS_ERROR = 1  # nimbus.runtime.messages.Status.ERROR: a result that is (error, traceback)
FAIL_CHUNK = 1000  # tasks failed per Redis script call
log = logging.getLogger(__name__)


def _live_workers(runtime: str | None, capacity: int) -> int:
    """The workers its blocks' managers have now (its last heartbeat's runtime rows): 0
    while a provider's endpoint (Slurm) runs no block. ``capacity`` (its hello's) before
    one is heard, and for an endpoint whose workers are its agent's own (provider local:
    a manager of no block, its workers started at once)."""
    if not runtime or not capacity:
        return capacity
    try:
        managers = [r for r in json.loads(runtime) if r.get("kind") == "manager"]
        if any(not r.get("block") for r in managers):
            return capacity
        return min(capacity, sum(int(r.get("workers") or 0) for r in managers))
    except (ValueError, TypeError, AttributeError):
        return capacity


class AmbiguousName(ServiceError):
    """An endpoint name matches several endpoints the user can see (409); ``choices``
    are their ``owner/name``."""

    def __init__(self, message: str, choices: list[str]) -> None:
        super().__init__(message, 409)
        self.choices = choices


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
        # held while tokens are revoked and their connections closed, so that the
        # registry sweep (app.py) never closes one first with the wrong reason
        self._revoking = asyncio.Lock()
        self._jobs: set[asyncio.Task[None]] = set()
        self.orders = OrderBook()  # environment orders to the agents connected here

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
        """Tokens were revoked (by the admin, found in the registry): forget them and
        close the connections made with them."""
        async with self._revoking:
            await self._revoke(digests, REVOKED, "")

    async def _revoke(self, digests: set[str], code: int, reason: str) -> None:
        for digest in digests:
            self._principals.pop(digest, None)
        await self.hub.revoked(digests, code, reason)

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

    async def _function(self, function_id: str) -> FunctionInfo | None:
        """Function ``function_id``, from the cache or else the registry; None if unknown."""
        info = self._functions.get(function_id)
        if info is None:
            info = await run_in_threadpool(self.registry.function, function_id)
            if info is not None:
                self._functions[function_id] = info
        return info

    async def function(
        self, user: Principal, function_id: str, *, own: bool = False
    ) -> FunctionInfo:
        info = await self._function(function_id)
        if info is None:
            raise NotFound(f"function {function_id} not found", 404)
        self._check(user, "function", function_id, info, own)
        return info

    async def unrunnable(self, owner_id: str, function_id: str) -> str | None:
        """Why a task user ``owner_id`` queued may not run ``function_id`` now (it was
        deleted, or is no longer shared with them), or None if it may."""
        info = await self._function(function_id)
        if info is None:
            return (
                f"function {function_id} was deleted by its owner before this task was "
                f"sent to an endpoint; register it again and submit the task again"
            )
        if info.usable_by(owner_id):
            return None
        return (
            f"function {info.name!r} ({function_id}) of {info.owner} is no longer shared "
            f"with you; this task was not run"
        )

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
        capacity = int(status.get("workers", 0)) if online else 0  # its hello's
        return {
            **info.as_dict(),
            "online": online > 0,
            "agents": online,
            "workers": _live_workers(status.get("runtime"), capacity),
            "capacity": capacity,
            "python": status.get("python", ""),
            "serializer": status.get("serializer", ""),
            "environments": json.loads(status.get("environments") or "[]"),
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

    async def resolve_endpoint(self, user: Principal, ref: str) -> EndpointInfo:
        """The endpoint ``ref`` names for ``user``: an id, ``owner/name``, or a bare name.

        A bare name is the user's own endpoint of that name if they have one, else the
        one endpoint of that name they can see; AmbiguousName (409, listing the
        ``owner/name`` choices) when they can see several, NotFound when none.
        """
        if is_uuid(ref):
            return await self.endpoint(user, ref)
        owner, slash, name = ref.rpartition("/")
        found = []
        if name and (owner or not slash):
            found = await run_in_threadpool(
                self.registry.endpoints, user.user_id, name, owner if slash else None
            )
        if not slash:
            found = [info for info in found if info.owner_id == user.user_id] or found
        if not found:
            raise NotFound(
                f"no endpoint named {ref!r} is visible to you: `nimbus endpoints list` shows "
                f"those you can use (OWNER/NAME picks one of another user's)",
                404,
            )
        if len(found) > 1:
            choices = sorted(f"{info.owner}/{info.name}" for info in found)
            raise AmbiguousName(
                f"endpoint name {ref!r} matches {len(found)} endpoints you can use: "
                f"{', '.join(choices)}; name one of them as OWNER/NAME",
                choices,
            )
        return found[0]

    async def new_endpoint_token(self, user: Principal, name: str) -> tuple[str, bool, str]:
        """Register the user's endpoint ``name`` (or find it) with a new agent token;
        the agents connected with its older tokens are disconnected, told why.

        Returns the endpoint id, whether it was created, and the token.
        """
        async with self._revoking:
            endpoint_id, created = await run_in_threadpool(
                partial(self.registry.add_endpoint, limit=self.settings.max_endpoints),
                user.user_id,
                name,
            )
            token, replaced = await run_in_threadpool(
                self.registry.create_endpoint_token, user.user_id, endpoint_id
            )
            reason = f"endpoint {name} was configured again: a new token replaced this agent's"
            await self._revoke(set(replaced), REPLACED, reason)
        return endpoint_id, created, token

    async def delete_endpoint(self, info: EndpointInfo) -> None:
        """Delete an endpoint: its agents are disconnected and told why, its tokens
        revoked, and its tasks not yet done fail, telling those who wait for them."""
        reason = f"endpoint {info.name} was deleted by its owner {info.owner}"
        async with self._revoking:
            digests = await run_in_threadpool(self.registry.delete_endpoint, info.id)
            self.forget_endpoint(info.id)
            self.versions.pop(info.id, None)
            await self._revoke(set(digests), DELETED, reason)
            for conn_id in list(self.hub.endpoint_agents.get(info.id, ())):
                peer = self.hub.agents.get(conn_id)
                if peer is not None and not peer.closed:
                    await peer.close(DELETED, reason)
        message = (
            f"endpoint {info.name} ({info.id}) of {info.owner} was deleted before this task "
            f"finished; submit it to another endpoint"
        )
        await self._drop_endpoint_tasks(info.id, message)
        self.hub.beats.pop(info.id, None)
        self._again(self._drop_endpoint_tasks(info.id, message))

    async def released_on_deleted(self, endpoint_ids: list[str]) -> None:
        """Tasks held for their inputs were just queued for ``endpoint_ids``: those of an
        endpoint deleted meanwhile (a race with its deletion) fail, naming it."""
        for endpoint_id in endpoint_ids:
            hit = self._endpoints.get(endpoint_id)
            if hit is not None and hit[1] > time.monotonic():
                continue
            info = await run_in_threadpool(self.registry.endpoint, endpoint_id)
            if info is not None:
                self._endpoints[endpoint_id] = (info, time.monotonic() + CACHE_SECONDS)
                continue
            message = (
                f"endpoint {endpoint_id} was deleted before this task's inputs ended; "
                f"submit it to another endpoint"
            )
            await self._drop_endpoint_tasks(endpoint_id, message)

    async def _drop_endpoint_tasks(self, endpoint_id: str, message: str) -> int:
        """A deleted endpoint's tasks fail; its queue and status go."""
        failed = await self._fail_endpoint_tasks(endpoint_id, message)
        await self.store.forget_endpoint(endpoint_id)
        return failed

    async def withdraw_endpoint(self, info: EndpointInfo) -> None:
        """``info`` is shared with fewer users now (made private, users removed): the
        tasks not yet done of those who may no longer use it fail, telling them why."""
        message = (
            f"endpoint {info.name} ({info.id}) of {info.owner} is no longer shared with you; "
            f"this task did not finish there"
        )
        await self._fail_endpoint_tasks(info.id, message, info)
        self._again(self._fail_endpoint_tasks(info.id, message, info))

    def _again(self, job: Coroutine[Any, Any, int]) -> None:
        """Run ``job`` once more in a while: a submit that passed its access check just
        before a change may queue its tasks just after it."""

        async def later() -> None:
            await asyncio.sleep(CACHE_SECONDS)
            try:
                await job
            except Exception:  # the service is stopping: its tasks stay for the next start
                log.exception("failing the tasks left behind by an endpoint's change failed")

        task = asyncio.create_task(later())
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)

    async def _fail_endpoint_tasks(
        self, endpoint_id: str, message: str, shared: EndpointInfo | None = None
    ) -> int:
        """Fail the tasks queued for an endpoint or in flight on it (first result wins):
        all of them, or with ``shared`` (the endpoint now) those of users who may no
        longer use it. Whoever waits for them is told; their agent is told to cancel
        them. How many failed here."""
        ids = await self.store.endpoint_task_ids(endpoint_id)
        if shared is not None:
            if shared.public or not ids:
                return 0
            allowed = await run_in_threadpool(self.registry.user_ids, list(shared.shared_with))
            users = {shared.owner_id, *allowed.values()}
            tasks = await self.store.info(ids)
            ids = [i for i, task in zip(ids, tasks) if task and task["owner"] not in users]
        result = pack([STATUS_ERROR, pickle.dumps((ServiceError(message, 410), ""), 5), []])
        state = TaskState.FAILED.value
        failed = 0
        for start in range(0, len(ids), FAIL_CHUNK):
            rows: list[Any] = [[i, state, result, b"", ""] for i in ids[start : start + FAIL_CHUNK]]
            stored, drop = await self.store.finish(endpoint_id, rows)
            self.data.drop(drop)
            await self.hub.deliver([ResultRow(i, TaskState.FAILED, result, b"") for i in stored])
            for conn_id in list(self.hub.endpoint_agents.get(endpoint_id, ())):
                agent = self.hub.agents.get(conn_id)
                if agent is not None and stored:  # a task not started yet is dropped there
                    await agent.send(Cancel(stored).encode())
            failed += len(stored)
        return failed

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
