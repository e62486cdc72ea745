"""Real components for the service tests: a uvicorn service process on 127.0.0.1,
endpoint agent processes, users with tokens, a private PostgreSQL, and tasks whose
every run answers with a token of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from nimbus.client import Client
from nimbus.config import Settings
from nimbus.endpoint.config import EndpointConfig
from nimbus.protocol.wsclient import ws_url
from nimbus.service.registry import Registry
from nimbus.statestore import StateStore

CLI = "import sys; from nimbus.cli import main; sys.exit(main())"
PG_BIN = Path("/usr/lib/postgresql/15/bin")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 15) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Service:
    """``nimbus service start`` in a subprocess; ``env`` is shared with agents and clients."""

    def __init__(
        self, root: Path, env: dict[str, str], port: int = 0, args: Sequence[str] = ()
    ) -> None:
        self.root = root
        self.env = env
        self.port = port
        self.args = list(args)  # more options of `nimbus service start`
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "service.log"

    def command(self) -> list[str]:
        """The command line that starts the service."""
        return [sys.executable, "-c", CLI, "service", "start", "--port", str(self.port), *self.args]

    def start(self) -> Service:
        url_file = self.root / "service.url"
        url_file.unlink(missing_ok=True)
        cmd = self.command()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*cmd, "--url-file", str(url_file)], env=self.env, stdout=log, stderr=log
            )
        deadline = time.monotonic() + 30
        while not url_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"service did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        self.url = url_file.read_text().strip()
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)

    def settings(self) -> Settings:
        return Settings.load(self.env)

    def user_settings(self, token: str, **env: str) -> Settings:
        """A client's settings: this service's URL, ``token``, and ``env`` on top."""
        return Settings.load(
            self.env | {"NIMBUS_SERVICE_URL": self.url, "NIMBUS_TOKEN": token} | env
        )

    def token(self, user: str) -> str:
        """What `nimbus service token create USER` prints (same registry database)."""
        registry = Registry(self.settings().registry_url)
        try:
            return registry.create_user_token(user)
        finally:
            registry.close()

    def client(self, token: str) -> Client:
        return Client(self.url, token, settings=self.settings())

    def http(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        verify = self.settings().ssl_context() if self.url.startswith("https://") else True
        return httpx.Client(base_url=self.url, headers=headers, timeout=30, verify=verify)


class EndpointProcess:
    """``python -m nimbus.endpoint.daemon NAME`` for an endpoint registered by ``client``."""

    def __init__(self, service: Service, client: Client, name: str, workers: int = 2) -> None:
        registered = client.register_endpoint(name)
        self.service = service
        self.endpoint_id: str = registered["endpoint_id"]
        self.token: str = registered["token"]
        self.config = EndpointConfig(
            name=name,
            service_url=service.url,
            endpoint_id=self.endpoint_id,
            token=self.token,
            workers=workers,
            prefetch=2,
        )
        self.save_config()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = service.root / f"agent-{name}.log"

    def save_config(self) -> None:
        """Write ``self.config`` where the agent reads it (the service's config home)."""
        old = os.environ.get("XDG_CONFIG_HOME")
        os.environ["XDG_CONFIG_HOME"] = self.service.env["XDG_CONFIG_HOME"]
        try:
            self.config.save()
        finally:
            if old is None:
                del os.environ["XDG_CONFIG_HOME"]
            else:
                os.environ["XDG_CONFIG_HOME"] = old

    def command(self) -> list[str]:
        """The command line that starts the agent."""
        return [sys.executable, "-m", "nimbus.endpoint.daemon", self.config.name]

    def start(self, client: Client | None = None, timeout: float = 30) -> EndpointProcess:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                env=self.service.env,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        if client is not None:
            self.wait_online(client, timeout)
        return self

    def wait_online(self, client: Client, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not client.get_endpoint(self.endpoint_id)["online"]:
            assert self.proc is not None
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"agent did not come online:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the agent and its workers (its whole session), as a lost node."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


def service_redis(service: Service, *, stores: bool = False) -> int:
    """The pid of one of the service's embedded Redis servers: its queue Redis (on a Unix
    socket only), or with ``stores`` the one it hands out for endpoint programs (it also
    listens on TCP; started with the first endpoint Executor)."""
    import json

    import psutil

    found = []
    for state in Path(service.env["NIMBUS_RUNTIME_DIR"]).glob("redis-*.json"):
        pid = int(json.loads(state.read_text())["server"][0])
        process = psutil.Process(pid)
        title = " ".join(process.cmdline())  # redis-server <first address>
        if "redis-server" in process.name() and ("unixsocket:" in title) != stores:
            found.append(pid)
    assert len(found) == 1, f"the service's {'stores' if stores else 'queue'} Redis: {found}"
    return found[0]


def make_certificates(root: Path, name: str = "ca") -> tuple[Path, Path, Path]:
    """A private CA in ``root`` and a server certificate it signed for 127.0.0.1 and
    localhost (``openssl`` CLI): (CA file, certificate, key)."""
    root.mkdir(parents=True, exist_ok=True)
    ca, ca_key = root / f"{name}.pem", root / f"{name}.key"
    cert, key, csr = root / f"{name}-server.pem", root / f"{name}-server.key", root / "req.csr"
    ext = root / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        f"/CN=nimbus test {name}",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        str(key),
        "-out",
        str(csr),
    )
    openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        str(ext),
        "-out",
        str(cert),
    )
    return ca, cert, key


