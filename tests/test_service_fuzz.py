"""Fuzz the published OpenAPI spec of a real service with schemathesis, as two users.

Phase one sends each operation of ``GET /openapi.json`` generated requests, valid
and invalid (bodies, paths, queries), with user A's token. Phase two is
schemathesis's stateful testing: its state machine chains operations by the links
it finds between them (an id one response returns is the path or body of the
next), so requests reach real objects. Before each such request A makes on an
object of A's (not shared), user B sends the same request: it must answer 404
(400/422 for a request malformed before any lookup; a route answering per id,
``/tasks/status``, maps each of A's ids to null).

The test fails on a 5xx (naming the request), on an object of A's that B reached,
on an operation that never answered 2xx (a service that refuses everything does
not pass), and on too few requests. The seed is random per run and printed with
a failure; ``NIMBUS_FUZZ_SEED`` replays one. Run with Hypothesis directly
(schemathesis's pytest plugin does not load on this pytest).
"""

from __future__ import annotations

import base64
import json
import os
import random
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

from service_support import Service

schemathesis = pytest.importorskip("schemathesis")
import msgpack  # noqa: E402
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis.errors import Flaky, Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

pytestmark = pytest.mark.timeout(180)

ID_KEYS = ("function_id", "endpoint_id", "task_id", "data_id", "group_id")
STATELESS_BUDGET = 20.0  # seconds the first phase is expected to take, about
STATEFUL_BUDGET = 20.0  # seconds of stateful runs after it
WAIT_MAX = 0.2  # seconds a fuzzed long-poll may wait (the runtime stays bounded)
# operations that answer 2xx only with an endpoint's agent online (the fuzzed service has
# none: they answer 409 offline / 404); their 2xx: tests/test_service_environments.py
NEEDS_AGENT = frozenset(
    {
        "POST /v1/endpoints/{endpoint_id}/environments",
        "GET /v1/endpoints/{endpoint_id}/environments/{order_id}",
    }
)


@schemathesis.serializer("application/msgpack")
def _msgpack(ctx: object, value: object) -> bytes:
    """``POST /v1/tasks/batch`` takes msgpack; fuzz it with what the schema generates."""
    data: bytes = msgpack.packb(value, use_bin_type=True)
    return data


