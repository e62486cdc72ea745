"""Tasks: submit in batches, status, results, cancel, list, groups.

``POST /v1/tasks`` takes JSON (payloads in base64) and ``POST /v1/tasks/batch``
takes the same in msgpack (payloads as bytes: what the SDK uses). Results come
back by long-poll (``GET /v1/tasks/{id}/result?wait=30``), in batches, or
streamed over the client WebSocket (``nimbus.service.ws``).
"""

from __future__ import annotations

import base64
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Base64Bytes, BaseModel, Field

from nimbus.errors import NotFound, ServiceError
from nimbus.records import TaskRecord, TaskState
from nimbus.service.context import ServiceContext
from nimbus.service.deps import context, current_user
from nimbus.service.protocol import MSGPACK, data_ref, pack, too_large, unpack
from nimbus.service.queues import CANCELLED_RESULT
from nimbus.service.registry import Principal

__all__ = ["cancel_tasks", "router", "submit_tasks", "wire_row"]

MAX_BATCH = 100_000
Row = tuple[str, bytes, float | None, str]


def wire_row(function_id: object, payload: object, timeout: Any) -> Row:
    """A submitted ``[function_id, payload | {"data": id}, timeout]`` as a Row."""
    ref = data_ref(payload)
    if ref is not None:
        return str(function_id), b"", timeout, ref
    return str(function_id), bytes(payload), timeout, ""  # type: ignore[call-overload]


async def submit_tasks(
    ctx: ServiceContext, user: Principal, endpoint_id: str, rows: list[Row]
) -> tuple[str, list[str]]:
    """Queue ``(function_id, payload, timeout, data_id)`` rows; the group id and the task ids.

    A row with a ``data_id`` has its payload in the data store, uploaded by ``user``.
    """
    if not rows:
        raise ServiceError("tasks: give at least one task", 422)
    if len(rows) > MAX_BATCH:
        raise ServiceError(f"tasks: at most {MAX_BATCH} tasks per batch", 422)
    endpoint = await ctx.endpoint(user, endpoint_id, cached=True)
    limit = ctx.settings.max_payload
    for fn_id in {row[0] for row in rows}:
        fn = await ctx.function(user, fn_id)
        await ctx.check_versions(fn, endpoint)
    for _, payload, timeout, _ in rows:
        if len(payload) > limit:
            raise too_large("a task payload", len(payload), limit)
        if timeout is not None and not (isinstance(timeout, int | float) and timeout > 0):
            raise ServiceError(
                f"tasks.timeout: must be a number of seconds > 0, not {timeout!r}", 422
            )
    data_ids = [row[3] for row in rows if row[3]]
    if len(set(data_ids)) < len(data_ids):
        raise ServiceError("tasks.payload: each task needs its own data; upload it again", 409)
    await ctx.data.check_arguments(user.user_id, data_ids)
    group_id = str(uuid.uuid4())
    ids = [str(uuid.uuid4()) for _ in rows]
    await ctx.store.submit(
        user.user_id, endpoint.id, group_id, [(task_id, *row) for task_id, row in zip(ids, rows)]
    )
    return group_id, ids


async def cancel_tasks(ctx: ServiceContext, user: Principal, task_ids: list[str]) -> list[bool]:
    out = []
    for info in await ctx.store.info(task_ids):
        if info is None or info["owner"] != user.user_id:
            out.append(False)
            continue
        cancelled = await ctx.store.cancel(info["task_id"], info["endpoint"])
        if cancelled is None:
            out.append(False)
            continue
        out.append(True)
        conn, data_id = cancelled
        ctx.data.drop([data_id])
        if conn and (agent := ctx.hub.agents.get(conn)) is not None:
            await agent.send(pack({"op": "cancel", "ids": [info["task_id"]]}))
        await ctx.hub.deliver([[info["task_id"], TaskState.CANCELLED.value, CANCELLED_RESULT, b""]])
    return out


def task_view(info: dict[str, Any]) -> dict[str, Any]:
    record = None
    if info.get("record"):
        rec = TaskRecord.from_wire(unpack(info["record"]))
        rec.state = TaskState(info["state"])
        rec.submitted = float(info["submitted"] or 0)
        record = rec.as_dict()
    return {
        "task_id": info["task_id"],
        "state": info["state"],
        "endpoint_id": info["endpoint"],
        "function_id": info["function"],
        "group_id": info["group"],
        "submitted": float(info["submitted"] or 0),
        "dispatched": float(info["dispatched"] or 0),
        "ended": float(info["ended"] or 0),
        "timeout": info["timeout"],
        "record": record,
    }


# ---------------------------------------------------------------- REST

router = APIRouter(prefix="/v1", tags=["tasks"])
User = Annotated[Principal, Depends(current_user)]
Ctx = Annotated[ServiceContext, Depends(context)]


class TaskIn(BaseModel):
    function_id: str = Field(min_length=1, max_length=64)
    payload: Base64Bytes = Field(default=b"", description="the packed arguments, inline")
    data: str | None = Field(
        default=None,
        max_length=64,
        description="instead of payload: the data id (PUT /v1/data) of the packed arguments",
    )
    timeout: float | None = Field(default=None, gt=0)


class SubmitBody(BaseModel):
    endpoint_id: str = Field(min_length=1, max_length=64)
    tasks: list[TaskIn] = Field(min_length=1, max_length=MAX_BATCH)


class TaskIds(BaseModel):
    task_ids: list[str] = Field(min_length=1, max_length=10_000)