def ws_connect(service: Service, path: str, token: str) -> ClientConnection:
    """A WebSocket to ``service`` at ``path`` (``/v1/ws/client`` or ``/v1/ws/endpoint``)."""
    url = ws_url(service.url, path)
    return connect(
        url,
        additional_headers={"Authorization": f"Bearer {token}"},
        open_timeout=10,
        max_size=None,
    )


def closed_with(ws: ClientConnection, timeout: float = 10) -> tuple[int, str]:
    """Wait for the service to close ``ws``; its close code and reason."""
    import pytest

    deadline = time.monotonic() + timeout
    with pytest.raises(ConnectionClosed) as info:
        while time.monotonic() < deadline:
            ws.recv(timeout=max(0.01, deadline - time.monotonic()))
    rcvd = info.value.rcvd
    assert rcvd is not None, "the service dropped the connection without a close frame"
    return rcvd.code, rcvd.reason


def service_env(root: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIMBUS_")}
    env.update(
        NIMBUS_RUNTIME_DIR=str(root / "rt"),
        XDG_CONFIG_HOME=str(root / "cfg"),
        NIMBUS_HEARTBEAT="0.3",
        NIMBUS_MAX_PAYLOAD="1M",
        NIMBUS_WORKERS="2",
    )
    env.update(extra)
    return env


def serve(
    factory: pytest.TempPathFactory, name: str = "service", args: Sequence[str] = (), **extra: str
) -> Iterator[Service]:
    """A started service for a test module's fixture (``yield from serve(...)``), in a new
    directory ``name``, with ``extra`` on top of :func:`service_env`; stopped after."""
    root = factory.mktemp(name)
    svc = Service(root, service_env(root, **extra), args=args).start()
    try:
        yield svc
    finally:
        svc.stop()


@contextlib.contextmanager
def two_services(tmp_path: Path) -> Iterator[tuple[Service, Service, StateStore]]:
    """Two service processes on one registry and one queue Redis (an embedded one in
    ``tmp_path``), as behind a load balancer; both stopped and the Redis closed after."""
    store = StateStore.open(None, tmp_path / "redis")  # the queue Redis both processes share
    root = tmp_path / "svc"
    root.mkdir()
    env = service_env(root, NIMBUS_REDIS_URL=store.url)
    started: list[Service] = []
    try:
        for _ in range(2):  # same registry, same Redis
            started.append(Service(root, env, port=free_port()).start())
        yield started[0], started[1], store
    finally:
        for service in reversed(started):
            service.stop()
        store.close()


def slurm_endpoint(
    service: Service, client: Client, name: str, slurm: Any, **config: object
) -> EndpointProcess:
    """Endpoint ``name`` of ``client`` whose blocks are jobs of the test cluster ``slurm``
    (``slurm_support.Cluster``): its config saved with ``config`` besides the partition,
    a 5-minute walltime and the agent on loopback; ``SLURM_CONF`` in the service's env
    (for the agents it starts: delete it when done)."""
    endpoint = EndpointProcess(service, client, name)
    endpoint.config = dataclasses.replace(
        endpoint.config,
        provider="slurm",
        partition=slurm.partition,
        walltime="00:05:00",
        agent_listen="127.0.0.1:0",
        **config,
    )
    old = dict(os.environ)
    os.environ.update(service.env | {"SLURM_CONF": str(slurm.conf)})
    try:
        endpoint.config.save()
    finally:
        os.environ.clear()
        os.environ.update(old)
    service.env["SLURM_CONF"] = str(slurm.conf)
    return endpoint


# ---------------------------------------------------------------- PostgreSQL


class Postgres:
    """A private PostgreSQL 15 cluster (run as the ``postgres`` user) on a loopback port."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "pgdata"
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @staticmethod
    def unavailable() -> str | None:
        """Why a PostgreSQL cannot be started here, or None."""
        if not (PG_BIN / "initdb").exists():
            return f"no PostgreSQL server binaries in {PG_BIN} (apt install postgresql-15)"
        if shutil.which("runuser") is None:
            return "no runuser to drop root privileges for PostgreSQL"
        try:
            import pwd

            pwd.getpwnam("postgres")
        except KeyError:
            return "no 'postgres' system user to run PostgreSQL as"
        return None

    @staticmethod
    def explain(exc: BaseException) -> str:
        """What a failed PostgreSQL command said (its stderr), for the failure message."""
        err = getattr(exc, "stderr", None)
        text = err.decode(errors="replace").strip() if isinstance(err, bytes) else ""
        return f"{exc}: {text}" if text else str(exc)

    def _as_postgres(self, *cmd: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run([*prefix, *cmd], check=True, capture_output=True, timeout=120)

    def start(self) -> Postgres:
        self.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        self._as_postgres(
            str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres"
        )
        self._pg_ctl_start()
        return self

    def _pg_ctl_start(self) -> None:
        self._as_postgres(
            str(PG_BIN / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.root / "pg.log"),
            "-o",
            f"-h 127.0.0.1 -p {self.port} -k {self.root}",
            "-w",
            "start",
        )

    def restart(self, timeout: float = 30) -> None:
        """Start the cluster again after it was killed (its leftover processes may hold
        its shared memory for a moment)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._pg_ctl_start()
                return
            except subprocess.CalledProcessError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        try:
            self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "fast", "stop")
        except subprocess.CalledProcessError:
            pass


