"""nimbus.multiprocessing.Pool: the stdlib's pool on nimbus processes and store queues."""

from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import nimbus.multiprocessing as mp
from nimbus.multiprocessing.pool import ThreadPool

# -- targets (module level) -----------------------------------------------------

_INIT_CALLS: list[object] = []


def _square(x: int) -> int:
    return x * x


def _add(a: int, b: int) -> int:
    return a + b


def _pid(_: object = None) -> int:
    return os.getpid()


def _sleep_return(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _fail(x: int) -> int:
    raise ValueError(f"bad item {x}")


def _init(tag: str, q: mp.Queue) -> None:
    _INIT_CALLS.append(tag)
    q.put(os.getpid())


def _init_state(_: object) -> tuple[int, int, list[object]]:
    time.sleep(0.02)  # lets every pool process take some tasks
    return os.getpid(), len(_INIT_CALLS), list(_INIT_CALLS)


def _monte_carlo(seed: int, n: int = 20_000) -> int:
    rng = random.Random(seed)
    inside = 0
    for _ in range(n):
        x, y = rng.random(), rng.random()
        inside += x * x + y * y <= 1.0
    return inside


@pytest.fixture(scope="module")
def pool() -> Iterator[multiprocessing.pool.Pool]:
    p = mp.Pool(2)
    yield p
    p.close()
    p.join()


# -- basic calls ------------------------------------------------------------------


def _name(_: object = None) -> str:
    return mp.current_process().name


@pytest.mark.timeout(60)
def test_workers_are_named_as_the_stdlibs_for_their_start_method() -> None:
    """F7: they were PoolWorker-N under every method (the stdlib's: ForkPoolWorker-N
    under fork, the default, SpawnPoolWorker-N under spawn); programs print them."""
    for method, prefix in (("fork", "ForkPoolWorker-"), ("spawn", "SpawnPoolWorker-")):
        with mp.get_context(method).Pool(1) as p:
            name = p.apply(_name)
        assert name.startswith(prefix) and name[len(prefix) :].isdigit(), name
    with mp.Pool(1) as p:
        assert p.apply(_name).startswith("ForkPoolWorker-")


@pytest.mark.timeout(60)
def test_apply(pool: multiprocessing.pool.Pool) -> None:
    assert pool.apply(_square, (7,)) == 49
    assert pool.apply(_add, (2,), {"b": 3}) == 5
    assert pool.apply(_pid) != os.getpid()


@pytest.mark.timeout(30)
def test_apply_async_callback_and_error_callback(pool: multiprocessing.pool.Pool) -> None:
    results: list[object] = []
    errors: list[BaseException] = []
    ok = pool.apply_async(_square, (5,), callback=results.append, error_callback=errors.append)
    bad = pool.apply_async(_fail, (3,), callback=results.append, error_callback=errors.append)
    assert ok.get(timeout=20) == 25
    bad.wait(20)
    assert bad.ready() and not bad.successful()
    assert results == [25]
    assert len(errors) == 1 and isinstance(errors[0], ValueError)
    assert "bad item 3" in str(errors[0])


@pytest.mark.timeout(30)
def test_map_and_map_async(pool: multiprocessing.pool.Pool) -> None:
    assert pool.map(_square, range(50)) == [x * x for x in range(50)]
    got: list[object] = []
    res = pool.map_async(_square, range(10), callback=got.append)
    assert res.get(timeout=20) == [x * x for x in range(10)]
    assert got == [[x * x for x in range(10)]]
    assert pool.map(_square, []) == []


@pytest.mark.timeout(30)
def test_starmap_and_starmap_async(pool: multiprocessing.pool.Pool) -> None:
    pairs = [(i, 10 * i) for i in range(20)]
    assert pool.starmap(_add, pairs) == [a + b for a, b in pairs]
    assert pool.starmap_async(_add, pairs, chunksize=3).get(timeout=20) == [a + b for a, b in pairs]


@pytest.mark.timeout(30)
def test_imap_is_lazy(pool: multiprocessing.pool.Pool) -> None:
    t0 = time.monotonic()
    it = pool.imap(_sleep_return, [0.0, 1.0, 1.0])
    assert next(it) == 0.0
    first = time.monotonic() - t0
    assert first < 0.8, first  # the first result before the others are done
    assert list(it) == [1.0, 1.0]
    assert time.monotonic() - t0 >= 1.0


@pytest.mark.timeout(30)
def test_imap_unordered_completion_order(pool: multiprocessing.pool.Pool) -> None:
    items = [0.8, 0.05, 0.05]
    got = list(pool.imap_unordered(_sleep_return, items))
    assert sorted(got) == sorted(items)
    assert got != items
    assert got[-1] == 0.8


@pytest.mark.timeout(30)
def test_imap_chunksize_results(pool: multiprocessing.pool.Pool) -> None:
    assert list(pool.imap(_square, range(30), chunksize=7)) == [x * x for x in range(30)]
    assert sorted(pool.imap_unordered(_square, range(30), chunksize=4)) == [
        x * x for x in range(30)
    ]


@pytest.mark.timeout(30)
def test_chunksize_honoured(pool: multiprocessing.pool.Pool) -> None:
    # a chunk runs in one pool process, so pids come in runs of `chunksize`
    pids = pool.map(_pid, range(20), chunksize=5)
    for start in range(0, 20, 5):
        assert len(set(pids[start : start + 5])) == 1, pids
    assert len(set(pool.map(_pid, range(12), chunksize=12))) == 1


@pytest.mark.timeout(30)
def test_async_result_get_timeout(pool: multiprocessing.pool.Pool) -> None:
    res = pool.apply_async(_sleep_return, (1.0,))
    t0 = time.monotonic()
    with pytest.raises(multiprocessing.TimeoutError):
        res.get(timeout=0.1)
    assert time.monotonic() - t0 < 0.9
    assert mp.TimeoutError is multiprocessing.TimeoutError
    assert not res.ready()
    assert res.get(timeout=20) == 1.0


@pytest.mark.timeout(30)
def test_task_exception_reraised_with_remote_traceback(pool: multiprocessing.pool.Pool) -> None:
    with pytest.raises(ValueError, match="bad item 4") as info:
        pool.apply(_fail, (4,))
    cause = info.value.__cause__
    assert isinstance(cause, multiprocessing.pool.RemoteTraceback)
    assert "_fail" in str(cause) and "Traceback" in str(cause)
    with pytest.raises(ValueError, match="bad item"):
        pool.map(_fail, range(3))
    # the pool is still usable
    assert pool.apply(_square, (3,)) == 9


@pytest.mark.timeout(60)
def test_results_equal_sequential(pool: multiprocessing.pool.Pool) -> None:
    seeds = list(range(16))
    inside = pool.map(_monte_carlo, seeds)
    assert inside == [_monte_carlo(s) for s in seeds]
    pi = 4 * sum(inside) / (20_000 * len(seeds))
    assert abs(pi - 3.14159) < 0.05
    n = 10_000
    assert sum(pool.map(_square, range(n), chunksize=500)) == sum(x * x for x in range(n))


# -- pool lifecycle (own pools) ---------------------------------------------------


@pytest.mark.timeout(30)
def test_close_join() -> None:
    p = mp.Pool(2)
    assert p.map(_square, range(5)) == [0, 1, 4, 9, 16]
    res = p.apply_async(_sleep_return, (0.3,))
    p.close()
    with pytest.raises(ValueError, match="Pool not running"):
        p.apply(_square, (1,))
    p.join()
    assert res.get(timeout=0) == 0.3  # close lets queued work finish


@pytest.mark.timeout(30)
def test_terminate_stops_running_work() -> None:
    p = mp.Pool(2)
    res = p.apply_async(_sleep_return, (30,))
    time.sleep(0.3)
    t0 = time.monotonic()
    p.terminate()
    p.join()
    assert time.monotonic() - t0 < 10
    assert not res.ready()


@pytest.mark.timeout(30)
def test_context_manager_terminates() -> None:
    with mp.Pool(2) as p:
        assert p.map(_square, range(4)) == [0, 1, 4, 9]
    with pytest.raises(ValueError, match="Pool not running"):
        p.apply(_square, (1,))
    p.join()


@pytest.mark.timeout(30)
def test_initializer_runs_once_per_process() -> None:
    q = mp.Queue()
    with mp.Pool(2, initializer=_init, initargs=("tag-A", q)) as p:
        states = set()
        for pid, count, calls in p.map(_init_state, range(40), chunksize=1):
            assert count == 1 and calls == ["tag-A"]
            states.add(pid)
        p.close()
        p.join()
    init_pids = [q.get(timeout=10) for _ in range(2)]
    assert sorted(init_pids) == sorted(set(init_pids))  # one call per process
    assert states <= set(init_pids)
    assert q.empty()
    assert _INIT_CALLS == []  # never in the parent


@pytest.mark.timeout(30)
def test_maxtasksperchild_replaces_processes() -> None:
    with mp.Pool(2, maxtasksperchild=1) as p:
        pids = p.map(_pid, range(8), chunksize=1)
        p.close()
        p.join()
    assert len(set(pids)) > 2, pids


@pytest.mark.timeout(10)
def test_pool_zero_processes() -> None:
    with pytest.raises(ValueError):
        mp.Pool(0)


@pytest.mark.timeout(10)
def test_pool_default_size_is_cpu_count() -> None:
    with mp.Pool() as p:
        assert p._processes == mp.cpu_count()
        p.close()
        p.join()


@pytest.mark.timeout(30)
def test_thread_pool() -> None:
    with ThreadPool(3) as tp:
        assert tp.map(_square, range(10)) == [x * x for x in range(10)]
        assert set(tp.map(_pid, range(6))) == {os.getpid()}  # threads of this process
        idents = tp.map(lambda _: threading.get_ident(), range(30))
        assert threading.get_ident() not in idents
    assert mp.pool.ThreadPool is multiprocessing.pool.ThreadPool


# -- a script without the __main__ guard (a separate program) ---------------------

_GUARD_MESSAGE = "An attempt has been made to start a new process before the"


def _run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )


