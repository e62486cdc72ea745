"""The dashboard's routes: login, endpoints, tasks (paged, live), a task, static files.

::

    GET  /login, POST /login, POST /logout          _session (cookie, CSRF)
    GET  /, /endpoints/{id}     endpoints: _endpoints; a task: _task; the timeline: _timeline
    GET  /directory             messaging instances: _directory; POST buttons: _actions
    GET  /tasks?state=&endpoint=&function=&after=   a keyset page of your tasks
    GET  /tasks/stream?state=&endpoint=&function=   server-sent events: rows that changed
                                (pushed: ``_live``, a Redis subscription per process)
    GET  /network?endpoint=&after=  your tasks' bytes and throughput; endpoints' totals
    GET  /batches, /batches/stream  progress of your recent batches (live: events)
    GET  /static/{name}         the JS and CSS in this package

Without a session a page answers 303 to /login (the stream and static files
excepted: 401, and files that hold nothing of anyone's). Another user's task is
404, as in the API. A user named in ``NIMBUS_SERVICE_ADMINS`` sees every endpoint
and every task (the index ``Keys.all_tasks``). Every response carries a Content-Security-Policy allowing
scripts from this origin only, so even markup that slipped through would not run.
"""

from __future__ import annotations

import asyncio
import html
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from importlib import resources
from typing import Annotated, Any, NamedTuple
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from nimbus.errors import AuthError, NotFound
from nimbus.service import metrics
from nimbus.service.context import ServiceContext
from nimbus.service.dashboard import _batches, _live, _network, _session
from nimbus.service.dashboard._html import Html, esc, join, layout, when
from nimbus.service.dashboard._tasks import (
    LIVE_WINDOW,
    STATES,
    Filter,
    Row,
    decode_cursor,
    index,
    live_window,
    page,
)
from nimbus.service.history import Query
from nimbus.service.registry import EndpointInfo, FunctionInfo, Principal, Registry
from nimbus.service.tables import Endpoint

__all__ = ["router"]

router = APIRouter(include_in_schema=False)
PAGE_SIZE = 50
CHOICES_SECONDS = 2.0  # how long a viewer's filter choices (endpoints, functions) are reused
TICK = 0.25  # seconds between looks at the live window of an open tasks page, at most
BATCH_TICK = 1.0  # seconds between looks at the batches of an open batches page, at most
WAKE = 1.0  # seconds an idle stream sleeps between checks that the service is stopping
RECHECK = 5.0  # seconds between checks that a stream's session still holds
KEEPALIVE = 15.0
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # no-referrer would make Origin "null" on POSTs
    "Cache-Control": "no-store",
}
STATIC = {
    "dashboard.js": "text/javascript",
    "pages.js": "text/javascript",
    "dashboard.css": "text/css",
}


def _is_admin(ctx: ServiceContext, user: Principal) -> bool:
    """Whether ``user`` is named in NIMBUS_SERVICE_ADMINS (sees every endpoint and task)."""
    admins = ctx.settings.service_admins or ""
    return user.user_name in {name.strip() for name in admins.split(",")}


def _all_endpoints(registry: Registry) -> list[EndpointInfo]:
    with Session(registry.engine) as session:
        ids = list(session.scalars(select(Endpoint.id).order_by(Endpoint.created)))
    return [info for eid in ids if (info := registry.endpoint(eid)) is not None]


async def _endpoints(ctx: ServiceContext, user: Principal) -> list[EndpointInfo]:
    """The endpoints ``user`` sees: their own, shared and public ones; all for an admin."""
    if _is_admin(ctx, user):
        return await run_in_threadpool(_all_endpoints, ctx.registry)
    return await run_in_threadpool(ctx.registry.endpoints, user.user_id)


def _ctx(request: Request) -> ServiceContext:
    ctx: ServiceContext = request.app.state.ctx
    return ctx


def _html(body: Html, status: int = 200, **headers: str) -> HTMLResponse:
    return HTMLResponse(str(body), status, headers=HEADERS | headers)


def _to_login(request: Request) -> RedirectResponse:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse("/login?" + urlencode({"next": target}), 303, headers=HEADERS)


class Viewing(NamedTuple):
    """Who asks (logged in) and the service asked: what a page or a stream opens with."""

    ctx: ServiceContext
    who: _session.Viewer


class _SignedOut(Exception):
    """Raised by the ``Page`` and ``Stream`` dependencies without a session: ``response``
    answers the request instead of its route (:class:`Route`)."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


class Route(APIRoute):
    """A dashboard route: a request its dependencies find signed out is answered with
    their login redirect or 401 (``_SignedOut``), not an error."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except _SignedOut as out:
                return out.response

        return route


