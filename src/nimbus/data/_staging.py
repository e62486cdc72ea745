"""The client's side of Files: a submit's ``File`` arguments checked and staged where its
task runs, before the task is sent (see ``_file`` for the whole way of a file).

::

    stage(executor, args, kwargs)   each File: this machine's (checked here), the task's
        own endpoint's (read in place), or another endpoint's: _fetch, once per
        (endpoint, path, size, mtime) in ``_cache`` -> a Staged (parts in the task's
        endpoint's store, or a copy sent directly: _direct), the task's argument
    restage(executor, staging)      a copy whose holding node left: staged again, once
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import os
import threading
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any

from nimbus.data._direct import Unreachable
from nimbus.data._file import (
    File,
    Out,
    Staged,
    check_export,
    check_out,
    exports_of,
    missing,
    read_export,
    stat_export,
)
from nimbus.data._ref import Ref, new_id
from nimbus.errors import DataError, FileRefused, NotFound

__all__ = ["carry_out", "close_sources", "copy_names", "has_files", "restage", "stage"]

_pool = cf.ThreadPoolExecutor(4, thread_name_prefix="nimbus-file")
_parts = cf.ThreadPoolExecutor(4, thread_name_prefix="nimbus-file-part")  # puts at once
_lock = threading.Lock()
_cache: dict[tuple[str, str, str, int, float], cf.Future[Staged]] = {}


def _endpoint_id(executor: Any, name: str) -> str:
    client = getattr(executor._backend, "client", None)
    if client is None:
        if exports_of(name) is None:  # (no service: only the endpoints configured here)
            raise FileRefused(
                f"endpoint {name!r} is not configured on this machine, and this Executor "
                f"has no service to ask: `nimbus endpoint list` shows the endpoints "
                f"configured here (`nimbus endpoint configure NAME --exports DIR`, logged "
                f"in to a service, adds one); "
                f"a file of this machine is named without an endpoint: nimbus.File('/path')"
            )
        return name
    try:
        info = client.get_endpoint(name)
    except NotFound:
        raise FileRefused(
            f"endpoint {name!r} is not known to the service: `nimbus endpoints list` shows "
            f"those you can use; `nimbus endpoint configure {name}` registers it (on the "
            f"machine it is to run on)"
        ) from None
    if not info.get("online", True) and info["endpoint_id"] != executor_place(executor):
        raise DataError(
            f"endpoint {name!r} is offline: its files cannot be staged; start its agent "
            f"(`nimbus endpoint start {name}`) and submit again"
        )
    return str(info["endpoint_id"])


def executor_place(executor: Any) -> str:
    return str(getattr(executor._backend, "endpoint_id", executor._endpoint))


def _source(executor: Any, endpoint_id: str) -> Any:
    with _lock:  # an Executor of the same user, to the file's endpoint
        sources = executor.__dict__.setdefault("_file_sources", {})
        if endpoint_id not in sources:
            sources[endpoint_id] = type(executor)(endpoint=endpoint_id, settings=executor.settings)
        return sources[endpoint_id]


def close_sources(executor: Any) -> None:
    executor.__dict__.pop("_out_pins", None)  # (their pins freed, or left to their lease)
    executor.__dict__.pop("_out_places", None)
    for source in executor.__dict__.pop("_file_sources", {}).values():
        source.shutdown(wait=False)


TIMEOUT = 600.0  # seconds a part of a file may take to come from its endpoint


def _answer(future: cf.Future[Any], file: File) -> Any:
    try:
        return future.result(timeout=TIMEOUT)
    except cf.TimeoutError:
        future.cancel()
        raise DataError(
            f"{file!r}: its endpoint did not answer within {TIMEOUT:.0f} s; is its agent "
            f"running? Submit again once it is"
        ) from None


def _step(executor: Any) -> int:
    """The size of the parts a file travels in: half what the service takes at once."""
    client = getattr(executor._backend, "client", None)
    limit = int(client.limits().get("max_payload", 0)) if client is not None else 0
    return max(limit // 2, 64 * 1024) if limit else 64 * 1024 * 1024


def _fetch(executor: Any, file: File, source_id: str | None, place: str) -> cf.Future[Staged]:
    """The future of ``file`` staged into ``place``'s store (once per size and mtime)."""
    from nimbus.data._ref import put

    if source_id is None:
        st = os.stat(file.path)
        size, mtime = st.st_size, st.st_mtime
    else:
        asked = _source(executor, source_id).submit(
            stat_export, source_id, file.path, file.endpoint or ""
        )
        size, mtime = _answer(asked, file)
    key = (place, source_id or "", file.path, size, mtime)
    step = _step(executor)
    with _lock:
        found = _cache.get(key)
        if found is not None and not (
            found.done() and (found.exception() or _gone(executor, found))
        ):
            return found

        name = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
        base = PurePosixPath(file.path).name

        def transfer() -> Staged:
            if source_id is not None:  # endpoint to endpoint, unless there is no path
                try:
                    return _direct(executor, file, source_id, mtime, f"{name}-{base}")
                except Unreachable:
                    pass  # carried through this client instead (below)
            if source_id is None:
                body = Path(file.path).read_bytes()
                parts = [body[i : i + step] for i in range(0, len(body), step)] or [b""]
            else:
                source = _source(executor, source_id)
                reads = [
                    source.submit(read_export, source_id, file.path, i, step, mtime)
                    for i in range(0, size, step)
                ] or [source.submit(read_export, source_id, file.path, 0, 0, mtime)]
                parts = [_answer(r, file) for r in reads]
            sha = hashlib.sha256()
            for part in parts:
                sha.update(part)
            refs = tuple(_parts.map(lambda part: put(part, endpoint=place), parts))
            total = sum(map(len, parts))
            return Staged(refs, name, base, total, sha.hexdigest())

        future = _cache[key] = _pool.submit(transfer)
        future.staging = (file, source_id, place, key)  # type: ignore[attr-defined]
        if len(_cache) > 256:
            _cache.pop(next(iter(_cache)))
    return future


