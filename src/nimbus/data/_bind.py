"""The client's side of a task on the data path: its dependencies and its references.

::

    submit(fn, ref, future, [future, ...])
        waiting_on: the futures not done yet (the task is sent when they are), and the
                    Refs refused now if they are not this session's (another user's)
        bind:       done futures -> their Ref (kept) or their value; every Ref held
                    until the task is done

Arguments are looked at to the depth ``run`` resolves: the arguments themselves and
the items of lists, tuples and dicts among them of at most ``MAX_SCAN`` items (a
larger container is passed as it is: pass its futures as arguments, or in smaller lists).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any

from nimbus.data._file import File, Out, Staged
from nimbus.data._ref import MAX_SCAN, Ref, Session, owner_namespace, register, session
from nimbus.errors import DataError, InputFailed

__all__ = [
    "bind",
    "failed_among",
    "open_session",
    "uses_data",
    "waiting_on",
    "walk",
    "when_done",
]


def _items(value: Any) -> Any:
    """The items of a list, tuple or dict argument that are looked at (small ones only)."""
    kind = type(value)
    if kind is list or kind is tuple:
        return value if len(value) <= MAX_SCAN else ()
    if kind is dict:
        return value.values() if len(value) <= MAX_SCAN else ()
    return ()


def walk(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Any]:
    for value in (*args, *kwargs.values()):
        yield value
        yield from _items(value)


def _is_data(value: Any) -> bool:
    return type(value) in _DATA or isinstance(value, cf.Future)


_DATA = (Ref, File, Out, Staged)


def uses_data(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a Ref or a future is among the arguments (the data path is needed)."""
    for value in (*args, *kwargs.values()):
        if _is_data(value) or any(map(_is_data, _items(value))):
            return True
    return False


def waiting_on(args: tuple[Any, ...], kwargs: dict[str, Any], where: Session) -> list[cf.Future]:
    """The futures among the arguments not done yet; a Ref ``where`` cannot use is refused."""
    waiting = []
    for value in walk(args, kwargs):
        if type(value) is Ref:
            where.check(value)
        elif isinstance(value, cf.Future) and not value.done():
            waiting.append(value)
    return waiting


def failed_among(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[cf.Future]:
    """The futures among the arguments that failed or were cancelled."""
    return [
        value
        for value in walk(args, kwargs)
        if isinstance(value, cf.Future)
        and value.done()
        and (value.cancelled() or value.exception() is not None)
    ]


def _bound(value: Any, where: Session, holds: list[Ref], promised: Collection[Any] = ()) -> Any:
    if type(value) is Ref:
        where.check(value)
        holds.append(value)
        return value
    if isinstance(value, cf.Future):
        if value in promised:  # not done: the Ref its task will make (it runs first)
            promise: Ref = value._promise  # type: ignore[attr-defined]
            return promise
        if value.cancelled():  # (its result() says only CancelledError, no word of which)
            record = getattr(value, "record", None)
            task_id = getattr(record, "task_id", "")
            named = f"task {task_id} ({record.function})" if record is not None else repr(value)
            raise InputFailed(
                f"this task did not run: its input, {named}, was cancelled; submit that "
                f"task again and pass its new future",
                task_id,
            )
        if getattr(value, "kept", False):
            ref: Ref = value.ref()  # type: ignore[attr-defined]
            where.check(ref)
            holds.append(ref)
            return ref
        return value.result()  # a future of a result that came back: its value
    return value


def bind(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    where: Session,
    promised: Collection[Any] = (),
) -> tuple[tuple[Any, ...], dict[str, Any], list[Ref]]:
    """The arguments with done futures replaced, and the Refs the task holds.

    A future that failed raises its exception here: the dependent task fails with it.
    The kept futures in ``promised`` (not done: the service runs the task after them)
    are replaced by the Refs their tasks will make (``KeptFuture._promise``).
    """
    holds: list[Ref] = []

    def one(value: Any) -> Any:
        kind = type(value)
        if not any(map(_is_data, _items(value))):
            return _bound(value, where, holds, promised)
        if kind is list:
            return [_bound(v, where, holds, promised) for v in value]
        if kind is tuple:
            return tuple(_bound(v, where, holds, promised) for v in value)
        if kind is dict:
            return {k: _bound(v, where, holds, promised) for k, v in value.items()}
        return _bound(value, where, holds, promised)

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}, holds


def when_done(futures: list[cf.Future], then: Callable[[], None]) -> None:
    """Call ``then`` once, when all ``futures`` are done (on the thread of the last)."""
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: cf.Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    for future in futures:
        future.add_done_callback(one_done)


def open_session(backend: Any, endpoint: str | None, call: Callable[..., Any]) -> Session:
    """The session of an Executor whose backend is ``backend``: this node's store for a
    local runtime; for an endpoint through the service, its user's store there (the
    user as the service knows the token: ``whoami``)."""
    client = getattr(backend, "client", None)
    if endpoint is None or client is None:
        return session(None)
    token = getattr(client, "token", None)
    if not token:
        raise DataError("references on an endpoint need a service token (NIMBUS_TOKEN)")
    me = client.whoami()
    # the store the endpoint gives this user's tasks: named from the owner the service
    # passes with each task (every token of the user finds the same one)
    place = str(getattr(backend, "endpoint_id", endpoint))  # names differ between users
    name = endpoint  # as the user named it; an id given: the service's name for it
    if name == place:
        try:
            name = str(client.get_endpoint(place).get("name") or place)
        except Exception:  # (only for messages)
            name = place
    user = str(me.get("name", ""))
    found = Session(owner_namespace(str(me["user_id"])), user, place, call=call, name=name)
    register(place, found)
    register(endpoint, found)
    return found
