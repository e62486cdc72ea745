"""The service backend: an Executor's tasks run on a remote endpoint.

::

    Executor.submit --> submit(batch) --> pending --(loop thread: one message per
                                                     burst)--> WebSocket /v1/ws/client
    on_results(tasks) <-- results (streamed, no polling) <-----------------+

One thread runs an asyncio loop holding the WebSocket to the service. Tasks
submitted while a message is being built join the next one, so a ``map`` of
many small tasks travels in a few large msgpack messages. When the connection
breaks it reconnects, asks again for the results of the tasks it waits for
(``watch``) and sends again the batches the service had not acknowledged; the
connection is the shared :class:`~nimbus.protocol.wsclient.ServiceSocket`. A
token the service refuses or revokes ends it: every task waiting and every
later submit fails with an AuthError naming the token and what to do.
Arguments larger than the service's inline limit are uploaded to its data store
by ``submit`` (in the caller's thread); results in the data store are fetched
in a thread of the loop before they are delivered.

Whatever the service sends is checked: a frame that is not a well-formed
message (or larger than ``RECEIVE_MAX``) closes the connection with a code,
one log line, and it reconnects; a result of the wrong shape fails its task
alone. Tasks the service says it does not know (``unknown``: lost when its
queues restarted empty) fail with :class:`~nimbus.errors.TaskLost`. This module
keeps the connection and which task waits for which reply; reading one task's
row into its outcome is ``nimbus.backends._outcomes``'s.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from websockets.asyncio.client import ClientConnection

from nimbus import _loop, serialization
from nimbus.backends import DispatchCallback, ResultCallback
from nimbus.backends._outcomes import fail, input_failed, lost, outcome, stored
from nimbus.backends._program import EndpointProgram
from nimbus.backends.handout import Store, open_store, probe_store
from nimbus.client import Client, environment_mismatch, error_for
from nimbus.config import Settings
from nimbus.errors import (
    ConfigError,
    NimbusError,
    ProtocolError,
    ServiceError,
    ServiceUnavailable,
    VersionMismatchError,
)
from nimbus.protocol import (
    INLINE_MIN,
    PYTHON,
    SERIALIZER,
    WRONG_SHAPE,
    WS_CLIENT,
    Accepted,
    Cancel,
    DataRef,
    Malformed,
    Message,
    Refused,
    ResultRow,
    Results,
    Submit,
    SubmitRow,
    Unknown,
    Watch,
    batches,
    brief,
    decode_frame,
    decode_message,
    new_row,
    pack_payload,
    payload_size,
    submit_row,
)
from nimbus.protocol.wsclient import ServiceSocket
from nimbus.runtime.messages import Status
from nimbus.runtime.task import Task

__all__ = ["ServiceBackend", "Store", "probe_store"]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 15.0
KEEPALIVE = 5.0  # seconds between WebSocket pings to the service
COALESCE = 0.002  # with work in flight, wait this long to gather more into one message
COALESCE_MAX = 4096
RETRY_503 = 1.0  # seconds before a batch refused with 503 (queues restarting) is sent again
SERVICE_SENDS: dict[str, type[Message]] = {
    kind.op: kind for kind in (Results, Accepted, Refused, Unknown)
}
WHOSE = "this client's token (NIMBUS_TOKEN, or the one `nimbus login` saved)"
FIX = "ask the service admin for a new one (then `nimbus login` again, or set NIMBUS_TOKEN)"


class ServiceBackend:
    """Runs an Executor's tasks on endpoint ``endpoint`` through the nimbus service."""

    open_store = staticmethod(open_store)  # for nimbus.multiprocessing (backends.handout)

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
        # a task's owner (its future) may name its inputs (``_after``: their futures):
        # the service holds it until they succeed (``nimbus.service.dependencies``)
        self.dependencies = True
        self.client = Client(settings=settings)
        try:
            info = self.client.get_endpoint(endpoint)
            self._socket = ServiceSocket(
                self.client.service_url,
                WS_CLIENT,
                self.client.token,
                self.client.ssl_context(),
                keepalive=KEEPALIVE,
                whose=WHOSE,
                fix=FIX,
                backoff=(0.05, 2.0),
                jitter=False,
            )
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
        # the program its tasks message each other in (the Executor starts it)
        self.program = EndpointProgram(self.client, self.endpoint_id, settings or Settings.load())
        self._on_results = on_results
        self._on_dispatch = on_dispatch
        self._registered: dict[str, str] = {}
        self._lock = threading.Lock()
        self._pending: list[Task] = []
        self._scheduled = False
        self._delayed = False
        self._refs = itertools.count()
        self._unaccepted: dict[int, list[Task]] = {}
        self._unsent: set[Task] = set()  # submitted, not yet accepted by the service
        self._blocked: list[Task] = []  # their inputs not yet accepted: sent after them
        self._packed: dict[Task, bytes | DataRef] = {}  # staged payloads (large ones)
        self._failed: dict[Task, BaseException] = {}  # staging failed: the task fails
        self._fetches: set[asyncio.Task[None]] = set()
        self._by_id: dict[str, Task] = {}
        self._early: dict[
            str, ResultRow | Malformed
        ] = {}  # results that arrived before their "accepted"
        self._idle = threading.Condition(self._lock)
        self._outstanding = 0
        self._closing = False
        self._loop = _loop.new_event_loop()
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._connected = threading.Event()  # connected once (or refused: see _refused)
        self._refused: NimbusError | None = None  # the token was refused or revoked: it ended
        self._thread = threading.Thread(target=self._run, name="nimbus-service", daemon=True)
        self._thread.start()
        if not self._connected.wait(CONNECT_TIMEOUT) or (
            self._refused is not None and not self._socket.connects
        ):
            self.shutdown(wait=False)
            if self._refused is not None:
                raise self._refused
            error = self._socket.error
            raise ServiceUnavailable(
                f"no WebSocket to {self.client.service_url} after {CONNECT_TIMEOUT} s"
                + (f" ({error})" if error else "")
            )

    # ------------------------------------------------------------ caller's side

    def submit(self, batch: list[Task]) -> None:
        for task in batch:
            function_id = self._registered.get(task.fn_key)
            if function_id is None:
                function_id = self.client.register_function_bytes(
                    task.fn_bytes, task.record.function, wraps=task.wraps
                )
                self._registered[task.fn_key] = function_id
            task.route = function_id
            if task.environment is not None:
                mismatch = environment_mismatch(task.environment)
                if mismatch is not None:  # refused at submit: the future fails with it
                    self._failed[task] = mismatch
                    continue
            if payload_size(task.payload, task.buffers) > INLINE_MIN:
                self._stage(task)
        with self._lock:
            self._pending.extend(batch)
            self._unsent.update(batch)
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
        self._socket.stop()
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._outbox.put_nowait, b"")
        if threading.current_thread() is not self._thread:
            self._thread.join(10)
        self.client.close()

    # ------------------------------------------------------------ loop thread

    def _run(self) -> None:
        _loop.run_on(self._loop, self._main())

    async def _main(self) -> None:
        try:
            await self._socket.run(self._connection)
        except (ServiceError, ConfigError) as exc:  # the token refused or revoked: we end
            log.info("%s", exc)  # raised by every result and submit: not printed twice
            self._refused = exc
            self._fail_all(exc)
            self._connected.set()  # a constructor waiting for the first connection: it ends
            await self._socket.wait_stopped()  # submits fail at once (_flush) until shutdown

    async def _connection(self, ws: ClientConnection) -> None:
        await self._resume(ws)
        self._connected.set()
        await self._session(ws)

    def _fail_all(self, error: BaseException) -> None:
        """Fail every task waiting for the service (which refuses this client now)."""
        tasks = list(self._by_id.values()) + self._blocked
        for batch in self._unaccepted.values():
            tasks.extend(batch)
        self._by_id.clear()
        self._unaccepted.clear()
        self._blocked = []
        self._unsent.clear()
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
            await ws.send(Watch(list(self._by_id)).encode())
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
        places: dict[Task, int] | None = None
        rows = []
        for t in tasks:
            if getattr(t.owner, "_after", None) is None:
                row = (t.route, self._payload(t), t.timeout, _environment(t))
                rows.append(new_row(SubmitRow, row))
                continue
            if places is None:
                places = {t: i for i, t in enumerate(tasks)}
            rows.append(self._row_after(t, places))
        return Submit(ref, self.endpoint_id, rows).encode()

    def _row_after(self, task: Task, places: dict[Task, int]) -> SubmitRow:
        """The row of a task that takes its inputs' results: each named by its place in
        this message (``places``) or else by its task id (``_ready`` made sure it is one
        or the other)."""
        after: list[str | int] = []
        for future in task.owner._after:
            place = places.get(future._task)
            after.append(future.record.task_id if place is None else place)
        return submit_row(task.route, self._payload(task), task.timeout, _environment(task), after)

    def _ready(self, tasks: list[Task]) -> list[Task]:
        """``tasks`` that can go in one message now. A task whose inputs are not all
        accepted by the service or earlier in this message waits (``_blocked``) until
        they are; one whose input failed or was cancelled here fails with InputFailed."""
        ready: list[Task] = []
        here: set[Task] = set()
        failed = []
        for task in tasks:
            inputs = getattr(task.owner, "_after", None)
            if inputs is not None:
                if task.cancelled:
                    self._unsent.discard(task)
                    self._done(1)
                    continue
                why = input_failed(task, inputs)
                if why is not None:
                    self._unsent.discard(task)
                    failed.append(fail(task, why))
                    continue
                if any(
                    f._task is not None and f._task in self._unsent and f._task not in here
                    for f in inputs
                ):
                    self._blocked.append(task)
                    continue
            ready.append(task)
            here.add(task)
        self._deliver(failed)
        return ready

    def _payload(self, task: Task) -> bytes | DataRef:
        packed = self._packed.get(task)
        return pack_payload(task.payload, task.buffers) if packed is None else packed

    def _size(self, task: Task) -> int:
        packed = self._packed.get(task)
        if isinstance(packed, DataRef):
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
                self._unsent.discard(task)
            batch = kept
        if self._refused is not None:  # the service refuses our token: fail, do not queue
            for task in batch:
                self._failed.setdefault(task, self._refused)
        failed = {task for task in batch if task in self._failed}
        if failed:
            self._unsent.difference_update(failed)
            self._deliver([fail(task, self._failed.pop(task)) for task in failed])
            batch = [task for task in batch if task not in failed]
        if self._blocked:  # older: first
            batch, self._blocked = self._blocked + batch, []
        for tasks in batches(batch, self._size):
            tasks = self._ready(tasks)
            if not tasks:
                continue
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
            self._outbox.put_nowait(Cancel([task_id]).encode())

    async def _reader(self, ws: ClientConnection) -> None:
        """Handle the service's messages; a malformed one closes the connection with its
        close code and one log line, and raises the ProtocolError (to reconnect)."""
        try:
            async for data in ws:
                msg = decode_message(decode_frame(data, SERVICE_SENDS), SERVICE_SENDS)
                await self._handle(ws, msg)
        except ProtocolError as exc:
            url = self.client.service_url
            log.warning("closing the connection to %s: malformed frame: %s", url, exc)
            await ws.close(exc.code, str(exc).encode()[:120].decode(errors="ignore"))
            raise

    async def _handle(self, ws: ClientConnection, msg: Message) -> None:
        if isinstance(msg, Results):
            self._results(msg.results)
        elif isinstance(msg, Unknown):
            self._lost(msg.ids)
        elif isinstance(msg, Accepted):
            tasks = self._unaccepted.get(msg.ref)
            if tasks is None:
                return  # a batch sent twice (again after a reconnect), accepted twice
            if len(msg.ids) != len(tasks):
                raise ProtocolError(
                    f"accepted: {len(msg.ids)} ids for batch {brief(msg.ref)} of "
                    f"{len(tasks)} tasks",
                    WRONG_SHAPE,
                )
            cancels = self._accepted(msg.ref, msg.ids)
            if cancels:
                await ws.send(Cancel(cancels).encode())
            self._unblock()
        elif isinstance(msg, Refused):
            if msg.status == 503:
                self._loop.call_later(RETRY_503, self._resend, msg.ref)
                return
            tasks = self._unaccepted.pop(msg.ref, [])
            data = serialization.dumps_exception(error_for(msg.status, msg.detail), "")
            self._unsent.difference_update(tasks)
            for task in tasks:
                self._packed.pop(task, None)
                task.status, task.data = Status.ERROR, data
            self._deliver(tasks)
            self._unblock()

    def _unblock(self) -> None:
        """Inputs were accepted (or refused): send the tasks that waited for them."""
        if self._blocked and not self._scheduled:
            with self._lock:
                self._scheduled = True
            self._loop.call_soon(self._flush)

    def _accepted(self, ref: int, ids: list[str]) -> list[str]:
        """The service queued batch ``ref`` as tasks ``ids``; those cancelled meanwhile."""
        tasks = self._unaccepted.pop(ref, [])
        early = []
        cancels = []
        self._unsent.difference_update(tasks)
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
        gone = []
        for task_id in ids:
            task = self._by_id.pop(task_id, None)
            if task is None:
                continue
            gone.append(fail(task, lost(task_id, url)))
        if gone:
            were = "task was" if len(gone) == 1 else "tasks were"
            log.warning("%d %s lost by the service at %s", len(gone), were, url)
        self._deliver(gone)

    def _results(self, rows: list[ResultRow | Malformed]) -> None:
        done = []
        for row in rows:
            task_id = row.task_id
            assert task_id is not None  # Results.decode read it
            task = self._by_id.pop(task_id, None)
            if task is None:
                if self._unaccepted:  # it overtook the reply that names it
                    self._early[task_id] = row
                continue
            result = outcome(task, row)
            if isinstance(result, BaseException):
                done.append(fail(task, result))
                continue
            if isinstance(result, DataRef):  # in the data store: fetched in a thread, then
                fetch = asyncio.ensure_future(self._fetch_result(task, result.data_id))
                self._fetches.add(fetch)  # delivered
                fetch.add_done_callback(self._fetches.discard)
                continue
            buffers = result.buffers
            task.status, task.data = result.status, result.data
            task.result_buffers = buffers
            done.append(task)
        self._deliver(done)

    async def _fetch_result(self, task: Task, data_id: str) -> None:
        try:
            blob = await asyncio.to_thread(self.client.download, data_id)
        except NimbusError as exc:
            self._deliver([fail(task, exc)])
            return
        stored(task, data_id, blob)
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


def _environment(task: Task) -> dict[str, Any] | None:
    """The task's environment as it travels (``to_dict()``), or None for the workers' own."""
    env = task.environment
    return None if env is None else env.to_dict()
