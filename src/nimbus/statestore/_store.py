"""The store a program or the service uses: a Redis reached by URL, or an embedded one it owns.

::

    StateStore.open(url or None, runtime_dir)
        url given  -> probe(url): PING, clear errors -> StateStore(url)
        None       -> EmbeddedRedis(runtime_dir).start() -> StateStore(unix://...sock, server)
    store.client()  -> a client on the store's own pool
    store.close()   -> pool closed; the embedded server stopped (this process's clients too)

It translates redis errors into :class:`~nimbus.errors.StateStoreError` only in
:meth:`StateStore.open`; modules that issue commands translate the errors of
their own calls.
"""

from __future__ import annotations

import atexit
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from nimbus._lazy import lazy
from nimbus.statestore._connect import forget, pool, probe
from nimbus.statestore._embedded import EmbeddedRedis

if TYPE_CHECKING:
    from nimbus.config import Settings


if TYPE_CHECKING:
    import redis
else:  # imported on first use (redis-py: at the first connection)
    redis = lazy("redis", globals())

__all__ = ["StateStore"]


class StateStore:
    """The Redis that holds nimbus's shared state, and a connection pool to it.

    Open one with :meth:`open` (or :meth:`from_settings`). ``url`` is what other
    processes pass to :func:`connect`; ``embedded`` says whether this object owns a
    private server that :meth:`close` stops.
    """

    def __init__(self, url: str, server: EmbeddedRedis | None = None) -> None:
        self.url = url
        self.embedded = server is not None
        self._server = server
        self._made: redis.ConnectionPool | None = None  # on first use: redis-py is imported then

    @property
    def _pool(self) -> redis.ConnectionPool:
        if self._made is None:
            self._made = pool(self.url)
        return self._made

    @classmethod
    def open(
        cls,
        redis_url: str | None,
        runtime_dir: Path,
        *,
        connect_timeout: float = 3.0,
        persist_dir: Path | None = None,
    ) -> StateStore:
        """Connect to ``redis_url``, or start an embedded Redis in ``runtime_dir`` if it is None
        (keeping its data in ``persist_dir`` when given)."""
        if redis_url:
            probe(redis_url, connect_timeout)
            return cls(redis_url)
        server = EmbeddedRedis(runtime_dir, persist_dir=persist_dir).start()
        return cls(server.url, server)

    @classmethod
    def from_settings(cls, settings: Settings) -> StateStore:
        """:meth:`open` with a :class:`nimbus.config.Settings`."""
        return cls.open(settings.redis_url, settings.ensure_runtime_dir())

    def alive(self) -> bool:
        """False once the embedded server died (a store reached by URL: always True)."""
        return self._server is None or self._server.alive()

    @property
    def server_pid(self) -> int:
        """The embedded server's pid (0 for a store reached by URL)."""
        return self._server.server_pid if self._server is not None else 0

    def restart(self) -> None:
        """Start the embedded server again, on the same URL, after it died: from its
        append-only file when it persists, else empty."""
        if self._server is not None:
            if self._made is not None:
                self._made.disconnect()
            self._server.restart()

    def client(self) -> redis.Redis:
        """A client on this store's pool (bytes replies; hiredis when installed)."""
        return redis.Redis(connection_pool=self._pool)

    def stop_at_close_only(self) -> None:
        """Leave the embedded server running at interpreter exit until :meth:`close`.

        For an owner whose own exit work still uses the store (multiprocessing's
        exit finalizers run after ``atexit`` handlers registered later than
        them); the watchdog still ends the server if the owner dies first.
        """
        if self._server is not None:
            atexit.unregister(self._server.stop)

    def close(self) -> None:
        """Close the pool and stop the embedded server if this store owns one."""
        if self._made is not None:
            self._made.disconnect()
        if self._server is not None:
            self._server.stop()
            forget(self.url)

    def __enter__(self) -> StateStore:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
