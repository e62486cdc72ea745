"""``nimbus.service.tasks``: a task's environment at the service. Wrong ones are refused
naming the field, another cloudpickle naming both versions, and a function's
registered environment is given to its tasks (the client and executor never look it up)."""

from __future__ import annotations

import base64
import contextlib
import functools
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from environment_support import environments_service
from nimbus import Client, Environment, Executor, serialization
from nimbus.environments import PLAIN
from nimbus.errors import VersionMismatchError
from nimbus.protocol import SubmitRow, pack, pack_payload
from service_support import EndpointProcess, Service


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The module's service: its endpoints build environments in a directory of its own."""
    yield from environments_service(tmp_path_factory)


def square(x: int) -> int:
    return x * x


PAYLOAD = pack_payload(*serialization.dumps(((2,), {})))


OLD_PICKLE = Environment("old", requirements=["cloudpickle==2.2.1"])


def where(x: int) -> tuple[int, str]:
    """``x`` and the environment this task ran in ("" for the workers' own Python)."""

    return x, os.environ.get("NIMBUS_WORKER_ENVIRONMENT", "")


def _ran_in(client: Client, task_ids: list[str]) -> set[str]:
    results = [client.get_result(t, timeout=60) for t in task_ids]
    assert [x for x, _ in results] == list(range(len(task_ids)))
    return {env for _, env in results}


def test_the_service_refuses_a_wrong_environment(service: Service) -> None:
    token = service.token("carol")
    with service.client(token) as carol, service.http(token) as http:
        endpoint = carol.register_endpoint("refuses")["endpoint_id"]
        function_id = carol.register_function(square)
        task = {"function_id": function_id, "payload": "", "environment": {"name": 7}}
        response = http.post("/v1/tasks", json={"endpoint_id": endpoint, "tasks": [task]})
        assert response.status_code == 422 and "environment.name" in response.text
        row = ["f" * 8, b"", None, {"name": "g", "sandbox": "yes"}]
        body = pack({"endpoint_id": endpoint, "tasks": [row]})
        response = http.post(
            "/v1/tasks/batch", content=body, headers={"Content-Type": "application/msgpack"}
        )
        assert response.status_code == 422 and "tasks[0].environment.sandbox" in response.text


