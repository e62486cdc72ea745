"""The one WebSocket client of the service's peers: endpoint daemons and the SDK.

::

    http://host:port   ->  ws://host:port/v1/ws/...
    https://host:port  ->  wss://host:port/v1/ws/...   (certificate verified with the
                                                        caller's SSL context: NIMBUS_CA_FILE)

    ServiceSocket.run(session):  connect --> session(ws) --> connection ends --+
                                    ^                                          |
                                    +---- backoff (doubling, up to a cap) <----+
                                 until stop(), or the token is refused or revoked (AuthError),
                                 replaced (AuthError) or its endpoint deleted (NotFound)

:func:`open_socket` opens ``path`` of the service with the bearer token and the
options both peers use (no compression, messages of at most ``RECEIVE_MAX``
bytes accepted (a larger one closes the connection with 1009), pings every
``keepalive`` seconds so that a link cut silently is noticed);
:class:`ServiceSocket` keeps one such connection up: it builds the URL once,
reconnects with exponential backoff, and ends with an error that names the
token and what to do when the service will not take that token any more;
:func:`certificate_error` turns a refused certificate into a ConfigError that
names the setting to fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
from collections.abc import Awaitable, Callable

import websockets
from websockets.asyncio.client import ClientConnection, connect

from nimbus.config import untrusted_certificate
from nimbus.errors import AuthError, ConfigError, NotFound, ProtocolError, ServiceError
from nimbus.protocol._codec import DELETED, RECEIVE_MAX, REPLACED, REVOKED

__all__ = ["ServiceSocket", "certificate_error", "open_socket", "ws_url"]

log = logging.getLogger(__name__)

Session = Callable[[ClientConnection], Awaitable[None]]


def ws_url(service_url: str, path: str) -> str:
    """The WebSocket URL of ``path`` on the service at ``service_url``."""
    base = service_url.rstrip("/")
    if base.startswith("https://"):
        return "wss://" + base.removeprefix("https://") + path
    return "ws://" + base.removeprefix("http://") + path


def open_socket(
    service_url: str,
    path: str,
    token: str,
    context: ssl.SSLContext | None,
    *,
    keepalive: float,
) -> connect:
    """``async with open_socket(...) as ws``: a connection to ``path`` of the service;
    ``context`` verifies its certificate (required for https:// URLs)."""
    url = ws_url(service_url, path)
    if url.startswith("wss://") and context is None:
        raise ConfigError(f"{service_url} is https://: give the SSL context that verifies it")
    return connect(
        url,
        additional_headers={"Authorization": f"Bearer {token}"},
        max_size=RECEIVE_MAX,
        ping_interval=keepalive,
        ping_timeout=3 * keepalive,
        compression=None,
        open_timeout=10,
        ssl=context if url.startswith("wss://") else None,
    )


def certificate_error(exc: BaseException, service_url: str) -> ConfigError | None:
    """A ConfigError naming NIMBUS_CA_FILE if ``exc`` is a refused certificate, else None."""
    return untrusted_certificate(exc, f"the nimbus service at {service_url}")


class ServiceSocket:
    """A WebSocket to ``path`` of the service, kept up by :meth:`run` until :meth:`stop`.

    ``whose`` names the token in errors ("endpoint lab's token") and ``fix`` says how
    to get a new one (``replaced`` and ``deleted`` what to do when the service closes
    the connection because the token was replaced, or its endpoint deleted); ``backoff`` is the first and the longest wait between connects
    (``jitter`` spreads them, as many daemons reconnect at once after a restart).
    """

    def __init__(
        self,
        service_url: str,
        path: str,
        token: str,
        context: ssl.SSLContext | None,
        *,
        keepalive: float,
        whose: str,
        fix: str,
        replaced: str = "",
        deleted: str = "",
        backoff: tuple[float, float] = (0.1, 5.0),
        jitter: bool = True,
    ) -> None:
        self.service_url = service_url.rstrip("/")
        self.url = ws_url(self.service_url, path)
        self.path = path
        self.token = token
        self.context = context
        self.keepalive = keepalive
        self.whose = whose
        self.fix = fix
        self.replaced = replaced or f"{whose} was replaced by a new one: {fix}"
        self.deleted = deleted or fix
        self.backoff = backoff
        self.jitter = jitter
        self.connects = 0
        self.error: BaseException | None = None  # why the last connection failed
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stop(self) -> None:
        """Stop reconnecting, and end :meth:`wait_stopped` (thread-safe)."""
        self._stopping = True
        if self._loop is not None and self._stopped is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing waits
                self._loop.call_soon_threadsafe(self._stopped.set)

    async def wait_stopped(self) -> None:
        """Wait until :meth:`stop` (for a session that ends then)."""
        assert self._stopped is not None
        await self._stopped.wait()

    async def run(self, session: Session) -> None:
        """Connect, run ``session(ws)``, and connect again when it ends, until :meth:`stop`.

        A session that ends with ProtocolError (it closed the connection on a malformed
        frame) keeps the backoff growing. Raises AuthError when the service refuses the
        token (HTTP 401/403) or closes the connection because it was revoked or
        replaced, NotFound when its endpoint was deleted, ConfigError when the
        service's certificate is not trusted.
        """
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        if self._stopping:
            self._stopped.set()
        first, most = self.backoff
        backoff = first
        malformed = False  # the last connection ended on a malformed frame: keep backing off
        while not self._stopping:
            try:
                async with open_socket(
                    self.service_url, self.path, self.token, self.context, keepalive=self.keepalive
                ) as ws:
                    self.connects += 1
                    if not malformed:
                        backoff = first
                    malformed = False
                    await session(ws)
            except ProtocolError as exc:  # logged and closed by the session
                self.error = exc
                malformed = True
            except websockets.InvalidStatus as exc:
                status = exc.response.status_code
                if status in (401, 403):
                    raise self.refused(status) from None
                self.error = ServiceError(
                    f"the service at {self.url} answered HTTP {status}", status
                )
                log.warning("the service at %s answered HTTP %s; retrying", self.url, status)
            except websockets.ConnectionClosed as exc:
                if exc.rcvd is not None:
                    self._closed_for_good(exc.rcvd.code, exc.rcvd.reason)
                self.error = exc
                if exc.sent is not None and exc.sent.code == 1009:  # over RECEIVE_MAX
                    log.warning("closed the connection to %s: %s; reconnecting", self.url, exc.sent)
                else:
                    log.info("connection to %s lost (%s); retrying", self.url, exc)
            except ssl.SSLCertVerificationError as exc:
                raise certificate_error(exc, self.service_url) or exc from None
            except (OSError, websockets.WebSocketException, TimeoutError) as exc:
                self.error = exc
                log.info("connection to %s lost (%s); retrying in %.1fs", self.url, exc, backoff)
            except Exception as exc:  # a fault met in a session: this connection ends, not us
                self.error = exc
                log.exception("the session with %s failed; reconnecting", self.url)
            if self._stopping:
                break
            wait = backoff * (1 + random.random()) if self.jitter else backoff
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), wait)
            backoff = min(most, backoff * 2)

    def refused(self, status: int) -> AuthError:
        """The error of the token refused when connecting (HTTP ``status``)."""
        return AuthError(
            f"the service at {self.service_url} refused {self.whose} (HTTP {status}): it is "
            f"unknown or was revoked; {self.fix}",
            status,
        )

    def _closed_for_good(self, code: int, reason: str) -> None:
        """The service closed the connection for good (the token revoked or replaced,
        the endpoint deleted): raise the error saying why and what to do."""
        said = f"the service at {self.service_url} closed the connection: {reason or code}"
        if code == REVOKED:
            raise AuthError(f"{said}; {self.whose} was revoked: {self.fix}", 401)
        if code == REPLACED:
            raise AuthError(f"{said}; {self.replaced}", 401)
        if code == DELETED:
            raise NotFound(f"{said}; {self.deleted}", 410)