def copy_names(staging: Any) -> set[str]:
    """The ids a task names (``ReferenceLost.ref_id``) when the copy that ``staging``
    (a future :func:`stage` gave) made is gone: its pin's, its parts'."""
    if getattr(staging, "staging", None) is None or not staging.done():
        return set()
    if staging.cancelled() or staging.exception() is not None:
        return set()
    staged: Staged = staging.result()
    return {r.id for r in staged.refs} | ({staged.pin.id} if staged.pin is not None else set())


def restage(executor: Any, staging: cf.Future[Staged]) -> cf.Future[Staged]:
    """The file of ``staging`` staged again from its endpoint (its copy is gone: the node
    that held it left before the others fetched it): the future of the new copy, one for
    all the tasks that found the old one gone. Its endpoint offline, or the transfer
    failing: the future's error, which fails the tasks."""
    file, source_id, place, key = staging.staging  # type: ignore[attr-defined]
    with _lock:
        found = _cache.get(key)
        if found is not None and found is not staging:
            return found  # staged again already (another task found the copy gone)
        _cache.pop(key, None)
    try:
        if source_id is not None:  # offline: said now, not a task queued there for long
            _endpoint_id(executor, file.endpoint or source_id)
        return _fetch(executor, file, source_id, place)
    except BaseException as exc:
        failed: cf.Future[Staged] = cf.Future()
        failed.set_exception(exc)
        return failed


def _gone(executor: Any, staged: cf.Future[Staged]) -> bool:
    """A copy sent directly whose node a renewal of its pin found gone (its block
    ended): staged again rather than given to tasks that would fail to fetch it."""
    pin = staged.result().pin
    return pin is not None and pin.id in executor._path.open().gone


def _direct(executor: Any, file: File, source_id: str, mtime: float, name: str) -> Staged:
    """``file`` sent by its endpoint straight into the cache of the task's endpoint's
    node (``_direct``): this client carries only where to and the secret."""
    import time

    from nimbus.data._direct import offer, send_export

    where = executor._path.open()  # the pin: leased there, held (renewed) by this client
    key, base = name.split("-", 1)
    pin = key + new_id()
    expires = time.time() + where.lease
    answer = _answer(executor._path.call(offer, "file", name, expires, pin), file)
    host, port, secret = answer[:3]
    served = answer[3] if len(answer) > 3 else None  # (None from an older endpoint)
    holder = None if not served else (str(served[0]), int(served[1]), str(served[2]))
    held = where.adopt(Ref(pin, where.namespace, where.user, where.endpoint, 0))
    if holder is not None:
        where.served(pin, holder)  # renewed through that node, wherever the renewal runs
    sent = _source(executor, source_id).submit(
        send_export, source_id, file.path, mtime, host, port, secret
    )
    got, sha, _ = _answer(sent, file)
    return Staged((), key, base, got, sha, held, holder)


