"""The service's two WebSockets: endpoint agents pull tasks, clients stream results.

An agent connection (``/v1/ws/endpoint``, an endpoint token) says hello, then
a dispatcher keeps up to ``window`` of its endpoint's tasks in flight on it;
results are stored (first wins), acknowledged, and delivered to the clients
that wait. A connection silent for three heartbeats is closed, and its tasks
in flight go back to the head of the endpoint's queue. A frame that is not a
well-formed message closes its connection with a code and reason and one log
line (the messages are ``nimbus.protocol``'s dataclasses); a task whose stored record is broken fails
alone, and a dispatcher that fails is started again. A task whose function was
deleted, or is no longer shared with its submitter, fails instead of being sent
(an agent may still hold the function from an earlier task).

A client's ``watch`` is answered with the results already stored and an
``unknown`` message naming the tasks the service does not know (lost when the
queue Redis restarted empty, or expired); after such a restart
:func:`tell_lost` sends every client the same for the tasks it waits on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from nimbus import serialization
from nimbus.errors import NimbusError, PayloadTooLargeError, ProtocolError, ServiceError
from nimbus.protocol import (
    WRONG_SHAPE,
    Accepted,
    Ack,
    Beat,
    Cancel,
    DataRef,
    Hello,
    Malformed,
    Message,
    Ordered,
    Refused,
    Result,
    ResultRow,
    Results,
    Running,
    Submit,
    TaskRow,
    Tasks,
    Unknown,
    Watch,
    batches,
    decode_frame,
    new_row,
    pack,
)
from nimbus.records import TaskRecord, TaskState
from nimbus.runtime.messages import Status
from nimbus.service.context import ServiceContext
from nimbus.service.counters import measures
from nimbus.service.hub import Peer
from nimbus.service.registry import hash_token
from nimbus.service.tasks import after_of, cancel_tasks, row_of, submit_tasks
from nimbus.service.wakeups import deliver_stored

__all__ = ["agent_socket", "client_socket", "tell_lost"]

log = logging.getLogger(__name__)
TAKE_MAX = 2000
IDLE_POLL = 5.0  # seconds; submits in this process wake a dispatcher at once
BEAT_SAVE_SECONDS = 10.0
COALESCE = 0.002  # with work in flight, wait this long to gather more into one message
STOP_SECONDS = 2.0  # a dispatcher gets this long to stop when its connection ends
RESTART_MAX = 5.0  # seconds between restarts of a dispatcher that keeps failing
DONE_STATES = frozenset(state for state in TaskState if state.done)
LOST_CHUNK = 10_000  # task ids looked up, or named in one "unknown" message
AGENT_SENDS: dict[str, type[Message]] = {
    kind.op: kind for kind in (Results, Running, Beat, Ordered)
}
CLIENT_SENDS: dict[str, type[Message]] = {kind.op: kind for kind in (Submit, Watch, Cancel)}


def bearer(headers: Any) -> str | None:
    value: str = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def _refuse(ws: WebSocket, exc: ServiceError) -> None:
    await ws.close(code=4000 + (exc.status or 400), reason=str(exc)[:120])


async def _receive(ws: WebSocket, kinds: dict[str, type[Message]]) -> dict[str, Any]:
    """The next frame as a msgpack map with an op of ``kinds``; ProtocolError otherwise."""
    message = await ws.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    text = message.get("text")
    return decode_frame(text if text is not None else message.get("bytes"), kinds)


async def _close_malformed(ws: WebSocket, exc: ProtocolError, who: str) -> None:
    """Answer a malformed frame: one log line, a close frame with its code and reason."""
    log.warning("closing %s: malformed frame: %s", who, exc)
    reason = str(exc).encode()[:120].decode(errors="ignore")  # a close reason has 123 bytes
    with contextlib.suppress(Exception):
        await ws.close(code=exc.code, reason=reason)


def _results(msg: dict[str, Any]) -> list[ResultRow]:
    """A daemon's result rows: each finished, with a result as sent (or a data-store
    reference); ProtocolError naming the first row that is not."""
    rows = Results.decode(msg).results
    for i, row in enumerate(rows):
        if isinstance(row, Malformed):
            raise row.error
        if row.state not in DONE_STATES or type(row.result) is bytes:
            raise ProtocolError(
                f"results.results[{i}]: expected [task_id, success|failed|cancelled, "
                f"[status, data, buffers] | {{data: id}}, record], got {list(row)!r:.60}",
                WRONG_SHAPE,
            )
    return rows  # type: ignore[return-value]


def _stored(row: ResultRow) -> list[Any]:
    """A result row as the task store keeps it: ``[task_id, state, result, record, data_id,
    measures]`` with the result and record packed (``measures``: what the counters read)."""
    result = row.result
    assert not isinstance(result, bytes)
    data_id = result.data_id if isinstance(result, DataRef) else ""
    record = row.record
    return [row.task_id, row.state.value, pack(result), pack(record), data_id, measures(record)]


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
    who = f"an agent of endpoint {endpoint_id}"
    await ws.accept()
    silence = 3 * ctx.settings.heartbeat
    try:
        hello = Hello.decode(await asyncio.wait_for(_receive(ws, {"hello": Hello}), silence))
        python, serializer, workers, window, can = (
            hello.python,
            hello.serializer,
            hello.workers,
            hello.window,
            hello.can,
        )
    except WebSocketDisconnect:
        return
    except TimeoutError:  # connected and silent: it holds a connection for nothing
        log.warning("closing %s: no hello in %.1f s", who, silence)
        with contextlib.suppress(Exception):
            await ws.close(code=WRONG_SHAPE, reason=f"no hello in {silence:.1f} s")
        return
    except ProtocolError as exc:
        await _close_malformed(ws, exc, who)
        return
    conn_id = uuid.uuid4().hex
    peer = Peer(conn_id, ws.send_bytes, digest=hash_token(token or ""), close=ws.close)
    await ctx.store.set_status(
        endpoint_id,
        python=python,
        serializer=serializer,
        workers=workers,
        last_heartbeat=repr(time.time()),
    )
    ctx.versions[endpoint_id] = (python, serializer)
    ctx.orders.joined(conn_id, can)  # environment orders only to an agent that knows them
    ctx.hub.add_agent(endpoint_id, peer)
    await ctx.store.endpoint_changed(endpoint_id)  # its open dashboard pages read it again
    sent: set[str] = set()
    room = asyncio.Event()
    dispatcher = asyncio.create_task(
        _supervised(
            f"the dispatcher of endpoint {endpoint_id}",
            lambda: _dispatch(ctx, endpoint_id, peer, window, sent, room),
            lambda: not peer.closed,
        )
    )
    saved = time.time()
    last_held = ""
    last_runtime: list[dict[str, Any]] | None = None
    malformed: ProtocolError | None = None
    try:
        while True:
            msg = await asyncio.wait_for(_receive(ws, AGENT_SENDS), silence)
            op = msg["op"]
            if op == "results":
                rows = _results(msg)
                done, drop = await ctx.store.finish(endpoint_id, [_stored(r) for r in rows])
                ctx.data.drop(drop)
                stored = set(done)
                ids = [row.task_id for row in rows]
                sent.difference_update(ids)
                room.set()
                await ctx.hub.deliver([row for row in rows if row.task_id in stored])
                await peer.send(Ack(ids).encode())
            elif op == "running":
                await ctx.store.running(endpoint_id, Running.decode(msg).ids)
            elif op == "ordered":
                ctx.orders.answered(conn_id, Ordered.decode(msg))
            elif op == "beat":
                beat = Beat.decode(msg)
                await peer.send(Beat(beat.t).encode())
                if beat.environments is not None:  # what its nodes hold, for `environments list`
                    held = json.dumps(beat.environments, separators=(",", ":"))
                    if held != last_held:
                        last_held = held
                        await ctx.store.set_status(endpoint_id, environments=held)
                if beat.orders:  # how its nodes do with environment orders
                    ctx.orders.heard(endpoint_id, beat.orders)
                if beat.runtime is not None and beat.runtime != last_runtime:
                    last_runtime = beat.runtime  # blocks, managers, workers: for the dashboard
                    await ctx.store.set_status(
                        endpoint_id, runtime=json.dumps(beat.runtime, separators=(",", ":"))
                    )
                    await ctx.store.endpoint_changed(endpoint_id)
                now = time.time()
                ctx.hub.beats[endpoint_id] = now
                if now - saved > BEAT_SAVE_SECONDS:  # Redis keeps it for a restart
                    saved = now
                    await ctx.store.set_status(endpoint_id, last_heartbeat=repr(now))
    except (WebSocketDisconnect, TimeoutError):
        pass
    except ProtocolError as exc:
        malformed = exc
    except Exception:
        log.exception("agent connection %s of endpoint %s failed", conn_id, endpoint_id)
    finally:
        # the dispatcher stops first, and by itself too (a cancel that meets a wake-up
        # inside wait_for is lost on Python 3.11): it sees peer.closed when it wakes
        peer.closed = True
        room.set()
        ctx.hub.work_arrived(endpoint_id)
        dispatcher.cancel()
        await asyncio.wait({dispatcher}, timeout=STOP_SECONDS)
        if not dispatcher.done():
            log.warning("the dispatcher of connection %s did not stop in time", conn_id)
        ctx.hub.drop_agent(endpoint_id, peer)
        ctx.orders.left(conn_id)
        if await ctx.store.requeue(endpoint_id, conn_id):
            ctx.hub.work_arrived(endpoint_id)
        with contextlib.suppress(Exception):  # the queue Redis may be what went away
            await ctx.store.endpoint_changed(endpoint_id)
        if malformed is not None:
            await _close_malformed(ws, malformed, f"{who} (connection {conn_id})")
        with contextlib.suppress(Exception):
            await ws.close()


async def _supervised(
    what: str, run: Callable[[], Awaitable[None]], wanted: Callable[[], bool]
) -> None:
    """Run ``run()`` while ``wanted()``; if it fails, log it and start it again (backing off)."""
    backoff = 0.1
    while wanted():
        try:
            await run()
            return
        except Exception:
            log.exception("%s failed; restarting it in %.1f s", what, backoff)
        await asyncio.sleep(backoff)
        backoff = min(RESTART_MAX, backoff * 2)


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
        taken, broken = await ctx.store.take(endpoint_id, peer.conn_id, min(free, TAKE_MAX))
        failed: list[tuple[str, str, Exception]] = [
            (t, fn, _broken(endpoint_id, t, why)) for t, fn, why in broken
        ]
        refused: dict[tuple[str, str], str | None] = {}  # (owner, function): why not, or None
        rows = []
        for row in taken:
            task_id, function_id, owner = row[0], row[1], row[5]
            if (owner, function_id) not in refused:
                refused[owner, function_id] = await ctx.unrunnable(owner, function_id)
            why = refused[owner, function_id]
            if why is None:
                rows.append(row)
            else:
                failed.append((task_id, function_id, ServiceError(why, 410)))
        if failed:
            await _fail_tasks(ctx, endpoint_id, failed)
        if not rows:
            if not failed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), IDLE_POLL)
            continue
        out = []
        for task_id, function_id, payload, timeout, data_id, owner, environment in rows:
            body: bytes | None = None
            if function_id not in known:
                try:
                    body = await ctx.function_body(function_id)
                except NimbusError:
                    body = b""  # deleted since: the agent fails the task with a clear error
                known.add(function_id)
            sent_payload = DataRef(data_id) if data_id else payload
            out.append(
                new_row(
                    TaskRow,
                    (task_id, function_id, body, sent_payload, timeout, environment, owner or None),
                )
            )
            sent.add(task_id)
        for batch in batches(out, _task_size):
            await peer.send(Tasks(batch).encode())


def _broken(endpoint_id: str, task_id: str, why: str) -> ProtocolError:
    """The error of a task whose stored record cannot be read (logged)."""
    log.warning(
        "task %s of endpoint %s has a broken record (%s): failed", task_id, endpoint_id, why
    )
    return ProtocolError(
        f"task {task_id} could not be sent to its endpoint: its stored record is broken "
        f"({why}); submit it again"
    )


async def _fail_tasks(
    ctx: ServiceContext, endpoint_id: str, failed: list[tuple[str, str, Exception]]
) -> None:
    """Fail taken tasks ``(task_id, function_id, error)`` that are not to be sent, as an
    agent fails a task (their quota given back, whoever waits told); go on."""
    rows = []
    for task_id, function_id, error in failed:
        result = Result(Status.ERROR, serialization.dumps_exception(error, ""))
        record = TaskRecord(task_id, TaskState.FAILED, function=function_id).to_wire()
        rows.append(ResultRow(task_id, TaskState.FAILED, result, record))
    done, drop = await ctx.store.finish(endpoint_id, [_stored(r) for r in rows])
    ctx.data.drop(drop)
    stored = set(done)
    await ctx.hub.deliver([row for row in rows if row.task_id in stored])


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

    def watching(ids: list[str]) -> None:  # before they are queued: a held task may fail at once
        ctx.hub.watch(ids, peer)

    try:
        while True:
            msg = await _receive(ws, CLIENT_SENDS)
            op = msg["op"]
            if op == "submit":
                ref = msg.get("ref")
                try:  # a malformed submit is refused (422 naming the field), not closed
                    submit = Submit.decode(msg)
                    endpoint_id = submit.endpoint_id
                    rows = [row_of(row) for row in submit.tasks]
                    group_id, ids = await submit_tasks(
                        ctx, user, endpoint_id, rows, after_of(submit.tasks), watching
                    )
                except (ServiceError, PayloadTooLargeError) as exc:
                    status = exc.status if isinstance(exc, ServiceError) else 413
                    await peer.send(Refused(ref, status or 422, str(exc)).encode())
                    continue
                ctx.hub.watch(ids, peer)
                ctx.hub.work_arrived(endpoint_id)  # results may overtake this reply: clients wait
                await peer.send(Accepted(ref, ids, group_id).encode())
            elif op == "watch":
                await _watch(ctx, user.user_id, Watch.decode(msg).ids, peer)
            elif op == "cancel":
                await cancel_tasks(ctx, user, Cancel.decode(msg).ids)
    except WebSocketDisconnect:
        pass
    except ProtocolError as exc:
        await _close_malformed(ws, exc, f"a client of user {user.user_name}")
    finally:
        peer.closed = True
        ctx.hub.unwatch_peer(peer)


async def _watch(ctx: ServiceContext, user_id: str, ids: list[str], peer: Peer) -> None:
    """Watch the user's tasks ``ids``: their stored results now, the others when they
    finish; the tasks the service does not know (or not as theirs) are named ``unknown``."""
    infos = await ctx.store.info(ids)
    mine = [i for i, info in zip(ids, infos) if info is not None and info["owner"] == user_id]
    if len(mine) < len(ids):
        known = set(mine)
        unknown = [i for i in dict.fromkeys(ids) if i not in known]
        for start in range(0, len(unknown), LOST_CHUNK):
            await peer.send(Unknown(unknown[start : start + LOST_CHUNK]).encode())
    ctx.hub.watch(mine, peer)
    await deliver_stored(ctx, mine)


async def tell_lost(ctx: ServiceContext) -> int:
    """The queue Redis restarted (empty without ``--persist``): tell each client the
    tasks it waits on that the service no longer knows (``unknown``); how many."""
    watched = list(ctx.hub.watchers.items())
    lost: dict[Peer, list[str]] = defaultdict(list)
    for start in range(0, len(watched), LOST_CHUNK):
        chunk = watched[start : start + LOST_CHUNK]
        infos = await ctx.store.info([task_id for task_id, _ in chunk])
        for (task_id, peer), info in zip(chunk, infos):
            if info is None and ctx.hub.watchers.get(task_id) is peer:
                del ctx.hub.watchers[task_id]
                lost[peer].append(task_id)
    for peer, ids in lost.items():
        for start in range(0, len(ids), LOST_CHUNK):
            await peer.send(Unknown(ids[start : start + LOST_CHUNK]).encode())
    total = sum(len(ids) for ids in lost.values())
    if total:
        log.warning(
            "%d tasks that %d clients waited for were lost with the task queues; they were told",
            total,
            len(lost),
        )
    return total


def _task_size(row: TaskRow) -> int:
    body, payload = row.body, row.payload
    return (len(body) if body else 0) + (len(payload) if isinstance(payload, bytes) else 64)
