"""The dashboard's task stream: each task as a bar on its worker's lane, live; PNG export.

::

    GET /timeline?endpoint=&group=    the page: a canvas (drawn by static/pages.js) and
                                      a table of the lanes; the newest WINDOW tasks of
                                      your index, or the first WINDOW of one batch (group)
    GET /timeline/stream?...          server-sent events ``spans``: the bars that changed
                                      (first every bar, then the watched tasks each TICK:
                                      the index's live window, or the batch's tasks)
    GET /timeline.png?...             the same bars drawn by matplotlib (Agg), to save

A bar is drawn from what the service keeps of a task, nothing measured for the page:
its submit time (service clock) and, from the record its worker sent when it ended
(``record.worker``, ``started``, ``ended``), its lane and run; a task still running
has no record yet, so it runs on its endpoint's "running" lane from its dispatch until
now; one not dispatched waits on the endpoint's "queued" lane. The queued part of a
bar (submit to start) is light, the run coloured by its end state.

Why the PNG is drawn on the server (matplotlib: the ``netbench`` extra; without
it the export answers 503 saying so, and the page's "Save the canvas" button,
``canvas.toBlob``, still saves what is on screen) rather than only in the browser: the file is the same whatever the window's size and
the page's scroll (every lane, full resolution), it needs no script (a link, ``curl``
with the session cookie), and its look is one function a test checks; the cost is one
request's drawing (see ``bench``: about 0.3 s for WINDOW bars), only when asked.
"""

from __future__ import annotations

import io
import json
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, fields
from typing import Any
from urllib.parse import urlencode

import msgpack
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from nimbus.records import TaskRecord, TaskState
from nimbus.service import listing
from nimbus.service.context import ServiceContext
from nimbus.service.dashboard._html import Html, esc, join, layout, short
from nimbus.service.dashboard._routes import (
    HEADERS,
    Page,
    Route,
    Stream,
    _html,
    _is_admin,
    _Names,
    _stream,
)
from nimbus.service.listing import LIVE_WINDOW, index
from nimbus.service.queues import TaskStore
from nimbus.service.registry import Principal

__all__ = ["Span", "draw_png", "router", "spans"]

router = APIRouter(include_in_schema=False, route_class=Route)
_NAMES = [f.name for f in fields(TaskRecord)]
WINDOW = 1000  # tasks a timeline shows
CHUNK = 250  # tasks one script call reads (Redis runs nothing else meanwhile: ~1-4 ms)
TICK = 0.5  # seconds between looks at the watched tasks of an open timeline
COLOURS = {
    "success": "#16a34a",
    "failed": "#dc2626",
    "cancelled": "#9ca3af",
    "running": "#2563eb",
    "dispatched": "#60a5fa",
    "queued": "#e5e7eb",
}
DONE = {state.value for state in TaskState if state.done}


@dataclass(frozen=True)
class Span:
    """One task's bar: ``lane`` (its worker, or its endpoint's queue), submit ``q0``,
    start ``r0`` and end ``r1`` of its run (0: not yet)."""

    id: str
    lane: str
    state: str
    q0: float
    r0: float
    r1: float


async def _visible_ids(
    ctx: ServiceContext, user: Principal, endpoint: str, group: str
) -> tuple[list[str], list[str]]:
    """The ids the timeline shows (newest first) and those its stream watches."""
    store = ctx.store
    admin = _is_admin(ctx, user)
    if group:
        ids = await listing.group_ids(store, group[:64], WINDOW)
        ids = [
            task_id
            for task_id, got in zip(ids, await _read(ctx.store, ids))
            if got[8] is not None  # its owner: another user's task of the group is not shown
            and (admin or got[8].decode() == user.user_id)
            and (not endpoint or (got[1] or b"").decode() == endpoint)
        ]
        return ids, ids
    key = index(store, user.user_id, admin)
    members = await store.redis.zrevrange(key, 0, WINDOW - 1)
    ids = [m.decode() for m in members]
    return ids, ids[:LIVE_WINDOW]


