from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest
import redis

import nimbus.statestore
from nimbus.errors import ConfigError, StateStoreError
from nimbus.statestore import EmbeddedRedis, Program, StateStore, connect, redis_server_binary

if TYPE_CHECKING:
    from conftest import LockHolder

SRC = str(Path(__file__).resolve().parents[1] / "src")
PACKAGE = Path(SRC) / "nimbus"


def _ours(marker: str) -> set[int]:
    """Pids of live processes whose command line mentions ``marker``."""
    pids = set()
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and any(
                marker in part for part in proc.info["cmdline"] or ()
            ):
                pids.add(proc.pid)
        except psutil.Error:
            pass
    return pids - {os.getpid()}


@pytest.fixture
def rt(tmp_path: Path) -> Iterator[Path]:
    """A runtime dir; fails the test if a server or watchdog in it outlives the test by
    more than 3 s (a server that was sent SHUTDOWN or lost its watchdog, PR_SET_PDEATHSIG,
    takes a moment to go under load: a CI run once saw one still there at once)."""
    yield tmp_path
    deadline = time.monotonic() + 3
    while (left := _ours(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.05)
    named = {}
    for pid in left:
        try:
            named[pid] = " ".join(psutil.Process(pid).cmdline())
            os.kill(pid, signal.SIGKILL)
        except (psutil.Error, ProcessLookupError):
            pass
    assert not named, f"processes left running: {named}"


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.02)
    return False


