"""Refs of one endpoint passed to tasks on another: copied there, once per target.

::

    ex_hpc.submit(fn, ref_made_on_lab)   (the same user; lab's Executor open here)
        carry: the Ref -> a Copy future (a dependency, as a kept future is)
        a thread: offer on hpc (a new id in the user's store there)
                  send_object on lab (the stored bytes, straight to hpc: ``_direct``)
                  -> Ref(new id, hpc), held by hpc's session -> the task is sent
    a kept future of another endpoint's executor: copied the same way once it is done

Copies are remembered by (source id, target) while the original is held here: 16 tasks
on hpc reading one Ref of lab copy it once; the copy is freed (as any Ref) once the
original's last Ref and the tasks that read the copy are gone. A Ref of another user is not copied (refused at submit, as before).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
import weakref
from typing import Any

from nimbus.data._ref import MAX_SCAN, Ref, Session, new_id, session

__all__ = ["Copy", "carry"]

TIMEOUT = 600.0  # seconds a copy may take (each of its two steps)
_pool = cf.ThreadPoolExecutor(4, thread_name_prefix="nimbus-data-copy")
_lock = threading.Lock()
_copies: dict[tuple[str, str | None], Copy] = {}


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
        made = getattr(path, "session", None)
        return made is not None and made.endpoint != where.endpoint
    return False


def _one(value: Any, where: Session) -> Any:
    if type(value) is Ref:
        return _copy(value, where)
    return _copy_later(value, where)


def carry(
    args: tuple[Any, ...], kwargs: dict[str, Any], where: Session
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with the Refs (and kept futures) of another endpoint
    replaced by futures of their copies where the task runs."""

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
    with _lock:
        found = _copies.get(key)
        if found is not None and not (found.done() and found.exception()):
            return found
        copy = _copies[key] = Copy()
        if len(_copies) > 1024:
            _copies.pop(next(iter(_copies)), None)  # (None: _forget may pop it meanwhile)
    if ref._entry is not None:  # the copy is let go with the last Ref of the original
        weakref.finalize(ref._entry, _forget, key, copy)
    _pool.submit(_transfer, ref, where, copy)
    return copy


def _forget(key: tuple[str, str | None], copy: Copy) -> None:
    """The original's last Ref went: its copy is let go (its Ref freed with it). A
    finalizer: it runs wherever the cyclic collector runs, also in a thread inside
    ``_copy``'s ``_lock``, so it takes no lock. (No Ref of the original is left to
    copy it again meanwhile; at worst a copy made again at that instant is not cached.)"""
    if _copies.get(key) is copy:
        _copies.pop(key, None)


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


def _transfer(ref: Ref, where: Session, copy: Copy) -> None:
    from nimbus.data._direct import offer, send_object

    try:
        source = session(ref.endpoint)  # the Executor of the endpoint that keeps it
        ref_id = new_id()
        expires = time.time() + where.lease
        assert where.call is not None and source.call is not None
        host, port, secret = where.call(offer, "obj", ref_id, expires).result(TIMEOUT)[:3]
        size, _ = source.call(send_object, ref.id, host, port, secret).result(TIMEOUT)
        made = Ref(ref_id, where.namespace, where.user, where.endpoint, size)
        copy.set_result(where.adopt(made))
    except BaseException as exc:
        copy.set_exception(exc)