@pytest.mark.timeout(90)
def test_unguarded_pool_script_fails_once_with_the_stdlib_message(tmp_path: Path) -> None:
    """The README's Pool example without ``if __name__ == "__main__":`` fails once, at Pool()."""
    started = time.monotonic()
    res = _run_script(
        tmp_path,
        """
        import nimbus.multiprocessing as multiprocessing

        def work(x):
            return x * x

        with multiprocessing.Pool(4) as pool:
            print(sum(pool.map(work, range(100))))
        """,
    )
    assert res.returncode == 1, res.stderr[-3000:]
    assert res.stderr.count(_GUARD_MESSAGE) == 1, res.stderr[-3000:]
    assert "if __name__ == '__main__':" in res.stderr
    assert "Can't get attribute" not in res.stderr
    assert "with multiprocessing.Pool(4) as pool:" in res.stderr  # the line that started it
    assert res.stdout == ""
    assert time.monotonic() - started < 30


@pytest.mark.timeout(90)
def test_unguarded_process_script_fails_at_start(tmp_path: Path) -> None:
    res = _run_script(
        tmp_path,
        """
        import nimbus.multiprocessing as multiprocessing

        def work():
            print("child ran")

        p = multiprocessing.Process(target=work)
        p.start()
        p.join()
        """,
    )
    assert res.returncode == 1, res.stderr[-3000:]
    assert res.stderr.count(_GUARD_MESSAGE) == 1, res.stderr[-3000:]
    assert "child ran" not in res.stdout


