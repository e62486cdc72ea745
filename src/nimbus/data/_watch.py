"""The data path's calls to an endpoint, failed when that endpoint is offline.

::

    DataPath.call(fn, ...) on an endpoint --> its future, watched until it is done
        a thread (while one is watched) asks the service whether the endpoint is
        online: at once for a new call (at most every MIN s), then every POLL s
        offline (at every answer for GRACE s) --> each watched future fails with the error made for it (a Ref's
                    read: ReferenceLost naming it and the endpoint), and its task is
                    cancelled at the service (no Executor waits for it at shutdown)

A stopped endpoint takes its objects with it (its data directory goes when its agent
stops), so a read of one would wait for ever in the service's queue: ``Ref.get``, a
copy to another endpoint (``_carry``) and the tasks waiting for that copy fail
instead. A service that cannot be asked says nothing: the calls wait as before.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["GRACE", "MIN", "POLL", "Watch", "offline_error"]

POLL = 2.0  # seconds between two questions while calls are watched
MIN = 0.2  # seconds at least between two questions (many calls at once: one question)
# seconds the service must say "offline" without a break before calls fail (an agent that
# reconnects is offline for a moment; its objects are not gone)
GRACE = 8.0


class Watch:
    """The watched calls of one endpoint; ``online()`` says (online, its name), or None
    when the service cannot tell now."""

    def __init__(self, online: Callable[[], tuple[bool, str] | None]) -> None:
        self._online = online
        self._lock = threading.Lock()
        self._watched: dict[cf.Future[Any], Callable[[str], BaseException]] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._offline_since: float | None = None  # offline at every answer since

    def add(self, future: cf.Future[Any], error: Callable[[str], BaseException]) -> None:
        """Fail ``future`` with ``error(name of the endpoint)`` if its endpoint is offline
        before it is done."""
        with self._lock:
            self._watched[future] = error
            start = self._thread is None
            if start:
                self._thread = threading.Thread(
                    target=self._run, name="nimbus-data-watch", daemon=True
                )
        future.add_done_callback(self._drop)
        self._wake.set()
        if start:
            assert self._thread is not None
            self._thread.start()

    def _drop(self, future: cf.Future[Any]) -> None:
        with self._lock:
            self._watched.pop(future, None)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._watched:
                    self._thread = None  # (an add from now on starts another)
                    return
                asked = list(self._watched.items())
            self._wake.clear()
            state = self._online()
            if state is not None and state[0]:
                self._offline_since = None
            elif state is not None:
                now = time.monotonic()
                if self._offline_since is None:
                    self._offline_since = now
                if now - self._offline_since >= GRACE:
                    for future, error in asked:
                        fail(future, error(state[1]))
            time.sleep(MIN)
            self._wake.wait(POLL - MIN)


def fail(future: cf.Future[Any], error: BaseException) -> None:
    """``future`` fails with ``error`` and its task is cancelled at the service."""
    task = getattr(future, "_task", None)
    try:
        future.set_exception(error)
    except cf.InvalidStateError:  # done meanwhile
        return
    if task is not None:
        task.cancelled = True  # (not yet accepted: cancelled once it is)
        stop = getattr(future, "_stop", None)
        if stop is not None:
            stop(task)


def offline_error(fn: Callable[..., Any], args: tuple[Any, ...]) -> Callable[[str], BaseException]:
    """What a call of ``fn`` with ``args`` fails with when its endpoint (named when
    it fails) is offline: ``ReferenceLost`` naming the object it reads, where it reads
    one (a Ref, or a reference's id first), else ``DataError``."""
    from nimbus.data._ref import Ref
    from nimbus.errors import DataError, ReferenceLost

    first = args[0] if args else None
    if type(first) is Ref:
        what, ref_id = repr(first), first.id
    elif isinstance(first, str) and len(first) == 32 and first.isalnum():
        what, ref_id = f"the object {first[:12]}", first
    else:
        what, ref_id = "", ""

    def error(name: str) -> BaseException:
        if not ref_id:
            return DataError(
                f"endpoint {name!r} is offline (stopped, or cut off from the service): "
                f"{getattr(fn, '__name__', fn)} of the data path cannot run there; start it "
                f"(`nimbus endpoint start {name}`) and try again"
            )
        return ReferenceLost(
            f"{what} cannot be read: endpoint {name!r}, which keeps it, is offline (stopped, "
            f"or cut off from the service), and a stopped endpoint's objects are gone with "
            f"it; make the object again (nimbus.put, or the task that made it) and pass the "
            f"new reference",
            ref_id,
        )

    return error
