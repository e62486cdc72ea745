"""Tasks: submit in batches, status, results, cancel, list, groups.

``POST /v1/tasks`` takes JSON (payloads in base64) and ``POST /v1/tasks/batch``
takes the same in msgpack (payloads as bytes: what the SDK uses). Results come
back by long-poll (``GET /v1/tasks/{id}/result?wait=30``), in batches, or
streamed over the client WebSocket (``nimbus.service.ws``).
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import re
import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Base64Bytes, BaseModel, Field, field_validator

from nimbus.config import INLINE_MIN, MAX_TIMEOUT, check_timeout
from nimbus.errors import NotFound, PayloadTooLargeError, ProtocolError, ServiceError
from nimbus.protocol import (
    MSGPACK,
    Batch,
    Cancel,
    DataRef,
    ResultRow,
    SubmitRow,
    brief,
    check_payload,
    inputs_of,
    pack,
    too_large,
    unpack,
)
from nimbus.records import TaskRecord, TaskState
from nimbus.service import listing
from nimbus.service.context import ServiceContext
from nimbus.service.deps import context, current_user, environment_field
from nimbus.service.listing import Filter, page
from nimbus.service.queues import CANCELLED_RESULT, DONE
from nimbus.service.registry import FunctionInfo, Principal

__all__ = ["after_of", "cancel_tasks", "router", "row_of", "submit_tasks"]

Row = tuple[str, bytes, float | None, str, dict[str, Any] | None]
GROUP_MAX = 1_000_000  # task ids GET /v1/groups/{id} lists (Redis's list, else the history's)

# a random hex digit's low two bits under the RFC 4122 variant (10xx): 8, 9, a or b
_VARIANT = {digit: "89ab"[int(digit, 16) & 3] for digit in "0123456789abcdef"}


def new_ids(n: int) -> list[str]:
    """``n`` task ids, UUIDs of version 7 (RFC 9562): the time in milliseconds, then 74
    random bits. Ids made later sort later, so the history's primary key and its batch
    index grow at their end: with random (version 4) ids each row's insert landed on a
    random page of a B-tree as large as the history (18 -> 13.5 CPU us a row written).
    From one ``os.urandom`` call (a batch of thousands is one system call, not one a
    task), cut as hex text (no integer a task)."""
    t = f"{time.time_ns() // 1_000_000:012x}"
    head, h, v = f"{t[:8]}-{t[8:]}-7", os.urandom(10 * n).hex(), _VARIANT
    return [
        f"{head}{h[i : i + 3]}-{v[h[i + 3]]}{h[i + 4 : i + 7]}-{h[i + 7 : i + 19]}"
        for i in range(0, 20 * n, 20)
    ]


def after_of(rows: list[SubmitRow]) -> list[list[str | int] | None] | None:
    """The inputs each submitted row names (``after``), or None if none names any."""
    after = [inputs_of(row) for row in rows]
    return after if any(after) else None


def _inputs(after: list[list[str | int] | None], ids: list[str]) -> list[list[str] | None]:
    """Each row's inputs as task ids (a place ``i`` names row ``i``, an earlier one),
    each once."""
    out: list[list[str] | None] = []
    for index, names in enumerate(after):
        if not names:
            out.append(None)
            continue
        found: dict[str, None] = {}
        for name in names:
            if type(name) is int:
                if not 0 <= name < index:
                    raise ServiceError(
                        f"tasks[{index}].after: {name} is not the place of an earlier task of "
                        f"this batch (0 to {index - 1})",
                        422,
                    )
                name = ids[name]
            found[str(name)] = None
        out.append(list(found))
    return out


def row_of(row: SubmitRow) -> Row:
    """A submitted row as ``(function_id, payload, timeout, data_id, environment)``."""
    if isinstance(row.payload, DataRef):
        return row.function_id, b"", row.timeout, row.payload.data_id, row.environment
    return row.function_id, row.payload, row.timeout, "", row.environment


def _check_rows(ctx: ServiceContext, rows: list[Row]) -> list[Row]:
    """Rows with their timeouts checked, their inline payloads framed and within the limits."""
    settings = ctx.settings
    if not rows:
        raise ServiceError("tasks: give at least one task", 422)
    if len(rows) > settings.max_batch:
        raise ServiceError(
            f"tasks: {len(rows)} tasks in one submit; the service takes at most "
            f"{settings.max_batch} (NIMBUS_MAX_BATCH): submit them in parts",
            422,
        )
    out = []
    for i, (function_id, payload, timeout, data_id, environment) in enumerate(rows):
        try:  # (no timeout: nothing to check, no field name to make)
            seconds = None if timeout is None else check_timeout(timeout, f"tasks[{i}].timeout")
        except ValueError as exc:
            raise ServiceError(str(exc), 422) from None
        if not data_id:
            if len(payload) > settings.max_payload:
                raise too_large(f"tasks[{i}].payload", len(payload), settings.max_payload)
            try:
                size = check_payload(payload)
            except ValueError as exc:
                raise ServiceError(
                    f"tasks[{i}].payload: not the packed arguments of a task ({exc}); "
                    f'send pack_payload(pickle, buffers), or {{"data": data_id}}',
                    422,
                ) from None
            if size > max(settings.inline_payload, INLINE_MIN):
                raise PayloadTooLargeError(
                    f"tasks[{i}].payload: {size} bytes inline exceeds the service's inline limit "
                    f"of {settings.inline_payload} bytes (NIMBUS_INLINE_PAYLOAD); upload larger "
                    f'arguments with PUT /v1/data and send {{"data": data_id}} in their place'
                )
        out.append((function_id, payload, seconds, data_id, environment))
    return out


_PIN = re.compile(r"^\s*cloudpickle\s*===?\s*([0-9]+)[0-9A-Za-z.+!-]*\s*$", re.IGNORECASE)
_MAJOR = re.compile(r"cloudpickle([0-9]+)")


def _check_pins(fn: FunctionInfo, environment: dict[str, Any], index: int) -> None:
    """Refuse (409) an environment that pins another cloudpickle major version than the
    one the function was pickled with: its tasks could not be exchanged."""
    ours = _MAJOR.search(fn.serializer)
    for requirement in environment.get("requirements") or ():
        pin = _PIN.match(requirement)
        if pin and ours and pin.group(1) != ours.group(1):
            raise ServiceError(
                f"version mismatch: tasks[{index}].environment {environment.get('name')!r} "
                f"pins {requirement!r}, but function {fn.name!r} ({fn.id}) was registered "
                f"from Python {fn.python} with serializer {fn.serializer}; pin the "
                f"client's cloudpickle in the environment's requirements (or drop the pin)",
                409,
            )


async def submit_tasks(
    ctx: ServiceContext,
    user: Principal,
    endpoint_id: str,
    rows: list[Row],
    after: list[list[str | int] | None] | None = None,
    watch: Callable[[list[str]], None] | None = None,
) -> tuple[str, list[str]]:
    """Queue ``(function_id, payload, timeout, data_id, environment)`` rows; the group id
    and the task ids.

    A row with a ``data_id`` has its payload in the data store, uploaded by ``user``.
    ``after`` (one entry per row): the tasks whose results a row takes (task ids of
    ``user``, or places of earlier rows); it is held until they succeed
    (``nimbus.service.dependencies``). ``watch`` is given the ids before they are
    queued (a held task may fail at once: its watcher hears it).
    """
    if not isinstance(endpoint_id, str) or not 0 < len(endpoint_id) <= 64:
        raise ServiceError(f"endpoint_id: expected an endpoint id, not {brief(endpoint_id)}", 422)
    rows = _check_rows(ctx, rows)
    endpoint = await ctx.endpoint(user, endpoint_id, cached=True)
    functions = {}
    for fn_id in {row[0] for row in rows}:
        fn = await ctx.function(user, fn_id)
        await ctx.check_versions(fn, endpoint)
        functions[fn_id] = fn
    if any(fn.environment is not None for fn in functions.values()):
        rows = [  # a function's registered environment, where the call gives none
            row
            if row[4] is not None
            else (row[0], row[1], row[2], row[3], functions[row[0]].environment)
            for row in rows
        ]
    for i, row in enumerate(rows):
        if row[4] is not None:
            _check_pins(functions[row[0]], row[4], i)
    data_ids = [row[3] for row in rows if row[3]]
    if len(set(data_ids)) < len(data_ids):
        raise ServiceError("tasks.payload: each task needs its own data; upload it again", 409)
    await ctx.data.check_arguments(user.user_id, data_ids)
    group_id, *ids = new_ids(len(rows) + 1)
    if after is not None and len(after) != len(rows):
        raise ServiceError(f"tasks.after: {len(after)} entries for {len(rows)} tasks", 422)
    inputs = None if after is None else _inputs(after, ids)
    watched = watch is not None and inputs is not None
    if watch is not None and watched:
        watch(ids)
    try:
        await ctx.store.submit(
            user.user_id,
            endpoint.id,
            group_id,
            [(task_id, *row) for task_id, row in zip(ids, rows)],
            max_tasks=ctx.settings.max_queued_tasks,
            max_bytes=ctx.settings.max_queued_bytes,
            after=inputs,
        )
    except BaseException:
        for task_id in ids if watched else ():
            ctx.hub.watchers.pop(task_id, None)
        raise
    return group_id, ids


async def cancel_tasks(ctx: ServiceContext, user: Principal, task_ids: list[str]) -> list[bool]:
    """Cancel tasks ``user`` may cancel (their own, or queued on their endpoint)."""
    out = []
    for info in await ctx.store.info(task_ids):
        if info is None or not await ctx.may_cancel(user, info):
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
            await agent.send(Cancel([info["task_id"]]).encode())
        await ctx.hub.deliver(
            [ResultRow(info["task_id"], TaskState.CANCELLED, CANCELLED_RESULT, b"")]
        )
    return out


def task_view(info: dict[str, Any]) -> dict[str, Any]:
    """A task as the routes show it; fields of a broken record show as 0 or None, never a 500."""
    record = None
    if info.get("record"):
        try:
            rec = TaskRecord.from_wire(unpack(info["record"]))
            rec.state = TaskState(info["state"])
            rec.submitted = _seconds(info["submitted"])
            record = rec.as_dict()
        except Exception:  # sent by an agent or stored by an older version: not shown
            record = None
    return {
        "task_id": info["task_id"],
        "state": info["state"],
        "endpoint_id": info["endpoint"],
        "function_id": info["function"],
        "group_id": info["group"],
        "submitted": _seconds(info["submitted"]),
        "dispatched": _seconds(info["dispatched"]),
        "started": _seconds(info.get("started")),  # a worker started it (0: not yet, or old)
        "ended": _seconds(info["ended"]),
        "timeout": info["timeout"],
        "record": record,
    }


def _seconds(value: object) -> float:
    """A stored time, 0.0 if it is missing or broken."""
    try:
        seconds = float(value or 0)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
    return seconds if math.isfinite(seconds) else 0.0


# ---------------------------------------------------------------- REST

router = APIRouter(prefix="/v1", tags=["tasks"])
User = Annotated[Principal, Depends(current_user)]
Ctx = Annotated[ServiceContext, Depends(context)]


class TaskIn(BaseModel):
    function_id: str = Field(min_length=1, max_length=64)
    payload: Base64Bytes = Field(
        default=b"", description="the packed arguments (pack_payload), inline, in base64"
    )
    data: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description="instead of payload: the data id (PUT /v1/data) of the packed arguments",
    )
    timeout: float | None = Field(
        default=None, gt=0, le=MAX_TIMEOUT, allow_inf_nan=False, strict=True
    )

    environment: dict[str, Any] | None = Field(
        default=None,
        description="the environment the task runs in (Environment.to_dict()), or null",
    )

    @field_validator("environment", mode="before")
    @classmethod
    def _environment(cls, value: object) -> object:
        return environment_field(value)

    @field_validator("payload", mode="before")
    @classmethod
    def _strict_base64(cls, value: object) -> object:
        """Refuse what lenient base64 would skip ("!!!" would decode to nothing)."""
        if isinstance(value, str):
            try:
                base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError("not valid base64 (standard alphabet, padded)") from None
        return value


class SubmitBody(BaseModel):
    endpoint_id: str = Field(min_length=1, max_length=64)
    tasks: list[TaskIn] = Field(min_length=1)


class TaskIds(BaseModel):
    task_ids: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        min_length=1, max_length=10_000
    )


class Submitted(BaseModel):
    group_id: str
    task_ids: list[str]


@router.post("/tasks", response_model=Submitted, status_code=201)
async def submit(body: SubmitBody, user: User, ctx: Ctx) -> dict[str, Any]:
    for i, t in enumerate(body.tasks):
        if t.data is not None and t.payload:
            raise ServiceError(f"tasks[{i}].data: give payload or data, not both", 422)
    rows = [(t.function_id, t.payload, t.timeout, t.data or "", t.environment) for t in body.tasks]
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
            "description": "msgpack map {endpoint_id, tasks: [[function_id, payload, timeout, environment]]}",
        }
    },
)
async def submit_batch(request: Request, user: User, ctx: Ctx) -> Response:
    body = await request.body()
    if len(body) > ctx.settings.max_payload:  # sent without a Content-Length
        raise too_large("request body", len(body), ctx.settings.max_payload)
    try:
        batch = Batch.decode(body)
    except ProtocolError as exc:
        raise ServiceError(str(exc), 422) from None
    endpoint_id = batch.endpoint_id
    rows = [row_of(row) for row in batch.tasks]
    group_id, ids = await submit_tasks(ctx, user, endpoint_id, rows, after_of(batch.tasks))
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
    """Your tasks, newest first: those running or recent (Redis) and the SQL history."""
    flt = Filter(state=status.value if status else "", endpoint=endpoint_id or "")
    key = ctx.store.keys.user_tasks(user.user_id)
    rows, _ = await page(ctx.store, key, flt, None, limit, user.user_id)
    infos = await ctx.store.info([row.task_id for row in rows])
    return {"tasks": [task_view(info) for info in infos if info is not None]}


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
        return str((await ctx.task(user, task_id))["state"]) in DONE

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
    """Cancel a task: the submitter's, or one queued or running on the caller's endpoint."""
    await ctx.cancellable_task(user, task_id)
    [done] = await cancel_tasks(ctx, user, [task_id])
    [info] = await ctx.store.info([task_id])
    return {"task_id": task_id, "cancelled": done, "state": info["state"] if info else "cancelled"}


@router.get("/groups/{group_id}")
async def group(group_id: str, user: User, ctx: Ctx) -> dict[str, Any]:
    ids = await listing.group_ids(ctx.store, group_id, GROUP_MAX)
    infos = await ctx.store.info(ids[:1])
    if not ids or infos[0] is None or infos[0]["owner"] != user.user_id:
        raise NotFound(f"task group {group_id} not found", 404)
    return {"group_id": group_id, "task_ids": ids}
