"""The service's data store: large payloads and results, as files beside the registry.

::

    client --PUT /v1/data--> <data dir>/<id>  + hash data:<id> {owner, size}
                             (unclaimed: expires after UNCLAIMED_TTL)
    submit {"data": id} ---> claimed by the task: {task, endpoint}, no expiry;
                             that endpoint's agent may GET it
    agent --PUT /v1/data?task_id=T--> a result blob owned by T's owner, {task: T}
    task done or cancelled: its argument blob is dropped at once; a stored
    result blob expires with the task's result (NIMBUS_RESULT_TTL)

The bytes are streamed to and from files and never unpickled, nor kept in the
SQL registry or in Redis. A file is fsynced before its hash is written and
renamed into place, so a machine crash loses only an upload under way at that
moment (its task then fails saying the data is gone). A file whose hash is gone (expired, dropped, or left
by a service that was killed) is removed by :meth:`DataStore.sweep`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Annotated, Any

import redis.asyncio as aioredis
from fastapi import APIRouter, Depends, Query
from fastapi.responses import StreamingResponse
from starlette.requests import Request

from nimbus.errors import NotFound, ServiceError
from nimbus.protocol import too_large
from nimbus.service.deps import context, current_principal
from nimbus.service.registry import Principal
from nimbus.statestore import Keys

__all__ = ["DataStore", "router", "too_large"]

UNCLAIMED_TTL = 3600  # seconds an uploaded blob waits for the task that uses it
PART_TTL = 3600.0  # seconds after which an upload left unfinished is removed
CHUNK = 1 << 20
_ID = re.compile(r"^[0-9a-f]{32}$")


class DataStore:
    """Blobs in ``root`` (one file each), described by a hash in Redis."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, root: Path, *, limit: int) -> None:
        self.redis: Any = redis
        self.keys = keys
        self.root = root
        self.limit = limit
        root.mkdir(mode=0o700, parents=True, exist_ok=True)

    def path(self, data_id: str) -> Path:
        return self.root / data_id

    async def receive(
        self, chunks: AsyncIterator[bytes], *, owner: str, task: str = "", endpoint: str = ""
    ) -> tuple[str, int]:
        """Store the streamed bytes; their data id and size. Over the limit: nothing is kept."""
        data_id = uuid.uuid4().hex
        part = self.root / f".{data_id}.part"
        size = 0
        try:
            with open(part, "wb") as out:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > self.limit:
                        raise too_large("the data", size, self.limit)
                    out.write(chunk)
                out.flush()  # on disk before its record says it is there (a machine crash)
                await asyncio.to_thread(os.fsync, out.fileno())
            fields = {"owner": owner, "size": size, "task": task, "endpoint": endpoint}
            await self.redis.hset(self.keys.data(data_id), mapping=fields)
            await self.redis.expire(self.keys.data(data_id), UNCLAIMED_TTL)
            part.replace(self.path(data_id))
            await asyncio.to_thread(_sync_directory, self.root)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        return data_id, size

    async def describe(self, data_ids: Sequence[str]) -> list[dict[str, str] | None]:
        """Each blob's hash (owner, size, task, endpoint), None for an unknown one."""
        pipe = self.redis.pipeline(transaction=False)
        for data_id in data_ids:
            pipe.hgetall(self.keys.data(data_id) if _ID.match(data_id) else self.keys.data("-"))
        out: list[dict[str, str] | None] = []
        for raw in await pipe.execute():
            out.append({k.decode(): v.decode() for k, v in raw.items()} if raw else None)
        return out

    async def check_arguments(self, owner: str, data_ids: Sequence[str]) -> None:
        """Refuse references to blobs ``owner`` did not upload or a task already uses."""
        if not data_ids:
            return
        for data_id, meta in zip(data_ids, await self.describe(data_ids)):
            if meta is None or meta["owner"] != owner or meta.get("endpoint"):
                raise NotFound(f"tasks.payload: data {data_id} not found", 404)
            if meta.get("task"):
                raise ServiceError(
                    f"tasks.payload: data {data_id} is already the argument of task "
                    f"{meta['task']}; upload it again for another task",
                    409,
                )

    def drop(self, data_ids: Iterable[str]) -> None:
        """Remove blobs whose hash the queues already deleted."""
        for data_id in data_ids:
            if data_id and _ID.match(data_id):
                self.path(data_id).unlink(missing_ok=True)

    async def sweep(self) -> int:
        """Remove the files no hash describes and uploads left unfinished; how many."""
        names = [p.name for p in self.root.iterdir()]
        stale = time.time() - PART_TTL
        removed = 0
        for name in names:
            if name.endswith(".part"):
                with contextlib.suppress(OSError):
                    if (self.root / name).stat().st_mtime < stale:
                        (self.root / name).unlink()
                        removed += 1
        ids = [name for name in names if _ID.match(name)]
        for start in range(0, len(ids), 1000):
            chunk = ids[start : start + 1000]
            pipe = self.redis.pipeline(transaction=False)
            for data_id in chunk:
                pipe.exists(self.keys.data(data_id))
            gone = [i for i, there in zip(chunk, await pipe.execute()) if not there]
            self.drop(gone)
            removed += len(gone)
        return removed


