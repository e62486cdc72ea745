"""Large payloads through the service's data store, on a real service and endpoint."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from nimbus import Client, Executor
from nimbus.errors import NotFound, PayloadTooLargeError
from nimbus.protocol import PYTHON, SERIALIZER, pack_payload
from service_support import EndpointProcess, Service, service_env

LIMIT = 48 << 20
BIG = 24 << 20
BODY_TIMEOUT = 3.0


def flip(blob: bytes) -> bytes:
    return blob[::-1]


def make(n: int) -> bytes:
    return b"r" * n


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """This module's service takes payloads up to LIMIT (alice and lab use it)."""
    root = tmp_path_factory.mktemp("data-service")
    env = service_env(root, NIMBUS_MAX_PAYLOAD=str(LIMIT), NIMBUS_BODY_TIMEOUT=str(BODY_TIMEOUT))
    big = Service(root, env).start()
    yield big
    big.stop()


def _data_dir(service: Service) -> Path:
    return Path(service.env["NIMBUS_RUNTIME_DIR"]) / "service" / "data"


def _files(service: Service) -> set[str]:
    return set(os.listdir(_data_dir(service)))


def _executor(service: Service, client: Client) -> Executor:
    # the client's own limit is higher: the service's limit is the one that refuses
    return Executor(
        endpoint="lab", settings=service.user_settings(client.token, NIMBUS_MAX_PAYLOAD="1G")
    )


