"""Run the service: ``serve(settings, host, port)`` (``nimbus service start``).

The task queues use ``Settings.redis_url``, or an embedded Redis the service
starts in its runtime directory and stops on exit (kept on disk, in
``<runtime_dir>/service/redis``, with ``--persist``). If that Redis dies, the
service starts it again within a second, from its append-only file with
``--persist`` (else empty: the tasks queued and running are lost, and the log
says so); meanwhile ``/v1/health`` and every call that needs it answer 503 with
``Retry-After``, and errors caused by the outage are logged as one line per
``QUIET`` seconds, not a traceback per request. With ``port=0`` the system
picks a free port; the URL the service listens on is printed on stdout, and
written to ``url_file`` when given, once it accepts connections. With
``tls=(cert, key)`` it serves HTTPS and WSS only (the URL is ``https://``), and
the stores Redis handed to programs is reached through TLS too (see
``nimbus.service.stores``); see SECURITY.md.

While it runs, ``<runtime_dir>/service/service.json`` holds its URL and pid, so
that the admin commands (``nimbus service token``) can say which service's
registry they use (:func:`running_service`).

SIGTERM and SIGINT (Ctrl-C) stop it gracefully: uvicorn answers what is under
way, then signals the process again with the handler it found; ours (SIGTERM)
ends :func:`serve` so that the embedded Redis stops and its socket, state and
log files leave the runtime directory.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import redis
import uvicorn
from fastapi import FastAPI

from nimbus import _loop, _service_state
from nimbus.config import Settings
from nimbus.errors import ConfigError, StateStoreError
from nimbus.service.limits import HeadLimit
from nimbus.service.running import STATE_FILE, running_service
from nimbus.statestore import StateStore

__all__ = ["check_tls", "running_service", "serve"]

log = logging.getLogger(__name__)
SUPERVISE_SECONDS = 0.5  # how often the embedded queue Redis is checked
QUIET = 30.0  # seconds between log lines about errors of one queue Redis outage


def serve(
    settings: Settings,
    host: str = "127.0.0.1",
    port: int = 8420,
    url_file: Path | None = None,
    *,
    persist: bool = False,
    tls: tuple[Path, Path] | None = None,
    name: str = "service",
) -> None:
    """Run the service until SIGTERM or SIGINT; ``persist`` keeps the embedded Redis on disk;
    ``tls`` is (certificate chain, private key), PEM files, to serve HTTPS; ``name`` is
    what it says is listening (``nimbus NAME listening on URL``: service, dashboard)."""
    context = None if tls is None else check_tls(*tls)

    if persist and settings.redis_url:
        raise ConfigError(
            "--persist keeps the embedded Redis on disk; NIMBUS_REDIS_URL names your own "
            "Redis: configure its persistence there (appendonly yes)"
        )
    persist_dir = settings.service_dir / "redis" if persist else None
    # a SIGTERM while the handler is swapped waits for the try below (it arrived as the
    # service started: stop it cleanly, not from inside signal.signal)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        previous = _stop_on_sigterm()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        _serve(settings, host, port, url_file, persist_dir, tls, context, name)
    except _Terminated:
        log.info("nimbus service stopped (SIGTERM)")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class _Terminated(Exception):
    """SIGTERM arrived: leave :func:`serve`, cleaning up on the way."""


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def _stop_on_sigterm() -> Any:
    """Make SIGTERM end :func:`serve` by an exception (so ``finally`` runs); the old handler.

    uvicorn takes SIGTERM while it serves, shuts down gracefully and then
    raises the signal again under the handler it found: by default that kills
    the process before the embedded Redis is stopped.
    """
    if threading.current_thread() is not threading.main_thread():
        return None  # signals reach the main thread only: its owner decides
    return signal.signal(signal.SIGTERM, _terminated)


def _serve(
    settings: Settings,
    host: str,
    port: int,
    url_file: Path | None,
    persist_dir: Path | None,
    tls: tuple[Path, Path] | None,
    context: ssl.SSLContext | None,
    name: str,
) -> None:
    from nimbus.service.app import create_app

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
            ws_max_size=settings.max_message,  # NIMBUS_MAX_MESSAGE; larger: closed, 1009
            ws_ping_interval=None,
            ws_per_message_deflate=False,  # payloads are pickles: compressing costs, gains little
            lifespan="on",
            timeout_graceful_shutdown=5,  # then connections still open are cut
            ssl_certfile=None if tls is None else str(tls[0]),
            ssl_keyfile=None if tls is None else str(tls[1]),
            http=HeadLimit,  # a head over max_header_bytes: 431
            h11_max_incomplete_event_size=settings.max_header_bytes,
        )
        _quiet_outage_errors()  # after uvicorn.Config, which sets up uvicorn's loggers
        server = uvicorn.Server(config)
        _loop.serving_gc()
        _loop.run(
            _run(
                server,
                app,
                url_file,
                store,
                persist_dir,
                settings.service_dir / STATE_FILE,
                "http" if tls is None else "https",
                name,
            )
        )
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


def _outage_error(exc: BaseException | None) -> redis.RedisError | None:
    """The Redis connection error behind ``exc`` (its causes, its group), if any."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, (redis.ConnectionError, redis.TimeoutError)):
            return err
        if isinstance(err, BaseExceptionGroup):
            todo.extend(err.exceptions)
        todo.extend((err.__cause__, err.__context__))
    return None