def _spawn_owner(
    rt: Path, then: str = "time.sleep(60)", persist_dir: Path | None = None
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """A real child Python that starts an embedded Redis in ``rt`` and prints its pids."""
    disk = f"Path({str(persist_dir)!r})" if persist_dir else "None"
    code = (
        "import json, sys, time\nfrom pathlib import Path\n"
        "from nimbus.statestore import EmbeddedRedis\n"
        f"e = EmbeddedRedis(Path({str(rt)!r}), persist_dir={disk}).start()\n"
        "print(json.dumps({'server': e.server_pid, 'watchdog': e._watchdog.pid,"
        " 'socket': str(e.socket_path)}), flush=True)\n" + then
    )
    env = {**os.environ, "PYTHONPATH": SRC}
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout is not None
    return child, json.loads(child.stdout.readline())


def _reap(child: subprocess.Popen[str]) -> int:
    child.kill()
    assert child.stdout is not None
    child.stdout.close()
    return child.wait()


def test_binary_is_bundled() -> None:
    assert redis_server_binary().name == "redis-server"


def test_embedded_start_ping_stop_leaves_nothing(rt: Path) -> None:
    server = EmbeddedRedis(rt / "run").start()
    assert server.url == f"unix://{server.socket_path}"
    assert (rt / "run").stat().st_mode & 0o777 == 0o700
    assert server.socket_path.stat().st_mode & 0o777 == 0o700
    with redis.Redis(unix_socket_path=str(server.socket_path)) as client:
        assert client.ping()
        assert client.config_get("save")["save"] == ""
        assert client.config_get("appendonly")["appendonly"] == "no"
        assert client.config_get("port")["port"] == "0"
    pid = server.server_pid
    server.stop()
    assert _gone(pid, 1)
    assert list((rt / "run").iterdir()) == []
    server.stop()  # idempotent


def test_tcp_listener_needs_the_password_that_no_command_line_shows(rt: Path) -> None:
    from service_support import free_port

    with pytest.raises(ConfigError, match="password"):
        EmbeddedRedis(rt, tcp=("127.0.0.1", free_port()))
    port = free_port()
    with EmbeddedRedis(rt, tcp=("127.0.0.1", port), password="s3cret-admin") as server:
        assert not list(rt.glob("*.conf"))  # read at start, then removed
        cmdline = " ".join(psutil.Process(server.server_pid).cmdline())
        assert "s3cret-admin" not in cmdline and str(port) in cmdline
        with redis.Redis(host="127.0.0.1", port=port, password="s3cret-admin") as admin:
            assert admin.ping()
        with (
            redis.Redis(host="127.0.0.1", port=port) as anyone,
            pytest.raises(redis.AuthenticationError),
        ):
            anyone.ping()


def test_two_servers_in_one_dir_are_independent(rt: Path) -> None:
    with EmbeddedRedis(rt) as a, EmbeddedRedis(rt) as b:
        assert a.socket_path != b.socket_path
        ca, cb = (redis.Redis(unix_socket_path=str(s.socket_path)) for s in (a, b))
        ca.set("k", "a")
        assert cb.get("k") is None
        ca.close()
        cb.close()
    assert list(rt.iterdir()) == []


def test_server_dies_when_owner_is_sigkilled(rt: Path) -> None:
    child, pids = _spawn_owner(rt)
    _reap(child)
    assert _gone(pids["server"], 3)
    assert _gone(pids["watchdog"], 3)
    EmbeddedRedis(rt).start().stop()  # the next start removes the dead owner's files
    assert list(rt.iterdir()) == []


def test_persisted_server_keeps_its_writes_when_its_owner_is_sigkilled(rt: Path) -> None:
    disk = rt / "disk"
    child, pids = _spawn_owner(rt, persist_dir=disk)
    with redis.Redis(unix_socket_path=pids["socket"]) as client:
        client.set("k", "kept")  # written to the append-only file before the reply
        assert client.config_get("appendfsync")["appendfsync"] == "everysec"
    _reap(child)
    assert _gone(pids["server"], 3)
    for persist_dir, expected in ((disk, b"kept"), (None, None)):  # in memory: nothing
        with (
            EmbeddedRedis(rt, persist_dir=persist_dir) as again,
            redis.Redis(unix_socket_path=str(again.socket_path)) as client,
        ):
            assert client.get("k") == expected
    assert [p.name for p in disk.iterdir()] == ["appendonly.aof"]


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux only")
@pytest.mark.parametrize("setpriv", [True, False])
def test_a_direct_server_is_the_owners_child_and_dies_when_it_is_sigkilled(
    rt: Path, setpriv: bool
) -> None:
    # a program's root launches its store with no watchdog (it answers sooner); without
    # util-linux's setpriv the child sets PR_SET_PDEATHSIG itself
    code = (
        "import json, os, shutil\nfrom pathlib import Path\n"
        "from nimbus.statestore import EmbeddedRedis\n"
        + ("" if setpriv else "shutil.which = lambda name: None\n")
        + f"e = EmbeddedRedis(Path({str(rt)!r})).launch(direct=True).ready()\n"
        "assert e._watchdog.pid == e.server_pid\n"
        "print(json.dumps({'server': e.server_pid, 'parent': os.getpid()}), flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": SRC}
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout is not None
    pids = json.loads(child.stdout.readline())
    assert psutil.Process(pids["server"]).ppid() == pids["parent"]
    assert "redis-server" in " ".join(psutil.Process(pids["server"]).cmdline())
    _reap(child)
    assert _gone(pids["server"], 3)
    EmbeddedRedis(rt).start().stop()  # the next launch removes the dead owner's files
    assert list(rt.glob("redis-*")) == []


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux only")
def test_server_dies_when_watchdog_is_sigkilled(rt: Path) -> None:
    server = EmbeddedRedis(rt).start()
    assert server._watchdog is not None
    server._watchdog.kill()
    assert _gone(server.server_pid, 3)
    server.stop()
    assert list(rt.iterdir()) == []


def test_atexit_stops_server_of_owner_that_exits(rt: Path) -> None:
    child, pids = _spawn_owner(rt, then="sys.exit(0)")
    assert child.wait(5) == 0
    _reap(child)
    assert _gone(pids["server"], 1)
    assert list(rt.iterdir()) == []


def test_orphan_server_of_dead_owner_is_cleaned_at_next_start(rt: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    sock = rt / "redis-0rphan00.sock"
    orphan = subprocess.Popen(
        [str(redis_server_binary()), "--port", "0", "--unixsocket", str(sock), "--save", ""],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    while not sock.exists():
        time.sleep(0.01)
    created = psutil.Process(orphan.pid).create_time()
    state = {"owner": [dead.pid, 1.0], "watchdog": [0, None], "server": [orphan.pid, created]}
    (rt / "redis-0rphan00.json").write_text(json.dumps({**state, "socket": str(sock)}))
    (rt / "redis-0rphan00.log").write_text("old")
    EmbeddedRedis(rt).start().stop()
    orphan.wait(2)  # killed (and reaped by psutil, as it is our child here)
    assert not psutil.pid_exists(orphan.pid)
    assert list(rt.iterdir()) == []


def test_a_program_that_never_starts_its_store_still_sweeps_a_dead_owners(rt: Path) -> None:
    """The sweep is asked for when a program opens its store (``defer()``), not when the
    store starts: a program that never starts one (a local Pool) removes a killed one's
    files (on the chores' thread, off the first start: at once here, as at exit)."""
    child, pids = _spawn_owner(rt)
    _reap(child)
    assert _gone(pids["server"], 3)
    (rt / f".{Path(pids['socket']).stem}.lock").touch()  # as a child's serve() leaves it
    left = sorted(p.name for p in rt.iterdir())
    assert any(n.endswith(".json") for n in left), left
    server = EmbeddedRedis(rt).defer()
    nimbus.statestore._chores.run_now()
    assert list(rt.iterdir()) == []
    assert not server.socket_path.exists()  # not started
    server.stop()
    assert list(rt.iterdir()) == []


def test_live_owner_entries_and_unrelated_pids_are_left_alone(rt: Path) -> None:
    child, pids = _spawn_owner(rt)
    try:
        with EmbeddedRedis(rt):
            pass
        assert psutil.pid_exists(pids["server"])
        assert Path(pids["socket"]).exists()
    finally:
        _reap(child)
    assert _gone(pids["server"], 3)
    EmbeddedRedis(rt).start().stop()


def test_long_runtime_dir_falls_back_to_short_socket_path(rt: Path) -> None:
    deep = rt / ("d" * 60) / ("e" * 60)
    server = EmbeddedRedis(deep).start()
    try:
        assert len(str(server.socket_path)) < 107
        assert server.socket_path.parent.stat().st_mode & 0o777 == 0o700
        with StateStore(server.url) as store:
            assert store.client().ping()
    finally:
        server.stop()
    assert not server.socket_path.parent.exists()
    assert list(deep.iterdir()) == []
    assert _gone(server.server_pid, 1)


def test_statestore_embedded(rt: Path) -> None:
    with StateStore.open(None, rt) as store:
        assert store.embedded
        assert store.url.startswith("unix://")
        client = store.client()
        client.set(b"k", b"v")
        assert client.get(b"k") == b"v"
        assert connect(store.url).get(b"k") == b"v"
    assert list(rt.iterdir()) == []


def test_statestore_external_url(rt: Path) -> None:
    with EmbeddedRedis(rt) as server, StateStore.open(server.url, rt) as store:
        assert not store.embedded
        assert store.client().ping()
    assert list(rt.iterdir()) == []


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1", "unix:///nonexistent/redis.sock"])
def test_unreachable_url_fails_fast_naming_it(rt: Path, url: str) -> None:
    start = time.monotonic()
    with pytest.raises(StateStoreError, match="NIMBUS_REDIS_URL") as info:
        StateStore.open(url, rt)
    assert url in str(info.value)
    assert time.monotonic() - start < 2


def test_bad_url_is_a_config_error(rt: Path) -> None:
    with pytest.raises(ConfigError, match="NIMBUS_REDIS_URL"):
        StateStore.open("http://example.com", rt)


def test_connect_is_cached_per_process(rt: Path) -> None:
    with EmbeddedRedis(rt) as server:
        parent = connect(server.url)
        assert connect(server.url) is parent
        assert parent.ping()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                mine = connect(server.url)
                ok = mine is not parent and connect(server.url) is mine and mine.ping()
                os.write(write, b"1" if ok else b"0")
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(read, 1) == b"1"
        os.close(read)
        os.close(write)
        assert connect(server.url) is parent
        parent.close()


@pytest.mark.parametrize("deep", [False, True])
def test_restart_after_sigkill_keeps_the_url_and_with_persist_the_data(
    rt: Path, deep: bool
) -> None:
    runtime = rt / ("d" * 60) / ("e" * 60) if deep else rt  # deep: a fallback socket dir
    with StateStore.open(None, runtime, persist_dir=rt / "disk") as store:
        url, client = store.url, store.client()
        client.set(b"k", b"kept")
        first = store.server_pid
        assert store.alive()
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while store.alive():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(redis.ConnectionError):
            client.get(b"k")
        store.restart()
        assert store.alive() and store.server_pid != first and store.url == url
        assert client.get(b"k") == b"kept"  # read back from its append-only file
    assert _gone(first, 1)
    with StateStore.open(None, rt) as store:  # not persisted: back empty
        store.client().set(b"k", b"lost")
        os.kill(store.server_pid, signal.SIGKILL)
        while store.alive():
            time.sleep(0.01)
        store.restart()
        assert store.client().get(b"k") is None


def test_connect_own_is_a_client_of_its_own_and_single_keeps_one_connection(rt: Path) -> None:
    with EmbeddedRedis(rt) as server:
        shared = connect(server.url)
        with connect(server.url, own=True, single=True) as own:
            assert own is not shared
            assert own.client_id() == own.client_id()  # the one connection it keeps
            assert own.client_id() != shared.client_id()
        start = time.monotonic()
        with pytest.raises(redis.RedisError):
            connect(f"unix://{rt}/no.sock", own=True, timeout=0.2).ping()
        assert time.monotonic() - start < 1


def test_a_roots_embedded_store_boots_while_it_goes_on_and_connections_wait(
    rt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # issue 16: a program that only starts Processes never waits for its store; the
    # first connection to it (here or in a fork of this process) waits until it answers
    monkeypatch.delenv("NIMBUS_REDIS_URL", raising=False)
    monkeypatch.setenv("NIMBUS_RUNTIME_DIR", str(rt))
    from nimbus.config import Settings
    from nimbus.statestore import open_store
    from nimbus.statestore._connect import untouched

    store = open_store(Settings.load())
    try:
        program = Program(store.url, "p-boot", 30.0)
        assert untouched(store.url)  # launched, not waited for (it may answer already)
        pid = os.fork()
        if pid == 0:  # a process forked while it boots: its first command waits too
            code = 1
            try:
                code = 0 if connect(store.url).ping() else 3
            finally:
                os._exit(code)
        assert connect(store.url).set(b"k", b"v")
        assert not program.booting() and not untouched(store.url)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    finally:
        store.close()
    assert not program.booting()
    with pytest.raises(redis.RedisError):  # stopped: an error at once, not a wait
        connect(f"unix://{rt}/gone.sock", own=True, timeout=0.2).ping()


def test_an_embedded_store_that_cannot_start_is_an_error_at_first_use(rt: Path) -> None:
    from nimbus.statestore._connect import booting

    server = EmbeddedRedis(rt, options=("--no-such-option", "1")).launch()
    booting(server, server.url)
    try:
        # a redis error (as any connection's), which names what went wrong
        with pytest.raises(redis.ConnectionError, match="exited at start"):
            connect(server.url).ping()
        with pytest.raises(redis.ConnectionError, match="stopped"):  # and every use after it
            connect(server.url).ping()
    finally:
        server.stop()


def test_public_names_are_pinned() -> None:
    assert sorted(nimbus.statestore.__all__) == sorted(
        [
            *("EmbeddedRedis", "Keys", "Link", "MIN_WAIT", "Opener", "Program", "Root"),
            *("SKIP_REPLY", "Script", "StateStore", "adopt", "connect", "connect_async"),
            *("current", "is_root", "keys", "later", "link", "lua", "open_local", "pack"),
            *("kept_presence", "preload", "presence"),
            *("probe", "program", "redacted", "redis_server_binary", "root", "scripts"),
            *("set_opener", "start_asked", "tls_options", "open_store"),
            *("join", "leave", "on_leave"),
        ]
    )
    assert all(hasattr(nimbus.statestore, name) for name in nimbus.statestore.__all__)


def _nimbus_imports(path: Path) -> set[str]:
    """The nimbus modules ``path`` imports (``from nimbus import x`` counts as nimbus.x)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "nimbus":
                found |= {f"nimbus.{alias.name}" for alias in node.names}
            elif node.module.startswith("nimbus."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("nimbus.")}
    return found


def test_the_state_store_stands_on_the_bottom_layer_only() -> None:
    below = (
        "nimbus.statestore",
        "nimbus.errors",
        "nimbus.config",
        "nimbus.telemetry",
        "nimbus._lazy",
        "nimbus._lockfile",
        "nimbus._joined",  # the program a warm worker's task joined (set by the runtime)
    )
    for path in sorted((PACKAGE / "statestore").glob("*.py")):
        upward = {name for name in _nimbus_imports(path) if not name.startswith(below)}
        assert not upward, f"statestore/{path.name} imports {upward}"


def test_messaging_and_the_service_reach_the_store_without_multiprocessing() -> None:
    paths = [*(PACKAGE / "messaging").glob("*.py"), *(PACKAGE / "service").glob("*.py")]
    for path in sorted(paths):
        found = {n for n in _nimbus_imports(path) if n.startswith("nimbus.multiprocessing")}
        assert not found, f"{path.relative_to(PACKAGE)} imports {found}"


def test_every_lua_script_is_listed_without_importing_multiprocessing() -> None:
    code = (
        "import sys\n"
        "from nimbus.statestore import lua, scripts\n"
        "assert 'nimbus.multiprocessing' not in sys.modules\n"
        "print(len(scripts()), len(lua.__all__))\n"
        "import nimbus.multiprocessing.connection, nimbus.multiprocessing.queues\n"
        "import nimbus.multiprocessing.sharedctypes, nimbus.multiprocessing.synchronize\n"
        "print(len(scripts()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=os.environ | {"PYTHONPATH": SRC},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    assert out[0] == out[1] == out[2]  # the modules that run them make no others


_FIRST_USE = """\
import glob, os, sys
import nimbus.multiprocessing as mp
from nimbus.config import Settings
from nimbus.statestore import program


def servers():
    return glob.glob(os.path.join(Settings.load().runtime_dir, "redis-*.json"))


def f(x):
    return x


def child():
    q = mp.Queue()  # the first use of the store, in a child: it starts the store
    q.put(7)
    assert q.get(timeout=30) == 7


if __name__ == "__main__":
    program()
    with mp.Pool(2) as pool:  # its queues are this host's pipes
        assert pool.map(f, range(8)) == list(range(8))
    print(len(servers()))
    p = mp.Process(target=child)
    p.start()
    p.join()
    print(p.exitcode, len(servers()))
    q = mp.Queue()  # the root finds the store the child started
    q.put(8)
    print(q.get(timeout=30))
"""


def test_a_programs_store_starts_at_its_first_use_by_any_of_its_processes(tmp_path: Path) -> None:
    script = tmp_path / "first_use.py"
    script.write_text(_FIRST_USE)
    env = os.environ | {"PYTHONPATH": SRC, "NIMBUS_RUNTIME_DIR": str(tmp_path / "run")}
    env.pop("NIMBUS_REDIS_URL", None)
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "0", "1", "8"]
    # the root is gone: the server a child started for it ends with it (by its watchdog)
    deadline = time.monotonic() + 5
    while _ours(str(tmp_path / "run")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _ours(str(tmp_path / "run"))


class _ForksAtLaunch(EmbeddedRedis):
    """Forks a long-lived child (a standby, a Process) as it launches, i.e. under the
    lock of the first connection: as a worker's main thread does while another of its
    threads (a Queue's feeder, messaging) makes the process's first connection."""

    standby = 0

    def launch(self, *, direct: bool = False, watch: int | None = None) -> EmbeddedRedis:
        self.standby = os.fork()
        if self.standby == 0:
            time.sleep(30)
            os._exit(0)
        return super().launch(direct=direct, watch=watch)


def test_the_first_connection_lock_is_not_held_by_a_child_forked_under_it(rt: Path) -> None:
    """review6 #2: the lock was an flock, which a child forked under it keeps held for
    as long as it lives: the root's stop() at exit (and every other first connection)
    waited for it with no timeout."""
    server = _ForksAtLaunch(rt).defer()
    read, write = os.pipe()
    worker = os.fork()
    if worker == 0:  # a process of the program (not its root) that uses the store first
        code = 1
        try:
            code = 0 if server.serve() is False else 3
            os.write(write, b"%d" % server.standby)
        finally:
            os._exit(code)
    os.close(write)
    standby = int(os.read(read, 100) or 0)
    os.close(read)
    try:
        assert os.waitstatus_to_exitcode(os.waitpid(worker, 0)[1]) == 0
        assert standby and psutil.pid_exists(standby)
        stopping = threading.Thread(target=server.stop)  # the root at its exit
        stopping.start()
        stopping.join(5)
        assert not stopping.is_alive(), "stop() waits for the lock a forked child holds"
    finally:
        if standby:
            os.kill(standby, signal.SIGKILL)  # (not our child: W's, reaped by init)
            assert _gone(standby, 5)
        server.stop()


def test_a_lock_held_for_ever_is_an_error_naming_it_and_stop_skips_it(
    rt: Path, hold_lock: Callable[[Path], LockHolder]
) -> None:
    server = EmbeddedRedis(rt, start_timeout=0.5).defer()
    lock = rt / f".{server.name}.lock"
    holder = hold_lock(lock)  # a stuck process of the program
    try:
        start = time.monotonic()
        with pytest.raises(StateStoreError, match=f"{lock}.*remove that file"):
            server.serve()
        server._stop_theirs()  # skips it after about 2 s
        assert time.monotonic() - start < 5
    finally:
        holder.let_go()
        server.stop()


def test_stop_with_the_runtime_directory_removed_removes_the_rest(rt: Path) -> None:
    """Review 7 #9: a deferred store's stop() after its runtime directory was removed
    (a tmpfiles cleaner, logout) raised FileNotFoundError from the lock file and left
    the rest of stop() (its fallback socket directory, say) undone."""
    server = EmbeddedRedis(rt).defer()
    fallback = Path(tempfile.mkdtemp(prefix="nimbus-", dir="/tmp"))
    server._fallback_dir = fallback  # (as when the socket's path is too long)
    shutil.rmtree(rt)
    try:
        server.stop()
        assert not fallback.exists()
    finally:
        shutil.rmtree(fallback, ignore_errors=True)
        rt.mkdir(mode=0o700)


def test_a_store_that_died_is_an_error_at_once_naming_it(rt: Path) -> None:
    """review6 #2 (related): another process of the program started the store and it
    died (SIGKILL); a first connection here failed after start_timeout with a bare
    FileNotFoundError. Now at once, with what happened and what to do."""
    from nimbus.statestore._connect import booting, forget

    server = EmbeddedRedis(rt, start_timeout=10).defer()
    booting(server, server.url)
    try:
        child = os.fork()
        if child == 0:  # a process of the program that uses the store first
            code = 1
            try:
                code = 0 if connect(server.url).ping() else 3
            finally:
                os._exit(code)
        assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
        watchdog = json.loads(server.state_file.read_text())["watchdog"][0]
        for proc in psutil.Process(watchdog).children():
            proc.kill()  # the server (its watchdog then ends)
        assert _gone(watchdog, 5)
        start = time.monotonic()
        with pytest.raises(redis.ConnectionError, match=f"state store .*{rt}.* died"):
            connect(server.url).ping()
        assert time.monotonic() - start < 3
    finally:
        forget(server.url)
        server.stop()


def test_lock_files_and_sockets_with_no_state_file_are_swept_once_old(rt: Path) -> None:
    old = time.time() - 120
    for name in (".redis-0ld00000.lock", "redis-0ld00001.sock"):
        (rt / name).touch()
        os.utime(rt / name, (old, old))
    (rt / ".redis-n3w00000.lock").touch()  # being made now: its state file comes next
    (rt / ".redis-l1ve0000.lock").touch()
    os.utime(rt / ".redis-l1ve0000.lock", (old, old))
    (rt / "redis-l1ve0000.json").write_text("{}")  # (unreadable state: left alone)
    server = EmbeddedRedis(rt).defer()
    nimbus.statestore._chores.run_now()  # (the sweep runs off the first start: at once here)
    left = sorted(p.name for p in rt.iterdir())
    assert left == [".redis-l1ve0000.lock", ".redis-n3w00000.lock", "redis-l1ve0000.json"]
    server.stop()
    for name in left:
        (rt / name).unlink()


def _keepalive(sock: Any) -> tuple[int, ...]:
    import socket

    return (
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
    )


@pytest.mark.skipif(sys.platform != "linux", reason="TCP_KEEPIDLE and friends: Linux")
def test_every_network_client_has_tcp_keepalive(rt: Path) -> None:
    """review6 #6: with no read timeout, a command on a connection whose peer vanished
    without a reset (a NAT that dropped the flow) waited for ever; keepalive ends it."""
    import asyncio

    from nimbus.statestore import connect_async
    from nimbus.statestore._connect import forget
    from service_support import free_port

    port = free_port()
    with EmbeddedRedis(rt, tcp=("127.0.0.1", port), password="pw") as server:
        url = f"redis://default:pw@127.0.0.1:{port}/0"
        shared = connect(url)
        assert shared.ping()
        (conn,) = shared.connection_pool._available_connections
        assert _keepalive(conn._sock) == (1, 15, 5, 3)
        with connect(url, own=True, single=True) as own:
            assert own.ping()
            assert _keepalive(own.connection._sock) == (1, 15, 5, 3)
        forget(url)

        async def asynchronous() -> tuple[int, ...]:
            client = connect_async(url)
            try:
                await client.ping()
                (conn,) = client.connection_pool._available_connections
                return _keepalive(conn._writer.get_extra_info("socket"))
            finally:
                await client.aclose()

        assert asyncio.run(asynchronous()) == (1, 15, 5, 3)
        unix = connect(server.url, own=True, single=True, password="pw")  # (no keepalive)
        with unix:
            assert unix.ping()


# ---------------------------------------------------------------- chores (off the first start)


def test_chores_run_later_on_their_thread_or_at_once_when_asked(tmp_path: Path) -> None:
    """``later(fn)`` does not run ``fn`` now; its thread runs it after CHORES_AFTER s, or
    at once when ``run_now`` (the exit handler) asks; a fork runs none of them."""
    code = textwrap.dedent(
        """
        import os, sys, threading, time
        from nimbus.statestore import _chores, later
        ran = []
        t0 = time.monotonic()
        later(lambda: ran.append(("a", threading.current_thread().name, time.monotonic())))
        assert ran == []
        deadline = time.monotonic() + 10
        while not ran and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ran and ran[0][1] == "nimbus-chores", ran
        assert ran[0][2] - t0 >= _chores.CHORES_AFTER * 0.9, ran  # not at once
        later(lambda: ran.append("b"))
        pid = os.fork()
        if pid == 0:  # the child's copy of the chore never runs
            later(lambda: ran.append("child"))
            _chores.run_now()
            os._exit(0 if ran[1:] == ["child"] else 3)
        assert os.waitpid(pid, 0)[1] == 0
        t1 = time.monotonic()
        _chores.run_now()  # (the exit handler): at once
        assert ran[1:] == ["b"] and time.monotonic() - t1 < _chores.CHORES_AFTER / 2, ran
        later(lambda: os.write(1, b"at exit\\n"))
        os.write(1, b"end\\n")
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["at exit", "end"]  # ran before the exit
