"""nimbus.multiprocessing.Process: real processes forked by warm workers."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import selectors
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import nimbus.multiprocessing as mp
import nimbus.multiprocessing.connection as nconn

# -- targets (module level: children find them by reference) ----------------


def _noop() -> None:
    pass


def _raise() -> None:
    raise ValueError("kaboom-from-child")


def _exit7() -> None:
    sys.exit(7)


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _exit_with(code: int) -> None:
    sys.exit(code)


def _count_fds(q: mp.Queue) -> None:
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            fds[fd] = "?"
    q.put((len(fds), sorted(fds.items(), key=lambda kv: int(kv[0]))))


def _report_identity(q: mp.Queue) -> None:
    parent = mp.parent_process()
    q.put((mp.current_process().name, parent.pid if parent else None, os.getpid()))


def _start_grandchild(q: mp.Queue) -> None:
    inner = mp.Queue()
    p = mp.Process(target=_report_identity, args=(inner,), name="grandchild")
    p.start()
    result = inner.get(timeout=30)
    p.join(30)
    q.put((result, p.exitcode, os.getpid()))


def _relayed_starts(q: mp.Queue, relay: str | None) -> None:
    from nimbus.multiprocessing import _local, popen_nimbus

    if relay is not None:
        _local.set_relay_address(relay)
    sleeper = mp.Process(target=_sleep, args=(60,))
    sleeper.start()
    sleeper.terminate()
    sleeper.join(30)
    failing = mp.Process(target=_exit7)
    failing.start()
    failing.join(30)
    q.put((type(popen_nimbus.site()).__name__, sleeper.exitcode, failing.exitcode))


def _report_start_state(q: mp.Queue) -> None:
    q.put((os.environ.get("NIMBUS_TEST_STANDBY"), os.getcwd()))


def _timestamps(q: mp.Queue, seconds: float) -> None:
    start = time.monotonic()
    time.sleep(seconds)
    q.put((start, time.monotonic()))


def _print_then_wait(event: mp.Event) -> None:
    print("hello-from-child-stdout", flush=True)
    event.wait(30)


def _lock_state(lock: Any, rlock: Any, q: Any) -> None:
    q.put((lock.locked(), rlock.acquire(blocking=False)))


def _takes_lock(lock: object) -> None:
    pass


class _RunOverride(mp.Process):
    def __init__(self, q: mp.Queue) -> None:
        super().__init__(name="overridden")
        self.q = q

    def run(self) -> None:
        self.q.put(("ran", self.name))


@pytest.fixture(scope="module", autouse=True)
def warm() -> None:
    """Start the workers once, so timing tests measure starts, not the first boot."""
    p = mp.Process(target=_noop)
    p.start()
    p.join(60)
    assert p.exitcode == 0


# -- lifecycle ------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_start_join_exitcode_zero() -> None:
    p = mp.Process(target=_noop)
    assert p.exitcode is None
    p.start()
    p.join(20)
    assert p.exitcode == 0
    assert not p.is_alive()


@pytest.mark.timeout(30)
def test_target_raising_exitcode_one_traceback_on_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    p = mp.Process(target=_raise)
    p.start()
    p.join(20)
    assert p.exitcode == 1
    deadline = time.monotonic() + 3
    err = ""
    while time.monotonic() < deadline:
        err += capfd.readouterr().err
        if "kaboom-from-child" in err:
            break
        time.sleep(0.05)
    assert "Traceback" in err
    assert "ValueError: kaboom-from-child" in err


@pytest.mark.timeout(30)
def test_sys_exit_code() -> None:
    p = mp.Process(target=_exit7)
    p.start()
    p.join(20)
    assert p.exitcode == 7


@pytest.mark.timeout(30)
def test_terminate_and_kill() -> None:
    p = mp.Process(target=_sleep, args=(60,))
    q = mp.Process(target=_sleep, args=(60,))
    p.start()
    q.start()
    assert p.is_alive() and q.is_alive()
    p.terminate()
    q.kill()
    p.join(20)
    q.join(20)
    assert p.exitcode == -signal.SIGTERM
    assert q.exitcode == -signal.SIGKILL
    assert not p.is_alive() and not q.is_alive()


@pytest.mark.timeout(30)
def test_join_timeout_returns_while_alive() -> None:
    p = mp.Process(target=_sleep, args=(60,))
    p.start()
    try:
        t0 = time.monotonic()
        p.join(0.3)
        elapsed = time.monotonic() - t0
        assert 0.25 <= elapsed < 3
        assert p.is_alive()
        assert p.exitcode is None
    finally:
        p.kill()
        p.join(20)


@pytest.mark.timeout(30)
def test_pid_name_daemon_ident() -> None:
    p = mp.Process(target=_sleep, args=(60,), name="my-proc", daemon=True)
    assert p.name == "my-proc"
    assert p.daemon is True
    assert p.pid is None and p.ident is None
    p.start()
    try:
        assert isinstance(p.pid, int)
        assert p.pid != os.getpid()
        assert p.ident == p.pid
        os.kill(p.pid, 0)  # a live pid on this host
        assert psutil.pid_exists(p.pid)
        with pytest.raises(AssertionError):
            p.daemon = False  # stdlib: cannot change daemon of a started process
    finally:
        p.kill()
        p.join(20)


@pytest.mark.timeout(30)
def test_sentinel_with_stdlib_wait() -> None:
    p = mp.Process(target=_sleep, args=(0.3,))
    p.start()
    assert isinstance(p.sentinel, int)
    assert multiprocessing.connection.wait([p.sentinel], timeout=0) == []
    assert multiprocessing.connection.wait([p.sentinel], timeout=20) == [p.sentinel]
    p.join(5)
    assert p.exitcode == 0


@pytest.mark.timeout(30)
def test_sentinel_with_nimbus_wait_mixed_with_connection() -> None:
    p = mp.Process(target=_sleep, args=(0.3,))
    r, w = mp.Pipe(duplex=False)
    p.start()
    assert nconn.wait([p.sentinel, r], timeout=0) == []
    assert nconn.wait([p.sentinel, r], timeout=20) == [p.sentinel]
    w.send("x")
    assert set(nconn.wait([p.sentinel, r], timeout=5)) == {p.sentinel, r}
    assert r.recv() == "x"
    p.join(5)
    r.close()
    w.close()


@pytest.mark.timeout(60)
def test_a_poll_that_reads_the_exit_code_before_the_end_leaves_the_sentinel_to_the_end() -> None:
    """The child writes its exit code to the sentinel's pipe, then ends (its memory
    freed: milliseconds, more for a large one). A poll() reading the code before the end
    made the pipe readable again (a byte put back, for a thread waiting on it): a
    stdlib-style wait on the sentinel then returned at once until the end, and a loop
    of them (the stdlib Pool's worker handler: wait, then exitcode) spun, 50 to 350
    times per child's exit. The sentinel becomes the child's pidfd: ready at its end,
    as a stdlib sentinel is. (The child's write is made here, its process running, to
    hold that moment.)"""
    from nimbus.multiprocessing._forking import EXIT, started

    p = mp.Process(target=_sleep, args=(60,))
    p.start()
    popen = p._popen  # type: ignore[attr-defined]
    watch = selectors.EpollSelector()  # a watch kept by the file, not its number
    watch.register(p.sentinel, selectors.EVENT_READ)
    try:
        os.write(popen._exit_w, EXIT.pack(p.pid, 0, started(p.pid)))  # as the child does
        assert p.exitcode is None  # read, but the child has not ended
        assert watch.select(5)  # woken still (the pipe is kept open for it)
        t0 = time.monotonic()
        assert multiprocessing.connection.wait([p.sentinel], timeout=0.5) == []
        assert time.monotonic() - t0 >= 0.45
        assert p.is_alive()
        os.kill(p.pid, signal.SIGKILL)  # its end (kill() sends nothing: its code is in)
        assert multiprocessing.connection.wait([p.sentinel], timeout=10) == [p.sentinel]
        p.join(10)
        assert p.exitcode in (0, -signal.SIGKILL)  # the code written, or the worker's notice
    finally:
        watch.close()
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(30)


@pytest.mark.timeout(60)
def test_a_join_does_not_wait_for_another_process_that_got_the_childs_pid() -> None:
    """Review 7 #11: the child writes its exit code and pid, ends, and its worker reaps
    it; its pid may name another process by the time the parent looks (a busy host
    wraps its pids around): join() waited for that one's end instead (for ever, without
    a timeout). The child writes its start time too, and the pid is taken as its only
    while that matches. (The write is made here, naming a process that took the pid.)"""
    from nimbus.multiprocessing._forking import EXIT, started

    p = mp.Process(target=_sleep, args=(60,))
    p.start()
    other = subprocess.Popen(["sleep", "60"])
    try:
        began = started(p.pid)
        assert began and started(other.pid) != began
        os.write(p._popen._exit_w, EXIT.pack(other.pid, 0, began))  # type: ignore[attr-defined]
        t0 = time.monotonic()
        p.join(10)
        assert p.exitcode == 0
        assert time.monotonic() - t0 < 5
    finally:
        os.kill(p.pid, signal.SIGKILL)  # (its exit code is in: kill() would send nothing)
        other.kill()
        other.wait()
        p.join(30)


@pytest.mark.timeout(30)
def test_close_then_value_error() -> None:
    p = mp.Process(target=_noop)
    p.start()
    p.join(20)
    p.close()
    with pytest.raises(ValueError, match="closed"):
        p.is_alive()
    with pytest.raises(ValueError, match="closed"):
        _ = p.exitcode
    with pytest.raises(ValueError, match="closed"):
        p.start()


@pytest.mark.timeout(30)
def test_close_running_process_raises() -> None:
    p = mp.Process(target=_sleep, args=(60,))
    p.start()
    try:
        with pytest.raises(ValueError):
            p.close()
    finally:
        p.kill()
        p.join(20)


@pytest.mark.timeout(30)
def test_start_twice_and_join_unstarted() -> None:
    p = mp.Process(target=_noop)
    with pytest.raises(AssertionError, match="can only join a started process"):
        p.join()
    p.start()
    with pytest.raises(AssertionError, match="cannot start a process twice"):
        p.start()
    p.join(20)
    assert p.exitcode == 0


@pytest.mark.timeout(30)
def test_subclass_overriding_run() -> None:
    q = mp.Queue()
    p = _RunOverride(q)
    p.start()
    assert q.get(timeout=20) == ("ran", "overridden")
    p.join(20)
    assert p.exitcode == 0


@pytest.mark.timeout(30)
def test_current_and_parent_process_in_child() -> None:
    q = mp.Queue()
    p = mp.Process(target=_report_identity, args=(q,), name="ident-child")
    p.start()
    name, parent_pid, child_pid = q.get(timeout=20)
    p.join(20)
    assert name == "ident-child"
    assert parent_pid == os.getpid()
    assert child_pid == p.pid


@pytest.mark.timeout(30)
def test_active_children() -> None:
    p = mp.Process(target=_sleep, args=(60,))
    p.start()
    try:
        assert p in mp.active_children()
    finally:
        p.terminate()
        p.join(20)
    assert p not in mp.active_children()


@pytest.mark.timeout(60)
def test_children_start_children() -> None:
    q = mp.Queue()
    p = mp.Process(target=_start_grandchild, args=(q,))
    p.start()
    (name, grand_parent_pid, grandchild_pid), grand_exitcode, child_pid = q.get(timeout=50)
    p.join(20)
    assert p.exitcode == 0
    assert name == "grandchild"
    assert grand_exitcode == 0
    assert child_pid == p.pid
    assert grand_parent_pid == child_pid  # the grandchild's parent is the child
    assert grandchild_pid not in (os.getpid(), child_pid)


@pytest.mark.timeout(60)
def test_children_start_theirs_through_the_roots_relay() -> None:
    # no second set of warm workers: the child's starts go to the root's, and the
    # grandchildren's pids and exit codes (a signal's too) come back to the child
    q = mp.Queue()
    p = mp.Process(target=_relayed_starts, args=(q, None))
    p.start()
    assert q.get(timeout=50) == ("RelayedSite", -signal.SIGTERM, 7)
    p.join(20)
    assert p.exitcode == 0


@pytest.mark.timeout(60)
def test_a_child_without_the_relay_starts_warm_workers_of_its_own(tmp_path: Path) -> None:
    q = mp.Queue()
    p = mp.Process(target=_relayed_starts, args=(q, str(tmp_path / "no-relay")))
    p.start()
    assert q.get(timeout=50) == ("LocalSite", -signal.SIGTERM, 7)
    p.join(20)
    assert p.exitcode == 0


def test_the_relay_refuses_a_wrong_authkey() -> None:
    from nimbus.multiprocessing import _local, popen_nimbus

    popen_nimbus.site()
    address = _local.relay_address()
    assert address is not None
    assert Path(address).parent.stat().st_mode & 0o077 == 0  # only this user reaches it
    with pytest.raises(multiprocessing.AuthenticationError):
        multiprocessing.connection.Client(address, "AF_UNIX", authkey=b"not the program's")
    q = mp.Queue()  # and it still serves the program's own processes
    p = mp.Process(target=_start_grandchild, args=(q,))
    p.start()
    assert q.get(timeout=50)[1] == 0
    p.join(20)


def _standbys() -> list[psutil.Process]:
    """The children forked ahead of need by this program's warm workers.

    The workers are forks of this process (its command line), or new
    interpreters running ``nimbus.runtime.worker``.
    """
    me = psutil.Process()
    workers = [
        p
        for p in me.children()
        if p.cmdline() == me.cmdline() or "nimbus.runtime.worker" in " ".join(p.cmdline())
    ]
    return [child for worker in workers for child in worker.children()]


def test_a_start_sees_the_environment_and_directory_at_start(tmp_path: Path) -> None:
    # a worker forks a standby child after each start; the next process runs in it
    # and must still see the parent's environment and directory as at *its* start
    q = mp.Queue()
    for value in ("first", "second"):
        os.environ["NIMBUS_TEST_STANDBY"] = value
        here = os.getcwd()
        os.chdir(tmp_path / ".." if value == "first" else tmp_path)
        try:
            p = mp.Process(target=_report_start_state, args=(q,))
            p.start()
            expected = (value, os.getcwd())
        finally:
            os.chdir(here)
            del os.environ["NIMBUS_TEST_STANDBY"]
        assert q.get(timeout=20) == expected
        p.join(20)
        assert p.exitcode == 0


@pytest.mark.timeout(60)
def test_standby_children_killed_while_idle_are_replaced() -> None:
    for _ in range(2):
        p = mp.Process(target=_noop)
        p.start()
        p.join(20)
    deadline = time.monotonic() + 10
    while not (standbys := _standbys()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert standbys, "the workers keep a child forked ahead of the next start"
    for child in standbys:
        try:
            child.kill()
        except psutil.NoSuchProcess:  # it went meanwhile (a standby retired: seen once)
            pass
    # once reaped (a standby killed *while* a start hands it a process takes that
    # process along, as any process killed as it starts)
    psutil.wait_procs(standbys, timeout=10)
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(c.pid) for c in standbys) and time.monotonic() < deadline:
        time.sleep(0.05)
    for _ in range(4):  # each start forks afresh where its standby is gone
        p = mp.Process(target=_exit7)
        p.start()
        p.join(20)
        assert p.exitcode == 7


@pytest.mark.timeout(60)
def test_a_burst_of_starts_takes_every_standby_and_forks_the_rest() -> None:
    # each worker keeps more than one standby: a burst hands processes to them all
    # (each must read its process to the end while the others wait) and forks afresh
    # once they are used up; every process runs and reports its own exit code
    for _ in range(2):  # the second burst comes while the standbys are refilled
        procs = [mp.Process(target=_exit_with, args=(10 + i,)) for i in range(7)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(20)
        assert [p.exitcode for p in procs] == [10 + i for i in range(7)]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
@pytest.mark.timeout(60)
def test_children_have_the_same_descriptors_however_they_start() -> None:
    # standbys (connected to the store while they wait), standbys handed a process
    # at once and fresh forks alike (CPython's test_child_fd_inflation)
    for _ in range(3):
        q = mp.Queue()
        procs = [mp.Process(target=_count_fds, args=(q,)) for _ in range(7)]
        for p in procs:
            p.start()
        got = [q.get(timeout=20) for _ in procs]
        counts = [n for n, _ in got]
        for p in procs:
            p.join(20)
        if len(set(counts)) != 1:
            lo = dict(min(got)[1])
            hi = dict(max(got)[1])
            extra = {k: v for k, v in hi.items() if lo.get(k) != v}
            missing = {k: v for k, v in lo.items() if hi.get(k) != v}
            raise AssertionError(f"counts {counts}; extra {extra}; missing {missing}")


def test_relay_sockets_of_dead_roots_are_removed(tmp_path: Path) -> None:
    from nimbus.config import Settings

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    runtime_dir = Settings.load().ensure_runtime_dir()
    stale = runtime_dir / f"relay-{int(gone.stdout)}-deadbeef"
    live = runtime_dir / f"relay-{os.getpid()}-notstale"
    stale.touch()
    live.touch()
    try:
        res = _run_script(
            tmp_path,
            """
            import nimbus.multiprocessing as mp
            if __name__ == "__main__":
                p = mp.Process(target=print)
                p.start()
                p.join()
            """,
        )
        assert res.returncode == 0, res.stderr
        assert not stale.exists()  # a root that died by SIGKILL left it
        assert live.exists()  # a live root's is kept
    finally:
        stale.unlink(missing_ok=True)
        live.unlink(missing_ok=True)


@pytest.mark.timeout(30)
def test_twenty_processes_run_concurrently() -> None:
    q = mp.Queue()
    procs = [mp.Process(target=_timestamps, args=(q, 2.0)) for _ in range(20)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    stamps = [q.get(timeout=20) for _ in procs]
    for p in procs:
        p.join(20)
    elapsed = time.monotonic() - t0
    assert [p.exitcode for p in procs] == [0] * 20
    assert elapsed < 8, elapsed  # (one after another: 40 s)
    # all 20 were asleep at the same moment
    assert max(s for s, _ in stamps) < min(e for _, e in stamps)


@pytest.mark.timeout(30)
def test_child_stdout_appears_live(capfd: pytest.CaptureFixture[str]) -> None:
    event = mp.Event()
    p = mp.Process(target=_print_then_wait, args=(event,))
    p.start()
    try:
        out = ""
        deadline = time.monotonic() + 4
        while "hello-from-child-stdout" not in out and time.monotonic() < deadline:
            out += capfd.readouterr().out
            time.sleep(0.05)
        assert "hello-from-child-stdout" in out
        assert p.is_alive()  # seen while the child still runs
    finally:
        event.set()
        p.join(20)


@pytest.mark.timeout(30)
def test_unpicklable_argument_raises_at_start() -> None:
    p = mp.get_context("spawn").Process(target=_takes_lock, args=(threading.Lock(),))
    with pytest.raises((TypeError, pickle.PicklingError), match="pickle") as info:
        p.start()
    assert "_thread.lock" in str(info.value)
    assert p._popen is None  # the process never started
    assert p not in mp.active_children()


@pytest.mark.timeout(30)
def test_unpicklable_argument_error_is_a_typeerror_as_in_stdlib() -> None:
    # the stdlib (spawn) raises TypeError: cannot pickle '_thread.lock' object;
    # code written for it catches TypeError
    p = mp.get_context("spawn").Process(target=_takes_lock, args=(threading.Lock(),))
    with pytest.raises(TypeError):
        p.start()


@pytest.mark.timeout(30)
def test_a_thread_lock_goes_to_a_fork_child_as_a_copy() -> None:
    """As under the stdlib's fork (issue 16 fixrun #2): a copy in the state it was in;
    pickled elsewhere (a queue), it is still the stdlib's TypeError."""
    lock = threading.Lock()
    lock.acquire()
    q = mp.Queue()
    p = mp.get_context("fork").Process(target=_lock_state, args=(lock, threading.RLock(), q))
    p.start()
    assert q.get(timeout=20) == (True, True)
    p.join(20)
    assert p.exitcode == 0
    from multiprocessing.reduction import ForkingPickler

    with pytest.raises(TypeError, match=r"cannot pickle '_thread\.lock' object"):
        ForkingPickler.dumps(threading.Lock())


