"""The service and its agents against hostile and careless input (issue 13: #1-#4, #9, #11).

Every test talks to a real service process (its queue Redis is the tests' shared
embedded store, so a test can corrupt a record as a bug or an old version would)
and real agent processes. Each finding is reproduced as it was reported, then the
service is asked to serve a normal task afterwards.
"""

from __future__ import annotations

import asyncio
import base64
import math
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from nimbus import Client, Executor
from nimbus.config import MAX_TIMEOUT, Settings
from nimbus.errors import ConfigError, DeserializationError, QuotaExceeded
from nimbus.protocol import (
    MSGPACK,
    NOT_MSGPACK,
    PYTHON,
    RECEIVE_MAX,
    SERIALIZER,
    TEXT_FRAME,
    WRONG_SHAPE,
    pack,
    pack_payload,
    unpack,
)
from nimbus.statestore import Keys
from service_support import EndpointProcess, Service, closed_with, serve, ws_connect

CLOSE_CODES = {TEXT_FRAME, NOT_MSGPACK, WRONG_SHAPE}


def square(x: int) -> int:
    return x * x


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, store_url: str) -> Iterator[Service]:
    """A service with small quotas, whose queue Redis the tests can reach."""
    yield from serve(
        tmp_path_factory,
        "hostile",
        NIMBUS_REDIS_URL=store_url,
        NIMBUS_INLINE_PAYLOAD="64K",
        NIMBUS_MAX_QUEUED_TASKS="40",
        NIMBUS_MAX_QUEUED_BYTES="600K",
        NIMBUS_MAX_BATCH="30",
    )


