"""GET /metrics on a real service with a real agent: the exposition parses and counts right."""

from __future__ import annotations

import re
import time
from collections import Counter

from nimbus import Client
from service_support import EndpointProcess, Service

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_]+="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def parse(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Samples of a text exposition; fails on any line that is not a comment or a sample."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
            continue
        if line.startswith("# HELP "):
            continue
        match = SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        name, labels, value = match.groups()
        assert name in typed, f"{name} has no TYPE line before its samples"
        pairs = frozenset(re.findall(r'([a-zA-Z_]+)="((?:[^"\\]|\\.)*)"', labels or ""))
        key = (name, pairs)
        assert key not in out, f"sample {line!r} given twice"
        out[key] = float(value)
    return out


def scrape(service: Service) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with service.http() as http:  # no token: Prometheus scrapes without one
        response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(response.text)


def ep(endpoint_id: str, **more: str) -> frozenset[tuple[str, str]]:
    return frozenset({("endpoint_id", endpoint_id), *more.items()})


def test_metrics_count_tasks_endpoints_and_heartbeats(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    offline = EndpointProcess(service, alice, "offline-metrics")  # registered, never started
    waiting = [alice.run(nap, 0.1, endpoint="offline-metrics") for _ in range(3)]
    slow = alice.batch_run(nap, [(20,)] * 6, endpoint="lab")
    try:
        deadline = time.monotonic() + 20
        while True:  # the agent takes them and runs some: the metrics say what the tasks say
            m = scrape(service)
            lab_states = {
                s: m[("nimbus_endpoint_tasks", ep(lab.endpoint_id, state=s))]
                for s in ("waiting-for-endpoint", "dispatched", "running")
            }
            truth = Counter(alice.get_task(task_id)["state"] for task_id in slow)
            if lab_states["running"] >= 1 and lab_states == {s: truth[s] for s in lab_states}:
                break
            assert time.monotonic() < deadline, (lab_states, truth)
            time.sleep(0.1)
        assert sum(lab_states.values()) == 6, lab_states
        assert (
            m[("nimbus_endpoint_queue_depth", ep(lab.endpoint_id))]
            == lab_states["waiting-for-endpoint"]
        )
        assert m[("nimbus_endpoint_queue_depth", ep(offline.endpoint_id))] == 3
        assert m[("nimbus_endpoint_tasks", ep(offline.endpoint_id, state="running"))] == 0
        assert m[("nimbus_tasks", frozenset({("state", "running")}))] >= 2
        assert m[("nimbus_tasks", frozenset({("state", "waiting-for-endpoint")}))] >= 3
        assert m[("nimbus_endpoint_online", ep(lab.endpoint_id))] == 1
        assert m[("nimbus_endpoint_online", ep(offline.endpoint_id))] == 0
        assert m[("nimbus_endpoint_workers", ep(lab.endpoint_id))] == 2
        assert m[("nimbus_endpoint_agents", ep(lab.endpoint_id))] == 1
        assert m[("nimbus_endpoints_online", frozenset())] >= 1
        assert m[("nimbus_endpoints", frozenset())] >= 2
        assert 0 <= m[("nimbus_endpoint_heartbeat_age_seconds", ep(lab.endpoint_id))] < 5
        assert ("nimbus_endpoint_heartbeat_age_seconds", ep(offline.endpoint_id)) not in m
    finally:
        for task_id in [*waiting, *slow]:
            alice.cancel(task_id)
    m = scrape(service)
    assert m[("nimbus_endpoint_queue_depth", ep(offline.endpoint_id))] == 0
    assert m[("nimbus_endpoint_tasks", ep(lab.endpoint_id, state="waiting-for-endpoint"))] == 0