@contextlib.contextmanager
def postgres_cluster() -> Iterator[Postgres]:
    """A private PostgreSQL cluster, stopped and removed after. The test is skipped only
    where this machine cannot have one (not root, no server binaries); as root with
    apt, a PostgreSQL that is missing or does not start fails it."""
    why = Postgres.unavailable()
    if why:
        if os.geteuid() == 0 and shutil.which("apt-get"):
            pytest.fail(
                f"PostgreSQL can run here (root, apt) but {why}; "
                "install it (.ci/run does: apt-get install -y postgresql-15)"
            )
        pytest.skip(f"PostgreSQL not available: {why}")
    root = Path(tempfile.mkdtemp(prefix="nimbus-pg-"))  # reachable by the postgres user
    os.chmod(root, 0o755)
    pg = Postgres(root / "cluster")
    try:
        pg.start()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        log = pg.root / "pg.log"
        said = log.read_text()[-2000:] if log.exists() else ""
        subprocess.run(["rm", "-rf", str(root)], check=False)
        pytest.fail(f"PostgreSQL could not be started: {Postgres.explain(exc)}\n{said}")
    try:
        yield pg
    finally:
        pg.stop()
        subprocess.run(["rm", "-rf", str(root)], check=False)


# ---------------------------------------------------------------- runs of a task


