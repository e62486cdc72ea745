"""Run the service: ``serve(settings, host, port)`` (``nimbus service start``).

The task queues use ``Settings.redis_url``, or an embedded Redis the service
starts in its runtime directory and stops on exit (kept on disk, in
``<runtime_dir>/service/redis``, with ``--persist``). With ``port=0`` the system
picks a free port; the URL the service listens on is printed on stdout, and
written to ``url_file`` when given, once it accepts connections. With
``tls=(cert, key)`` it serves HTTPS and WSS only (the URL is ``https://``), and
the stores Redis handed to programs is reached through TLS too (see
``nimbus.service.stores``); see SECURITY.md.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from nimbus import _loop
from nimbus.config import Settings
from nimbus.errors import ConfigError
from nimbus.service.protocol import MESSAGE_BYTES
from nimbus.statestore import StateStore

__all__ = ["check_tls", "serve"]

log = logging.getLogger(__name__)


def serve(
    settings: Settings,
    host: str = "127.0.0.1",
    port: int = 8420,
    url_file: Path | None = None,
    *,
    persist: bool = False,
    tls: tuple[Path, Path] | None = None,
) -> None:
    """Run the service until SIGTERM or SIGINT; ``persist`` keeps the embedded Redis on disk;
    ``tls`` is (certificate chain, private key), PEM files, to serve HTTPS."""
    from nimbus.service.app import create_app

    context = None if tls is None else check_tls(*tls)

    if persist and settings.redis_url:
        raise ConfigError(
            "--persist keeps the embedded Redis on disk; NIMBUS_REDIS_URL names your own "
            "Redis: configure its persistence there (appendonly yes)"
        )
    persist_dir = settings.service_dir / "redis" if persist else None
    store = StateStore.open(
        settings.redis_url, settings.ensure_runtime_dir(), persist_dir=persist_dir
    )
    try:
        app = create_app(settings, store.url)
        app.state.tls = context  # the stores Redis serves TLS with the same certificate
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            ws_max_size=4 * MESSAGE_BYTES,  # larger payloads go through the data store
            ws_ping_interval=None,
            ws_per_message_deflate=False,  # payloads are pickles: compressing costs, gains little
            lifespan="on",
            timeout_graceful_shutdown=5,  # then connections still open are cut
            ssl_certfile=None if tls is None else str(tls[0]),
            ssl_keyfile=None if tls is None else str(tls[1]),
        )
        server = uvicorn.Server(config)
        _loop.run(_run(server, app, url_file, "http" if tls is None else "https"))
    finally:
        store.close()


async def _end_waits_at_exit(server: uvicorn.Server, app: FastAPI) -> None:
    """Once the server is told to stop, answer the long-polls now: uvicorn's graceful
    shutdown waits for requests under way, and a long-poll may wait minutes."""
    while not server.should_exit:
        await asyncio.sleep(0.1)
    ctx = getattr(app.state, "ctx", None)
    if ctx is not None:
        ctx.hub.close()


def check_tls(cert: Path, key: Path) -> ssl.SSLContext:
    """A server context of ``cert`` and ``key``; ConfigError naming the flag when they
    cannot be read or do not match."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except FileNotFoundError as exc:
        flag = "--tls-cert" if Path(exc.filename or "") == cert else "--tls-key"
        raise ConfigError(f"{flag} {exc.filename}: no such file") from None
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"--tls-cert {cert} and --tls-key {key} cannot be used ({exc}); give the PEM "
            f"certificate chain and its private key (unencrypted)"
        ) from None
    return context


async def _run(server: uvicorn.Server, app: FastAPI, url_file: Path | None, scheme: str) -> None:
    task = asyncio.create_task(server.serve())
    ender = asyncio.create_task(_end_waits_at_exit(server, app))
    task.add_done_callback(lambda _: ender.cancel())
    while not server.started:
        if task.done():
            await task  # failed to start: raise why
            return
        await asyncio.sleep(0.02)
    sock = server.servers[0].sockets[0]
    host, port = sock.getsockname()[:2]
    url = f"{scheme}://{host}:{port}"
    print(f"nimbus service listening on {url}", flush=True)
    if url_file is not None:
        tmp = url_file.with_suffix(".tmp")
        tmp.write_text(url + "\n")
        tmp.replace(url_file)
    await task
