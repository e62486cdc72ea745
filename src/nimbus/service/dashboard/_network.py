"""The dashboard's network page: per-task bytes and throughput, per-endpoint totals.

::

    GET /network?endpoint=&after=     your tasks, newest first (keyset pages, as /tasks),
                                      each with its record's network fields
                                      (one HMGET of ``record`` a row of the page)
                                      and above them, each endpoint you see: bytes in
                                      and out so far (the /metrics counters)

From the task records only (``nimbus.records``): ``net_bytes_in``/``_out``,
throughput over the run time, ``net_source`` (``netns`` exact, ``socket``
Python sockets only), ``colocated`` (other tasks on the host) and ``tcp``
(retransmits, RTT). Nothing is measured for the page.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import Response

from nimbus.records import TaskRecord
from nimbus.service import metrics
from nimbus.service.dashboard._html import Html, esc, join, layout, short
from nimbus.service.dashboard._routes import (
    PAGE_SIZE,
    Page,
    Route,
    _endpoints,
    _html,
    _is_admin,
    _Names,
)
from nimbus.service.listing import Filter, Row, decode_cursor, index, page, record_of
from nimbus.service.queues import TaskStore

__all__ = ["NetRow", "amount", "net_rows", "rate", "router", "row_html", "table"]

router = APIRouter(include_in_schema=False, route_class=Route)


@dataclass(frozen=True)
class NetRow:
    row: Row
    function: str
    endpoint: str
    record: TaskRecord | None


def amount(n: float) -> str:
    """Bytes in units of 1000 (as network rates are given)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def rate(n: float) -> str:
    return amount(n) + "/s"


async def net_rows(store: TaskStore, rows: list[Row]) -> list[TaskRecord | None]:
    """The record of each row (None when the task has none yet, or it expired)."""
    pipe = store.redis.pipeline(transaction=False)
    for row in rows:
        pipe.hget(store.keys.task(row.task_id), "record")
    raws = await pipe.execute(raise_on_error=False) if rows else []
    missing = [row.task_id for row, raw in zip(rows, raws) if not isinstance(raw, bytes)]
    if missing and store.history is not None:  # no longer in Redis: in the SQL history
        found = await asyncio.to_thread(store.history.info, missing)
        raws = [
            raw if isinstance(raw, bytes) else found.get(row.task_id, {}).get("record")
            for row, raw in zip(rows, raws)
        ]
    return [record_of(raw) if isinstance(raw, bytes) else None for raw in raws]


def _colocated(record: TaskRecord) -> str:
    seen = record.colocated or {}
    if not seen:
        return ""
    return f"{seen.get('mean', 0):.1f} (max {seen.get('max', 0):.0f})"


def _tcp(record: TaskRecord) -> str:
    tcp = record.tcp or {}
    parts = []
    if "retransmits" in tcp:
        parts.append(f"{tcp['retransmits']:.0f} retr")
    if "rtt_ms" in tcp:
        parts.append(f"rtt {tcp['rtt_ms']:.2f} ms")
    return ", ".join(parts)


def row_html(net: NetRow) -> Html:
    row, record = net.row, net.record
    link = f"/tasks/{row.task_id}"
    cells: list[str] = [net.function, net.endpoint, row.state]
    if record is not None and record.ended:
        cells += [
            f"{record.run_seconds:.3f} s",
            amount(record.net_bytes_in),
            amount(record.net_bytes_out),
            rate(record.net_throughput_in),
            rate(record.net_throughput_out),
            record.net_source,
            _colocated(record),
            _tcp(record),
        ]
    else:
        cells += [""] * 8
    return Html(
        f'<tr data-task="{esc(row.task_id)}"><td><a href="{esc(link)}">{esc(short(row.task_id))}'
        f"</a></td>{join(Html(f'<td>{esc(c)}</td>') for c in cells)}</tr>"
    )


def table(rows: list[NetRow]) -> Html:
    head = (
        "Task",
        "Function",
        "Endpoint",
        "State",
        "Run",
        "Bytes in",
        "Bytes out",
        "In",
        "Out",
        "Source",
        "Co-located",
        "TCP",
    )
    return Html(
        '<table id="network"><thead><tr>'
        + join(Html(f"<th>{esc(h)}</th>") for h in head)
        + f"</tr></thead><tbody>{join(row_html(r) for r in rows)}</tbody></table>"
    )


@router.get("/network", response_model=None)
async def network_page(request: Request, seen: Page) -> Response:
    ctx, who = seen
    user = who.principal
    flt = Filter(endpoint=request.query_params.get("endpoint", "")[:64])
    after = decode_cursor(request.query_params.get("after", ""))
    admin = _is_admin(ctx, user)
    key = index(ctx.store, user.user_id, admin)
    rows, cursor = await page(
        ctx.store, key, flt, after, PAGE_SIZE, None if admin else user.user_id
    )
    records = await net_rows(ctx.store, rows)
    names = _Names(ctx, user)
    nets = [
        NetRow(
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
            f"<td>{esc(amount(int(got or 0)))}</td>"
            f"<td>{esc(amount(int(sent or 0)))}</td></tr>"
        )
        for info, (got, sent) in zip(endpoints, totals)
    )
    body = Html(
        '<h2>Endpoints</h2><table id="endpoint-bytes"><thead><tr><th>Endpoint</th>'
        f"<th>Bytes in</th><th>Bytes out</th></tr></thead><tbody>{summary}</tbody></table>"
        f"<h2>Tasks</h2>{table(nets)}"
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
