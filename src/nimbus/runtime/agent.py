"""The agent: one per endpoint; routes tasks to managers and results back.

::

    submit(tasks) --> Agent --route by free capacity--> Manager (node 1) --> workers
                        ^                          \\--> Manager (node 2) --> workers
    on_results(tasks) <-+------------- results -------------/

The embedded runtime (``nimbus.backends.local``) runs an Agent in the
caller's process; an endpoint started with ``nimbus endpoint start`` runs the
same class in its own process, fed by the service. Tasks run only in worker
processes, so a crashing task never takes the agent down.

Managers on other nodes (blocks from a provider) connect to the agent after
:meth:`Agent.listen` (see ``nimbus.runtime.remote``). The agent gives each of
them at most its ``window`` of tasks and holds the rest in ``pending``; a
manager that is lost gives its tasks back to the front of ``pending``.
``on_demand`` (the scaler) hears when tasks wait with no free capacity.

Tasks of an environment (``task.env``, see ``nimbus.environments``) wait in a
queue of their environment and are routed warm-first (``nimbus.runtime.routing``):
to a manager with room in workers of their environment, then to an unused
slot, then to an idle worker of another environment that switches, in
proportion to each environment's work. Until the first such task, the agent
routes as it did before environments (the plain path costs what it did); an
agent with one local manager and no listener (``Executor()``) hands every task
to it, and the manager places them on workers of their environment itself.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nimbus import errors, serialization
from nimbus.environments import Environment, Prepared
from nimbus.runtime import routing
from nimbus.runtime._orders import named
from nimbus.runtime.manager import Manager
from nimbus.runtime.messages import Status

if TYPE_CHECKING:
    from nimbus.network import WorkerNetworks
from nimbus.runtime.remote import Listener, RemoteManager
from nimbus.runtime.task import Task
from nimbus.wire import Channel

__all__ = ["Agent"]

_MODES = routing.MODES
DATA_AFTER = 0.25  # seconds after an agent starts that it holds and sweeps the data


class Agent:
    """Routes batches of tasks to its managers and forwards their results."""

    def __init__(
        self,
        *,
        on_results: Callable[[list[Task]], None],
        on_dispatch: Callable[[list[Task]], list[Task]] | None = None,
        on_notice: Callable[[Any], None] | None = None,
        name: str = "agent",
        routing: str = "warm",
        seed: int | None = None,
        serve_data: bool = True,
    ) -> None:
        if routing not in _MODES:
            raise ValueError(f"routing must be one of {', '.join(_MODES)}, not {routing!r}")
        self.name = name
        self.routing = routing
        self._rng = random.Random(seed)
        self._on_results = on_results
        self._on_dispatch = on_dispatch
        self._on_notice = on_notice
        self._managers: list[Any] = []  # Manager | RemoteManager
        self._outstanding: dict[Any, int] = {}
        self._lock = threading.Lock()
        self._pending: deque[Task] = deque()  # no manager has room for them yet
        self._queues: dict[str, deque[Task]] = {"": self._pending}  # the same, by environment
        self._envs: dict[str, Environment | None] = {"": None}
        self._held: dict[Any, dict[str, int]] = {}  # manager -> tasks it holds per environment
        self._typed = False  # a task of an environment came: route by environment
        self._listener: Listener | None = None
        self._prefetch = 8
        self._closing = False
        self.on_demand: Callable[[], None] | None = None  # tasks wait with no room
        self.on_change: Callable[[], None] | None = None  # a manager joined or was lost
        self.lost: list[tuple[str, str, int]] = []  # (manager, why, tasks requeued)
        # the runtime's data (held, swept, its file cache served: nimbus.data.Sweeper),
        # after DATA_AFTER s: not on the path of the first tasks, nor beside the workers'
        # forks (a multiprocessing program's first Process start waits for both)
        self._data: Any = None
        self._serve_data = serve_data
        self._data_now = threading.Event()
        self._data_thread = threading.Thread(
            target=self._hold_data, name=f"nimbus-{name}-data", daemon=True
        )
        self._data_thread.start()

    def hold_data(self) -> None:
        """Hold the runtime's data (and serve it) now, not ``DATA_AFTER`` s after the start."""
        self._data_now.set()
        self._data_thread.join()

    def _hold_data(self) -> None:
        self._data_now.wait(DATA_AFTER)
        from nimbus.data import (
            Sweeper,
            default_root,
        )  # holds this runtime's data, sweeps the node's

        closing = self._closing  # (stopped within DATA_AFTER s: only what its tasks left)
        try:
            if closing and not default_root().exists():
                return  # no data to hold nor remove: no sweeper made only to be closed
            # (serve_data: other nodes fetch from it; not at the close)
            self._data = Sweeper(serve=self._serve_data and not closing)
        except Exception as exc:  # (its directory cannot be made): tasks still run
            import logging

            logging.getLogger(__name__).warning(
                "nimbus %s: the runtime's data directory is not held nor swept: %s", self.name, exc
            )

    # -- managers on other nodes -----------------------------------------
    def listen(
        self,
        secret: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        prefetch: int = 8,
        advertise: str | None = None,
    ) -> str:
        """Accept managers holding ``secret`` on ``host:port``; the address they dial."""
        self._prefetch = prefetch
        self._listener = Listener(
            secret=secret, on_join=self._join, host=host, port=port, advertise=advertise
        )
        return self._listener.address

    def _join(self, channel: Channel, info: dict[str, Any]) -> None:
        manager = RemoteManager(
            channel,
            info,
            prefetch=self._prefetch,
            on_results=self._results,
            on_lost=self._lost,
            on_notice=self._on_notice,
        )
        with self._lock:
            if self._closing:
                channel.close()
                return
            self._managers.append(manager)
            self._outstanding[manager] = 0
            self._held[manager] = {}
        manager.start()
        self._route()
        if self.on_change is not None:
            self.on_change()

    def _lost(self, manager: RemoteManager, tasks: list[Task], why: str) -> None:
        with self._lock:
            if manager in self._outstanding:
                self._managers.remove(manager)
                del self._outstanding[manager]
                self._held.pop(manager, None)
            closing = self._closing
            if not closing:
                for task in reversed(tasks):
                    task.route = None
                    self._queue_of(task).appendleft(task)
        if closing:
            if tasks:
                self.fail(tasks, errors.RuntimeClosed(f"{self.name} was shut down"))
            return
        if not manager.closing and not any(name == manager.name for name, _, _ in self.lost[-1:]):
            self.lost.append((manager.name, why, len(tasks)))
        self._route()
        if self.on_change is not None:
            self.on_change()
        if self._pending and self.on_demand is not None:
            self.on_demand()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no task is pending or held by a manager; False at ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.pending or any(self._outstanding.values()):
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def remote_managers(self) -> list[RemoteManager]:
        return [m for m in self._managers if isinstance(m, RemoteManager)]

    @property
    def pending(self) -> int:
        """Tasks waiting for room at a manager."""
        return sum(len(queue) for queue in list(self._queues.values()))

    def outstanding(self, manager: Any) -> int:
        return self._outstanding.get(manager, 0)

    def fail(self, tasks: list[Task], error: Exception) -> None:
        """Answer tasks with ``error`` (a provider that cannot give nodes, say)."""
        data = serialization.dumps_exception(error, "")
        for task in tasks:
            task.status, task.data, task.result_buffers = Status.ERROR, data, []
        self._on_results(tasks)

    def fail_pending(self, error: Exception) -> int:
        with self._lock:
            tasks: list[Task] = []
            for queue in self._queues.values():
                tasks.extend(queue)
                queue.clear()
        if tasks:
            self.fail(tasks, error)
        return len(tasks)

    def add_manager(
        self,
        workers: int,
        *,
        prefetch: int = 8,
        python: str | None = None,
        env: Mapping[str, str] | None = None,
        preload: Sequence[str] = (),
        fork: bool = False,
        warm: Sequence[Environment | None] | None = None,
        prepare: Callable[[Environment], Prepared] | None = None,
        networks: WorkerNetworks | None = None,
    ) -> Manager:
        """Start a manager with ``workers`` slots on this node.

        ``warm``: the environments of the workers it starts at once (default:
        all of the node's own Python); ``prepare``: its builder (see ``Manager``).
        """
        extra: dict[str, Any] = {} if prepare is None else {"prepare": prepare}
        manager = Manager(
            workers,
            on_results=self._results,
            on_dispatch=self._on_dispatch,
            on_notice=self._on_notice,
            prefetch=prefetch,
            python=python,
            env=env,
            preload=preload,
            name=f"{self.name}/m{len(self._managers)}",
            fork=fork,
            warm=warm,
            networks=networks,
            **extra,
        )
        with self._lock:
            self._managers.append(manager)
            self._outstanding[manager] = 0
            self._held[manager] = {}
        manager.start()
        return manager

    @property
    def capacity(self) -> int:
        """Workers across all managers."""
        return sum(m.size for m in self._managers)

    def submit(self, tasks: list[Task]) -> None:
        """Route tasks to managers, each given a share of its free capacity."""
        managers = self._managers
        if len(managers) == 1 and self._listener is None:  # one node: it places them itself
            manager = managers[0]
            for task in tasks:
                task.route = manager
            with self._lock:
                self._outstanding[manager] += len(tasks)
            manager.submit(tasks)
            return
        if self._typed or tasks[0].env or any(task.env for task in tasks):
            self._submit_typed(tasks)
            return
        if self._listener is not None:
            with self._lock:
                self._pending.extend(tasks)
            self._route()
            if self._pending and self.on_demand is not None:
                self.on_demand()
            return
        if not managers:
            raise RuntimeError(f"{self.name} has no managers to run tasks on")
        with self._lock:
            shares: dict[Manager, list[Task]] = {}
            for task in tasks:
                manager = min(managers, key=lambda m: self._outstanding[m] / m.size)
                self._outstanding[manager] += 1
                task.route = manager
                shares.setdefault(manager, []).append(task)
        for manager, share in shares.items():
            manager.submit(share)

    def _queue_of(self, task: Task) -> deque[Task]:
        queue = self._queues.get(task.env)
        if queue is None:
            self._envs.setdefault(task.env, task.environment)
            queue = self._queues.setdefault(task.env, deque())
        return queue

    def _submit_typed(self, tasks: list[Task]) -> None:
        if not self._managers and self._listener is None:
            raise RuntimeError(f"{self.name} has no managers to run tasks on")
        with self._lock:
            self._typed = True
            for task in tasks:
                self._queue_of(task).append(task)
        self._route()
        if self.pending and self.on_demand is not None:
            self.on_demand()

    def _views(self) -> list[routing.View]:
        views = []
        for m in self._managers:
            if not getattr(m, "accepting", True):
                continue
            slots, unused, window = m.environments()
            view = routing.View(m, slots, unused, max(1, window), dict(self._held[m]))
            view.run_seconds, view.start_seconds = m.costs()
            views.append(view)
        return views

    def _route_typed(self) -> dict[Any, list[Task]]:
        """Deal waiting tasks by environment (holding ``_lock``): see ``routing.plan``."""
        queues = self._queues
        waiting = {tag: len(queue) for tag, queue in queues.items() if queue}
        shares: dict[Any, list[Task]] = {}
        if not waiting:
            return shares
        moves = routing.plan(waiting, self._views(), self.routing, self._rng)
        for move in moves:
            m = move.manager
            if move.claim:
                m.reserve(self._envs.get(move.env), move.take_from)
            if not move.tasks:
                continue
            queue, batch = queues[move.env], shares.setdefault(m, [])
            for _ in range(move.tasks):
                task = queue.popleft()
                task.route = m
                batch.append(task)
            held = self._held[m]
            held[move.env] = held.get(move.env, 0) + move.tasks
            self._outstanding[m] += move.tasks
        return shares

    def _route(self) -> None:
        """Deal pending tasks to accepting managers, each up to its window."""
        if self._typed:
            with self._lock:
                typed = self._route_typed()
            self._send(typed)
            return
        shares: dict[Any, list[Task]] = {}
        with self._lock:
            pending, out = self._pending, self._outstanding
            while pending:
                room = [
                    m
                    for m in self._managers
                    if getattr(m, "accepting", True) and out[m] < getattr(m, "window", math.inf)
                ]
                if not room:
                    break
                room.sort(key=lambda m: out[m] / m.size)  # the least loaded first
                share = -(-len(pending) // len(room))
                for m in room:
                    n = min(share, getattr(m, "window", math.inf) - out[m], len(pending))
                    if n <= 0:
                        continue
                    batch = shares.setdefault(m, [])
                    for _ in range(int(n)):
                        task = pending.popleft()
                        task.route = m
                        batch.append(task)
                    out[m] += int(n)
        self._send(shares)

    def _send(self, shares: dict[Any, list[Task]]) -> None:
        out = self._outstanding
        for manager, batch in shares.items():
            if isinstance(manager, RemoteManager) and self._on_dispatch is not None:
                kept = self._on_dispatch(batch)
                if len(kept) != len(batch):
                    with self._lock:
                        if manager in out:
                            out[manager] -= len(batch) - len(kept)
                            self._unhold(manager, [t for t in batch if t not in kept])
                batch = kept
            if batch:
                manager.submit(batch)

    def order(
        self, ref: str, action: str, name: str, environment: Environment | None = None
    ) -> list[Any]:
        """Ask every manager (this node's, and those on other nodes) to build
        ``environment`` on its node or to remove the environment ``name`` there
        (``nimbus.runtime._orders``); the managers asked, whose ``orders[ref]`` says
        how it goes."""
        with self._lock:
            managers = [m for m in self._managers if not getattr(m, "closing", False)]
        for manager in managers:
            manager.order(ref, action, name, environment)
        return managers

    def busy(self, name: str) -> dict[str, int]:
        """Tasks of the environment ``name`` (or key) not done: per manager (its name)
        those it holds or its workers run, and "queued" those no manager has yet."""
        with self._lock:
            queued = sum(len(q) for tag, q in self._queues.items() if named(tag, name))
            held = {
                m: sum(n for t, n in h.items() if named(t, name)) for m, h in self._held.items()
            }
        out = {"queued": queued} if queued else {}
        for manager, count in held.items():
            envs = manager.statistics().get("environments") or {}
            running = sum(
                max(0, int(e.get("workers") or 0) - int(e.get("free") or 0))
                for tag, e in envs.items()
                if named(str(tag), name) and isinstance(e, dict)
            )
            if max(count, running):
                out[manager.name] = max(count, running)
        return out

    def cancel(self, task: Task) -> None:
        """Stop a task wherever it is (see ``Manager.cancel``)."""
        manager = task.route
        task.cancelled = True
        if manager is not None:
            manager.cancel(task)
            return
        with self._lock:
            try:
                self._queue_of(task).remove(task)
            except ValueError:
                return
        task.status, task.data, task.result_buffers = Status.SKIPPED, b"", []
        self._on_results([task])

    def _results(self, tasks: list[Task]) -> None:
        manager = tasks[0].route
        if manager is not None:
            with self._lock:
                if manager in self._outstanding:
                    self._outstanding[manager] -= len(tasks)
                    if self._typed:
                        self._unhold(manager, tasks)
        self._on_results(tasks)
        if self._pending or (self._typed and self.pending):
            self._route()

    def _unhold(self, manager: Any, tasks: list[Task]) -> None:
        held = self._held.get(manager)
        if held is not None:
            for task in tasks:
                held[task.env] = held.get(task.env, 0) - 1

    def shutdown(self, wait: bool = True, *, kill: bool = False) -> None:
        if wait and not kill and self._listener is not None:
            self.wait_idle()
        with self._lock:
            self._closing = True
        if self._listener is not None:
            self._listener.close()
            if kill and self.pending:
                self.fail_pending(errors.RuntimeClosed(f"{self.name} was shut down"))
        for manager in list(self._managers):
            manager.shutdown(wait=False, kill=kill)
        if wait:
            for manager in list(self._managers):
                manager.shutdown(wait=True, kill=kill)
        if self.pending:
            self.fail_pending(errors.RuntimeClosed(f"{self.name} was shut down"))
        if wait or kill:  # its workers are gone: its data directory goes with the last agent
            self._close_data(after_managers=False)
        else:  # once they are (the managers' loops ended)
            threading.Thread(target=self._close_data, name="nimbus-data-close", daemon=True).start()

    def _close_data(self, after_managers: bool = True) -> None:
        for manager in list(self._managers) if after_managers else ():
            stopped = getattr(manager, "stopped", None)  # (a remote one's workers: elsewhere)
            if stopped is not None:
                stopped.wait()
        self._data_now.set()
        self._data_thread.join()
        if self._data is not None:
            self._data.close()

    def statistics(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pending": self.pending,
            "managers": [m.statistics() for m in self._managers],
        }
