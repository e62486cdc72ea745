"""A progress bar on stderr for ``Executor.map(..., progress=True)``.

tqdm draws it when it is installed (the dev extras have it); without it a plain
line ``map fn: 3/10 (30%) 1.2 s`` is rewritten in place on a terminal, or
printed at each tenth of the way when stderr is a file or a pipe, so a log
stays short. Futures report to :meth:`Bar.done` from whatever thread completes
them; the bar is closed when the last one is done.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import Future
from typing import IO, Any

__all__ = ["Bar", "bar", "count"]


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
            if self.closed:
                return
            self.count = min(self.total, self.count + n)
            self._draw()
            if self.count >= self.total:
                self._close()

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

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                self._bar.close()


def bar(total: int, label: str, plain: bool = False) -> Bar | _Tqdm:
    """A bar of ``total`` items: tqdm's if it is installed (and not ``plain``), else :class:`Bar`."""
    if not plain:
        try:
            from tqdm.auto import tqdm  # type: ignore[import-untyped,unused-ignore]
        except ImportError:
            pass
        else:
            return _Tqdm(tqdm, total, label)
    return Bar(total, label)


def count(shown: Bar | _Tqdm, size: int, future: Future[Any]) -> None:
    """A done-callback: ``size`` items more, unless ``future`` was cancelled."""
    shown.done(0 if future.cancelled() else size)
