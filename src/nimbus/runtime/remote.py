"""The agent's side of managers on other nodes: a TCP listener and a proxy per manager.

::

    Listener.accept --> CHALLENGE --> JOIN (proof checked) --> WELCOME --> RemoteManager
    RemoteManager.submit(tasks) --TASKS--> node   (the agent keeps at most ``window`` there)
    reader thread <--RESULTS/HEARTBEAT/DRAINED-- node;  silent ``lost_after`` s, or the
    connection breaks --> on_lost(manager, tasks it held): the agent requeues them

A :class:`RemoteManager` has the shape of a local
:class:`~nimbus.runtime.manager.Manager` (``size``, ``submit``, ``cancel``,
``shutdown``, ``statistics``), so the agent routes to both alike. Each task
sent gets a wire id; a result whose id is no longer held (the manager was
declared lost and the task requeued) is dropped, so a task that ran twice
gives exactly one result.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from nimbus.runtime._orders import DONE, KEPT, ORDERS
from nimbus.runtime.messages import INLINE_LIMIT, Link
from nimbus.runtime.node import HANDSHAKE_SECONDS, proof, receive_one
from nimbus.runtime.task import Task, environment_tag
from nimbus.wire import Channel, Frame, pack, unpack

__all__ = ["Listener", "RemoteManager", "new_secret"]

log = logging.getLogger(__name__)

HEARTBEAT = 1.0  # seconds between a manager's heartbeats
LOST_AFTER = 6.0  # seconds of silence before a manager is lost (detected within 10 s)


def new_secret() -> str:
    return secrets.token_urlsafe(32)


class RemoteManager:
    """A manager on another node, seen from the agent."""

    def __init__(
        self,
        channel: Channel,
        info: dict[str, Any],
        *,
        prefetch: int,
        on_results: Callable[[list[Task]], None],
        on_lost: Callable[[RemoteManager, list[Task], str], None],
        on_notice: Callable[[Any], None] | None = None,
        lost_after: float = LOST_AFTER,
    ) -> None:
        self.size = int(info["workers"])
        self.host = str(info.get("host", ""))
        self.node = str(info.get("node", self.host))
        self.block = str(info.get("block", ""))
        self.pid = int(info.get("pid", 0))
        self.name = f"{self.node}/manager"
        self._prefetch = prefetch
        self.window = self.size * prefetch  # tasks the agent lets it hold (see HEARTBEAT)
        self.accepting = True  # False: draining or near its walltime
        self.slots: dict[str, int] = {"": self.size}  # per environment, as its heartbeats say
        self.unused = 0
        # per environment tag its slots, ready and free workers; its node's cache rows
        self.held_environments: dict[str, dict[str, Any]] = {}
        self.cache: list[dict[str, Any]] | None = None
        self.can = set(info.get("can") or ())  # "orders": it builds and removes when asked
        self.orders: dict[str, dict[str, Any]] = {}  # ref -> outcome, as its heartbeats say
        self.run_seconds: float | None = None  # a task's run, a worker's start: heartbeats
        self.start_seconds: float | None = None
        self.joined = time.monotonic()
        self.last_seen = self.joined
        self.held = -1  # tasks it said it holds at its last DRAINED (-1: not asked)
        self.drained = threading.Event()
        self.closing = False
        self._channel = channel
        self._on_results = on_results
        self._on_lost = on_lost
        self._on_notice = on_notice
        self._lost_after = lost_after
        self._sent: dict[int, Task] = {}
        self._wids: dict[int, int] = {}  # id(task) -> wire id
        self._fns: set[str] = set()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._gone = False
        self._out_rows: list[list[Any]] = []  # tasks gathered for the writer
        self._out_buffers: list[Any] = []
        self._outbox = threading.Event()
        self._thread = threading.Thread(target=self._read, name=f"nimbus-{self.name}", daemon=True)
        self._writer = threading.Thread(
            target=self._send_tasks, name=f"nimbus-{self.name}-writer", daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        self._writer.start()

    @property
    def holding(self) -> int:
        return len(self._sent)

    def submit(self, tasks: list[Task]) -> None:
        now = time.time()
        with self._lock:
            gone = self._gone
            if not gone:
                self._queue(tasks, self._out_rows, self._out_buffers, now)
        if not gone:
            self._outbox.set()  # the writer sends what has gathered as one frame
        else:  # lost while the agent chose it: the tasks go back to the agent's queue
            self._on_lost(self, list(tasks), "it was lost before its tasks were sent")

    def _queue(
        self, tasks: list[Task], rows: list[list[Any]], buffers: list[Any], now: float
    ) -> None:
        """Give the tasks wire ids and rows (holding ``_lock``)."""
        for task in tasks:
            wid = next(self._ids)
            self._sent[wid] = task
            self._wids[id(task)] = wid
            fn_bytes = None
            if task.fn_key not in self._fns:
                self._fns.add(task.fn_key)
                fn_bytes = task.fn_bytes
            env = task.environment.to_dict() if task.env and task.environment else None
            if len(task.payload) > INLINE_LIMIT:
                rows.append(
                    [wid, task.fn_key, fn_bytes, None, len(task.buffers) + 1, task.timeout, env]
                )
                buffers.append(task.payload)
            else:
                rows.append(
                    [wid, task.fn_key, fn_bytes, task.payload, len(task.buffers), task.timeout, env]
                )
            buffers.extend(task.buffers)
            task.record.dispatched = now
            task.attempts += 1

    def _send_tasks(self) -> None:
        """The writer thread: what ``submit`` gathered, one TASKS frame at a time.

        A caller submitting task after task holds the GIL while the writer waits
        for it, so tasks gather: a frame (and a syscall) per batch, not per task.
        """
        while not self._gone:
            self._outbox.wait()
            self._outbox.clear()
            with self._lock:
                self._flush_tasks()

    def _flush_tasks(self) -> None:
        """Send the gathered tasks (holding ``_lock``); before any other frame."""
        if self._out_rows:
            rows, buffers = self._out_rows, self._out_buffers
            self._out_rows, self._out_buffers = [], []
            self._write(Link.TASKS, rows, buffers)

    def _write(self, kind: int, meta: object, buffers: list[Any] | None = None) -> None:
        """Send a frame (holding ``_lock``); a broken link is seen by the reader."""
        if self._gone:
            return
        if kind != Link.TASKS and self._out_rows:
            self._flush_tasks()
        try:
            self._channel.send(kind, pack(meta), buffers or [])
            self._channel.flush()
        except OSError:
            pass

    def environments(self) -> tuple[dict[str, int], int, int]:
        """Slots per environment, unused slots and tasks per worker, as last heard."""
        return dict(self.slots), self.unused, self.window // max(1, self.size)

    def costs(self) -> tuple[float | None, float | None]:
        return self.run_seconds, self.start_seconds

    def reserve(self, env: Any, take_from: str | None = None) -> bool:
        """Count a slot for ``env`` until the next heartbeat; the node grows the
        environment itself when its tasks wait there."""
        tag = environment_tag(env)
        if self.unused > 0:
            self.unused -= 1
        elif take_from is not None and self.slots.get(take_from, 0) > 0:
            self.slots[take_from] -= 1
        else:
            return False
        self.slots[tag] = self.slots.get(tag, 0) + 1
        return True

    def order(self, ref: str, action: str, name: str, environment: Any = None) -> None:
        """Build ``environment`` on its node, or remove ``name`` there (``orders[ref]``
        says how it went, from its heartbeats); a node too old to know orders fails it."""
        if ORDERS not in self.can:
            self.orders[ref] = {
                "state": "failed",
                "message": f"the nimbus manager on {self.node} is older than its agent and "
                "cannot build or remove environments on request: upgrade nimbus there (its "
                "next block does); meanwhile it builds an environment at its first task",
                "seconds": 0.0,
            }
            return
        if self._gone or self.closing:
            self.orders[ref] = {
                "state": "failed",
                "message": f"the nimbus manager on {self.node} is stopping (its block ends): "
                "nothing was done there",
                "seconds": 0.0,
            }
            return
        spec = environment.to_dict() if environment is not None else None
        self.orders[ref] = {"state": "building" if spec else "removing", "message": ""}
        with self._lock:
            self._write(
                Link.ORDER, {"ref": ref, "action": action, "name": name, "environment": spec}
            )

    def cancel(self, task: Task) -> None:
        with self._lock:
            wid = self._wids.get(id(task))
            if wid is not None and wid in self._sent:
                self._write(Link.CANCEL, [wid])

    def drain(self) -> None:
        """Take no more tasks; ask the node what it holds (answered in ``held``)."""
        self.accepting = False
        self.drained.clear()
        with self._lock:
            self._write(Link.DRAIN, None)

    def shutdown(self, wait: bool = True, *, kill: bool = False) -> None:
        self.closing = True
        self.accepting = False
        with self._lock:
            if not kill:
                self._write(Link.STOP, None)
        if kill:
            self._lose("the agent shut down")
        elif wait and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
            self._lose("the agent shut down")

    def statistics(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "node": self.node,
            "block": self.block,
            "workers": self.size,
            "inflight": self.holding,
            "accepting": self.accepting,
            "seen": round(time.monotonic() - self.last_seen, 1),
            "environments": self.held_environments,
            "cache": self.cache,
        }

    # -- the reader thread -------------------------------------------------
    def _read(self) -> None:
        sock = self._channel.sock
        reason = "its connection closed"
        try:
            while not self._gone:
                ready, _, _ = select.select([sock], [], [], HEARTBEAT / 2)
                if ready:
                    frames = self._channel.receive()
                    if frames is None:
                        break
                    self.last_seen = time.monotonic()
                    self._handle(frames)
                elif time.monotonic() - self.last_seen > self._lost_after:
                    reason = f"it sent nothing for {self._lost_after:.0f} s"
                    break
        except (OSError, ValueError) as exc:
            reason = f"its connection broke ({exc})"
        self._lose(reason)

    def _handle(self, frames: list[Frame]) -> None:
        for frame in frames:
            if frame.kind == Link.RESULTS:
                self._results(unpack(frame.meta), frame.buffers)
            elif frame.kind == Link.HEARTBEAT:
                # the node's per-worker window grows for short tasks: so does ours
                beat = unpack(frame.meta)
                self.window = self.size * max(self._prefetch, int(beat.get("window", 0)))
                if "slots" in beat:
                    self.slots, self.unused = dict(beat["slots"]), int(beat["unused"])
                    self.run_seconds, self.start_seconds = beat.get("run"), beat.get("start")
                    self.held_environments = beat.get("environments") or {}
                if "cache" in beat:  # its node's built environments, now and then
                    self.cache = list(beat["cache"])
                if "orders" in beat:  # how its environment orders went (its last KEPT)
                    orders = {**self.orders, **beat["orders"]}
                    self.orders = dict(list(orders.items())[-2 * KEPT :])
            elif frame.kind == Link.NOTICE:
                if self._on_notice is not None:
                    try:
                        self._on_notice(unpack(frame.meta))
                    except Exception:
                        log.exception("nimbus %s: a notice callback failed", self.name)
            elif frame.kind == Link.DRAINED:
                self.held = int(unpack(frame.meta)["held"])
                self.drained.set()

    def _results(self, rows: list[list[Any]], buffers: list[Any]) -> None:
        done: list[Task] = []
        position = 0
        with self._lock:
            for row in rows:
                wid, status, data, nbufs = row[0], row[1], row[2], row[3]
                task = self._sent.pop(wid, None)
                if data is None:
                    data, bufs = buffers[position], buffers[position + 1 : position + nbufs]
                else:
                    bufs = buffers[position : position + nbufs]
                position += nbufs
                if task is None:  # requeued after this manager was lost: answered elsewhere
                    continue
                self._wids.pop(id(task), None)
                task.status, task.data, task.result_buffers = status, data, list(bufs)
                r = task.record
                (r.started, r.ended, r.cpu_user, r.cpu_system, r.peak_memory) = row[4:9]
                (r.net_bytes_in, r.net_bytes_out, r.worker, r.host, r.pid) = row[9:14]
                if len(row) > 14:
                    r.add_network(row[14])
                if len(row) > 15:
                    r.build_seconds = row[15]
                r.worker = f"{self.node}:{r.worker}"
                done.append(task)
        if done:
            self._on_results(done)

    def _lose(self, reason: str) -> None:
        with self._lock:
            if self._gone:
                return
            self._gone = True
            self._out_rows, self._out_buffers = [], []
            tasks = list(self._sent.values())
            self._sent.clear()
            self._wids.clear()
        self._outbox.set()  # the writer ends
        self._channel.close()
        for ref, said in list(self.orders.items()):  # no heartbeat will say how they went
            if said.get("state") not in DONE:
                self.orders[ref] = {
                    "state": "failed",
                    "message": f"the nimbus manager on {self.node} went away ({reason}) before "
                    "it said how this went: `nimbus environments list --endpoint` shows what "
                    "its node holds",
                    "seconds": float(said.get("seconds") or 0.0),
                }
        self._on_lost(self, tasks, reason)


class Listener:
    """Accepts managers that prove they hold ``secret``; ``on_join`` gets each."""

    def __init__(
        self,
        *,
        secret: str,
        on_join: Callable[[Channel, dict[str, Any]], None],
        host: str = "127.0.0.1",
        port: int = 0,
        advertise: str | None = None,
    ) -> None:
        self.secret = secret
        self._on_join = on_join
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.5)
        bound = self._sock.getsockname()[1]
        shown = advertise or (socket.gethostname() if host in ("", "0.0.0.0") else host)
        self.address = f"{shown}:{bound}"
        self.refused = 0
        self._closing = False
        self._thread = threading.Thread(target=self._accept, name="nimbus-listener", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(conn,), daemon=True).start()

    def _handshake(self, conn: socket.socket) -> None:
        conn.settimeout(HANDSHAKE_SECONDS)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        channel = Channel(conn)
        try:
            nonce = os.urandom(16)
            channel.send(Link.CHALLENGE, pack({"nonce": nonce}))
            channel.flush()
            join = receive_one(channel, Link.JOIN)
            if not hmac.compare_digest(join["proof"], proof(self.secret, nonce, b"manager")):
                raise ConnectionError("a manager with a wrong secret")
            channel.send(
                Link.WELCOME,
                pack(
                    {"proof": proof(self.secret, join["nonce"], b"agent"), "heartbeat": HEARTBEAT}
                ),
            )
            channel.flush()
        except (OSError, ConnectionError, KeyError, TypeError, ValueError) as exc:
            self.refused += 1
            log.warning("nimbus agent: refused a manager connection: %s", exc)
            channel.close()
            return
        conn.settimeout(None)
        conn.setblocking(True)
        self._on_join(channel, join)

    def close(self) -> None:
        self._closing = True
        self._sock.close()
        self._thread.join(timeout=2)