def test_large_argument_and_result_round_trip(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    blob = os.urandom(1 << 20) * (BIG >> 20)
    before = _files(service)
    with _executor(service, alice) as ex:
        assert ex.submit(flip, blob).result(120) == blob[::-1]
        assert ex.submit(flip, b"small").result(60) == b"llams"
    after = _files(service) - before
    assert len(after) == 1, after  # the result's blob; the argument's went with its task
    # the same through Client.run and the REST long-poll
    task_id = alice.run(flip, blob, endpoint="lab")
    assert alice.get_result(task_id, timeout=120) == blob[::-1]
    with service.http(alice.token) as http:
        raw = http.get(f"/v1/tasks/{task_id}/result").json()
    assert raw["state"] == "success"


def test_many_payloads_just_under_the_inline_limit(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    """40 x 900 KiB inline each way: messages are cut (the service takes 32 MB at most)."""
    blobs = [bytes([i]) * (900 << 10) for i in range(40)]
    before = _files(service)
    with _executor(service, alice) as ex:
        assert list(ex.map(flip, blobs)) == [b[::-1] for b in blobs]
    assert _files(service) == before  # all inline


def test_over_the_limit_is_refused_naming_it_and_nothing_is_kept(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    before = _files(service)
    too_big = b"x" * (LIMIT + 1)
    with _executor(service, alice) as ex:
        future = ex.submit(flip, too_big)
        with pytest.raises(PayloadTooLargeError, match=f"limit of {LIMIT} bytes") as info:
            future.result(60)
        assert "NIMBUS_MAX_PAYLOAD" in str(info.value)
        result = ex.submit(make, LIMIT + 1)  # a result over the limit fails its task
        with pytest.raises(PayloadTooLargeError, match=f"limit of {LIMIT} bytes"):
            result.result(120)
    with pytest.raises(PayloadTooLargeError, match=f"limit of {LIMIT} bytes"):
        alice.run(flip, too_big, endpoint="lab")
    with service.http(alice.token) as http:
        declared = http.put("/v1/data", content=too_big)
        assert declared.status_code == 413
        assert f"limit of {LIMIT} bytes" in declared.json()["detail"]
        streamed = http.put("/v1/data", content=iter([b"y" * (1 << 20)] * ((LIMIT >> 20) + 1)))
        assert streamed.status_code == 413  # no Content-Length: cut off once over the limit
        assert f"limit of {LIMIT} bytes" in streamed.json()["detail"]
    assert _files(service) == before  # no blob, no partial file


def test_blobs_are_private_to_their_owner_and_their_endpoint(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    with (
        service.http(alice.token) as a,
        service.http(service.token("bob")) as b,
        service.http(lab.token) as agent,
    ):
        data_id = a.put("/v1/data", content=b"alice's secret").json()["data_id"]
        assert a.get(f"/v1/data/{data_id}").content == b"alice's secret"
        assert b.get(f"/v1/data/{data_id}").status_code == 404
        assert agent.get(f"/v1/data/{data_id}").status_code == 404  # not given to it
        assert a.get("/v1/data/..%2F..%2Fregistry.sqlite3").status_code == 404
        assert a.get("/v1/data/0123").status_code == 404
        bob_ep = b.post("/v1/endpoints", json={"name": "bobs"}).json()["endpoint_id"]
        fn = b.post(
            "/v1/functions",
            json={"function": "eA==", "name": "f", "python": PYTHON, "serializer": SERIALIZER},
        ).json()["function_id"]
        stolen = {"endpoint_id": bob_ep, "tasks": [{"function_id": fn, "data": data_id}]}
        assert b.post("/v1/tasks", json=stolen).status_code == 404
        both = {"function_id": fn, "data": data_id, "payload": "eA=="}
        refused = b.post("/v1/tasks", json={"endpoint_id": bob_ep, "tasks": [both]})
        assert refused.status_code == 422 and "not both" in refused.json()["detail"]
        # an endpoint's token stores only results of tasks in flight on it
        no_task = agent.put("/v1/data", content=b"r")
        assert no_task.status_code == 422 and "task_id" in no_task.json()["detail"]
        other = agent.put("/v1/data", params={"task_id": "nope"}, content=b"r")
        assert other.status_code == 404
        assert a.put("/v1/data", params={"task_id": "x"}, content=b"r").status_code == 422
    # a blob serves one task: a second reference to it is refused
    fn_id = alice.register_function(flip)
    blob = pack_payload(*_pickled((b"abc",)))
    used = alice.upload(blob)
    with service.http(alice.token) as a:
        task = {"function_id": fn_id, "data": used}
        first = a.post("/v1/tasks", json={"endpoint_id": lab.endpoint_id, "tasks": [task]})
        assert first.status_code == 201, first.text
        again = a.post("/v1/tasks", json={"endpoint_id": lab.endpoint_id, "tasks": [task]})
        assert again.status_code in (404, 409), again.text  # 404 once its task has run
    [task_id] = first.json()["task_ids"]
    assert alice.get_result(task_id, timeout=60) == b"cba"
    with pytest.raises(NotFound):
        alice.download(used)  # dropped with its task


def test_result_blob_is_the_owners_only(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    task_id = alice.run(make, 3 << 20, endpoint="lab")
    assert alice.get_result(task_id, timeout=60) == b"r" * (3 << 20)
    with service.http(alice.token) as a:
        stored = a.get(f"/v1/tasks/{task_id}/result", headers={"Accept": "application/msgpack"})
    from nimbus.protocol import data_ref, unpack

    ref = data_ref(unpack(unpack(stored.content)["result"]))
    assert ref is not None, "a 3 MiB result should be in the data store"
    with service.http(service.token("mallory")) as m:
        assert m.get(f"/v1/data/{ref}").status_code == 404
    with httpx.Client(base_url=service.url) as anonymous:
        assert anonymous.get(f"/v1/data/{ref}").status_code == 401


def _pickled(args: tuple[object, ...]) -> tuple[bytes, list[object]]:
    from nimbus import serialization

    data, buffers = serialization.dumps((args, {}))
    return data, list(buffers)


def test_sweep_removes_what_no_task_refers_to(tmp_path: Path) -> None:
    """The data store on a real (embedded) Redis: expired blobs and stale uploads go."""
    import asyncio

    import redis.asyncio as aioredis

    from nimbus.service.data import DataStore
    from nimbus.statestore import Keys, StateStore

    async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    async def scenario(url: str) -> None:
        client = aioredis.Redis.from_url(url)
        keys = Keys("sweep")
        data = DataStore(client, keys, tmp_path / "data", limit=10)
        try:
            kept, size = await data.receive(chunks(b"abc", b"de"), owner="u")
            assert size == 5 and data.path(kept).read_bytes() == b"abcde"
            expired, _ = await data.receive(chunks(b"x"), owner="u")
            with pytest.raises(PayloadTooLargeError, match="limit of 10 bytes"):
                await data.receive(chunks(b"123456", b"789012"), owner="u")
            await client.delete(keys.data(expired))  # as when its task's result expires
            stale = data.root / ".0123.part"
            stale.write_bytes(b"left by a killed service")
            os.utime(stale, (0, 0))
            fresh = data.root / ".4567.part"  # an upload under way
            fresh.write_bytes(b"")
            assert await data.sweep() == 2
            assert sorted(os.listdir(data.root)) == [".4567.part", kept]
        finally:
            await client.aclose()

    with StateStore.open(None, tmp_path / "redis") as store:
        asyncio.run(scenario(store.url))


# ---------------------------------------------------------------- the HTTP edge, raw sockets


def _raw(service: Service, *parts: bytes, timeout: float = 60) -> tuple[bytes, float]:
    """Send ``parts`` on a new loopback connection; all the service answered until it
    closed the connection, and how long that took."""
    host, port = service.url.removeprefix("http://").rsplit(":", 1)
    start = time.monotonic()
    reply = b""
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        try:
            for part in parts:
                sock.sendall(part)
            while chunk := sock.recv(65536):
                reply += chunk
        except (ConnectionResetError, BrokenPipeError):  # it answered and closed with our
            pass  # bytes unread: the kernel resets the connection (what came is kept)
    return reply, time.monotonic() - start


def test_a_stalled_body_is_answered_408_and_its_connection_closed(
    service: Service, alice: Client
) -> None:
    # a body of LIMIT bytes announced (the largest accepted), 3 bytes sent, then silence
    before = _files(service)
    head = (
        f"PUT /v1/data HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {alice.token}\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {LIMIT}\r\n\r\n"
    )
    reply, took = _raw(service, head.encode(), b"abc")
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    assert b"NIMBUS_BODY_TIMEOUT" in reply
    assert BODY_TIMEOUT - 0.5 < took < BODY_TIMEOUT + 10  # not held for ever
    assert _files(service) == before  # the partial file went too
    # a body sent slowly, but each part within the timeout, is taken
    with service.http(alice.token) as http:

        def slow() -> Iterator[bytes]:
            for _ in range(3):
                yield b"x" * 10
                time.sleep(BODY_TIMEOUT / 3)

        data_id = http.put("/v1/data", content=slow()).json()["data_id"]
        assert http.get(f"/v1/data/{data_id}").content == b"x" * 30


def test_a_request_head_over_the_limit_is_answered_431(service: Service) -> None:
    limit = service.settings().max_header_bytes
    request = b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    big = b"X-Pad: " + b"a" * (limit + 1024) + b"\r\n\r\n"
    reply, took = _raw(service, request, big)
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]
    assert b"NIMBUS_MAX_HEADER_BYTES" in reply and took < 10
    # headers sent without end are cut at the limit too, not read for ever
    reply, _ = _raw(service, request, *[b"X-Pad: " + b"a" * 1000 + b"\r\n"] * (limit // 900))
    assert reply.startswith(b"HTTP/1.1 431 ")
    # under the limit: answered
    fits = b"X-Pad: " + b"a" * (limit - 2048) + b"\r\nConnection: close\r\n\r\n"
    reply, _ = _raw(service, request, fits)
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
