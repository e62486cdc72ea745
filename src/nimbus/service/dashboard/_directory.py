"""The dashboard's directory page: your programs' messaging instances and where they listen.

::

    GET /directory      each program of yours that has instances (``nimbus.messaging``):
                        instance id, host, pid, Unix socket, TCP address, alive/exited

The directories are hashes in the stores Redis the service runs for programs on
endpoints (``service.stores``): ``Keys(program_id).directory()``, instance id ->
``Entry``. A user's program ids start with their prefix (``u-<user id>.``), so
the page reads ``nimbus:{u-<user id>.*}:directory`` only (the admin: every
program's); the ACL keeps users to the same keys. The stores Redis keeps no index
of its programs, so the keys are found with SCAN (MATCH, COUNT): that costs the
stores Redis's key count, at most ``SCAN_KEYS`` keys a page view, and ``PROGRAMS``
programs and ``INSTANCES`` instances each are shown. No stores Redis yet (nobody
asked for a store since the service started): nothing to show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from nimbus.errors import ConfigError
from nimbus.messaging import Entry
from nimbus.service.dashboard._html import Html, esc, join, layout
from nimbus.service.dashboard._routes import Page, Route, _html, _is_admin
from nimbus.service.stores import key_prefix
from nimbus.statestore import Keys

__all__ = ["Program", "directories", "router"]

router = APIRouter(include_in_schema=False, route_class=Route)
SCAN_KEYS = 100_000  # keys of the stores Redis examined for one page at most
PROGRAMS = 100
INSTANCES = 1000  # of one program


@dataclass(frozen=True)
class Program:
    program_id: str
    instances: list[tuple[str, Entry | None]]  # None: an entry this version cannot read
    total: int


def _pattern(user_id: str, admin: bool) -> str:
    """``Keys(program_id).directory()`` with a glob for the program id (braces are literal)."""
    mine = Keys(key_prefix(user_id)).directory()  # nimbus:{u-<id>}:directory
    return mine.replace(
        "{" + key_prefix(user_id) + "}", "{*}" if admin else "{" + key_prefix(user_id) + ".*}"
    )


def _is_directory(key: str, program_id: str) -> bool:
    """Whether ``key`` is the directory of the program ``program_id`` (the glob also matches
    a user's own keys that end so, ``nimbus.data.store()``'s, with any characters)."""
    try:
        return key == Keys(program_id).directory()
    except ConfigError:  # (not a program id)
        return False


def directories(client: redis.Redis, pattern: str) -> tuple[list[Program], bool]:
    """The programs whose directory key matches ``pattern``; and whether the scan stopped
    at ``SCAN_KEYS`` before the end."""
    found: list[str] = []
    cursor, examined = 0, 0
    while True:
        cursor, keys = client.scan(cursor, match=pattern, count=1000)
        examined += 1000
        found += [k.decode() if isinstance(k, bytes) else str(k) for k in keys]
        if cursor == 0 or len(found) >= PROGRAMS or examined >= SCAN_KEYS:
            break
    cut = cursor != 0 and examined >= SCAN_KEYS
    programs = []
    for key in sorted(set(found))[:PROGRAMS]:
        program_id = key.partition("{")[2].partition("}")[0]  # (an id has no braces)
        if not _is_directory(key, program_id):
            continue  # another key the glob matched: a key of nimbus.data.store() "x}:directory"
        try:
            total = int(client.hlen(key))
            raw: Any = client.hscan(key, 0, count=INSTANCES)[1]
        except redis.ResponseError:  # (WRONGTYPE: a user's own key of that name, not a hash)
            continue
        entries: list[tuple[str, Entry | None]] = []
        for instance, data in sorted(raw.items())[:INSTANCES]:
            try:
                entry: Entry | None = Entry.loads(data)
            except Exception:  # written by another version: listed, not read
                entry = None
            entries.append((instance.decode(errors="replace"), entry))
        programs.append(Program(program_id, entries, total))
    return programs, cut


def _program_html(program: Program) -> Html:
    rows = []
    for instance, entry in program.instances:
        if entry is None:
            cells = [instance, "", "", "", "", "unreadable"]
        else:
            tcp = f"{entry.tcp[0]}:{entry.tcp[1]}" if entry.tcp else ""
            cells = [instance, entry.host.split("/")[0], str(entry.pid), entry.unix or "", tcp]
            cells.append(entry.state)
        rows.append(
            Html(
                f'<tr data-instance="{esc(instance)}">'
                + join(Html(f"<td>{esc(c)}</td>") for c in cells)
                + "</tr>"
            )
        )
    more = len(program.instances) < program.total
    return Html(
        f"<h2>Program <code>{esc(program.program_id)}</code></h2>"
        f'<table class="directory" data-program="{esc(program.program_id)}"><thead><tr>'
        "<th>Instance</th><th>Host</th><th>Pid</th><th>Unix socket</th><th>TCP</th>"
        f"<th>State</th></tr></thead><tbody>{join(rows)}</tbody></table>"
        + (f"<p>{program.total - len(program.instances)} more not shown.</p>" if more else "")
    )


@router.get("/directory", response_model=None)
async def directory_page(request: Request, seen: Page) -> Response:
    ctx, who = seen
    user = who.principal
    server = getattr(request.app.state, "store_server", None)
    intro = Html(
        "<p>Instances of your multiprocessing programs on endpoints "
        "(<code>nimbus.messaging</code>): where each listens, and whether it is alive.</p>"
    )
    if server is None:
        body = Html(intro + '<p id="directory" class="empty">No program has asked the '
                    "service for a state store since it started.</p>")  # fmt: skip
        return _html(layout("Directory", body, user.user_name, who.csrf))
    pattern = _pattern(user.user_id, _is_admin(ctx, user))
    try:
        programs, cut = await run_in_threadpool(directories, server.client, pattern)
    except redis.RedisError as exc:
        body = Html(intro + f'<p class="error">The programs\' store did not answer: {esc(exc)}</p>')
        return _html(layout("Directory", body, user.user_name, who.csrf), 503)
    listed = (
        join(_program_html(p) for p in programs)
        if programs
        else Html('<p class="empty">None of your programs has messaging instances now.</p>')
    )
    note = Html(f"<p>Stopped after {SCAN_KEYS} keys of the store.</p>" if cut else "")
    body = Html(intro + f'<div id="directory">{listed}</div>{note}')
    return _html(layout("Directory", body, user.user_name, who.csrf))
