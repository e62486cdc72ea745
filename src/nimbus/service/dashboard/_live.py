"""Wake-ups for the dashboard's open pages: one Redis subscription per service process.

Every script of the task store that moves tasks publishes on ``TaskStore.changes``
the ids of the tasks' owners (``nimbus.service.queues``; '' for anyone's). While
at least one page of this process streams, one subscriber task listens on that
channel and bumps a version number, noting it for each owner named; a stream
waits until its user's mark (:meth:`Changes.mark`: any change for an admin)
passes the one it last drew, so an open page reads nothing while nothing of its
user's changes, and all the processes of a service see every change (the
publishes go through the shared queue Redis). With no page
open the subscription is dropped. If the subscription breaks (the queue Redis
restarted) the version is bumped too, so pages re-read what they may have missed.
:attr:`Changes.local` is the version of the last change to a local Executor's
tasks (owners ``local:<user>``, published by ``local_history.ingest_and_tell``):
those are in the SQL history only, which an admin's tasks stream then reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.requests import Request

from nimbus.service.local_history import OWNER_PREFIX
from nimbus.service.queues import TaskStore

__all__ = ["Changes", "changes"]

log = logging.getLogger(__name__)
RETRY = 1.0  # seconds before subscribing again after the queue Redis went away


class Changes:
    """The version of the task store as this process last heard of it."""

    def __init__(self, store: TaskStore) -> None:
        self.store = store
        self.version = 0
        self._anyone = 0  # the version of the last change published without owners
        self.local = 0  # the version of the last change to a local Executor's tasks
        self._owners: dict[str, int] = {}  # owner id -> the version of their last change
        self._changed = asyncio.Condition()
        self._watchers = 0
        self._listener: asyncio.Task[None] | None = None

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """Keep the subscription while the block runs (one open stream)."""
        self._watchers += 1
        if self._listener is None or self._listener.done():
            self._listener = asyncio.create_task(self._listen())
        try:
            yield
        finally:
            self._watchers -= 1
            if not self._watchers and self._listener is not None:
                self._listener.cancel()
                self._listener = None

    def mark(self, owner: str | None) -> int:
        """The version of the last change to ``owner``'s tasks (None: anyone's)."""
        if owner is None:
            return self.version
        return max(self._anyone, self._owners.get(owner, 0))

    async def wait(self, owner: str | None, seen: int, timeout: float) -> int:
        """:meth:`mark` once it is past ``seen``, or after ``timeout`` seconds."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self.mark(owner) > seen), max(0.0, timeout)
                )
            return self.mark(owner)

    async def _bump(self, owners: bytes = b"") -> None:
        async with self._changed:
            self.version += 1
            if owners:
                for owner in owners.decode(errors="replace").split():
                    self._owners[owner] = self.version
                    if owner.startswith(OWNER_PREFIX):
                        self.local = self.version
            else:
                self._anyone = self.version
            self._changed.notify_all()

    async def _listen(self) -> None:
        while True:
            pubsub = self.store.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.store.changes)
                await self._bump()  # anything before the subscription held
                while True:
                    message = await pubsub.get_message(timeout=None)
                    if message is not None:
                        await self._bump(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the queue Redis went away: subscribe again
                log.debug("dashboard subscription lost: %s", exc)
                await self._bump()
                await asyncio.sleep(RETRY)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.shield(pubsub.aclose())


def changes(request: Request) -> Changes:
    """This process's :class:`Changes` of the service's task store."""
    state = request.app.state
    found: Changes | None = getattr(state, "dashboard_changes", None)
    if found is None:
        found = state.dashboard_changes = Changes(state.ctx.store)
    return found
