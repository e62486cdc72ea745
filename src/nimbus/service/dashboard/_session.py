"""Logging in to the dashboard: the same tokens, never in a URL.

::

    GET /login   --> form + a random login-CSRF cookie (HttpOnly, SameSite=Strict)
    POST /login  --> token checked as the API checks it; a session in the queue
                     Redis (Keys.dashboard_session: user, token digest, CSRF token),
                     its id in an HttpOnly SameSite=Strict cookie; 303 to the page
    each page    --> session read from Redis; its token must still be in the
                     registry (revoked: logged out within TOKEN_RECHECK seconds)
    POST /logout --> the session's CSRF token in the form, else 403

The session lives in Redis, not in one process, so any service process serves
it and it survives a restart. Every state-changing POST checks a CSRF token from
the form against the one stored with the session (login: against its cookie),
and the Origin header when the browser sends one.
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fastapi import Request
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from nimbus.errors import AuthError
from nimbus.service.context import ServiceContext
from nimbus.service.registry import Principal, Registry, hash_token
from nimbus.service.tables import Token

__all__ = [
    "COOKIE",
    "LOGIN_COOKIE",
    "Viewer",
    "check_origin",
    "end_session",
    "form",
    "new_session",
    "same",
    "viewer",
]

COOKIE = "nimbus_session"
LOGIN_COOKIE = "nimbus_login_csrf"
SESSION_SECONDS = 12 * 3600
TOKEN_RECHECK = 1.0  # seconds a session's token is trusted before the registry is asked again
FORM_MAX = 4096


@dataclass(frozen=True)
class Viewer:
    """Who is looking at a page, and the CSRF token their forms carry."""

    principal: Principal
    session_id: str
    csrf: str


def _token_exists(registry: Registry, digest: str) -> bool:
    with Session(registry.engine) as session:
        return session.scalar(select(Token.digest).where(Token.digest == digest)) is not None


async def _token_valid(request: Request, ctx: ServiceContext, digest: str) -> bool:
    checked: dict[str, float] = request.app.state.__dict__.setdefault("dashboard_tokens", {})
    now = time.monotonic()
    if checked.get(digest, 0.0) > now:
        return True
    if not await run_in_threadpool(_token_exists, ctx.registry, digest):
        checked.pop(digest, None)
        return False
    if len(checked) > 10_000:
        checked.clear()
    checked[digest] = now + TOKEN_RECHECK
    return True


async def viewer(request: Request, ctx: ServiceContext) -> Viewer | None:
    """The logged-in user of a request, or None (no session, expired, token revoked)."""
    session_id = request.cookies.get(COOKIE, "")
    if not session_id or len(session_id) > 100:
        return None
    key = ctx.store.keys.dashboard_session(session_id)
    raw: dict[bytes, bytes] = await ctx.store.redis.hgetall(key)
    if not raw:
        return None
    fields = {k.decode(): v.decode() for k, v in raw.items()}
    if not await _token_valid(request, ctx, fields["digest"]):
        await ctx.store.redis.delete(key)
        return None
    return Viewer(Principal(fields["user_id"], fields["user_name"]), session_id, fields["csrf"])


async def new_session(ctx: ServiceContext, token: str) -> str:
    """A session for the user ``token`` belongs to; AuthError (401/403) as the API says."""
    user = await ctx.user(token)
    session_id = secrets.token_urlsafe(32)
    key = ctx.store.keys.dashboard_session(session_id)
    mapping = {
        "user_id": user.user_id,
        "user_name": user.user_name,
        "digest": hash_token(token),
        "csrf": secrets.token_urlsafe(32),
    }
    pipe = ctx.store.redis.pipeline(transaction=True)
    pipe.hset(key, mapping=mapping)
    pipe.expire(key, SESSION_SECONDS)
    await pipe.execute()
    return session_id


async def end_session(ctx: ServiceContext, session_id: str) -> None:
    await ctx.store.redis.delete(ctx.store.keys.dashboard_session(session_id))


async def form(request: Request) -> dict[str, str]:
    """An urlencoded form's fields (the first value of each); AuthError (400) if too large."""
    body = await request.body()
    if len(body) > FORM_MAX:
        raise AuthError(f"form: {len(body)} bytes, at most {FORM_MAX} are read", 400)
    try:
        parsed: dict[str, Any] = parse_qs(body.decode(errors="replace"), max_num_fields=20)
    except ValueError:  # more fields than any of the dashboard's forms has
        raise AuthError(
            "form: more than 20 fields; the dashboard's forms have a few", 400
        ) from None
    return {name: values[0] for name, values in parsed.items()}


def same(given: str, expected: str) -> bool:
    """A constant-time comparison of two tokens (any text: bytes are compared)."""
    return bool(given) and bool(expected) and hmac.compare_digest(given.encode(), expected.encode())


def check_origin(request: Request) -> bool:
    """False when the browser says the request comes from another site."""
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    return urlsplit(origin).netloc == request.headers.get("host", "")
