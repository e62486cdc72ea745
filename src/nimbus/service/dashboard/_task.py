"""The dashboard's page of one task: its record, its exception and traceback, its output.

::

    GET /tasks/{task_id}    HMGET of the task's fields and record; a finished task's
                            result (HMGET result) read for its traceback or its output;
                            a Cancel button (POST /tasks/{id}/cancel, ``_actions``) while
                            it is not done and you may cancel it

The service never unpickles what a worker sent: the traceback is the text inside
the pickled exception, and the output is shown only when the pickle is one plain
value (a string, a number, bytes, True/False/None), read from its opcodes with
``pickletools``; anything else shows its size (``Client.get_result`` gives it).
Another user's task is 404, as in the API; the admin sees every one.
"""

from __future__ import annotations

import pickletools

import msgpack
from fastapi import APIRouter, Request
from fastapi.responses import Response

from nimbus.errors import NotFound
from nimbus.protocol import traceback_text
from nimbus.records import TaskState
from nimbus.service.dashboard import _network
from nimbus.service.dashboard._html import Html, esc, join, layout, short, when
from nimbus.service.dashboard._routes import Page, Route, _html, _is_admin, _Names
from nimbus.service.listing import Row, record_of

__all__ = ["output_text", "router"]

router = APIRouter(include_in_schema=False, route_class=Route)
OUTPUT_MAX = 1 << 16  # characters of an output shown
_PLAIN = {
    "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE",
    "BINUNICODE8", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "NEWTRUE", "NEWFALSE", "NONE",
}  # fmt: skip
_FRAMING = {"PROTO", "FRAME", "MEMOIZE", "STOP"}


def output_text(result: bytes | None, limit: int = 1 << 20) -> str | None:
    """A successful task's output as text when its pickle is one plain value, else None."""
    if not result or len(result) > limit:
        return None
    try:
        status, data, buffers = msgpack.unpackb(result, raw=False)
        if status != 0 or buffers:
            return None
        ops = [(op.name, arg) for op, arg, _ in pickletools.genops(bytes(data))]
    except Exception:  # not a result nimbus packed inline (a data reference, say)
        return None
    values = [(name, arg) for name, arg in ops if name not in _FRAMING]
    if len(values) != 1 or values[0][0] not in _PLAIN:
        return None
    name, arg = values[0]
    value = {"NEWTRUE": True, "NEWFALSE": False, "NONE": None}.get(name, arg)
    return repr(value)[:OUTPUT_MAX]


def _cancel_form(task_id: str, csrf: str) -> Html:
    return Html(
        f'<form method="post" action="/tasks/{esc(task_id)}/cancel" id="cancel">'
        f'<input type="hidden" name="csrf" value="{esc(csrf)}">'
        '<button type="submit">Cancel this task</button></form>'
    )


@router.get("/tasks/{task_id}", response_model=None)
async def task_page(request: Request, task_id: str, seen: Page) -> Response:
    ctx, who = seen
    user = who.principal
    task_id = task_id[:64]
    try:
        if _is_admin(ctx, user):
            [found] = await ctx.store.info([task_id])
            if found is None:
                raise NotFound(f"task {task_id} not found", 404)
            info = found
        else:
            info = await ctx.task(user, task_id)
    except NotFound as exc:
        return _html(layout("Not found", esc(str(exc)), user.user_name, who.csrf), 404)
    names = _Names(ctx, user)
    row = Row(
        task_id,
        0.0,
        str(info["state"]),
        str(info["endpoint"]),
        str(info["function"]),
        float(str(info["submitted"] or 0)),
        float(str(info["dispatched"] or 0)),
        float(str(info["ended"] or 0)),
    )
    view = await names.row(row)
    fields = [
        ("Task", task_id),
        ("State", view["state"]),
        ("Function", view["function"]),
        ("Function id", row.function_id),
        ("Endpoint", view["endpoint"]),
        ("Submitted", view["submitted"]),
        ("Dispatched", view["dispatched"]),
        ("Ended", view["ended"]),
        ("Timeout", info["timeout"] or "none"),
    ]
    record = record_of(info.get("record"))
    if record is not None:
        record.submitted = row.submitted  # the service's clock, as the API shows it
        fields += [
            ("Worker", record.worker),
            ("Host", record.host),
            ("Pid", record.pid),
            ("Started", when(record.started)),
            ("Run", f"{record.run_seconds:.3f} s"),
            ("Queued", f"{record.queued_seconds:.3f} s"),
            ("CPU", f"{record.cpu_user:.3f} s user, {record.cpu_system:.3f} s system"),
            ("Peak memory", f"{record.peak_memory} bytes"),
            ("Network in", f"{_network.amount(record.net_bytes_in)}, "
             f"{_network.rate(record.net_throughput_in)} ({record.net_source})"),
            ("Network out", f"{_network.amount(record.net_bytes_out)}, "
             f"{_network.rate(record.net_throughput_out)}"),
        ]  # fmt: skip
    body = Html(
        '<table id="task" class="record">'
        + join(Html(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>") for k, v in fields)
        + "</table>"
    )
    done = row.state in {s.value for s in TaskState if s.done}
    if not done and await ctx.may_cancel(user, info):
        body = Html(body + _cancel_form(task_id, who.csrf))
    if row.state in (TaskState.FAILED.value, TaskState.SUCCESS.value):
        [stored] = await ctx.store.results([task_id])
        result = stored[1] if stored else None
        if row.state == TaskState.FAILED.value:
            text = traceback_text(result)
            last = text.strip().splitlines()[-1] if text.strip() else ""
            body = Html(
                body
                + (
                    f'<h2>Exception</h2><p id="exception" class="error">{esc(last)}</p>'
                    f'<h2>Traceback</h2><pre id="traceback">{esc(text)}</pre>'
                    if text
                    else "<p>The worker sent no traceback text.</p>"
                )
            )
        else:
            out = output_text(result)
            body = Html(
                body
                + "<h2>Output</h2>"
                + (
                    f'<pre id="output">{esc(out)}</pre>'
                    if out is not None
                    else f'<p id="output">A pickled object of {len(result or b"")} bytes '
                    "(not read by the service: <code>Client.get_result</code> gives it).</p>"
                )
            )
    return _html(layout(f"Task {short(task_id)}", body, user.user_name, who.csrf))
