"""A manager's workers, typed by environment: start them, retire them, settle the
tasks of those that die.

::

    the loop reconciles (the node's ``layout.Layout``): too few of a tag --> its build
        (``layout.Builds``, off the loop) --> start(prepared) --> Worker(env=tag)
    too many of a tag --> retiring: no new tasks; closed when idle
    a worker that dies: its task failed or sent again; a start that fails, counted
        (``START_FAILURES`` in a row: the environment's tasks fail)
"""

from __future__ import annotations

import functools
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from nimbus import errors, serialization  # errors.WorkerLost: made at its first use
from nimbus.environments import WORKER_VARIABLE, Prepared
from nimbus.errors import NimbusError, TaskTimeoutError
from nimbus.network import WorkerNetworks
from nimbus.runtime import popen_fork
from nimbus.runtime.layout import Builds, Layout
from nimbus.runtime.messages import Status
from nimbus.runtime.task import Task
from nimbus.wire import Channel

__all__ = [
    "START_FAILURES",
    "WORKER_MAIN",
    "Worker",
    "Workers",
    "how",
    "start",
    "worker_environment",
]

log = logging.getLogger("nimbus.runtime.manager")  # (the manager's: this is its half)
START_FAILURES = 3  # workers that die before saying hello, in a row, before giving up

# run through an import, not ``-m``, so the module is ``nimbus.runtime.worker`` for
# the task code that calls its functions, not ``__main__``
WORKER_MAIN = "import sys; from nimbus.runtime.worker import main; sys.exit(main())"


class Worker:
    """One worker process of environment ``env`` (a tag; "" is the node's own Python)."""

    __slots__ = (
        "born",
        "channel",
        "deadline",
        "env",
        "functions",
        "head_since",
        "host",
        "inflight",
        "kill_reason",
        "kill_task",
        "name",
        "net",
        "pid",
        "proc",
        "ready",
        "recalling",
        "retiring",
        "writing",
    )

    def __init__(self, name: str, proc: Any, channel: Channel, env: str = "") -> None:
        self.name = name
        self.proc = proc
        self.channel = channel
        self.env = env
        self.born = time.monotonic()
        self.inflight: deque[Task] = deque()
        self.functions: set[str] = set()
        self.ready = False
        self.writing = False
        self.pid = proc.pid
        self.host = ""
        self.deadline: float | None = None
        self.kill_reason = ""
        self.kill_task: Task | None = None
        self.recalling = False  # a RECALL is on its way: wait for its HANDBACK
        self.retiring = False  # its slot went to another environment: closed when idle
        self.head_since = 0.0  # when the first inflight task was said to be running
        self.net: dict[str, Any] | None = None  # its last network fields (a row's None: these)


