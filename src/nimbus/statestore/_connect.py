"""The one way to open a connection to a state store: :func:`connect`.

::

    connect(url)                  -> this process's client of ``url`` (cached, pooled)
    connect(url, own=True, ...)   -> a new client of its own, the caller closes it
    connect_async(url)            -> a new asyncio client (the service's task queues)
    Link(url) (``_link``)         -> one thread's hiredis wire, made from connect(url)'s settings

Every client gets the same options: no read timeout (BLPOP and friends may block
for long; a dead server closes the socket, a vanished one is found by TCP keepalive:
:data:`KEEPALIVE`), no ``CLIENT SETINFO`` at connect, and
for a ``rediss://`` URL the CAs of ``NIMBUS_CA_FILE`` (:func:`tls_options`).
A connection to an embedded store that is still booting (:func:`booting`: a
program's root launches its store and goes on) waits until it answers.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from nimbus._lazy import lazy
from nimbus.errors import ConfigError, StateStoreError

if TYPE_CHECKING:
    import redis
    import redis.asyncio as aioredis
else:  # imported at the first connection (redis-py is most of what importing nimbus costs)
    redis = lazy("redis", globals())
    aioredis = lazy("redis.asyncio", globals(), "aioredis")

__all__ = [
    "AskedStart",
    "Booting",
    "ask_to_start",
    "booting",
    "booting_server",
    "connect",
    "connect_async",
    "forget",
    "is_booting",
    "pool",
    "probe",
    "redacted",
    "tls_options",
    "untouched",
    "when_ready",
]

# driver_info=None: no CLIENT SETINFO at connect (two round trips) and no lookup
# of redis-py's version in the package metadata (about 6 ms per connection)
_POOL_OPTIONS: dict[str, Any] = {
    "socket_connect_timeout": 5.0,
    "socket_timeout": None,
    "driver_info": None,
}

# TCP keepalive for every network client: a peer gone without a reset (a NAT or load
# balancer that dropped the flow, a host powered off) ends its connections in about
# 15 + 5 x 3 s, where a command on them (no read timeout) would wait for ever
KEEPALIVE = (15, 5, 3)  # seconds idle, seconds between probes, probes


def _keepalive(url: str) -> dict[str, Any]:
    if url.startswith("unix://"):
        return {}
    import socket

    idle, interval, count = KEEPALIVE
    options = {
        getattr(socket, "TCP_KEEPIDLE", None) or getattr(socket, "TCP_KEEPALIVE", None): idle,
        getattr(socket, "TCP_KEEPINTVL", None): interval,
        getattr(socket, "TCP_KEEPCNT", None): count,
    }
    return {
        "socket_keepalive": True,
        "socket_keepalive_options": {k: v for k, v in options.items() if k is not None},
    }


class Booting(Protocol):
    """An embedded store launched and maybe not answering yet (``EmbeddedRedis``)."""

    owner_pid: int
    start_timeout: float

    def serve(self) -> bool: ...

    def gone(self) -> bool: ...


class AskedStart:
    """A store that another process owns and starts when asked (``ask(url)``, once): a
    warm worker's task waits for its executor's process to start its program's store."""

    def __init__(self, ask: Callable[[str], None], url: str, owner_pid: int, timeout: float):
        self._ask: Callable[[str], None] | None = ask
        self.url = url
        self.owner_pid = owner_pid
        self.start_timeout = timeout

    def serve(self) -> bool:
        ask, self._ask = self._ask, None
        if ask is not None:
            ask(self.url)
        return False  # (the caller waits for its socket)

    def gone(self) -> bool:
        try:
            os.kill(self.owner_pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
        return False


# Embedded stores that boot while the program goes on (a Process needs no store), by
# socket path: a connection to one waits until it answers. Its owner waits by the
# server's own readiness; a process forked from the owner (which inherits this) for
# its socket to take connections.
_booting: dict[str, Booting] = {}
_on_ready: dict[str, list[Callable[[], None]]] = {}  # its owner's work once it answers


def booting(server: Booting, url: str) -> None:
    """Connections to ``url`` (``unix://``) wait until ``server`` answers."""
    _booting[_path(url)] = server


def when_ready(url: str, fn: Callable[[], None]) -> bool:
    """Have this process (the owner of a booting store) call ``fn`` once its first
    connection to ``url`` found the store answering; False (and no call) if it is not
    booting here: the caller does it now."""
    path = _path(url)
    server = _booting.get(path)
    if server is None or server.owner_pid != os.getpid():
        return False
    _on_ready.setdefault(path, []).append(fn)
    return True


def ask_to_start(server: AskedStart) -> None:
    """Have this process's connections to ``server.url`` ask its owner to start it, unless
    it listens already."""
    if not os.path.exists(_path(server.url)):
        _booting[_path(server.url)] = server


def booting_server(url: str) -> Booting | None:
    """The server of ``url`` if it is booting here (:func:`booting`) and not started yet."""
    path = _path(url)
    server = _booting.get(path)
    return server if server is not None and not os.path.exists(path) else None


def is_booting(url: str) -> bool:
    """Whether the store at ``url`` may not answer yet (never waits)."""
    path = _path(url)
    return path in _booting and not os.path.exists(path)


def untouched(url: str) -> bool:
    """Whether ``url`` is a store this process launched and has not connected to yet."""
    server = _booting.get(_path(url))
    return server is not None and server.owner_pid == os.getpid()


def _path(url: str) -> str:
    return url.removeprefix("unix://").partition("?")[0]


def no_retry() -> Any:
    """redis-py's retry policy of none: a dead store is an error at once."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return Retry(NoBackoff(), 0)


@functools.cache
def _unix_connection() -> type:
    """redis-py's Unix socket connection, which waits for a store that is booting
    (a class made on first use: redis-py is imported then)."""

    class _UnixConnection(redis.UnixDomainSocketConnection):
        _connect = _unix_connect

    return _UnixConnection


def _unix_connect(self: Any) -> Any:
    """``_UnixConnection._connect``: wait for the store while it boots."""
    server = _booting.get(self.path)
    if server is None:
        return redis.UnixDomainSocketConnection._connect(self)
    # started now if deferred; its own StateStoreError if the server could not start
    if server.serve():
        _booting.pop(self.path, None)
        for fn in _on_ready.pop(self.path, ()):
            fn()
        return redis.UnixDomainSocketConnection._connect(self)
    deadline = time.monotonic() + server.start_timeout
    check = time.monotonic() + 0.1  # whether it died: a few times a second
    while True:
        try:
            sock = redis.UnixDomainSocketConnection._connect(self)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            now = time.monotonic()
            if now > deadline or (now > check and server.gone()):
                why = "died" if server.gone() else f"took no connection in {server.start_timeout} s"
                raise StateStoreError(
                    f"this program's state store ({self.path}) {why} ({exc.strerror}): what it "
                    f"held is lost; run the program again (or set NIMBUS_REDIS_URL to a Redis "
                    f"server of your own)"
                ) from exc
            if now > check:
                check = now + 0.1
            time.sleep(0.002)
            continue
        _booting.pop(self.path, None)
        if server.owner_pid == os.getpid():  # (started by another process of its program)
            for fn in _on_ready.pop(self.path, ()):
                fn()
        return sock


def _options(url: str) -> dict[str, Any]:
    options = _POOL_OPTIONS | tls_options(url) | _keepalive(url)
    if url.startswith("unix://"):
        options["connection_class"] = _unix_connection()
    return options


# Per-process clients by URL. Not a global default client: nothing reaches Redis without
# a URL, which a shared object carries in its pickle so it finds its store after unpickling
# in another process. Keyed by pid so a forked child never reuses its parent's sockets.
_clients: dict[tuple[int, str], redis.Redis] = {}
_lock = threading.Lock()


def _after_fork() -> None:
    """In a forked child: close its copies of the parent's sockets (close only: a
    shutdown would end the parent's connections too), so they are not inherited on."""
    global _lock
    _lock = threading.Lock()
    for client in _clients.values():
        pool = client.connection_pool
        for conn in [*pool._available_connections, *pool._in_use_connections]:
            sock = getattr(conn, "_sock", None)
            if sock is not None:
                sock.close()
    _clients.clear()


os.register_at_fork(after_in_child=_after_fork)


def tls_options(url: str) -> dict[str, Any]:
    """For a ``rediss://`` URL that names no CA of its own: verify the server with the
    CAs of ``ca_file`` (NIMBUS_CA_FILE), as the service's certificate is verified."""
    if not url.startswith("rediss://") or "ssl_ca_" in url:
        return {}
    from nimbus.config import Settings

    ca_file = Settings.load().ca_file
    return {} if ca_file is None else {"ssl_ca_certs": str(ca_file)}


def connect(
    url: str,
    *,
    own: bool = False,
    single: bool = False,
    timeout: float | None = None,
    password: str | None = None,
) -> redis.Redis:
    """A client of the state store at ``url``.

    By default this process's client of ``url`` (created on first use, shared
    by its threads, bytes replies, hiredis when installed). With ``own=True``
    a new client of its own, which the caller closes (a ``with`` block): for
    connections that must not outlive a call. ``single=True`` (with ``own``)
    connects at once, on the one connection it keeps: for a connection whose
    identity matters (its client id). ``timeout`` (with ``own``) bounds the
    connect and every reply, with no retries: a probe fails within about it.
    """
    options = _options(url) if not own else _POOL_OPTIONS | tls_options(url) | _keepalive(url)
    if own:
        if timeout is not None:
            options |= {
                "socket_connect_timeout": timeout,
                "socket_timeout": timeout,
                "retry": no_retry(),
            }
        if password is not None:
            options["password"] = password
        return redis.Redis.from_url(url, single_connection_client=single, **options)
    key = (os.getpid(), url)
    with _lock:
        client = _clients.get(key)
        if client is None:
            for stale in [k for k in _clients if k[0] != key[0]]:
                del _clients[stale]  # inherited across fork: the parent's, not ours
            client = _clients[key] = redis.Redis.from_url(url, **options)
        return client


def connect_async(url: str) -> aioredis.Redis:
    """A new asyncio client of the state store at ``url`` (the service's task queues),
    with :func:`connect`'s options; the caller closes it (``aclose``)."""
    return aioredis.Redis.from_url(url, **_POOL_OPTIONS, **tls_options(url), **_keepalive(url))


def redacted(url: str) -> str:
    """``url`` without its password (for messages and logs)."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.rpartition('@')[2]}"


def pool(url: str) -> redis.ConnectionPool:
    """A new connection pool to ``url``, with :func:`connect`'s options."""
    return redis.ConnectionPool.from_url(url, **_options(url))


def forget(url: str) -> None:
    """Close this process's clients of ``url`` now (its server is stopping), not
    whenever the collector gets to their sockets."""
    _booting.pop(_path(url), None)
    _on_ready.pop(_path(url), None)
    with _lock:
        for key in [k for k in _clients if k[1] == url]:
            _clients.pop(key).connection_pool.disconnect()


def probe(url: str, timeout: float) -> None:
    """PING ``url`` once, failing within about ``timeout`` seconds."""
    try:
        client = connect(url, own=True, timeout=timeout)
    except ValueError as exc:
        raise ConfigError(
            f"state store URL {url!r} is invalid ({exc}); NIMBUS_REDIS_URL takes a "
            f"redis://, rediss:// or unix:// URL"
        ) from None
    try:
        with client:
            client.ping()
    except redis.RedisError as exc:
        raise StateStoreError(
            f"cannot reach the state store at {url} ({exc}); check NIMBUS_REDIS_URL and "
            f"that the Redis server there is running"
        ) from exc
