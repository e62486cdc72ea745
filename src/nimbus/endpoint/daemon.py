"""The endpoint daemon: the process that hosts an endpoint's runtime Agent and links it to
the service over a WebSocket.

::

    service --tasks (window)--> EndpointDaemon --submit--> runtime Agent --> Manager --> workers
       ^                           |     ^                                    |
       +--results (until acked)----+     +---------- on_results -------------+
       +--beat <-> beat

It connects out only (``ws(s)://<service>/v1/ws/endpoint`` with the endpoint's
token, through the shared :class:`~nimbus.protocol.wsclient.ServiceSocket`) and
reconnects with exponential backoff; a token the service refuses or revokes
stops it with an error saying what to do; a malformed message from the
service closes the connection (with a close code) and it reconnects, and a
task it cannot decode fails alone (``DeserializationError``). A result is kept until the
service acknowledges it, and sent again after a reconnect; a task sent again
while this daemon still runs it is not started twice. Arguments in the
service's data store are fetched before their task starts; a result larger
than the service's inline limit is stored there and sent as a reference. Run
it with ``nimbus endpoint start NAME`` or ``python -m nimbus.endpoint.daemon NAME``
(``EndpointDaemon.runtime`` is the runtime's ``nimbus.runtime.Agent``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import ssl
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection

from nimbus import _loop, environments, owners, serialization
from nimbus.config import Settings
from nimbus.endpoint._orders import Orders
from nimbus.endpoint._summary import runtime_rows
from nimbus.endpoint.config import EndpointConfig
from nimbus.environments import Environment
from nimbus.errors import (
    ConfigError,
    DeserializationError,
    NimbusError,
    ProtocolError,
    RemoteError,
    ServiceError,
)
from nimbus.protocol import (
    DATA,
    INLINE_MIN,
    LIMITS,
    MAX_ENVIRONMENTS,
    ORDERS,
    PYTHON,
    SERIALIZER,
    WS_AGENT,
    Ack,
    Beat,
    Cancel,
    DataRef,
    Hello,
    Malformed,
    Message,
    Order,
    Result,
    ResultRow,
    Results,
    Running,
    TaskRow,
    Tasks,
    batches,
    decode_frame,
    decode_message,
    new_row,
    payload_size,
    too_large,
    unpack_payload,
)
from nimbus.protocol.wsclient import ServiceSocket
from nimbus.records import TaskRecord, TaskState
from nimbus.runtime.agent import Agent
from nimbus.runtime.messages import Status
from nimbus.runtime.scaling import Scaler, make_scaler
from nimbus.runtime.task import Task, environment_tag

__all__ = ["EndpointDaemon", "main"]

log = logging.getLogger(__name__)
STATES = {
    Status.OK: TaskState.SUCCESS,
    Status.ERROR: TaskState.FAILED,
    Status.SKIPPED: TaskState.CANCELLED,
}
MAX_BACKOFF = 5.0
RUNNING_AFTER = 0.05  # seconds: shorter tasks go from dispatched to done unreported
MIN_WINDOW = 1024  # tasks in flight from the service: enough to cover its round trip
SEND_CHUNK = 5000
COALESCE = 0.002  # with work in flight, wait this long to gather more into one message
ENVIRONMENTS_EVERY = 5  # heartbeats between two reports of the environments held
ORDER_POLL = 0.25  # seconds between beats while a node has not said how an order went
SERVICE_SENDS: dict[str, type[Message]] = {
    kind.op: kind for kind in (Tasks, Ack, Cancel, Beat, Order)
}


class EndpointDaemon:
    """Serves one endpoint: ``await daemon.run()`` until :meth:`stop`."""

    def __init__(
        self,
        service_url: str,
        token: str,
        *,
        workers: int,
        prefetch: int = 8,
        heartbeat: float = 2.0,
        name: str = "endpoint",
        settings: Settings | None = None,
        blocks_file: Path | None = None,
    ) -> None:
        self.service_url = service_url.rstrip("/")
        self._ssl: ssl.SSLContext | None = None  # verifies the service's certificate
        self._runtime_failed = False  # _runtime said why it could not: once
        if self.service_url.startswith("https://"):
            self._ssl = (settings if settings is not None else Settings.load()).ssl_context()
        self.socket = ServiceSocket(
            self.service_url,
            WS_AGENT,
            token,
            self._ssl,
            keepalive=heartbeat,
            whose=f"endpoint {name}'s token",
            fix=f"run `nimbus endpoint configure {name}` for a new one",
            replaced=f"this daemon stops: start the endpoint where it was configured again "
            f"(`nimbus endpoint start {name}`)",
            deleted=f"this daemon stops (`nimbus endpoint configure {name}` registers the "
            f"endpoint again)",
            backoff=(0.1, MAX_BACKOFF),
        )
        self.url = self.socket.url
        self.token = token
        self.workers = workers
        self.window = max(MIN_WINDOW, 4 * workers * prefetch)
        self.heartbeat = heartbeat
        self.name = name
        self.beat_latency = 0.0
        self._seq = itertools.count()
        self._held: dict[str, Task] = {}
        self._unacked: dict[str, ResultRow] = {}
        self._outbox: list[ResultRow] = []
        self._functions: dict[str, bytes] = {}
        self._owned: dict[tuple[str, str], tuple[str, bytes]] = {}  # (function, owner) -> key, fn
        self._dispatched: dict[str, float] = {}  # task id -> when a worker got it
        self._fetching: set[str] = set()  # tasks whose arguments come from the data store
        self._jobs: set[asyncio.Task[None]] = set()  # data-store transfers under way
        self._http: httpx.AsyncClient | None = None
        self._limits: dict[str, int] | None = None  # the service's (GET /v1/limits), asked once
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        self.runtime = Agent(
            on_results=self._on_results, on_dispatch=self._on_dispatch, name=f"endpoint/{name}"
        )
        self.scaler: Scaler | None = None  # managers from a provider's blocks (issue 17)
        if settings is not None and settings.provider != "local":
            self.scaler = make_scaler(
                self.runtime, settings, prefetch=prefetch, status_file=blocks_file
            )
            self.scaler.start()
        else:
            self.runtime.add_manager(workers, prefetch=prefetch)
        self.orders = Orders(self.runtime, name)  # environment orders (build, remove)

    # ------------------------------------------------------------ running

    @property
    def connects(self) -> int:
        """How many times it connected to the service."""
        return self.socket.connects

    async def run(self) -> None:
        """Serve until :meth:`stop`; AuthError or NotFound when the service will not take
        this endpoint's token any more (refused, revoked, replaced, deleted)."""
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self._http = httpx.AsyncClient(
            base_url=self.service_url,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=httpx.Timeout(60.0, connect=10.0),
            verify=self._ssl or True,
        )
        try:
            await self.socket.run(self._session)
        finally:
            for job in list(self._jobs):
                job.cancel()
            await asyncio.gather(*self._jobs, return_exceptions=True)
            await self._http.aclose()
            self.runtime.shutdown(wait=True, kill=True)
            if self.scaler is not None:
                self.scaler.stop()

    def stop(self) -> None:
        """Stop (thread-safe): close the connection; the service requeues held tasks."""
        self.socket.stop()

    async def _session(self, ws: ClientConnection) -> None:
        assert self._ready is not None
        hello = Hello(PYTHON, SERIALIZER, self.workers, self.window, list(self._held), (ORDERS,))
        await ws.send(hello.encode())
        self._outbox = list(self._unacked.values())
        self._ready.set()
        jobs = [
            asyncio.create_task(self._reader(ws)),
            asyncio.create_task(self._sender(ws)),
            asyncio.create_task(self._beater(ws)),
            asyncio.create_task(self._marker(ws)),
            asyncio.create_task(self.socket.wait_stopped()),
        ]
        try:
            done, _ = await asyncio.wait(jobs, return_when=asyncio.FIRST_COMPLETED)
            for job in done:
                if job.exception() is not None:
                    raise job.exception()  # type: ignore[misc]
        finally:
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)

    async def _reader(self, ws: ClientConnection) -> None:
        """Handle the service's messages; a malformed one closes the connection (to
        reconnect), with its close code and one log line."""
        try:
            async for data in ws:
                msg = decode_message(decode_frame(data, SERVICE_SENDS), SERVICE_SENDS)
                if isinstance(msg, Order):  # answered at once; the nodes report in beats
                    await ws.send((await asyncio.to_thread(self.orders.answer, msg)).encode())
                    continue
                self._handle(msg)
        except ProtocolError as exc:
            log.warning("closing the connection to %s: malformed frame: %s", self.url, exc)
            await ws.close(exc.code, str(exc).encode()[:120].decode(errors="ignore"))

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, Tasks):
            self._start(msg.tasks)
        elif isinstance(msg, Ack):
            for task_id in msg.ids:
                self._unacked.pop(task_id, None)
        elif isinstance(msg, Cancel):
            for task_id in msg.ids:
                task = self._held.get(task_id)
                if task is not None:
                    self.runtime.cancel(task)
        elif isinstance(msg, Beat):
            self.beat_latency = time.monotonic() - msg.seconds()

    async def _sender(self, ws: ClientConnection) -> None:
        assert self._ready is not None
        while True:
            await self._ready.wait()
            if self._held:
                await asyncio.sleep(COALESCE)  # more results are coming: let them join
            self._ready.clear()
            rows, self._outbox = self._outbox, []
            for batch in batches(rows, _result_size, most=SEND_CHUNK):
                await ws.send(Results(batch).encode())

    async def _beater(self, ws: ClientConnection) -> None:
        beats = 0
        said: list[dict[str, Any]] | None = None
        while True:
            envs = None
            orders = self.orders.changed()  # how the nodes do with environment orders
            if beats % ENVIRONMENTS_EVERY == 0 or self.orders.finished:  # what nodes hold
                self.orders.finished = False
                envs = await asyncio.to_thread(self._environments)
            runtime = self._runtime()  # blocks, managers, workers: when it changed
            send = runtime if runtime != said or beats % ENVIRONMENTS_EVERY == 0 else None
            said = runtime
            beats += 1
            await ws.send(Beat(time.monotonic(), envs, send, orders).encode())
            if not self.orders.unfinished:
                await asyncio.sleep(self.heartbeat)
                continue
            for _ in range(max(1, round(self.heartbeat / ORDER_POLL))):  # say an end soon
                await asyncio.sleep(min(ORDER_POLL, self.heartbeat))
                if self.orders.rows() != self.orders.said:
                    break

    def _runtime(self) -> list[dict[str, Any]]:
        """``Beat.runtime``: the blocks, managers and workers busy or idle now."""
        try:
            scaler = self.scaler.statistics() if self.scaler is not None else None
            return runtime_rows(self.runtime.statistics(), scaler)
        except Exception as exc:  # shutting down, or a row it cannot read: said once
            if not self._runtime_failed:
                self._runtime_failed = True
                log.warning("cannot say the runtime in heartbeats: %r", exc, exc_info=True)
            return []

    def _environments(self) -> list[dict[str, Any]]:
        """What the nodes hold, one row per node and environment (warm workers, build
        state, size, last use: ``nimbus.environments.held``), for ``nimbus
        environments list --endpoint``; remote managers report their own node's."""
        try:
            managers = self.runtime.statistics()["managers"]
        except Exception:  # the runtime is shutting down
            managers = []
        try:
            local = environments.cache().report()
        except (OSError, NimbusError) as exc:
            log.warning("cannot read this node's environments: %s", exc)
            local = []
        try:  # a heartbeat goes on whatever a manager's statistics say
            return environments.held(managers, socket.gethostname(), local)[:MAX_ENVIRONMENTS]
        except Exception as exc:
            log.warning("cannot say the nodes' environments in heartbeats: %r", exc)
            return []

    async def _marker(self, ws: ClientConnection) -> None:
        """Tell the service which tasks run: those a worker has started (not those waiting
        in a worker's window) still running RUNNING_AFTER after they went to it. Blocks'
        managers on other nodes do not say when a task starts: there, those sent on."""
        said_start = self.scaler is None  # the workers are this process's manager's
        while True:
            await asyncio.sleep(RUNNING_AFTER)
            now = time.monotonic()
            running = []
            for task_id, since in list(self._dispatched.items()):
                task = self._held.get(task_id)
                if task is None:
                    self._dispatched.pop(task_id, None)
                elif now - since >= RUNNING_AFTER and (task.started or not said_start):
                    running.append(task_id)
                    self._dispatched.pop(task_id, None)
            if running:
                await ws.send(Running(running).encode())

    # ------------------------------------------------------------ tasks

    def _start(self, rows: list[TaskRow | Malformed]) -> None:
        batch: list[Task] = []
        failed: list[ResultRow] = []
        for row in rows:
            if isinstance(row, Malformed):
                if row.task_id is None:
                    log.warning("dropped a task row from the service: %s", row.error)
                    continue
                error: Exception = ProtocolError(
                    f"task {row.task_id} came from the service malformed: {row.error}"
                )
                failed.append(self._failure(row.task_id, row.function_id, error))
                continue
            task_id, function_id, payload = row.task_id, row.function_id, row.payload
            if row.body is not None:
                self._functions[function_id] = row.body
            if task_id in self._held or task_id in self._fetching:
                continue  # sent again after a reconnect: it is still running here
            if task_id in self._unacked:
                self._outbox.append(self._unacked[task_id])
                continue
            fn_bytes = self._functions.get(function_id)
            if not fn_bytes:
                error = RemoteError(f"function {function_id} is not registered (deleted?)")
                failed.append(self._failure(task_id, function_id, error))
                continue
            if isinstance(payload, DataRef):  # its arguments are in the data store: fetch them
                self._fetching.add(task_id)
                self._spawn(self._fetch(row, payload.data_id))
                continue
            try:
                data, buffers = unpack_payload(payload)
            except ValueError as exc:
                error = DeserializationError(
                    f"the arguments of task {task_id} could not be decoded ({exc}); "
                    f"they must be pack_payload(pickle, buffers)"
                )
                failed.append(self._failure(task_id, function_id, error))
                continue
            environment: Environment | None = None
            if row.environment is not None:
                try:
                    environment = Environment.from_dict(row.environment)
                except ConfigError as exc:
                    error = ProtocolError(f"task {task_id}: its environment: {exc}")
                    failed.append(self._failure(task_id, function_id, error))
                    continue
            fn_key = function_id
            if row.owner is not None:  # run as its owner: their data scope in the worker
                fn_key, fn_bytes = self._as_owner(function_id, row.owner, fn_bytes)
            record = TaskRecord(task_id, TaskState.RUNNING, function=function_id)
            task = Task(
                next(self._seq),
                fn_key,
                fn_bytes,
                data,
                buffers,
                record,
                timeout=row.timeout,
                environment=environment,
                env="" if environment is None else environment_tag(environment),
            )
            self._held[task_id] = task
            batch.append(task)
        if batch:
            self.runtime.submit(batch)
        if failed:
            self._outbox.extend(failed)
        if failed or self._outbox:
            assert self._ready is not None
            self._ready.set()

    def _as_owner(self, function_id: str, owner: str, fn_bytes: bytes) -> tuple[str, bytes]:
        """The function ``function_id`` run as the user ``owner`` (``nimbus.owners``):
        a function key of its own, made once per function and user."""
        found = self._owned.get((function_id, owner))
        if found is None:
            if len(self._owned) >= 4096:  # bounded: made again on use
                self._owned.clear()
            found = (f"{function_id}:{owner}", owners.owned(owner, fn_bytes))
            self._owned[function_id, owner] = found
        return found

    def _on_dispatch(self, tasks: list[Task]) -> list[Task]:
        """On the runtime's thread: a cancelled task going (back) to a worker ends here."""
        now = time.monotonic()
        for task in tasks:
            self._dispatched[task.record.task_id] = now
        cancelled = [task for task in tasks if task.cancelled]
        if not cancelled:
            return tasks
        for task in cancelled:
            task.status, task.data = Status.SKIPPED, b""
        self._on_results(cancelled)
        return [task for task in tasks if not task.cancelled]

    def _on_results(self, tasks: list[Task]) -> None:
        """On the runtime's thread: hand finished tasks to the event loop."""
        rows = []
        for task in tasks:
            record = task.record
            record.state = STATES.get(Status(task.status), TaskState.FAILED)
            result = new_row(Result, (task.status, task.data, task.result_buffers))
            rows.append(
                new_row(ResultRow, (record.task_id, record.state, result, record.to_wire()))
            )
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._finished, rows)

    def _finished(self, rows: list[ResultRow]) -> None:
        small = []
        for row in rows:
            result = row.result
            assert isinstance(result, Result)
            if payload_size(result.data, result.buffers) > INLINE_MIN:  # maybe for the data store
                self._spawn(self._send_large(row))  # held until it is stored
            else:
                small.append(row)
        for row in small:
            self._held.pop(row.task_id, None)
            self._unacked[row.task_id] = row
        self._outbox.extend(small)
        assert self._ready is not None
        self._ready.set()

    def _failure(
        self, task_id: str, function_id: str, error: BaseException, record: Any = None
    ) -> ResultRow:
        """The result row of a task that failed here, before it ran or (``record``) after."""
        if record is None:
            record = TaskRecord(task_id, TaskState.FAILED, function=function_id).to_wire()
        result = Result(Status.ERROR, serialization.dumps_exception(error, ""))
        row = ResultRow(task_id, TaskState.FAILED, result, record)
        self._unacked[task_id] = row
        return row

    # ------------------------------------------------------------ the data store

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        job = asyncio.ensure_future(coro)
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)

    async def _fetch(self, row: TaskRow, data_id: str) -> None:
        """Fetch a task's arguments from the data store, then start it (or fail it)."""
        assert self._http is not None
        task_id = row.task_id
        try:
            response = await self._http.get(f"{DATA}/{data_id}")
            response.raise_for_status()
            payload = response.content
        except (httpx.HTTPError, OSError) as exc:
            self._fetching.discard(task_id)
            error = RemoteError(
                f"the arguments of task {task_id} could not be fetched from the service's "
                f"data store ({data_id}): {exc}"
            )
            self._finished([self._failure(task_id, row.function_id, error)])
            return
        self._fetching.discard(task_id)
        self._start([row._replace(body=None, payload=payload)])

    async def _send_large(self, row: ResultRow) -> None:
        """Send a large result: inline below the service's limit, else through the data store."""
        assert self._http is not None
        task_id = row.task_id
        result = row.result
        assert isinstance(result, Result)
        data, buffers = result.data, result.buffers
        backoff = 0.1
        while True:
            try:
                if self._limits is None:
                    limits = await self._http.get(LIMITS)
                    limits.raise_for_status()
                    self._limits = {k: int(v) for k, v in limits.json().items()}
                size = payload_size(data, buffers)
                if size <= self._limits["inline_payload"]:
                    break
                if size > self._limits["max_payload"]:  # refused before a byte is sent
                    error = too_large(
                        f"the result of task {task_id}", size, self._limits["max_payload"]
                    )
                    row = self._failure(task_id, "", error, row.record)
                    break
                blob = result.pack()
                response = await self._http.put(DATA, params={"task_id": task_id}, content=blob)
                if response.status_code == 404:  # done elsewhere or cancelled: not needed
                    self._held.pop(task_id, None)
                    return
                response.raise_for_status()
                row = row._replace(result=DataRef(response.json()["data_id"]))
                break
            except (httpx.HTTPError, OSError, ValueError) as exc:
                log.info("storing the result of %s failed (%s); retrying", task_id, exc)
                await asyncio.sleep(backoff)
                backoff = min(MAX_BACKOFF, backoff * 2)
        self._held.pop(task_id, None)
        self._unacked[task_id] = row
        self._outbox.append(row)
        assert self._ready is not None
        self._ready.set()


