"""Direct messaging between instances: addressable tasks and collectives.

Owns instances (a running task with an instance id and a listening address,
``Instance``), their peers and mailboxes, the directory of addresses and the
collectives; it stands on the state store and wire frames.

::

    import nimbus.messaging as msg

    me = msg.instance_id()            # this task, now addressable
    msg.send(peer, {"step": 1})       # straight over a socket (the store until peer listens)
    obj = msg.recv(timeout=5)         # from anyone; recv(source=peer) from one
    total = msg.allreduce(group, array)   # group: the same list of instance ids everywhere

Errors are in :mod:`nimbus.errors` (``PeerLost``, ``PeerExited``, ``PeerUnknown``,
``PeerUnreachable``, ``PeerRefused``, ``MessageDecodeError``,
``MessagingTimeout``, all ``MessagingError``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from nimbus.messaging import _collectives
from nimbus.messaging._api import (
    ANY,
    close,
    current,
    direct_enabled,
    instance_for,
    instance_id,
    recv,
    recv_with_source,
    send,
)
from nimbus.messaging._directory import Directory, Entry
from nimbus.messaging._instance import Instance, Transport
from nimbus.messaging._receiving import NOTHING

__all__ = [
    "ANY",
    "NOTHING",
    "Directory",
    "Entry",
    "Instance",
    "Transport",
    "allreduce",
    "barrier",
    "bcast",
    "close",
    "current",
    "direct_enabled",
    "gather",
    "instance_for",
    "instance_id",
    "recv",
    "recv_with_source",
    "reduce",
    "scatter",
    "send",
]

Op = _collectives.Op


def barrier(group: Sequence[str]) -> None:
    """Wait until every instance of ``group`` has called ``barrier(group)``."""
    _collectives.barrier(current(), group)


def bcast(group: Sequence[str], obj: object = None, root: int = 0) -> Any:
    """The ``obj`` of ``group[root]``, returned on every member."""
    return _collectives.bcast(current(), group, obj, root)


def scatter(group: Sequence[str], objs: Sequence[Any] | None = None, root: int = 0) -> Any:
    """Member ``i`` gets ``objs[i]`` from ``group[root]``."""
    return _collectives.scatter(current(), group, objs, root)


def gather(group: Sequence[str], obj: object, root: int = 0) -> list[Any] | None:
    """Every member's ``obj`` by rank, on ``group[root]`` (None elsewhere)."""
    return _collectives.gather(current(), group, obj, root)


def reduce(group: Sequence[str], obj: object, op: Op = operator.add, root: int = 0) -> Any:
    """``op`` folded over the members' ``obj`` in rank order, on ``group[root]``."""
    return _collectives.reduce(current(), group, obj, op, root)


def allreduce(group: Sequence[str], obj: Any, op: Op = operator.add) -> Any:
    """``op`` folded over the members' ``obj``, on every member."""
    return _collectives.allreduce(current(), group, obj, op)