# One round trip and one small reply for a window: Redis reads each task's fields and
# takes worker, started and ended out of its record (msgpack, positions of
# TaskRecord's fields) itself. A pipeline of WINDOW HMGETs cost redis-py about 0.15 ms
# a command to pack and parse, and decoding WINDOW whole records 30 ms more.
_READ = """
local at = cmsgpack.unpack(ARGV[3])
local out = {}
for i, id in ipairs(cmsgpack.unpack(ARGV[2])) do
  local v = redis.pcall('HMGET', ARGV[1] .. id, 'state', 'endpoint', 'submitted',
                        'dispatched', 'ended', 'record', 'owner')
  if type(v) ~= 'table' or v.err then
    v = {false, false, false, false, false, false, false, false, false}
  else
    v[9] = v[7]
    local ok, rec = false, nil
    if v[6] then ok, rec = pcall(cmsgpack.unpack, v[6]) end
    if ok and type(rec) == 'table' then
      v[6] = rec[at[1]] or false
      v[7] = rec[at[2]] or 0
      v[8] = rec[at[3]] or 0
    else
      v[6], v[7], v[8] = false, 0, 0
    end
  end
  out[i] = v
end
return cmsgpack.pack(out)
"""
_AT = msgpack.packb([_NAMES.index(name) + 1 for name in ("worker", "started", "ended")])
# the queue Redis client -> its registered script (not keeping a client alive)
_scripts: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


async def _read(store: TaskStore, ids: list[str]) -> list[list[Any]]:
    """Each task's state, endpoint, submitted, dispatched, ended, its record's worker,
    started and ended, and its owner (state None: unknown or expired; worker None: no
    record): from Redis, else from the SQL history."""
    if not ids:
        return []
    redis = store.redis
    script = _scripts.get(redis)
    if script is None:
        script = _scripts[redis] = redis.register_script(_READ)
    prefix = store.keys.task("")
    pipe = redis.pipeline(transaction=False)
    for at in range(0, len(ids), CHUNK):  # other clients' commands run between chunks
        await script(keys=[], args=[prefix, msgpack.packb(ids[at : at + CHUNK]), _AT], client=pipe)
    rows: list[list[Any]] = []
    for packed in await pipe.execute():
        rows += msgpack.unpackb(packed, raw=True)
    out = [[None if v is False else v for v in row] for row in rows]
    gone = [task_id for task_id, row in zip(ids, out) if row[0] is None]
    if gone:  # out of Redis (an old batch): the SQL history's
        found = await listing.saved(store, gone)
        for i, task_id in enumerate(ids):
            if out[i][0] is None and (t := found.get(task_id)) is not None:
                out[i] = [
                    t.state.encode(), t.endpoint.encode(), t.submitted, t.dispatched, t.ended,
                    t.worker.encode() or None, t.started, t.run_ended, t.owner.encode(),
                ]  # fmt: skip
    return out


async def spans(ctx: ServiceContext, names: _Names, ids: list[str], endpoint: str) -> list[Span]:
    """The bars of these tasks (those of ``endpoint`` only, if given; expired ones left out)."""
    out: list[Span] = []
    for task_id, got in zip(ids, await _read(ctx.store, ids)):
        if got[0] is None:
            continue
        state, where = got[0].decode(errors="replace"), (got[1] or b"").decode()
        if endpoint and where != endpoint:
            continue
        submitted = float(got[2] or 0)
        worker, started, ended = got[5:8]
        if worker and started:
            lane, r0, r1 = worker.decode(errors="replace"), float(started), float(ended)
        else:
            dispatched, ended = float(got[3] or 0), float(got[4] or 0)  # the service's
            here = await names.endpoint(where)
            if state in DONE:  # cancelled, or failed by the service: no worker said
                lane, r0, r1 = f"{here}: no worker record", dispatched or ended, ended
            elif dispatched:  # its worker is named in its record, at its end
                lane, r0, r1 = f"{here}: running", dispatched, 0.0
            else:
                lane, r0, r1 = f"{here}: queued", 0.0, 0.0
        out.append(Span(task_id, lane, state, submitted, r0, r1))
    return out


