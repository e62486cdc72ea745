"""The data path inside a worker: references resolved where the task runs, results kept.

::

    Executor: fn(*args) with Refs / kept futures  -->  run(fn, scope, *args)  (one task)
    worker:   run: each Ref in args (and in lists, tuples, dicts among them) read from
              this node's store of scope.namespace  ->  fn(*args)
              keep: the result written to the store, a Ref to it returned instead
              (on an endpoint, naming this node's server and a pin: ``Ref.holder``;
              a task on another node fetches it from there, ``_fetched``)

Within ``fn``, :func:`store` is the user's key-value store on this node.

On an endpoint, the agent runs each task as its owner, the user the service says
submitted it (``nimbus.owners``): ``store()`` is that user's, and ``run`` reads and
keeps in that user's namespace whatever the client's scope says.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import os
import time
from pathlib import Path
from typing import Any

from nimbus import owners
from nimbus.data._file import (
    File,
    Out,
    OutPending,
    Staged,
    discard_out,
    finish_out,
    local_path,
    out_id,
)
from nimbus.data._kv import EndpointKeyValue, KeyValue, NodeKeyValue
from nimbus.data._node import NodeStore, default_root
from nimbus.data._ref import MAX_SCAN, Ref, Scope, local_namespace, lost, new_id, owner_namespace
from nimbus.errors import DataAccessError, DataError

__all__ = ["endpoint_store", "free_objects", "identity", "renew_objects", "run", "store"]

_CONTAINERS = (list, tuple, dict)
FORWARDS = 8  # pins forwarded to their holding nodes at once (a node serves 8 per peer)
_current: Scope | None = None  # the scope of the task this worker runs now


def _node(namespace: str) -> NodeStore:
    """The store of ``namespace`` in this runtime's data directory (``default_root``)."""
    return _store(namespace, default_root())


@functools.lru_cache(maxsize=64)
def _store(namespace: str, root: Path) -> NodeStore:
    return NodeStore(namespace, root)


_FILES = (File, Staged, Out)


def _resolve(value: Any, scope: Scope, seen: dict[str, Any], depth: int = 0) -> Any:
    kind = type(value)
    if kind in _FILES:  # a pathlib.Path on this node
        got = local_path(value, _node(scope.namespace).dir / "files", scope.endpoint)
        seen[f"file:{id(value)}"] = (value, got)
        return got
    if kind is Ref:
        got = seen.get(value.id, seen)
        if got is seen:
            if value.namespace != scope.namespace:
                raise DataAccessError(
                    f"{value!r} belongs to user {value.user!r}, not to {scope.user!r}, who "
                    f"runs this task: a reference can be used only by the user who made it"
                )
            node = _node(scope.namespace)
            try:
                got = node.read(value.id)
            except FileNotFoundError:
                if value.holder is None:
                    raise lost(value) from None
                got = _fetched(node, value, scope)
            seen[value.id] = got
        return got
    if depth or kind not in _CONTAINERS or len(value) > MAX_SCAN:
        return value
    if not any(type(v) is Ref for v in (value.values() if kind is dict else value)):
        return value  # nothing to read: the same object, not a copy
    if kind is list:
        return [_resolve(v, scope, seen, depth + 1) for v in value]
    if kind is tuple:
        return tuple(_resolve(v, scope, seen, depth + 1) for v in value)
    if kind is dict:
        return {k: _resolve(v, scope, seen, depth + 1) for k, v in value.items()}
    return value


def _fetched(node: NodeStore, ref: Ref, scope: Scope) -> Any:
    """``ref``'s object, kept on another node of this endpoint (``ref.holder``), fetched
    from that node's server into this node's store (once per node), then read here."""
    from nimbus.data._fetch import fetch_object

    assert ref.holder is not None
    host, port, secret, pin = ref.holder
    if pin[:32] != ref.id:
        raise DataError(f"{ref!r}: its holder's pin {pin!r} names another object")
    fetch_object(
        (host, port, secret), node.namespace, pin, node.path(ref.id), time.time() + scope.lease
    )
    try:
        return node.read(ref.id)
    except FileNotFoundError:  # (freed here meanwhile)
        raise lost(ref) from None