# ---------------------------------------------------------------- REST

router = APIRouter(prefix="/v1", tags=["data"])
Caller = Annotated[Principal, Depends(current_principal)]


@router.get("/limits", tags=["service"])
async def limits(request: Request, caller: Caller) -> dict[str, int]:
    """Payloads above ``inline_payload`` go through ``/v1/data``; none above ``max_payload``."""
    settings = context(request).settings
    return {"max_payload": settings.max_payload, "inline_payload": settings.inline_payload}


@router.put(
    "/data",
    status_code=201,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
            "description": "the bytes to store (a packed payload or result)",
        }
    },
)
async def put_data(
    request: Request,
    caller: Caller,
    task_id: Annotated[str | None, Query(max_length=64)] = None,
) -> dict[str, Any]:
    """Store bytes; their data id. An endpoint's token stores results: give ``task_id``."""
    ctx = context(request)
    if caller.endpoint_id is None:
        if task_id is not None:
            raise ServiceError("task_id: only an endpoint's agent stores a task's result", 422)
        owner, endpoint = caller.user_id, ""
    else:
        if task_id is None:
            raise ServiceError(
                "task_id: an endpoint's token stores only results; give the task's id", 422
            )
        [info] = await ctx.store.info([task_id])
        if info is None or info["endpoint"] != caller.endpoint_id or info["ended"]:
            raise NotFound(f"task {task_id} is not in flight on this endpoint", 404)
        owner, endpoint = info["owner"], caller.endpoint_id
    data_id, size = await ctx.data.receive(
        request.stream(), owner=owner, task=task_id or "", endpoint=endpoint
    )
    return {"data_id": data_id, "size": size}


@router.get(
    "/data/{data_id}",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
async def get_data(data_id: str, request: Request, caller: Caller) -> StreamingResponse:
    """Bytes you stored, or (an endpoint's token) those of a task given to that endpoint."""
    ctx = context(request)
    [meta] = await ctx.data.describe([data_id])
    if meta is not None:
        mine = caller.endpoint_id is None and meta["owner"] == caller.user_id
        if mine or (caller.endpoint_id is not None and meta["endpoint"] == caller.endpoint_id):
            try:
                file = open(ctx.data.path(data_id), "rb")  # noqa: SIM115 (closed by _read)
            except FileNotFoundError:
                pass
            else:
                size = os.fstat(file.fileno()).st_size
                return StreamingResponse(
                    _read(file),
                    media_type="application/octet-stream",
                    headers={"Content-Length": str(size)},
                )
    raise NotFound(f"data {data_id} not found", 404)


def _sync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read(file: IO[bytes]) -> Iterator[bytes]:
    with file:
        while chunk := file.read(CHUNK):
            yield chunk
