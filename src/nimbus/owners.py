"""Whom a task runs as on an endpoint: its owner, the user the service says submitted it.

::

    service --TaskRow.owner--> agent: the function wrapped once per (function, owner)
                                      (owned(owner, fn_bytes) -> a function of its own key)
    worker: Owned(*args) --> current() is the owner's id while the function runs
            --> nimbus.data.store() and the data path use that user's namespace

The service sets the owner, never the client, so a user's tasks see the same store
whichever of their tokens submitted them, and another user's tasks another. This
module is kept light (the standard library and ``serialization``): every task of an
endpoint goes through :class:`Owned`, and a worker that never touches ``nimbus.data``
does not import it.
"""

from __future__ import annotations

import pickle
from typing import Any

from nimbus import serialization

__all__ = ["Owned", "current", "owned"]

_current: str | None = None  # the owner of the task this worker runs now


def current() -> str | None:
    """The id of the user whose task runs in this process now (None: no owner given)."""
    return _current


class Owned:
    """A function run as the user ``owner``: the worker unpickles ``fn_bytes`` on the
    first call and caches this object as it caches any function."""

    __slots__ = ("fn", "fn_bytes", "owner")

    def __init__(self, owner: str, fn_bytes: bytes) -> None:
        self.owner = owner
        self.fn_bytes = fn_bytes
        self.fn: Any = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (Owned, (self.owner, self.fn_bytes))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        global _current
        fn = self.fn
        if fn is None:
            fn = self.fn = serialization.loads(self.fn_bytes)
        before, _current = _current, self.owner
        try:
            return fn(*args, **kwargs)
        finally:
            _current = before


def owned(owner: str, fn_bytes: bytes) -> bytes:
    """The pickled function ``fn_bytes`` run as ``owner`` (:class:`Owned`)."""
    return pickle.dumps(Owned(owner, fn_bytes), protocol=5)