def _expect_out(executor: Any, file: File, owner: str) -> cf.Future[Out]:
    """The future of ``file`` (an out= file of another endpoint, ``owner``) made ready:
    that endpoint checks its exports and expects the files (``_direct.expect_out``: its
    node server, a pin's secret, the template kept with the pin, held by this client as a
    Ref), once per (Executor, endpoint, template); the tasks are sent once it is done,
    and fail with its error (a path refused there) without running."""
    key = (owner, file.path)
    with _lock:
        outs = executor.__dict__.setdefault("_out_places", {})
        found = outs.get(key)
        if found is not None and not (
            found.done() and (found.exception() or _lost(executor, found))
        ):
            return found  # type: ignore[no-any-return]

        def expect() -> Out:
            import time

            from nimbus.data._direct import expect_out

            source = _source(executor, owner)
            where = source._path.open()
            pin = new_id() + new_id()
            expires = time.time() + where.lease
            asked = source._path.call(
                expect_out, owner, file.endpoint or owner, file.path, pin, expires
            )
            target = _answer(asked, file)
            if target is None:
                raise DataError(
                    f"out={file!r}: endpoint {file.endpoint!r} serves no data to other "
                    f"endpoints (its agent runs no data server); restart it with a current "
                    f"nimbus (`nimbus endpoint start {file.endpoint}`)"
                )
            target = (str(target[0]), int(target[1]), str(target[2]))
            held = where.adopt(Ref(pin, where.namespace, where.user, where.endpoint, 0))
            where.served(pin, target)  # renewed (and freed) on that node, wherever it runs
            executor.__dict__.setdefault("_out_pins", {})[key] = held  # (with the Executor)
            name = file.endpoint or owner
            return Out(owner, file.path, target, pin, where.namespace, name)

        future = outs[key] = _pool.submit(expect)
    return future


def _lost(executor: Any, place: cf.Future[Out]) -> bool:
    """Whether a renewal found the node that expects ``place``'s files gone (its agent
    restarted): expected again rather than given to tasks that would fail to send."""
    out = place.result()
    source = executor.__dict__.get("_file_sources", {}).get(out.endpoint)
    session = None if source is None else source._path.session
    return session is not None and out.pin in session.gone


def carry_out(executor: Any, pending: tuple[Any, ...]) -> None:
    """The out= files of a task that could not send them where they go (no path from
    its node: ``_file.OutPending``) carried through this client, as inputs are when
    there is no direct path: read in parts from the task's endpoint (where its node left
    them), put on theirs, written there by a task (``write_out``: sha256, the exports,
    a rename), then removed where they were. A failure: a DataError naming the file."""
    from nimbus.data._file import drop_out, read_out, write_out
    from nimbus.data._ref import put

    step = _step(executor)
    for out, out_id, name, size, sha, why in pending:
        path = out.template.replace("{task_id}", out_id)
        file = File(f"{out.name}:{path}")
        try:
            call = executor._path.call
            reads = [call(read_out, out_id, name, i, step) for i in range(0, size, step)]
            parts = [_answer(r, file) for r in reads or [call(read_out, out_id, name, 0, 0)]]
            target = _source(executor, out.endpoint)
            target._path.open()  # (its session: where ``put`` puts)
            there = partial(put, endpoint=out.endpoint)
            refs = list(_parts.map(there, parts))
            args = (out.endpoint, out.name, out.template, out_id, sha, *refs)
            _answer(target._path.call(write_out, *args), file)
        except Exception as exc:
            raise DataError(
                f"the task ran, but its out= file {file.endpoint}:{path} could not be sent "
                f"to endpoint {out.name!r}: not directly ({why}), nor through this client "
                f"({exc})"
            ) from None
        finally:
            executor._path.call(drop_out, out_id)  # (not waited for: the sweep's otherwise)


def stage(executor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``args`` and ``kwargs`` with their Files made ready for the task (checked now)."""
    remote = executor._endpoint is not None
    place = executor_place(executor) if remote else ""

    def one(value: Any, out: bool = False) -> Any:
        if type(value) is not File:
            return value
        owner = None if value.endpoint is None else _endpoint_id(executor, value.endpoint)
        local = exports_of(owner) if owner is not None else None
        if local is not None:  # its owner's config is here: refused now if outside
            check_export(value.path, local[1], local[0])
        if out:
            if remote and owner is None:
                raise DataError(
                    f"out={value!r} names a file of this machine, but the task runs on "
                    f"endpoint {executor._endpoint!r}: name the endpoint it goes to, e.g. "
                    f"nimbus.File('{executor._endpoint}:{value.path}')"
                )
            if remote and owner != place:  # staged out from there
                check_out(value, local is not None)
                return _expect_out(executor, value, str(owner))
            if not remote and value.endpoint is not None and local is None:
                raise FileRefused(f"out={value!r}: endpoint {value.endpoint!r} is not here")
            check_out(value, local is not None or not remote)  # (its directory is here)
            return Out(owner, value.path)
        if value.endpoint is None and not os.path.exists(value.path):
            raise missing(value.path, "on this machine")
        if local is not None and not os.path.exists(value.path):
            raise missing(f"{value.endpoint}:{value.path}", f"on endpoint {value.endpoint!r}")
        if not remote:
            return value
        if owner == place:  # on the task's own endpoint: read in place there
            return File(f"{owner}:{value.path}")
        return _fetch(executor, value, owner, place)

    new_args = tuple(one(a) for a in args)
    new_kwargs = {k: one(v, out=(k == "out")) for k, v in kwargs.items()}
    return new_args, new_kwargs


def has_files(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return any(type(v) is File for v in (*args, *kwargs.values()))
