"""The service's two WebSockets: endpoint agents pull tasks, clients stream results.

An agent connection (``/v1/ws/endpoint``, an endpoint token) says hello, then
a dispatcher keeps up to ``window`` of its endpoint's tasks in flight on it;
results are stored (first wins), acknowledged, and delivered to the clients
that wait. A connection silent for three heartbeats is closed, and its tasks
in flight go back to the head of the endpoint's queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from nimbus.errors import NimbusError, PayloadTooLargeError, ServiceError
from nimbus.service.context import ServiceContext
from nimbus.service.hub import Peer
from nimbus.service.protocol import batches, data_ref, pack, unpack
from nimbus.service.registry import hash_token
from nimbus.service.tasks import cancel_tasks, submit_tasks, wire_row

__all__ = ["agent_socket", "client_socket"]

log = logging.getLogger(__name__)
TAKE_MAX = 2000
IDLE_POLL = 5.0  # seconds; submits in this process wake a dispatcher at once
BEAT_SAVE_SECONDS = 10.0
COALESCE = 0.002  # with work in flight, wait this long to gather more into one message


def bearer(headers: Any) -> str | None:
    value: str = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def _refuse(ws: WebSocket, exc: ServiceError) -> None:
    await ws.close(code=4000 + (exc.status or 400), reason=str(exc)[:120])


async def agent_socket(ctx: ServiceContext, ws: WebSocket) -> None:
    token = bearer(ws.headers)
    try:
        principal = await ctx.principal(token)
        if principal.endpoint_id is None:
            raise ServiceError("only an endpoint's own token may connect as its agent", 403)
    except ServiceError as exc:
        await _refuse(ws, exc)
        return
    endpoint_id = principal.endpoint_id
    await ws.accept()
    try:
        hello = unpack(await ws.receive_bytes())
    except WebSocketDisconnect:
        return
    conn_id = uuid.uuid4().hex
    peer = Peer(conn_id, ws.send_bytes, digest=hash_token(token or ""), close=ws.close)
    window = max(1, int(hello.get("window", 1)))
    await ctx.store.set_status(
        endpoint_id,
        python=str(hello.get("python", "")),
        serializer=str(hello.get("serializer", "")),
        workers=int(hello.get("workers", 0)),
        last_heartbeat=repr(time.time()),
    )
    ctx.versions[endpoint_id] = (str(hello.get("python", "")), str(hello.get("serializer", "")))
    ctx.hub.add_agent(endpoint_id, peer)
    sent: set[str] = set()
    room = asyncio.Event()
    dispatcher = asyncio.create_task(_dispatch(ctx, endpoint_id, peer, window, sent, room))
    silence = 3 * ctx.settings.heartbeat
    saved = time.time()
    try:
        while True:
            msg = unpack(await asyncio.wait_for(ws.receive_bytes(), silence))
            op = msg.get("op")
            if op == "results":
                rows = msg["results"]  # [task_id, state, [status, data, buffers] | ref, record]
                packed = [[r[0], r[1], pack(r[2]), pack(r[3]), data_ref(r[2]) or ""] for r in rows]
                done, drop = await ctx.store.finish(endpoint_id, packed)
                ctx.data.drop(drop)
                stored = set(done)
                ids = [row[0] for row in rows]
                sent.difference_update(ids)
                room.set()
                await ctx.hub.deliver([row for row in rows if row[0] in stored])
                await peer.send(pack({"op": "ack", "ids": ids}))
            elif op == "running":
                await ctx.store.running(endpoint_id, [str(i) for i in msg.get("ids", [])])
            elif op == "beat":
                await peer.send(pack({"op": "beat", "t": msg.get("t")}))
                now = time.time()
                ctx.hub.beats[endpoint_id] = now
                if now - saved > BEAT_SAVE_SECONDS:  # Redis keeps it for a restart
                    saved = now
                    await ctx.store.set_status(endpoint_id, last_heartbeat=repr(now))
    except (WebSocketDisconnect, TimeoutError):
        pass
    except Exception:
        log.exception("agent connection %s of endpoint %s failed", conn_id, endpoint_id)
    finally:
        dispatcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await dispatcher
        peer.closed = True
        ctx.hub.drop_agent(endpoint_id, peer)
        if await ctx.store.requeue(endpoint_id, conn_id):
            ctx.hub.work_arrived(endpoint_id)
        with contextlib.suppress(Exception):
            await ws.close()


async def _dispatch(
    ctx: ServiceContext,
    endpoint_id: str,
    peer: Peer,
    window: int,
    sent: set[str],
    room: asyncio.Event,
) -> None:
    known: set[str] = set()
    wake = ctx.hub.wakeup(endpoint_id)
    while not peer.closed:
        free = window - len(sent)
        if free <= 0:
            room.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(room.wait(), 1.0)
            continue
        if sent:
            await asyncio.sleep(COALESCE)  # the agent is busy: let more tasks join this batch
        wake.clear()
        rows = await ctx.store.take(endpoint_id, peer.conn_id, min(free, TAKE_MAX))
        if not rows:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), IDLE_POLL)
            continue
        out = []
        for task_id, function_id, payload, timeout, data_id in rows:
            body: bytes | None = None
            if function_id not in known:
                try:
                    body = await ctx.function_body(function_id)
                except NimbusError:
                    body = b""  # deleted since: the agent fails the task with a clear error
                known.add(function_id)
            sent_payload: bytes | dict[str, str] = {"data": data_id} if data_id else payload
            out.append([task_id, function_id, body, sent_payload, timeout])
            sent.add(task_id)
        for batch in batches(out, _task_size):
            await peer.send(pack({"op": "tasks", "tasks": batch}))


async def client_socket(ctx: ServiceContext, ws: WebSocket) -> None:
    token = bearer(ws.headers)
    try:
        user = await ctx.user(token)
    except ServiceError as exc:
        await _refuse(ws, exc)
        return
    await ws.accept()
    peer = Peer(uuid.uuid4().hex, ws.send_bytes, digest=hash_token(token or ""), close=ws.close)
    ctx.hub.peers[peer.conn_id] = peer
    try:
        while True:
            msg = unpack(await ws.receive_bytes())
            op = msg.get("op")
            if op == "submit":
                ref = msg.get("ref")
                try:
                    endpoint_id = str(msg.get("endpoint_id", ""))
                    rows = [wire_row(*task) for task in msg.get("tasks", [])]
                    group_id, ids = await submit_tasks(ctx, user, endpoint_id, rows)
                except (ServiceError, PayloadTooLargeError) as exc:
                    status = exc.status if isinstance(exc, ServiceError) else 413
                    await peer.send(
                        pack({"op": "refused", "ref": ref, "status": status, "detail": str(exc)})
                    )
                    continue
                except (TypeError, ValueError) as exc:
                    detail = (
                        f"malformed submit: tasks must be [function_id, payload, timeout] ({exc})"
                    )
                    await peer.send(
                        pack({"op": "refused", "ref": ref, "status": 422, "detail": detail})
                    )
                    continue
                ctx.hub.watch(ids, peer)
                ctx.hub.work_arrived(endpoint_id)  # results may overtake this reply: clients wait
                await peer.send(pack({"op": "accepted", "ref": ref, "ids": ids, "group": group_id}))
            elif op == "watch":
                await _watch(ctx, user.user_id, [str(i) for i in msg.get("ids", [])], peer)
            elif op == "cancel":
                await cancel_tasks(ctx, user, [str(i) for i in msg.get("ids", [])])
    except WebSocketDisconnect:
        pass
    finally:
        peer.closed = True
        ctx.hub.unwatch_peer(peer)


async def _watch(ctx: ServiceContext, user_id: str, ids: list[str], peer: Peer) -> None:
    infos = await ctx.store.info(ids)
    mine = [i for i, info in zip(ids, infos) if info is not None and info["owner"] == user_id]
    ctx.hub.watch(mine, peer)
    done = []
    for task_id, result in zip(mine, await ctx.store.results(mine)):
        if result is not None:
            done.append([task_id, *result])
    for batch in batches(done, lambda row: len(row[2])):
        await ctx.hub.deliver(batch)


def _task_size(row: list[Any]) -> int:
    body, payload = row[2], row[3]
    return (len(body) if body else 0) + (len(payload) if isinstance(payload, bytes) else 64)
