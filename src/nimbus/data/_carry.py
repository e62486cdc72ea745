"""Refs of one endpoint passed to tasks on another: copied there, once per target.

::

    ex_hpc.submit(fn, ref_made_on_lab)   (the same user; lab's Executor open here)
        carry: the Ref -> a Copy future (a dependency, as a kept future is)
        a thread: offer on hpc (a new id in the user's store there)
                  send_object on lab (the stored bytes, straight to hpc: ``_direct``)
                  -> Ref(new id, hpc), held by hpc's session -> the task is sent
    a kept future of another endpoint's executor, not done, through the same service
    (``_relay``): no wait here: expect_object on hpc (its node's server, a pin's secret),
    push_object on lab held by the service after the future, the task held after it
    (any other: copied the same way as a Ref once it is done)

Copies are remembered by (source id, target) while the original is held here: 16 tasks
on hpc reading one Ref of lab copy it once; the copy is freed (as any Ref) once the
original's last Ref and the tasks that read the copy are gone. A Ref of another user is not copied (refused at submit, as before).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from nimbus.data._ref import MAX_SCAN, Ref, Session, named, new_id, session
from nimbus.errors import DataAccessError, DataError

__all__ = ["Copy", "carry"]

TIMEOUT = 600.0  # seconds a copy may take (each of its two steps)
_pool = cf.ThreadPoolExecutor(4, thread_name_prefix="nimbus-data-copy")
_lock = threading.Lock()  # (for ``_relaying``)
V = TypeVar("V")
Key = tuple[str, str | None]  # (the original's id, the target endpoint)


class _Registry(Generic[V]):
    """What was made for a key (a Ref's copy, a relay), the newest ``LIMIT`` kept:
    found and kept under a lock of its own, forgotten without it (by a finalizer)."""

    LIMIT = 1024

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._made: dict[Key, V] = {}

    def get(self, key: Key) -> V | None:
        with self._lock:
            return self._made.get(key)

    def add(self, key: Key, make: Callable[[], V], keep: Callable[[V], bool]) -> tuple[V, bool]:
        """The value of ``key`` if there is one to ``keep``, else one made and kept in its
        place; and whether it was made."""
        with self._lock:
            found = self._made.get(key)
            if found is not None and keep(found):
                return found, False
            made = self._made[key] = make()
            self._trim()
        return made, True

    def put(self, key: Key, value: V) -> None:
        with self._lock:
            self._made[key] = value
            self._trim()

    def _trim(self) -> None:
        if len(self._made) > self.LIMIT:  # (the oldest: a dict keeps its order)
            self._made.pop(next(iter(self._made)), None)

    def forget(self, key: Key, value: V, *held: Any) -> None:
        """``key`` forgotten if ``value`` is still its own (``held``: kept alive until
        this runs, as a relay's pin). A finalizer: the cyclic GC may run it inside ``with
        self._lock`` in this very thread, so no lock (at worst a newer value is forgotten,
        and made again when next needed)."""
        if self._made.get(key) is value:
            self._made.pop(key, None)

    def clear(self) -> None:
        """Nothing kept, and a new lock (a forked child: the parent's may be held)."""
        self._lock = threading.Lock()
        self._made.clear()


_copies: _Registry[Copy] = _Registry()  # a Ref's copy to an endpoint
# (a promise's id, the target endpoint) -> the copy's id, the relay's future, its holder
_relays: _Registry[tuple[str, Any, tuple[str, int, str, str]]] = _Registry()
_relaying: dict[Key, Copy] = {}  # relays being made


def _after_fork() -> None:
    """A forked child: the parent's copies are not its own, nor its pool's threads."""
    global _pool, _lock
    _pool = cf.ThreadPoolExecutor(4, thread_name_prefix="nimbus-data-copy")
    _lock = threading.Lock()
    _copies.clear()
    _relaying.clear()
    _relays.clear()


os.register_at_fork(after_in_child=_after_fork)


class Copy(cf.Future[Any]):
    """The future of a Ref copied to the task's endpoint (a kept result, to ``bind``)."""

    kept = True

    def ref(self, timeout: float | None = None) -> Ref:
        ref: Ref = self.result(timeout)
        return ref


def _elsewhere(value: Any, where: Session) -> bool:
    if type(value) is Ref:
        return value.endpoint != where.endpoint and value.namespace == where.namespace
    if getattr(value, "kept", False) and type(value) is not Copy:
        path = getattr(value, "_path", None) or getattr(value, "_maker", None)
        made = getattr(path, "session", None)  # (the local runtime's: refused by ``check``)
        return (
            made is not None
            and made.endpoint != where.endpoint
            and made.namespace == where.namespace
        )
    return False


def carry(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    where: Session,
    path: Any = None,
    relays: list[Any] | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with the Refs (and kept futures) of another endpoint
    replaced by futures of their copies where the task runs; a kept future not done yet
    whose endpoint and the task's share a service (``path``: the task's DataPath) by the
    Ref its copy will be, its relay task appended to ``relays`` (:func:`_relay`)."""

    def _one(value: Any, where: Session) -> Any:
        if type(value) is Ref:
            return _copy(value, where)
        if relays is not None and path is not None and not value.done():
            copy = _relay_later(value, where, path)
            relays.append(copy)  # (its relay, once made: ``relayed_by``)
            return copy
        return _copy_later(value, where)

    def one(value: Any) -> Any:
        if _elsewhere(value, where):
            return _one(value, where)
        kind = type(value)
        if kind in (list, tuple) and len(value) <= MAX_SCAN:
            if any(_elsewhere(v, where) for v in value):
                return kind(_one(v, where) if _elsewhere(v, where) else v for v in value)
        elif (
            kind is dict
            and len(value) <= MAX_SCAN
            and any(_elsewhere(v, where) for v in value.values())
        ):
            return {k: _one(v, where) if _elsewhere(v, where) else v for k, v in value.items()}
        return value

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _copy(ref: Ref, where: Session) -> Copy:
    key = (ref.id, where.endpoint)
    copy, made = _copies.add(key, Copy, lambda found: not (found.done() and found.exception()))
    if not made:
        return copy
    if ref._entry is not None:  # the copy is let go with the last Ref of the original
        weakref.finalize(ref._entry, _copies.forget, key, copy)
    _pool.submit(_transfer, ref, where, copy)
    return copy


def _copy_later(future: Any, where: Session) -> Copy:
    copy = Copy()

    def done(f: Any) -> None:
        error = f.exception()
        if error is not None:
            copy.set_exception(error)
            return
        made = _copy(f.ref(), where)
        made.add_done_callback(lambda m: _settle(copy, m))

    future.add_done_callback(done)
    return copy


def _settle(copy: Copy, made: cf.Future[Any]) -> None:
    error = made.exception()
    if error is not None:
        copy.set_exception(error)
    else:
        copy.set_result(made.result())


def _name(endpoint: str | None) -> str:
    return f"endpoint {named(endpoint)}" if endpoint else "the local runtime"


def _step(future: cf.Future[Any], ref: Ref, where: Session, what: str) -> Any:
    """The result of a step of copying ``ref`` to ``where`` (``what`` it waits for),
    within ``TIMEOUT`` s; then a :class:`DataError` naming the Ref and both ends."""
    try:
        return future.result(TIMEOUT)
    except cf.TimeoutError:
        if future.done():  # (the step's own TimeoutError)
            raise
        raise DataError(
            f"{ref!r} was not copied from {_name(ref.endpoint)} to {_name(where.endpoint)}: "
            f"{what} did not end within {TIMEOUT:.0f} s; is it online (`nimbus endpoints "
            f"list`)? Submit the task again once it is"
        ) from None


def _transfer(ref: Ref, where: Session, copy: Copy) -> None:
    from nimbus.data._direct import offer, send_object

    try:
        source = session(ref.endpoint)  # the Executor of the endpoint that keeps it
        ref_id = new_id()
        expires = time.time() + where.lease
        if where.call is None or source.call is None:  # (``carry`` passes no such Ref)
            raise DataAccessError(
                f"{ref!r} cannot be copied to {_name(where.endpoint)}: no endpoint"
            )
        taking = f"the task of {_name(where.endpoint)} that takes it"
        offered = _step(where.call(offer, "obj", ref_id, expires), ref, where, taking)
        host, port, secret = offered[:3]
        sending = f"the task of {_name(ref.endpoint)} that sends it"
        sent = source.call(send_object, ref.id, host, port, secret, ref.holder)
        size, _ = _step(sent, ref, where, sending)
        made = Ref(ref_id, where.namespace, where.user, where.endpoint, size)
        copy.set_result(where.adopt(made))
    except BaseException as exc:
        copy.set_exception(exc)


# ---------------------------------------------------------------- relayed by the service

ACCEPTED = 30.0  # seconds a relay task may take to be accepted by the service


def relayed_by(value: Any) -> Any:
    """The relay task of ``value`` if it is a relayed copy made (:func:`_relay_later`),
    else ``value``."""
    return getattr(value, "_relayed_by", None) or value


def _relay_later(future: Any, where: Session, path: Any) -> Copy:
    """:func:`_relay` on a thread of its own, so that ``submit`` does not wait for the
    target endpoint to expect the object (behind its whole queue, or offline): the copy's
    future, done (its ``_relayed_by`` set) once the relay is accepted by the service, or
    made by ``_copy_later`` where no relay can be."""
    promise = getattr(future, "_promise", None)
    key = None if promise is None else (promise.id, where.endpoint)
    with _lock:  # one relay for the tasks that take it meanwhile
        found = _relaying.get(key) if key is not None else None
        if found is not None:
            return found
        copy = Copy()
        if key is not None:
            _relaying[key] = copy

    def run() -> None:
        try:
            _run()
        finally:  # (made: ``_relays`` has it)
            with _lock:
                if key is not None and _relaying.get(key) is copy:
                    del _relaying[key]

    def _run() -> None:
        try:
            relayed = _relay(future, where, path)
        except cf.TimeoutError:
            copy.set_exception(
                DataError(
                    f"{_name(where.endpoint)} did not take the copy of a result of "
                    f"another endpoint within {TIMEOUT:.0f} s: is it online? "
                    f"(`nimbus endpoints list`)"
                )
            )
            return
        except BaseException as exc:
            copy.set_exception(exc)
            return
        if relayed is None:
            made = _copy_later(future, where)
            made.add_done_callback(lambda m: _settle(copy, m))
            return
        copy._relayed_by = relayed[1]  # type: ignore[attr-defined]
        copy.set_result(relayed[0])

    # a daemon thread: a relay waiting for an endpoint does not hold the program's exit
    threading.Thread(target=run, name="nimbus-data-relay", daemon=True).start()
    return copy


def _relay(future: Any, where: Session, path: Any) -> tuple[Ref, Any] | None:
    """A kept future of another endpoint (not done) copied to ``where`` without the
    client waiting for it: the target's node expects the object (``expect_object``: its
    server, a pin's secret), a relay task on the source endpoint, held by the service
    until the future's task succeeds, sends it there (``push_object``), and the task that
    takes it is held by the service until the relay succeeds. The Ref the copy will be,
    and the relay's future; None where this cannot be (then ``_copy_later``).

    The copy lands on the node that expected it; the Ref names that node (``holder``:
    its server, the pin's secret), so a task on another node of the endpoint fetches it
    from there (``_fetch.fetch_object``); the pin is held (renewed there, freed there)
    as long as the copy is."""
    from nimbus.data._direct import expect_object, push_object

    source = getattr(future, "_maker", None)
    promise = getattr(future, "_promise", None)
    if promise is None or source is None or not path.relays_with(source, future):
        return None
    key = (promise.id, where.endpoint)
    found = _relays.get(key)
    failed = found is not None and found[1].done() and not _succeeded(found[1])
    if found is not None and not failed:  # (its copy held: the entry goes with its last Ref)
        copy_id, relay, holder = found
        ref = Ref(copy_id, where.namespace, where.user, where.endpoint, 0, holder)
        return where.adopt(ref), relay
    copy_id = new_id()
    pin = copy_id + new_id()
    assert where.call is not None
    target = where.call(expect_object, copy_id, pin, time.time() + where.lease).result(TIMEOUT)
    if target is None:
        return None
    target = tuple(target)
    held_pin = where.adopt(Ref(pin, where.namespace, where.user, where.endpoint, 0))
    where.served(pin, target)  # renewed (and freed) on that node, wherever it runs
    relay = source.call(push_object, promise.id, target, pin, after=[future])
    relay._relay = True
    relay._maker = source
    relay._pin = held_pin  # the pin lives until the relay ended, and as long as the copy
    relay.add_done_callback(lambda f: setattr(f, "_pin", None))
    deadline = time.monotonic() + ACCEPTED  # named by its task id: accepted, not ended
    while not source.accepted(relay) and time.monotonic() < deadline:
        time.sleep(0.005)
    holder = (str(target[0]), int(target[1]), str(target[2]), pin)
    copy = where.adopt(Ref(copy_id, where.namespace, where.user, where.endpoint, 0, holder))
    made = (copy_id, relay, holder)
    _relays.put(key, made)
    assert copy._entry is not None
    # the copy's last Ref gone: its relay forgotten, its pin released with the finalizer
    # (which holds it: the pin lives as long as the copy, the other nodes fetch it)
    weakref.finalize(copy._entry, _relays.forget, key, made, held_pin)
    return copy, relay


def _succeeded(future: Any) -> bool:
    return not future.cancelled() and future.exception() is None
