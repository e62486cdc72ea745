"""What a user's input decides the size of is bounded, and what an owner withdraws
takes effect (issue 13, the gaps left after its findings).

A real service with small limits: functions and endpoints per user, WebSocket
message size, queued tasks and bytes given back when an endpoint is deleted or
unshared, queued tasks of a deleted or unshared function never run, and a
client's ``watch`` answers the ids the service does not know. Agents here are a
test's own WebSocket speaking the agent protocol, so that what the dispatcher
sends (and does not send) is seen frame by frame. The SDK's WebSocket client is
also run against a fake service that sends it garbage.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.sync.client import ClientConnection

from nimbus import Client, Executor, serialization
from nimbus.config import Settings
from nimbus.errors import (
    ConfigError,
    PayloadTooLargeError,
    ProtocolError,
    QuotaExceeded,
    ServiceError,
    TaskLost,
)
from nimbus.protocol import (
    FUNCTION_MAX,
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
from service_support import Service, closed_with, free_port, serve, ws_connect

CLOSE_CODES = {TEXT_FRAME, NOT_MSGPACK, WRONG_SHAPE}
MAX_TASKS = 20
BIG = 60 << 10  # bytes of a "big" argument: four of them and 16 small tasks fit the quota


def square(x: int) -> int:
    return x * x


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    yield from serve(
        tmp_path_factory,
        "limits",
        NIMBUS_MAX_FUNCTIONS="5",
        NIMBUS_MAX_ENDPOINTS="3",
        NIMBUS_MAX_MESSAGE="16M",
        NIMBUS_MAX_PAYLOAD="64M",
        NIMBUS_INLINE_PAYLOAD="64K",
        NIMBUS_MAX_QUEUED_TASKS=str(MAX_TASKS),
        NIMBUS_MAX_QUEUED_BYTES="300K",
        NIMBUS_HEARTBEAT="5",  # the tests' own agents need not beat
    )


def _arguments(*args: Any) -> bytes:
    data, buffers = serialization.dumps((args, {}))
    return pack_payload(data, [b.raw() for b in buffers])


# ---------------------------------------------------------------- functions, endpoints


def test_functions_per_user_are_limited(service: Service) -> None:
    with service.client(service.token("fay")) as fay, service.client(service.token("fin")) as fin:
        ids = [fay.register_function_bytes(f"body {i}".encode(), f"f{i}") for i in range(5)]
        assert fay.register_function_bytes(b"body 0", "f0") == ids[0]  # the same: no new one
        with pytest.raises(QuotaExceeded, match="NIMBUS_MAX_FUNCTIONS") as info:
            fay.register_function_bytes(b"body 5", "f5")
        assert info.value.status == 429 and "5" in str(info.value)
        fin.register_function_bytes(b"body 5", "f5")  # per user: others unaffected
        fay.delete_function(ids[0])
        fay.register_function_bytes(b"body 5", "f5")  # room again


def test_a_function_body_over_function_max_gets_413(service: Service) -> None:
    with service.client(service.token("fred")) as fred:
        with pytest.raises(PayloadTooLargeError, match="FUNCTION_MAX"):
            fred.register_function_bytes(b"x" * (FUNCTION_MAX + 1), "huge")
        assert fred.register_function_bytes(b"x" * 1000, "small")


def test_endpoints_per_user_are_limited(service: Service) -> None:
    with service.client(service.token("eve")) as eve, service.client(service.token("eli")) as eli:
        ids = [eve.register_endpoint(f"ep{i}")["endpoint_id"] for i in range(3)]
        assert eve.register_endpoint("ep0")["endpoint_id"] == ids[0]  # configured again
        with pytest.raises(QuotaExceeded, match="NIMBUS_MAX_ENDPOINTS") as info:
            eve.register_endpoint("ep3")
        assert info.value.status == 429
        eli.register_endpoint("ep3")
        eve.delete_endpoint(ids[0])
        eve.register_endpoint("ep3")


def _frame_header_over_the_limit(service: Service, path: str, token: str, size: int) -> int:
    """Open a WebSocket by hand and send only the header of a binary frame of ``size``
    bytes: the close code the service answers with (before any of the body is sent,
    so no reset of a half-sent message can hide its close frame)."""
    import os
    import socket
    import struct
    from urllib.parse import urlsplit

    where = urlsplit(service.url)
    with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
        key = base64.b64encode(os.urandom(16)).decode()
        sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: {where.netloc}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(4096)
            assert chunk, head
            head += chunk
        assert head.startswith(b"HTTP/1.1 101"), head
        rest = head.split(b"\r\n\r\n", 1)[1]
        sock.sendall(bytes([0x82, 0x80 | 127]) + struct.pack("!Q", size) + os.urandom(4))
        while len(rest) < 4:
            chunk = sock.recv(4096)
            assert chunk, "dropped without a close frame"
            rest += chunk
        assert rest[0] == 0x88, rest  # FIN + close
        code: int = struct.unpack("!H", rest[2:4])[0]
        return code


def test_websocket_messages_over_max_message_are_closed(service: Service) -> None:
    token = service.token("max")
    over = (16 << 20) + 1  # one byte over NIMBUS_MAX_MESSAGE
    assert _frame_header_over_the_limit(service, "/v1/ws/client", token, over) == 1009
    with ws_connect(service, "/v1/ws/client", token) as ws:  # a message at the limit is read
        ws.send(b"\x80" + b"x" * ((16 << 20) - 1))
        assert closed_with(ws)[0] in (1003, 1007, 1008)  # not msgpack of the right shape
    with service.http(token) as http:
        assert http.get("/v1/whoami").status_code == 200


def test_settings_of_the_limits_are_checked() -> None:
    settings = Settings.load({})
    assert settings.max_functions == 10_000 and settings.max_endpoints == 1000
    assert settings.max_message == 32 << 20
    for name, value in (
        ("NIMBUS_MAX_FUNCTIONS", "0"),
        ("NIMBUS_MAX_ENDPOINTS", "-1"),
        ("NIMBUS_MAX_MESSAGE", "1M"),
    ):
        with pytest.raises(ConfigError, match=name):
            Settings.load({name: value})


# ---------------------------------------------------------------- quotas given back


def _fill_quota(client: Client, endpoint: str) -> list[str]:
    """MAX_TASKS tasks holding about 245 KiB of the 300 KiB quota; the next is refused."""
    ids = client.batch_run(len, [(b"b" * BIG,) for _ in range(4)], endpoint=endpoint)
    ids += client.batch_run(square, [(i,) for i in range(MAX_TASKS - 4)], endpoint=endpoint)
    with pytest.raises(QuotaExceeded, match="NIMBUS_MAX_QUEUED_TASKS"):
        client.run(square, 1, endpoint=endpoint)
    return ids


def test_deleting_an_endpoint_gives_back_the_quota_of_its_tasks(service: Service) -> None:
    with service.client(service.token("quinn")) as quinn:
        doomed = quinn.register_endpoint("doomed")["endpoint_id"]
        ids = _fill_quota(quinn, doomed)
        quinn.delete_endpoint(doomed)
        for task_id in ids[:2]:
            with pytest.raises(ServiceError, match="was deleted"):
                quinn.get_result(task_id, timeout=10)
        other = quinn.register_endpoint("other")["endpoint_id"]
        _fill_quota(quinn, other)  # tasks and bytes both given back


def test_unsharing_an_endpoint_gives_back_the_quota_of_the_failed_tasks(
    service: Service,
) -> None:
    with service.client(service.token("owen")) as owen, service.client(service.token("uli")) as uli:
        shared = owen.register_endpoint("lent")["endpoint_id"]
        shown = owen.share_endpoint(shared, ["uli"])
        assert shown["shared_with"] == ["uli"]
        ids = _fill_quota(uli, "owen/lent")
        shown = owen.share_endpoint(shared, remove=["uli"])
        assert shown["shared_with"] == []
        for task_id in ids[:2]:
            with pytest.raises(ServiceError, match="no longer shared with you"):
                uli.get_result(task_id, timeout=10)
        _fill_quota(uli, uli.register_endpoint("mine")["endpoint_id"])


# ---------------------------------------------------------------- deleted, unshared functions


class FakeAgent:
    """An agent of ``token`` that asks for one task at a time and answers when told."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        hello = {"op": "hello", "python": PYTHON, "serializer": SERIALIZER, "workers": 1}
        self.ws.send(pack({**hello, "window": 1, "held": []}))

    def next_tasks(self, timeout: float) -> list[list[Any]] | None:
        """The next ``tasks`` message's rows, None if none comes in ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = unpack(self.ws.recv(timeout=left))
            except TimeoutError:
                return None
            if msg["op"] == "tasks":
                rows: list[list[Any]] = msg["tasks"]
                return rows
        return None

    def finish(self, task_id: str, value: Any) -> None:
        result = [0, serialization.dumps(value)[0], []]
        self.ws.send(pack({"op": "results", "results": [[task_id, "success", result, None]]}))


def _submit(http: Any, endpoint_id: str, function_id: str, *args: Any) -> str:
    """Submit by function id (as any REST user may): the task id."""
    payload = base64.b64encode(_arguments(*args)).decode()
    body = {"endpoint_id": endpoint_id, "tasks": [{"function_id": function_id, "payload": payload}]}
    reply = http.post("/v1/tasks", json=body)
    assert reply.status_code == 201, reply.text
    [task_id] = reply.json()["task_ids"]
    return str(task_id)


@contextlib.contextmanager
def _one_sent_one_queued(
    service: Service, http: Any, registered: dict[str, Any], fn: str, x: int, y: int
) -> Iterator[tuple[FakeAgent, str, str, list[list[Any]]]]:
    """A fake agent of the endpoint ``registered`` with room for one task: of the tasks
    ``fn(x)`` and ``fn(y)``, the first is sent to it, the second stays queued. Yields the
    agent, the two task ids and the rows it was sent."""
    endpoint = registered["endpoint_id"]
    with ws_connect(service, "/v1/ws/endpoint", registered["token"]) as ws:
        agent = FakeAgent(ws)
        first = _submit(http, endpoint, fn, x)
        second = _submit(http, endpoint, fn, y)
        rows = agent.next_tasks(10)
        assert rows is not None and [r[0] for r in rows] == [first]
        yield agent, first, second, rows


def test_a_deleted_function_no_longer_runs_its_queued_tasks(service: Service) -> None:
    with service.client(service.token("dee")) as dee, service.http(dee.token) as http:
        registered = dee.register_endpoint("held")
        fn = dee.register_function(square)
        with _one_sent_one_queued(service, http, registered, fn, 3, 4) as sent:
            agent, first, second, rows = sent
            assert rows[0][2], "the function's body comes with its first task"
            dee.delete_function(fn)
            agent.finish(first, 9)  # room for one more: the second is not sent
            assert agent.next_tasks(1.5) is None
            assert dee.get_result(first, timeout=10) == 9
            with pytest.raises(ServiceError, match=f"function {fn} was deleted") as info:
                dee.get_result(second, timeout=10)
            assert info.value.status == 410
            assert dee.get_task(second)["state"] == "failed"


def test_an_unshared_function_no_longer_runs_the_lost_users_queued_tasks(
    service: Service,
) -> None:
    with (
        service.client(service.token("ada")) as ada,
        service.client(service.token("bob")) as bob,
        service.http(bob.token) as http,
    ):
        fn = ada.register_function(square)
        assert ada.share_function(fn, ["bob"])["shared_with"] == ["bob"]
        registered = bob.register_endpoint("bobs")
        with _one_sent_one_queued(service, http, registered, fn, 5, 6) as sent:
            agent, first, second, _ = sent
            assert ada.share_function(fn, remove=["bob"])["shared_with"] == []
            agent.finish(first, 25)
            assert agent.next_tasks(1.5) is None
            with pytest.raises(ServiceError, match="no longer shared with you") as info:
                bob.get_result(second, timeout=10)
            assert info.value.status == 410
            ada.share_function(fn, ["bob"])  # shared again: bob's tasks run again
            third = _submit(http, registered["endpoint_id"], fn, 7)
            rows = agent.next_tasks(10)
            assert rows is not None and [r[0] for r in rows] == [third]


# ---------------------------------------------------------------- watch


def test_watch_answers_the_ids_the_service_does_not_know(service: Service) -> None:
    with service.client(service.token("wu")) as wu, service.client(service.token("xi")) as xi:
        endpoint = wu.register_endpoint("w")["endpoint_id"]
        mine = wu.run(square, 2, endpoint=endpoint)  # waiting: watched, not unknown
        theirs = xi.run(square, 2, endpoint=xi.register_endpoint("x")["endpoint_id"])
        nobody = str(uuid.uuid4())
        with ws_connect(service, "/v1/ws/client", wu.token) as ws:
            ws.send(pack({"op": "watch", "ids": [mine, theirs, nobody]}))
            msg = unpack(ws.recv(timeout=10))
            assert msg == {"op": "unknown", "ids": [theirs, nobody]}
            wu.cancel(mine)
            msg = unpack(ws.recv(timeout=10))
            assert msg["op"] == "results" and msg["results"][0][0] == mine


# ---------------------------------------------------------------- the SDK against a bad service


GARBAGE: list[str | bytes] = [
    "text",
    b"\xc1garbage",
    pack(5),
    pack({"op": "dance"}),
    pack({"op": "results", "results": 5}),
    pack({"op": "results", "results": [[1, 2]]}),
    pack({"op": "accepted", "ref": "x", "ids": []}),
    pack({"op": "accepted", "ref": 0, "ids": ["a", "b", "c", "d"]}),
    pack({"op": "refused", "ref": 0}),
    pack({"op": "unknown", "ids": [1]}),
    b"\x80" * (RECEIVE_MAX + 1),  # over the size the SDK accepts from a service
]


class FakeService:
    """A service on 127.0.0.1 (uvicorn, in a thread) whose client WebSocket sends one
    frame of GARBAGE on each connection, then behaves: tasks ``0`` and ``1`` answer
    with a result of the wrong shape and 49, task ``2`` is unknown."""

    def __init__(self) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route, WebSocketRoute
        from starlette.websockets import WebSocket

        self.closes: list[int] = []
        self.port = free_port()

        async def resolve(request: Request) -> JSONResponse:
            del request
            return JSONResponse(
                {"endpoint_id": "ep", "python": PYTHON, "serializer": SERIALIZER, "online": True}
            )

        async def register(request: Request) -> JSONResponse:
            del request
            return JSONResponse({"function_id": "fn"}, 201)

        async def client(ws: WebSocket) -> None:
            await ws.accept()
            n = len(self.closes)
            if n < len(GARBAGE):
                frame = GARBAGE[n]
                await (ws.send_text(frame) if isinstance(frame, str) else ws.send_bytes(frame))
                message = await ws.receive()
                while message["type"] != "websocket.disconnect":
                    message = await ws.receive()
                self.closes.append(int(message.get("code", 0)))
                return
            answers: dict[str, Any] = {
                "t0": ["t0", "success", [5, b"", []], None],  # no such status
                "t1": ["t1", "success", [0, serialization.dumps(49)[0], []], None],
                "t2": None,  # unknown
            }
            count = 0
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                msg = unpack(message["bytes"])
                if msg["op"] != "submit":
                    continue
                ids = [f"t{count + i}" for i in range(len(msg["tasks"]))]
                count += len(ids)
                await ws.send_bytes(pack({"op": "accepted", "ref": msg["ref"], "ids": ids}))
                rows = [answers[i] for i in ids if answers.get(i)]
                if rows:
                    await ws.send_bytes(pack({"op": "results", "results": rows}))
                lost = [i for i in ids if i in answers and answers[i] is None]
                if lost:
                    await ws.send_bytes(pack({"op": "unknown", "ids": [*lost, "t-not-mine"]}))

        app = Starlette(
            routes=[
                Route("/v1/endpoints/resolve", resolve),
                Route("/v1/functions", register, methods=["POST"]),
                WebSocketRoute("/v1/ws/client", client),
            ]
        )
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", ws_max_size=1 << 20
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeService:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def test_the_sdk_survives_malformed_frames_from_a_service(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="nimbus.backends.service")
    with FakeService() as fake:
        env = {
            "NIMBUS_SERVICE_URL": fake.url,
            "NIMBUS_TOKEN": "tok",
            "NIMBUS_RUNTIME_DIR": str(tmp_path / "rt"),
        }
        with Executor(endpoint="ep", settings=Settings.load(env)) as ex:
            futures = [ex.submit(square, i) for i in range(3)]
            with pytest.raises(ProtocolError, match="wrong shape"):
                futures[0].result(60)
            assert futures[1].result(60) == 49
            with pytest.raises(TaskLost, match="--persist"):
                futures[2].result(60)
        assert fake.thread.is_alive()
        closes = list(fake.closes)
    assert len(closes) == len(GARBAGE)
    assert all(code in CLOSE_CODES for code in closes[:-1]), closes
    assert closes[-1] == 1009, closes  # too big
    malformed = [r for r in caplog.records if "malformed frame" in r.getMessage()]
    assert len(malformed) == len(GARBAGE) - 1  # one line each


def test_a_task_cancelled_by_its_endpoints_owner_fails_the_executors_future(
    service: Service,
) -> None:
    """The owner of an endpoint may cancel a task another user queued on it: that user's
    Executor future fails saying so, instead of waiting forever."""
    with service.client(service.token("oda")) as oda, service.client(service.token("uwe")) as uwe:
        endpoint = oda.register_endpoint("offline")["endpoint_id"]
        oda.share_endpoint(endpoint, ["uwe"])
        settings = service.user_settings(uwe.token)
        with Executor(endpoint="oda/offline", settings=settings) as ex:
            future = ex.submit(square, 3)
            deadline = time.monotonic() + 30
            while not (tasks := uwe.list_tasks()):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert oda.cancel(tasks[0]["task_id"])
            with pytest.raises(ServiceError, match="cancelled on the service"):
                future.result(30)
