"""The Executor's data path: tasks whose arguments are Refs or futures, kept results.

::

    Executor._submit(fn, args, keep)  --uses data / keep-->  DataPath.submit
        waiting_on: the futures not done yet; Refs of another user refused now
        on an endpoint (the backend takes ``dependencies``), when they are kept futures
        of this path (or of another Executor of the same user on the same endpoint and
        service, accepted there): sent at once, each input named (``_after``) and replaced by the
        Ref its task will make (``_promise``); the service holds the task until they
        succeed, and fails it (InputFailed) if one does not
        else, when they are done (on this path's sender thread): bind -> the task, sent
        through ``run`` (``Executor._launch``) with the session's scope
    a kept result (a Ref) --> KeptFuture.set_result; held by the session
    a task that read a lost Ref made by a pure task --> that task again, then this one

The executor keeps the runtime side (launching, results, cancelling); this module keeps
what a task of the data path needs before it is sent and after its result is in.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import logging
import threading
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

from nimbus import serialization
from nimbus._future import Future
from nimbus.data._bind import bind, failed_among, open_session, waiting_on, walk, when_done
from nimbus.data._carry import Copy, carry, relayed_by
from nimbus.data._file import OutPending
from nimbus.data._ref import MAX_SCAN, Ref, Session, new_id
from nimbus.data._staging import carry_out, copy_names, restage
from nimbus.data._task import run
from nimbus.data._watch import Watch, offline_error
from nimbus.errors import InputFailed, ReferenceLost
from nimbus.records import TaskRecord, TaskState

__all__ = ["DataPath", "KeptFuture"]

log = logging.getLogger(__name__)


RESTAGE = 3  # times a task's staged file is staged again (its copy's node left)


def _stagings(given: list[Any]) -> list[cf.Future[Any]]:
    """The futures of staged files among a task's arguments (``_staging.stage``'s)."""
    args, kwargs = given
    return [v for v in walk(args, kwargs) if isinstance(v, cf.Future) and hasattr(v, "staging")]


def _replaced(
    args: tuple[Any, ...], kwargs: dict[str, Any], old: Any, new: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with ``old`` (at the depth ``bind`` looks) made ``new``."""

    def one(value: Any) -> Any:
        if value is old:
            return new
        kind = type(value)
        if kind in (list, tuple) and len(value) <= MAX_SCAN and any(v is old for v in value):
            return kind(new if v is old else v for v in value)
        if kind is dict and len(value) <= MAX_SCAN and any(v is old for v in value.values()):
            return {k: new if v is old else v for k, v in value.items()}
        return value

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


