"""Prometheus metrics at ``GET /metrics`` (text exposition format 0.0.4).

::

    scrape --> registry (every endpoint id)          one SELECT of ids
           --> queue Redis, one pipeline:            LRANGE/LLEN queue, HKEYS inflight,
                                                     HGETALL status, per endpoint
           --> queue Redis, one pipeline:            HGET state of each task queued
                                                     (the first EXACT_QUEUE) or in flight
           --> this process's hub:                   agents connected

Everything but the agents connected is read at scrape time from the stores
every service process shares (the registry and the queue Redis), never from
counters kept in one process, so any process answers the same. The agents are
counted where their WebSockets are held (``Hub``): today the service is one
process holding them all. The cost is bounded by the endpoints and the tasks in
flight (at most the agents' prefetch) and the first ``EXACT_QUEUE`` tasks of
each queue (a cancelled task stays in its queue list until an agent's take skips
it, so each queued task's state is read), never by the task history.

Labels carry endpoint ids only (UUIDs the service made), never a name a user
chose: the page is open, as Prometheus scrapes it without a token.

Tasks finished, their latency histograms and network bytes are counters the
task path keeps (``nimbus.service.counters``: the script that stores an agent's
results counts them in the same call): one hash per endpoint in the queue Redis,
``...:endpoint:<id>:metrics``, whose fields are bucket counts (``wait:3``,
``run:16`` for +Inf), ``*:sum``, ``*:count``, ``net_in``, ``net_out`` and
``done:<state>``, added to with HINCRBY by whichever service process stored the
result. So the counters are
the service's, not one process's: a scrape of any process reads the same
totals, and they survive a restart of the service (not of its Redis). The
queue wait is the service's own clock (submitted to dispatched, from the task
hash); the run time is the worker's (started to ended, from its record).

Not yet exposed: blocks (the service does not see an endpoint's provider).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from nimbus.records import TaskState
from nimbus.service import counters
from nimbus.service.context import ServiceContext
from nimbus.service.counters import BUCKETS
from nimbus.service.registry import Registry
from nimbus.service.tables import Endpoint

__all__ = ["BUCKETS", "CONTENT_TYPE", "metrics_key", "render", "router"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
EXACT_QUEUE = 2_000  # queued ids whose state is read (cancelled ones are not waiting)
LIVE_STATES = (TaskState.WAITING, TaskState.DISPATCHED, TaskState.RUNNING)

HISTOGRAMS = {
    "wait": ("nimbus_task_queue_wait_seconds", "Seconds from submit to dispatch to an agent."),
    "run": ("nimbus_task_run_seconds", "Seconds a task ran on its worker."),
}

router = APIRouter()
log = logging.getLogger(__name__)


def metrics_key(store: Any, endpoint_id: str) -> str:
    """The hash of an endpoint's counters in the queue Redis (``store``: a TaskStore)."""
    return counters.metrics_key(store.keys, endpoint_id)


def _histogram(name: str, help_text: str, kind: str, saved: dict[str, dict[bytes, bytes]]) -> str:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    for endpoint_id, fields in saved.items():
        total = 0
        for i, bound in enumerate((*BUCKETS, float("inf"))):
            total += int(fields.get(f"{kind}:{i}".encode(), b"0"))
            le = "+Inf" if bound == float("inf") else _number(bound)
            lines.append(f"{name}_bucket{_label(endpoint_id, le=le)} {total}")
        sum_ = float(fields.get(f"{kind}:sum".encode(), b"0"))
        lines.append(f"{name}_sum{_label(endpoint_id)} {_number(round(sum_, 6))}")
        lines.append(f"{name}_count{_label(endpoint_id)} {total}")
    return "\n".join(lines) + "\n"


def _endpoint_ids(registry: Registry) -> list[str]:
    with Session(registry.engine) as session:
        return list(session.scalars(select(Endpoint.id).order_by(Endpoint.id)))


def _family(name: str, kind: str, help_text: str, samples: Iterable[tuple[str, float]]) -> str:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{labels} {_number(value)}" for labels, value in samples]
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _label(endpoint_id: str, **more: str) -> str:
    pairs = {"endpoint_id": endpoint_id, **more}
    body = ",".join(f'{key}="{_escape(value)}"' for key, value in pairs.items())
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


