"""The dashboard's endpoint pages: the list, and one endpoint's blocks, managers and workers.

::

    GET /                       endpoints you can use: online, heartbeat age, workers busy
                                and idle, blocks, queued (a row each: HGETALL status + LLEN)
    GET /endpoints/{id}         one endpoint: its status, blocks and their scheduler state,
                                managers, workers busy/idle per environment; links to its
                                tasks and timeline; the share form (its owner only)
    GET /endpoints/{id}/stream  server-sent events: the same, when a heartbeat changed it

What a page shows of blocks, managers and workers is the ``runtime`` the endpoint's
daemon put in its last heartbeat (``Beat.runtime``; the service keeps the last one in
the endpoint's status hash), never asked of the endpoint for the page. An endpoint
you neither own nor see shared or public is 404; the admin sees every one.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from nimbus.errors import NotFound
from nimbus.service.context import ServiceContext
from nimbus.service.dashboard import _live, _session
from nimbus.service.dashboard._html import Html, age, esc, join, layout
from nimbus.service.dashboard._routes import (
    HEADERS,
    KEEPALIVE,
    RECHECK,
    Page,
    Route,
    Stream,
    _endpoints,
    _html,
    _is_admin,
)
from nimbus.service.registry import EndpointInfo, Principal

__all__ = ["router", "visible_endpoint"]

router = APIRouter(include_in_schema=False, route_class=Route)
TICK = 1.0  # seconds between looks at an open endpoint page's status, at most


async def visible_endpoint(ctx: ServiceContext, user: Principal, endpoint_id: str) -> EndpointInfo:
    """The endpoint if ``user`` sees it (own, shared, public; any for the admin); NotFound."""
    if _is_admin(ctx, user):
        info = await run_in_threadpool(ctx.registry.endpoint, endpoint_id[:64])
        if info is None:
            raise NotFound(f"endpoint {endpoint_id[:64]} not found", 404)
        return info
    return await ctx.endpoint(user, endpoint_id[:64])


async def _state(ctx: ServiceContext, info: EndpointInfo) -> dict[str, Any]:
    """What the pages show of an endpoint: its status and the runtime of its last beat."""
    status = await ctx.endpoint_status(info)
    raw = await ctx.store.redis.hget(ctx.store.keys.endpoint_status(info.id), "runtime")
    try:
        rows = json.loads(raw) if raw else []
    except ValueError:
        rows = []
    beat = float(status["last_heartbeat"])  # type: ignore[arg-type]
    return {
        "online": bool(status["online"]),
        "heartbeat": age(time.time() - beat if beat else None),
        "agents": status["agents"],
        "workers": status["workers"],
        "queued": status["queued"],
        "python": status["python"],
        "blocks": [r for r in rows if r.get("kind") == "block"],
        "managers": [r for r in rows if r.get("kind") == "manager"],
        "pools": [r for r in rows if r.get("kind") == "workers"],
    }


def _busy(state: dict[str, Any]) -> tuple[int, int]:
    pools = state["pools"] if state["online"] else []
    return sum(int(p.get("busy", 0)) for p in pools), sum(int(p.get("idle", 0)) for p in pools)


def _cells(values: list[object]) -> Html:
    return join(Html(f"<td>{esc(v)}</td>") for v in values)


def _table(table_id: str, head: list[str], rows: list[list[object]], empty: str) -> Html:
    if not rows:
        return Html(f'<p id="{esc(table_id)}" class="empty">{esc(empty)}</p>')
    return Html(
        f'<table id="{esc(table_id)}"><thead><tr>'
        + join(Html(f"<th>{esc(h)}</th>") for h in head)
        + "</tr></thead><tbody>"
        + join(Html(f"<tr>{_cells(r)}</tr>") for r in rows)
        + "</tbody></table>"
    )


BLOCK_HEAD = ["Block", "Scheduler state", "Nodes", "Managers", "Busy", "Walltime left", "Note"]
MANAGER_HEAD = ["Manager", "Node", "Block", "Workers", "Busy", "Taking tasks"]
POOL_HEAD = ["Manager", "Environment", "Workers", "Busy", "Idle"]


def _rows(state: dict[str, Any]) -> dict[str, list[list[object]]]:
    """The three tables' rows (as the stream sends them, and the page draws them)."""
    left = lambda v: "" if v is None else f"{v} s"  # noqa: E731
    return {
        "blocks": [
            [b.get("id"), b.get("state"), b.get("nodes"), b.get("managers"), b.get("busy"),
             left(b.get("walltime_left")), b.get("message")]
            for b in state["blocks"]
        ],
        "managers": [
            [m.get("name"), m.get("node"), m.get("block"), m.get("workers"), m.get("busy"),
             "yes" if m.get("accepting") else "no (draining)"]
            for m in state["managers"]
        ],
        "pools": [
            [p.get("manager"), p.get("environment") or "any", p.get("workers"), p.get("busy"),
             p.get("idle")]
            for p in state["pools"]
        ],
    }  # fmt: skip


