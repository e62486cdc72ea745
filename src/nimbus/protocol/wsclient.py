"""The one WebSocket client of the service's peers: endpoint agents and the SDK.

::

    http://host:port   ->  ws://host:port/v1/ws/...
    https://host:port  ->  wss://host:port/v1/ws/...   (certificate verified with the
                                                        caller's SSL context: NIMBUS_CA_FILE)

:func:`open_socket` opens ``path`` of the service with the bearer token and the
options both peers use (no compression, messages of at most ``RECEIVE_MAX``
bytes accepted (a larger one closes the connection with 1009), pings every
``keepalive`` seconds so that a link cut silently is noticed);
:func:`certificate_error` turns a refused certificate into a ConfigError that
names the setting to fix.
"""

from __future__ import annotations

import ssl

from websockets.asyncio.client import connect

from nimbus.config import untrusted_certificate
from nimbus.errors import ConfigError
from nimbus.protocol import RECEIVE_MAX

__all__ = ["certificate_error", "open_socket", "ws_url"]


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
