"""Collectives over a group of instances: binomial trees, a ring for large arrays.

A *group* is a sequence of instance ids, the same on every member; a
member's rank is its position in it. Every member calls the same collective
in the same order. Each call gets its own message tag (group + call number),
so collectives never take each other's messages or the user's.

===========  ==============================================  =============
call         algorithm                                       rounds
===========  ==============================================  =============
barrier      dissemination                                   log2 p
bcast        binomial tree from the root                     log2 p
scatter      binomial tree, each child gets its subtree      log2 p
gather       binomial tree to the root                       log2 p
reduce       binomial tree to the root (rank order kept)     log2 p
allreduce    ring reduce-scatter + allgather (numpy arrays), 2 (p - 1) or
             else reduce then bcast                          2 log2 p
===========  ==============================================  =============
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

from nimbus.messaging._instance import Instance

__all__ = ["allreduce", "barrier", "bcast", "gather", "reduce", "scatter"]

RING_MIN_BYTES = 64 * 1024  # arrays at least this large use the ring allreduce
Op = Callable[[Any, Any], Any]


class _Call:
    """One collective call on one member: its rank, size and message tag."""

    _counts: dict[tuple[int, str], int] = {}

    def __init__(self, instance: Instance, group: Sequence[str], name: str) -> None:
        self.ep = instance
        self.group = list(group)
        self.size = len(self.group)
        if self.size == 0:
            raise ValueError("a group needs at least one instance")
        if len(set(self.group)) != self.size:
            raise ValueError("a group lists each instance once")
        try:
            self.rank = self.group.index(instance.id)
        except ValueError:
            raise ValueError(f"instance {instance.id} is not in the group") from None
        digest = hashlib.blake2s("\0".join(self.group).encode(), digest_size=6).hexdigest()
        key = (id(instance), digest)
        number = self._counts.get(key, 0)
        self._counts[key] = number + 1
        self.tag = f"c:{digest}:{number}:{name}"

    def send(self, rank: int, obj: object) -> None:
        self.ep.send(self.group[rank], obj, self.tag)

    def recv(self, rank: int) -> Any:
        return self.ep.recv(self.group[rank], None, self.tag)


def barrier(instance: Instance, group: Sequence[str]) -> None:
    """Return when every member of ``group`` has called it."""
    call = _Call(instance, group, "barrier")
    p, r = call.size, call.rank
    step = 1
    while step < p:
        call.send((r + step) % p, None)
        call.recv((r - step) % p)
        step <<= 1


def bcast(instance: Instance, group: Sequence[str], obj: object = None, root: int = 0) -> Any:
    """``obj`` of the root, on every member."""
    call = _Call(instance, group, "bcast")
    p = call.size
    vr = (call.rank - root) % p
    mask = 1
    while mask < p:
        if vr & mask:
            obj = call.recv((vr - mask + root) % p)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vr + mask < p:
            call.send((vr + mask + root) % p, obj)
        mask >>= 1
    return obj


def scatter(
    instance: Instance, group: Sequence[str], objs: Sequence[Any] | None = None, root: int = 0
) -> Any:
    """Member ``i`` gets ``objs[i]`` of the root."""
    call = _Call(instance, group, "scatter")
    p = call.size
    vr = (call.rank - root) % p
    mine: dict[int, Any]  # virtual rank -> object, for this member's subtree
    mask = 1
    if vr == 0:
        if objs is None or len(objs) != p:
            raise ValueError(f"the root must scatter a sequence of {p} objects")
        mine = {(i - root) % p: obj for i, obj in enumerate(objs)}
        while mask < p:
            mask <<= 1
    else:
        while not vr & mask:
            mask <<= 1
        mine = call.recv((vr - mask + root) % p)
    mask >>= 1
    while mask > 0:
        child = vr + mask
        if child < p:
            part = {v: mine.pop(v) for v in range(child, min(child + mask, p))}
            call.send((child + root) % p, part)
        mask >>= 1
    return mine[vr]


def _up_tree(call: _Call, acc: Any, combine: Op, root: int) -> Any:
    """Combine up a binomial tree; the root gets the result, the others None."""
    p = call.size
    vr = (call.rank - root) % p
    mask = 1
    while mask < p:
        if vr & mask:
            call.send((vr - mask + root) % p, acc)
            return None
        if vr + mask < p:
            acc = combine(acc, call.recv((vr + mask + root) % p))
        mask <<= 1
    return acc


def gather(
    instance: Instance, group: Sequence[str], obj: object, root: int = 0
) -> list[Any] | None:
    """On the root, the list of every member's ``obj`` by rank; None elsewhere."""
    call = _Call(instance, group, "gather")
    p = call.size
    got = _up_tree(call, {call.rank: obj}, lambda a, b: {**a, **b}, root)
    return None if got is None else [got[i] for i in range(p)]


def reduce(
    instance: Instance, group: Sequence[str], obj: object, op: Op = operator.add, root: int = 0
) -> Any:
    """On the root, ``op`` folded over every member's ``obj`` in rank order; None elsewhere."""
    call = _Call(instance, group, "reduce")
    # the tree is rooted at rank 0, which keeps the rank order of the fold for an
    # operation that does not commute; rank 0 hands the result to another root
    got = _up_tree(call, obj, op, 0)
    if root == 0:
        return got
    if call.rank == 0:
        call.send(root, got)
    elif call.rank == root:
        return call.recv(0)
    return None


def allreduce(instance: Instance, group: Sequence[str], obj: Any, op: Op = operator.add) -> Any:
    """``op`` folded over every member's ``obj``, on every member.

    A numpy array of 64 KiB or more goes round a ring (reduce-scatter then
    allgather: each member sends about twice the array, whatever the group
    size), with ``op`` applied elementwise on slices; anything else is reduced
    up a tree and broadcast back down.
    """
    if _ring_ok(obj) and len(group) > 1 and obj.size >= len(group):
        return _ring_allreduce(instance, group, obj, op)
    total = reduce(instance, group, obj, op, 0)
    return bcast(instance, group, total, 0)


def _ring_ok(obj: Any) -> bool:
    nbytes = getattr(obj, "nbytes", 0)
    return (
        type(obj).__module__ == "numpy"
        and type(obj).__name__ == "ndarray"
        and nbytes >= RING_MIN_BYTES
    )


def _ring_allreduce(instance: Instance, group: Sequence[str], arr: Any, op: Op) -> Any:
    import numpy as np

    call = _Call(instance, group, "allreduce")
    p, r = call.size, call.rank
    out = np.array(arr, copy=True, order="C")
    flat = out.reshape(-1)
    bounds = np.linspace(0, flat.size, p + 1).astype(int)
    chunk = [flat[bounds[i] : bounds[i + 1]] for i in range(p)]
    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):  # reduce-scatter: member r ends owning chunk r + 1
        call.send(right, chunk[(r - step) % p])
        i = (r - step - 1) % p
        chunk[i][...] = op(chunk[i], call.recv(left))
    for step in range(p - 1):  # allgather
        call.send(right, chunk[(r + 1 - step) % p])
        i = (r - step) % p
        chunk[i][...] = call.recv(left)
    return out