@pytest.fixture(scope="module")
def queue_redis(store_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(store_url)
    yield client
    client.close()


def _function(client: Client, fn: Any = square) -> str:
    return client.register_function(fn)


def _served(client: Client, endpoint: str) -> None:
    """The endpoint still runs an ordinary task."""
    assert client.get_result(client.run(square, 9, endpoint=endpoint), timeout=60) == 81


def _log(service: Service) -> str:
    return service.log.read_text(errors="replace")


def _no_tracebacks(service: Service, since: int = 0) -> None:
    """No traceback in the service's log after its first ``since`` characters."""
    assert "Traceback" not in _log(service)[since:]


# ---------------------------------------------------------------- 1: payloads


def test_payloads_the_service_can_check_get_422(service: Service, alice: Client) -> None:
    fn = _function(alice)
    ep = alice.register_endpoint("p-offline")["endpoint_id"]
    bad = {
        "missing": None,
        "empty": "",
        "not base64": "!!!",
        "not a packed payload": base64.b64encode(b"garbage!").decode(),
        "msgpack, wrong shape": base64.b64encode(pack([1, 2, 3])).decode(),
        "buffers not bytes": base64.b64encode(pack([b"x", [5]])).decode(),
        "extra data": base64.b64encode(pack_payload(b"x") + b"!").decode(),
    }
    with service.http(alice.token) as http:
        for what, payload in bad.items():
            task: dict[str, Any] = {"function_id": fn}
            if payload is not None:
                task["payload"] = payload
            response = http.post("/v1/tasks", json={"endpoint_id": ep, "tasks": [task]})
            assert response.status_code == 422, (what, response.text)
            assert "payload" in response.text, (what, response.text)
        for what, payload_bytes in {"garbage": b"garbage!", "empty": b""}.items():
            body = pack({"endpoint_id": ep, "tasks": [[fn, payload_bytes, None]]})
            response = http.post("/v1/tasks/batch", content=body, headers={"content-type": MSGPACK})
            assert response.status_code == 422, (what, response.text)
            assert "tasks[0].payload" in response.json()["detail"]
        ok = {"function_id": fn, "payload": base64.b64encode(pack_payload(b"x")).decode()}
        assert http.post("/v1/tasks", json={"endpoint_id": ep, "tasks": [ok]}).status_code == 201


def test_a_payload_the_agent_cannot_decode_fails_that_task_alone(
    alice: Client, lab: EndpointProcess
) -> None:
    fn = _function(alice)
    # the data store keeps bytes it cannot check: the agent meets them
    undecodable = alice.upload(b"garbage!")
    not_a_pickle = pack_payload(b"garbage!")
    body = pack(
        {
            "endpoint_id": lab.endpoint_id,
            "tasks": [[fn, {"data": undecodable}, None], [fn, not_a_pickle, None]],
        }
    )
    response = alice.request(
        "POST", "/v1/tasks/batch", content=body, headers={"Content-Type": MSGPACK}
    )
    ids = unpack(response.content)["task_ids"]
    for task_id in ids:
        with pytest.raises(DeserializationError):
            alice.get_result(task_id, timeout=60)
        assert alice.get_task(task_id)["state"] == "failed"
    assert lab.proc is not None and lab.proc.poll() is None, lab.log.read_text()[-3000:]
    _served(alice, "lab")


def test_the_endpoint_owner_can_cancel_any_task_queued_on_it(service: Service) -> None:
    owner, guest, stranger = (service.token(u) for u in ("own1", "guest1", "stranger1"))
    with service.client(owner) as a, service.client(guest) as b:
        ep = a.register_endpoint("owned")["endpoint_id"]
        a.share_endpoint(ep, users=["guest1"])
        [task_id] = b.batch_run(square, [(1,)], endpoint=ep)
    with service.http(stranger) as c:
        assert c.post(f"/v1/tasks/{task_id}/cancel").status_code == 404
    with service.http(owner) as a_http:
        assert a_http.get(f"/v1/tasks/{task_id}").status_code == 404  # still not theirs to read
        cancelled = a_http.post(f"/v1/tasks/{task_id}/cancel")
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["cancelled"] is True
        assert cancelled.json()["state"] == "cancelled"
    with service.http(guest) as b_http:
        assert b_http.get(f"/v1/tasks/{task_id}").json()["state"] == "cancelled"


# ---------------------------------------------------------------- 2, 9: timeouts

BAD_TIMEOUTS = [math.inf, -math.inf, math.nan, 1e300, 2**63, -1, 0, MAX_TIMEOUT + 1]


def test_rest_timeouts_are_finite_and_bounded(service: Service, alice: Client) -> None:
    fn = _function(alice)
    ep = alice.register_endpoint("t-offline")["endpoint_id"]
    payload = base64.b64encode(pack_payload(b"x")).decode()
    with service.http(alice.token) as http:
        for text in ["Infinity", "-Infinity", "NaN", "1e300", str(2**63), "-1", "0", '"5"']:
            raw = (
                f'{{"endpoint_id": "{ep}", "tasks": [{{"function_id": "{fn}", '
                f'"payload": "{payload}", "timeout": {text}}}]}}'
            )
            response = http.post(
                "/v1/tasks", content=raw, headers={"content-type": "application/json"}
            )
            assert response.status_code == 422, (text, response.text)
            assert "timeout" in response.text
        for timeout in [*BAD_TIMEOUTS, True, "5", [1]]:
            body = pack({"endpoint_id": ep, "tasks": [[fn, pack_payload(b"x"), timeout]]})
            response = http.post("/v1/tasks/batch", content=body, headers={"content-type": MSGPACK})
            assert response.status_code == 422, (timeout, response.text)
            assert "tasks[0].timeout" in response.json()["detail"]
            if isinstance(timeout, float | int) and not isinstance(timeout, bool):
                assert str(MAX_TIMEOUT) in response.json()["detail"]
        good = pack({"endpoint_id": ep, "tasks": [[fn, pack_payload(b"x"), float(MAX_TIMEOUT)]]})
        response = http.post("/v1/tasks/batch", content=good, headers={"content-type": MSGPACK})
        assert response.status_code == 201, response.text


def test_client_and_websocket_timeouts_are_checked(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    for timeout in BAD_TIMEOUTS:
        with pytest.raises(ValueError, match="timeout"):
            alice.run(square, 2, endpoint="lab", timeout=timeout)
    fn = _function(alice)
    with ws_connect(service, "/v1/ws/client", alice.token) as ws:
        for i, timeout in enumerate([*BAD_TIMEOUTS, True]):
            row = [fn, pack_payload(b"x"), timeout]
            ws.send(
                pack({"op": "submit", "ref": i, "endpoint_id": lab.endpoint_id, "tasks": [row]})
            )
            answer = unpack(ws.recv(timeout=10))
            assert answer["op"] == "refused" and answer["ref"] == i, answer
            assert answer["status"] == 422 and "timeout" in answer["detail"]
    with Executor(endpoint="lab", settings=service.user_settings(alice.token)) as ex:
        for timeout in BAD_TIMEOUTS:
            with pytest.raises(ValueError, match="timeout"):
                ex.options(timeout=timeout)
        assert ex.options(timeout=30).submit(square, 5).result(60) == 25
    _served(alice, "lab")  # the manager never saw a bad value


def test_local_executor_timeouts_are_checked_and_the_runtime_lives() -> None:
    with Executor(2) as ex:
        for timeout in BAD_TIMEOUTS:
            with pytest.raises(ValueError, match=str(MAX_TIMEOUT)):
                ex.options(timeout=timeout)
        with pytest.raises(ValueError, match="task_timeout"):
            Executor(1, task_timeout=math.inf)
        assert ex.options(timeout=MAX_TIMEOUT).submit(square, 3).result(30) == 9


def test_json_nan_and_a_lone_surrogate_get_422(service: Service, alice: Client) -> None:
    with service.http(alice.token) as http:
        raw = (
            '{"function": "eA==", "name": "s", "python": "' + PYTHON + '", "serializer": "\\ud800"}'
        )
        response = http.post(
            "/v1/functions", content=raw, headers={"content-type": "application/json"}
        )
        assert response.status_code == 422, response.text
        nan = '{"endpoint_id": "e", "tasks": [{"function_id": "f", "timeout": NaN}]}'
        response = http.post("/v1/tasks", content=nan, headers={"content-type": "application/json"})
        assert response.status_code == 422, response.text
        assert "timeout" in response.text
        assert http.get("/v1/health").status_code == 200
    fn = {"function": "eA==", "name": "ok", "python": PYTHON, "serializer": SERIALIZER}
    with service.http(alice.token) as http:
        assert http.post("/v1/functions", json=fn).status_code == 201


# ---------------------------------------------------------------- 3: batch rows, bad records


def test_malformed_batch_rows_get_422_naming_the_row(service: Service, alice: Client) -> None:
    fn = _function(alice)
    ep = alice.register_endpoint("rows-offline")["endpoint_id"]
    p = pack_payload(b"x")
    bad: dict[str, tuple[Any, str]] = {
        "timeout True": ([[fn, p, True]], "tasks[0].timeout"),
        "too short": ([[fn, p]], "tasks[0]"),
        "too long": ([[fn, p, None, 1]], "tasks[0]"),
        "not a list": (["abc"], "tasks[0]"),
        "function id int": ([[5, p, None]], "tasks[0].function_id"),
        "second row bad": ([[fn, p, None], [fn, p, "x"]], "tasks[1].timeout"),
        "bad data ref": ([[fn, {"data": 5}, None]], "tasks[0].payload"),
        "tasks a map": ({"a": 1}, "tasks"),
    }
    with service.http(alice.token) as http:
        for what, (rows, field) in bad.items():
            body = pack({"endpoint_id": ep, "tasks": rows})
            response = http.post("/v1/tasks/batch", content=body, headers={"content-type": MSGPACK})
            assert response.status_code == 422, (what, response.text)
            assert field in response.json()["detail"], (what, response.text)
        long_id = http.post("/v1/tasks/status", json={"task_ids": ["x" * 65]})
        assert long_id.status_code == 422, long_id.text
        for body in [pack([1, 2]), pack({"endpoint_id": 5, "tasks": [[fn, p, None]]}), pack(5)]:
            response = http.post("/v1/tasks/batch", content=body, headers={"content-type": MSGPACK})
            assert response.status_code == 422, response.text


def test_a_bad_record_in_redis_fails_its_task_and_dispatch_goes_on(
    service: Service, alice: Client, queue_redis: redis.Redis
) -> None:
    keys = Keys("service")
    agent = EndpointProcess(service, alice, "records")
    # first in the queue: a task whose hash is not a hash kills the take script: the
    # dispatcher fails, and is started again
    [doomed] = alice.batch_run(square, [(0,)], endpoint="records")
    queue_redis.delete(keys.task(doomed))
    queue_redis.set(keys.task(doomed), "not a hash")
    ids = alice.batch_run(square, [(i,) for i in range(4)], endpoint="records")
    queue_redis.hset(keys.task(ids[0]), "timeout", "True")  # what a row of [FN, p, True] made
    queue_redis.hset(keys.task(ids[1]), mapping={"submitted": "abc", "record": b"\xc1"})
    queue_redis.hset(keys.task(ids[2]), "payload", 50_000_000)
    # the user's routes answer on bad records
    assert len(alice.list_tasks(limit=1000)) >= 4
    for task_id in ids:
        assert alice.get_task(task_id)["task_id"] == task_id
    status = alice.request("POST", "/v1/tasks/status", json={"task_ids": ids}).json()["tasks"]
    assert set(status) == set(ids)
    restarts = _log(service).count("restarting it")
    agent.start(alice)
    try:
        assert alice.get_result(ids[3], timeout=60) == 9
        with pytest.raises(Exception) as info:
            alice.get_result(ids[0], timeout=60)
        assert "timeout" in str(info.value)
        assert alice.get_result(ids[1], timeout=60) == 1  # its own fields are still good
        with pytest.raises(DeserializationError):
            alice.get_result(ids[2], timeout=60)
        assert alice.cancel(ids[0]) is False
        _served(alice, "records")
        assert _log(service).count("restarting it") > restarts  # the dispatcher did die
        assert agent.proc is not None and agent.proc.poll() is None
    finally:
        agent.stop()
        queue_redis.delete(keys.task(doomed))


# ---------------------------------------------------------------- 4: types, limits, quotas


def test_payload_types_inline_limit_and_batch_size(service: Service, alice: Client) -> None:
    fn = _function(alice)
    ep = alice.register_endpoint("sizes-offline")["endpoint_id"]
    with service.http(alice.token) as http:
        for payload in [50_000_000, 1.5, None, [1, 2], {"x": 1}]:
            body = pack({"endpoint_id": ep, "tasks": [[fn, payload, None]]})
            response = http.post("/v1/tasks/batch", content=body, headers={"content-type": MSGPACK})
            assert response.status_code == 422, (payload, response.text)
            assert "tasks[0].payload" in response.json()["detail"]
        big = pack_payload(b"y" * (100 << 10))  # over the 64 KiB inline limit
        body = pack({"endpoint_id": ep, "tasks": [[fn, big, None]]})
        response = http.post("/v1/tasks/batch", content=body, headers={"content-type": MSGPACK})
        assert response.status_code == 413, response.text
        detail = response.json()["detail"]
        assert "65536" in detail and "/v1/data" in detail and "NIMBUS_INLINE_PAYLOAD" in detail
        inline = base64.b64encode(big).decode()
        response = http.post(
            "/v1/tasks",
            json={"endpoint_id": ep, "tasks": [{"function_id": fn, "payload": inline}]},
        )
        assert response.status_code == 413, response.text
        rows = [[fn, pack_payload(b"x"), None]] * 31
        body = pack({"endpoint_id": ep, "tasks": rows})
        response = http.post("/v1/tasks/batch", content=body, headers={"content-type": MSGPACK})
        assert response.status_code == 422 and "NIMBUS_MAX_BATCH" in response.text
    # through the data store, a large payload is fine
    [task_id] = alice.batch_run(len, [(b"y" * (100 << 10),)], endpoint=ep)
    assert alice.cancel(task_id) is True


def test_quotas_on_queued_tasks_and_bytes(service: Service) -> None:
    token = service.token("quota")
    with service.client(token) as client, service.http(token) as http:
        fn = _function(client)
        ep = client.register_endpoint("quota-offline")["endpoint_id"]
        ids = client.batch_run(square, [(i,) for i in range(30)], endpoint=ep)
        ids += client.batch_run(square, [(i,) for i in range(10)], endpoint=ep)
        with pytest.raises(QuotaExceeded, match="NIMBUS_MAX_QUEUED_TASKS") as info:
            client.batch_run(square, [(1,)], endpoint=ep)
        assert info.value.status == 429
        assert "40" in str(info.value)
        for task_id in ids[:20]:
            assert client.cancel(task_id)
        ids = ids[20:] + client.batch_run(square, [(i,) for i in range(5)], endpoint=ep)
        for task_id in ids:
            client.cancel(task_id)
        # bytes: 10 x 58 KiB fit, the 11th passes 600 KiB
        blob = pack_payload(b"z" * (58 << 10))
        body = pack({"endpoint_id": ep, "tasks": [[fn, blob, None]] * 10})
        response = http.post("/v1/tasks/batch", content=body, headers={"content-type": MSGPACK})
        assert response.status_code == 201, response.text
        body = pack({"endpoint_id": ep, "tasks": [[fn, blob, None]]})
        response = http.post("/v1/tasks/batch", content=body, headers={"content-type": MSGPACK})
        assert response.status_code == 429, response.text
        assert "NIMBUS_MAX_QUEUED_BYTES" in response.json()["detail"]
    with service.client(service.token("quota2")) as other:  # per user: others unaffected
        other.batch_run(square, [(1,)], endpoint=other.register_endpoint("q2")["endpoint_id"])


def test_quota_frees_when_tasks_finish(service: Service, alice: Client) -> None:
    agent = EndpointProcess(service, alice, "quota-run").start(alice)
    try:
        for _ in range(3):  # 3 x 30 tasks through a 40-task quota
            ids = alice.batch_run(square, [(i,) for i in range(30)], endpoint="quota-run")
            assert [alice.get_result(i, timeout=60) for i in ids] == [i * i for i in range(30)]
    finally:
        agent.stop()


# ---------------------------------------------------------------- 11: WebSocket frames


def _hello(**fields: Any) -> bytes:
    hello = {"op": "hello", "python": PYTHON, "serializer": SERIALIZER, "workers": 1}
    return pack({**hello, "window": 4, "held": [], **fields})


MALFORMED_AGENT_FIRST: list[str | bytes] = [
    "hello",  # a text frame
    b"\xc1\x00garbage",
    pack(5),
    pack([1, 2]),
    pack({"op": "hello", "workers": "abc"}),
    pack({"op": "hello", "window": -1}),
    pack({"op": "results"}),  # before hello
]
MALFORMED_AFTER_HELLO: list[str | bytes] = [
    "text",
    b"\xc1",
    pack(5),
    pack({"op": 5}),
    pack({"op": "nope"}),
    pack({"op": "results", "results": 5}),
    pack({"op": "results", "results": [[1, 2]]}),
    pack({"op": "results", "results": [["id", "sleeping", [0, b"", []], b""]]}),
    pack({"op": "running", "ids": "abc"}),
    pack({"op": "running", "ids": [1, 2]}),
]
MALFORMED_CLIENT: list[str | bytes] = [
    "submit",
    b"\xc1",
    pack(5),
    pack([1, 2]),
    pack({"op": None}),
    pack({"op": "dance"}),
    pack({"op": "watch", "ids": 7}),
    pack({"op": "watch", "ids": [None]}),
    pack({"op": "cancel", "ids": "x"}),
]


@pytest.fixture(scope="module")
def fuzz_endpoint(service: Service, alice: Client) -> dict[str, Any]:
    return alice.register_endpoint("fuzz")


def test_malformed_frames_get_a_close_code(
    service: Service, alice: Client, lab: EndpointProcess, fuzz_endpoint: dict[str, Any]
) -> None:
    token = fuzz_endpoint["token"]
    logged, since = _malformed_lines(service), len(_log(service))
    for frame in MALFORMED_AGENT_FIRST:
        with ws_connect(service, "/v1/ws/endpoint", token) as ws:
            ws.send(frame)
            code, reason = closed_with(ws)
            assert code in CLOSE_CODES and reason, (frame, code, reason)
    for frame in MALFORMED_AFTER_HELLO:
        with ws_connect(service, "/v1/ws/endpoint", token) as ws:
            ws.send(_hello())
            ws.send(frame)
            code, reason = closed_with(ws)
            assert code in CLOSE_CODES and reason, (frame, code, reason)
    for frame in MALFORMED_CLIENT:
        with ws_connect(service, "/v1/ws/client", alice.token) as ws:
            ws.send(frame)
            code, reason = closed_with(ws)
            assert code in CLOSE_CODES and reason, (frame, code, reason)
    frames = len(MALFORMED_AGENT_FIRST) + len(MALFORMED_AFTER_HELLO) + len(MALFORMED_CLIENT)
    deadline = time.monotonic() + 10
    while _malformed_lines(service) - logged < frames and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _malformed_lines(service) - logged == frames  # one log line each
    with ws_connect(service, "/v1/ws/endpoint", token) as ws:  # an agent that never says hello
        code, reason = closed_with(ws)
        assert code in CLOSE_CODES and "hello" in reason
    _served(alice, "lab")
    _no_tracebacks(service, since)


def _malformed_lines(service: Service) -> int:
    return service.log.read_text(errors="replace").count("malformed frame")


def _garbage(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["int", "str", "bytes", "float", "none", "bool"]
    if depth < 3:
        kinds += ["list", "map"]
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, -1, 5, 2**63, -(2**63), 2**64 - 1])
    if kind == "str":
        return rng.choice(["", "op", "hello", "results", "x" * 300, "\u00e9"])
    if kind == "bytes":
        return rng.randbytes(rng.randrange(0, 40))
    if kind == "float":
        return rng.choice([math.nan, math.inf, -0.0, 1e300])
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "list":
        return [_garbage(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    return {_key(rng): _garbage(rng, depth + 1) for _ in range(rng.randrange(0, 5))}


def _key(rng: random.Random) -> Any:
    return rng.choice(["op", "ids", "tasks", "results", "t", "workers", "window", 1, b"op"])


def _malformed_frame(rng: random.Random, ops: list[str]) -> str | bytes:
    """A frame no correct peer sends: never a well-formed message of ``ops``."""
    choice = rng.randrange(6)
    if choice == 0:
        return "".join(rng.choice("{}[]op:,\"' 0123") for _ in range(rng.randrange(1, 30)))
    if choice == 1:
        return b"\xc1" + rng.randbytes(rng.randrange(0, 50))  # 0xc1: never valid msgpack
    if choice == 2:
        value = _garbage(rng)
        return pack(value if not isinstance(value, dict) else [value])
    if choice == 3:
        return pack({"op": rng.choice([5, None, b"x", [1], "x" + rng.choice(ops)])})
    if choice == 4:  # a known op whose fields have the wrong types
        op = rng.choice(ops)
        fields = ("ids", "results", "workers", "window")
        return pack({"op": op, **{k: rng.choice([None, "abc", {"a": 1}]) for k in fields}})
    whole = pack({"op": rng.choice(ops), "ids": ["a"]})
    return whole[: rng.randrange(1, len(whole))]  # cut short


def test_websocket_frame_fuzzer(
    service: Service, alice: Client, lab: EndpointProcess, fuzz_endpoint: dict[str, Any]
) -> None:
    rng = random.Random(1313)
    frames, since = 0, len(_log(service))
    for _ in range(40):
        with ws_connect(service, "/v1/ws/client", alice.token) as ws:
            frame = _malformed_frame(rng, ["watch", "cancel"])
            ws.send(frame)
            code, reason = closed_with(ws)
            assert code in CLOSE_CODES and reason, (frame, code, reason)
            frames += 1
        with ws_connect(service, "/v1/ws/endpoint", fuzz_endpoint["token"]) as ws:
            if rng.random() < 0.5:
                ws.send(_hello())
                frame = _malformed_frame(rng, ["results", "running"])
            else:
                frame = _malformed_frame(rng, ["hello"])
            ws.send(frame)
            code, reason = closed_with(ws)
            assert code in CLOSE_CODES and reason, (frame, code, reason)
            frames += 1
    assert frames == 80
    _served(alice, "lab")
    _no_tracebacks(service, since)


# ---------------------------------------------------------------- 11: a hostile service


def test_the_agent_survives_malformed_frames_from_a_service(tmp_path: Any) -> None:
    """A fake service sends the agent garbage on each connection; it closes, reconnects,
    and then runs a real task it is sent."""
    from websockets.asyncio.server import ServerConnection, serve

    from nimbus import serialization
    from nimbus.endpoint.daemon import EndpointDaemon

    garbage: list[str | bytes] = [
        "text",
        b"\xc1garbage",
        pack(5),
        pack({"op": "tasks", "tasks": 5}),
        pack({"op": "ack", "ids": 7}),
        pack({"op": "beat", "t": "noon"}),
        b"\x80" * (RECEIVE_MAX + 1),  # over the size an agent accepts from a service
    ]
    _, fn_bytes = serialization.FunctionCache(by_value=True).get(square)
    closes: list[int] = []
    results: list[Any] = []
    done = threading.Event()

    async def handler(ws: ServerConnection) -> None:
        unpack(await ws.recv())  # hello
        n = len(closes)
        if n < len(garbage):
            await ws.send(garbage[n])
            await ws.wait_closed()
            closes.append(ws.close_code or 0)
            return
        tasks = [
            ["t-bad-row", "f"],  # a row of the wrong shape: dropped, logged
            ["t-bad-payload", "f", fn_bytes, b"\xc1", None],
            ["t-ok", "f", None, pack_payload(*_arguments(7)), None],
        ]
        await ws.send(pack({"op": "tasks", "tasks": tasks}))
        async for data in ws:
            msg = unpack(data)
            if msg.get("op") == "results":
                results.extend(msg["results"])
                if {r[0] for r in results} >= {"t-bad-payload", "t-ok"}:
                    done.set()

    agent_box: dict[str, Any] = {}

    async def main() -> None:
        async with serve(handler, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            agent = EndpointDaemon(f"http://127.0.0.1:{port}", "tok", workers=1, heartbeat=0.5)
            agent_box["agent"] = agent
            await agent.run()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    try:
        assert done.wait(60), (closes, results)
    finally:
        while "agent" not in agent_box:
            time.sleep(0.01)
        agent_box["agent"].stop()
        thread.join(30)
    assert not thread.is_alive()
    assert all(code in CLOSE_CODES for code in closes[:-1]), closes
    assert closes[-1] == 1009, closes  # message too big: closed, and it reconnected
    by_id = {r[0]: r for r in results}
    assert by_id["t-bad-payload"][1] == "failed"
    _, data, _ = by_id["t-bad-payload"][2]
    error, _ = serialization.loads(data)
    assert isinstance(error, DeserializationError)
    assert by_id["t-ok"][1] == "success"
    assert serialization.loads(by_id["t-ok"][2][1]) == 49


def _arguments(*args: Any) -> tuple[bytes, list[Any]]:
    from nimbus import serialization

    data, buffers = serialization.dumps((args, {}))
    return data, [b.raw() for b in buffers]


def test_settings_name_the_new_limits() -> None:
    settings = Settings.load({})
    assert settings.max_queued_tasks > 0 and settings.max_queued_bytes > 0
    assert settings.max_batch > 0
    with pytest.raises(ConfigError, match="NIMBUS_MAX_QUEUED_TASKS"):
        Settings.load({"NIMBUS_MAX_QUEUED_TASKS": "-3"})