def worker_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for worker processes: this one, with this ``sys.path``."""
    env = dict(os.environ)
    paths = [p or os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if extra:
        env.update(extra)
    return env


def how(returncode: int | None) -> str:
    if returncode is None:
        return "closed its channel"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def start(
    child: socket.socket,
    python: str,
    environ: Mapping[str, str],
    preload: list[str],
    prepared: Prepared | None,
    net: Callable[[list[str]], list[str]] | None = None,
) -> subprocess.Popen[bytes]:
    """A worker process on ``child`` (its end of the channel), in ``prepared`` if given,
    in the network context ``net`` wraps it in (``nimbus.network``) if given."""
    argv = [python, "-u", "-c", WORKER_MAIN, str(child.fileno()), *preload]
    env: Mapping[str, str] = environ
    if prepared is not None:
        argv = prepared.command(argv)
        env = prepared.environ(environ)
    elif WORKER_VARIABLE in environ:  # a node inside an environment's worker: not this one
        env = {k: v for k, v in environ.items() if k != WORKER_VARIABLE}
    if net is not None:
        argv = net(argv)
    return subprocess.Popen(
        argv,
        pass_fds=(child.fileno(),),
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


class Workers:
    """The manager's side of its workers: start them in their environment, retire
    them, and settle the tasks of those that die (mixed into ``Manager``, whose
    loop thread alone calls these)."""

    name: str
    size: int
    layout: Layout
    _builds: Builds
    _building: dict[str, int]
    _changes: int
    _retiring: bool
    _reap: list[Worker]
    _env_failures: dict[str, int]
    _start_failures: int
    _closing: bool
    _kill: bool
    _fork: bool
    _python: str
    _env: dict[str, str]
    _preload: list[str]
    _counter: int
    _spawned: int
    _lost: int
    _workers: list[Worker]
    _pending: dict[str, deque[Task]]
    _selector: selectors.BaseSelector
    _wake_r: int
    _wake_w: int
    _net: WorkerNetworks
    _descriptors: set[int] | None

    def _deliver(self, tasks: list[Task]) -> None:
        raise NotImplementedError  # the manager's

    def _fail_all(self, error: NimbusError) -> None:
        raise NotImplementedError  # the manager's

    def _stop_workers(self) -> None:
        """The loop ends: close every worker's channel (kill them with ``_kill``), wait
        for them (2 s, then kill) and for the retired ones, and close the loop's files."""
        self._closing = True
        for worker in self._workers:
            worker.channel.close()
            if self._kill:
                worker.proc.kill()
        deadline = time.monotonic() + 2.0
        for worker in self._workers:
            try:
                worker.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()
        for proc in [w.proc for w in self._reap]:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._workers.clear()
        self._net.close()
        self._selector.close()
        wake_w, self._wake_w = self._wake_w, -1
        os.close(wake_w)
        os.close(self._wake_r)

    def _reconcile(self) -> None:
        """Make the workers match the layout: retire surplus ones, start missing ones."""
        self._changes = self.layout.changes
        slots, _ = self.layout.snapshot()
        count: dict[str, int] = dict(self._building)
        for worker in self._workers:
            if not worker.retiring:
                count[worker.env] = count.get(worker.env, 0) + 1
        for worker in self._workers:  # about to retire, but its slot came back
            if worker.retiring and count.get(worker.env, 0) < slots.get(worker.env, 0):
                worker.retiring = False
                count[worker.env] = count.get(worker.env, 0) + 1
        for tag, n in list(count.items()):
            surplus = n - slots.get(tag, 0)
            if surplus <= 0:
                continue
            mine = [w for w in self._workers if w.env == tag and not w.retiring]
            mine.sort(key=lambda w: (w.ready, -len(w.inflight)))  # starting, then idle first
            for worker in mine[:surplus]:
                worker.retiring = True
                count[tag] -= 1
        self._retiring = False
        for worker in [w for w in self._workers if w.retiring]:
            if worker.inflight:
                self._retiring = True  # looked at again as it empties
            else:
                self._retire(worker)  # idle, or still starting: its start is not waited for
        free = self.size - len(self._workers) - sum(self._building.values())
        for tag, want in slots.items():
            missing = min(free, want - count.get(tag, 0))
            for _ in range(max(0, missing)):
                self._spawn(tag)
                free -= 1

    def _retire(self, worker: Worker) -> None:
        """Stop an idle worker whose slot went to another environment."""
        self._selector.unregister(worker.channel.sock)
        worker.channel.close()  # it reads the end of its channel and exits
        if not worker.ready:
            worker.proc.kill()  # still importing: no need to wait for it
        self._workers.remove(worker)
        self._reap.append(worker)
        self._reaped()

    def _reaped(self) -> bool:
        """Wait for the retired workers that exited (else each stays a zombie until the
        next retirement) and release what the network made for them (their slot and
        cgroup were held until the manager stopped); True while some have not exited yet
        (the loop looks again soon)."""
        if self._reap:
            exiting = []
            for worker in self._reap:
                if worker.proc.poll() is None:
                    exiting.append(worker)
                else:
                    self._net.release(worker.name)
            self._reap = exiting
        return bool(self._reap)

    def _built(self) -> None:
        """Builds that ended: start their workers, or fail their environment's tasks."""
        builds = self._builds
        while builds.done:
            tag = builds.done.popleft()
            builds.running.discard(tag)
            waiting = self._building.pop(tag, 0)
            error = builds.failed.get(tag)
            if error is not None:
                self.layout.release(tag)
                self._fail_env(tag, error)
                if waiting:
                    self._reconcile()  # the slots it held while building go to others
                continue
            seconds = builds.seconds.get(tag, 0.0)
            for task in self._pending.get(tag, ()):
                task.record.build_seconds = seconds
            if waiting:
                self._reconcile()  # as many as the layout wants now (it may have changed)

    def _fail_env(self, tag: str, error: BaseException) -> None:
        queue = self._pending.get(tag)
        failed = list(queue or ())
        if queue:
            queue.clear()
        for task in failed:
            self._fail(task, error)
        if failed:
            self._deliver(failed)

    def _idle_env(self, tag: str) -> bool:
        """Nothing of ``tag`` waits here and one of its workers is idle: it can give a slot."""
        if self._pending.get(tag):
            return False
        return any(w.env == tag and not w.inflight for w in self._workers) or tag in self._building

    def _spawn(self, tag: str = "") -> None:
        prepared: Prepared | None = None
        if tag in self._builds.failed:  # stays failed: its slots go back
            self.layout.release(tag)
            return
        if tag:
            prepared = self._builds.prepared.get(tag)
            if prepared is None:  # built off the loop; started when the build ends
                env = self.layout.envs.get(tag)
                assert env is not None
                self._building[tag] = self._building.get(tag, 0) + 1
                self._builds.start(tag, env)
                return
        for _ in range(START_FAILURES):
            try:
                worker = self._start(tag, prepared)
                break
            except Exception as exc:  # no process (an interpreter gone, a cgroup refused):
                error = exc  # as a worker that died before starting, not the loop's end
                log.warning("nimbus %s: a worker could not be started: %r", self.name, exc)
                self._count_start_failure(tag)
        else:
            self._give_up(tag, f"could not be started ({type(error).__name__}: {error})")
            return
        self._workers.append(worker)
        self._selector.register(worker.channel.sock, selectors.EVENT_READ, worker)
        self._spawned += 1

    def _start(self, tag: str, prepared: Prepared | None) -> Worker:
        """A new worker's process and channel; raises if it cannot be started."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._counter += 1
        name = f"{self.name}/w{self._counter}"
        proc: Any
        try:
            if self._fork and not tag:
                others = [w.channel.sock for w in self._workers]
                close: list[Callable[[], object]] = [parent.close, self._selector.close]
                close += [s.close for s in others]
                close += [lambda: os.close(self._wake_r), lambda: os.close(self._wake_w)]
                proc = popen_fork.fork_worker(child, close, self._preload, self._descriptors)
            else:
                net = functools.partial(self._net.command, name)
                proc = start(child, self._python, self._env, self._preload, prepared, net)
        except BaseException:
            parent.close()
            self._net.release(name)  # what the network made for it (a slot, a cgroup)
            raise
        finally:
            child.close()
        parent.setblocking(False)
        return Worker(name, proc, Channel(parent), tag)

    def _grow(self, tag: str, pending: deque[Task], limit: int) -> None:
        """Tasks of ``tag`` wait: fail them if its build failed, else plan more slots for it."""
        error = self._builds.failed.get(tag)
        if error is not None:
            self._fail_env(tag, error)
            return
        layout = self.layout
        if len(self._pending) == 1 and layout.unused <= 0:
            return  # one environment on a full node: nothing to plan (the plain hot path)
        inflight = sum(len(w.inflight) for w in self._workers if w.env == tag)
        want = -(-(len(pending) + inflight) // limit)
        if want > layout.slots.get(tag, 0):
            layout.plan(tag, want, self._idle_env)

    def _worker_lost(self, worker: Worker) -> None:
        self._selector.unregister(worker.channel.sock)
        worker.channel.close()
        self._workers.remove(worker)
        try:
            code = worker.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            code = worker.proc.wait()
        self._net.release(worker.name)
        self._lost += 1
        tag = worker.env
        if not worker.ready:
            self._count_start_failure(tag)
        if worker.inflight:
            self._settle(worker, code)
        if self._closing and not self._drop_cancelled(tag):
            return  # (tasks still to run, given back by it: a worker takes its place)
        if self._give_up(tag, f"{how(code)} before starting"):
            return
        self._reconcile()  # a new worker of its environment takes its place

    def _count_start_failure(self, tag: str) -> None:
        if tag:
            self._env_failures[tag] = self._env_failures.get(tag, 0) + 1
        else:
            self._start_failures += 1

    def _give_up(self, tag: str, what: str) -> bool:
        """After START_FAILURES workers of ``tag`` in a row that never started: fail its
        tasks (an environment's: as a failed build of it; the node's own: all, and close);
        True if it did."""
        if tag and self._env_failures.get(tag, 0) >= START_FAILURES:
            # a worker that cannot start in its environment is a failed build of it
            self._builds.failed[tag] = errors.WorkerLost(
                f"{START_FAILURES} workers of environment {self.layout.envs[tag]!r} on "
                f"{self.name} in a row {what}; see their output on stderr"
            )
            self.layout.release(tag)
            self._fail_env(tag, self._builds.failed[tag])
            self._reconcile()
            return True
        if not tag and self._start_failures >= START_FAILURES:
            self._fail_all(
                errors.WorkerLost(
                    f"{self._start_failures} workers of {self.name} in a row {what} "
                    f"(python: {self._python}); see their output on stderr"
                )
            )
            self._closing = True
            return True
        return False

    def _drop_cancelled(self, tag: str) -> bool:
        """Answer the cancelled tasks waiting for a worker of ``tag`` as skipped (a
        closing manager starts no worker to drop them at dispatch); True if others wait."""
        queue = self._pending.get(tag)
        if not queue:
            return False
        dropped = [task for task in queue if task.cancelled]
        if dropped:
            for task in dropped:
                queue.remove(task)
                task.status, task.data, task.result_buffers = Status.SKIPPED, b"", []
            self._deliver(dropped)
        return bool(queue)

    def _settle(self, worker: Worker, code: int | None) -> None:
        """Decide the fate of the tasks a dead worker held.

        The running task, when the worker said which, fails (or is counted as
        cancelled or timed out when we killed it for that). When the worker had
        not said, the task that killed it is not known: all go back to the
        queue as suspects, which run with a started mark, so one that kills
        its next worker too is known and failed then.
        """
        head: Task | None = worker.inflight[0]
        assert head is not None
        suspect = False
        if worker.kill_reason and head is worker.kill_task:
            worker.inflight.popleft()
            if worker.kill_reason == "cancel":
                head.status, head.data = Status.SKIPPED, b""
            else:
                self._fail(
                    head,
                    TaskTimeoutError(
                        f"the task ran longer than its timeout of {head.timeout} s; "
                        f"its worker {worker.name} (pid {worker.pid}) was stopped and replaced"
                    ),
                )
        elif worker.kill_reason:
            head = None  # killed for a task that had just finished: the rest is innocent
        elif head.started:
            worker.inflight.popleft()
            self._fail(
                head,
                self._net.lost(worker.name)  # over its memory limit: MemoryLimitExceeded
                or errors.WorkerLost(
                    f"the worker {worker.name} (pid {worker.pid}) running this task "
                    f"{how(code)}; it was replaced and the other tasks carry on"
                ),
            )
        else:
            head, suspect = None, True
        for task in worker.inflight:
            task.suspect = task.suspect or suspect
            task.started = False
        self._pending[worker.env].extendleft(reversed(worker.inflight))
        worker.inflight.clear()
        if head is not None:
            self._deliver([head])

    @staticmethod
    def _fail(task: Task, error: BaseException) -> None:
        task.status = Status.ERROR
        task.data = serialization.dumps_exception(error, "")
        task.result_buffers = []
