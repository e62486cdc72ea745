"""Managers: the stdlib's server and proxies, the server running as a nimbus process.

``SyncManager`` and ``BaseManager`` are the stdlib's classes with a nimbus
context by default, so ``Manager()``, ``register`` (with ``exposed``,
``proxytype``, ``method_to_typeid``), ``start``, ``connect``, ``shutdown``
and proxies pickled into children work as in the stdlib. The manager's
server listens on a Unix socket (same host) or the TCP address given.
``SharedMemoryManager`` is the stdlib's: shared memory is local to one host.
"""

from __future__ import annotations

from multiprocessing import managers as stdlib_managers
from multiprocessing.managers import (
    AcquirerProxy,
    ArrayProxy,
    BarrierProxy,
    BaseListProxy,
    BaseProxy,
    ConditionProxy,
    DictProxy,
    EventProxy,
    IteratorProxy,
    ListProxy,
    Namespace,
    NamespaceProxy,
    PoolProxy,
    RemoteError,
    Server,
    SharedMemoryManager,
    Token,
    ValueProxy,
)
from typing import Any

__all__ = [
    "AcquirerProxy",
    "ArrayProxy",
    "BarrierProxy",
    "BaseListProxy",
    "BaseManager",
    "BaseProxy",
    "ConditionProxy",
    "DictProxy",
    "EventProxy",
    "IteratorProxy",
    "ListProxy",
    "Namespace",
    "NamespaceProxy",
    "PoolProxy",
    "RemoteError",
    "Server",
    "SharedMemoryManager",
    "SyncManager",
    "Token",
    "ValueProxy",
]


def _default_ctx(ctx: Any) -> Any:
    if ctx is None:
        from nimbus.multiprocessing.context import _default_context

        return _default_context.get_context()
    return ctx


class BaseManager(stdlib_managers.BaseManager):
    """``multiprocessing.managers.BaseManager`` whose server is a nimbus process."""

    def __init__(
        self,
        address: Any = None,
        authkey: bytes | None = None,
        serializer: str = "pickle",
        ctx: Any = None,
        *,
        shutdown_timeout: float = 1.0,
    ) -> None:
        super().__init__(
            address, authkey, serializer, _default_ctx(ctx), shutdown_timeout=shutdown_timeout
        )


class SyncManager(stdlib_managers.SyncManager, BaseManager):
    """``multiprocessing.managers.SyncManager`` whose server is a nimbus process."""


def _pool(*args: Any, **kwargs: Any) -> Any:
    from nimbus.multiprocessing.pool import Pool

    return Pool(*args, **kwargs)


# `manager.Pool()`: nimbus's (the stdlib's Pool class, shadowed by ours where nimbus is
# installed as multiprocessing, would not pickle by reference into the server)
SyncManager.register("Pool", _pool, stdlib_managers.PoolProxy)
