"""``Executor.options(...)``: a view of an executor whose tasks have a timeout, an
environment or limits of their own, or keep their results where they were made.

::

    ex.options(timeout=5, keep=True) -> Options(ex._submit, ex._cancel_queued, ...)
        submit(fn, *args) -> ex._submit(fn, args, kwargs, timeout, keep, environment, ...)
        map(fn, *iterables) -> _mapping.Mapper.map: map_results(self.submit, ...), or
                               with ``keep`` the list of KeptFuture, one an item

A view owns nothing: its ``shutdown`` does nothing, the executor's stops the work.
Used by ``nimbus.executor`` alone (``tests/test_layers.py`` pins it).
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from nimbus import _mapping

if TYPE_CHECKING:
    from nimbus.environments import Environment

__all__ = ["Options"]

T = TypeVar("T")


class Options(_mapping.Mapper):
    """An executor view whose tasks have a timeout, an environment or limits of their own,
    or (``keep``) keep their results where they were made."""

    def __init__(
        self,
        submit: Callable[..., cf.Future[Any]],
        cancel_queued: Callable[[list[Any]], None],
        timeout: float | None,
        environment: Environment | None,
        env: str,
        *,
        keep: bool = False,
        limits: Any = None,
        staged_items: Callable[[list[tuple[Any, ...]]], list[tuple[Any, ...]] | None],
    ) -> None:
        self._submit = submit  # the executor's own (Executor._submit)
        self._staged_items = staged_items  # (the executor's: map's Files, checked first)
        self._cancel_queued = cancel_queued
        self._timeout = timeout
        self._environment = environment
        self._env = env
        self._keeps = keep
        self._limits = limits  # a task's own limits, with its arguments (nimbus.network)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> cf.Future[T]:
        return self._submit(
            fn, args, kwargs, self._timeout, self._keeps, self._environment, self._env,
            self._limits,
        )  # fmt: skip

    def _map_kept(self, fn: Callable[..., Any], items: list[tuple[Any, ...]]) -> list[Any]:
        """One kept task an item: the list of their KeptFuture, to pass to other tasks."""
        return [
            self._submit(
                fn, args, {}, self._timeout, True, self._environment, self._env, self._limits
            )
            for args in items
        ]

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """A view owns nothing; shut down the executor itself."""