def _viewing(refuse: Callable[[Request], Response]) -> Callable[[Request], Awaitable[Viewing]]:
    """A dependency: the request's viewer, else ``refuse(request)`` answers it."""

    async def viewing(request: Request) -> Viewing:
        ctx = _ctx(request)
        who = await _session.viewer(request, ctx)
        if who is None:
            raise _SignedOut(refuse(request))
        return Viewing(ctx, who)

    return viewing


def _unauthorised(request: Request) -> Response:
    return Response(status_code=401, headers=HEADERS)


Page = Annotated[Viewing, Depends(_viewing(_to_login))]  # a page: signed out, 303 to /login
Stream = Annotated[Viewing, Depends(_viewing(_unauthorised))]  # a stream, a file: 401


def _safe_next(target: str) -> str:
    """A same-site path to go to after login (anything else: the endpoints page)."""
    ok = target.startswith("/") and not target.startswith(("//", "/\\"))
    return target if ok and len(target) < 2000 else "/"


# ---------------------------------------------------------------- login


def _login_page(request: Request, error: str, status: int) -> HTMLResponse:
    token = request.cookies.get(_session.LOGIN_COOKIE) or secrets.token_urlsafe(32)
    target = _safe_next(request.query_params.get("next", "/"))
    message = Html(f'<p class="error">{esc(error)}</p>') if error else Html("")
    body = Html(
        f"{message}"
        f'<form method="post" action="/login" class="login">'
        f'<input type="hidden" name="csrf" value="{esc(token)}">'
        f'<input type="hidden" name="next" value="{esc(target)}">'
        f'<label>Token <input type="password" name="token" autocomplete="off" required '
        f'autofocus></label> <button type="submit">Log in</button></form>'
        f"<p>A token from <code>nimbus service token create USER</code>; it is kept "
        f"by the service for this session only, never in a URL.</p>"
    )
    response = _html(layout("Log in", body), status)
    response.set_cookie(
        _session.LOGIN_COOKIE,
        token,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/login",
    )
    return response


@router.get("/login")
async def login_form(request: Request) -> HTMLResponse:
    return _login_page(request, "", 200)


