"""Environments through the service: client -> service -> endpoint daemon -> a worker of it."""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nimbus import Client, Environment, Executor, serialization
from nimbus.environments import PLAIN
from nimbus.errors import EnvironmentBuildError, ProtocolError, VersionMismatchError
from nimbus.protocol import (
    Beat,
    SubmitRow,
    TaskRow,
    decode_message,
    pack,
    pack_payload,
    unpack,
)
from service_support import CLI, EndpointProcess, Service, postgres_cluster, service_env

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    root = tmp_path_factory.mktemp("service")
    env = service_env(root, NIMBUS_ENVIRONMENTS_DIR=str(root / "envs"))
    svc = Service(root, env).start()
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def listener() -> Iterator[int]:
    """A TCP port on the host's loopback that accepts connections."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock.getsockname()[1]
    sock.close()


PAYLOAD = pack_payload(*serialization.dumps(((2,), {})))


def connect(port: int) -> str:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            return "connected"
    except OSError as exc:
        return type(exc).__name__


def square(x: int) -> int:
    return x * x


def _record(client: Client, task_id: str) -> dict[str, Any]:
    return dict(client.get_task(task_id)["record"])


# ---------------------------------------------------------------- the rows


def test_rows_carry_an_environment_and_old_rows_still_read() -> None:
    env = Environment("geo", requirements=["six"], sandbox=True).to_dict()
    row = SubmitRow("f", b"p", None, env)
    assert SubmitRow.decode(unpack(pack(row)), "tasks[0]") == row
    assert SubmitRow.decode(["f", b"p", None], "tasks[0]") == SubmitRow("f", b"p", None, None)
    task = TaskRow("t", "f", None, b"p", 2.0, env)
    assert TaskRow.read(unpack(pack(task)), 0) == task
    assert TaskRow.read(["t", "f", None, b"p", None], 0) == TaskRow("t", "f", None, b"p", None)


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ("geo", "tasks[0].environment: expected None or an environment"),
        ({"name": "geo", "shell": "rm -rf /"}, "tasks[0].environment: expected None"),
        ({"name": ""}, "tasks[0].environment.name"),
        ({"name": "g", "requirements": "six"}, "tasks[0].environment.requirements"),
        ({"name": "g", "requirements": [1]}, "tasks[0].environment.requirements"),
        ({"name": "g", "image": 5}, "tasks[0].environment.image"),
        ({"name": "g", "sandbox": "yes"}, "tasks[0].environment.sandbox"),
    ],
)
def test_a_wrong_environment_is_refused_naming_the_field(env: object, field: str) -> None:
    with pytest.raises(ProtocolError, match=field.replace(".", r"\.").replace("[", r"\[")):
        SubmitRow.decode(["f", b"p", None, env], "tasks[0]")
    bad = TaskRow.read(["t", "f", None, b"p", None, env], 3)
    assert not isinstance(bad, TaskRow)
    assert bad.task_id == "t" and "tasks.tasks[3].environment" in str(bad.error)


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


# ---------------------------------------------------------------- end to end


def test_a_named_environment_runs_in_workers_of_its_own(
    alice: Client, lab: EndpointProcess
) -> None:
    plain = alice.batch_run(square, [(i,) for i in range(4)], endpoint="lab")
    named = alice.batch_run(
        square, [(i,) for i in range(4)], endpoint="lab", environment=Environment("named")
    )
    assert [alice.get_result(t, timeout=60) for t in plain + named] == [0, 1, 4, 9] * 2
    plain_workers = {_record(alice, t)["worker"] for t in plain}
    named_workers = {_record(alice, t)["worker"] for t in named}
    assert plain_workers and named_workers and not plain_workers & named_workers


@needs_bwrap
def test_a_sandboxed_task_through_the_service_has_no_network(
    service: Service, alice: Client, lab: EndpointProcess, listener: int
) -> None:
    settings = service.user_settings(alice.token)
    with Executor(endpoint="lab", settings=settings) as ex:
        assert ex.submit(connect, listener).result(timeout=60) == "connected"
        jailed = ex.options(environment=Environment("jail", sandbox=True))
        assert jailed.submit(connect, listener).result(timeout=120) == "ConnectionRefusedError"


def test_a_failed_build_fails_the_task_within_seconds(
    alice: Client, lab: EndpointProcess, tmp_path: Path
) -> None:
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    env = Environment("bad", requirements=["no-such-package-xyz"], wheelhouse=str(wheelhouse))
    started = time.monotonic()
    (task_id,) = alice.batch_run(square, [(3,)], endpoint="lab", environment=env)
    with pytest.raises(EnvironmentBuildError) as info:
        alice.get_result(task_id, timeout=60)
    assert time.monotonic() - started < 30
    assert "no-such-package-xyz" in str(info.value)
    assert alice.get_task(task_id)["state"] == "failed"
    assert alice.get_result(alice.run(square, 5, endpoint="lab"), timeout=30) == 25


# ---------------------------------------------------------------- per registered function


def where(x: int) -> tuple[int, str]:
    """``x`` and the environment this task ran in ("" for the workers' own Python)."""

    return x, os.environ.get("NIMBUS_WORKER_ENVIRONMENT", "")


def _ran_in(client: Client, task_ids: list[str]) -> set[str]:
    results = [client.get_result(t, timeout=60) for t in task_ids]
    assert [x for x, _ in results] == list(range(len(task_ids)))
    return {env for _, env in results}


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


@pytest.fixture(params=["sqlite", "postgresql"])
def registry_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A registry database of each kind: a SQLite file, a private PostgreSQL cluster."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'registry.db'}"
        return
    with postgres_cluster() as pg:
        yield pg.url


def test_the_registry_keeps_a_functions_environment_and_adds_the_column_to_an_old_one(
    registry_url: str,
) -> None:
    from sqlalchemy import text

    from nimbus.service.registry import Registry

    old = Registry(registry_url)  # as an older nimbus made it: no environment column
    with old.engine.begin() as db:
        db.execute(text("ALTER TABLE functions DROP COLUMN environment"))
    old.create_user_token("ada")
    ada = old.user_ids(["ada"])["ada"]
    with old.engine.begin() as db:
        db.execute(
            text(
                "INSERT INTO functions (id, owner_id, name, digest, body, python, serializer,"
                " public, created) VALUES ('f-old', :ada, 'old', :digest, :body, '3.11', 's',"
                " false, 1.0)"
            ),
            {"ada": ada, "digest": hashlib.sha256(b"old").hexdigest(), "body": b"old"},
        )
    old.close()
    registry = Registry(registry_url)  # adds the column; the old row has none
    try:
        info = registry.function("f-old")
        assert info is not None and info.environment is None
        geo = Environment("geo", requirements=["six"], sandbox=True).to_dict()
        fid = registry.add_function(ada, "f", b"body", "3.11", "s", environment=geo)
        stored = registry.function(fid)
        assert stored is not None and stored.environment == geo
        assert stored.as_dict()["environment"] == geo
        same = dict(reversed(list(geo.items())))  # the same spec, keys in another order
        assert registry.add_function(ada, "f", b"body", "3.11", "s", environment=same) == fid
        assert registry.add_function(ada, "f", b"body", "3.11", "s") == fid  # found, as is
        box = Environment("box", image="localhost/x:1").to_dict()
        other = registry.add_function(ada, "f", b"body", "3.11", "s", environment=box)
        assert other != fid and registry.function(fid).environment == geo  # type: ignore[union-attr]
        assert registry.add_function(ada, "f", b"body", "3.11", "s") == other
        # a wrapper of those bytes (an executor's scope): their latest registration's
        wrapper = registry.add_function(
            ada, "w", b"wrapper", "3.11", "s", wraps=hashlib.sha256(b"body").hexdigest()
        )
        assert registry.function(wrapper).environment == box  # type: ignore[union-attr]
        plain = registry.add_function(ada, "w", b"w2", "3.11", "s", wraps="0" * 64)
        assert registry.function(plain).environment is None  # type: ignore[union-attr]
        assert registry.add_function(ada, "f", b"old", "3.11", "s") == "f-old"
    finally:
        registry.close()


def test_services_starting_together_add_a_missing_column_once(registry_url: str) -> None:
    """Two services on one database both find the column missing: neither fails."""
    from sqlalchemy import text

    from nimbus.service.migrate import add_columns
    from nimbus.service.registry import Registry

    first, second = Registry(registry_url), Registry(registry_url)
    try:
        for _ in range(5):
            with first.engine.begin() as db:
                db.execute(text("ALTER TABLE functions DROP COLUMN environment"))
            barrier = threading.Barrier(2)
            failed: list[BaseException] = []

            def start(
                registry: Registry, barrier: threading.Barrier, failed: list[BaseException]
            ) -> None:
                barrier.wait()
                try:
                    add_columns(registry.engine)
                except BaseException as exc:
                    failed.append(exc)

            threads = [
                threading.Thread(target=start, args=(r, barrier, failed)) for r in (first, second)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert failed == []
            first.create_user_token("ada")  # the table works with its column
            ada = first.user_ids(["ada"])["ada"]
            geo = Environment("geo").to_dict()
            fid = second.add_function(ada, "f", b"body", "3.11", "s", environment=geo)
            assert first.function(fid).environment == geo  # type: ignore[union-attr]
            with first.engine.begin() as db:
                db.execute(text("DELETE FROM functions"))
    finally:
        first.close()
        second.close()


# ---------------------------------------------------------------- versions, at submit

OLD_PICKLE = Environment("old", requirements=["cloudpickle==2.2.1"])


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


# ---------------------------------------------------------------- nimbus environments list


def _cli(service: Service, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = service.env | {"NIMBUS_SERVICE_URL": service.url, "NIMBUS_TOKEN": token}
    return subprocess.run(
        [sys.executable, "-c", CLI, "environments", "list", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_environments_list_endpoint_shows_what_its_nodes_hold(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    named = Environment("shown")
    ids = alice.batch_run(square, [(i,) for i in range(2)], endpoint="lab", environment=named)
    assert [alice.get_result(t, timeout=60) for t in ids] == [0, 1]
    deadline = time.monotonic() + 20  # reported every 5 beats (0.3 s each here)
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        rows = alice.get_endpoint("lab")["environments"]
        if any(r["name"] == "shown" and r["state"] == "warm" for r in rows):
            break
        time.sleep(0.3)
    warm = [r for r in rows if r["name"] == "shown" and r["state"] == "warm"]
    assert warm and warm[0]["workers"] >= 1 and warm[0]["key"] == named.key, rows
    out = _cli(service, alice.token, "--endpoint", "lab", "--json")
    assert out.returncode == 0, out.stderr
    assert any(r["name"] == "shown" for r in json.loads(out.stdout))
    table = _cli(service, alice.token, "--endpoint", "lab")
    assert table.returncode == 0 and "shown" in table.stdout and "warm" in table.stdout
    unknown = _cli(service, alice.token, "--endpoint", "no-such-endpoint")
    assert unknown.returncode == 1  # not found, as for every command
    assert "no endpoint 'no-such-endpoint'" in unknown.stderr, unknown.stderr
    assert "`nimbus endpoints list`" in unknown.stderr and unknown.stderr.count("(") == 1


def _rows_until(client: Client, endpoint: str, ok: Any, timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        rows = client.get_endpoint(endpoint)["environments"]
        if ok(rows):
            return rows
        time.sleep(0.3)
    raise AssertionError(f"after {timeout} s the endpoint reports {rows}")


def on_node(x: int) -> tuple[int, str]:

    return x, os.environ.get("SLURMD_NODENAME", "?")


@needs_bwrap
def test_environments_list_endpoint_shows_what_remote_managers_hold(
    service: Service, alice: Client, slurm: Any
) -> None:
    from service_support import slurm_endpoint

    endpoint = slurm_endpoint(
        service,
        alice,
        "hpc",
        slurm,
        workers_per_node=2,
        min_blocks=1,
        init_blocks=1,
        max_blocks=1,
        max_idle=60.0,
    )
    jail = Environment("remote-jail", sandbox=True)
    try:
        endpoint.start(alice)
        ids = alice.batch_run(on_node, [(i,) for i in range(4)], endpoint="hpc", environment=jail)
        nodes = {node for _, node in (alice.get_result(t, timeout=120) for t in ids)}
        assert len(nodes) == 1 and next(iter(nodes)).startswith("n"), nodes
        node = nodes.pop()

        def shown(rows: list[dict[str, Any]]) -> bool:
            return any(
                r["node"] == node
                and r["name"] == jail.name
                and r["state"] == "warm"
                and "last_use" in r  # its node's cache said it is built: every 5th beat
                for r in rows
            )

        rows = _rows_until(alice, "hpc", shown, 30)
        mine = [r for r in rows if r["node"] == node and r["key"] == jail.key]
        assert len(mine) == 1, rows  # one row per node and environment
        row = mine[0]
        assert row["workers"] >= 1 and 0 <= row["free"] <= row["workers"], row
        # from its node's cache: built there (a sandbox has no files of its own: size 0)
        assert row["size"] == 0 and row["build_seconds"] >= 0, row
        assert time.time() - 600 < row["last_use"] <= time.time(), row
        assert all(r["message"] for r in rows if r["state"] == "failed")  # the builder's words
        out = _cli(service, alice.token, "--endpoint", "hpc")
        assert out.returncode == 0, out.stderr
        line = next(x for x in out.stdout.splitlines() if x.startswith(node) and "remote-" in x)
        assert "warm" in line and "free" in line, out.stdout
    finally:
        endpoint.stop()
        del service.env["SLURM_CONF"]


def test_a_beat_carries_environments_and_refuses_wrong_ones() -> None:
    rows = [{"node": "n1", "name": "geo", "key": "k", "state": "warm", "workers": 2, "free": 1}]
    beat = Beat(1.5, rows)
    assert decode_message(unpack(beat.encode()), {"beat": Beat}) == beat
    assert Beat(1.5).encode() == pack({"op": "beat", "t": 1.5})  # none: as before
    for wrong in ("warm", [["geo"]], [{"name": ["geo"]}]):
        with pytest.raises(ProtocolError, match=r"beat\.environments"):
            Beat.decode({"op": "beat", "t": 1.5, "environments": wrong})


# ---------------------------------------------------------------- build|remove --endpoint


def _wheel(where: Path, name: str = "orderpkg", version: str = "1.0") -> str:
    """A pure-Python wheel made here (no package index): ``import orderpkg`` says its version."""
    import zipfile

    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n",
        f"{name}-{version}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        ),
        f"{name}-{version}.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{name}-{version}.dist-info/RECORD,,")
    files[f"{name}-{version}.dist-info/RECORD"] = "\n".join(record) + "\n"
    where.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(where / f"{name}-{version}-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)
    return str(where)


def _env_cli(
    service: Service, token: str, *args: str, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    env = service.env | {"NIMBUS_SERVICE_URL": service.url, "NIMBUS_TOKEN": token}
    return subprocess.run(
        [sys.executable, "-c", CLI, "environments", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def orderpkg_version(x: int) -> tuple[int, str, str]:

    import orderpkg  # type: ignore[import-not-found]

    return x, orderpkg.VERSION, os.environ.get("NIMBUS_WORKER_ENVIRONMENT", "")


def slow_in_env(seconds: float) -> str:
    import time

    time.sleep(seconds)
    return os.environ.get("NIMBUS_WORKER_ENVIRONMENT", "")


@pytest.fixture(scope="module")
def shop(service: Service, alice: Client) -> Iterator[EndpointProcess]:
    endpoint = EndpointProcess(service, alice, "shop").start(alice)
    yield endpoint
    endpoint.stop()


def test_build_endpoint_builds_on_its_node_before_any_task_and_remove_removes_it(
    service: Service, alice: Client, shop: EndpointProcess, tmp_path: Path
) -> None:
    wheels = _wheel(tmp_path / "wheels")
    spec = ["-r", "orderpkg==1.0", "--wheelhouse", wheels]
    out = _env_cli(service, alice.token, "build", "ordered", *spec, "--endpoint", "shop")
    assert out.returncode == 0, out.stdout + out.stderr
    node = socket.gethostname()
    env = Environment("ordered", requirements=["orderpkg==1.0"], wheelhouse=wheels)
    lines = out.stdout.splitlines()
    assert lines[0] == f"building ordered (key {env.key}) on 1 node of endpoint shop: {node}"
    assert lines[1].startswith(f"{node}: built in "), out.stdout
    # built there, as the endpoint reports it, before any task
    rows = _rows_until(
        alice, "shop", lambda rs: any(r["key"] == env.key and r["state"] == "built" for r in rs), 20
    )
    assert [r["node"] for r in rows if r["key"] == env.key] == [node]
    # the first task starts in it with no build in its path
    (task_id,) = alice.batch_run(orderpkg_version, [(1,)], endpoint="shop", environment=env)
    assert alice.get_result(task_id, timeout=60) == (1, "1.0", "ordered")
    assert _record(alice, task_id)["build_seconds"] == 0.0
    # again: nothing to build
    again = _env_cli(service, alice.token, "build", "ordered", *spec, "--endpoint", "shop")
    assert again.returncode == 0 and f"{node}: built (already)" in again.stdout, again.stdout
    # a short --timeout: a node that has not answered is not said to be "still building"
    quick = _env_cli(
        service, alice.token, "build", "ordered", *spec, "--endpoint", "shop", "--timeout", "0.01"
    )
    said = quick.stdout.splitlines()[1]
    assert said in (f"{node}: built (already)", f"{node}: no answer yet after 0.01 s: "
                    "`nimbus environments list --endpoint shop` shows when it ends"), quick.stdout  # fmt: skip
    # busy: a task of it runs, so nothing is removed
    (slow,) = alice.batch_run(slow_in_env, [(4.0,)], endpoint="shop", environment=env)
    deadline = time.monotonic() + 30
    while alice.get_task(slow)["state"] != "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    busy = _env_cli(service, alice.token, "remove", "ordered", "--endpoint", "shop")
    assert busy.returncode == 2, busy.stdout + busy.stderr
    assert "is busy on endpoint 'shop'" in busy.stderr and "nothing was removed" in busy.stderr
    assert alice.get_result(slow, timeout=60) == "ordered"
    # idle now: removed from its node, and its workers with it
    gone = _env_cli(service, alice.token, "remove", "ordered", "--endpoint", "shop")
    assert gone.returncode == 0, gone.stdout + gone.stderr
    assert gone.stdout.splitlines()[1] == f"{node}: removed", gone.stdout
    _rows_until(alice, "shop", lambda rs: all(r["key"] != env.key for r in rs), 20)
    assert not (Path(service.env["NIMBUS_ENVIRONMENTS_DIR"]) / env.key).exists()
    # a task of it afterwards builds it again, as at any first use
    (task_id,) = alice.batch_run(orderpkg_version, [(2,)], endpoint="shop", environment=env)
    assert alice.get_result(task_id, timeout=60) == (2, "1.0", "ordered")
    assert _record(alice, task_id)["build_seconds"] > 0


def test_build_endpoint_with_a_failing_spec_prints_the_cause_per_node(
    service: Service, alice: Client, shop: EndpointProcess, tmp_path: Path
) -> None:
    wheels = _wheel(tmp_path / "wheels")
    args = ["build", "broken", "-r", "no-such-package-xyz", "--wheelhouse", wheels]
    out = _env_cli(service, alice.token, *args, "--endpoint", "shop")
    assert out.returncode == 1, out.stdout + out.stderr
    line = out.stdout.splitlines()[1]
    assert line.startswith(f"{socket.gethostname()}: failed: environment 'broken'"), out.stdout
    assert "no-such-package-xyz" in line
    # --no-wait returns once the nodes are asked; --timeout says who did not say in time
    quick = _env_cli(service, alice.token, *args, "--endpoint", "shop", "--no-wait")
    assert quick.returncode == 0 and "not waiting" in quick.stdout, quick.stdout
    late = _env_cli(service, alice.token, *args, "--endpoint", "shop", "--timeout", "0.01")
    assert late.returncode == 1, late.stdout + late.stderr
    assert f"{socket.gethostname()}: no answer yet after 0.01 s" in late.stdout, late.stdout
    assert "`nimbus environments list --endpoint shop`" in late.stdout


def test_build_and_remove_endpoint_refuse_wrong_input_doing_nothing(
    service: Service, alice: Client, shop: EndpointProcess
) -> None:
    def refused(*args: str, token: str = alice.token) -> str:
        out = _env_cli(service, token, *args)
        assert out.returncode == 2, out.stdout + out.stderr
        assert out.stdout == "" and len(out.stderr.strip().splitlines()) == 1, out.stderr
        return out.stderr

    sandbox = ("build", "jailed", "--sandbox", "--endpoint")
    said = refused(*sandbox, "no-such-endpoint")
    assert "no endpoint named 'no-such-endpoint'" in said and "`nimbus endpoints list`" in said
    alice.register_endpoint("sleepy")  # registered, never started
    said = refused(*sandbox, "sleepy")
    assert "endpoint 'sleepy' is offline" in said and "nimbus endpoint start sleepy" in said
    said = refused("build", "never-built-here", "--endpoint", "shop")
    assert "'never-built-here' is not built on this machine" in said and "-r REQUIREMENT" in said
    said = refused("remove", "never-built-anywhere", "--endpoint", "shop")
    assert "no environment named 'never-built-anywhere' on the nodes of endpoint 'shop'" in said
    bob = service.token("bob")  # shop is alice's, not shared with bob
    said = refused(*sandbox, "shop", token=bob)
    assert "no endpoint named 'shop' is visible to you" in said
    said = refused(*sandbox, shop.endpoint_id, token=bob)
    assert f"endpoint {shop.endpoint_id} not found" in said
    assert all(r["name"] != "jailed" for r in alice.get_endpoint("shop")["environments"])


@contextlib.contextmanager
def _bare_agent(
    service: Service, client: Client, name: str, *, orders: bool = True
) -> Iterator[tuple[str, list[str]]]:
    """A bare agent for ``client``'s new endpoint ``name``, on ``service``'s WebSocket: it
    beats and, with ``orders``, answers every order as built on node n1 (never saying
    a node is done); without, it says nothing of orders, as an older agent. Yields,
    once the endpoint is online, its id and the ops the service sent it."""
    from nimbus.protocol import ORDERS, WS_AGENT, Hello, Order, Ordered
    from service_support import ws_connect

    registered = client.register_endpoint(name)
    heard: list[str] = []
    with ws_connect(service, WS_AGENT, registered["token"]) as ws:
        ws.send(Hello("3.11", "x", 1, 1024, [], (ORDERS,) if orders else ()).encode())
        stop = threading.Event()

        def agent() -> None:
            while not stop.is_set():
                ws.send(Beat(time.monotonic()).encode())
                with contextlib.suppress(TimeoutError):
                    msg = unpack(ws.recv(timeout=0.1))
                    heard.append(msg["op"])
                    if orders and msg["op"] == "order":
                        ws.send(Ordered(Order.decode(msg).ref, 0, "", ["n1"]).encode())

        answering = threading.Thread(target=agent, daemon=True)
        answering.start()
        try:
            deadline = time.monotonic() + 10
            while not client.get_endpoint(name)["online"]:
                assert time.monotonic() < deadline, f"endpoint {name} not online"
                time.sleep(0.05)
            yield registered["endpoint_id"], heard
        finally:
            stop.set()
            answering.join(timeout=5)


def test_an_older_agent_is_not_sent_an_order(service: Service, alice: Client) -> None:
    with _bare_agent(service, alice, "elder", orders=False) as (_, heard):
        args = ("build", "jailed", "--sandbox", "--endpoint", "elder")
        out = _env_cli(service, alice.token, *args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "endpoint 'elder' runs an older nimbus" in out.stderr, out.stderr
    assert "nimbus endpoint start elder" in out.stderr
    assert "beat" in heard and "order" not in heard  # sent nothing it would not understand


def env_node(x: int) -> tuple[int, str, str]:

    import orderpkg  # type: ignore[import-not-found]

    return x, orderpkg.VERSION, os.environ.get("SLURMD_NODENAME", "?")


def test_build_and_remove_endpoint_reach_a_slurm_blocks_manager(
    service: Service, alice: Client, slurm: Any, tmp_path: Path
) -> None:
    from service_support import slurm_endpoint

    endpoint = slurm_endpoint(
        service, alice, "hpc-orders", slurm,
        workers_per_node=2, min_blocks=1, init_blocks=1, max_blocks=1, max_idle=60.0,
    )  # fmt: skip
    wheels = _wheel(tmp_path / "wheels", version="2.0")
    env = Environment("blocked", requirements=["orderpkg==2.0"], wheelhouse=wheels)
    spec = ["-r", "orderpkg==2.0", "--wheelhouse", wheels, "--endpoint", "hpc-orders"]
    try:
        endpoint.start(alice)
        deadline = time.monotonic() + 90
        while True:  # until the block's manager has joined the agent
            out = _env_cli(service, alice.token, "build", "blocked", *spec)
            if "has no nodes now" not in out.stderr or time.monotonic() > deadline:
                break
            assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
            time.sleep(1)
        assert out.returncode == 0, out.stdout + out.stderr
        head, line = out.stdout.splitlines()[:2]
        node = head.rpartition(": ")[2]
        assert node.startswith("n") and "on 1 node of endpoint hpc-orders" in head, out.stdout
        assert line.startswith(f"{node}: built in "), out.stdout
        rows = _rows_until(
            alice,
            "hpc-orders",
            lambda rs: any(r["node"] == node and r["key"] == env.key for r in rs),
            30,
        )
        mine = [r["state"] for r in rows if r["key"] == env.key and r["node"] == node]
        assert mine == ["built"], rows  # (the agent's machine shares this test's cache)
        ids = alice.batch_run(env_node, [(1,)], endpoint="hpc-orders", environment=env)
        assert alice.get_result(ids[0], timeout=120) == (1, "2.0", node)
        assert _record(alice, ids[0])["build_seconds"] == 0.0  # built before: no build
        gone = _env_cli(service, alice.token, "remove", "blocked", "--endpoint", "hpc-orders")
        assert gone.returncode == 0 and f"{node}: removed" in gone.stdout, gone.stdout + gone.stderr
    finally:
        endpoint.stop()
        del service.env["SLURM_CONF"]


def test_ordered_builds_wait_their_turn_and_a_removal_during_a_build_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manager runs at most BUILDS_AT_ONCE ordered builds (the others wait, saying so);
    a build's outcome is applied by the manager's loop, and a removal ordered while it
    runs wins: the build is not registered when it ends."""
    from nimbus.runtime._orders import BUILDS_AT_ONCE, DONE
    from nimbus.runtime.manager import Manager
    from nimbus.runtime.task import environment_tag

    monkeypatch.setenv("NIMBUS_ENVIRONMENTS_DIR", str(tmp_path / "envs"))
    wheels = tmp_path / "wheels"
    envs = []
    for i in range(BUILDS_AT_ONCE + 1):
        _wheel(wheels, version=f"1.{i}")
        envs.append(
            Environment(f"turn{i}", requirements=[f"orderpkg==1.{i}"], wheelhouse=str(wheels))
        )
    manager = Manager(1, on_results=lambda tasks: None, name="m1")
    manager.start()
    try:
        for i, env in enumerate(envs):
            manager.order(f"b{i}", "build", env.name, env)
        last = f"b{BUILDS_AT_ONCE}"
        deadline = time.monotonic() + 10
        while "waiting its turn" not in manager.orders[last]["message"]:
            assert time.monotonic() < deadline, manager.orders
            time.sleep(0.01)
        assert manager.orders["b0"] == {"state": "building", "message": "", "seconds": 0.0}
        manager.order("r0", "remove", "turn0")  # while it builds
        deadline = time.monotonic() + 180
        while any(said["state"] not in DONE for said in list(manager.orders.values())):
            assert time.monotonic() < deadline, manager.orders
            time.sleep(0.05)
        said = manager.orders
        assert said["b0"]["state"] == "failed", said
        assert "was removed on m1 while it was being built" in said["b0"]["message"]
        assert said["r0"]["state"] == "removed", said
        assert all(said[f"b{i}"]["state"] == "built" for i in range(1, len(envs))), said
        gone = environment_tag(envs[0])
        assert gone not in manager.layout.envs and gone not in manager._builds.prepared
        assert all(environment_tag(env) in manager._builds.prepared for env in envs[1:])
    finally:
        manager.shutdown(kill=True)


def test_only_the_owner_removes_and_a_user_has_a_few_orders_in_flight(
    service: Service, alice: Client
) -> None:
    """On a public endpoint another user may order builds, at most USER_ORDERS not done
    at a time (429 naming the limit), and no removal (403 naming the owner)."""
    import httpx

    from nimbus.service.orders import USER_ORDERS

    carol = service.token("carol")
    spec = Environment("jailed", sandbox=True).to_dict()
    with _bare_agent(service, alice, "depot") as (depot, _):
        headers = {"Authorization": f"Bearer {alice.token}"}
        with httpx.Client(base_url=service.url, headers=headers, timeout=30) as http:
            http.post(f"/v1/endpoints/{depot}/share", json={"public": True}).raise_for_status()
            url = f"/v1/endpoints/{depot}/environments"
            theirs = {"Authorization": f"Bearer {carol}"}
            removal = {"action": "remove", "name": "jailed"}
            said = http.post(url, json=removal, headers=theirs)
            assert said.status_code == 403, said.text
            assert "belongs to alice: only they may remove" in said.json()["detail"]
            build = {"action": "build", "name": "jailed", "environment": spec}
            for _ in range(USER_ORDERS):
                placed = http.post(url, json=build, headers=theirs)
                assert placed.status_code == 202, placed.text
            said = http.post(url, json=build, headers=theirs)
            assert said.status_code == 429, said.text
            assert f"at most {USER_ORDERS} at a time" in said.json()["detail"]
            assert http.post(url, json=build).status_code == 202  # alice's own count
            assert http.post(url, json=removal).status_code == 202  # the owner's


def test_an_order_to_another_service_process_says_where_the_agent_is(tmp_path: Path) -> None:
    """Two service processes: an order asked of the one the endpoint's agent is not
    connected to says so and what to do (not "offline"); the other one takes it."""
    import httpx

    from service_support import two_services

    with (
        two_services(tmp_path) as (first, second, _),
        first.client(first.token("alice")) as alice,
        _bare_agent(first, alice, "twin") as (twin, _),
    ):
        spec = Environment("jailed", sandbox=True).to_dict()
        body = {"action": "build", "name": "jailed", "environment": spec}
        url = f"/v1/endpoints/{twin}/environments"
        headers = {"Authorization": f"Bearer {alice.token}"}
        said = httpx.post(second.url + url, json=body, headers=headers, timeout=30)
        assert said.status_code == 409, said.text
        detail = said.json()["detail"]
        assert "is online, but its agent is connected to another process" in detail
        assert "ask again" in detail and "offline" not in detail
        placed = httpx.post(first.url + url, json=body, headers=headers, timeout=30)
        assert placed.status_code == 202, placed.text
        order_id = placed.json()["order_id"]
        got = httpx.get(f"{second.url}{url}/{order_id}", headers=headers, timeout=30)
        assert got.status_code == 404
        assert "the service process the endpoint's agent" in got.json()["detail"]
