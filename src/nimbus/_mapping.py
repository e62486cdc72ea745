"""``Executor.map``'s results, in order: one task an item (or a chunk of items), and
what happens to the tasks left when the caller stops reading.

::

    map_results(submit, fn, iterables)
        submit(fn, *args) per item   or   submit(run_chunk(fn), chunk) per chunk (_chunks)
        -> futures (a progress bar counts them as they finish: _progress)
        -> results(): future.result() in order, within the one deadline of ``timeout``
             left early (an error, a timeout, the iterator closed): the tasks not done
                 are cancelled, the running ones killed (Future.cancel)
             left on a Ctrl-C: only the queued ones are (cancel_queued); the running
                 ones finish, as the executor's shutdown waits for them

Used by ``nimbus.executor`` alone (``Executor.map`` and its ``options()`` views);
``tests/test_layers.py`` pins what it imports and who imports it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from functools import partial
from typing import Any

from nimbus import _chunks

__all__ = ["map_results"]


def map_results(
    submit: Callable[..., Future[Any]],
    fn: Callable[..., Any],
    iterables: tuple[Iterable[Any], ...],
    timeout: float | None,
    chunksize: int,
    progress: bool,
    cancel_queued: Callable[[list[Any]], None],
) -> Iterator[Any]:
    """The results of ``fn`` over ``iterables``, in order. Left early (an error, a timeout,
    the iterator closed), the tasks not done are cancelled, the running ones killed; after
    a Ctrl-C only the queued ones are: the running ones finish, as ``shutdown`` waits for
    them (a second Ctrl-C there stops the workers), as in a loop of ``submit``."""
    if isinstance(chunksize, bool) or not isinstance(chunksize, int) or chunksize < 1:
        raise ValueError(f"chunksize must be an int >= 1, not {chunksize!r}")
    from nimbus import _progress

    _progress.check(progress)
    end = None if timeout is None else timeout + time.monotonic()
    if chunksize == 1:
        futures = [submit(fn, *args) for args in zip(*iterables, strict=False)]
        sizes = [1] * len(futures)
    else:
        run = partial(_chunks.run_chunk, fn)
        chunks = list(_chunks.chunks(iterables, chunksize))
        futures = [submit(run, chunk) for chunk in chunks]
        sizes = [len(chunk) for chunk in chunks]
    if progress:
        shown: Any = _progress.bar(sum(sizes), f"map {getattr(fn, '__name__', 'fn')}")
        for future, size in zip(futures, sizes):
            future.add_done_callback(partial(_progress.count, shown, size))
    else:
        shown = None

    def results() -> Iterator[Any]:
        interrupted = False
        try:
            futures.reverse()
            while futures:
                future = futures[-1]
                value = future.result() if end is None else future.result(end - time.monotonic())
                futures.pop()
                if chunksize == 1:
                    yield value
                else:
                    yield from value
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            if interrupted:
                cancel_queued(futures)
            else:
                for future in futures:
                    future.cancel()
            if shown is not None:
                shown.close()

    return results()
