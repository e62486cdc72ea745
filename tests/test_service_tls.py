"""The service behind TLS: a private CA and a server certificate made here (openssl), a
real service started with --tls-cert/--tls-key, a real endpoint agent over wss://, and a
remote nimbus.multiprocessing program whose state store is reached over rediss://."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from nimbus import Client, Executor
from nimbus.backends.service import probe_store
from nimbus.config import Settings, untrusted_certificate
from nimbus.errors import ConfigError, ServiceUnavailable
from nimbus.service.tunnel import TLSTunnel
from nimbus.statestore import EmbeddedRedis
from service_support import (
    EndpointProcess,
    Service,
    free_port,
    make_certificates,
    serve,
    service_env,
)

pytestmark = pytest.mark.skipif(
    subprocess.run(["openssl", "version"], capture_output=True).returncode != 0,
    reason="no openssl CLI to make the test certificates",
)


def square(x: int) -> int:
    return x * x


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("certs")
    ca, cert, key = make_certificates(root, "ca")
    other_ca, _, _ = make_certificates(root, "other")  # a CA that signed nothing of ours
    return {"ca": ca, "cert": cert, "key": key, "other_ca": other_ca}


@pytest.fixture(scope="module")
def tls_service(
    tmp_path_factory: pytest.TempPathFactory, certs: dict[str, Path]
) -> Iterator[Service]:
    args = ["--tls-cert", str(certs["cert"]), "--tls-key", str(certs["key"])]
    yield from serve(tmp_path_factory, "tls-service", args, NIMBUS_CA_FILE=str(certs["ca"]))


@pytest.fixture(scope="module")
def carol(tls_service: Service) -> Iterator[Client]:
    with tls_service.client(tls_service.token("carol")) as client:
        yield client


@pytest.fixture(scope="module")
def site(tls_service: Service, carol: Client) -> Iterator[EndpointProcess]:
    endpoint = EndpointProcess(tls_service, carol, "site").start(carol)
    yield endpoint
    endpoint.stop()


def _port(service: Service) -> int:
    return int(service.url.rpartition(":")[2])


def test_the_service_url_is_https(tls_service: Service) -> None:
    assert tls_service.url.startswith("https://127.0.0.1:")
    with tls_service.http() as http:  # verified with the test's CA
        assert http.get("/v1/health").status_code == 200


def test_client_submits_and_gets_results_through_an_agent_over_wss(
    tls_service: Service, carol: Client, site: EndpointProcess
) -> None:
    assert site.config.service_url.startswith("https://")  # so the agent's socket is wss://
    task_id = carol.run(square, 7, endpoint="site")
    assert carol.get_result(task_id, timeout=60) == 49
    settings = tls_service.user_settings(carol.token)
    with Executor(endpoint="site", settings=settings) as ex:  # the SDK's own wss:// socket
        assert list(ex.map(square, range(20))) == [i * i for i in range(20)]


@pytest.mark.parametrize("ca", ["none", "other_ca"])
def test_a_client_that_does_not_trust_the_certificate_is_told_which_setting_to_fix(
    tls_service: Service, carol: Client, certs: dict[str, Path], ca: str
) -> None:
    env = {"NIMBUS_CA_FILE": "none" if ca == "none" else str(certs[ca])}
    settings = tls_service.user_settings(carol.token, **env)
    with Client(settings=settings) as client, pytest.raises(ConfigError) as info:
        client.whoami()
    message = str(info.value)
    assert "NIMBUS_CA_FILE" in message and tls_service.url in message
    assert "certificate" in message
    with pytest.raises(ConfigError, match="NIMBUS_CA_FILE"):  # the Executor: the same
        Executor(endpoint="site", settings=settings)


def test_an_agent_that_does_not_trust_the_certificate_exits_saying_why(
    tls_service: Service, carol: Client, certs: dict[str, Path]
) -> None:
    agent = EndpointProcess(tls_service, carol, "doubter")
    agent.service = Service(tls_service.root, tls_service.env | {"NIMBUS_CA_FILE": "none"})
    agent.service.url = tls_service.url
    agent.start()
    assert agent.proc is not None
    try:
        assert agent.proc.wait(60) == 1
    finally:
        agent.stop()
    log = agent.log.read_text()
    assert "NIMBUS_CA_FILE" in log and "not trusted" in log, log
    assert not carol.get_endpoint(agent.endpoint_id)["online"]


def test_plain_http_to_the_tls_port_gets_no_answer(tls_service: Service, carol: Client) -> None:
    plain = f"http://127.0.0.1:{_port(tls_service)}"
    with pytest.raises(httpx.TransportError):
        httpx.get(plain + "/v1/health", timeout=10)
    with (
        Client(plain, carol.token, settings=tls_service.settings()) as client,
        pytest.raises(ServiceUnavailable, match="https://"),
    ):
        client.whoami()
    with socket.create_connection(("127.0.0.1", _port(tls_service)), timeout=10) as sock:
        sock.sendall(b"GET /v1/whoami HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"HTTP/1.1 200" not in sock.recv(4096)  # nothing readable comes back


def test_a_missing_or_mismatched_certificate_is_refused_at_start(
    tmp_path: Path, certs: dict[str, Path]
) -> None:
    env = service_env(tmp_path)
    for args, expected in [
        (["--tls-cert", str(certs["cert"])], "go together"),
        (["--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", str(certs["key"])], "--tls-cert"),
        (["--tls-cert", str(certs["cert"]), "--tls-key", str(certs["other_ca"])], "--tls-key"),
    ]:
        svc = Service(tmp_path, env, args=args)
        with pytest.raises(RuntimeError) as info:
            svc.start()
        assert expected in str(info.value)


# ---------------------------------------------------------------- the stores Redis


def test_the_store_handed_out_is_rediss_and_verified(
    tls_service: Service,
    carol: Client,
    site: EndpointProcess,
    certs: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = carol.store("site")
    url = store["url"]
    assert url.startswith("rediss://nimbus-u-")
    with redis.Redis.from_url(url, ssl_ca_certs=str(certs["ca"])) as verified:
        assert verified.ping()
    with redis.Redis.from_url(url) as unverified, pytest.raises(redis.ConnectionError) as info:
        unverified.ping()  # the system's CAs do not know the test's CA
    assert "CERTIFICATE_VERIFY_FAILED" in str(info.value)
    plain = "redis://" + url.removeprefix("rediss://")
    with (
        redis.Redis.from_url(plain, socket_timeout=5) as cleartext,
        pytest.raises(redis.RedisError),
    ):
        cleartext.ping()  # the port speaks TLS only
    # what a program checks before it starts: verified with NIMBUS_CA_FILE, else told to set it
    monkeypatch.setenv("NIMBUS_CA_FILE", "none")
    with pytest.raises(ConfigError, match="NIMBUS_CA_FILE") as refused:
        probe_store(url, "site")
    assert "state store" in str(refused.value) and url not in str(refused.value)  # no password
    monkeypatch.setenv("NIMBUS_CA_FILE", str(certs["ca"]))
    probe_store(url, "site")


PROGRAM = r"""
import nimbus.multiprocessing as mp

