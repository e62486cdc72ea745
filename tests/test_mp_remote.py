"""nimbus.multiprocessing on a remote endpoint: a real service, a real endpoint agent, and
programs run with NIMBUS_ENDPOINT set (each in its own interpreter, as a user runs them)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import redis

from nimbus import Client
from nimbus.backends.service import ServiceBackend, probe_store
from nimbus.config import Settings
from nimbus.errors import (
    ConfigError,
    NotFound,
    ServiceError,
    ServiceUnavailable,
    StateStoreError,
)
from nimbus.multiprocessing._remote import CHECK, KILL_AFTER, deliver_signals
from nimbus.statestore import Keys, Program, connect
from service_support import EndpointProcess, Service, free_port, process_tree, service_env

# Where a process runs: the pids of its ancestors, which include the endpoint agent's
# when it runs there. Shared by the programs below.
PRELUDE = r"""
import os, sys, time
import psutil
import nimbus.multiprocessing as mp

def ancestors(_=None):
    return [p.pid for p in psutil.Process().parents()]

def say(name, *values):  # one write per line: children write to the same stdout
    sys.stdout.write(f"{name}: {' '.join(map(str, values))}\n")
    sys.stdout.flush()
"""


def _env(service: Service, client: Client, endpoint: str = "lab") -> dict[str, str]:
    return service.env | {
        "NIMBUS_SERVICE_URL": service.url,
        "NIMBUS_TOKEN": client.token,
        "NIMBUS_ENDPOINT": endpoint,
        "NIMBUS_WORKERS": "7",  # this machine's; the endpoint has 2
    }


def _run(
    tmp_path: Path, env: dict[str, str], body: str, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "program.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _lines(out: str) -> dict[str, str]:
    """``name: value`` lines a program printed."""
    return dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)


def _on_lab(
    tmp_path: Path, service: Service, client: Client, body: str
) -> tuple[dict[str, str], subprocess.CompletedProcess[str]]:
    """Run a program with NIMBUS_ENDPOINT=lab; the lines it printed, and how it ended."""
    result = _run(tmp_path, _env(service, client), body)
    assert result.returncode == 0, result.stderr
    return _lines(result.stdout), result


def test_pool_map_runs_on_the_endpoint(
    tmp_path: Path, service: Service, alice: Client, lab: EndpointProcess
) -> None:
    program = """
        def square(x):
            return x * x

        if __name__ == "__main__":
            with mp.Pool(4) as pool:
                say("sum", sum(pool.map(square, range(64))))
                say("where", pool.map(ancestors, range(4), chunksize=1))
                say("mine", os.getpid())
            say("cpus", mp.cpu_count())
        """
    out, _ = _on_lab(tmp_path, service, alice, program)
    assert out["sum"] == str(sum(i * i for i in range(64)))
    assert out["cpus"] == "2"  # the endpoint's workers
    assert lab.proc is not None
    for chain in eval(out["where"]):  # every pool process descends from the endpoint agent
        assert lab.proc.pid in chain and int(out["mine"]) not in chain


def test_a_pools_tasks_share_the_users_store_on_the_endpoint(
    tmp_path: Path, service: Service, alice: Client, lab: EndpointProcess
) -> None:
    """``nimbus.data.store()`` in a Pool's processes on lab: the user's keys there, seen
    by the next program's processes too."""
    program = """
        import nimbus.data

        def put(i):
            nimbus.data.store().set(f"part-{i}", i * i, ttl=60)
            return repr(nimbus.data.store())

        def take(i):
            return nimbus.data.store().get(f"part-{i}")

        if __name__ == "__main__":
            with mp.Pool(2) as pool:
                say("where", set(pool.map(put, range(8))))
        """
    out, _ = _on_lab(tmp_path, service, alice, program)
    (where,) = eval(out["where"])  # one store, whichever process and worker
    assert where.endswith(f" on endpoint {lab.endpoint_id}>")
    program = program.replace(
        'say("where", set(pool.map(put, range(8))))', 'say("got", pool.map(take, range(8)))'
    )
    out, _ = _on_lab(tmp_path, service, alice, program)
    assert eval(out["got"]) == [i * i for i in range(8)]