def run(fn: Any, scope: Scope, /, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` with its references resolved here; keep its result."""
    global _current
    owner = owners.current()
    if owner is not None and scope.namespace != owner_namespace(owner):
        scope = scope._replace(
            namespace=owner_namespace(owner)
        )  # the service's word, not the client's
    before, _current = _current, scope
    seen: dict[str, Any] = {}
    pending: list[tuple[Any, ...]] = []  # out= files left for the client to carry
    try:
        try:
            args = tuple(_resolve(a, scope, seen) for a in args)
            if kwargs:
                kwargs = {k: _resolve(v, scope, seen) for k, v in kwargs.items()}
            result = fn(*args, **kwargs)
            del args, kwargs
            for key in [k for k in seen if k.startswith("file:")]:
                marker, written = seen[key]
                if type(marker) is Out:  # out=File(...): the task's file moved where it goes
                    left = finish_out(marker, written, out_id(written))
                    if left is not None:
                        pending.append(left)
        finally:  # out= files' private directories: nothing left, whatever happened
            carried = {p[1] for p in pending}
            for key in [k for k in seen if k.startswith("file:")]:
                marker, written = seen.pop(key)
                if type(marker) is Out:
                    discard_out(written, keep=out_id(written) in carried)
        value = _kept(result, scope, seen) if scope.keep else result
        if pending:  # (the client carries them, then gives ``value`` to the task's future)
            raise OutPending(
                f"the task ran, but its out= files could not be sent where they go "
                f"({pending[0][5]}); they wait on its node for its client",
                value,
                tuple(pending),
            )
        return value
    finally:
        _current = before


def _kept(result: Any, scope: Scope, seen: dict[str, Any]) -> Ref:
    """``result`` written to this node's store: the Ref to it."""
    ref_id = scope.ref_id or new_id()
    node = _node(scope.namespace)
    expires = time.time() + scope.lease
    same = _argument(result, seen) if type(result) in _IMMUTABLE else None
    size = -1
    if same is not None:  # an argument's object, unchanged: the same bytes, no copy
        try:
            os.link(node.path(same), node.path(ref_id))
            os.utime(node.path(ref_id), (expires, expires))
            size = same_size(node, ref_id)
        except OSError:
            pass
    if size < 0:
        size = node.write(ref_id, result, expires)
    # on a node of a provider's block (one of several of the endpoint): where from
    held_here = scope.endpoint is not None and os.environ.get("NIMBUS_BLOCK_ID")
    holder = _holder(ref_id, expires) if held_here else None
    return Ref(ref_id, scope.namespace, scope.user, scope.endpoint, size, holder)


def _holder(ref_id: str, expires: float) -> tuple[str, int, str, str] | None:
    """Where the endpoint's other nodes fetch the kept object ``ref_id`` from: this
    node's server and a pin's secret, as for a relayed object (``_direct.expect_object``;
    the client holds the pin with the Ref, so its renewals and its freeing are forwarded
    here from any node); None where this node serves nothing. Only on a block's node
    (``NIMBUS_BLOCK_ID``): an endpoint of one node has no other node to serve (a pin per
    kept object, renewed and freed by tasks of its own, made a chain of 1,000 kept
    results 1.65x slower there: 3.9 s against 2.4)."""
    from nimbus.data._direct import expect_object

    pin = ref_id + new_id()
    served = expect_object(ref_id, pin, expires)
    return None if served is None else (str(served[0]), int(served[1]), str(served[2]), pin)


_IMMUTABLE = (bytes, str)


def _argument(result: Any, seen: dict[str, Any]) -> str | None:
    """The id of the reference ``result`` was read from, if it is one of them."""
    for ref_id, value in seen.items():
        if value is result:
            return ref_id
    return None


def same_size(node: NodeStore, ref_id: str) -> int:
    return node.path(ref_id).stat().st_size


def identity(value: Any) -> Any:
    """A task that returns its argument (to put, or to fetch a reference's object)."""
    return value


def free_objects(ref_ids: list[str], holders: dict[str, tuple[str, int, str]] | None = None) -> int:
    """A task: free these objects of the current user here; how many. A pin of a staged
    copy not on this node is freed on the node that holds it (``holders``:
    ``_fetch.free``), as its renewals are."""
    node = _node(_scope().namespace)
    # those held here are freed here alone (told before freeing: then none exists here)
    elsewhere = [i for i in ref_ids if holders and i in holders and not node.exists(i)]
    freed = node.free(ref_ids)
    if elsewhere:
        assert holders is not None
        from nimbus.data._fetch import free
        from nimbus.data._serve import HANDSHAKE

        # (a node gone, or that freed it already: nothing to free there)
        done = _forwarded(elsewhere, holders, lambda h, i: free(h, node.namespace, i), HANDSHAKE)
        freed += len(done)
    return freed


def renew_objects(
    ref_ids: list[str], expires: float, holders: dict[str, tuple[str, int, str]] | None = None
) -> list[str]:
    """A task: renew these objects' leases; the ids of those lost. A pin of a staged copy
    not on this node is renewed on the node that holds it (``holders``: ``_fetch.renew``)."""
    node = _node(_scope().namespace)
    lost = node.renew(ref_ids, expires)
    if holders:
        from nimbus.data._fetch import renew

        elsewhere = [i for i in lost if i in holders]
        within = max(1.0, (expires - time.time()) / 3)  # (the client renews a third in)
        done = _forwarded(
            elsewhere, holders, lambda h, i: renew(h, node.namespace, i, expires), within
        )
        lost = [i for i in lost if i not in done]  # (the others: their node is gone)
    return lost


def _forwarded(
    ref_ids: list[str],
    holders: dict[str, tuple[str, int, str]],
    send: Any,
    within: float,
) -> set[str]:
    """The pins among ``ref_ids`` that ``send(holder, pin)`` handled on their holding
    nodes: asked in parallel (``FORWARDS`` at once), waited for ``within`` s in all (a
    holder that does not answer costs that, not a timeout per pin)."""
    done: list[str] = []  # (appended by the threads; a slice copies it at once)
    if not ref_ids:
        return set()

    def one(ref_id: str) -> None:
        try:
            send(holders[ref_id], ref_id)
        except DataError:
            return  # that node is gone (its copy with it), or holds the pin no more
        done.append(ref_id)

    pool = cf.ThreadPoolExecutor(min(FORWARDS, len(ref_ids)), "nimbus-data-forward")
    try:
        cf.wait([pool.submit(one, i) for i in ref_ids], timeout=within)
    finally:  # (one still asking ends at its own request's timeout)
        pool.shutdown(wait=False, cancel_futures=True)
    return set(done[:])


def _scope() -> Scope:
    if _current is not None:
        return _current
    owner = owners.current()
    if owner is not None:  # a plain task on an endpoint: its owner's
        return Scope(owner_namespace(owner), owner, None, False, 0.0)
    return Scope(local_namespace(), "", None, False, 0.0)


def store() -> KeyValue:
    """The key-value store of the user whose task this is, on its endpoint (``_kv``).

    funcX's ``get_redis_client()``, with isolation: another user's tasks on the
    same endpoint see other keys. Run locally, and outside a task: this user's store
    in this runtime.
    """
    scope = _scope()
    from nimbus import statestore  # (a task that never calls store() does not import it)

    program = None if statestore.is_root() else statestore.current()
    if program is not None and program.endpoint:  # the store the service handed out
        return endpoint_store(program, scope.user)
    return NodeKeyValue(_node(scope.namespace).dir / "kv", scope.user)


def endpoint_store(program: Any, user: str = "") -> EndpointKeyValue:
    """The keys of ``program``'s user on its endpoint (a ``statestore.Program`` the
    service handed out for it: its id is ``<user's prefix>.<random>``): what its tasks'
    :func:`store` is, and what the client reads with ``Executor.store()``."""
    from nimbus import statestore

    prefix = program.program_id.rpartition(".")[0]
    keys = statestore.Keys(f"{prefix}.kv-{program.endpoint}")
    return EndpointKeyValue(program.client(), keys, program.endpoint, user)
