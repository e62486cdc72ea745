"""The dashboard's state-changing buttons: cancel a task, share an endpoint.

::

    POST /tasks/{id}/cancel       csrf=<the session's>          -> 303 to the task's page
    POST /endpoints/{id}/share    csrf=, user=NAME | remove=NAME -> 303 to the endpoint's page

Each POST is checked three ways before anything changes (403 otherwise, nothing done):

- the form carries the CSRF token stored with the session (``_session``), which only
  a page of this origin holds (never in a URL: a hidden field of the form);
- the browser's ``Origin``, when it sends one, is this host (``_session.check_origin``),
  and ``Sec-Fetch-Site``, when sent, is not ``cross-site``;
- the session cookie is ``SameSite=Strict``: a request another site starts carries none.

Then the same rules as the API apply (``ctx.cancellable_task``; the API's share route,
only the endpoint's owner), so a button never does more than its user's token could.
"""

from __future__ import annotations

from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from pydantic import ValidationError

from nimbus.errors import ServiceError
from nimbus.service import routes, tasks
from nimbus.service.dashboard import _session
from nimbus.service.dashboard._html import esc, layout
from nimbus.service.dashboard._routes import HEADERS, _ctx, _html

__all__ = ["router"]

router = APIRouter(include_in_schema=False)


def cross_site(request: Request, fields: dict[str, str], csrf: str) -> bool:
    """Whether a POST may come from another site (then it is refused)."""
    if request.headers.get("sec-fetch-site", "same-origin") == "cross-site":
        return True
    return not _session.check_origin(request) or not _session.same(fields.get("csrf", ""), csrf)


def _login_then(page: str) -> Response:
    return RedirectResponse("/login?" + urlencode({"next": page}), 303, headers=HEADERS)


def _refused(title: str, user: str, csrf: str) -> Response:
    body = esc("cross-site request refused: nothing was changed (use the page's own button)")
    return _html(layout(title, body, user, csrf), 403)


@router.post("/tasks/{task_id}/cancel", response_model=None)
async def cancel_task(request: Request, task_id: str) -> Response:
    ctx = _ctx(request)
    who = await _session.viewer(request, ctx)
    fields = await _session.form(request)
    if who is None:  # logged in again, the task's page (a POST is not repeated)
        return _login_then(f"/tasks/{task_id[:64]}")
    user = who.principal
    if cross_site(request, fields, who.csrf):
        return _refused("Cancel", user.user_name, who.csrf)
    try:
        await tasks.cancel(task_id[:64], user, ctx)
    except ServiceError as exc:
        return _html(layout("Cancel", esc(str(exc)), user.user_name, who.csrf), exc.status or 400)
    return RedirectResponse(f"/tasks/{task_id[:64]}", 303, headers=HEADERS)


@router.post("/endpoints/{endpoint_id}/share", response_model=None)
async def share_endpoint(request: Request, endpoint_id: str) -> Response:
    ctx = _ctx(request)
    who = await _session.viewer(request, ctx)
    fields = await _session.form(request)
    if who is None:
        return _login_then(f"/endpoints/{endpoint_id[:64]}")
    user = who.principal
    if cross_site(request, fields, who.csrf):
        return _refused("Share", user.user_name, who.csrf)
    endpoint_id = endpoint_id[:64]
    try:
        add, remove = fields.get("user", "").strip(), fields.get("remove", "").strip()
        body = routes.ShareIn(users=[add] if add else [], remove=[remove] if remove else [])
        await routes.share_endpoint(endpoint_id, body, user, ctx)
    except ValidationError:
        message = "a user name is 1-200 letters, digits, '_', '.', '@' or '-'"
        return _html(layout("Share", esc(message), user.user_name, who.csrf), 422)
    except ServiceError as exc:
        return _html(layout("Share", esc(str(exc)), user.user_name, who.csrf), exc.status or 400)
    return RedirectResponse(f"/endpoints/{endpoint_id}", 303, headers=HEADERS)