def tokened_run(path: str, i: int, seconds: float) -> str:
    """Task ``i``: a token of this run's own (task, pid, session, uuid), written to
    ``path`` when the run starts and again when it returns, after ``seconds``.

    Every run answers differently, so a second result that replaced the first is
    seen; the file is the on-disk count of the runs. (A function of the tests'
    own code travels to the endpoint by value.)
    """
    import os as _os
    import time as _time
    import uuid as _uuid

    token = f"{i}:{_os.getpid()}:{_os.getsid(0)}:{_uuid.uuid4().hex}"
    with open(path, "a") as out:
        out.write(f"start {token}\n")
    _time.sleep(seconds)
    with open(path, "a") as out:
        out.write(f"end {token}\n")
    return token


class Runs:
    """The runs ``tokened_run`` recorded in a file: started and returned, in order."""

    def __init__(self, path: Path) -> None:
        self.started: dict[int, list[str]] = {}
        self.ended: dict[int, list[str]] = {}
        for line in path.read_text().splitlines():
            kind, token = line.split()
            runs = self.started if kind == "start" else self.ended
            runs.setdefault(int(token.split(":")[0]), []).append(token)

    @staticmethod
    def pid(token: str) -> int:
        return int(token.split(":")[1])

    def first(self, i: int, lost: Collection[int] = ()) -> str:
        """The result task ``i`` must keep: its first run that returned.

        Runs in a ``lost`` process (a worker of an agent killed or cut off) may
        have returned without their result ever reaching the service; the first
        result that arrived is then that of the first run elsewhere, or, if every
        run was in a lost process, the first of them.
        """
        ended = self.ended.get(i, [])
        assert ended, f"task {i} never returned: {self.started.get(i)}"
        kept = [t for t in ended if self.pid(t) not in lost]
        return kept[0] if kept else ended[0]

    def duplicates(self) -> int:
        """Runs beyond one per task."""
        return sum(len(runs) - 1 for runs in self.started.values())


def process_tree(pid: int) -> set[int]:
    """``pid`` and every process below it now (an agent and its workers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = set(), [pid]
    while todo:
        here = todo.pop()
        tree.add(here)
        todo.extend(children.get(here, []))
    return tree


def assert_first_results(path: Path, results: Sequence[str], lost: Collection[int] = ()) -> Runs:
    """Task ``i``'s one result is ``results[i]`` and it is its first run's."""
    runs = Runs(path)
    assert sorted(runs.started) == list(range(len(results))), "a task never started"
    wrong = {
        i: (result, runs.first(i, lost))
        for i, result in enumerate(results)
        if result != runs.first(i, lost)
    }
    assert not wrong, f"results not of the first run (kept, first): {wrong}"
    return runs


def ship(n: int, pause: float = 0.0) -> int:
    """A task: send ``n`` bytes over TCP on loopback to itself (``n`` out, ``n`` in), then
    wait ``pause`` seconds (a run long enough for a throughput to mean something)."""
    import socket
    import time

    got = 0
    with (
        socket.create_server(("127.0.0.1", 0)) as server,
        socket.create_connection(server.getsockname()) as out,
    ):
        conn, _ = server.accept()
        with conn:
            out.sendall(b"x" * n)
            out.shutdown(socket.SHUT_WR)
            while chunk := conn.recv(65536):
                got += len(chunk)
    time.sleep(pause)
    return got
