"""A manager: owns one node's warm workers and feeds them tasks.

::

    submit() --> pending[env] --(window)--> worker 0 of env (inflight: t1 t2 t3)
                   ^  ^                   \\-> worker 1 of env (inflight: t4 t5)
                   |  |                                    |
                   |  +-- HANDBACK t2 t3 <-- RECALL -------+ worker 2 idle, t1 long
                   +---- requeue the waiting tasks --------+ worker lost
    on_results(tasks) <-------- RESULTS in send order -----+
                   pending[env], no worker of env --> Layout: a slot for env
                   (unused, or an idle environment's) --> build off the loop --> worker

Workers are typed by environment (``nimbus.runtime.pool``): each
environment has its own pending queue and its own workers; tasks go only to
workers of their environment. The node's slots are shared out by a
:class:`~nimbus.runtime.layout.Layout`: the agent reserves slots for the
environments it routes here, and the manager itself grows an environment
whose tasks wait, from unused slots, then from idle environments. An
environment is built (``nimbus.environments.prepare``) on a thread, never on
the loop; a build that fails fails the environment's waiting tasks with the
builder's message, and the time a task waited for its build goes in its
record (``build_seconds``), not against its timeout.

Everything happens on one loop thread: a selector over the workers'
channels and a wake-up pipe. A worker holds at most ``prefetch`` tasks and
answers them in order; it says which task it has started before any task that
may take long, and within 2 ms of the start of any other. When a worker dies,
the task it said it was running fails with :class:`~nimbus.errors.WorkerLost`
(or :class:`~nimbus.errors.TaskTimeoutError` / is cancelled when the manager
killed it for that), the others go back to the front of the pending queue, and
a new worker takes its place. If it had not said (a task of a function that
was quick before died in its first 2 ms), nobody is blamed: the unanswered
tasks go back as suspects and run with a started mark, so the culprit is
known when it kills its next worker. Every task gets exactly one result.

No task waits in one worker's window while another worker is idle: when a
worker is idle and nothing is pending, the manager recalls the queued (not
started) tasks of a worker of the same environment whose window holds more
than ``STEAL_SECONDS`` of work, counting its running task, and deals them out
again (work stealing).
The worker answers a RECALL at once, even while a task runs. How long a task
takes is learned per function from its run times; a function not yet timed
counts as long, so the first tasks of a fresh executor spread over the
workers as they come up, whatever the prefetch.
"""

from __future__ import annotations

import logging
import os
import selectors
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from nimbus import environments, errors, network  # errors.WorkerLost: at first use
from nimbus.environments import Environment, Prepared
from nimbus.errors import NimbusError
from nimbus.runtime import popen_fork
from nimbus.runtime._orders import NodeOrders
from nimbus.runtime.layout import Builds, Layout
from nimbus.runtime.messages import INLINE_LIMIT, PYTHON, Kind, Status
from nimbus.runtime.pool import Worker as _Worker
from nimbus.runtime.pool import Workers, worker_environment
from nimbus.runtime.task import Task, environment_tag
from nimbus.wire import ProtocolError, pack, unpack

__all__ = ["Manager", "worker_environment"]

log = logging.getLogger(__name__)

QUEUED_SECONDS = 0.010  # work a worker holds ahead: deeper windows for short tasks
STEAL_SECONDS = 0.050  # queued work worth moving to an idle worker (5 windows' worth)
FUNCTIONS_TIMED = 1024  # run-time estimates kept (one per function), oldest dropped
MAX_WINDOW = 256  # tasks a worker may hold at most, however short
REAP_EVERY = 0.1  # seconds between two looks at retired workers not yet exited