def _lanes(bars: list[Span]) -> Html:
    """The lanes as a table: tasks done, running and busy seconds of each worker."""
    lanes: dict[str, list[Span]] = {}
    for bar in bars:
        lanes.setdefault(bar.lane, []).append(bar)
    rows = []
    for lane in sorted(lanes):
        mine = lanes[lane]
        busy = sum(b.r1 - b.r0 for b in mine if b.r0 and b.r1)
        done = sum(b.state in DONE for b in mine)
        rows.append(
            Html(
                f"<tr><td>{esc(lane)}</td><td>{len(mine)}</td><td>{done}</td>"
                f"<td>{len(mine) - done}</td><td>{busy:.2f} s</td></tr>"
            )
        )
    return Html(
        '<table id="lanes"><thead><tr><th>Worker</th><th>Tasks</th><th>Done</th>'
        f"<th>Not done</th><th>Busy</th></tr></thead><tbody>{join(rows)}</tbody></table>"
    )


def _query(request: Request) -> tuple[str, str]:
    params = request.query_params
    return params.get("endpoint", "")[:64], params.get("group", "")[:64]


async def _shown(
    request: Request, ctx: ServiceContext, user: Principal
) -> tuple[list[Span], _Names, str, str]:
    """The bars of what the page and its PNG show (the query's endpoint and batch, as
    ``user`` may see them), the names they use, that endpoint and batch."""
    endpoint, group = _query(request)
    ids, _ = await _visible_ids(ctx, user, endpoint, group)
    names = _Names(ctx, user)
    return await spans(ctx, names, ids, endpoint), names, endpoint, group


@router.get("/timeline", response_model=None)
async def timeline_page(request: Request, seen: Page) -> Response:
    ctx, who = seen
    user = who.principal
    bars, names, endpoint, group = await _shown(request, ctx, user)
    query = urlencode({k: v for k, v in (("endpoint", endpoint), ("group", group)) if v})
    what = f"batch {short(group)}" if group else f"the newest {WINDOW} tasks"
    if endpoint:
        what += f" on {await names.endpoint(endpoint)}"
    legend = join(
        Html(f'<span class="key" data-colour="{esc(c)}">{esc(s)}</span> ')
        for s, c in COLOURS.items()
    )
    body = Html(
        f'<p id="live" class="live">live</p><p>Each task of {esc(what)} on its worker: '
        f"queued (light), then its run, coloured by state. {legend}"
        f'<a id="png" href="/timeline.png?{esc(query)}" download="timeline.png">'
        'Export PNG</a> <button type="button" id="png-canvas">Save the canvas</button></p>'
        f'<canvas id="timeline" width="1100" height="300" '
        f'data-stream="/timeline/stream?{esc(query)}" data-colours="{esc(json.dumps(COLOURS))}">'
        "</canvas>"
        f"<h2>Workers</h2>{_lanes(bars)}"
    )
    return _html(layout("Timeline", body, user.user_name, who.csrf, ("pages.js",)))


@router.get("/timeline/stream", response_model=None)
async def timeline_stream(request: Request, seen: Stream) -> Response:
    ctx, who = seen
    user = who.principal
    endpoint, group = _query(request)
    names = _Names(ctx, user)

    admin = _is_admin(ctx, user)
    key = index(ctx.store, user.user_id, admin)

    sent: dict[str, Span] = {}
    todo: list[str] = []
    watched: list[str] = []
    first = True

    async def look() -> AsyncIterator[str]:
        """Every bar once, then, each time the user's tasks moved (pushed: ``_stream``),
        the watched tasks not yet ended (a batch's tasks, read once; else the index's
        newest LIVE_WINDOW, read each time)."""
        nonlocal sent, todo, watched, first
        if first:
            todo, watched = await _visible_ids(ctx, user, endpoint, group)
        elif not group:
            newest = await ctx.store.redis.zrevrange(key, 0, LIVE_WINDOW - 1)
            watched = [member.decode() for member in newest]
        if len(sent) > 4 * WINDOW:
            sent = {k: sent[k] for k in watched if k in sent}
        if not first:
            todo = [i for i in watched if i not in sent or sent[i].r1 == 0]
        changed = [s for s in await spans(ctx, names, todo, endpoint) if sent.get(s.id) != s]
        if first or changed:
            for bar in changed:
                sent[bar.id] = bar
            data = json.dumps({"now": time.time(), "spans": [asdict(s) for s in changed]})
            yield f"event: spans\ndata: {data}\n\n"
        first = False

    return _stream(request, ctx, look, TICK, None if admin else user.user_id)