def test_process_queue_lock_output_and_exitcodes(
    tmp_path: Path, service: Service, alice: Client, lab: EndpointProcess
) -> None:
    program = """
        def child(q, lock):
            q.put(("blocked", lock.acquire(timeout=0.2)))  # the parent holds it
            q.put(("where", ancestors()))
            q.put(("locked", lock.acquire(timeout=60)))  # after the parent released it
            lock.release()
            say("child stdout", "a line")
            sys.stderr.write("child stderr line\\n")

        def grandchild(q):
            q.put(("grandchild", ancestors()))

        def starts_a_child(q):
            g = mp.Process(target=grandchild, args=(q,))
            g.start()
            g.join(60)
            q.put(("grandchild exitcode", g.exitcode))

        def boom():
            raise KeyError("remote boom")

        def sleeper():
            time.sleep(120)

        if __name__ == "__main__":
            q, lock = mp.Queue(), mp.Lock()
            lock.acquire()
            p = mp.Process(target=child, args=(q, lock))
            p.start()
            say("blocked", q.get(timeout=60))
            say("where", q.get(timeout=60))
            lock.release()
            say("locked", q.get(timeout=60))
            p.join(60)
            say("child exitcode", p.exitcode, p.pid > 0)
            n = mp.Process(target=starts_a_child, args=(q,))
            n.start()
            say("grandchild", q.get(timeout=60)[1])
            say("grandchild exitcode", q.get(timeout=60)[1])
            n.join(60)
            say("nested exitcode", n.exitcode)
            b = mp.Process(target=boom)
            b.start()
            b.join(60)
            say("boom exitcode", b.exitcode)
            for how in ("terminate", "kill"):
                s = mp.Process(target=sleeper)
                s.start()
                say(how + " alive", s.is_alive())
                getattr(s, how)()
                s.join(60)
                say(how + " exitcode", s.exitcode)
        """
    out, result = _on_lab(tmp_path, service, alice, program)
    assert out["blocked"] == "('blocked', False)"
    assert out["locked"] == "('locked', True)"
    assert lab.proc is not None and str(lab.proc.pid) in out["where"]
    assert out["child exitcode"] == "0 True"
    # the child's output came through the store, before its join returned
    assert out["child stdout"] == "a line"
    assert result.stdout.index("child stdout") < result.stdout.index("child exitcode")
    assert "child stderr line" in result.stderr
    # children start children (through the service again), on the endpoint too
    assert str(lab.proc.pid) in out["grandchild"]
    assert out["grandchild exitcode"] == "0" and out["nested exitcode"] == "0"
    # an uncaught exception: traceback on the parent's stderr, exitcode 1 (as the stdlib)
    assert out["boom exitcode"] == "1"
    assert "Traceback" in result.stderr and "KeyError: 'remote boom'" in result.stderr
    assert out["terminate alive"] == "True" and out["terminate exitcode"] == "-15"
    assert out["kill alive"] == "True" and out["kill exitcode"] == "-9"


def test_childrens_lines_reach_the_parent_whole(
    tmp_path: Path, service: Service, alice: Client, lab: EndpointProcess
) -> None:
    """Two children write long lines at once, each in two writes (as a C library's or a
    subprocess's stdout on a pipe goes in blocks that end inside lines): each line
    reaches the parent's stdout whole, never with the other's output in its middle; and
    a line without its end (a prompt) still arrives while the child runs."""
    program = """
        def talk(ch, go):  # each line in two writes, as a C program's blocks end inside one
            go.wait(60)
            half = (ch * 1500).encode()
            for i in range(40):
                os.write(1, half)
                time.sleep(0.005)
                os.write(1, half + b"\\n")

        def prompt(q):
            sys.stdout.write("ready? ")
            sys.stdout.flush()
            q.get(timeout=60)

        if __name__ == "__main__":
            go = mp.Event()
            kids = [mp.Process(target=talk, args=(ch, go)) for ch in "ab"]
            for p in kids:
                p.start()
            go.set()
            for p in kids:
                p.join(60)
            q = mp.Queue()
            p = mp.Process(target=prompt, args=(q,))
            p.start()
            time.sleep(1)  # its prompt is on the parent's stdout before the child ends
            sys.stdout.flush()
            say("prompted", "yes")
            q.put(1)
            p.join(60)
        """
    _, result = _on_lab(tmp_path, service, alice, program)
    lines = result.stdout.splitlines()
    long_lines = [line for line in lines if len(line) >= 3000]
    assert len(long_lines) == 80, [len(x) for x in lines][:20]
    assert all(line in ("a" * 3000, "b" * 3000) for line in long_lines)
    assert "ready? prompted: yes" in result.stdout, result.stdout[-200:]


