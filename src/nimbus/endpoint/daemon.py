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

Its parts, each a module of its own: the task rows made Tasks (``_intake``), the
transfers to and from the data store (``_transfers``), the beats and the running
marks (``_reports``, with ``_summary``'s rows and ``_orders``' environment orders).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import ssl
import sys
import time
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection

from nimbus import _loop, serialization
from nimbus.config import Settings
from nimbus.endpoint._intake import Intake
from nimbus.endpoint._orders import Orders
from nimbus.endpoint._reports import Reports
from nimbus.endpoint._transfers import Transfers
from nimbus.endpoint.config import EndpointConfig
from nimbus.errors import ConfigError, ProtocolError, ServiceError
from nimbus.protocol import (
    INLINE_MIN,
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
    TaskRow,
    Tasks,
    batches,
    decode_frame,
    decode_message,
    new_row,
    payload_size,
)
from nimbus.protocol.wsclient import ServiceSocket
from nimbus.records import TaskRecord, TaskState
from nimbus.runtime.agent import Agent
from nimbus.runtime.messages import Status
from nimbus.runtime.scaling import Scaler, make_scaler
from nimbus.runtime.task import Task

__all__ = ["EndpointDaemon", "main"]

log = logging.getLogger(__name__)
STATES = {
    Status.OK: TaskState.SUCCESS,
    Status.ERROR: TaskState.FAILED,
    Status.SKIPPED: TaskState.CANCELLED,
}
MAX_BACKOFF = 5.0
MIN_WINDOW = 1024  # tasks in flight from the service: enough to cover its round trip
SEND_CHUNK = 5000
COALESCE = 0.002  # with work in flight, wait this long to gather more into one message
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
        self._held: dict[str, Task] = {}
        self._unacked: dict[str, ResultRow] = {}
        self._outbox: list[ResultRow] = []
        self.intake = Intake()  # the functions sent, and the Tasks made of rows
        self._fetching: set[str] = set()  # tasks whose arguments come from the data store
        self.transfers = Transfers(self.service_url, token, self._ssl, backoff=(0.1, MAX_BACKOFF))
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
        self.reports = Reports(self.runtime, self.scaler, self.orders, heartbeat)

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
        self.transfers.open()
        try:
            # its node's data served before it is online: a put or out= file sent right
            # after the start finds it (the embedded runtime's waits DATA_AFTER s instead)
            await asyncio.to_thread(self.runtime.hold_data)
            await self.socket.run(self._session)
        finally:
            await self.transfers.close()
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
            asyncio.create_task(self.reports.beater(ws)),
            asyncio.create_task(self.reports.marker(ws, self._held)),
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
            task_id = row.task_id
            self.intake.learn(row)
            if task_id in self._held or task_id in self._fetching:
                continue  # sent again after a reconnect: it is still running here
            if task_id in self._unacked:
                self._outbox.append(self._unacked[task_id])
                continue
            task = self.intake.task(row)
            if isinstance(task, Exception):
                failed.append(self._failure(task_id, row.function_id, task))
                continue
            if task is None:  # its arguments are in the data store: fetch them
                assert isinstance(row.payload, DataRef)
                self._fetching.add(task_id)
                self.transfers.spawn(self._fetch(row, row.payload.data_id))
                continue
            self._held[task_id] = task
            batch.append(task)
        if batch:
            self.runtime.submit(batch)
        if failed:
            self._outbox.extend(failed)
        if failed or self._outbox:
            assert self._ready is not None
            self._ready.set()

    def _on_dispatch(self, tasks: list[Task]) -> list[Task]:
        """On the runtime's thread: a cancelled task going (back) to a worker ends here."""
        self.reports.dispatched(tasks)
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
                self.transfers.spawn(self._send_large(row))  # held until it is stored
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

    async def _fetch(self, row: TaskRow, data_id: str) -> None:
        """Fetch a task's arguments from the data store, then start it (or fail it)."""
        payload = await self.transfers.arguments(row.task_id, data_id)
        self._fetching.discard(row.task_id)
        if isinstance(payload, Exception):
            self._finished([self._failure(row.task_id, row.function_id, payload)])
        else:
            self._start([row._replace(body=None, payload=payload)])

    async def _send_large(self, row: ResultRow) -> None:
        """Send a large result: inline below the service's limit, else through the data store."""
        sent = await self.transfers.result(row)
        self._held.pop(row.task_id, None)
        if sent is None:  # done elsewhere or cancelled: not needed
            return
        if isinstance(sent, Exception):  # too large
            sent = self._failure(row.task_id, "", sent, row.record)
        self._unacked[row.task_id] = sent
        self._outbox.append(sent)
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
    _loop.serving_gc()
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
