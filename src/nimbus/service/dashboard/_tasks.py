"""The tasks pages: a keyset page of your tasks, filtered, and its live rows.

::

    GET  /tasks?state=&endpoint=&function=&after=   a page (``nimbus.service.listing``)
    GET  /tasks/stream?state=&endpoint=&function=   server-sent events: rows that changed
                                (pushed: ``_live``, a Redis subscription per process)

An admin's page shows every task (the index ``Keys.all_tasks``) and, on its live
stream, a local program's tasks as they are ingested into the SQL history.
"""

from __future__ import annotations

import asyncio
import html
import json
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from nimbus.service.context import ServiceContext
from nimbus.service.dashboard import _live
from nimbus.service.dashboard._html import Html, esc, join, layout, short, when
from nimbus.service.dashboard._routes import (
    PAGE_SIZE,
    Page,
    Route,
    Stream,
    _all_endpoints,
    _html,
    _is_admin,
    _Names,
    _stream,
)
from nimbus.service.history import Query
from nimbus.service.listing import (
    LIVE_WINDOW,
    STATES,
    Filter,
    Row,
    decode_cursor,
    index,
    live_window,
    page,
)
from nimbus.service.registry import EndpointInfo, FunctionInfo, Principal, Registry

__all__ = ["router"]

router = APIRouter(include_in_schema=False, route_class=Route)
CHOICES_SECONDS = 2.0  # how long a viewer's filter choices (endpoints, functions) are reused
TICK = 0.25  # seconds between looks at the live window of an open tasks page, at most


def _filter(request: Request) -> Filter:
    params = request.query_params
    return Filter(
        params.get("state", "")[:64],
        params.get("endpoint", "")[:64],
        params.get("function", "")[:64],
    )


def _row_html(
    task_id: str, state: str, function: str, endpoint: str, *times: str, _e: Any = html.escape
) -> Html:
    """A task's row of the tasks table, every value escaped (``html.escape`` straight:
    rows are most of a page's rendering)."""
    tid = _e(task_id)
    st = _e(state)
    submitted, dispatched, ended = times  # when()'s: nothing to escape
    return Html(
        f'<tr data-task="{tid}"><td><a href="/tasks/{tid}">{_e(short(task_id))}</a></td>'
        f'<td class="state {st}">{st}</td><td>{_e(function)}</td><td>{_e(endpoint)}</td>'
        f"<td>{submitted}</td><td>{dispatched}</td><td>{ended}</td></tr>"
    )


async def _rows_html(names: _Names, rows: list[Row]) -> Html:
    """The table's rows: each function's and endpoint's name looked up once."""
    functions = {f: await names.function(f) for f in {row.function_id for row in rows}}
    endpoints = {e: await names.endpoint(e) for e in {row.endpoint_id for row in rows}}
    return Html(
        "".join(
            _row_html(
                row.task_id, row.state, functions[row.function_id], endpoints[row.endpoint_id],
                when(row.submitted), when(row.dispatched), when(row.ended),
            )
            for row in rows
        )
    )  # fmt: skip


def _choices_of(
    registry: Registry, user_id: str, admin: bool
) -> tuple[list[EndpointInfo], list[FunctionInfo]]:
    endpoints = _all_endpoints(registry) if admin else registry.endpoints(user_id)
    return endpoints, registry.functions(user_id)


async def _choices(
    request: Request, ctx: ServiceContext, user: Principal, admin: bool
) -> tuple[list[EndpointInfo], list[FunctionInfo]]:
    """The endpoints and functions of a viewer's filters, read in one go and reused for
    ``CHOICES_SECONDS`` (one new endpoint or function shows that much later)."""
    cache: dict[tuple[str, bool], Any] = request.app.state.__dict__.setdefault(
        "dashboard_choices", {}
    )
    now = time.monotonic()
    hit = cache.get((user.user_id, admin))
    if hit is not None and hit[0] > now:
        return hit[1]  # type: ignore[no-any-return]
    got = await run_in_threadpool(_choices_of, ctx.registry, user.user_id, admin)
    if len(cache) > 1000:
        cache.clear()
    cache[(user.user_id, admin)] = (now + CHOICES_SECONDS, got)
    return got


def _options(name: str, current: str, choices: list[tuple[str, str]]) -> Html:
    opts = [Html('<option value="">any</option>')]
    for value, label in choices:
        chosen = " selected" if value == current else ""
        opts.append(Html(f'<option value="{esc(value)}"{chosen}>{esc(label)}</option>'))
    return Html(f'<label>{esc(name)} <select name="{esc(name)}">{join(opts)}</select></label> ')