def test_store_is_per_user_and_never_the_admin(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    with service.client(service.token("bob")) as bob:
        with pytest.raises(NotFound):  # bob cannot see alice's endpoint, nor get its store
            bob.store(lab.endpoint_id)
        alice.share_endpoint(lab.endpoint_id, ["bob"])
        mine, theirs = alice.store("lab"), bob.store(lab.endpoint_id)
    assert mine["online"] and mine["url"] != theirs["url"]
    assert mine["url"].startswith("redis://nimbus-u-")  # an ACL user, not 'default'
    key = Keys(f"{mine['key_prefix']}.p1").queue("q")
    with (
        redis.Redis.from_url(mine["url"]) as a,
        redis.Redis.from_url(theirs["url"]) as b,
    ):
        a.rpush(key, b"secret")
        with pytest.raises(redis.exceptions.NoPermissionError):
            b.lrange(key, 0, -1)
        with pytest.raises(redis.exceptions.NoPermissionError):
            a.config_get("requirepass")
        a.delete(key)


def _sleeper(tmp_path: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """A program whose one child sleeps 300 s while it joins it (up to 120 s), printing
    the child's pid first and its exit code last."""
    script = tmp_path / "program.py"
    script.write_text(
        PRELUDE
        + textwrap.dedent(
            """
            if __name__ == "__main__":
                p = mp.Process(target=time.sleep, args=(300,))
                p.start()
                say("pid", p.pid)
                p.join(120)
                say("exitcode", p.exitcode)
            """
        )
    )
    return subprocess.Popen(
        [sys.executable, str(script)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_lost_endpoint_ends_its_processes_with_sigkill(
    tmp_path: Path, service: Service, alice: Client
) -> None:
    flaky = EndpointProcess(service, alice, "flaky").start(alice)
    with _sleeper(tmp_path, _env(service, alice, "flaky")) as proc:
        assert proc.stdout is not None
        pid = int(proc.stdout.readline().split(": ")[1])
        flaky.kill()  # the agent, its workers and (through them) the process
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert _lines(out)["exitcode"] == "-9"  # not a hang: the parent saw its worker go
    assert "endpoint worker of process" in err and "was lost" in err
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_lost_store_ends_a_waiting_join_with_a_clear_error(
    tmp_path: Path, service: Service
) -> None:
    from nimbus.service.registry import Registry, hash_token

    token = service.token("sam")
    with service.client(token) as sam:
        lab = EndpointProcess(service, sam, "sam-lab").start(sam)
        try:
            with _sleeper(tmp_path, _env(service, sam, "sam-lab")) as proc:
                assert proc.stdout is not None
                line = proc.stdout.readline()
                assert line.startswith("pid: ")
                child = int(line.split(": ")[1])
                # revoking sam's own token deletes sam's store user: the program's store is gone
                registry = Registry(service.settings().registry_url)
                try:
                    registry.revoke(hash_token(token)[:12])
                finally:
                    registry.close()
                out, err = proc.communicate(timeout=120)
                # nor does the process go on, with nowhere to report: its worker ends it
                deadline = time.monotonic() + 30  # STORE_GRACE, SIGTERM
                while not _gone(child):
                    assert time.monotonic() < deadline, "the process outlived its store"
                    time.sleep(0.05)
        finally:
            lab.stop()
    assert _lines(out)["exitcode"] == "1"  # not a hang: join returned within the grace
    assert "lost the program's state store at redis://" in err and "exit code 1" in err
    assert "@" not in err.split("state store at ")[1].split()[0]  # the URL without its password


def test_token_stays_home_on_a_shared_endpoint(
    tmp_path: Path, service: Service, alice: Client, lab: EndpointProcess
) -> None:
    program = """
        def token(q):
            q.put(os.environ.get("NIMBUS_TOKEN"))

        if __name__ == "__main__":
            q = mp.Queue()
            mp.Process(target=token, args=(q,)).start()
            say("token", q.get(timeout=60))
        """
    out, _ = _on_lab(tmp_path, service, alice, program)
    assert out["token"] == alice.token  # alice's own endpoint: the environment as is
    dave_token = service.token("dave")
    alice.share_endpoint(lab.endpoint_id, ["dave"])
    with service.client(dave_token) as dave:
        env = _env(service, dave, lab.endpoint_id)
        result = _run(tmp_path, env, program)
    assert result.returncode == 0, result.stderr
    assert _lines(result.stdout)["token"] == "None"


def test_clear_errors(
    tmp_path: Path, service: Service, alice: Client, lab: EndpointProcess
) -> None:
    env = _env(service, alice)
    with pytest.raises(NotFound, match="nimbus endpoints list"):
        ServiceBackend.open_store(Settings.load(env | {"NIMBUS_ENDPOINT": "nosuch"}))
    alice.register_endpoint("dark")  # registered, never started
    with pytest.raises(ServiceUnavailable, match="nimbus endpoint start dark"):
        ServiceBackend.open_store(Settings.load(env | {"NIMBUS_ENDPOINT": "dark"}))
    no_login = {k: v for k, v in env.items() if k not in ("NIMBUS_SERVICE_URL", "NIMBUS_TOKEN")}
    no_login["XDG_CONFIG_HOME"] = str(tmp_path / "nothing")
    with pytest.raises(ConfigError, match=r"NIMBUS_ENDPOINT=lab .*`nimbus login"):
        ServiceBackend.open_store(Settings.load(no_login))
    closed = f"redis://u:p@127.0.0.1:{free_port()}/0"
    with pytest.raises(StateStoreError, match="NIMBUS_STORE_LISTEN") as info:
        probe_store(closed, "lab")
    assert ":p@" not in str(info.value)  # the password is not printed
    # what a user program sees: the error, not a hang
    result = _run(
        tmp_path, env | {"NIMBUS_ENDPOINT": "dark"}, "mp.Process(target=print).start()\n", 60
    )
    assert result.returncode == 1 and "endpoint 'dark' is offline" in result.stderr


def test_service_that_cannot_listen_for_stores_says_so(tmp_path: Path) -> None:
    # told to listen on an address that is not this machine's: 503, naming the setting
    svc = Service(tmp_path, service_env(tmp_path, NIMBUS_STORE_LISTEN="192.0.2.1:0")).start()
    try:
        with svc.client(svc.token("carol")) as carol:
            carol.register_endpoint("far")
            with pytest.raises(ServiceError, match="NIMBUS_STORE_LISTEN") as info:
                carol.store("far")
        assert info.value.status == 503
    finally:
        svc.stop()


# ---------------------------------------------------------------- the store's ACL

REFUSED = [
    ("EVAL", "return 1", 0),
    ("EVALSHA", "0" * 40, 0),  # a script nimbus does not have
    ("SCRIPT", "LOAD", "return 1"),
    ("SCRIPT", "FLUSH"),
    ("SCRIPT", "KILL"),
    ("SCRIPT", "EXISTS", "0" * 40),
    ("PUBSUB", "CHANNELS"),
    ("PUBLISH", "nimbus:{x}", "hi"),
    ("RANDOMKEY",),
    ("DBSIZE",),
    ("MEMORY", "STATS"),
    ("MEMORY", "USAGE", "k"),
    ("OBJECT", "ENCODING", "k"),
    ("KEYS", "*"),
    ("FLUSHALL",),
    ("FLUSHDB",),
    ("CONFIG", "GET", "maxmemory"),
    ("CONFIG", "SET", "maxmemory", "0"),
    ("DEBUG", "SLEEP", "0"),
    ("INFO",),
    ("TIME",),
    ("SLOWLOG", "GET"),
    ("LATENCY", "LATEST"),
    ("CLIENT", "KILL", "ID", "1"),
    ("CLIENT", "PAUSE", "10"),
    ("ACL", "LIST"),
    ("SWAPDB", "0", "1"),
    ("SELECT", "1"),
    ("WAIT", "0", "0"),
    ("BGSAVE",),
    ("SORT", "k"),
]
# a script that keeps the (single-threaded) store busy for 3 s
BUSY_LOOP = (
    "local t = tonumber(redis.call('TIME')[1]) "
    "while tonumber(redis.call('TIME')[1]) - t < 3 do redis.call('GET', KEYS[1]) end "
    "return 1"
)


def test_store_users_run_nimbus_commands_only(
    service: Service, alice: Client, lab: EndpointProcess
) -> None:
    import threading
    import time

    from nimbus.multiprocessing import connection

    mine = alice.store("lab")
    with service.client(service.token("erin")) as erin:
        erin.register_endpoint("erin-lab")
        theirs = erin.store("erin-lab")
    key = Keys(f"{mine['key_prefix']}.p1").queue("q")
    with (
        redis.Redis.from_url(mine["url"]) as a,
        redis.Redis.from_url(theirs["url"], socket_timeout=10) as b,
    ):
        # a script of one's own, looping on one's own key, would stall every user's store
        stalled: list[float] = []

        def other_user() -> None:
            time.sleep(0.3)
            start = time.monotonic()
            b.ping()
            stalled.append(time.monotonic() - start)

        other = threading.Thread(target=other_user)
        other.start()
        with pytest.raises(redis.exceptions.NoPermissionError):
            a.eval(BUSY_LOOP, 1, key)
        other.join(15)
        assert stalled and stalled[0] < 1.0
        for command in REFUSED:
            with pytest.raises(redis.exceptions.NoPermissionError):
                a.execute_command(*command)
        # nimbus's own scripts: by their SHA1, on one's own keys only
        script = connection._RELEASE  # a Pipe end's release
        assert a.evalsha(script.sha, 2, key, key, "0", 1000) == -1
        with pytest.raises(redis.exceptions.NoPermissionError):
            b.evalsha(script.sha, 2, key, key, "0", 1000)  # alice's key
        a.rpush(key, b"x")
        assert a.lpop(key) == b"x"


def test_store_limits(tmp_path: Path) -> None:
    from nimbus.service.stores import LUA_TIME_LIMIT_MS, StoreServer

    server = StoreServer(Settings(runtime_dir=tmp_path / "rt", store_maxmemory=16 << 20))
    try:
        config = server._admin.config_get("*")  # str keys and values
        assert config["maxmemory"] == str(16 << 20)
        assert config["maxmemory-policy"] == "noeviction"
        assert config["lua-time-limit"] == str(LUA_TIME_LIMIT_MS)
        keys = Keys("u-fay.p1")
        with redis.Redis.from_url(server.store("fay", "127.0.0.1")["url"]) as fay:
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                for i in range(64):  # 32 MiB into 16: refused once full
                    fay.set(keys.queue(str(i)), b"m" * (512 << 10))
            assert fay.exists(keys.queue("0"))  # nothing evicted
            assert fay.delete(*[keys.queue(str(i)) for i in range(64)]) > 0
            fay.set(keys.queue("0"), b"fits again")
    finally:
        server.close()


def test_a_whole_program_runs_under_the_store_acl(
    tmp_path: Path, service: Service, alice: Client, lab: EndpointProcess
) -> None:
    """Queues, locks, conditions, events, barriers, pipes, values, arrays, a manager and
    a pool, each used across processes on the endpoint, through the user's ACL user."""
    program = """
        def work(q, jq, lock, rlock, sem, cond, event, barrier, conn, value, arr, shared, done):
            with lock:
                with rlock:
                    with rlock:
                        value.value += 1
            with sem:
                arr[0] += 1
            barrier.wait(60)
            event.wait(60)
            with cond:
                cond.wait_for(lambda: done.value, 60)
            q.put(conn.recv())
            jq.put("job")
            shared["child"] = os.getpid()
            conn.send(("got", value.value))
            conn.close()

        def square(x):
            return x * x

        if __name__ == "__main__":
            q, jq, sq = mp.Queue(), mp.JoinableQueue(2), mp.SimpleQueue()
            lock, rlock, sem = mp.Lock(), mp.RLock(), mp.BoundedSemaphore(1)
            cond, event, barrier = mp.Condition(), mp.Event(), mp.Barrier(2)
            parent, child = mp.Pipe()
            value, arr = mp.Value("i", 0), mp.Array("d", [0.0, 1.5])
            raw = mp.RawValue("q", 7)
            done = mp.Value("b", 0)
            with mp.Manager() as manager:
                shared = manager.dict()
                p = mp.Process(
                    target=work,
                    args=(q, jq, lock, rlock, sem, cond, event, barrier, child, value, arr,
                          shared, done),
                )
                p.start()
                barrier.wait(60)
                event.set()
                with cond:
                    done.value = 1
                    cond.notify_all()
                parent.send("ping")
                say("queue", q.get(timeout=60))
                say("joinable", jq.get(timeout=60))
                jq.task_done()
                jq.join()
                say("pipe", parent.recv())
                p.join(60)
                say("exitcode", p.exitcode)
                say("manager", shared["child"] == p.pid)
            sq.put("simple")
            say("simple", sq.get())
            say("value", value.value, arr[0], arr[1], raw.value)
            with mp.Pool(2) as pool:
                say("pool", sum(pool.map(square, range(20))), pool.apply_async(square, (9,)).get(60))
        """
    out, result = _on_lab(tmp_path, service, alice, program)
    assert out["queue"] == "ping", result.stderr
    assert out["joinable"] == "job"
    assert out["pipe"] == "('got', 1)"
    assert out["exitcode"] == "0"
    assert out["manager"] == "True"
    assert out["simple"] == "simple"
    assert out["value"] == "1 1.0 1.5 7"
    assert out["pool"] == f"{sum(i * i for i in range(20))} 81"


def test_a_dead_store_comes_back_empty_and_old_urls_stop_working(tmp_path: Path) -> None:
    import os
    import signal
    import time

    from nimbus.multiprocessing import connection
    from nimbus.service.stores import StoreServer

    server = StoreServer(Settings(runtime_dir=tmp_path / "rt"))
    try:
        old = server.store("gus", "127.0.0.1")["url"]
        key = Keys("u-gus.p1").queue("q")
        with redis.Redis.from_url(old) as gus:
            gus.rpush(key, b"x")
        os.kill(server._server.server_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while server._server.alive():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        new = server.store("gus", "127.0.0.1")["url"]  # started again on this call
        assert new != old and new.rsplit("@", 1)[1] == old.rsplit("@", 1)[1]
        with redis.Redis.from_url(old) as stale, pytest.raises(redis.AuthenticationError):
            stale.ping()  # a program of before fails clearly, not on an empty store
        with redis.Redis.from_url(new) as gus:
            assert gus.llen(key) == 0
            assert gus.evalsha(connection._RELEASE.sha, 2, key, key, "0", 1000) == -1
            with pytest.raises(redis.exceptions.NoPermissionError):
                gus.eval("return 1", 0)
    finally:
        server.close()


# ---------------------------------------------------------------- a parent killed

# a Pool (daemonic processes, waiting for jobs) and a Process (not daemonic) with a child of
# its own, all sleeping on the endpoint: their pids first
ORPHANED = """
    def nested(q):
        g = mp.Process(target=time.sleep, args=(300,))
        g.start()
        q.put(g.pid)
        g.join()

    if __name__ == "__main__":
        q = mp.Queue()
        n = mp.Process(target=nested, args=(q,))
        n.start()
        with mp.Pool(2) as pool:
            say("pids", [p.pid for p in pool._pool] + [n.pid, q.get(timeout=60)])
            pool.map(time.sleep, [300] * 4, chunksize=1)
    """


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _killed_parent(
    tmp_path: Path,
    env: dict[str, str],
    command: list[str],
    sig: int,
    lab: EndpointProcess,
    within: float,
) -> tuple[float, int]:
    """Run ``ORPHANED`` by ``command``, send its parent ``sig`` once its four processes run
    on the endpoint: the seconds until they are all gone (at most ``within``), and how many
    of them the endpoint's workers ended for their parent's lapse (its agent's log says;
    not those its Pool started again as the others ended, in the moment before its end)."""
    script = tmp_path / "program.py"
    script.write_text(PRELUDE + textwrap.dedent(ORPHANED))
    before = len(lab.log.read_text())
    pids: list[int] = []
    proc = subprocess.Popen(
        [*command, str(script)], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("pids: "), proc.communicate(timeout=60)
        pids = eval(line.split(": ", 1)[1])
        assert lab.proc is not None
        agent = process_tree(lab.proc.pid)
        assert len(pids) == 4 and all(pid in agent and not _gone(pid) for pid in pids)
        proc.send_signal(sig)
        start = time.monotonic()
        assert proc.wait(30) == -sig
        while not all(_gone(pid) for pid in pids):
            assert time.monotonic() - start < within, [p for p in pids if not _gone(p)]
            time.sleep(0.02)
        took = time.monotonic() - start
        time.sleep(1.5)  # (a worker's note of a lapse reaches the log)
        log = lab.log.read_text()[before:]
        print(pids, *(line for line in log.splitlines() if "ending process" in line), sep="\n")
        return took, sum(f"(pid {pid}): its parent is gone" in log for pid in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.communicate()
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()


def test_sigterm_to_nimbus_run_ends_its_processes_on_the_endpoint(
    tmp_path: Path, service: Service, alice: Client, lab: EndpointProcess
) -> None:
    """Stranger 7 F2: `nimbus run --endpoint lab` ended by SIGTERM (`kill PID`, `timeout`, a
    batch scheduler) passes it on to its processes there, as a Ctrl-C, and ends by it."""
    env = {k: v for k, v in _env(service, alice).items() if k != "NIMBUS_ENDPOINT"}
    command = [sys.executable, "-m", "nimbus", "run", "--endpoint", "lab"]
    took, lapsed = _killed_parent(tmp_path, env, command, signal.SIGTERM, lab, within=5)
    print(f"SIGTERM: the remote processes ended {took:.2f} s after the signal")
    assert lapsed == 0  # each ended by the SIGTERM passed on, none for its parent's lapse


def test_sigkilled_parent_ends_its_processes_on_the_endpoint(
    tmp_path: Path, service: Service, alice: Client, lab: EndpointProcess
) -> None:
    """Stranger 7 F2: a parent killed outright runs nothing: the endpoint's workers see its
    presence gone and end its processes, daemonic or not (their output and exit codes have
    nowhere to go), and theirs after them (the nested one passes the SIGTERM on)."""
    env, command = _env(service, alice), [sys.executable]
    took, lapsed = _killed_parent(tmp_path, env, command, signal.SIGKILL, lab, within=10)
    print(f"SIGKILL: the remote processes ended {took:.2f} s after the signal")
    assert lapsed == 3  # the Pool's two and the Process; its child by the SIGTERM passed on


_PRESENT_PARENT = """
import sys, time
from nimbus.statestore import kept_presence
print(*kept_presence(sys.argv[1]), flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(60)
def test_a_childs_watcher_ends_it_for_its_parents_death_not_for_a_dropped_connection(
    program: Program,
) -> None:
    """Review 7 #4: the store may close the parent's presence connection while the
    parent lives (an idle timeout, a failover, CLIENT KILL): the parent makes it again
    under its name, and the watcher of its child on the endpoint, finding that name,
    lets the child run. The parent's death still ends it (SIGTERM), within moments."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _PRESENT_PARENT, program.url], stdout=subprocess.PIPE, text=True
    )
    child = subprocess.Popen(["sleep", "120"])
    try:
        assert parent.stdout is not None
        client_id, name = parent.stdout.readline().split()
        watcher = connect(program.url, own=True, single=True)
        deliver_signals(watcher, program, Keys.new_name(), lambda: child.poll() is None,
                        child.send_signal, (int(client_id), name), child.pid)  # fmt: skip
        store = program.client()
        for _ in range(2):  # dropped twice: made again twice
            store.execute_command("CLIENT", "KILL", "ID", client_id)
            time.sleep(2.5 * CHECK)  # the watcher looked at least twice meanwhile
            assert child.poll() is None
            lines = store.execute_command("CLIENT", "LIST", "TYPE", "normal").decode()
            again = [ln.split()[0].removeprefix("id=") for ln in lines.splitlines()
                     if f" name={name} " in ln]  # fmt: skip
            assert len(again) == 1 and again[0] != client_id  # the same name, a new id
            client_id = again[0]
        parent.kill()
        parent.wait(10)
        start = time.monotonic()
        assert child.wait(3 * CHECK + KILL_AFTER + 5) == -signal.SIGTERM
        print(f"the child ended {time.monotonic() - start:.2f} s after its parent")
    finally:
        for proc in (parent, child):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if parent.stdout is not None:
            parent.stdout.close()