class Manager(Workers, NodeOrders):
    """Warm workers on this node, fed from a pending queue per environment by one loop thread.

    ``warm`` lists the environments of the workers started at once (default:
    ``workers`` workers of the node's own Python, as before environments); the
    other slots start unused. ``prepare`` makes an environment ready on the
    node (``nimbus.environments.prepare``; the builders' seam). ``order`` builds or
    removes an environment here when asked (``nimbus.runtime._orders``).
    """

    def __init__(
        self,
        workers: int,
        *,
        on_results: Callable[[list[Task]], None],
        on_dispatch: Callable[[list[Task]], list[Task]] | None = None,
        on_notice: Callable[[Any], None] | None = None,
        prefetch: int = 8,
        python: str | None = None,
        env: Mapping[str, str] | None = None,
        preload: Sequence[str] = (),
        name: str = "manager",
        fork: bool = False,
        warm: Sequence[Environment | None] | None = None,
        prepare: Callable[[Environment], Prepared] = environments.prepare,
        networks: network.WorkerNetworks | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"a manager needs at least one worker, not {workers}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, not {prefetch}")
        self.name = name
        self.size = workers
        self.prefetch = prefetch
        self._on_results = on_results
        self._on_dispatch = on_dispatch
        self._on_notice = on_notice
        self._python = python or sys.executable
        self._env = worker_environment(env)
        self._preload = list(preload)
        self._fork = fork  # workers are forks of this process (popen_fork.fork_worker)
        # namespaces, limits (issue 19): as given (an Executor's settings), else configured
        self._net = networks or network.WorkerNetworks.configured()
        # the descriptors of the first forked workers: those forked later keep only these
        self._descriptors: set[int] | None = None
        warm = [None] * workers if warm is None else list(warm)
        self.layout = Layout(workers, [environment_tag(env) for env in warm])
        for spec in warm:
            self.layout.envs.setdefault(environment_tag(spec), spec)
        self._builds = Builds(prepare, self._wake)
        self._building: dict[str, int] = {}  # workers waiting for their environment's build
        self._changes = -1  # the layout's changes the loop has acted on
        self._env_failures: dict[str, int] = {}  # workers of an environment dead at start
        self._pending: dict[str, deque[Task]] = {"": deque()}
        self._cancels: deque[Task] = deque()
        self._init_orders()  # environment orders: build, remove (nimbus.runtime._orders)
        self._reap: list[_Worker] = []  # retired workers, not yet exited
        self._retiring = False  # some worker waits to empty before it is retired
        self._workers: list[_Worker] = []
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._woken = False
        self._closing = False
        self._kill = False
        self._thread = threading.Thread(target=self._run, name=f"nimbus-{name}", daemon=True)
        self._spawned = 0
        self._lost = 0
        self._start_failures = 0
        self._counter = 0
        self._run_avg: float | None = None  # moving average of task run time, seconds
        self._start_avg: float | None = None  # ... of a worker's start (a cold start)
        self._fn_time: dict[str, float] = {}  # function key -> its moving average run time
        self._recalls = 0
        self._recheck: float | None = None  # look again for work to steal then
        self.stopped = threading.Event()
        self._forked = threading.Event()  # the first workers are forked (or failed to be)

    # -- called from any thread -----------------------------------------
    def start(self) -> None:
        self._thread.start()
        if self._fork:
            # a forked worker keeps every descriptor this process has open as it forks:
            # the caller waits (milliseconds), so that none it opens meanwhile (a scan of
            # a directory, a pipe) is in one worker and not another, nor in their children
            self._forked.wait()

    def submit(self, tasks: Iterable[Task]) -> None:
        """Queue tasks; results arrive through ``on_results``."""
        if self._closing:
            raise RuntimeError(f"cannot submit to {self.name}: it is shutting down")
        queues = self._pending
        for task in tasks:
            queue = queues.get(task.env)
            if queue is None:
                self.layout.envs.setdefault(task.env, task.environment)
                queue = queues.setdefault(task.env, deque())
            queue.append(task)
        self._wake()

    def reserve(self, env: Environment | None, take_from: str | None = None) -> bool:
        """One more worker slot for ``env``: an unused one, else one of ``take_from``'s.

        Refused for an environment whose build failed here (its tasks fail at once)."""
        tag = environment_tag(env)
        if tag in self._builds.failed:
            return False
        done = self.layout.reserve(tag, env, take_from)
        if done:
            self._wake()
        return done

    def environments(self) -> tuple[dict[str, int], int, int]:
        """Slots per environment tag, unused slots and tasks per worker (the window)."""
        slots, unused = self.layout.snapshot()
        return slots, unused, self.window()

    def costs(self) -> tuple[float | None, float | None]:
        """Seconds a task runs and a worker takes to start, on average (None: not seen)."""
        return self._run_avg, self._start_avg

    def cancel(self, task: Task) -> None:
        """Stop a task: drop it if queued, skip it at its worker, or kill the worker."""
        task.cancelled = True
        self._cancels.append(task)
        self._wake()

    def shutdown(self, wait: bool = True, *, kill: bool = False) -> None:
        """Stop once the outstanding tasks are done (or at once, with ``kill``)."""
        self._closing = True
        self._kill = self._kill or kill
        self._wake()
        if (
            wait
            and self._thread.ident is not None
            and threading.current_thread() is not self._thread
        ):
            # not join(): on 3.11 a join interrupted by Ctrl-C marks the thread stopped
            # (bpo-45274), and a second shutdown (kill) would not wait for its workers
            self.stopped.wait()

    def statistics(self) -> dict[str, Any]:
        """What the node holds; ``environments``: per tag its ``slots``, ready ``workers``
        and ``free`` (idle) ones; ``unused``: slots of no environment."""
        workers = list(self._workers)
        slots, unused = self.layout.snapshot()
        envs: dict[str, dict[str, Any]] = {}
        for tag in {*slots, *(w.env for w in workers)}:
            env = self.layout.envs.get(tag)
            mine = [w for w in workers if w.env == tag and w.ready and not w.retiring]
            envs[tag] = {
                "name": env.name if env is not None else "plain",
                "slots": slots.get(tag, 0),
                "workers": len(mine),
                "free": sum(1 for w in mine if not w.inflight),
            }
        return {
            "name": self.name,
            "workers": len(workers),
            "ready": sum(w.ready for w in workers),
            "pending": sum(len(q) for q in list(self._pending.values())),
            "environments": envs,
            "unused": unused,
            "inflight": self._inflight(),
            "spawned": self._spawned,
            "lost": self._lost,
            "recalls": self._recalls,
            "pids": [w.pid for w in self._workers],
        }

    def _wake(self) -> None:
        if not self._woken and self._wake_w >= 0:
            self._woken = True
            try:
                os.write(self._wake_w, b"x")
            except OSError:  # closed: the loop is gone
                pass

    # -- the loop thread ----------------------------------------------
    def _run(self) -> None:
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        if self._fork:
            self._descriptors = popen_fork.open_descriptors()
        try:
            try:
                self._reconcile()
            finally:
                self._forked.set()
            while True:
                for key, mask in self._selector.select(self._timeout()):
                    worker = key.data
                    if worker is None:
                        # drain, then clear: a submit between the two leaves the flag
                        # clear (and maybe a byte in the pipe: a spurious wake-up), and
                        # the dispatch below sees its tasks. The other order could
                        # leave the flag set with an empty pipe, and no wake-up ever.
                        try:
                            while os.read(self._wake_r, 4096):
                                pass
                        except BlockingIOError:
                            pass
                        self._woken = False
                        continue
                    if mask & selectors.EVENT_WRITE:
                        self._flush(worker)
                    if mask & selectors.EVENT_READ and worker in self._workers:
                        self._read(worker)
                if self._kill:
                    self._fail_all(errors.RuntimeClosed(f"{self.name} was shut down"))
                    break
                self._do_cancels()
                if self._ordered:
                    self._do_orders()
                self._check_deadlines()
                if self._builds.done:
                    self._built()
                self._dispatch()
                if self.layout.changes != self._changes or self._retiring:
                    self._reconcile()
                if self._closing and not self._queued() and not self._inflight():
                    break
        except BaseException as exc:  # a bug here must not leave callers waiting forever
            log.exception("nimbus %s loop failed", self.name)
            self._fail_all(errors.RuntimeClosed(f"{self.name} failed: {type(exc).__name__}: {exc}"))
        finally:
            self._stop_workers()
            self.stopped.set()

    def _inflight(self) -> int:
        return sum(len(w.inflight) for w in self._workers)

    def _queued(self) -> int:
        return sum(len(queue) for queue in list(self._pending.values()))

    def _timeout(self) -> float | None:
        deadlines = [w.deadline for w in self._workers if w.deadline is not None]
        if self._recheck is not None:
            deadlines.append(self._recheck)
        if self._reaped():  # a retired worker still exiting: wait for it soon
            deadlines.append(time.monotonic() + REAP_EVERY)
        if not deadlines:
            return None
        # capped: epoll takes at most ~24 days, and a far deadline is looked at again anyway
        return min(3600.0, max(0.0, min(deadlines) - time.monotonic()))

    def _read(self, worker: _Worker) -> None:
        try:
            frames = worker.channel.receive()
        except (OSError, ProtocolError, ValueError):
            frames = None
        if frames is None:
            self._worker_lost(worker)
            return
        for frame in frames:
            if frame.kind == Kind.RESULTS:
                rows, started = unpack(frame.meta)
                if rows:
                    self._results(worker, rows, frame.buffers)
                head = worker.inflight[0] if worker.inflight else None
                if started is not None and head is not None and head.seq == started:
                    head.started = True
                    worker.head_since = time.monotonic()
                    if head.timeout is not None:
                        worker.deadline = time.monotonic() + head.timeout
            elif frame.kind == Kind.HANDBACK:
                self._handed_back(worker, unpack(frame.meta))
            elif frame.kind == Kind.NOTICE:
                if self._on_notice is not None:
                    try:
                        self._on_notice(unpack(frame.meta))
                    except Exception:
                        log.exception("nimbus %s: a notice callback failed", self.name)
            elif frame.kind == Kind.HELLO:
                hello = unpack(frame.meta)
                worker.host = hello["host"]
                worker.ready = True
                took = time.monotonic() - worker.born
                avg = self._start_avg
                self._start_avg = took if avg is None else avg + 0.25 * (took - avg)
                self._start_failures = 0
                self._env_failures.pop(worker.env, None)

    def _results(self, worker: _Worker, rows: list[list[Any]], buffers: list[Any]) -> None:
        done: list[Task] = []
        position = 0
        for row in rows:
            seq, status, data, nbufs = row[0], row[1], row[2], row[3]
            task = worker.inflight.popleft()
            if task.seq != seq:
                raise ProtocolError(f"{worker.name} answered task {seq}, expected {task.seq}")
            worker.deadline = None
            if data is None:
                data = buffers[position]
                task.result_buffers = buffers[position + 1 : position + nbufs]
            else:
                task.result_buffers = buffers[position : position + nbufs]
            position += nbufs
            task.status, task.data = status, data
            record = task.record
            (record.started, record.ended, record.cpu_user, record.cpu_system) = row[4:8]
            (record.peak_memory, record.net_bytes_in, record.net_bytes_out) = row[8:11]
            if len(row) > 11:  # a counted worker's fields; None: the same as its last
                net = row[11]
                if net is None:
                    net = worker.net
                else:
                    worker.net = net
                if net is not None:
                    record.add_network(net)  # (each record its own dicts)
            record.worker, record.host, record.pid = worker.name, worker.host, worker.pid
            if status != Status.SKIPPED:
                self._timed(task.fn_key, record.ended - record.started)
            done.append(task)
        self._deliver(done)

    def _deliver(self, tasks: list[Task]) -> None:
        try:
            self._on_results(tasks)
        except Exception:
            log.exception("nimbus %s: a result callback failed", self.name)

    def _timed(self, fn_key: str, seconds: float) -> None:
        """Learn from one run time: the moving averages, overall and of the function."""
        avg = self._run_avg
        self._run_avg = seconds if avg is None else avg + 0.05 * (seconds - avg)
        times = self._fn_time
        known = times.pop(fn_key, None)  # re-inserted: the dict's order is last use
        times[fn_key] = seconds if known is None else known + 0.25 * (seconds - known)
        if len(times) > FUNCTIONS_TIMED:
            del times[next(iter(times))]

    def window(self) -> int:
        """Tasks a worker may hold: ``prefetch``, more for short tasks (about 10 ms of work).

        A deep window keeps workers busy when this thread waits for the GIL
        (the caller submitting in a loop); long tasks keep the shallow one, so
        they spread evenly over the workers. Before any task has run, tasks
        count as long: the window is ``prefetch``.
        """
        if self._run_avg is None:
            return self.prefetch
        return max(self.prefetch, min(MAX_WINDOW, int(QUEUED_SECONDS / max(self._run_avg, 1e-6))))

    def _dispatch(self) -> None:
        self._recheck = None  # a past one would make the loop spin
        limit = self.window()
        waiting = False
        queues = self._pending
        # one environment (the plain hot path): no copy of the dict
        for tag, pending in (
            [next(iter(queues.items()))] if len(queues) == 1 else list(queues.items())
        ):
            if pending:
                self._deal(tag, pending, limit)
            if pending:
                waiting = True
                self._grow(tag, pending, limit)
        if not waiting:
            self._steal()

    def _deal(self, tag: str, pending: deque[Task], limit: int) -> None:
        while pending:
            ready = [
                w
                for w in self._workers
                if w.ready and w.env == tag and len(w.inflight) < limit and not w.retiring
            ]
            if not ready:
                return
            ready.sort(key=lambda w: len(w.inflight))  # idle workers first
            # dealt in turn, as cards: the first tasks start first (2 workers
            # run tasks 0 and 1, then 2 and 3; not 0 and 2)
            rooms = [limit - len(worker.inflight) for worker in ready]
            batches: list[list[Task]] = [[] for _ in ready]
            while pending and any(rooms):
                for i, room in enumerate(rooms):
                    if room and pending:
                        batches[i].append(pending.popleft())
                        rooms[i] = room - 1
            for worker, batch in zip(ready, batches):
                if batch and self._on_dispatch is not None:
                    batch = self._on_dispatch(batch)
                if batch:
                    self._send(worker, batch)

    def _steal(self) -> None:
        """Recall the queued tasks of busy workers when others are idle.

        A worker is robbed when its window holds more than ``STEAL_SECONDS``
        of work, by the estimates: a function never timed counts as long, and
        the running task as long as it has run if that is longer than its
        function's average. Short tasks in a deep window (about
        ``QUEUED_SECONDS`` of work) are left alone: moving them costs more than
        it saves. A worker whose running task has said it started (it may be
        long) is looked at again a little later, as that task runs on.
        """
        busy = [w for w in self._workers if len(w.inflight) > 1 and not w.recalling]
        if not busy:
            return
        idle: dict[str, int] = {}
        for w in self._workers:
            if w.ready and not w.inflight and not w.retiring:
                idle[w.env] = idle.get(w.env, 0) + 1
        if not idle:
            return
        busy.sort(key=lambda w: len(w.inflight), reverse=True)
        now = time.monotonic()
        times = self._fn_time
        for worker in busy:
            if not idle.get(worker.env):
                continue
            head = worker.inflight[0]
            wait = times.get(head.fn_key, float("inf"))
            if head.started:
                wait = max(wait, now - worker.head_since)
            for task in worker.inflight:
                if wait > STEAL_SECONDS:
                    break
                if task is not head:
                    wait += times.get(task.fn_key, float("inf"))
            if wait <= STEAL_SECONDS:
                if head.started:  # no frame may come while it runs: look again then
                    self._recheck = now + QUEUED_SECONDS
                continue
            queued = [task.seq for task in worker.inflight][1:]
            worker.channel.send(Kind.RECALL, pack(queued))
            self._flush(worker)
            worker.recalling = True
            self._recalls += 1
            idle[worker.env] -= 1

    def _handed_back(self, worker: _Worker, seqs: list[int]) -> None:
        """Tasks a worker dropped unstarted at a RECALL go back to the front of the queue."""
        worker.recalling = False
        if not seqs:
            return
        back = set(seqs)
        tasks = [task for task in worker.inflight if task.seq in back]
        kept = [task for task in worker.inflight if task.seq not in back]
        worker.inflight.clear()
        worker.inflight.extend(kept)
        self._pending[worker.env].extendleft(reversed(tasks))

    def _send(self, worker: _Worker, batch: list[Task]) -> None:
        rows: list[list[Any]] = []
        buffers: list[Any] = []
        now = time.time()
        for task in batch:
            fn_bytes = None
            if task.fn_key not in worker.functions:
                worker.functions.add(task.fn_key)
                fn_bytes = task.fn_bytes
            notify = task.timeout is not None or task.suspect
            if len(task.payload) > INLINE_LIMIT:
                rows.append([task.seq, task.fn_key, fn_bytes, None, len(task.buffers) + 1, notify])
                buffers.append(task.payload)
            else:
                rows.append(
                    [task.seq, task.fn_key, fn_bytes, task.payload, len(task.buffers), notify]
                )
            buffers.extend(task.buffers)
            task.record.dispatched = now
            task.attempts += 1
            worker.inflight.append(task)
        worker.channel.send(Kind.TASKS, pack([PYTHON, rows]), buffers)
        self._flush(worker)

    def _flush(self, worker: _Worker) -> None:
        try:
            done = worker.channel.flush()
        except OSError:
            return  # the read side sees the end of the stream and handles the loss
        if done != (not worker.writing):
            worker.writing = not done
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if worker.writing else 0)
            self._selector.modify(worker.channel.sock, events, worker)

    def _do_cancels(self) -> None:
        while self._cancels:
            task = self._cancels.popleft()
            for worker in self._workers:
                if task in worker.inflight:
                    if worker.inflight[0] is task and task.started:
                        if not task.skip_only:  # shutdown(cancel_futures): a running one runs on
                            self._kill_worker(worker, "cancel", task)
                    else:
                        worker.channel.send(Kind.CANCEL, pack([task.seq]))
                        self._flush(worker)
                    break

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for worker in self._workers:
            if worker.deadline is not None and worker.deadline <= now and worker.inflight:
                worker.deadline = None
                self._kill_worker(worker, "timeout", worker.inflight[0])

    def _kill_worker(self, worker: _Worker, reason: str, task: Task) -> None:
        """Kill a worker because of ``task`` (only that task is charged for it)."""
        if not worker.kill_reason:
            worker.kill_reason, worker.kill_task = reason, task
            worker.proc.kill()

    def _fail_all(self, error: NimbusError) -> None:
        failed: list[Task] = []
        for queue in list(self._pending.values()):
            failed.extend(queue)
            queue.clear()
        for worker in self._workers:
            failed.extend(worker.inflight)
            worker.inflight.clear()
        for task in failed:
            self._fail(task, error)
        if failed:
            self._deliver(failed)