@router.get("/", response_model=None)
async def endpoints_page(request: Request, seen: Page) -> Response:
    ctx, who = seen
    user = who.principal
    rows = []
    for info in await _endpoints(ctx, user):
        state = await _state(ctx, info)
        online = state["online"]
        busy, idle = _busy(state)
        link = f"/endpoints/{info.id}"
        rows.append(
            Html(
                f'<tr data-endpoint="{esc(info.id)}"><td><a href="{esc(link)}">'
                f"{esc(info.name)}</a></td><td>{esc(info.owner)}</td>"
                f'<td class="{"online" if online else "offline"}">'
                f"{'online' if online else 'offline'}</td>"
                + _cells(
                    [
                        state["heartbeat"],
                        state["workers"],
                        busy,
                        idle,
                        len(state["blocks"]),
                        state["agents"],
                        state["queued"],
                        state["python"],
                    ]
                )
                + "</tr>"
            )
        )
    table = Html(
        '<table id="endpoints"><thead><tr><th>Endpoint</th><th>Owner</th><th>State</th>'
        "<th>Heartbeat</th><th>Workers</th><th>Busy</th><th>Idle</th><th>Blocks</th>"
        "<th>Agents</th><th>Queued</th><th>Python</th>"
        f"</tr></thead><tbody>{join(rows)}</tbody></table>"
        if rows
        else "<p>No endpoints yet: <code>nimbus endpoint start NAME</code>.</p>"
    )
    return _html(layout("Endpoints", table, user.user_name, who.csrf))


def _share_form(info: EndpointInfo, csrf: str) -> Html:
    """Share with a user, or stop sharing (the owner's page only); POST with the CSRF token."""
    action = f"/endpoints/{info.id}/share"
    stop = join(
        Html(
            f'<li>{esc(name)} <form method="post" action="{esc(action)}" class="inline">'
            f'<input type="hidden" name="csrf" value="{esc(csrf)}">'
            f'<input type="hidden" name="remove" value="{esc(name)}">'
            f'<button type="submit">Stop sharing</button></form></li>'
        )
        for name in info.shared_with
    )
    return Html(
        f'<h2>Sharing</h2><ul id="shared">{stop}</ul>'
        f'<form method="post" action="{esc(action)}" id="share" class="filters">'
        f'<input type="hidden" name="csrf" value="{esc(csrf)}">'
        '<label>User <input type="text" name="user" required maxlength="200"></label> '
        '<button type="submit">Share</button></form>'
    )


