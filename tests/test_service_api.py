"""The service's REST API against a real service: auth, ownership, sharing, 422, 413."""

from __future__ import annotations

import base64
import time
import uuid

import pytest

from nimbus.errors import AuthError, NotFound, PayloadTooLargeError
from nimbus.protocol import PYTHON, SERIALIZER, WS_CLIENT, pack_payload
from nimbus.protocol.wsclient import ws_url
from nimbus.service.tasks import new_ids
from service_support import Service

PAYLOAD = base64.b64encode(pack_payload(b"x")).decode()  # packed arguments (never unpickled here)


def _fn_body(name: str = "f") -> dict[str, str]:
    return {
        "function": base64.b64encode(b"not-really-a-pickle-" + name.encode()).decode(),
        "name": name,
        "python": PYTHON,
        "serializer": SERIALIZER,
    }


def test_openapi_is_published(service: Service) -> None:
    with service.http() as http:
        spec = http.get("/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    for path in ("/v1/functions", "/v1/endpoints", "/v1/tasks", "/v1/tasks/{task_id}/cancel"):
        assert path in spec["paths"], path
    assert "HTTPBearer" in spec["components"]["securitySchemes"]


@pytest.mark.parametrize("path", ["/v1/functions", "/v1/endpoints", "/v1/tasks", "/v1/whoami"])
def test_missing_or_wrong_token_is_401(service: Service, path: str) -> None:
    with service.http() as http:
        missing = http.get(path)
    with service.http("nimbus_not-a-token") as http:
        wrong = http.get(path)
    for response in (missing, wrong):
        assert response.status_code == 401, response.text
        assert response.headers["www-authenticate"] == "Bearer"
    assert "token" in missing.json()["detail"]


def test_users_cannot_see_each_others_things_unless_shared(service: Service) -> None:
    alice, bob = service.token("alice"), service.token("bob")
    with service.http(alice) as a, service.http(bob) as b:
        fn = a.post("/v1/functions", json=_fn_body("alices")).json()["function_id"]
        ep = a.post("/v1/endpoints", json={"name": "alice-ep"}).json()["endpoint_id"]
        # bob sees nothing of alice's: 404, not 403 (existence is not leaked)
        assert b.get(f"/v1/functions/{fn}").status_code == 404
        assert b.delete(f"/v1/functions/{fn}").status_code == 404
        assert b.get(f"/v1/endpoints/{ep}").status_code == 404
        assert b.post(f"/v1/endpoints/{ep}/share", json={"users": ["bob"]}).status_code == 404
        assert fn not in [f["function_id"] for f in b.get("/v1/functions").json()["functions"]]
        task = {"endpoint_id": ep, "tasks": [{"function_id": fn, "payload": PAYLOAD}]}
        assert b.post("/v1/tasks", json=task).status_code == 404
        # shared: bob may see and use them, not delete or re-share them (403)
        shared = a.post(f"/v1/functions/{fn}/share", json={"users": ["bob"]})
        assert shared.json()["shared_with"] == ["bob"]
        a.post(f"/v1/endpoints/{ep}/share", json={"users": ["bob"]}).raise_for_status()
        assert b.get(f"/v1/functions/{fn}").json()["owner"] == "alice"
        assert b.get(f"/v1/endpoints/{ep}").json()["name"] == "alice-ep"
        assert b.delete(f"/v1/functions/{fn}").status_code == 403
        assert b.delete(f"/v1/endpoints/{ep}").status_code == 403
        submitted = b.post("/v1/tasks", json=task)
        assert submitted.status_code == 201, submitted.text
        # bob's task is bob's: alice cannot see it, but may clear it from her endpoint
        [task_id, other] = b.post("/v1/tasks", json={**task, "tasks": task["tasks"] * 2}).json()[
            "task_ids"
        ]
        assert b.get(f"/v1/tasks/{task_id}").json()["state"] == "waiting-for-endpoint"
        assert a.get(f"/v1/tasks/{task_id}").status_code == 404
        assert a.post(f"/v1/tasks/{task_id}/cancel").json()["state"] == "cancelled"
        assert b.post(f"/v1/tasks/{other}/cancel").json()["state"] == "cancelled"
        # public: a third user sees it
        carol = service.token("carol")
        with service.http(carol) as c:
            assert c.get(f"/v1/functions/{fn}").status_code == 404
            a.post(f"/v1/functions/{fn}/share", json={"public": True}).raise_for_status()
            assert c.get(f"/v1/functions/{fn}").status_code == 200
        assert a.delete(f"/v1/functions/{fn}").status_code == 200
        assert a.get(f"/v1/functions/{fn}").status_code == 404


def test_endpoint_token_cannot_submit_or_read(service: Service) -> None:
    alice = service.token("alice")
    with service.http(alice) as a:
        fn = a.post("/v1/functions", json=_fn_body("g")).json()["function_id"]
        registered = a.post("/v1/endpoints", json={"name": "ep-token"}).json()
    with service.http(registered["token"]) as e:
        task = {
            "endpoint_id": registered["endpoint_id"],
            "tasks": [{"function_id": fn, "payload": PAYLOAD}],
        }
        response = e.post("/v1/tasks", json=task)
        assert response.status_code == 403
        assert "endpoint's token" in response.json()["detail"]
        assert e.get("/v1/functions").status_code == 403
        assert e.get("/v1/tasks").status_code == 403


def test_malformed_bodies_get_422_naming_the_field(service: Service) -> None:
    alice = service.token("alice")
    with service.http(alice) as a:
        missing = a.post("/v1/functions", json={"name": "x", "python": PYTHON})
        assert missing.status_code == 422
        fields = {err["loc"][-1] for err in missing.json()["detail"]}
        assert {"function", "serializer"} <= fields
        bad_b64 = a.post(
            "/v1/tasks",
            json={"endpoint_id": "e", "tasks": [{"function_id": "f", "payload": "@@not base64@@"}]},
        )
        assert bad_b64.status_code == 422
        assert bad_b64.json()["detail"][0]["loc"] == ["body", "tasks", 0, "payload"]
        bad_timeout = a.post(
            "/v1/tasks",
            json={
                "endpoint_id": "e",
                "tasks": [{"function_id": "f", "payload": "", "timeout": -1}],
            },
        )
        assert bad_timeout.json()["detail"][0]["loc"][-1] == "timeout"
        bad_status = a.get("/v1/tasks", params={"status": "sleeping"})
        assert bad_status.status_code == 422
        assert bad_status.json()["detail"][0]["loc"] == ["query", "status"]
        bad_name = a.post("/v1/endpoints", json={"name": "has spaces"})
        assert bad_name.json()["detail"][0]["loc"] == ["body", "name"]
        not_msgpack = a.post(
            "/v1/tasks/batch",
            content=b"\xc1garbage",
            headers={"content-type": "application/msgpack"},
        )
        assert not_msgpack.status_code == 422
        assert "endpoint_id" in not_msgpack.json()["detail"]


def test_oversized_payload_gets_413_naming_the_limit(service: Service) -> None:
    alice = service.token("alice")
    with service.http(alice) as a:
        response = a.post("/v1/functions", content=b"x" * (2 << 20))
    assert response.status_code == 413
    assert "limit of 1048576 bytes" in response.json()["detail"]
    with service.client(alice) as client:
        client.register_endpoint("big")
        with pytest.raises(PayloadTooLargeError, match="limit of 1048576 bytes"):
            client.run(len, b"y" * (1 << 20), endpoint="big")


def test_client_errors_are_typed(service: Service) -> None:
    with service.client("nimbus_wrong") as wrong, pytest.raises(AuthError) as info:
        wrong.whoami()
    assert info.value.status == 401
    with service.client(service.token("dave")) as client:
        assert client.whoami()["name"] == "dave"
        with pytest.raises(NotFound):
            client.get_task("00000000-0000-0000-0000-000000000000")
        with pytest.raises(NotFound):
            client.get_endpoint("no-such-endpoint")


def test_client_websocket_refuses_a_bad_token(service: Service) -> None:
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    url = ws_url(service.url, WS_CLIENT)
    with pytest.raises(InvalidStatus) as info:
        connect(url, additional_headers={"Authorization": "Bearer nimbus_wrong"}).close()
    assert info.value.response.status_code == 403  # refused before the upgrade


def test_groups_and_batch_status(service: Service) -> None:
    alice, bob = service.token("alice"), service.token("bob")
    with service.http(alice) as a, service.http(bob) as b:
        fn = a.post("/v1/functions", json=_fn_body("grouped")).json()["function_id"]
        ep = a.post("/v1/endpoints", json={"name": "group-ep"}).json()["endpoint_id"]
        body = {"endpoint_id": ep, "tasks": [{"function_id": fn, "payload": PAYLOAD}] * 3}
        submitted = a.post("/v1/tasks", json=body).json()
        ids = submitted["task_ids"]
        group = a.get(f"/v1/groups/{submitted['group_id']}").json()
        assert group["task_ids"] == ids
        assert b.get(f"/v1/groups/{submitted['group_id']}").status_code == 404
        status = a.post("/v1/tasks/status", json={"task_ids": [*ids, "nope"]}).json()["tasks"]
        assert [status[i]["state"] for i in ids] == ["waiting-for-endpoint"] * 3
        assert status["nope"] is None
        assert b.post("/v1/tasks/status", json={"task_ids": ids}).json()["tasks"] == dict.fromkeys(
            ids
        )
        results = a.post("/v1/tasks/results", json={"task_ids": ids}).json()["results"]
        assert results == dict.fromkeys(ids)  # not run: no endpoint is online
        waited = a.get(f"/v1/tasks/{ids[0]}/result", params={"wait": 0.2}).json()
        assert waited == {"task_id": ids[0], "state": "waiting-for-endpoint", "result": None}
        listed = a.get("/v1/tasks", params={"status": "waiting-for-endpoint"}).json()["tasks"]
        assert set(ids) <= {t["task_id"] for t in listed}
        assert not set(ids) & {t["task_id"] for t in b.get("/v1/tasks").json()["tasks"]}
        assert a.post(f"/v1/tasks/{ids[0]}/cancel").json()["cancelled"] is True
        results = a.post("/v1/tasks/results", json={"task_ids": ids[:1]}).json()["results"]
        assert results[ids[0]]["state"] == "cancelled"


def test_task_ids_are_version_7_uuids_that_sort_by_when_they_were_made() -> None:
    before = time.time_ns() // 1_000_000
    ids = new_ids(2_000)
    after = time.time_ns() // 1_000_000
    assert len(set(ids)) == 2_000 and new_ids(0) == []
    for text in ids:
        parsed = uuid.UUID(text)
        assert parsed.version == 7 and parsed.variant == uuid.RFC_4122 and str(parsed) == text
        assert before <= parsed.int >> 80 <= after  # its first 48 bits: the time in ms
    assert len({text[14:] for text in ids}) == 2_000  # 74 random bits after the time
    time.sleep(0.002)
    assert max(ids) < min(new_ids(100))  # made later: sorts later (the history's key)
