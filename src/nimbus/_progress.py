"""A progress bar on stderr for ``Executor.map(..., progress=True)`` and, under
``nimbus run --progress``, for each map of a program's ``multiprocessing.Pool``
(:func:`follow_pool_maps`).

On a terminal tqdm draws it when it is installed (the dev extras have it);
without it a plain line ``map fn: 3/10 (30%) 1.2 s`` is rewritten in place.
When stderr is a file or a pipe, the plain line is printed at each tenth of the
way, with no cursor control (tqdm's ``\r``), so a log stays short and readable;
tqdm's notebook bar (a widget) is drawn in Jupyter. Futures report to :meth:`Bar.done` from whatever thread completes
them; the bar is closed when the last one is done.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import Future
from typing import IO, Any

__all__ = ["Bar", "bar", "check", "count", "follow_pool_maps"]


class Bar:
    """The plain bar: ``total`` items, ``done(n)`` as they finish."""

    def __init__(self, total: int, label: str, stream: IO[str] | None = None) -> None:
        self.total, self.label = total, label
        self.stream = stream if stream is not None else sys.stderr
        self.count = 0
        self.closed = False
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._shown = -1  # the tenth last printed when stderr is not a terminal
        isatty = getattr(self.stream, "isatty", None)
        self._tty = bool(isatty and isatty())
        self._draw()

    def done(self, n: int = 1) -> None:
        with self._lock:
            if self.closed or (n <= 0 and self.count < self.total):
                return  # nothing new to draw
            self.count = min(self.total, self.count + n)
            self._draw()
            if self.count >= self.total:
                self._close()

    def reach(self, n: int) -> None:
        """At least ``n`` items done (a count read from the work itself)."""
        with self._lock:
            behind = n - self.count
        if behind > 0:
            self.done(behind)

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self._close()

    def _line(self) -> str:
        share = self.count / self.total if self.total else 1.0
        width = 20
        filled = int(share * width)
        elapsed = time.monotonic() - self._start
        return (
            f"{self.label}: [{'#' * filled}{'.' * (width - filled)}] "
            f"{self.count}/{self.total} ({share:.0%}) {elapsed:.1f} s"
        )

    def _draw(self) -> None:
        if self._tty:
            self.stream.write("\r" + self._line())
        else:
            tenth = self.count * 10 // self.total if self.total else 10
            if tenth == self._shown:
                return
            self._shown = tenth
            self.stream.write(self._line() + "\n")
        self.stream.flush()

    def _close(self) -> None:
        self.closed = True
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()


class _Tqdm:
    """tqdm's bar behind the same two calls."""

    def __init__(self, tqdm: Any, total: int, label: str) -> None:
        self._bar = tqdm(total=total, desc=label, unit="task", file=sys.stderr, leave=True)
        self._lock = threading.Lock()
        self.closed = False

    def done(self, n: int = 1) -> None:
        with self._lock:
            if self.closed:
                return
            self._bar.update(n)
            if self._bar.n >= self._bar.total:
                self.closed = True
                self._bar.close()

    def reach(self, n: int) -> None:
        with self._lock:
            behind = n - self._bar.n
        if behind > 0:
            self.done(behind)

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                self._bar.close()


def bar(total: int, label: str, plain: bool = False) -> Bar | _Tqdm:
    """A bar of ``total`` items: tqdm's if it is installed (and not ``plain``) and draws on
    a terminal or in a notebook, else :class:`Bar` (plain lines to a file or a pipe)."""
    if not plain:
        try:
            from tqdm.auto import tqdm  # type: ignore[import-untyped,unused-ignore]
        except ImportError:
            pass
        else:
            isatty = getattr(sys.stderr, "isatty", None)
            widget = any(c.__module__ == "tqdm.notebook" for c in tqdm.__mro__)
            if widget or (isatty is not None and isatty()):
                return _Tqdm(tqdm, total, label)
    return Bar(total, label)


def count(shown: Bar | _Tqdm, size: int, future: Future[Any]) -> None:
    """A done-callback: ``size`` items more; a cancelled ``future`` means the map was
    abandoned (a task failed, the program stopped reading): the bar ends where it is."""
    if future.cancelled():
        shown.close()
    else:
        shown.done(size)


def check(progress: object) -> bool:
    """``progress=`` as given to ``map``: True or False, else a TypeError."""
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False, not {progress!r}")
    return progress


def _label(func: Any) -> str:
    return f"map {getattr(func, '__name__', 'fn')}"


def _map_result(result: Any, length: int, shown: Bar | _Tqdm) -> None:
    """Move ``shown`` as the chunks of a pool's ``MapResult`` come back: the count is read
    from the result itself (chunks left), so chunks that came back before this ran count.
    A chunk that raised is not counted; the bar closes when the map has ended."""
    original = result._set
    chunksize = max(1, result._chunksize)
    chunks = -(-length // chunksize)

    failed = [0]  # chunks that raised: not items done

    def _set(i: int, success_result: Any) -> None:
        original(i, success_result)
        failed[0] += 0 if success_result[0] else 1
        shown.reach(min(length, (chunks - result._number_left - failed[0]) * chunksize))
        if result.ready():
            shown.close()

    result._set = _set
    if result.ready():  # every chunk came back (or one failed) before the bar existed
        shown.reach(length if result.successful() else 0)
        shown.close()


def _items(items: Any, shown: Bar | _Tqdm) -> Any:
    """The results of an ``imap``, counted as the program takes them."""
    try:
        for item in items:
            yield item
            shown.done(1)
    finally:
        shown.close()


def follow_pool_maps(pool_class: Any) -> None:
    """Draw a bar for every ``map``, ``starmap`` (and their ``_async``), ``imap`` and
    ``imap_unordered`` of ``pool_class`` (a ``multiprocessing.pool.Pool``) from now on:
    the items whose results came back, as the pool's result thread stores them (a map)
    or as the program takes them (an imap). An imap over an iterable without a length
    has a bar without a total (tqdm) or none (the plain bar)."""
    if getattr(pool_class, "_nimbus_progress", False):
        return
    map_async, imap, imap_unordered = (
        pool_class._map_async,
        pool_class.imap,
        pool_class.imap_unordered,
    )

    def _map_async(self: Any, func: Any, iterable: Any, mapper: Any, *args: Any) -> Any:
        if not hasattr(iterable, "__len__"):
            iterable = list(iterable)  # as the stdlib's _map_async does
        result = map_async(self, func, iterable, mapper, *args)
        _map_result(result, len(iterable), bar(len(iterable), _label(func)))
        return result

    def following(method: Any) -> Any:
        def follow(self: Any, func: Any, iterable: Any, *args: Any, **kwargs: Any) -> Any:
            if not hasattr(iterable, "__len__"):
                return method(self, func, iterable, *args, **kwargs)
            return _items(method(self, func, iterable, *args, **kwargs),
                          bar(len(iterable), _label(func)))  # fmt: skip

        follow.__name__ = method.__name__
        follow.__doc__ = method.__doc__
        return follow

    pool_class._map_async = _map_async
    pool_class.imap = following(imap)
    pool_class.imap_unordered = following(imap_unordered)
    pool_class._nimbus_progress = True
