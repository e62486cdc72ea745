"""Backends: where an Executor's tasks run.

Owns the one seam between the SDK and what runs tasks; it stands on the runtime
and the service's wire contract and never imports the Executor.

A backend takes batches of runtime tasks and calls back with the finished
ones. They are found in :data:`BACKENDS`, an explicit registry, by name:
``local`` (the embedded runtime), ``forked`` (the same, its workers forks of
this process: a multiprocessing program's root) and ``service`` (a remote endpoint through the
nimbus service). Factories take ``workers``, ``prefetch``, ``on_results``,
``on_dispatch``, ``on_notice``, ``settings`` and ``endpoint``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from nimbus.runtime.task import Task

__all__ = ["BACKENDS", "Backend", "ResultCallback"]

ResultCallback = Callable[[list[Task]], None]
DispatchCallback = Callable[[list[Task]], list[Task]]


class Backend(Protocol):
    """Runs tasks; ``on_results`` (given at construction) gets them back."""

    capacity: int

    def submit(self, batch: list[Task]) -> None: ...

    def cancel(self, task: Task) -> None: ...

    def shutdown(self, wait: bool = True, *, kill: bool = False) -> None: ...


def _local(*, settings: object = None, endpoint: str | None = None, **kwargs: object) -> Backend:
    from nimbus.backends.local import LocalBackend

    del endpoint  # the local runtime needs none
    if getattr(settings, "provider", "local") != "local":  # its managers on a provider's nodes
        from nimbus.backends.provided import ProvidedBackend

        return ProvidedBackend(settings=settings, **kwargs)  # type: ignore[arg-type]
    return LocalBackend(settings=settings, **kwargs)  # type: ignore[arg-type]


def _forked(*, settings: object = None, endpoint: str | None = None, **kwargs: object) -> Backend:
    from nimbus.backends.local import LocalBackend

    del endpoint
    return LocalBackend(fork=True, settings=settings, **kwargs)  # type: ignore[arg-type]


def _service(**kwargs: object) -> Backend:
    from nimbus.backends.service import ServiceBackend

    return ServiceBackend(**kwargs)  # type: ignore[arg-type]


BACKENDS: dict[str, Callable[..., Backend]] = {
    "local": _local,
    "forked": _forked,
    "service": _service,
}