# -- at the parent's exit (a separate program) ------------------------------------


def _run_script(tmp_path: Path, body: str, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(90)
def test_daemon_child_terminated_at_parent_exit(tmp_path: Path) -> None:
    res = _run_script(
        tmp_path,
        """
        import time
        import nimbus.multiprocessing as mp

        def sleeper():
            time.sleep(60)

        if __name__ == "__main__":
            p = mp.Process(target=sleeper, daemon=True)
            p.start()
            print(p.pid, flush=True)
        """,
    )
    assert res.returncode == 0, res.stderr
    pid = int(res.stdout.split()[0])
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid)


@pytest.mark.timeout(90)
def test_non_daemon_child_joined_at_parent_exit(tmp_path: Path) -> None:
    marker = tmp_path / "marker.txt"
    res = _run_script(
        tmp_path,
        """
        import sys, time
        import nimbus.multiprocessing as mp

        def writer(path):
            time.sleep(0.5)
            with open(path, "w") as f:
                f.write("done")

        if __name__ == "__main__":
            p = mp.Process(target=writer, args=(sys.argv[1],))
            p.start()
        """,
        str(marker),
    )
    assert res.returncode == 0, res.stderr
    assert marker.read_text() == "done"


@pytest.mark.timeout(90)
def test_pool_closed_and_joined_at_module_level_exits_cleanly(tmp_path: Path) -> None:
    # the Pool's own exit finalizer still uses the store: it must outlive it
    res = _run_script(
        tmp_path,
        """
        import nimbus.multiprocessing as mp

        def square(x):
            return x * x

        if __name__ == "__main__":
            pool = mp.Pool(2)
            print(sum(pool.map(square, range(10))))
            pool.close()
            pool.join()
        """,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["285"]
    assert res.stderr == ""


@pytest.mark.timeout(90)
def test_pool_left_open_at_exit_is_finalized(tmp_path: Path) -> None:
    # CPython's bpo-38744: the Pool's exit finalizer runs while its worker is already
    # terminated; it must not need to start another one (nor hang)
    res = _run_script(
        tmp_path,
        """
        from nimbus.multiprocessing import Pool

        class A:
            def __init__(self):
                self.pool = Pool(processes=1)

        if __name__ == "__main__":
            problem = A()
            print(sum(problem.pool.map(float, range(10))))
        """,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["45.0"]
    assert res.stderr == ""


def _attach_and_write(name: str) -> None:
    from multiprocessing import shared_memory

    block = shared_memory.SharedMemory(name)  # registers it with a resource tracker (3.11)
    block.buf[0] = 42
    block.close()


@pytest.mark.timeout(60)
def test_a_child_attaching_shared_memory_does_not_unlink_it() -> None:
    from multiprocessing import shared_memory

    block = shared_memory.SharedMemory(create=True, size=16)  # starts this process's tracker
    try:
        for _ in range(2):
            proc = mp.Process(target=_attach_and_write, args=(block.name,))
            proc.start()
            proc.join(20)
            assert proc.exitcode == 0
        # a child with a tracker of its own: that tracker unlinks the block when the child ends
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert os.path.exists(f"/dev/shm/{block.name}"), "a child's tracker unlinked it"
            time.sleep(0.05)
        again = shared_memory.SharedMemory(block.name)
        assert again.buf[0] == 42
        again.close()
    finally:
        block.close()
        block.unlink()


def _set_later(evt: Any, delay: float) -> None:
    time.sleep(delay)
    evt.set()


def _leave_a_thread(evt: Any) -> None:
    threading.Thread(target=_set_later, args=(evt, 0.5)).start()  # not a daemon: waited for


@pytest.mark.timeout(60)
def test_the_roots_warm_workers_are_forks_of_it_and_a_childs_threads_are_waited_for() -> None:
    evt = mp.Event()
    p = mp.Process(target=_leave_a_thread, args=(evt,))
    p.start()
    p.join(20)
    assert p.exitcode == 0
    assert evt.is_set()  # as in a new interpreter: the worker's thread is no daemon
    me = psutil.Process()
    forks = [c for c in me.children() if c.cmdline() == me.cmdline()]
    assert forks, "the root's warm workers are forks of it (nimbus already imported)"
    for worker in forks:
        assert worker.pid == os.getsid(worker.pid)  # a session of its own, as a new one


def _stop_my_worker(pid_of_worker: Any) -> None:
    """Stop the warm worker that forked this process (its reaper cannot report our exit)."""
    pid_of_worker.value = os.getppid()
    os.kill(os.getppid(), signal.SIGSTOP)
    sys.exit(7)


@pytest.mark.timeout(60)
def test_join_has_the_exit_code_while_the_worker_that_forked_it_is_stopped() -> None:
    """The child writes its exit code to its Popen's pipe and the parent waits for its
    pidfd: join() does not wait for the worker's reaper and notice (held up here)."""
    worker = mp.Value("i", 0)
    p = mp.Process(target=_stop_my_worker, args=(worker,))
    p.start()
    try:
        p.join(20)
        assert p.exitcode == 7
        assert not p.is_alive()
        assert multiprocessing.connection.wait([p.sentinel], timeout=5) == [p.sentinel]
    finally:
        if worker.value:
            os.kill(worker.value, signal.SIGCONT)


def _sleep_long() -> None:
    time.sleep(60)


@pytest.mark.timeout(60)
def test_a_killed_childs_exit_comes_by_the_notice_and_wakes_its_sentinel() -> None:
    """A child that cannot write its code (killed) ends by the worker's notice, which
    wakes a wait on its sentinel too."""
    p = mp.Process(target=_sleep_long)
    p.start()
    woke: list[Any] = []
    waiter = threading.Thread(
        target=lambda: woke.append(multiprocessing.connection.wait([p.sentinel], timeout=20))
    )
    waiter.start()
    p.kill()
    p.join(20)
    waiter.join(20)
    assert p.exitcode == -signal.SIGKILL
    assert woke == [[p.sentinel]]


@pytest.mark.timeout(90)
def test_the_first_warm_worker_imports_a_guarded_main_before_the_first_start(
    tmp_path: Path,
) -> None:
    """The root's first warm worker imports the main module as it comes up, not when the
    first start reaches it (that start would wait for the import)."""
    res = _run_script(
        tmp_path,
        """
        import os, time
        import nimbus.multiprocessing as mp
        from nimbus.multiprocessing import popen_nimbus

        if __name__ == "__mp_main__":
            with open("imported", "a") as f:
                f.write(f"{os.getpid()}\\n")

        def child():
            pass

        if __name__ == "__main__":
            popen_nimbus.site()  # the warm workers, no start yet
            deadline = time.monotonic() + 20
            while not os.path.exists("imported") and time.monotonic() < deadline:
                time.sleep(0.02)
            print(os.path.exists("imported"))
            p = mp.Process(target=child)
            p.start()
            p.join()
            print(p.exitcode, len(open("imported").read().split()))
        """,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "0", "1"]
