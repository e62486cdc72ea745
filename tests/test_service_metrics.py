"""GET /metrics on a real service with a real agent: the exposition parses and counts right."""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path

import pytest

from nimbus import Client
from nimbus.service.metrics import BUCKETS
from service_support import EndpointProcess, Service, ship, two_services

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
            _, _, family, kind = line.split()
            suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
            typed.update(family + suffix for suffix in suffixes)
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


def test_histograms_and_net_bytes_are_the_same_from_every_service_process(
    tmp_path: Path,
) -> None:
    agent = None
    with two_services(tmp_path) as (first, second, _store):
        try:
            with first.client(first.token("hugo")) as client:
                agent = EndpointProcess(first, client, "histo").start(client)
                naps = client.batch_run(nap, [(0.3,)] * 3, endpoint="histo")
                moved = client.run(ship, 100_000, endpoint="histo")
                bad = client.run(int, "x", endpoint="histo")
                slow = client.run(nap, 60, endpoint="histo")
                assert client.cancel(slow)  # counted by state; no run for the histograms
                assert [client.get_result(i, timeout=60) for i in naps] == [0.3] * 3
                assert client.get_result(moved, timeout=60) == 100_000
                with pytest.raises(ValueError):
                    client.get_result(bad, timeout=60)
                eid = agent.endpoint_id
            a, b = scrape(first), scrape(second)
            names = ("nimbus_task_run_seconds", "nimbus_task_queue_wait_seconds")
            kept = (*names, "nimbus_endpoint_net_bytes", "nimbus_endpoint_tasks_finished")
            counted = {k: v for k, v in a.items() if k[0].startswith(kept)}
            assert counted and counted == {k: b[k] for k in counted}  # any process: the same totals
            for name in names:
                buckets = buckets_of(a, name, eid)
                assert buckets[-1][0] == float("inf") and len(buckets) == len(BUCKETS) + 1
                values = [value for _, value in buckets]
                assert values == sorted(values)  # cumulative
                assert a[(f"{name}_count", ep(eid))] == values[-1] == 5
            run = dict(buckets_of(a, "nimbus_task_run_seconds", eid))
            assert run[0.25] <= 2 and run[0.5] == 5  # the three naps of 0.3 s sit in (0.25, 0.5]
            assert 0.9 <= a[("nimbus_task_run_seconds_sum", ep(eid))] < 2.0
            assert a[("nimbus_task_queue_wait_seconds_sum", ep(eid))] >= 0
            assert a[("nimbus_endpoint_tasks_finished_total", ep(eid, state="success"))] == 4
            assert a[("nimbus_endpoint_tasks_finished_total", ep(eid, state="failed"))] == 1
            assert a[("nimbus_endpoint_tasks_finished_total", ep(eid, state="cancelled"))] == 1
            record = client_record(first, moved)
            assert record["net_bytes_out"] >= 100_000 and record["net_bytes_in"] >= 100_000
            for d in ("in", "out"):
                assert a[("nimbus_endpoint_net_bytes_total", ep(eid, direction=d))] >= 100_000
        finally:
            if agent is not None:
                agent.stop()


def buckets_of(
    m: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, eid: str
) -> list[tuple[float, float]]:
    return sorted(
        (float(dict(labels)["le"]), value)
        for (sample, labels), value in m.items()
        if sample == f"{name}_bucket" and ("endpoint_id", eid) in labels
    )


def client_record(service: Service, task_id: str) -> dict[str, float]:
    with service.client(service.token("hugo")) as client:
        record: dict[str, float] = client.get_task(task_id)["record"]
    return record