@router.post("/login", response_model=None)
async def login(request: Request) -> Response:
    fields = await _session.form(request)
    expected = request.cookies.get(_session.LOGIN_COOKIE, "")
    if not _session.check_origin(request) or not _session.same(fields.get("csrf", ""), expected):
        return _html(layout("Log in", esc("cross-site login refused: load /login again")), 403)
    try:
        session_id = await _session.new_session(_ctx(request), fields.get("token", "").strip())
    except AuthError as exc:
        return _login_page(request, str(exc), exc.status or 401)
    response = RedirectResponse(_safe_next(fields.get("next", "/")), 303, headers=HEADERS)
    response.set_cookie(
        _session.COOKIE,
        session_id,
        max_age=_session.SESSION_SECONDS,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    response.delete_cookie(_session.LOGIN_COOKIE, path="/login", samesite="strict")
    return response


@router.post("/logout", response_model=None)
async def logout(request: Request) -> Response:
    ctx = _ctx(request)
    who = await _session.viewer(request, ctx)
    fields = await _session.form(request)
    if who is None:
        return _to_login(request)
    if not _session.check_origin(request) or not _session.same(fields.get("csrf", ""), who.csrf):
        return _html(layout("Log out", esc("cross-site request refused")), 403)
    await _session.end_session(ctx, who.session_id)
    response = RedirectResponse("/login", 303, headers=HEADERS)
    response.delete_cookie(_session.COOKIE, samesite="strict")
    return response


# ---------------------------------------------------------------- live streams


def _stream(
    request: Request,
    ctx: ServiceContext,
    look: Callable[[], AsyncIterator[str]],
    tick: float,
    owner: str | None,
) -> StreamingResponse:
    """Server-sent events for an open page: the frames of ``look()`` (only what changed
    since its last look) each time tasks of ``owner`` moved (None: anyone's, for an admin;
    ``_live``: pushed, nothing is read while nothing changes), at most once every
    ``tick`` seconds; a keepalive comment every
    ``KEEPALIVE``; the end of the stream once the viewer's session no longer holds
    (logged out, token revoked: checked every ``RECHECK``) or the service stops."""
    live = _live.changes(request)

    async def events() -> AsyncIterator[str]:
        async with live.watching():
            checked = beat = drawn = time.monotonic()
            shown = -1  # the version of the store the page shows
            yield "retry: 1000\n\n"
            while not ctx.hub.closing:
                if live.mark(owner) != shown:
                    shown, drawn = live.mark(owner), time.monotonic()
                    async for frame in look():
                        yield frame
                now = time.monotonic()
                if now - beat > KEEPALIVE:
                    beat = now
                    yield ": keepalive\n\n"
                if now - checked > RECHECK:
                    checked = now
                    if await _session.viewer(request, ctx) is None:
                        return
                if await live.wait(owner, shown, WAKE) != shown:  # at most one look per tick
                    await asyncio.sleep(max(0.0, drawn + tick - time.monotonic()))

    return StreamingResponse(events(), media_type="text/event-stream", headers=HEADERS)


# ---------------------------------------------------------------- tasks


class _Names:
    """Names of functions and endpoints for one request or stream (ids when not visible)."""

    def __init__(self, ctx: ServiceContext, user: Principal) -> None:
        self.ctx, self.user = ctx, user
        self.admin = _is_admin(ctx, user)
        self.functions: dict[str, str] = {}
        self.endpoints: dict[str, str] = {}

    async def function(self, function_id: str) -> str:
        registry = self.ctx.registry
        return await self._name(self.functions, function_id, registry.function, self.ctx.function)

    async def endpoint(self, endpoint_id: str) -> str:
        registry = self.ctx.registry
        return await self._name(self.endpoints, endpoint_id, registry.endpoint, self.ctx.endpoint)

    async def _name(
        self,
        names: dict[str, str],
        key: str,
        anyones: Callable[[str], Any],
        visible: Callable[[Principal, str], Awaitable[Any]],
    ) -> str:
        """The name of function or endpoint ``key`` (its id when it has none, or the user
        may not see it), asked once: ``anyones`` for an admin, else what the user sees."""
        if key not in names:
            try:
                if self.admin:
                    found = await run_in_threadpool(anyones, key)
                    if found is None:
                        raise NotFound(key)
                else:
                    found = await visible(self.user, key)
                names[key] = found.name or key
            except NotFound:
                names[key] = key
        return names[key]

    async def row(self, row: Row) -> dict[str, Any]:
        return {
            "task_id": row.task_id,
            "state": row.state,
            "function": await self.function(row.function_id),
            "endpoint": await self.endpoint(row.endpoint_id),
            "submitted": when(row.submitted),
            "dispatched": when(row.dispatched),
            "ended": when(row.ended),
        }


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
    submitted, dispatched, ended = (_e(t) for t in times)
    return Html(
        f'<tr data-task="{tid}"><td><a href="/tasks/{tid}">{_e(task_id[:8])}</a></td>'
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


@router.get("/tasks", response_model=None)
async def tasks_page(request: Request) -> Response:
    ctx = _ctx(request)
    who = await _session.viewer(request, ctx)
    if who is None:
        return _to_login(request)
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
    if admin:  # every endpoint is in the choices: no lookup each
        names.endpoints.update((e.id, e.name) for e in endpoints)
    body = await _rows_html(names, rows)
    query = {k: v for k, v in vars(flt).items() if v}
    filters = Html(
        '<form method="get" action="/tasks" class="filters">'
        f"{_options('state', flt.state, [(s, s) for s in STATES])}"
        f"{_options('endpoint', flt.endpoint, [(e.id, e.name) for e in endpoints])}"
        f"{_options('function', flt.function, [(f.id, f.name or f.id) for f in functions])}"
        '<button type="submit">Filter</button></form>'
    )
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
async def tasks_stream(request: Request) -> Response:
    ctx = _ctx(request)
    who = await _session.viewer(request, ctx)
    if who is None:
        return Response(status_code=401, headers=HEADERS)
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


# ---------------------------------------------------------------- network


@router.get("/network", response_model=None)
async def network_page(request: Request) -> Response:
    ctx = _ctx(request)
    who = await _session.viewer(request, ctx)
    if who is None:
        return _to_login(request)
    user = who.principal
    flt = Filter(endpoint=request.query_params.get("endpoint", "")[:64])
    after = decode_cursor(request.query_params.get("after", ""))
    admin = _is_admin(ctx, user)
    key = index(ctx.store, user.user_id, admin)
    rows, cursor = await page(
        ctx.store, key, flt, after, PAGE_SIZE, None if admin else user.user_id
    )
    records = await _network.net_rows(ctx.store, rows)
    names = _Names(ctx, user)
    nets = [
        _network.NetRow(
            row,
            await names.function(row.function_id),
            await names.endpoint(row.endpoint_id),
            record,
        )
        for row, record in zip(rows, records)
    ]
    endpoints = await _endpoints(ctx, user)
    pipe = ctx.store.redis.pipeline(transaction=False)
    for info in endpoints:
        pipe.hmget(metrics.metrics_key(ctx.store, info.id), ["net_in", "net_out"])
    totals = await pipe.execute() if endpoints else []
    summary = join(
        Html(
            f'<tr data-endpoint="{esc(info.id)}"><td><a href="/network?'
            f'{esc(urlencode({"endpoint": info.id}))}">{esc(info.name)}</a></td>'
            f"<td>{esc(_network.amount(int(got or 0)))}</td>"
            f"<td>{esc(_network.amount(int(sent or 0)))}</td></tr>"
        )
        for info, (got, sent) in zip(endpoints, totals)
    )
    body = Html(
        '<h2>Endpoints</h2><table id="endpoint-bytes"><thead><tr><th>Endpoint</th>'
        f"<th>Bytes in</th><th>Bytes out</th></tr></thead><tbody>{summary}</tbody></table>"
        f"<h2>Tasks</h2>{_network.table(nets)}"
        "<p>From each task's record: bytes its processes moved (source <code>netns</code>: "
        "every IP byte; <code>socket</code>: Python sockets only), throughput over its run "
        "time, other tasks on its host, TCP retransmits and round trip.</p>"
    )
    if cursor:
        query = {"endpoint": flt.endpoint} if flt.endpoint else {}
        body = Html(
            body + f'<p><a id="next" href="/network?{esc(urlencode(query | {"after": cursor}))}">'
            "Older tasks</a></p>"
        )
    return _html(layout("Network", body, user.user_name, who.csrf))


# ---------------------------------------------------------------- batches


def _counts(batch: _batches.Batch) -> str:
    return ", ".join(f"{n} {state}" for state, n in sorted(batch.counts.items()))


def _batch_row(batch: _batches.Batch) -> Html:
    return Html(
        f'<tr data-group="{esc(batch.group_id)}"><td>{esc(batch.group_id[:8])}</td>'
        f"<td>{esc(when(batch.submitted))}</td>"
        f'<td><progress max="{max(1, batch.total)}" value="{batch.done}"></progress></td>'
        f'<td class="done">{batch.done}/{batch.total}</td>'
        f'<td class="counts">{esc(_counts(batch))}</td></tr>'
    )


@router.get("/batches", response_model=None)
async def batches_page(request: Request) -> Response:
    ctx = _ctx(request)
    who = await _session.viewer(request, ctx)
    if who is None:
        return _to_login(request)
    user = who.principal
    key = index(ctx.store, user.user_id, _is_admin(ctx, user))
    batches = await _batches.recent(ctx.store, key)
    body = Html(
        '<p id="live" class="live">live</p>'
        '<table id="batches" data-stream="/batches/stream"><thead><tr><th>Batch</th>'
        "<th>Submitted</th><th>Progress</th><th>Done</th><th>States</th></tr></thead>"
        f"<tbody>{join(_batch_row(b) for b in batches)}</tbody></table>"
        "<p>A batch is what one submit sent: a <code>batch_run</code>, or the tasks an "
        "<code>Executor.map</code> sent together. States are counted for the first "
        f"{_batches.CAP} tasks of a batch.</p>"
    )
    return _html(layout("Batches", body, user.user_name, who.csrf))


@router.get("/batches/stream", response_model=None)
async def batches_stream(request: Request) -> Response:
    ctx = _ctx(request)
    who = await _session.viewer(request, ctx)
    if who is None:
        return Response(status_code=401, headers=HEADERS)
    key = index(ctx.store, who.principal.user_id, _is_admin(ctx, who.principal))

    sent: dict[str, dict[str, object]] = {}
    finished: dict[str, _batches.Batch] = {}

    async def look() -> AsyncIterator[str]:
        nonlocal sent, finished
        batches = await _batches.recent(ctx.store, key, finished=finished)
        finished = {b.group_id: b for b in batches if b.total and b.done == b.total}
        for batch in reversed(batches):  # oldest first: the page inserts each on top
            view = batch.as_dict() | {"submitted": when(batch.submitted)}
            view["states"] = _counts(batch)
            if sent.get(batch.group_id) != view:
                sent[batch.group_id] = view
                yield f"event: batch\ndata: {json.dumps(view)}\n\n"
        keep = {batch.group_id for batch in batches}
        sent = {k: v for k, v in sent.items() if k in keep}

    admin = _is_admin(ctx, who.principal)
    return _stream(request, ctx, look, BATCH_TICK, None if admin else who.principal.user_id)


@router.get("/static/{name}")
async def static(name: str) -> Response:
    if name not in STATIC:
        return Response(status_code=404, headers=HEADERS)
    data = resources.files("nimbus.service.dashboard").joinpath("static", name).read_bytes()
    headers = HEADERS | {"Cache-Control": "public, max-age=300"}
    return Response(data, media_type=STATIC[name], headers=headers)
