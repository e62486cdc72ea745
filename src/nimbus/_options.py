"""``Executor.options(...)``: a view of an executor whose tasks have a timeout, an
environment or limits of their own, or keep their results where they were made.

::

    ex.options(timeout=5, keep=True) -> Options(ex._submit, ex._cancel_queued, ...)
        submit(fn, *args) -> ex._submit(fn, args, kwargs, timeout, keep, environment, ...)
        map(fn, *iterables) -> _mapping.map_results(self.submit, ...), or with ``keep``
                               the list of KeptFuture, one an item, to pass to other tasks

A view owns nothing: its ``shutdown`` does nothing, the executor's stops the work.
Used by ``nimbus.executor`` alone (``tests/test_layers.py`` pins it).
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from nimbus import _mapping

if TYPE_CHECKING:
    from nimbus.environments import Environment

__all__ = ["Options"]

T = TypeVar("T")


class Options(cf.Executor):
    """An executor view that gives its tasks a timeout or an environment of their own."""

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
    ) -> None:
        self._submit = submit  # the executor's own (Executor._submit)
        self._cancel_queued = cancel_queued
        self._timeout = timeout
        self._environment = environment
        self._env = env
        self._keep = keep
        self._limits = limits  # a task's own limits, with its arguments (nimbus.network)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> cf.Future[T]:
        return self._submit(
            fn, args, kwargs, self._timeout, self._keep, self._environment, self._env,
            self._limits,
        )  # fmt: skip

    def map(
        self,
        fn: Callable[..., T],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
        keep: bool = False,
        progress: bool = False,
    ) -> Iterator[T]:
        if keep or self._keep:
            kept = [
                self._submit(
                    fn, args, {}, self._timeout, True, self._environment, self._env, self._limits
                )
                for args in zip(*iterables, strict=False)
            ]
            return kept  # type: ignore[return-value]  # a list of KeptFuture, to pass on
        return _mapping.map_results(
            self.submit, fn, iterables, timeout, chunksize, progress, self._cancel_queued
        )

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """A view owns nothing; shut down the executor itself."""
