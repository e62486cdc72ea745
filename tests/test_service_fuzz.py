"""Fuzz the published OpenAPI spec of a real service with schemathesis: never a 500.

Each operation of ``GET /openapi.json`` gets generated requests (valid and
invalid bodies, paths and queries) with a user's token; a 5xx fails the test
with the request that caused it. Run operation by operation with Hypothesis
directly (schemathesis's pytest plugin does not load on this pytest).
"""

from __future__ import annotations

import pytest

from service_support import Service

schemathesis = pytest.importorskip("schemathesis")
import msgpack  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402


@schemathesis.serializer("application/msgpack")
def _msgpack(ctx: object, value: object) -> bytes:
    """``POST /v1/tasks/batch`` takes msgpack; fuzz it with what the schema generates."""
    data: bytes = msgpack.packb(value, use_bin_type=True)
    return data


def test_no_server_errors(service: Service) -> None:
    token = service.token("fuzzer")
    headers = {"Authorization": f"Bearer {token}"}
    schema = schemathesis.openapi.from_url(service.url + "/openapi.json")
    failures: list[str] = []
    operations = 0
    statuses: list[int] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1

        @given(case=operation.as_strategy())
        @settings(
            max_examples=30,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        def run(case: object) -> None:
            response = case.call(headers=headers, timeout=30)  # type: ignore[attr-defined]
            statuses.append(response.status_code)
            if response.status_code >= 500:
                failures.append(
                    f"{case.method} {case.formatted_path} -> {response.status_code}: "  # type: ignore[attr-defined]
                    f"{response.text[:200]}"
                )

        run()
    assert operations >= 15
    assert len(statuses) > 10 * operations  # requests were really made
    assert not failures, "\n".join(failures[:10])
