"""HTML building for the dashboard: every value goes through :func:`esc`.

Pages are f-strings of :class:`Html` fragments; a plain ``str`` is always text
(a name, an id, an exception a user's function raised) and is escaped where it
is placed, so nothing a user controls is ever markup.
"""

from __future__ import annotations

import functools
import html
import time
from collections.abc import Iterable

__all__ = ["Html", "age", "esc", "join", "layout", "short", "when"]


class Html(str):
    """Markup already built from escaped parts."""


def esc(value: object) -> Html:
    """``value`` as text in HTML (markup it already is stays as it is)."""
    if isinstance(value, Html):
        return value
    return Html(html.escape(str(value), quote=True))


def short(task_id: str) -> str:
    """A task's or batch's id as the pages show it: its head and its tail (a local
    executor's ids share their head and differ only at the end); dashboard.js's
    ``short`` is the same."""
    return task_id if len(task_id) <= 13 else f"{task_id[:8]}…{task_id[-4:]}"


def join(parts: Iterable[Html]) -> Html:
    return Html("".join(esc(part) for part in parts))


def when(seconds: float) -> str:
    """A time as UTC ``HH:MM:SS`` with the date, or '' for none (digits, dashes, colons
    and a space only: nothing to escape)."""
    if not seconds:
        return ""
    return _second(int(seconds))


@functools.lru_cache(maxsize=4096)
def _second(second: int) -> str:
    """One second's text, formatted once (a page's rows share a few seconds)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(second))


def age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    return f"{seconds:.1f} s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago"


def layout(
    title: str, body: Html, user: str = "", csrf: str = "", scripts: tuple[str, ...] = ()
) -> Html:
    """A whole page: the navigation (and a logout form when someone is logged in);
    ``scripts``: more of the package's static scripts the page runs."""
    nav = Html("")
    if user:
        nav = Html(
            f'<nav><a href="/">Endpoints</a> <a href="/tasks">Tasks</a> '
            f'<a href="/batches">Batches</a> <a href="/timeline">Timeline</a> '
            f'<a href="/network">Network</a> <a href="/directory">Directory</a> '
            f'<span class="who">{esc(user)}</span>'
            f'<form method="post" action="/logout" class="inline">'
            f'<input type="hidden" name="csrf" value="{esc(csrf)}">'
            f'<button type="submit">Log out</button></form></nav>'
        )
    extra = join(Html(f'<script src="/static/{esc(name)}" defer></script>') for name in scripts)
    return Html(
        "<!doctype html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>{esc(title)} - nimbus</title>'
        '<link rel="stylesheet" href="/static/dashboard.css">'
        '<script src="/static/dashboard.js" defer></script>'
        f"{extra}</head>"
        f"<body>{nav}<main><h1>{esc(title)}</h1>{body}</main></body></html>"
    )
