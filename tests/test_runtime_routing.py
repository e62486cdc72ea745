"""Workers typed by environment and warming-aware routing (nimbus.runtime.routing, pool).

The builders here are real: a virtualenv made with ``python -m venv`` (no pip:
the worker finds nimbus through its PYTHONPATH), a slow one that also waits,
and one that fails as a venv into an unwritable place fails. They stand in for
``nimbus.environments.prepare`` through the manager's ``prepare`` seam.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from nimbus import Environment, Executor
from nimbus.environments import Prepared, _venv
from nimbus.errors import ConfigError, TaskTimeoutError
from nimbus.network import WorkerNetworks
from nimbus.records import TaskRecord
from nimbus.runtime import routing
from nimbus.runtime.agent import Agent
from nimbus.runtime.messages import Status
from nimbus.runtime.task import Task, environment_tag
from nimbus.serialization import FunctionCache, dumps, loads

A = Environment("a")
B = Environment("b")


def venv_builder(root: Path, *, wait: float = 0.0, broken: bool = False) -> Any:
    """Build a real virtualenv per environment (``broken``: environment "a"'s cannot be made)."""
    lock = threading.Lock()

    def prepare(env: Environment) -> Prepared:
        if env.plain and env.name == "plain":
            return Prepared(env)
        began = time.monotonic()
        where = root / env.key
        if broken and env.name == "a":
            where = Path("/proc/nimbus-cannot-write-here")
        with lock:
            if not (where / "bin" / "python").exists():
                done = subprocess.run(
                    [sys.executable, "-m", "venv", "--without-pip", str(where)],
                    capture_output=True,
                    text=True,
                )
                if done.returncode:
                    raise ConfigError(
                        f"environment {env.name!r}: python -m venv failed: {done.stderr.strip()}"
                    )
                # as the builders do: the node's import path after the venv's own
                (_venv._site_packages(where) / _venv.PTH_NAME).write_text(_venv.PTH)
        time.sleep(max(0.0, wait - (time.monotonic() - began)))
        return Prepared(
            env,
            python=str(where / "bin" / "python"),
            venv=str(where),
            build_seconds=time.monotonic() - began,
        )

    return prepare


def prefix() -> str:
    return sys.prefix


def pid() -> int:
    return os.getpid()


def nap(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def die() -> None:
    os._exit(3)


class Runtime:
    """An agent, its managers, and tasks whose results are counted per task."""

    def __init__(self, **agent: Any) -> None:
        self.results: Counter[int] = Counter()
        self.tasks: dict[int, Task] = {}
        self.done = threading.Condition()
        self.agent = Agent(on_results=self._on_results, **agent)
        self._fns = FunctionCache()
        self._seq = 0

    def _on_results(self, tasks: list[Task]) -> None:
        with self.done:
            for task in tasks:
                self.results[task.seq] += 1
                task.record.ended = task.record.ended or time.time()
            self.done.notify_all()

    def submit(self, env: Environment | None, fn: Any, *args: Any, timeout: float | None = None):
        key, body = self._fns.get(fn)
        payload, buffers = dumps((args, {}))
        self._seq += 1
        task = Task(
            self._seq,
            key,
            body,
            payload,
            buffers,
            TaskRecord(str(self._seq), submitted=time.time()),
            timeout=timeout,
            environment=env,
        )
        self.tasks[task.seq] = task
        self.agent.submit([task])
        return task

    def wait(self, timeout: float = 60.0) -> None:
        with self.done:
            assert self.done.wait_for(lambda: len(self.results) == len(self.tasks), timeout), (
                f"{len(self.tasks) - len(self.results)} tasks got no result"
            )

    @staticmethod
    def value(task: Task) -> Any:
        if task.status == Status.OK:
            return loads(task.data, task.result_buffers)
        error, _ = loads(task.data)
        return error

    def spawned(self) -> int:
        return sum(m.statistics()["spawned"] for m in self.agent._managers)


@pytest.fixture
def runtime():
    made: list[Runtime] = []

    def make(**agent: Any) -> Runtime:
        made.append(Runtime(**agent))
        return made[-1]

    yield make
    for rt in made:
        rt.agent.shutdown(kill=True)


def test_tasks_go_to_warm_workers_of_their_environment_first(runtime) -> None:
    rt = runtime()
    rt.agent.add_manager(2, warm=[A, A], prefetch=8)  # room for all: no backlog to switch for
    rt.agent.add_manager(2, warm=[B, B], prefetch=8)
    pairs = [(rt.submit(A, nap, 0.02), rt.submit(B, nap, 0.02)) for _ in range(12)]
    rt.wait()
    a_tasks, b_tasks = [a for a, _ in pairs], [b for _, b in pairs]
    assert {t.record.worker.split("/w")[0] for t in a_tasks} == {"agent/m0"}
    assert {t.record.worker.split("/w")[0] for t in b_tasks} == {"agent/m1"}
    assert rt.spawned() == 4  # no cold start: every task found a warm worker of its own
    stats = rt.agent._managers[0].statistics()
    assert stats["environments"][environment_tag(A)]["slots"] == 2
    assert stats["unused"] == 0


def test_tasks_pending_at_once_start_in_order_over_ready_workers(runtime) -> None:
    """Two ready workers and four long tasks queued in one go: tasks 1 and 2 run first
    (dealt in turn, as the stdlib's pool would start them), not 1 and 3."""
    rt = runtime()
    rt.agent.add_manager(2, prefetch=8)
    manager = rt.agent._managers[0]
    deadline = time.monotonic() + 30
    while manager.statistics()["ready"] < 2:
        assert time.monotonic() < deadline, "the 2 workers never became ready"
        time.sleep(0.02)
    key, body = rt._fns.get(nap)
    tasks = []
    for seq in range(1, 5):
        payload, buffers = dumps(((1.0,), {}))
        task = Task(seq, key, body, payload, buffers, TaskRecord(str(seq), submitted=time.time()))
        rt.tasks[seq] = task
        tasks.append(task)
    rt.agent.submit(tasks)  # all four pending when the manager deals them
    rt.wait()
    first, then = tasks[:2], tasks[2:]
    assert max(t.record.started for t in first) < min(t.record.started for t in then) - 0.5
    assert {t.record.worker for t in first} == {t.record.worker for t in then}  # both workers


def test_a_retired_workers_network_is_released_once_it_exits(runtime) -> None:
    """A worker retired for another environment's kept its network (slot, counting
    cgroup) until the manager stopped: a manager switching often held ever more."""
    rt = runtime()
    rt.agent.add_manager(1, warm=[A], prefetch=1)
    manager = rt.agent._managers[0]
    if not manager._net.active:
        pytest.skip("this node's workers get no network of their own (not root)")
    for env in (A, B, A, B):  # each switch retires the one worker for the other's
        rt.submit(env, pid)
        rt.wait(timeout=60)
    deadline = time.monotonic() + 10
    while manager._reap and time.monotonic() < deadline:  # (the loop reaps them)
        time.sleep(0.05)
    live = {w.name for w in manager._workers}
    assert manager.statistics()["spawned"] >= 4
    assert set(manager._net._held) <= live, (set(manager._net._held), live)


def test_unused_slots_before_switching_a_warm_worker(runtime) -> None:
    rt = runtime()
    rt.agent.add_manager(3, warm=[A], prefetch=1)
    first = rt.submit(A, nap, 0.01)
    rt.wait()
    b = rt.submit(B, pid)
    rt.wait()
    a = rt.submit(A, pid)
    rt.wait()
    assert a.record.worker == first.record.worker  # A's worker stayed: B took an unused slot
    assert b.record.worker != first.record.worker
    slots, unused, _ = rt.agent._managers[0].environments()
    assert slots == {environment_tag(A): 1, environment_tag(B): 1} and unused == 1


def test_an_environment_with_no_worker_does_not_starve(runtime) -> None:
    rt = runtime()
    rt.agent.add_manager(2, warm=[A, A], prefetch=1)
    many = [rt.submit(A, nap, 0.05) for _ in range(60)]  # 1.5 s of work on two workers
    late = rt.submit(B, pid)
    rt.wait()
    assert rt.value(late) != 0
    last_a = max(t.record.ended for t in many)
    assert late.record.ended < last_a - 0.5, "B waited for all of A's work"


def test_no_starvation_across_managers(runtime) -> None:
    rt = runtime()
    rt.agent.add_manager(1, warm=[A], prefetch=1)
    rt.agent.add_manager(1, warm=[A], prefetch=1)
    many = [rt.submit(A, nap, 0.05) for _ in range(60)]
    late = rt.submit(B, pid)
    rt.wait()
    assert rt.value(late) != 0
    assert late.record.ended < max(t.record.ended for t in many) - 0.5, "B waited for A"


def test_the_plan_shares_slots_in_proportion_to_work() -> None:
    views = [routing.View(m, {}, 4, 1) for m in ("m0", "m1")]
    moves = routing.plan({"a": 60, "b": 20}, views)
    claimed = Counter(m.env for m in moves if m.claim)
    assert claimed == {"a": 6, "b": 2}
    # a warm worker with room is used before any claim
    views = [routing.View("m0", {"a": 1}, 1, 2)]
    moves = routing.plan({"a": 2}, views)
    assert [(m.env, m.tasks, m.claim) for m in moves] == [("a", 2, False)]


def test_a_failed_build_fails_its_tasks_fast_with_the_builders_message(
    runtime, tmp_path: Path
) -> None:
    rt = runtime()
    rt.agent.add_manager(2, prefetch=1, prepare=venv_builder(tmp_path, broken=True))
    began = time.monotonic()
    bad = [rt.submit(A, pid) for _ in range(3)]
    good = rt.submit(None, pid)
    rt.wait(timeout=30)
    assert time.monotonic() - began < 10
    for task in bad:
        error = rt.value(task)
        assert isinstance(error, ConfigError)
        assert "python -m venv failed" in str(error) and "environment 'a'" in str(error)
    assert isinstance(rt.value(good), int)  # the node's own workers carry on
    again = rt.submit(A, pid)  # stays failed for that spec: no new build
    rt.wait(timeout=10)
    assert isinstance(rt.value(again), ConfigError)


def test_an_environment_whose_interpreter_is_gone_fails_its_tasks_and_the_manager_goes_on(
    runtime, tmp_path: Path
) -> None:
    """A worker that cannot be started at all (its interpreter gone, as an evicted
    cache entry's; a cgroup refused) raised out of the manager's loop: the loop ended,
    every task it held failed as RuntimeClosed, and the agent went on routing to it.
    Now it counts as a worker that died before starting: environment "a" fails as a
    failed build, and the node's own workers carry on."""
    rt = runtime()
    build = venv_builder(tmp_path)

    def gone(env: Environment) -> Prepared:
        made = build(env)
        if env.name != "a":
            return made
        removed = tmp_path / "removed"  # a venv whose directory went
        return Prepared(env, python=str(removed / "bin" / "python"), venv=str(removed))

    # socket counting: the interpreter exec'd at once (a counting cgroup's wrapper would
    # run first, and exit 127 as a worker that died)
    rt.agent.add_manager(2, prefetch=1, prepare=gone, networks=WorkerNetworks("socket"))
    bad = [rt.submit(A, pid) for _ in range(3)]
    good = rt.submit(None, pid)
    rt.wait(timeout=30)
    for task in bad:
        error = rt.value(task)
        assert type(error).__name__ == "WorkerLost", repr(error)
        assert "could not be started (FileNotFoundError" in str(error), str(error)
    assert isinstance(rt.value(good), int)
    later = [rt.submit(None, pid), rt.submit(B, pid)]  # the manager's loop still runs
    rt.wait(timeout=30)
    assert [type(rt.value(t)).__name__ for t in later] == ["int", "int"]


def test_a_manager_whose_python_cannot_be_started_fails_its_tasks_naming_it(runtime) -> None:
    rt = runtime()
    rt.agent.add_manager(
        1, prefetch=1, python="/nonexistent/bin/python", networks=WorkerNetworks("socket")
    )
    task = rt.submit(None, pid)
    rt.wait(timeout=30)
    error = rt.value(task)
    assert type(error).__name__ == "WorkerLost", repr(error)
    assert "could not be started (FileNotFoundError" in str(error)
    assert "/nonexistent/bin/python" in str(error)


def test_a_failed_build_across_managers_leaves_the_others_working(runtime, tmp_path: Path) -> None:
    rt = runtime()
    # one builder for both (its lock makes the venv once; two would race on one directory,
    # as two nodes never do: the real builders lock the cache entry across processes)
    builder = venv_builder(tmp_path, broken=True)
    for _ in range(2):
        rt.agent.add_manager(1, warm=[B], prefetch=1, prepare=builder)
    good = [rt.submit(B, nap, 0.02) for _ in range(10)]
    began = time.monotonic()
    bad = [rt.submit(A, pid) for _ in range(4)]
    rt.wait(timeout=60)
    assert all(isinstance(rt.value(t), ConfigError) for t in bad)
    assert max(t.record.ended for t in bad) - time.time() + time.monotonic() - began < 10
    assert all(isinstance(rt.value(t), int) for t in good), [repr(rt.value(t))[:300] for t in good]
    later = [rt.submit(A, pid) for _ in range(3)] + [rt.submit(B, pid) for _ in range(3)]
    rt.wait(timeout=30)
    assert [type(rt.value(t)).__name__ for t in later] == ["ConfigError"] * 3 + ["int"] * 3
    for m in rt.agent._managers:  # no slot held for the failed environment
        assert environment_tag(A) not in m.environments()[0]


def test_build_time_is_in_the_record_and_not_in_the_timeout(runtime, tmp_path: Path) -> None:
    rt = runtime()
    rt.agent.add_manager(1, warm=[], prefetch=1, prepare=venv_builder(tmp_path, wait=1.5))
    task = rt.submit(A, time.sleep, 0.2, timeout=1.0)  # a builtin: nothing to import
    rt.wait(timeout=60)
    assert task.status == Status.OK, rt.value(task)
    assert task.record.build_seconds >= 1.5
    slow = rt.submit(A, time.sleep, 3.0, timeout=1.0)  # the timeout itself still holds
    rt.wait(timeout=30)
    assert isinstance(rt.value(slow), TaskTimeoutError)


def test_two_environments_side_by_side_on_one_manager(runtime, tmp_path: Path) -> None:
    rt = runtime()
    geo = Environment("geo", requirements=["nothing-installed"])  # built as a bare venv here
    rt.agent.add_manager(2, prefetch=2, prepare=venv_builder(tmp_path))
    tasks = [rt.submit(geo if i % 2 else None, prefix) for i in range(20)]
    rt.wait(timeout=60)
    for i, task in enumerate(tasks):
        expected = str(tmp_path / geo.key) if i % 2 else sys.prefix
        assert rt.value(task) == expected
    geo_workers = {t.record.worker for i, t in enumerate(tasks) if i % 2}
    assert geo_workers.isdisjoint(t.record.worker for i, t in enumerate(tasks) if not i % 2)


def test_exactly_one_result_per_task_when_a_worker_of_one_environment_dies(runtime) -> None:
    rt = runtime()
    rt.agent.add_manager(2, warm=[A, B], prefetch=4)
    rt.agent.add_manager(2, warm=[A, B], prefetch=4)
    tasks = []
    for i in range(40):
        tasks.append(rt.submit(A if i % 2 else B, nap, 0.01))
        if i == 10:
            killer = rt.submit(A, die)
    rt.wait(timeout=60)
    assert set(rt.results.values()) == {1}
    assert type(rt.value(killer)).__name__ == "WorkerLost"
    wrong = {
        t.seq: (rt.value(t), t.record.worker, t.attempts, t.suspect)
        for t in tasks
        if not isinstance(rt.value(t), int)
    }
    assert not wrong, f"not an int (value, worker, attempts, suspect) by task: {wrong}"


def test_executor_environment_and_options(tmp_path: Path) -> None:
    with Executor(2, environment=A) as ex:
        a = {ex.submit(pid).result(timeout=30) for _ in range(4)}
        b = {ex.options(environment=B).submit(pid).result(timeout=30) for _ in range(4)}
        plain = ex.options(environment=None).submit(pid).result(timeout=30)
        assert a.isdisjoint(b) and plain not in a | b
        with pytest.raises(ConfigError, match=r"nimbus\.Environment"):  # as_environment's
            ex.options(environment=42)
        with pytest.raises(ConfigError, match="`nimbus environments build b"):
            ex.options(environment="b")  # a name: of one built on this node, else refused


def test_nimbus_environment_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIMBUS_ENVIRONMENT", '{"name": "geo"}')
    with Executor(1) as ex:
        assert ex._environment == Environment("geo")
    monkeypatch.setenv("NIMBUS_ENVIRONMENT", "{nope")
    with pytest.raises(ConfigError, match="NIMBUS_ENVIRONMENT"):
        Executor(1)


def test_the_environment_travels_to_managers_on_other_nodes(provided: Any) -> None:
    with Executor(2, backend="provided", settings=provided, environment=A) as ex:
        pids = {ex.submit(pid).result(timeout=60) for _ in range(4)}
        assert ex.options(environment=B).submit(pid).result(timeout=60) not in pids
        agent = ex._backend.agent  # type: ignore[attr-defined]
        deadline = time.monotonic() + 10
        seen: set[str] = set()
        while time.monotonic() < deadline and environment_tag(B) not in seen:
            time.sleep(0.2)  # the nodes say which environments they hold in their heartbeats
            seen = {tag for m in agent.remote_managers() for tag in m.slots}
        assert environment_tag(B) in seen


def test_nimbus_run_passes_the_environment_on() -> None:
    code = "import nimbus; print(nimbus.Executor(1)._environment.name)"
    out = subprocess.run(
        [sys.executable, "-m", "nimbus", "run", "--environment", '{"name": "geo"}', "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.stdout.strip() == "geo", out.stderr


def test_bench_routing_runs(tmp_path: Path) -> None:
    bench = Path(__file__).parent.parent / "bench" / "routing.py"
    small = ["--tasks", "60", "--nodes", "2", "--slots", "2", "--repeat", "20"]
    out = subprocess.run(
        [sys.executable, str(bench), *small, "--modes", "warm,oracle", "--json", f"{tmp_path}/r"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.returncode == 0, out.stderr
    assert "warm vs oracle" in out.stdout and "warm task round trip" in out.stdout
    assert "lower bound" in out.stdout
    rows = json.loads((tmp_path / "r").read_text())["rows"]
    assert rows["warm"]["failed"] == 0 and rows["oracle"]["cold_starts"] == 4