@router.get("/endpoints/{endpoint_id}", response_model=None)
async def endpoint_page(request: Request, endpoint_id: str, seen: Page) -> Response:
    ctx, who = seen
    user = who.principal
    try:
        info = await visible_endpoint(ctx, user, endpoint_id)
    except NotFound as exc:
        return _html(layout("Not found", esc(str(exc)), user.user_name, who.csrf), 404)
    state = await _state(ctx, info)
    tables = _rows(state)
    online = state["online"]
    facts = [
        ("Endpoint", info.name),
        ("Id", info.id),
        ("Owner", info.owner),
        ("Public", "yes" if info.public else "no"),
        ("Shared with", ", ".join(info.shared_with) or "nobody"),
        ("Python", state["python"]),
    ]
    live = [
        ("state", "online" if online else "offline"),
        ("heartbeat", state["heartbeat"]),
        ("agents", state["agents"]),
        ("workers", state["workers"]),
        ("queued", state["queued"]),
    ]
    tasks = "/tasks?" + urlencode({"endpoint": info.id})
    timeline = "/timeline?" + urlencode({"endpoint": info.id})
    body = Html(
        '<p id="live" class="live">live</p>'
        f'<p><a id="endpoint-tasks" href="{esc(tasks)}">Its tasks</a> '
        f'<a id="endpoint-timeline" href="{esc(timeline)}">Its timeline</a></p>'
        f'<table id="endpoint" class="record" data-stream="/endpoints/{esc(info.id)}/stream">'
        + join(Html(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>") for k, v in facts)
        + join(
            Html(f'<tr><th>{esc(k.capitalize())}</th><td data-field="{k}">{esc(v)}</td></tr>')
            for k, v in live
        )
        + "</table><h2>Blocks</h2>"
        + _table("blocks", BLOCK_HEAD, tables["blocks"], "No blocks: its workers are local.")
        + "<h2>Managers</h2>"
        + _table("managers", MANAGER_HEAD, tables["managers"], "No manager reported yet.")
        + "<h2>Workers per environment</h2>"
        + _table("pools", POOL_HEAD, tables["pools"], "No workers reported yet.")
        + "<p>As the endpoint's last heartbeat said"
        + ("" if online else " (offline: the last one it sent)")
        + ".</p>"
    )
    if info.owner_id == user.user_id:
        body = Html(body + _share_form(info, who.csrf))
    return _html(layout(f"Endpoint {info.name}", body, user.user_name, who.csrf, ("pages.js",)))


@router.get("/endpoints/{endpoint_id}/stream", response_model=None)
async def endpoint_stream(request: Request, endpoint_id: str, seen: Stream) -> Response:
    ctx, who = seen
    try:
        info = await visible_endpoint(ctx, who.principal, endpoint_id)
    except NotFound:
        return Response(status_code=404, headers=HEADERS)

    live = _live.changes(request)  # its summary and connections are published (ws.py)

    async def events() -> Any:
        async with live.watching():
            async for frame in look():
                yield frame

    async def look() -> Any:  # read when its summary or connections changed, or tasks moved
        sent: dict[str, Any] = {}
        checked = beat = time.monotonic()
        shown = -1
        yield "retry: 1000\n\n"
        drawn = 0.0
        while not ctx.hub.closing:
            if live.mark(None) != shown:  # nothing is read while nothing changed
                shown, drawn = live.mark(None), time.monotonic()
                state = await _state(ctx, info)
                view = {
                    "state": "online" if state["online"] else "offline",
                    **{k: state[k] for k in ("heartbeat", "agents", "workers", "queued")},
                    **_rows(state),
                }
                if view != sent:
                    sent = view
                    yield f"event: endpoint\ndata: {json.dumps(view)}\n\n"
            now = time.monotonic()
            if now - beat > KEEPALIVE:
                beat = now
                yield ": keepalive\n\n"
            if now - checked > RECHECK:  # still logged in, and still shown the endpoint
                checked = now
                viewer = await _session.viewer(request, ctx)
                if viewer is None:
                    return
                try:
                    await visible_endpoint(ctx, viewer.principal, endpoint_id)
                except NotFound:  # no longer shared with them, or made private
                    return
            wait = min(beat + KEEPALIVE, checked + RECHECK) - time.monotonic()
            if await live.wait(None, shown, max(0.1, wait)) != shown:  # at most once a TICK
                await asyncio.sleep(max(0.0, drawn + TICK - time.monotonic()))

    return StreamingResponse(events(), media_type="text/event-stream", headers=HEADERS)