class KeptFuture(Future):
    """A future whose result stays where its task ran: it holds a ``nimbus.Ref``.

    ``result()`` fetches the object (each call); ``ref()`` is the reference, to pass
    to other tasks (or pass the future itself: it is a dependency).
    """

    kept = True
    _recipe: tuple[Any, ...] | None = (
        None  # (fn, args, kwargs, timeout, env, limits) of a pure task
    )
    _path: DataPath | None = None
    # on an endpoint: the Ref its task will make (its id chosen here), for the tasks
    # that take it before it is done (the service holds them until it is)
    _promise: Ref | None = None

    def ref(self, timeout: float | None = None) -> Ref:
        """The reference to the result, once the task is done."""
        ref: Ref = super().result(timeout)
        return ref

    def result(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        ref = self.ref(timeout)
        try:  # (within what is left of ``timeout``: its read is a task there too)
            return ref.get(_left(deadline))
        except ReferenceLost:
            if self._recipe is None or self._path is None or self._path.offline():
                raise  # (an offline endpoint would hold the task made again for ever)
            again = self._path.again(self)  # a pure task: made again, then fetched
            return again.result(_left(deadline))


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _done_well(future: cf.Future[Any]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


def fail(future: cf.Future[Any], error: BaseException | None) -> None:
    try:
        future.set_exception(error)
    except cf.InvalidStateError:
        pass


class DataPath:
    """One Executor's tasks of the data path (``executor``: what launches them)."""

    def __init__(self, executor: Any) -> None:
        self._ex = executor
        self.session: Session | None = None
        self._lock = threading.Lock()
        self._opening = threading.Lock()
        self._wrapped: dict[int, tuple[Callable[..., Any], partial[Any], str]] = {}
        # reference id -> the kept future of the pure task that made it
        self._producers: weakref.WeakValueDictionary[str, KeptFuture] = (
            weakref.WeakValueDictionary()
        )
        # (a send, the future it fails if it raises)
        self._sends: list[tuple[Callable[[], None], cf.Future[Any] | None]] = []
        self._send_ready = threading.Condition(self._lock)
        self._sender: threading.Thread | None = None
        self._watch: Watch | None = None  # its calls on an endpoint (made on first use)

    # -- the session ---------------------------------------------------------
    def open(self) -> Session:
        """The executor's session in its place's store (made on first use)."""
        found = self.session
        if found is None:
            with self._opening:
                found = self.session
                if found is None:
                    ex = self._ex
                    found = self.session = open_session(ex._backend, ex._endpoint, self.call)
        return found

    def call(
        self, fn: Callable[..., Any], *args: Any, keep: bool = False, after: Any = ()
    ) -> Future:
        """``fn(*args)`` run there as a task of the data path (a read, a copy, a
        renewal); on an endpoint it fails, and is cancelled, if the endpoint is offline
        (``_watch``): a stopped endpoint's objects are gone, nothing waits for them."""
        ex = self._ex
        future = self.submit(
            fn, args, {}, ex._timeout, keep, ex._environment, ex._env, after=list(after)
        )
        if ex._endpoint is not None and getattr(ex._backend, "client", None) is not None:
            if self._watch is None:
                with self._opening:
                    if self._watch is None:
                        self._watch = Watch(self.online)
            self._watch.add(future, offline_error(fn, args))
        return future

    def offline(self) -> bool:
        """Whether the service says this path's endpoint is offline (never locally)."""
        if self._ex._endpoint is None or getattr(self._ex._backend, "client", None) is None:
            return False
        state = self.online()
        return state is not None and not state[0]

    def online(self) -> tuple[bool, str] | None:
        """Whether the endpoint is online, and its name, as the service says (None
        when it cannot be asked now)."""
        backend = self._ex._backend
        place = str(getattr(backend, "endpoint_id", self._ex._endpoint))
        try:
            info = backend.client.get_endpoint(place)
        except Exception:  # (the service unreachable: nothing is failed for it)
            return None
        return bool(info.get("online", True)), str(info.get("name") or place)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` run through ``nimbus.data.run`` (one partial per function, reused)."""
        entry = self._wrapped.get(id(fn))  # by identity, as the function cache
        if entry is not None and entry[0] is fn:
            return entry[1]
        if len(self._wrapped) >= 1024:  # bounded (new closures at every call)
            self._wrapped.clear()
        wrapped = partial(run, fn)
        wraps = ""  # on the service: registered with the environment fn was registered with
        if self._ex._remote:
            wraps = hashlib.sha256(self._ex._functions.get(fn)[1]).hexdigest()
        self._wrapped[id(fn)] = (fn, wrapped, wraps)
        return wrapped

    def wraps(self, fn: Callable[..., Any] | None) -> str:
        """The SHA-256 of ``fn``'s pickle if its task runs it wrapped (see :meth:`wrap`)."""
        entry = None if fn is None else self._wrapped.get(id(fn))
        return entry[2] if entry is not None and entry[0] is fn else ""

    # -- submitting ------------------------------------------------------------
    def submit(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        keep: bool,
        environment: Any = None,
        env: str = "",
        limits: Any = None,
        after: list[Any] | None = None,
    ) -> Future:
        """Submit ``fn`` through ``nimbus.data.run``: Refs resolved where it runs, its
        result kept when ``keep``; sent once the futures among its arguments (and those
        ``after`` names) are done."""
        ex = self._ex
        if ex._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")
        if not callable(fn):
            raise TypeError(f"{serialization.describe(fn)} is not callable; pass a function")
        session = self.open()
        relays: list[Any] = list(after or ())  # (kept futures of another endpoint: their relays)
        if session.endpoint is not None:  # Refs of other endpoints: copied there first
            args, kwargs = carry(args, kwargs, session, self, relays)
        waiting = waiting_on(args, kwargs, session)  # refuses another user's Refs now
        waiting += [f for f in relays if not _done_well(f) and f not in waiting]
        future: Future = KeptFuture() if keep else Future()
        if not keep:  # its Refs go when it is done (a kept one's: ``Executor._on_results``)
            future.add_done_callback(DataPath.done)  # type: ignore[arg-type]  # (not at a GC)
        future.record = TaskRecord("", function=getattr(fn, "__qualname__", ""))
        scope = session.scope(keep)
        ahead = getattr(ex._backend, "dependencies", False)  # the service holds dependents
        if keep:
            future._maker = self  # type: ignore[attr-defined]  # (where its Ref is)
            if ahead:
                scope = scope._replace(ref_id=new_id())
                where = (session.namespace, session.user, session.endpoint, 0)
                future._promise = Ref(scope.ref_id, *where)  # type: ignore[attr-defined]
        if ahead:  # inputs that failed already: InputFailed as for the others
            waiting += failed_among(args, kwargs)
        ahead = ahead and all(self.made(f) for f in waiting)
        if keep and getattr(fn, "__nimbus_pure__", False):
            future._recipe = (fn, args, kwargs, timeout, environment, env, limits)  # type: ignore[attr-defined]
            future._path = self  # type: ignore[attr-defined]
        wrapped = self.wrap(fn)
        given = future._given = [args, kwargs]  # type: ignore[attr-defined]  # (restage)

        def send() -> None:
            if future.done():
                return
            # ahead: every input not done, or failed (the backend fails this task with
            # InputFailed naming it), is named; those done well are bound as they are
            after = {f for f in waiting if not _done_well(f)} if ahead else set()
            # the relays of copies from another endpoint (made since: ``_relay_later``),
            # held by the service as inputs are
            held = [relayed_by(r) for r in relays]
            pending = [r for r in held if type(r) is not Copy and not _done_well(r)]
            pending = [r for r in pending if r not in after]
            for relay in held if not ahead else ():  # (ahead: InputFailed, by the backend)
                if relay.done() and not _done_well(relay):
                    fail(
                        future,
                        relay.exception()
                        if not relay.cancelled()
                        else InputFailed(
                            f"task {relay.record.task_id}, which copies this task's input "
                            f"from another endpoint, was cancelled; submit it again",
                            relay.record.task_id,
                        ),
                    )
                    return
            try:  # a dependency that failed fails this task with its error
                bound, bound_kw, holds = bind(given[0], given[1], session, after)
            except BaseException as exc:
                fail(future, exc)
                return
            # alive until it is done: its Refs, and its inputs (whose Refs it reads)
            future._holds = (holds, waiting, pending) if after or pending else holds  # type: ignore[attr-defined]
            future._after = [f for f in waiting if f in after] + pending or None
            ex._launch(
                wrapped,
                (scope, *bound),
                bound_kw,
                timeout,
                future,
                fn,
                environment=environment,
                env=env,
                limits=limits,
            )

        def send_later() -> None:
            try:
                send()
            except BaseException as exc:  # it cannot be sent (unpicklable, too large)
                fail(future, exc)

        future._resend = send_later  # type: ignore[attr-defined]
        if not waiting or ahead:  # (ahead: sent now, held by the service until its inputs)
            send()  # what cannot be sent raises here, at submit
            return future
        when_done(waiting, lambda: self.deferred(send_later, future))
        return future

    def made(self, future: cf.Future[Any]) -> bool:
        """Whether ``future`` is a kept task sent to the service (or done), whose Ref is
        known before it is done: a task taking it can be sent at once. Of this path; or
        of another Executor's whose tasks the same user runs on the same endpoint through
        the same service, once the service accepted it (it is named by its task id)."""
        maker = getattr(future, "_maker", None)
        if getattr(future, "_relay", False):  # another endpoint's relay (``_carry``)
            if maker is self or not isinstance(maker, DataPath):
                return False
            return self._one_service(maker) and maker.accepted(future)
        if type(future) is not KeptFuture or future._promise is None:
            return False
        if maker is self:
            return future._task is not None or future.done()
        return isinstance(maker, DataPath) and maker.accepted(future) and self._shares(maker)

    def accepted(self, future: cf.Future[Any]) -> bool:
        """Whether the service accepted ``future``'s task (it is known there by its task
        id: the id the executor gave it at launch is its own until then), or it is done."""
        if future.done():
            return True
        task = getattr(future, "_task", None)
        by_id = getattr(self._ex._backend, "_by_id", None)
        record = getattr(future, "record", None)
        return (
            task is not None
            and by_id is not None
            and record is not None
            and by_id.get(record.task_id) is task
        )

    def relays_with(self, source: Any, future: cf.Future[Any]) -> bool:
        """Whether a kept ``future`` of ``source`` (another endpoint's DataPath) can reach
        this path's tasks through the service alone: both through one service, which
        holds tasks after their inputs, the future sent there (``_carry._relay``)."""
        if source is self or not isinstance(source, DataPath) or not source.made(future):
            return False
        return self._one_service(source)

    def _one_service(self, source: Any) -> bool:
        """Whether ``source`` (a DataPath) sends its tasks to this path's service, and
        the service holds tasks after their inputs for both."""
        if not isinstance(source, DataPath):
            return False
        mine = getattr(self._ex._backend, "client", None)
        theirs = getattr(source._ex._backend, "client", None)
        return (
            getattr(self._ex._backend, "dependencies", False)
            and getattr(source._ex._backend, "dependencies", False)
            and mine is not None
            and theirs is not None
            and mine.service_url == theirs.service_url
        )

    def _shares(self, other: DataPath) -> bool:
        """Whether ``other``'s tasks run as this path's: same service, user and endpoint."""
        mine, theirs = self.session, other.session
        if mine is None or theirs is None or mine.endpoint is None:
            return False
        client = getattr(self._ex._backend, "client", None)
        their_client = getattr(other._ex._backend, "client", None)
        return (
            client is not None
            and their_client is not None
            and client.service_url == their_client.service_url
            and (mine.namespace, mine.endpoint) == (theirs.namespace, theirs.endpoint)
        )

    # -- results ---------------------------------------------------------------
    def kept(self, future: KeptFuture, ref: Ref) -> Ref:
        """A kept task's result: held by the session; a pure task's remembered."""
        ref = self.open().adopt(ref)
        if future._recipe is not None:  # pure: made again if it is lost
            self._producers[ref.id] = future
        return ref

    def again(self, producer: KeptFuture) -> KeptFuture:
        """Run a pure kept task again (its object was lost); ``producer`` names the new one."""
        assert producer._recipe is not None
        fn, args, kwargs, timeout, environment, env, limits = producer._recipe
        again: KeptFuture = self.submit(  # type: ignore[assignment]
            fn, args, kwargs, timeout, True, environment, env, limits
        )

        def made(f: cf.Future[Any]) -> None:
            if f.exception() is None:
                ref = again.ref()
                with producer._condition:
                    producer._result = ref
                self._producers[ref.id] = producer

        again.add_done_callback(made)
        return again

    def recover(self, future: Future, error: BaseException) -> bool:
        """A task read a lost reference: when a pure task of this executor made it, run
        that again and then this one (once per task); when it is a staged file's copy
        (its node left before the task's fetched it), stage the file again from its
        endpoint and send the task again (``RESTAGE`` times per task at most). A task
        whose out= files could not go where they go (``OutPending``): this client carries
        them, then the task's future gets its result. Whether it does."""
        if type(error) is OutPending:
            return self._carry_out(future, error)
        if type(error) is not ReferenceLost:
            return False
        return (
            self._restage(future, error)
            or self._rebind(future, error)
            or self._rerun(future, error)
        )

    def _carry_out(self, future: Future, error: OutPending) -> bool:
        """The out= files of ``error`` carried through this client (a thread of its
        own: ``carry_out``), then ``future`` done with the task's result, or failed."""

        def carry() -> None:
            try:
                carry_out(self._ex, error.pending)
                value = error.value
                if type(future) is KeptFuture:
                    value = self.kept(future, value)
            except BaseException as exc:
                future.record.state = TaskState.FAILED
                fail(future, exc)
            else:
                future.record.state = TaskState.SUCCESS
                with contextlib.suppress(cf.InvalidStateError):  # (cancelled meanwhile)
                    future.set_result(value)
            if type(future) is not Future:  # the data path: its Refs go when it does
                DataPath.done(future)

        threading.Thread(target=carry, name="nimbus-carry-out", daemon=True).start()
        return True

    def _rerun(self, future: Future, error: ReferenceLost) -> bool:
        """The pure task that made the lost reference run again, then ``future``'s (once)."""
        producer = self._producers.get(error.ref_id)
        resend = getattr(future, "_resend", None)
        if producer is None or resend is None or getattr(future, "_recovered", False):
            return False
        future._recovered = True  # type: ignore[attr-defined]

        def rerun() -> None:
            again = self.again(producer)
            again.add_done_callback(
                lambda f: resend() if f.exception() is None else fail(future, f.exception())
            )

        self.deferred(rerun, future)
        return True

    def _rebind(self, future: Future, error: ReferenceLost) -> bool:
        """A task sent before its input was made (``_promise``: the service held it) ran
        on another node of the endpoint than the input's task: the promised Ref named no
        node to fetch it from. Once the input is here, its Ref does (``Ref.holder``): the
        task is sent again with it (once)."""
        given = getattr(future, "_given", None)
        resend = getattr(future, "_resend", None)
        if given is None or resend is None or getattr(future, "_rebound", False):
            return False
        made = [
            v
            for v in walk(given[0], given[1])
            if type(v) is KeptFuture and v._promise is not None and v._promise.id == error.ref_id
        ]
        if not made:
            return False
        future._rebound = True  # type: ignore[attr-defined]

        def again(input: cf.Future[Any]) -> None:
            if _done_well(input) and made[0].ref().holder is not None:
                self.deferred(resend, future)
            elif not self._rerun(future, error):  # (held on no server: lost indeed)
                fail(future, error)

        made[0].add_done_callback(again)
        return True

    def _restage(self, future: Future, error: ReferenceLost) -> bool:
        given = getattr(future, "_given", None)
        resend = getattr(future, "_resend", None)
        tries = getattr(future, "_restaged", 0)
        if given is None or resend is None or tries >= RESTAGE or not error.ref_id:
            return False
        found = [s for s in _stagings(given) if error.ref_id in copy_names(s)]
        if not found:
            return False
        future._restaged = tries + 1  # type: ignore[attr-defined]
        old = found[0]

        def again() -> None:
            new = restage(self._ex, old)
            given[0], given[1] = _replaced(given[0], given[1], old, new)
            new.add_done_callback(lambda _: self.deferred(resend, future))

        # (a thread of its own: staging asks the file's endpoint, which may take a while)
        threading.Thread(target=again, name="nimbus-restage", daemon=True).start()
        return True

    @staticmethod
    def done(future: Future) -> None:
        """A task of the data path ended: its Refs go when it does."""
        future._holds = None  # type: ignore[attr-defined]
        future._after = None
        future._resend = None  # type: ignore[attr-defined]  # (a cycle through it)
        future._given = None  # type: ignore[attr-defined]
        future._task = None  # no cycle with the task: the last Ref is freed at once

    @staticmethod
    def explain(future: Future, error: InputFailed) -> None:
        """A task failed because its input did: the input's own error is its cause."""
        for source in future._after or ():
            record = getattr(source, "record", None)
            mine = record is not None and record.task_id == error.input_id
            mine = mine and error.__cause__ is None
            if mine and source.done() and not source.cancelled():
                error.__cause__ = source.exception()

    # -- sending ---------------------------------------------------------------
    def deferred(self, send: Callable[[], None], future: cf.Future[Any] | None = None) -> None:
        """Send a task whose dependencies are done, from this path's sender thread
        (not the runtime's, which delivered the results it waited for); a ``send`` that
        raises fails ``future`` (the task's) with its error."""
        with self._lock:
            self._sends.append((send, future))
            if self._sender is None:
                self._sender = threading.Thread(
                    target=self._send_deferred, name="nimbus-deps", daemon=True
                )
                self._sender.start()
            self._send_ready.notify()

    def _send_deferred(self) -> None:
        while True:
            with self._lock:
                while not self._sends:
                    self._send_ready.wait()
                batch, self._sends = self._sends, []
            for send, future in batch:
                try:
                    send()
                except BaseException as exc:  # the thread goes on: later tasks are sent
                    if future is None:
                        log.exception("a deferred task could not be sent")
                    else:
                        fail(future, exc)
            # not kept while waiting for the next: a send's closure holds its task's
            # arguments (Refs, copies), which would live until another task is deferred
            del batch, send, future