def _boxes(parts: list[tuple[float, float, float, float]]) -> Any:
    """Rectangles (x, width, y, height) as an array of corners, shape (n, 4, 2)."""
    import numpy as np

    x, w, y, h = np.array(parts, dtype=float).T
    return np.stack([np.c_[x, y], np.c_[x + w, y], np.c_[x + w, y + h], np.c_[x, y + h]], 1)


def draw_png(bars: list[Span], now: float, title: str) -> bytes:
    """The bars as a PNG: a lane per worker (matplotlib, the Agg backend, no display).
    One PolyCollection a colour (``broken_barh`` a lane costs ~1 ms a bar in units)."""
    from matplotlib.collections import PolyCollection  # imported on the first export
    from matplotlib.figure import Figure

    lanes = sorted({bar.lane for bar in bars})
    row = {lane: i for i, lane in enumerate(lanes)}
    height = 1.5 + 0.3 * max(1, len(lanes))  # inches
    fig = Figure(figsize=(12, height), dpi=100)
    fig.subplots_adjust(left=0.24, right=0.98, bottom=0.7 / height, top=1 - 0.45 / height)
    ax = fig.add_subplot()
    start = min((bar.q0 for bar in bars if bar.q0), default=now)
    parts: dict[str, list[tuple[float, float, float, float]]] = {}
    for bar in bars:
        y = row[bar.lane]
        begin = bar.r0 or now
        if bar.q0 and begin > bar.q0:
            parts.setdefault("queued", []).append((bar.q0 - start, begin - bar.q0, y - 0.4, 0.8))
        if bar.r0:
            run = (bar.r0 - start, (bar.r1 or now) - bar.r0, y - 0.33, 0.66)
            parts.setdefault(bar.state, []).append(run)
    for state in ["queued", *sorted(set(parts) - {"queued"})]:  # runs over their waits
        if state in parts:
            colour = COLOURS.get(state, "#6b7280")
            edge = "none" if state == "queued" else "white"
            boxes = PolyCollection(
                _boxes(parts[state]),
                closed=False,
                facecolors=colour,
                edgecolors=edge,
                linewidths=0.3,
            )
            ax.add_collection(boxes)
    end = max([now if not b.r1 and (b.r0 or b.q0) else b.r1 for b in bars] or [now])
    ax.set_xlim(0, max(end - start, 0.001) * 1.02)
    ax.set_yticks(range(len(lanes)), [lane[-40:] for lane in lanes], fontsize=8)
    ax.set_ylim(-0.6, max(1, len(lanes)) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first submit")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return out.getvalue()


@router.get("/timeline.png", response_model=None)
async def timeline_png(request: Request, seen: Stream) -> Response:
    ctx, who = seen
    bars, _, _, group = await _shown(request, ctx, who.principal)
    lanes = len({bar.lane for bar in bars})
    title = f"nimbus: {len(bars)} tasks on {lanes} lanes" + (f", batch {group}" if group else "")
    try:
        png = await run_in_threadpool(draw_png, bars, time.time(), title)
    except ImportError:
        message = (
            "the PNG export is drawn by matplotlib, which is not installed with this "
            "service: pip install 'nimbus[netbench]' (or save the page's canvas)"
        )
        return Response(message, 503, media_type="text/plain", headers=HEADERS)
    headers = HEADERS | {"Content-Disposition": 'attachment; filename="timeline.png"'}
    return Response(png, media_type="image/png", headers=headers)