def square(x):
    return x * x

def child(q, lock):
    with lock:
        q.put(sum(range(10)))

if __name__ == "__main__":
    with mp.Pool(2) as pool:
        print("sum:", sum(pool.map(square, range(32))), flush=True)
    q, lock = mp.Queue(), mp.Lock()
    p = mp.Process(target=child, args=(q, lock))
    p.start()
    print("child:", q.get(timeout=60), flush=True)
    p.join()
    print("exitcode:", p.exitcode, flush=True)
"""


def _program(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(PROGRAM))
    return subprocess.run(
        [sys.executable, str(script)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_a_remote_multiprocessing_program_runs_over_rediss(
    tmp_path: Path, tls_service: Service, carol: Client, site: EndpointProcess
) -> None:
    env = tls_service.env | {
        "NIMBUS_SERVICE_URL": tls_service.url,
        "NIMBUS_TOKEN": carol.token,
        "NIMBUS_ENDPOINT": "site",
    }
    result = _program(tmp_path, env)
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    assert lines == {"sum": str(sum(i * i for i in range(32))), "child": "45", "exitcode": "0"}


def test_settings_ca_file_must_be_a_pem_file(tmp_path: Path, certs: dict[str, Path]) -> None:
    assert Settings.load({"NIMBUS_CA_FILE": str(certs["ca"])}).ca_file == certs["ca"]
    assert isinstance(Settings(ca_file=certs["ca"]).ssl_context(), ssl.SSLContext)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="NIMBUS_CA_FILE"):
        Settings.load({"NIMBUS_CA_FILE": str(junk)})


# ---------------------------------------------------------------- the tunnel itself


def test_the_tunnel_pipes_tls_to_the_socket_and_passes_closes_on(
    tmp_path: Path, certs: dict[str, Path]
) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs["cert"], certs["key"])
    server = EmbeddedRedis(tmp_path / "rt", password="admin-secret").start()
    port = free_port()
    tunnel = TLSTunnel("127.0.0.1", port, server.socket_path, context).start()
    url = f"rediss://:admin-secret@127.0.0.1:{port}/0"
    try:
        with pytest.raises(OSError):  # the address is taken: said at start
            TLSTunnel("127.0.0.1", port, server.socket_path, context).start()
        client = redis.Redis.from_url(
            url, ssl_ca_certs=str(certs["ca"]), retry=None, socket_timeout=20
        )
        blob = bytes(range(256)) * 40_000  # 10 MB each way, through the tunnel
        client.set("k", blob)
        assert client.get("k") == blob
        me = client.client_id()
        with redis.Redis(unix_socket_path=str(server.socket_path), password="admin-secret") as a:
            a.client_kill_filter(_id=me)  # Redis closes it: the TLS side is closed too
        with pytest.raises(redis.ConnectionError):
            client.ping()
        client.close()
    finally:
        tunnel.close()
        server.stop()
    with pytest.raises(OSError):  # closed: nothing listens there any more
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_a_certificate_for_another_host_is_told_apart_from_an_unknown_ca() -> None:
    mismatch = ssl.SSLCertVerificationError(1, "certificate verify failed")
    mismatch.verify_message = "IP address mismatch, certificate is not valid for '10.0.0.9'."
    error = untrusted_certificate(httpx.ConnectError("x"), "the service")
    assert error is None  # not a certificate problem
    try:
        raise httpx.ConnectError("[SSL: CERTIFICATE_VERIFY_FAILED]") from mismatch
    except httpx.ConnectError as exc:
        error = untrusted_certificate(exc, "the nimbus service at https://10.0.0.9")
    assert error is not None and "does not name that host" in str(error)
    assert "NIMBUS_CA_FILE" not in str(error)