def _result_size(row: ResultRow) -> int:
    result = row.result
    return payload_size(result.data, result.buffers) if isinstance(result, Result) else 64


def main(argv: list[str] | None = None) -> int:
    """``python -m nimbus.endpoint.daemon NAME``: run a configured endpoint's daemon."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m nimbus.endpoint.daemon NAME", file=sys.stderr)
        return 2
    config = EndpointConfig.load(args[0])
    settings = Settings.load()
    workers = config.workers
    settings = settings.replace(**config.provider_settings())  # the endpoint's, not $NIMBUS_*
    if config.provider != "local":  # its managers come from the provider's blocks
        per_node = settings.workers_per_node or os.cpu_count() or 1
        workers = settings.max_blocks * settings.nodes_per_block * per_node
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    daemon = EndpointDaemon(
        config.service_url,
        config.token,
        workers=workers,
        prefetch=config.prefetch,
        heartbeat=settings.heartbeat,
        name=config.name,
        settings=settings,
        blocks_file=config.blocks_file,
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.stop())
    config.pid_file.write_text(f"{os.getpid()}\n")
    try:
        _loop.run(daemon.run())
    except (ServiceError, ConfigError) as exc:  # refused, revoked, replaced, deleted: says why
        print(f"nimbus endpoint {config.name}: {exc}", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(OSError):
            if config.pid_file.read_text().strip() == str(os.getpid()):
                config.pid_file.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