class _OneLinePerOutage(logging.Filter):
    """Errors logged because the queue Redis is away: one line (no traceback) per
    ``QUIET`` seconds, with the count of those left out since the last one."""

    def __init__(self) -> None:
        super().__init__()
        self.last = -QUIET
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        cause = _outage_error(record.exc_info[1] if record.exc_info else None)
        if cause is None:
            return True
        now = time.monotonic()
        if now - self.last < QUIET:
            self.dropped += 1
            return False
        message = record.getMessage()
        record.msg = "%s: the task queues' Redis is unavailable (%s: %s)%s"
        record.args = (
            message.strip(),
            type(cause).__name__,
            cause,
            f"; {self.dropped} such errors were not logged" if self.dropped else "",
        )
        record.exc_info = record.exc_text = None
        self.last, self.dropped = now, 0
        return True


def _quiet_outage_errors() -> None:
    """Put one :class:`_OneLinePerOutage` on the loggers and handlers errors reach."""
    quiet = _OneLinePerOutage()
    for name in ("", "uvicorn", "uvicorn.error", "nimbus", "nimbus.service"):
        logger = logging.getLogger(name)
        for handler in logger.handlers:
            if quiet not in handler.filters:
                handler.addFilter(quiet)
    for name in ("uvicorn.error", "nimbus.service.app", "nimbus.service.ws", "nimbus.service"):
        logging.getLogger(name).addFilter(quiet)


async def _supervise(app: FastAPI, store: StateStore, persist_dir: Path | None) -> None:
    """Start the embedded queue Redis again whenever it dies, requeue what was in flight,
    and tell the clients waiting on tasks it lost (restarted empty) that they are lost."""
    from nimbus.service.ws import tell_lost

    while True:
        await asyncio.sleep(SUPERVISE_SECONDS)
        if store.alive():
            continue
        since = time.monotonic()
        if persist_dir is not None:
            how = f"from its append-only file in {persist_dir}"
        else:
            how = (
                "empty: the tasks queued and running are lost (asked for, they are not found) "
                "(start the service with --persist to keep them)"
            )
        log.error("the task queues' Redis (pid %d) died; restarting it %s", store.server_pid, how)
        backoff = SUPERVISE_SECONDS
        while True:
            try:
                await asyncio.to_thread(store.restart)
                break
            except StateStoreError as exc:
                log.error(
                    "cannot restart the task queues' Redis: %s; again in %.0f s", exc, backoff
                )
                await asyncio.sleep(backoff)
                backoff = min(30.0, backoff * 2)
        requeued = 0
        ctx = getattr(app.state, "ctx", None)
        if ctx is not None:
            try:
                requeued = await ctx.store.requeue_all()
                await tell_lost(ctx)  # clients waiting on tasks it no longer has are told
            except redis.RedisError as exc:
                log.error("could not requeue the tasks in flight: %s", exc)
        log.warning(
            "the task queues' Redis is back (pid %d) after %.1f s; %d tasks in flight requeued",
            store.server_pid,
            time.monotonic() - since,
            requeued,
        )


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


async def _run(
    server: uvicorn.Server,
    app: FastAPI,
    url_file: Path | None,
    store: StateStore,
    persist_dir: Path | None,
    state: Path,
    scheme: str,
    name: str,
) -> None:
    task = asyncio.create_task(server.serve())
    ender = asyncio.create_task(_end_waits_at_exit(server, app))
    supervisor = asyncio.create_task(_supervise(app, store, persist_dir))
    task.add_done_callback(lambda _: (ender.cancel(), supervisor.cancel()))
    while not server.started:
        if task.done():
            await task  # failed to start: raise why
            return
        await asyncio.sleep(0.02)
    sock = server.servers[0].sockets[0]
    host, port = sock.getsockname()[:2]
    url = f"{scheme}://{host}:{port}"
    print(f"nimbus {name} listening on {url}", flush=True)
    if url_file is not None:
        _write(url_file, url + "\n")
    _write(state, _service_state.text(url))
    try:
        await task
    finally:
        state.unlink(missing_ok=True)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
