"""``nimbus manager``: one node's manager, connected out to its endpoint's agent.

::

    agent (login node)                          this process (a node of a block)
      Listener <------ TCP connect ------------- NodeManager
        CHALLENGE nonce ------------------------>
        <---------------- JOIN proof, nonce, workers, host, block
        WELCOME proof --------------------------> (the agent knows the secret too)
        TASKS (a prefetch window) --------------> Manager --> warm workers
        <---------------- RESULTS, HEARTBEAT (every second), DRAINED

The secret comes in ``NIMBUS_AGENT_SECRET`` (set by the agent in the block's
environment, never on a command line); proofs are HMAC-SHA256 of the peer's
nonce, so the secret never crosses the network. The tasks run on the same
:class:`~nimbus.runtime.manager.Manager` (and workers) as the embedded runtime.
When the agent goes away, the manager kills its workers and exits. As the agent
does on its node, the manager holds its runtime's data directory on this node while
it runs (removed with its last holder) and sweeps the node's expired objects and
unused file copies (``nimbus.data.Sweeper``: at start and every 10 s).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
import socket
import sys
import threading
from typing import Any

from nimbus import environments
from nimbus.environments import Environment
from nimbus.errors import NimbusError
from nimbus.records import TaskRecord
from nimbus.runtime._orders import ORDERS
from nimbus.runtime.manager import Manager
from nimbus.runtime.messages import INLINE_LIMIT, PYTHON, Link
from nimbus.runtime.task import Task
from nimbus.wire import Channel, Frame, pack, unpack

__all__ = [
    "ADDRESS_ENV",
    "MAIN",
    "SECRET_ENV",
    "NodeManager",
    "add_arguments",
    "main",
    "proof",
    "run",
]

log = logging.getLogger(__name__)

ADDRESS_ENV = "NIMBUS_AGENT_ADDRESS"
SECRET_ENV = "NIMBUS_AGENT_SECRET"
HANDSHAKE_SECONDS = 15.0
CACHE_EVERY = 5  # heartbeats between two reports of the environments built on this node


def proof(secret: str, nonce: bytes, role: bytes) -> bytes:
    """What a peer holding ``secret`` answers to ``nonce`` (``role``: b"manager"/b"agent")."""
    return hmac.new(secret.encode(), role + b":" + nonce, hashlib.sha256).digest()


def receive_one(channel: Channel, kind: int, rest: list[Frame] | None = None) -> Any:
    """The next frame, which must be of ``kind``; its metadata (blocking socket).

    Frames that came with it go to ``rest`` (refused if not given).
    """
    frames: list[Frame] = []
    while not frames:
        got = channel.receive(block=True)
        if got is None:
            raise ConnectionError("the peer closed the connection during the handshake")
        frames.extend(got)
    if frames[0].kind != kind or (len(frames) > 1 and rest is None):
        raise ConnectionError(f"expected a {Link(kind).name} frame, got kind {frames[0].kind}")
    if rest is not None:
        rest.extend(frames[1:])
    return unpack(frames[0].meta)


class NodeManager:
    """Connects to the agent at ``address`` and runs what it sends on local workers."""

    def __init__(
        self,
        address: str,
        secret: str,
        *,
        workers: int,
        prefetch: int = 8,
        heartbeat: float = 1.0,
        block: str = "",
    ) -> None:
        host, _, port = address.rpartition(":")
        self.address = (host, int(port))
        self.secret = secret
        self.workers = workers
        self.prefetch = prefetch
        self.heartbeat = heartbeat
        self.block = block
        self._tasks: dict[int, Task] = {}
        self._fns: dict[str, bytes] = {}
        self._envs: dict[str, Environment] = {}
        self._send_lock = threading.Lock()
        self._stopped = threading.Event()
        self._channel: Channel | None = None
        self._early: list[Frame] = []  # frames that came with the WELCOME

    def _send(self, kind: int, meta: object, buffers: list[Any] | None = None) -> None:
        if self._channel is None:
            return  # not joined yet: nothing to tell (a notice of a worker's start)
        with self._send_lock:
            try:
                self._channel.send(kind, pack(meta), buffers or [])
                self._channel.flush()
            except OSError:
                pass  # the reader sees the end of the stream

    def connect(self) -> Channel:
        sock = socket.create_connection(self.address, timeout=HANDSHAKE_SECONDS)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        channel = Channel(sock)
        try:
            return self._handshake(channel)
        except BaseException:
            channel.close()
            raise

    def _handshake(self, channel: Channel) -> Channel:
        sock = channel.sock
        challenge = receive_one(channel, Link.CHALLENGE)
        nonce = os.urandom(16)
        channel.send(
            Link.JOIN,
            pack(
                {
                    "proof": proof(self.secret, challenge["nonce"], b"manager"),
                    "nonce": nonce,
                    "workers": self.workers,
                    "host": socket.gethostname(),
                    "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
                    "pid": os.getpid(),
                    "block": self.block,
                    "python": PYTHON,
                    "can": [ORDERS],  # environment orders (Link.ORDER)
                }
            ),
        )
        channel.flush()
        welcome = receive_one(channel, Link.WELCOME, self._early)
        if not hmac.compare_digest(welcome["proof"], proof(self.secret, nonce, b"agent")):
            raise ConnectionError("the agent could not prove it holds the block's secret")
        self.heartbeat = float(welcome.get("heartbeat", self.heartbeat))
        sock.settimeout(None)
        return channel

    def run(self) -> int:
        # the workers first, forked from this process while it has no other thread and no
        # connection (milliseconds, where new interpreters take most of a second): they are
        # warm when the agent's first tasks come, which it sends as soon as this joins
        manager = Manager(
            self.workers,
            on_results=self._results,
            on_notice=lambda notice: self._send(Link.NOTICE, notice),
            prefetch=self.prefetch,
            name="node",
            fork=True,
        )
        manager.start()
        from nimbus.data import Sweeper  # as the agent: holds this node's data, sweeps it

        data = Sweeper()  # (a thread: after the workers are forked)
        try:
            self._channel = channel = self.connect()
        except BaseException:
            manager.shutdown(wait=True, kill=True)
            data.close()
            raise
        # a worker forked again later (one was lost) must not keep the agent's link open
        os.register_at_fork(after_in_child=channel.sock.close)
        beat = threading.Thread(target=self._beat, args=(manager,), daemon=True)
        beat.start()
        code = 1
        try:
            if self._early and self._handle(self._early, manager):
                manager.shutdown(wait=True)
                return 0
            while True:
                frames = channel.receive(block=True)
                if frames is None:
                    log.warning("nimbus manager: the agent closed the connection")
                    manager.shutdown(wait=True, kill=True)
                    break
                if self._handle(frames, manager):
                    manager.shutdown(wait=True)
                    code = 0
                    break
        finally:
            self._stopped.set()
            channel.close()
            data.close()  # the node's data directory goes with its last holder
        return code

    def _handle(self, frames: list[Frame], manager: Manager) -> bool:
        for frame in frames:
            if frame.kind == Link.TASKS:
                manager.submit(self._tasks_of(unpack(frame.meta), frame.buffers))
            elif frame.kind == Link.CANCEL:
                for wid in unpack(frame.meta):
                    task = self._tasks.get(wid)
                    if task is not None:
                        manager.cancel(task)
            elif frame.kind == Link.DRAIN:
                self._send(Link.DRAINED, {"held": len(self._tasks)})
            elif frame.kind == Link.STOP:
                return True
            elif frame.kind == Link.ORDER:
                order = unpack(frame.meta)
                spec = order.get("environment")
                env = self._environment(spec) if spec else None
                manager.order(str(order["ref"]), str(order["action"]), str(order["name"]), env)
        return False

    def _tasks_of(self, rows: list[list[Any]], buffers: list[Any]) -> list[Task]:
        tasks = []
        position = 0
        for wid, fn_key, fn_bytes, payload, nbufs, timeout, *more in rows:
            env = self._environment(more[0]) if more and more[0] else None
            if fn_bytes is not None:
                self._fns[fn_key] = fn_bytes
            if payload is None:
                payload = buffers[position]
                bufs = buffers[position + 1 : position + nbufs]
            else:
                bufs = buffers[position : position + nbufs]
            position += nbufs
            task = Task(
                wid,
                fn_key,
                self._fns[fn_key],
                payload,
                list(bufs),
                TaskRecord(""),
                timeout=timeout,
                environment=env,
            )
            self._tasks[wid] = task
            tasks.append(task)
        return tasks

    def _environment(self, spec: dict[str, Any]) -> Environment:
        key = repr(sorted(spec.items()))
        env = self._envs.get(key)
        if env is None:
            env = self._envs[key] = Environment.from_dict(spec)
        return env

    def _results(self, tasks: list[Task]) -> None:
        rows: list[list[Any]] = []
        buffers: list[Any] = []
        for task in tasks:
            self._tasks.pop(task.seq, None)
            r = task.record
            data: Any = task.data
            if len(data) > INLINE_LIMIT:
                buffers.append(data)
                data = None
            buffers.extend(task.result_buffers)
            nbufs = len(task.result_buffers) + (data is None)
            rows.append(
                [
                    task.seq,
                    task.status,
                    data,
                    nbufs,
                    r.started,
                    r.ended,
                    r.cpu_user,
                    r.cpu_system,
                    r.peak_memory,
                    r.net_bytes_in,
                    r.net_bytes_out,
                    r.worker,
                    r.host,
                    r.pid,
                    r.network(),  # issue 19: net_source, tcp, colocated...
                    r.build_seconds,
                ]
            )
        self._send(Link.RESULTS, rows, buffers)

    def _beat(self, manager: Manager) -> None:
        beats = 0
        said: dict[str, Any] = {}
        while not self._stopped.wait(self.heartbeat):
            stats = manager.statistics()
            slots, unused, window = manager.environments()
            beat = {"held": len(self._tasks), "ready": stats["ready"], "window": window}
            beat.update(slots=slots, unused=unused, environments=stats["environments"])
            beat["run"], beat["start"] = manager.costs()
            orders = dict(manager.orders)  # how the environment orders went here
            if orders:
                beat["orders"] = orders
            if beats % CACHE_EVERY == 0 or orders != said:  # what is built here: now and then
                said = orders
                try:
                    beat["cache"] = environments.cache().report()
                except (OSError, NimbusError) as exc:
                    log.warning("cannot read this node's environments: %s", exc)
            beats += 1
            self._send(Link.HEARTBEAT, beat)


# ---------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``nimbus manager``."""
    parser.add_argument("--address", help=f"the agent's host:port (default ${ADDRESS_ENV})")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="warm workers")
    parser.add_argument("--prefetch", type=int, default=8, help="tasks in flight per worker")


def main(argv: list[str] | None = None) -> int:
    """``nimbus manager`` without the CLI's imports: what a block runs (see :data:`MAIN`)."""
    parser = argparse.ArgumentParser(prog="nimbus manager", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


# the command line of ``nimbus manager`` a block runs: through an import, as the
# workers are started, not ``-m nimbus``, whose CLI imports most of nimbus first
MAIN = "import sys; from nimbus.runtime.node import main; sys.exit(main())"


def run(args: argparse.Namespace) -> int:
    from nimbus.errors import ConfigError

    secret = os.environ.get(SECRET_ENV)
    args.address = args.address or os.environ.get(ADDRESS_ENV)
    if not args.address or not secret:
        raise ConfigError(
            f"nimbus manager needs the agent's address (--address or {ADDRESS_ENV}) and "
            f"{SECRET_ENV}; a provider's block sets both"
        )
    block = os.environ.get("NIMBUS_BLOCK_ID", "")
    node = NodeManager(
        args.address, secret, workers=args.workers, prefetch=args.prefetch, block=block
    )
    try:
        return node.run()
    except (OSError, ConnectionError) as exc:
        print(f"nimbus manager: cannot join the agent at {args.address}: {exc}", file=sys.stderr)
        return 1
