"""Helpers that run inside workers for ``Executor.map`` with a chunksize."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["chunks", "run_chunk"]


def chunks(items: list[tuple[Any, ...]], size: int) -> Iterator[tuple[tuple[Any, ...], ...]]:
    """Tuples of up to ``size`` of the argument tuples ``items``, in order."""
    for at in range(0, len(items), size):
        yield tuple(items[at : at + size])


def run_chunk(fn: Callable[..., Any], chunk: tuple[tuple[Any, ...], ...]) -> list[Any]:
    """Call ``fn`` on every argument tuple of a chunk."""
    return [fn(*args) for args in chunk]