@pytest.mark.timeout(90)
def test_guarded_pool_script_runs(tmp_path: Path) -> None:
    """The README's example as printed, with the guard: __main__ functions by reference."""
    res = _run_script(
        tmp_path,
        """
        import nimbus.multiprocessing as multiprocessing

        def work(x):
            return x * x

        if __name__ == "__main__":
            with multiprocessing.Pool(4) as pool:
                print(sum(pool.map(work, range(10_000))))
        """,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == [str(sum(x * x for x in range(10_000)))]
    assert res.stderr == ""


@pytest.mark.timeout(90)
def test_a_guarded_programs_starts_do_not_wait_for_a_worker_to_import_its_main(
    tmp_path: Path,
) -> None:
    """Only a main module without the guard (it may start processes as it is imported)
    has its first start wait for a worker's import of it: a guarded one's Pool starts its
    processes at once (here the import takes 1.5 s; the Pool is made long before)."""
    res = _run_script(
        tmp_path,
        """
        import time
        import nimbus.multiprocessing as multiprocessing

        if __name__ == "__mp_main__":
            time.sleep(1.5)  # a slow import, in the workers only

        def work(x):
            return x * x

        if __name__ == "__main__":
            t0 = time.monotonic()
            pool = multiprocessing.Pool(4)
            made = time.monotonic() - t0
            print(pool.map(work, range(8)), made < 1.0, made)
            pool.close()
            pool.join()
        """,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[:-1] == ["[0,", "1,", "4,", "9,", "16,", "25,", "36,", "49]", "True"]


@pytest.mark.timeout(90)
def test_a_pools_processes_run_with_no_standby_forked_beside_them(tmp_path: Path) -> None:
    """A Pool's processes start together and stay: their warm workers fork no standbys
    for later starts while the Pool works (it took the CPU of its map and held up its
    processes' exit notices), only once they have been quiet a while."""
    res = _run_script(
        tmp_path,
        """
        import time, psutil
        import nimbus.multiprocessing as multiprocessing

        def work(x):
            return x

        def forked_by_workers():
            return {g.pid for c in psutil.Process().children() for g in c.children()}

        if __name__ == "__main__":
            with multiprocessing.Pool(4) as pool:
                pool.map(work, range(64))
                time.sleep(0.1)
                print(forked_by_workers() == {p.pid for p in pool._pool})
                time.sleep(1.0)  # quiet: the workers fork standbys for the next starts
                print(len(forked_by_workers()) > 4)
        """,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["True", "True"]


@pytest.mark.timeout(90)
def test_a_script_read_from_stdin_runs_as_with_fork(tmp_path: Path) -> None:
    """`python - < script.py` (no file behind __main__, no guard needed with fork): the
    Pool and a Process run it, their __main__ functions by value, no main to import."""
    body = """
        import nimbus.multiprocessing as multiprocessing

        def work(x):
            return x * x

        with multiprocessing.Pool(4) as pool:
            print(sum(pool.map(work, range(1000))))
        p = multiprocessing.Process(target=print, args=("child",))
        p.start()
        p.join()
        print(p.exitcode)
    """
    res = subprocess.run(
        [sys.executable, "-"],
        input=textwrap.dedent(body),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == [str(sum(x * x for x in range(1000))), "child", "0"]
    assert res.stderr == ""


@pytest.mark.timeout(90)
def test_a_local_programs_pool_runs_on_pipes_and_imports_no_redis(tmp_path: Path) -> None:
    """Its job and result queues are OS pipes (``_hostqueue``): neither the program nor its
    pool processes, nor the warm workers that start them, import redis-py."""
    res = _run_script(
        tmp_path,
        """
        import sys
        import nimbus.multiprocessing as multiprocessing

        def init(tag):
            global TAG
            TAG = tag

        def work(x):
            if x == 13:
                raise ValueError("thirteen")
            return x * x, TAG, "redis" in sys.modules

        if __name__ == "__main__":
            with multiprocessing.Pool(4, init, ("t",), maxtasksperchild=5) as pool:
                print(type(pool._inqueue).__name__, type(pool._outqueue).__name__)
                out = list(pool.imap(work, [x for x in range(40) if x != 13], chunksize=2))
                print(out == [(x * x, "t", False) for x in range(40) if x != 13])
                try:
                    pool.apply(work, (13,))
                except ValueError as exc:
                    print("raised", exc)
                pool.close()
                pool.join()
            print("redis" in sys.modules)
        """,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split("\n")[:4] == [
        "HostSimpleQueue HostSimpleQueue",
        "True",
        "raised thirteen",
        "False",
    ]
