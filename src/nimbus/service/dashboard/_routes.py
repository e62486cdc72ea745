"""The dashboard's routes: login, static files, and what every page module shares
(the ``Page``/``Stream`` dependencies, ``_stream``, ``_Names``).

::

    GET  /login, POST /login, GET|POST /logout      _session (cookie, CSRF)
    GET  /static/{name}         the JS and CSS in this package
    GET  /, /endpoints/{id}     endpoints: _endpoints; a task: _task; the timeline: _timeline
    GET  /tasks, /tasks/stream  a keyset page of your tasks, live: _tasks
    GET  /directory             messaging instances: _directory; POST buttons: _actions
    GET  /network?endpoint=&after=  your tasks' bytes and throughput; endpoints' totals: _network
    GET  /batches, /batches/stream  progress of your recent batches (live: events): _batches

Without a session a page answers 303 to /login (the stream and static files
excepted: 401, and files that hold nothing of anyone's). Another user's task is
404, as in the API. A user named in ``NIMBUS_SERVICE_ADMINS`` sees every endpoint
and every task (the index ``Keys.all_tasks``). Every response carries a Content-Security-Policy allowing
scripts from this origin only, so even markup that slipped through would not run.
"""

from __future__ import annotations

import asyncio
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
from nimbus.service.context import ServiceContext
from nimbus.service.dashboard import _live, _session
from nimbus.service.dashboard._html import Html, esc, layout, when
from nimbus.service.listing import (
    Row,
)
from nimbus.service.registry import EndpointInfo, Principal, Registry
from nimbus.service.tables import Endpoint

__all__ = ["router"]

router = APIRouter(include_in_schema=False)
PAGE_SIZE = 50
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


@router.get("/logout", response_model=None)
async def logout_form(request: Request) -> Response:
    """The URL typed in a browser: a page with the logout button (a GET changes nothing);
    not logged in, the login page."""
    who = await _session.viewer(request, _ctx(request))
    if who is None:
        return RedirectResponse("/login", 303, headers=HEADERS)
    body = Html(
        f'<form method="post" action="/logout"><input type="hidden" name="csrf" '
        f'value="{esc(who.csrf)}"><button type="submit">Log out</button></form>'
    )
    return _html(layout("Log out", body, who.principal.user_name, who.csrf), 200)


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


@router.get("/static/{name}")
async def static(name: str) -> Response:
    if name not in STATIC:
        return Response(status_code=404, headers=HEADERS)
    data = resources.files("nimbus.service.dashboard").joinpath("static", name).read_bytes()
    headers = HEADERS | {"Cache-Control": "public, max-age=300"}
    return Response(data, media_type=STATIC[name], headers=headers)