async def render(ctx: ServiceContext) -> str:
    """The metrics page of the service whose context is ``ctx``."""
    ids = await run_in_threadpool(_endpoint_ids, ctx.registry)
    store, keys = ctx.store, ctx.store.keys
    pipe = store.redis.pipeline(transaction=False)
    for endpoint_id in ids:
        pipe.lrange(keys.endpoint_queue(endpoint_id), 0, EXACT_QUEUE - 1)
        pipe.llen(keys.endpoint_queue(endpoint_id))
        pipe.hkeys(keys.endpoint_inflight(endpoint_id))
        pipe.hgetall(keys.endpoint_status(endpoint_id))
        pipe.hgetall(metrics_key(store, endpoint_id))
    replies: list[Any] = await pipe.execute() if ids else []
    queued: dict[str, int] = {}
    inflight: dict[str, list[str]] = {}
    status: dict[str, dict[bytes, bytes]] = {}
    heads: dict[str, list[str]] = {}
    counters: dict[str, dict[bytes, bytes]] = {}
    for i, endpoint_id in enumerate(ids):
        head, length, held, status[endpoint_id], counters[endpoint_id] = replies[5 * i : 5 * i + 5]
        heads[endpoint_id] = [task_id.decode() for task_id in head]
        queued[endpoint_id] = int(length) - len(head)  # beyond EXACT_QUEUE: counted as waiting
        inflight[endpoint_id] = [task_id.decode() for task_id in held]
    pipe = store.redis.pipeline(transaction=False)
    pairs = [(e, t) for e in ids for t in [*heads[e], *inflight[e]]]
    for _, task_id in pairs:
        pipe.hget(keys.task(task_id), "state")
    states: list[Any] = await pipe.execute(raise_on_error=False) if pairs else []
    per_state = {(endpoint_id, state.value): 0 for endpoint_id in ids for state in LIVE_STATES}
    for endpoint_id in ids:
        per_state[endpoint_id, TaskState.WAITING.value] = queued[endpoint_id]
    for (endpoint_id, _), state in zip(pairs, states):
        name = state.decode(errors="replace") if isinstance(state, bytes) else ""
        if (endpoint_id, name) in per_state:  # a task cancelled stays in the queue list
            per_state[endpoint_id, name] += 1
    queued = {e: per_state[e, TaskState.WAITING.value] for e in ids}
    now = time.time()
    agents = {endpoint_id: ctx.hub.online(endpoint_id) for endpoint_id in ids}
    beats: dict[str, float] = {}
    for endpoint_id in ids:
        saved = status[endpoint_id].get(b"last_heartbeat", b"0")
        try:
            last = max(float(saved), ctx.hub.beats.get(endpoint_id, 0.0))
        except ValueError:
            last = ctx.hub.beats.get(endpoint_id, 0.0)
        if last > 0:
            beats[endpoint_id] = max(0.0, now - last)
    workers = {
        endpoint_id: int(status[endpoint_id].get(b"workers", b"0") or 0)
        if agents[endpoint_id]
        else 0
        for endpoint_id in ids
    }
    totals = {state.value: 0 for state in LIVE_STATES}
    for (_, state_name), n in per_state.items():
        totals[state_name] += n
    return "".join(
        [
            _family(
                "nimbus_tasks",
                "gauge",
                "Tasks queued or in flight, by state.",
                [(f'{{state="{state}"}}', n) for state, n in totals.items()],
            ),
            _family(
                "nimbus_endpoint_tasks",
                "gauge",
                "Tasks queued or in flight on an endpoint, by state.",
                [(_label(e, state=s), n) for (e, s), n in per_state.items()],
            ),
            _family(
                "nimbus_endpoint_queue_depth",
                "gauge",
                "Tasks waiting in an endpoint's queue.",
                [(_label(e), queued[e]) for e in ids],
            ),
            _family("nimbus_endpoints", "gauge", "Endpoints registered.", [("", len(ids))]),
            _family(
                "nimbus_endpoints_online",
                "gauge",
                "Endpoints with at least one agent connected.",
                [("", sum(1 for e in ids if agents[e]))],
            ),
            _family(
                "nimbus_endpoint_online",
                "gauge",
                "1 while an agent of the endpoint is connected.",
                [(_label(e), 1 if agents[e] else 0) for e in ids],
            ),
            _family(
                "nimbus_endpoint_agents",
                "gauge",
                "Agents of an endpoint connected.",
                [(_label(e), agents[e]) for e in ids],
            ),
            _family(
                "nimbus_endpoint_workers",
                "gauge",
                "Workers an online endpoint's agent reported.",
                [(_label(e), workers[e]) for e in ids],
            ),
            _family(
                "nimbus_endpoint_heartbeat_age_seconds",
                "gauge",
                "Seconds since an endpoint's last heartbeat (absent if it never beat).",
                [(_label(e), round(age, 3)) for e, age in beats.items()],
            ),
            _family(
                "nimbus_endpoint_tasks_finished_total",
                "counter",
                "Tasks an endpoint finished, by state.",
                [
                    (_label(e, state=s.value), int(counters[e].get(f"done:{s.value}".encode(), 0)))
                    for e in ids
                    for s in (TaskState.SUCCESS, TaskState.FAILED, TaskState.CANCELLED)
                ],
            ),
            *(_histogram(name, text, kind, counters) for kind, (name, text) in HISTOGRAMS.items()),
            _family(
                "nimbus_endpoint_net_bytes_total",
                "counter",
                "Bytes an endpoint's tasks moved over the network (their records), by direction.",
                [
                    (_label(e, direction=d), int(counters[e].get(f"net_{d}".encode(), 0)))
                    for e in ids
                    for d in ("in", "out")
                ],
            ),
        ]
    )


@router.get("/metrics", tags=["service"], response_class=PlainTextResponse)
async def metrics(request: Request) -> PlainTextResponse:
    """Prometheus metrics: tasks by state, queue depths, endpoints online, heartbeats."""
    text = await render(request.app.state.ctx)
    return PlainTextResponse(text, media_type=CONTENT_TYPE)
