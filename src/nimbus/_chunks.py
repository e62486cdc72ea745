"""Helpers that run inside workers for ``Executor.map`` with a chunksize."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["chunks", "run_chunk"]


def chunks(
    iterables: tuple[Iterable[Any], ...], size: int
) -> Iterator[tuple[tuple[Any, ...], ...]]:
    """Tuples of up to ``size`` argument tuples, from zipped iterables."""
    zipped = zip(*iterables, strict=False)
    while True:
        chunk = tuple(itertools.islice(zipped, size))
        if not chunk:
            return
        yield chunk


def run_chunk(fn: Callable[..., Any], chunk: tuple[tuple[Any, ...], ...]) -> list[Any]:
    """Call ``fn`` on every argument tuple of a chunk."""
    return [fn(*args) for args in chunk]
