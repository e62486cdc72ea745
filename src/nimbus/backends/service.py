"""The service backend: an Executor's tasks run on a remote endpoint.

::

    Executor.submit --> submit(batch) --> pending --(loop thread: one message per
                                                     burst)--> WebSocket /v1/ws/client
    on_results(tasks) <-- results (streamed, no polling) <-----------------+

One thread runs an asyncio loop holding the WebSocket to the service. Tasks
submitted while a message is being built join the next one, so a ``map`` of
many small tasks travels in a few large msgpack messages. When the connection
breaks it reconnects, asks again for the results of the tasks it waits for
(``watch``) and sends again the batches the service had not acknowledged.
Arguments larger than the service's inline limit are uploaded to its data store
by ``submit`` (in the caller's thread); results in the data store are fetched
in a thread of the loop before they are delivered.

Whatever the service sends is checked: a frame that is not a well-formed
message (or larger than ``RECEIVE_MAX``) closes the connection with a code,
one log line, and it reconnects; a result of the wrong shape fails its task
alone. Tasks the service says it does not know (``unknown``: lost when its
queues restarted empty) fail with :class:`~nimbus.errors.TaskLost`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection

from nimbus import _loop, serialization
from nimbus.backends import DispatchCallback, ResultCallback
from nimbus.client import Client, error_for
from nimbus.config import Settings
from nimbus.errors import (
    AuthError,
    ConfigError,
    NimbusError,
    ProtocolError,
    ServiceError,
    ServiceUnavailable,
    TaskLost,
    VersionMismatchError,
)
from nimbus.protocol import (
    INLINE_MIN,
    PYTHON,
    SERIALIZER,
    WRONG_SHAPE,
    WS_CLIENT,
    batches,
    brief,
    data_ref,
    decode_frame,
    is_result,
    pack,
    pack_payload,
    payload_size,
    str_list,
    unpack,
    unpack_result,
)
from nimbus.protocol.wsclient import certificate_error, open_socket
from nimbus.records import TaskRecord
from nimbus.runtime.messages import Status
from nimbus.runtime.task import Task

__all__ = ["ServiceBackend"]

log = logging.getLogger(__name__)

_FIELDS = [f.name for f in dataclasses.fields(TaskRecord)]
_OURS = frozenset(("task_id", "state", "function", "submitted"))

CONNECT_TIMEOUT = 15.0
KEEPALIVE = 5.0  # seconds between WebSocket pings to the service
COALESCE = 0.002  # with work in flight, wait this long to gather more into one message
COALESCE_MAX = 4096
RETRY_503 = 1.0  # seconds before a batch refused with 503 (queues restarting) is sent again
SERVICE_OPS = ("results", "accepted", "refused", "unknown")
_STATUSES = frozenset(Status)


class ServiceBackend:
    """Runs an Executor's tasks on endpoint ``endpoint`` through the nimbus service."""

    def __init__(
        self,
        *,
        workers: int,
        prefetch: int,
        on_results: ResultCallback,
        on_dispatch: DispatchCallback | None = None,
        on_notice: Callable[[Any], None] | None = None,
        settings: Settings | None = None,
        endpoint: str | None = None,
        preload: Sequence[str] = (),
    ) -> None:
        del prefetch, on_notice
        if not endpoint:
            raise ConfigError("the service backend needs an endpoint: Executor(endpoint='name')")
        if preload:
            raise ConfigError(
                "preload applies to local workers; an endpoint's workers import what its tasks need"
            )
        self.capacity = workers
        self.remote = True  # the Executor pickles the caller's own functions by value
        self.client = Client(settings=settings)
        try:
            info = self.client.get_endpoint(endpoint)
        except BaseException:
            self.client.close()
            raise
        if info.get("python") and (info["python"], info["serializer"]) != (PYTHON, SERIALIZER):
            self.client.close()
            raise VersionMismatchError(
                f"endpoint {endpoint!r} runs Python {info['python']} with serializer "
                f"{info['serializer']}, this client runs Python {PYTHON} with serializer "
                f"{SERIALIZER}; use the same Python minor version on both sides"
            )
        self.endpoint_id: str = info["endpoint_id"]
        self._on_results = on_results
        self._on_dispatch = on_dispatch
        self._registered: dict[str, str] = {}
        self._lock = threading.Lock()
        self._pending: list[Task] = []
        self._scheduled = False
        self._delayed = False
        self._refs = itertools.count()
        self._unaccepted: dict[int, list[Task]] = {}
        self._packed: dict[Task, bytes | dict[str, str]] = {}  # staged payloads (large ones)
        self._failed: dict[Task, BaseException] = {}  # staging failed: the task fails
        self._fetches: set[asyncio.Task[None]] = set()
        self._by_id: dict[str, Task] = {}
        self._early: dict[str, list[Any]] = {}  # results that arrived before their "accepted"
        self._idle = threading.Condition(self._lock)
        self._outstanding = 0
        self._closing = False
        self._loop = _loop.new_event_loop()
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._connected = threading.Event()
        self._error: BaseException | None = None
        self._refused: AuthError | None = None  # the token was refused after connecting
        self._thread = threading.Thread(target=self._run, name="nimbus-service", daemon=True)
        self._thread.start()
        if not self._connected.wait(CONNECT_TIMEOUT):
            self.shutdown(wait=False)
            raise ServiceUnavailable(
                f"no WebSocket to {self.client.service_url} after {CONNECT_TIMEOUT} s"
                + (f" ({self._error})" if self._error else "")
            )

    # ------------------------------------------------------------ caller's side

    def submit(self, batch: list[Task]) -> None:
        for task in batch:
            function_id = self._registered.get(task.fn_key)
            if function_id is None:
                function_id = self.client.register_function_bytes(
                    task.fn_bytes, task.record.function
                )
                self._registered[task.fn_key] = function_id
            task.route = function_id
            if payload_size(task.payload, task.buffers) > INLINE_MIN:
                self._stage(task)
        with self._lock:
            self._pending.extend(batch)
            self._outstanding += len(batch)
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._flush)

    def _stage(self, task: Task) -> None:
        """Pack a large payload now, uploading it if over the service's inline limit (in
        the caller's thread); a failure (too large, say) fails the task when it is sent."""
        try:
            self._packed[task] = self.client.payload(task.payload, task.buffers)
        except NimbusError as exc:
            self._failed[task] = exc

    def cancel(self, task: Task) -> None:
        self._loop.call_soon_threadsafe(self._cancel, task)

    def shutdown(self, wait: bool = True, *, kill: bool = False) -> None:
        if wait and not kill:
            with self._idle:
                self._idle.wait_for(lambda: self._outstanding <= 0 or self._closing)
        self._closing = True
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._outbox.put_nowait, b"")
        if threading.current_thread() is not self._thread:
            self._thread.join(10)
        self.client.close()

    # ------------------------------------------------------------ loop thread

    def _run(self) -> None:
        _loop.run_on(self._loop, self._main())

    async def _main(self) -> None:
        base = self.client.service_url
        context = self.client.ssl_context()
        backoff = 0.05
        malformed = False  # the last connection ended on a malformed frame: keep backing off
        while not self._closing:
            try:
                async with open_socket(
                    base, WS_CLIENT, self.client.token, context, keepalive=KEEPALIVE
                ) as ws:
                    if not malformed:
                        backoff = 0.05
                    malformed = False
                    self._refused = None
                    await self._resume(ws)
                    self._connected.set()
                    await self._session(ws)
            except ProtocolError:
                malformed = True  # logged and closed by the reader
            except websockets.InvalidStatus as exc:
                status = exc.response.status_code
                self._error = error_for(status, "the service refused the token")
                if status in (401, 403) and self._connected.is_set():  # revoked since
                    self._refused = AuthError(
                        f"the service at {base} no longer accepts this token (HTTP {status}): "
                        f"it was revoked; ask the service admin for a new one",
                        status,
                    )
                    self._fail_all(self._refused)
            except (OSError, websockets.WebSocketException, TimeoutError) as exc:
                self._error = certificate_error(exc, base) or exc
                sent = getattr(exc, "sent", None)
                if sent is not None and sent.code == 1009:  # over RECEIVE_MAX
                    log.warning("closed the connection to %s: %s; reconnecting", base, sent)
            except Exception as exc:  # a fault met in a session ends that connection, not us
                log.exception("the session with the service at %s failed; reconnecting", base)
                self._error = exc
            if self._closing:
                break
            await asyncio.sleep(backoff)
            backoff = min(2.0, backoff * 2)

    def _fail_all(self, error: BaseException) -> None:
        """Fail every task waiting for the service (which refuses this client now)."""
        tasks = list(self._by_id.values())
        for batch in self._unaccepted.values():
            tasks.extend(batch)
        self._by_id.clear()
        self._unaccepted.clear()
        self._early.clear()
        self._packed.clear()
        data = serialization.dumps_exception(error, "")
        for task in tasks:
            task.status, task.data = Status.ERROR, data
        self._deliver(tasks)

    async def _resume(self, ws: ClientConnection) -> None:
        """After a (re)connect: ask for results still owed, resend unacknowledged batches."""
        while not self._outbox.empty():
            self._outbox.get_nowait()
        if self._by_id:
            await ws.send(pack({"op": "watch", "ids": list(self._by_id)}))
        for ref, tasks in self._unaccepted.items():
            await ws.send(self._submit_message(ref, tasks))

    async def _session(self, ws: ClientConnection) -> None:
        jobs = [asyncio.create_task(self._reader(ws)), asyncio.create_task(self._sender(ws))]
        try:
            done, _ = await asyncio.wait(jobs, return_when=asyncio.FIRST_COMPLETED)
            for job in done:
                job.result()  # a lost connection raises here: reconnect
        finally:
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)

    async def _sender(self, ws: ClientConnection) -> None:
        while not self._closing:
            message = await self._outbox.get()
            if not message:
                return  # shutdown
            await ws.send(message)

    def _submit_message(self, ref: int, tasks: list[Task]) -> bytes:
        rows = [[t.route, self._payload(t), t.timeout] for t in tasks]
        return pack({"op": "submit", "ref": ref, "endpoint_id": self.endpoint_id, "tasks": rows})

    def _payload(self, task: Task) -> bytes | dict[str, str]:
        packed = self._packed.get(task)
        return pack_payload(task.payload, task.buffers) if packed is None else packed

    def _size(self, task: Task) -> int:
        packed = self._packed.get(task)
        if isinstance(packed, dict):
            return 64
        return payload_size(task.payload, task.buffers)

    def _flush(self) -> None:
        """Send what was submitted; while tasks are in flight, wait COALESCE to gather more."""
        if (
            (self._by_id or self._unaccepted)  # busy: more submits are likely on their way
            and len(self._pending) < COALESCE_MAX
            and not self._delayed
        ):
            self._delayed = True
            self._loop.call_later(COALESCE, self._flush)
            return
        self._delayed = False
        with self._lock:
            batch, self._pending = self._pending, []
            self._scheduled = False
        if self._on_dispatch is not None:
            kept = self._on_dispatch(batch)
            self._done(len(batch) - len(kept))
            for task in set(batch).difference(kept):  # cancelled before they were sent
                self._packed.pop(task, None)
                self._failed.pop(task, None)
            batch = kept
        if self._refused is not None:  # the service refuses our token: fail, do not queue
            for task in batch:
                self._failed.setdefault(task, self._refused)
        failed = {task for task in batch if task in self._failed}
        if failed:
            for task in failed:
                task.status = Status.ERROR
                task.data = serialization.dumps_exception(self._failed.pop(task), "")
            self._deliver(list(failed))
            batch = [task for task in batch if task not in failed]
        for tasks in batches(batch, self._size):
            ref = next(self._refs)
            self._unaccepted[ref] = tasks
            self._outbox.put_nowait(self._submit_message(ref, tasks))

    def _resend(self, ref: int) -> None:
        """Send again a batch refused with 503 (the service's queues were away)."""
        tasks = self._unaccepted.get(ref)
        if tasks:
            self._outbox.put_nowait(self._submit_message(ref, tasks))

    def _cancel(self, task: Task) -> None:
        task_id = task.record.task_id
        if self._by_id.get(task_id) is task:
            self._outbox.put_nowait(pack({"op": "cancel", "ids": [task_id]}))

    async def _reader(self, ws: ClientConnection) -> None:
        """Handle the service's messages; a malformed one closes the connection with its
        close code and one log line, and raises the ProtocolError (to reconnect)."""
        try:
            async for data in ws:
                await self._handle(ws, decode_frame(data, SERVICE_OPS))
        except ProtocolError as exc:
            url = self.client.service_url
            log.warning("closing the connection to %s: malformed frame: %s", url, exc)
            await ws.close(exc.code, str(exc).encode()[:120].decode(errors="ignore"))
            raise

    async def _handle(self, ws: ClientConnection, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "results":
            rows = msg.get("results")
            if not isinstance(rows, list) or not all(_is_row(row) for row in rows):
                raise ProtocolError(
                    f"results.results: expected [[task_id, state, result, record], ...], "
                    f"got {brief(rows)}",
                    WRONG_SHAPE,
                )
            self._results(rows)
        elif op == "unknown":
            self._lost(str_list(msg, "ids"))
        elif op == "accepted":
            ref, ids = msg.get("ref"), str_list(msg, "ids")
            if not isinstance(ref, int):
                raise ProtocolError(f"accepted.ref: expected an int, got {brief(ref)}", WRONG_SHAPE)
            tasks = self._unaccepted.get(ref)
            if tasks is None:
                return  # a batch sent twice (again after a reconnect), accepted twice
            if len(ids) != len(tasks):
                raise ProtocolError(
                    f"accepted: {len(ids)} ids for batch {brief(ref)} of {len(tasks)} tasks",
                    WRONG_SHAPE,
                )
            cancels = self._accepted(ref, ids)
            if cancels:
                await ws.send(pack({"op": "cancel", "ids": cancels}))
        else:  # refused
            ref, status, detail = msg.get("ref"), msg.get("status"), msg.get("detail")
            if (
                not isinstance(ref, int)
                or not isinstance(status, int)
                or not isinstance(detail, str)
            ):
                raise ProtocolError(
                    "refused: expected {ref: int, status: int, detail: str}", WRONG_SHAPE
                )
            if status == 503:
                self._loop.call_later(RETRY_503, self._resend, ref)
                return
            tasks = self._unaccepted.pop(ref, [])
            data = serialization.dumps_exception(error_for(status, detail), "")
            for task in tasks:
                self._packed.pop(task, None)
                task.status, task.data = Status.ERROR, data
            self._deliver(tasks)

    def _accepted(self, ref: int, ids: list[str]) -> list[str]:
        """The service queued batch ``ref`` as tasks ``ids``; those cancelled meanwhile."""
        tasks = self._unaccepted.pop(ref, [])
        early = []
        cancels = []
        for task, task_id in zip(tasks, ids):
            self._packed.pop(task, None)
            task.record.task_id = task_id
            self._by_id[task_id] = task
            if task.cancelled:
                cancels.append(task_id)
            row = self._early.pop(task_id, None)
            if row is not None:
                early.append(row)
        if not self._unaccepted:
            self._early.clear()  # all replies are in: no other can be ours
        if early:
            self._results(early)
        return cancels

    def _lost(self, ids: list[str]) -> None:
        """The service does not know these tasks: they fail with TaskLost."""
        url = self.client.service_url
        lost = []
        for task_id in ids:
            task = self._by_id.pop(task_id, None)
            if task is None:
                continue
            error = TaskLost(
                f"task {task_id} was lost by the service at {url}: it no longer knows it "
                f"(its task queues restarted empty, or its result expired); it may or may "
                f"not have run: submit it again (a service started with --persist keeps "
                f"its tasks across such restarts)",
                410,
            )
            task.status, task.data = Status.ERROR, serialization.dumps_exception(error, "")
            lost.append(task)
        if lost:
            log.warning("%d tasks were lost by the service at %s", len(lost), url)
        self._deliver(lost)

    def _results(self, rows: list[list[Any]]) -> None:
        done = []
        for row in rows:
            task_id, _state, blob, record = row
            task = self._by_id.pop(task_id, None)
            if task is None:
                if self._unaccepted:  # it overtook the reply that names it
                    self._early[task_id] = row
                continue
            record = _unpacked(record)
            if isinstance(record, list):  # the worker's measures: keep our id, function,
                mine = task.record  # state, submit time
                for name, value in zip(_FIELDS, record):
                    if name not in _OURS:
                        setattr(mine, name, value)
            # packed when it comes from storage (a watch after a reconnect), else as sent
            value = _unpacked(blob)
            ref = data_ref(value)
            error: ServiceError | None = None
            if ref is None and not (is_result(value) and value[0] in _STATUSES):
                error = ProtocolError(
                    f"task {task_id}: the service sent a result of the wrong shape "
                    f"({brief(value)}); expected [status, data, buffers]"
                )
            elif ref is None and value[0] == Status.SKIPPED and not task.cancelled:
                error = ServiceError(
                    f"task {task_id} was cancelled on the service (by the owner of its "
                    f"endpoint, say) before it ran",
                    409,
                )
            if error is not None:
                task.status, task.data = Status.ERROR, serialization.dumps_exception(error, "")
                done.append(task)
                continue
            if ref is not None:  # in the data store: fetched in a thread, then delivered
                fetch = asyncio.ensure_future(self._fetch_result(task, ref))
                self._fetches.add(fetch)
                fetch.add_done_callback(self._fetches.discard)
                continue
            task.status, task.data, task.result_buffers = value
            done.append(task)
        self._deliver(done)

    async def _fetch_result(self, task: Task, data_id: str) -> None:
        try:
            blob = await asyncio.to_thread(self.client.download, data_id)
            task.status, task.data, task.result_buffers = unpack_result(blob)
            if task.status not in _STATUSES:
                raise ValueError(f"status {task.status!r}")
        except NimbusError as exc:
            task.status, task.data = Status.ERROR, serialization.dumps_exception(exc, "")
        except Exception as exc:  # not a packed result
            error = ProtocolError(
                f"task {task.record.task_id}: its result {data_id} in the service's data "
                f"store is not a packed result ({type(exc).__name__}: {exc})"
            )
            task.status, task.data = Status.ERROR, serialization.dumps_exception(error, "")
        self._deliver([task])

    def _deliver(self, tasks: list[Task]) -> None:
        if tasks:
            self._on_results(tasks)
            self._done(len(tasks))

    def _done(self, n: int) -> None:
        if n:
            with self._idle:
                self._outstanding -= n
                if self._outstanding <= 0:
                    self._idle.notify_all()


def _is_row(row: object) -> bool:
    """A results row's frame: ``[task_id, state, result, record]``."""
    return isinstance(row, list) and len(row) == 4 and isinstance(row[0], str)


def _unpacked(value: Any) -> Any:
    """A value the service sent as msgpack bytes (from storage) or as is; None if broken."""
    if not isinstance(value, bytes):
        return value
    if not value:
        return None
    try:
        return unpack(value)
    except Exception:
        return None