def test_a_function_registered_with_an_environment_runs_in_it_unless_a_call_says_otherwise(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    registered = Environment("registered")
    function_id = alice.register_function(where, environment=registered)
    assert alice.get_function(function_id)["environment"] == registered.to_dict()
    assert alice.register_function(where, environment=registered) == function_id
    # the client's later submits of the function: its registered environment
    assert _ran_in(alice, alice.batch_run(where, [(0,), (1,)], endpoint="lab")) == {"registered"}
    # by function id alone, as anyone it is shared with would submit: the registry has it
    with service.http(alice.token) as http:
        payloads = [pack_payload(*serialization.dumps(((i,), {}))) for i in range(2)]
        tasks = [
            {"function_id": function_id, "payload": base64.b64encode(p).decode()} for p in payloads
        ]
        response = http.post("/v1/tasks", json={"endpoint_id": lab.endpoint_id, "tasks": tasks})
        assert response.status_code == 201, response.text
        assert _ran_in(alice, response.json()["task_ids"]) == {"registered"}
    # an executor registering on first use finds that registration; a call's own wins
    with Executor(endpoint="lab", settings=service.user_settings(alice.token)) as ex:
        assert ex.submit(where, 0).result(timeout=60) == (0, "registered")
        other = ex.options(environment=Environment("other"))
        assert other.submit(where, 1).result(timeout=60) == (1, "other")
        plain = ex.options(environment=PLAIN)
        assert plain.submit(where, 2).result(timeout=60) == (2, "")
    assert _ran_in(
        alice, alice.batch_run(where, [(0,)], endpoint="lab", environment=Environment("call"))
    ) == {"call"}
    # another environment is another function id; the first keeps its own
    again = alice.register_function(where, environment=Environment("again"))
    assert again != function_id
    assert alice.get_function(function_id)["environment"] == registered.to_dict()
    assert _ran_in(alice, alice.batch_run(where, [(0,)], endpoint="lab")) == {"again"}


class CountingProxy:
    """A TCP proxy on 127.0.0.1 in front of the service that counts the HTTP request
    lines its clients send (``counts[b"GET /v1/functions"]``): what the service is asked."""

    LINES = (b"GET /v1/functions", b"POST /v1/functions", b"GET /v1/endpoints")

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").rstrip("/").split(":")
        self.upstream = (host, int(port))
        self.counts = dict.fromkeys(self.LINES, 0)
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self._server.accept()
            except OSError:  # closed
                return
            far = socket.create_connection(self.upstream)
            with self._lock:
                self._sockets += [near, far]
            threading.Thread(target=self._pump, args=(near, far, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(far, near, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        tail = b""
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
                if count:  # a request line may straddle two chunks: keep the end of the last
                    seen = tail + chunk
                    with self._lock:
                        for line in self.LINES:
                            self.counts[line] += seen.count(line) - tail.count(line)
                    tail = seen[-(max(map(len, self.LINES)) - 1) :]
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._server.close()
        with self._lock:
            for sock in self._sockets:
                sock.close()


def test_submits_of_new_partials_ask_the_service_nothing_but_their_tasks(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    """The service gives a function's registered environment to its tasks (submit_tasks):
    an executor does not look it up, so a new ``partial`` per call costs no GET."""
    proxy = CountingProxy(service.url)
    try:
        settings = service.user_settings(alice.token, NIMBUS_SERVICE_URL=proxy.url)
        with Executor(endpoint="lab", settings=settings) as ex:
            futures = [ex.submit(functools.partial(where, i)) for i in range(50)]
            assert [f.result(timeout=120) for f in futures] == [(i, "") for i in range(50)]
    finally:
        proxy.close()
    assert proxy.counts[b"GET /v1/endpoints"] >= 1  # the proxy saw the executor's requests
    assert proxy.counts[b"POST /v1/functions"] == 50  # one registration per new pickle
    assert proxy.counts[b"GET /v1/functions"] == 0


def test_registering_with_a_wrong_environment_is_refused(service: Service, alice: Client) -> None:
    with pytest.raises(VersionMismatchError, match=r"cloudpickle 2\.2\.1"):
        alice.register_function(where, environment=OLD_PICKLE)
    body = {
        "function": base64.b64encode(b"x").decode(),
        "python": "3.11",
        "serializer": "s",
        "environment": {"name": "g", "sandbox": "yes"},
    }
    with service.http(alice.token) as http:
        response = http.post("/v1/functions", json=body)
    assert response.status_code == 422 and "environment.sandbox" in response.text


def test_another_cloudpickle_is_refused_at_submit_naming_both(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    import cloudpickle

    ours = f"cloudpickle {cloudpickle.__version__}"
    started = time.monotonic()
    with Executor(endpoint="lab", settings=service.user_settings(alice.token)) as ex:
        future = ex.options(environment=OLD_PICKLE).submit(square, 2)
        with pytest.raises(VersionMismatchError) as info:
            future.result(timeout=30)
        assert ex.submit(square, 3).result(timeout=30) == 9  # the others still run
    assert time.monotonic() - started < 10  # refused, not built
    assert "cloudpickle 2.2.1" in str(info.value) and ours in str(info.value)
    with pytest.raises(VersionMismatchError, match=r"cloudpickle 2\.2\.1"):
        alice.batch_run(square, [(1,)], endpoint="lab", environment=OLD_PICKLE)


def test_the_service_refuses_another_cloudpickle_naming_both(service: Service) -> None:
    token = service.token("dave")
    with service.client(token) as dave, service.http(token) as http:
        endpoint = dave.register_endpoint("pins")["endpoint_id"]
        function_id = dave.register_function(square)
        row = SubmitRow(function_id, PAYLOAD, None, OLD_PICKLE.to_dict())
        body = pack({"endpoint_id": endpoint, "tasks": [row]})
        response = http.post(
            "/v1/tasks/batch", content=body, headers={"Content-Type": "application/msgpack"}
        )
        assert response.status_code == 409, response.text
        detail = response.json()["detail"]
        assert "version mismatch" in detail and "cloudpickle==2.2.1" in detail
        assert "serializer pickle5+cloudpickle3" in detail and "tasks[0].environment" in detail