def _ids(value: Any) -> Iterator[tuple[str, str]]:
    """Every object id in a JSON answer (at any depth), as (its key, the id)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ID_KEYS and isinstance(item, str):
                yield key, item
            elif key == "task_ids" and isinstance(item, list):
                yield from (("task_id", i) for i in item if isinstance(i, str))
            else:
                yield from _ids(item)
    elif isinstance(value, list):
        for item in value:
            yield from _ids(item)


def _payload() -> bytes:
    """Packed arguments the SDK would send: ``((1,), {})``."""
    from nimbus import serialization
    from nimbus.protocol import pack_payload

    data, buffers = serialization.dumps(((1,), {}))
    return pack_payload(data, buffers)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


class Campaign:
    """What the fuzzing saw: answers per operation, 5xx, and B's replays on A's objects."""

    def __init__(self, service: Service, run_seed: int) -> None:
        self.random = random.Random(run_seed)
        self.a = {"Authorization": f"Bearer {service.token('fuzz-a')}"}
        self.b = {"Authorization": f"Bearer {service.token('fuzz-b')}"}
        self.owned: set[str] = set()  # ids of A's objects, from A's answers
        self.kinds: dict[str, list[str]] = defaultdict(list)  # the same by key: "task_id"...
        self.anchors: set[str] = set()  # made before the fuzzing: never deleted
        self.anchors_of: dict[str, str] = {}  # the anchor endpoint_id and function_id
        self.shared: set[str] = set()  # ids A shared (B may reach those)
        self.statuses: dict[str, Counter[int]] = defaultdict(Counter)
        self.server_errors: list[str] = []
        self.leaks: list[str] = []
        self.isolation_checks = 0

    @staticmethod
    def describe(case: Any) -> str:
        body = case.body if not _is_unset(case.body) else None
        return (
            f"{case.method} {case.formatted_path} query={case.query!r} "
            f"body={json.dumps(body, default=repr)[:300]}"
        )

    def anchor(self, service: Service) -> None:
        """A's endpoint, function and tasks, made with real requests before the fuzzing,
        so that every operation can meet real objects from its first request."""
        from nimbus import serialization
        from nimbus.protocol import PYTHON, SERIALIZER

        with service.http(self.a["Authorization"].split()[1]) as http:
            endpoint = http.post("/v1/endpoints", json={"name": "fuzz-anchor"})
            function = http.post(
                "/v1/functions",
                json={
                    "function": base64.b64encode(serialization.dumps_function(abs)).decode(),
                    "name": "abs",
                    "python": PYTHON,
                    "serializer": SERIALIZER,
                },
            )
            endpoint_id = endpoint.json()["endpoint_id"]
            function_id = function.json()["function_id"]
            rows = [{"function_id": function_id, "payload": base64.b64encode(_payload()).decode()}]
            tasks = http.post("/v1/tasks", json={"endpoint_id": endpoint_id, "tasks": rows * 3})
        for response in (endpoint, function, tasks):
            assert response.status_code == 201, response.text
            for kind, object_id in _ids(response.json()):
                self.anchors.add(object_id)
                self.anchors_of.setdefault(kind, object_id)
                if object_id not in self.owned:
                    self.owned.add(object_id)
                    self.kinds[kind].append(object_id)

    def prepare(self, case: Any) -> None:
        """Make a generated request A's: A's token (not a generated Authorization),
        long-polls of at most WAIT_MAX seconds, and, half the time, ids of A's real
        objects in place of generated ones (a task needs an endpoint and a function
        of A's at once, which no single link gives)."""
        case.headers = {
            k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"
        } | self.a  # case.call(headers=...) does not override the case's own
        if isinstance(case.query, dict) and "wait" in case.query:
            try:
                case.query["wait"] = min(float(case.query["wait"]), WAIT_MAX)
            except (TypeError, ValueError):
                pass
        pick = self.random.random() < 0.5
        deleting = case.method.upper() == "DELETE"
        for name, value in list((case.path_parameters or {}).items()):
            ids = [i for i in self.kinds.get(name, []) if not (deleting and i in self.anchors)]
            if pick and ids:
                case.path_parameters[name] = self.random.choice(ids)
            elif deleting and value in self.anchors:  # a link reached one: it stays
                case.path_parameters[name] = str(uuid.uuid4())
        if pick and case.operation.path.endswith("/share") and isinstance(case.body, dict):
            # users that exist: a generated name is nearly always none (404), and a CI run's
            # 27 tries of a function's share never got a 2xx
            case.body["users"] = [] if self.random.random() < 0.7 else ["fuzz-b"]
            case.body["remove"] = []
            for name in case.path_parameters or {}:  # and, half the time, an object that is
                if name in self.anchors_of and self.random.random() < 0.5:  # never deleted
                    case.path_parameters[name] = self.anchors_of[name]
        kinds = self.kinds
        if not pick or not kinds.get("endpoint_id") or not kinds.get("function_id"):
            return
        if case.operation.path == "/v1/tasks/batch":  # msgpack, described as binary
            function_id, endpoint_id = (
                self.anchors_of["function_id"],
                self.anchors_of["endpoint_id"],
            )
            case.body = {"endpoint_id": endpoint_id, "tasks": [[function_id, _payload(), None]]}
            return
        body = case.body
        if not isinstance(body, dict) or "endpoint_id" not in body:
            return  # only fields the operation has: an extra one would be ignored
        body["endpoint_id"] = (  # the anchor is never deleted; others may have been
            self.anchors_of["endpoint_id"]
            if self.random.random() < 0.5
            else self.random.choice(kinds["endpoint_id"])
        )
        rows = body.get("tasks")
        if not isinstance(rows, list) or not rows or self.random.random() < 0.3:
            body["tasks"] = [{"function_id": ""}]  # one row at least, made valid below
        for row in body.get("tasks") or []:
            if isinstance(row, dict):
                row["function_id"] = self.random.choice(kinds["function_id"])
                # an opaque payload the service checks (framing) and a bounded timeout:
                # random ones are refused, and every row must pass for a 201
                row["payload"] = base64.b64encode(_payload()).decode()
                if "timeout" in row:
                    row["timeout"] = 30.0
                # a generated data id beside the payload (refused: one or the other) or
                # environment (a random dict, nearly always refused) would keep most
                # rows from a 201: a CI run's 54 tries never got one
                row.pop("data", None)
                if "environment" in row and self.random.random() < 0.8:
                    row["environment"] = None

    def record(self, case: Any, response: Any, user: str = "A") -> None:
        self.statuses[case.operation.label].update([response.status_code])
        if response.status_code >= 500:
            self.server_errors.append(
                f"as {user}: {self.describe(case)} -> {response.status_code}: {response.text[:200]}"
            )
        if user == "A" and 200 <= response.status_code < 300:
            try:
                answer = response.json()
            except ValueError:
                return
            for kind, object_id in _ids(answer):
                if object_id not in self.owned:
                    self.owned.add(object_id)
                    self.kinds[kind].append(object_id)
            if case.formatted_path.endswith("/share"):
                self.shared.update(case.path_parameters.values())

    def foreign(self, case: Any) -> list[str]:
        """The ids of A's unshared objects this request names (path or body)."""
        named = [*_strings(case.path_parameters)]
        if not _is_unset(case.body):
            named.extend(_strings(case.body))
        return [i for i in named if i in self.owned and i not in self.shared]

    def as_b(self, case: Any) -> None:
        """B sends A's request on an object of A's first: it must be refused."""
        foreign = self.foreign(case)
        if not foreign:
            return
        case.headers |= self.b
        try:
            response = case.call(timeout=30)
        finally:
            case.headers |= self.a
        self.record(case, response, user="B")
        self.isolation_checks += 1
        if not self.refused(response, foreign):
            self.leaks.append(f"{self.describe(case)} as B -> {response.status_code}")

    @staticmethod
    def refused(response: Any, foreign: list[str]) -> bool:
        """B's answer: 404; or 400/422 (malformed, nothing looked up); or, from a
        route answering per id (``/tasks/status``), each of A's ids mapped to null."""
        if response.status_code in (404, 400, 422):
            return True
        if not 200 <= response.status_code < 300:
            return False  # 403 or 409 would say that the object exists
        try:
            answer = response.json()
        except ValueError:
            return False
        seen: dict[str, Any] = {}

        def walk(value: Any) -> None:
            if isinstance(value, dict):
                for key, item in value.items():
                    if key in foreign:
                        seen.setdefault(key, item)
                    walk(item)
            elif isinstance(value, list):
                for item in value:
                    walk(item)

        walk(answer)
        return set(seen) == set(foreign) and all(item is None for item in seen.values())


def _is_unset(value: Any) -> bool:
    return type(value).__name__ == "NotSet"


def test_fuzz_two_users_stateful(service: Service) -> None:
    schema = schemathesis.openapi.from_url(service.url + "/openapi.json")
    run_seed = int(os.environ.get("NIMBUS_FUZZ_SEED") or random.randrange(2**32))
    campaign = Campaign(service, run_seed)
    campaign.anchor(service)
    started = time.monotonic()
    operations = [result.ok() for result in schema.get_all_operations()]
    for operation in operations:  # phase one: each operation alone, as A
        for mode, examples in ((GenerationMode.POSITIVE, 10), (GenerationMode.NEGATIVE, 5)):

            @seed(run_seed)
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=examples,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                database=None,
            )
            def alone(case: Any) -> None:
                campaign.prepare(case)
                campaign.record(case, case.call(timeout=30))

            try:
                alone()
            except Unsatisfiable:  # no input of it can be invalid (no parameters, no body)
                assert mode == GenerationMode.NEGATIVE, operation.label
    stateless = time.monotonic() - started

    class TwoUsers(schema.as_state_machine()):  # type: ignore[misc]
        """Phase two: chains of linked operations as A, each replayed as B first."""

        def before_call(self, case: Any) -> None:
            campaign.prepare(case)
            campaign.as_b(case)

        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"timeout": 30}

        def after_call(self, response: Any, case: Any) -> None:
            campaign.record(case, response)

        def validate_response(self, response: Any, case: Any, **kwargs: Any) -> None:
            pass  # judged by the campaign: 5xx, leaks, 2xx per operation

    # Hypothesis replays a scenario to shrink or check it, and a live service answers
    # differently the second time (its state moved on): that ends a run as Flaky,
    # which schemathesis's own runner also treats as the end of a suite, not a fault.
    # The campaign judges every answer as it comes, so runs go on until the budget.
    stateful_runs = flaky = 0
    while time.monotonic() - started < STATELESS_BUDGET + STATEFUL_BUDGET and stateful_runs < 4:
        machine = seed(run_seed + stateful_runs)(TwoUsers)
        stateful_runs += 1
        try:
            machine.run(
                settings=settings(
                    max_examples=25,
                    stateful_step_count=8,
                    deadline=None,
                    suppress_health_check=list(HealthCheck),
                    database=None,
                )
            )
        except Flaky:
            flaky += 1
    elapsed = time.monotonic() - started
    requests = sum(sum(c.values()) for c in campaign.statuses.values())
    summary = (
        f"seed {run_seed} (NIMBUS_FUZZ_SEED replays it): {requests} requests on "
        f"{len(operations)} operations in {elapsed:.0f} s ({stateless:.0f} s alone), "
        f"{campaign.isolation_checks} replays as B on A's objects, "
        f"{stateful_runs} stateful runs ({flaky} ended by a flaky replay); "
        f"statuses: {dict((k, dict(v)) for k, v in sorted(campaign.statuses.items()))}"
    )
    print(summary)
    assert not campaign.server_errors, (
        "5xx:\n" + "\n".join(campaign.server_errors[:20]) + "\n" + summary
    )
    assert not campaign.leaks, (
        "B reached A's objects:\n" + "\n".join(campaign.leaks) + "\n" + summary
    )
    assert len(operations) >= 15, summary
    assert requests > 20 * len(operations), summary
    assert campaign.isolation_checks >= 20, summary
    never = sorted(
        label
        for label, counts in campaign.statuses.items()
        if not any(200 <= status < 300 for status in counts) and label not in NEEDS_AGENT
    )
    assert not never, f"never answered 2xx: {never}; " + summary
