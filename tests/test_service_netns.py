"""Service, two endpoints and a client in separate network namespaces (root only).

::

    ns svc 10.231.N.1 --+
    ns ep1 10.231.N.2 --+-- bridge (root ns 10.231.N.254, the test's own view)
    ns ep2 10.231.N.3 --+
    ns cli 10.231.N.4 --+

The client submits to both endpoints; the test cuts ep1's link (its veth goes
down: no FIN, no RST, packets vanish) and heals it. Every task ends with
exactly one result, its first run's, and ran in its endpoint's namespace. Skipped
only where namespaces cannot be made (not root, no ``ip``); as root, a namespace
that cannot be made fails the test with what ``ip`` said.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nimbus import Client
from nimbus.data import default_root
from nimbus.data._serve import server_address
from service_support import (
    CLI,
    EndpointProcess,
    Service,
    assert_first_results,
    service_env,
    stop,
)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Net:
    def __init__(self) -> None:
        self.n = 100 + os.getpid() % 150
        self.tag = f"nbx{os.getpid() % 100000}"
        self.bridge = f"{self.tag}br"
        self.spaces: list[str] = []
        self.links: list[str] = []

    def addr(self, host: int) -> str:
        return f"10.231.{self.n}.{host}"

    def setup(self, names: list[str]) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self.links.append(self.bridge)
        _ip("addr", "add", f"{self.addr(254)}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(names, start=1):
            ns, outer, inner = f"{self.tag}-{name}", f"{self.tag}{name}o", f"{self.tag}{name}i"
            _ip("netns", "add", ns)
            self.spaces.append(ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self.links.append(outer)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def ns(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def cut(self, name: str, up: bool) -> None:
        _ip("link", "set", f"{self.tag}{name}o", "up" if up else "down")

    def teardown(self) -> None:
        for link in reversed(self.links):
            subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)
        for ns in self.spaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


@pytest.fixture
def net() -> Iterator[Net]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (the other tests use loopback)")
    net = Net()
    try:
        net.setup(["svc", "ep1", "ep2", "cli"])
    except subprocess.CalledProcessError as exc:
        net.teardown()
        pytest.fail(
            f"as root, creating network namespaces failed: {' '.join(exc.cmd)}: "
            f"{exc.stderr.decode().strip()}"
        )
    yield net
    net.teardown()


class NsService(Service):
    def __init__(self, root: Path, env: dict[str, str], net: Net) -> None:
        super().__init__(root, env, port=8420)
        self.net = net

    def command(self) -> list[str]:
        cmd = ["ip", "netns", "exec", self.net.ns("svc"), sys.executable, "-c", CLI]
        return [*cmd, "service", "start", "--host", self.net.addr(1), "--port", "8420"]


class NsEndpoint(EndpointProcess):
    def __init__(self, service: Service, client: Client, name: str, ns: str) -> None:
        super().__init__(service, client, name)
        self.ns = ns

    def command(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *super().command()]


CLIENT = textwrap.dedent(
    """
    import json, os, sys, time, uuid
    from nimbus import Executor

    def tagged(runs, i):
        # a token of this run's own: task, pid, the network namespace it ran in, uuid
        token = f"{i}:{os.getpid()}:{os.stat('/proc/self/ns/net').st_ino}:{uuid.uuid4().hex}"
        with open(runs, "a") as out:
            out.write(f"start {token}\\n")
        time.sleep(0.2)
        with open(runs, "a") as out:
            out.write(f"end {token}\\n")
        return token

    n, out, runs = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    with Executor(endpoint="ep1") as one, Executor(endpoint="ep2") as two:
        futures = [(one if i % 2 else two).submit(tagged, runs, i) for i in range(n)]
        print("submitted", flush=True)
        results = [f.result(120) for f in futures]
        ids = [f.record.task_id for f in futures]
    with open(out, "w") as fh:
        json.dump({"results": results, "ids": ids}, fh)
    """
)


def _net_inode(ns: str) -> int:
    """The inode of network namespace ``ns`` (what /proc/self/ns/net is inside it)."""
    return os.stat(f"/run/netns/{ns}").st_ino


def test_namespaces_cut_and_heal_an_endpoint_link(net: Net, tmp_path: Path) -> None:
    env = service_env(tmp_path)
    service = NsService(tmp_path, env, net).start()
    endpoints: list[NsEndpoint] = []
    client_proc = None
    try:
        token = service.token("netuser")
        with service.client(token) as admin:
            for name in ("ep1", "ep2"):
                endpoint = NsEndpoint(service, admin, name, net.ns(name))
                endpoints.append(endpoint.start(admin))
            script = tmp_path / "client.py"
            script.write_text(CLIENT)
            out, runs = tmp_path / "out.json", tmp_path / "runs.txt"
            n = 40
            client_env = env | {"NIMBUS_SERVICE_URL": service.url, "NIMBUS_TOKEN": token}
            client_proc = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    net.ns("cli"),
                    sys.executable,
                    str(script),
                    str(n),
                    str(out),
                    str(runs),
                ],
                env=client_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            assert client_proc.stdout is not None
            assert client_proc.stdout.readline().strip() == b"submitted"
            time.sleep(0.5)
            net.cut("ep1", up=False)  # partition: ep1 holds tasks, the service hears nothing
            deadline = time.monotonic() + 15
            while admin.get_endpoint(endpoints[0].endpoint_id)["online"]:
                assert time.monotonic() < deadline, "the service did not notice the cut"
                time.sleep(0.1)
            assert admin.get_endpoint(endpoints[1].endpoint_id)["online"]
            time.sleep(1.0)
            net.cut("ep1", up=True)  # heal: ep1's agent reconnects by itself
            endpoints[0].wait_online(admin, timeout=60)
            assert client_proc.wait(120) == 0, client_proc.stdout.read().decode()
            data = json.loads(out.read_text())
            results = data["results"]
            assert len(results) == n
            time.sleep(1.0)  # a late duplicate, if any, has arrived: nothing was replaced
            assert [admin.get_result(i, timeout=5) for i in data["ids"]] == results
            assert_first_results(runs, results)
            where = {_net_inode(net.ns("ep1")): "ep1", _net_inode(net.ns("ep2")): "ep2"}
            ran = [where.get(int(token.split(":")[2]), "elsewhere") for token in results]
            assert ran == ["ep1" if i % 2 else "ep2" for i in range(n)]
            states = {t["state"] for t in admin.list_tasks(limit=1000)}
            assert states == {"success"}
    finally:
        if client_proc is not None:
            stop(client_proc)
            if client_proc.stdout is not None:
                client_proc.stdout.close()
        for endpoint in endpoints:
            endpoint.stop()
        service.stop()


PUTS = textwrap.dedent(
    """
    import json, sys, time
    import nimbus
    from nimbus import Executor

    out = {}
    with Executor(endpoint="ep1") as one, Executor(endpoint="ep2") as two:
        for name, ex in (("ep1", one), ("ep2", two)):
            blob = bytes(range(256)) * (3 << 12)  # 3 MiB
            ref = nimbus.put(blob, endpoint=name)
            out[name] = {
                "holder": ref.holder and ref.holder[0],
                "later": nimbus.data.session(ref.endpoint).direct_after - time.monotonic(),
                "read": ex.submit(len, ref).result(120),
                "got": ref.get(120) == blob,
                "sent": ex.statistics()["bytes_sent"],
            }
    json.dump(out, open(sys.argv[1], "w"))
    """
)


def test_a_large_put_goes_straight_to_a_node_the_client_reaches_else_through_the_service(
    net: Net, tmp_path: Path
) -> None:
    """``nimbus.put`` of a large object from a client on another host: to ep2, whose
    node serves on its namespace's address, straight to that node (nothing through the
    service); to ep1, whose node serves on its own loopback (the default), through the
    service after one refused connection, and the object arrives all the same."""
    env = service_env(tmp_path) | {"NIMBUS_MAX_PAYLOAD": "16M"}
    service = NsService(tmp_path, env, net).start()
    endpoints: list[NsEndpoint] = []
    try:
        token = service.token("netuser")
        with service.client(token) as admin:
            for name, host in (("ep1", None), ("ep2", net.addr(3))):
                endpoint = NsEndpoint(service, admin, name, net.ns(name))
                endpoint.service = copy.copy(service)  # each its own node directory
                endpoint.service.env = dict(env, NIMBUS_RUNTIME_DIR=str(tmp_path / name))
                if host is not None:
                    endpoint.service.env["NIMBUS_DATA_HOST"] = host
                endpoints.append(endpoint.start(admin))
            for name in ("ep1", "ep2"):  # (an agent serves 0.25 s after it starts)
                deadline = time.monotonic() + 30
                while server_address(default_root(tmp_path / name)) is None:
                    assert time.monotonic() < deadline, f"{name}'s data server did not start"
                    time.sleep(0.05)
            script = tmp_path / "puts.py"
            script.write_text(PUTS)
            out = tmp_path / "out.json"
            client_env = env | {"NIMBUS_SERVICE_URL": service.url, "NIMBUS_TOKEN": token}
            run = subprocess.run(
                ["ip", "netns", "exec", net.ns("cli"), sys.executable, str(script), str(out)],
                env=client_env,
                capture_output=True,
                timeout=300,
            )
            assert run.returncode == 0, run.stderr.decode()[-3000:]
            got = json.loads(out.read_text())
        size = 3 << 20
        assert got["ep2"]["holder"] == net.addr(3) and got["ep2"]["later"] <= 0
        assert got["ep2"]["read"] == size and got["ep2"]["got"]
        assert got["ep2"]["sent"] < 64 * 1024  # (the task's argument: the Ref alone)
        assert got["ep1"]["holder"] is None and got["ep1"]["later"] > 60
        assert got["ep1"]["read"] == size and got["ep1"]["got"]
    finally:
        for endpoint in endpoints:
            endpoint.stop()
        service.stop()


FILES = textwrap.dedent(
    """
    import hashlib, json, os, sys
    import nimbus
    from nimbus import Executor

    def write_random(n, out):
        body = os.urandom(n)
        out.write_bytes(body)
        return out.name, hashlib.sha256(body).hexdigest()

    def digest(path):
        return hashlib.sha256(path.read_bytes()).hexdigest()

    exported, got = sys.argv[1], {}
    with Executor(endpoint="ep1") as one:
        out = nimbus.File(f"ep2:{exported}/{{task_id}}.bin")
        got["out"] = [one.submit(write_random, 2 << 20, out=out).result(180) for _ in range(2)]
        got["in"] = one.submit(digest, nimbus.File(f"ep2:{exported}/input.bin")).result(180)
        got["received"] = one.statistics()["bytes_received"]
    json.dump(got, open(sys.argv[2], "w"))
    """
)


def test_files_between_endpoints_that_cannot_reach_each_other_go_through_the_client(
    net: Net, tmp_path: Path
) -> None:
    """Two endpoints in namespaces of their own whose nodes serve on their own loopback
    (the default): neither reaches the other's node, nor does the client. A task on ep1
    writing ``out=File("ep2:...")`` still gets its files to ep2 (carried through the
    client, sha256 checked), and a file of ep2 is staged into a task on ep1 the same way."""
    env = service_env(tmp_path) | {"NIMBUS_MAX_PAYLOAD": "16M"}
    service = NsService(tmp_path, env, net).start()
    exported = tmp_path / "exported"
    exported.mkdir()
    body = os.urandom(3 << 20)
    (exported / "input.bin").write_bytes(body)
    endpoints: list[NsEndpoint] = []
    try:
        token = service.token("netuser")
        with service.client(token) as admin:
            for name in ("ep1", "ep2"):
                endpoint = NsEndpoint(service, admin, name, net.ns(name))
                endpoint.service = copy.copy(service)  # each its own node directory
                endpoint.service.env = dict(env, NIMBUS_RUNTIME_DIR=str(tmp_path / name))
                if name == "ep2":
                    endpoint.config = dataclasses.replace(endpoint.config, exports=str(exported))
                    endpoint.save_config()
                endpoints.append(endpoint.start(admin))
            out = tmp_path / "out.json"
            script = tmp_path / "files.py"
            script.write_text(FILES)
            client_env = env | {"NIMBUS_SERVICE_URL": service.url, "NIMBUS_TOKEN": token}
            command = ["ip", "netns", "exec", net.ns("cli"), sys.executable, str(script)]
            run = subprocess.run(
                [*command, str(exported), str(out)],
                env=client_env,
                capture_output=True,
                timeout=600,
            )
            assert run.returncode == 0, run.stderr.decode()[-3000:]
            got = json.loads(out.read_text())
        for name, sha in got["out"]:
            assert hashlib.sha256((exported / name).read_bytes()).hexdigest() == sha
        assert got["in"] == hashlib.sha256(body).hexdigest()
        assert got["received"] > 2 * (2 << 20)  # (carried: through this client)
        assert not [p for p in exported.iterdir() if p.name.startswith(".")]
    finally:
        for endpoint in endpoints:
            endpoint.stop()
        service.stop()