class Submitted(BaseModel):
    group_id: str
    task_ids: list[str]


@router.post("/tasks", response_model=Submitted, status_code=201)
async def submit(body: SubmitBody, user: User, ctx: Ctx) -> dict[str, Any]:
    for i, t in enumerate(body.tasks):
        if t.data is not None and t.payload:
            raise ServiceError(f"tasks.{i}.data: give payload or data, not both", 422)
    rows = [(t.function_id, t.payload, t.timeout, t.data or "") for t in body.tasks]
    group_id, ids = await submit_tasks(ctx, user, body.endpoint_id, rows)
    ctx.hub.work_arrived(body.endpoint_id)
    return {"group_id": group_id, "task_ids": ids}


@router.post(
    "/tasks/batch",
    response_model=Submitted,
    status_code=201,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {MSGPACK: {"schema": {"type": "string", "format": "binary"}}},
            "description": "msgpack map {endpoint_id, tasks: [[function_id, payload, timeout]]}",
        }
    },
)
async def submit_batch(request: Request, user: User, ctx: Ctx) -> Response:
    body = await request.body()
    if len(body) > ctx.settings.max_payload:  # sent without a Content-Length
        raise too_large("request body", len(body), ctx.settings.max_payload)
    try:
        msg = unpack(body)
        endpoint_id = msg["endpoint_id"]
        rows = [wire_row(*task) for task in msg["tasks"]]
        if not isinstance(endpoint_id, str):
            raise TypeError("endpoint_id must be a string")
    except Exception as exc:
        raise ServiceError(
            f"body: expected a msgpack map {{endpoint_id, tasks: [[function_id, payload | "
            f"{{data: data_id}}, timeout], ...]}} ({type(exc).__name__}: {exc})",
            422,
        ) from None
    group_id, ids = await submit_tasks(ctx, user, endpoint_id, rows)
    ctx.hub.work_arrived(endpoint_id)
    return Response(pack({"group_id": group_id, "task_ids": ids}), 201, media_type=MSGPACK)


@router.get("/tasks")
async def list_tasks(
    user: User,
    ctx: Ctx,
    status: TaskState | None = None,
    endpoint_id: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
) -> dict[str, Any]:
    ids = await ctx.store.user_task_ids(user.user_id, 10 * limit if status else limit)
    infos = await ctx.store.info(ids)
    await ctx.store.forget(user.user_id, [i for i, info in zip(ids, infos) if info is None])
    out = []
    for info in infos:
        if info is None or (status is not None and info["state"] != status.value):
            continue
        if endpoint_id is not None and info["endpoint"] != endpoint_id:
            continue
        out.append(task_view(info))
        if len(out) >= limit:
            break
    return {"tasks": out}


@router.get("/tasks/{task_id}")
async def get_task(task_id: str, user: User, ctx: Ctx) -> dict[str, Any]:
    return task_view(await ctx.task(user, task_id))


@router.get("/tasks/{task_id}/result")
async def get_result(
    task_id: str,
    request: Request,
    user: User,
    ctx: Ctx,
    wait: Annotated[float, Query(ge=0, le=300)] = 0.0,
) -> Response:
    async def done() -> bool:
        return TaskState(str((await ctx.task(user, task_id))["state"])).done

    if wait:
        await ctx.hub.wait_done(task_id, wait, done)
    else:
        await ctx.task(user, task_id)
    [result] = await ctx.store.results([task_id])
    state = result[0] if result else (await ctx.task(user, task_id))["state"]
    body = {"task_id": task_id, "state": state, "result": result[1] if result else None}
    if MSGPACK in request.headers.get("accept", ""):
        return Response(pack(body), media_type=MSGPACK)
    if result:
        body["result"] = base64.b64encode(result[1]).decode()
    return JSONResponse(body)


@router.post("/tasks/status")
async def batch_status(body: TaskIds, user: User, ctx: Ctx) -> dict[str, Any]:
    infos = await ctx.store.info(body.task_ids)
    return {
        "tasks": {
            i: task_view(info) if info and info["owner"] == user.user_id else None
            for i, info in zip(body.task_ids, infos)
        }
    }


@router.post("/tasks/results")
async def batch_results(body: TaskIds, user: User, ctx: Ctx) -> dict[str, Any]:
    infos = await ctx.store.info(body.task_ids)
    mine = [i for i, info in zip(body.task_ids, infos) if info and info["owner"] == user.user_id]
    results = dict(zip(mine, await ctx.store.results(mine)))
    out: dict[str, Any] = {}
    for task_id in body.task_ids:
        result = results.get(task_id)
        out[task_id] = (
            {"state": result[0], "result": base64.b64encode(result[1]).decode()} if result else None
        )
    return {"results": out}


@router.post("/tasks/{task_id}/cancel")
async def cancel(task_id: str, user: User, ctx: Ctx) -> dict[str, Any]:
    await ctx.task(user, task_id)
    [done] = await cancel_tasks(ctx, user, [task_id])
    state = (await ctx.task(user, task_id))["state"]
    return {"task_id": task_id, "cancelled": done, "state": state}


@router.get("/groups/{group_id}")
async def group(group_id: str, user: User, ctx: Ctx) -> dict[str, Any]:
    ids = await ctx.store.group(group_id)
    infos = await ctx.store.info(ids[:1])
    if not ids or infos[0] is None or infos[0]["owner"] != user.user_id:
        raise NotFound(f"task group {group_id} not found", 404)
    return {"group_id": group_id, "task_ids": ids}