def _unknown(flt: Filter, endpoints: list[EndpointInfo], functions: list[FunctionInfo]) -> str:
    """What is wrong with a filter value none of the choices has ('' if none is)."""
    if flt.state and flt.state not in STATES:
        return f"unknown state {flt.state!r}: choose one of {', '.join(STATES)} (or any)"
    if flt.endpoint and flt.endpoint not in {e.id for e in endpoints}:
        return f"no endpoint {flt.endpoint!r} that you can see: choose one in the list (or any)"
    if flt.function and flt.function not in {f.id for f in functions}:
        return f"no function {flt.function!r} of yours: choose one in the list (or any)"
    return ""


@router.get("/tasks", response_model=None)
async def tasks_page(request: Request, seen: Page) -> Response:
    ctx, who = seen
    user = who.principal
    flt = _filter(request)
    after_text = request.query_params.get("after", "")
    after = decode_cursor(after_text)
    admin = _is_admin(ctx, user)
    key = index(ctx.store, user.user_id, admin)
    (rows, cursor), (endpoints, functions) = await asyncio.gather(
        page(ctx.store, key, flt, after, PAGE_SIZE, None if admin else user.user_id),
        _choices(request, ctx, user, admin),
    )
    names = _Names(ctx, user)
    # the choices are what the viewer sees (an admin: every endpoint, their own
    # functions): those names need no lookup (a thread and a query each)
    names.endpoints.update((e.id, e.name) for e in endpoints)
    names.functions.update((f.id, f.name or f.id) for f in functions)
    body = await _rows_html(names, rows)
    query = {k: v for k, v in vars(flt).items() if v}
    filters = Html(
        '<form method="get" action="/tasks" class="filters">'
        f"{_options('state', flt.state, [(s, s) for s in STATES])}"
        f"{_options('endpoint', flt.endpoint, [(e.id, e.name) for e in endpoints])}"
        f"{_options('function', flt.function, [(f.id, f.name or f.id) for f in functions])}"
        '<button type="submit">Filter</button></form>'
    )
    unknown = _unknown(flt, endpoints, functions)
    if unknown:  # not an empty table: a filter value that matches nothing ever
        said = Html(f'<p class="error">{esc(unknown)}</p>')
        return _html(layout("Tasks", Html(said + filters), user.user_name, who.csrf), 422)
    live = not after_text
    stream = "/tasks/stream?" + urlencode(query)
    table = Html(
        f'<table id="tasks" data-stream="{esc(stream) if live else ""}"><thead><tr>'
        "<th>Task</th><th>State</th><th>Function</th><th>Endpoint</th><th>Submitted</th>"
        f"<th>Dispatched</th><th>Ended</th></tr></thead>"
        f"<tbody>{body}</tbody></table>"
    )
    more = Html("")
    if cursor:
        more = Html(
            f'<p><a id="next" href="/tasks?{esc(urlencode(query | {"after": cursor}))}">'
            "Older tasks</a></p>"
        )
    note = Html('<p id="live" class="live">live</p>' if live else "")
    return _html(layout("Tasks", Html(filters + note + table + more), user.user_name, who.csrf))


@router.get("/tasks/stream", response_model=None)
async def tasks_stream(request: Request, seen: Stream) -> Response:
    ctx, who = seen
    flt = _filter(request)
    names = _Names(ctx, who.principal)
    key = index(ctx.store, who.principal.user_id, names.admin)

    sent: dict[str, tuple[str, float, float]] = {}
    live = _live.changes(request)
    local = live.local  # a local Executor's rows: in the SQL history only

    async def look() -> AsyncIterator[str]:
        nonlocal sent, local
        rows = await live_window(ctx.store, key, flt)
        if names.admin and live.local != local and ctx.store.history is not None:
            local = live.local  # a local program's tasks were ingested: the newest of all
            query = Query(None, flt.state, flt.endpoint, flt.function)
            saved, _ = await asyncio.to_thread(ctx.store.history.page, query, None, LIVE_WINDOW)
            merged = {row.task_id: row for row in (Row(*values) for values in saved)}
            merged.update((row.task_id, row) for row in rows)
            rows = sorted(merged.values(), key=lambda r: (r.score, r.task_id), reverse=True)
            rows = rows[:LIVE_WINDOW]
        for row in reversed(rows):  # oldest first: the page inserts each on top
            seen = (row.state, row.dispatched, row.ended)
            if sent.get(row.task_id) != seen:
                sent[row.task_id] = seen
                yield f"event: task\ndata: {json.dumps(await names.row(row))}\n\n"
        if len(sent) > 4 * len(rows) + 100:
            keep = {row.task_id for row in rows}
            sent = {k: v for k, v in sent.items() if k in keep}

    return _stream(request, ctx, look, TICK, None if names.admin else who.principal.user_id)
