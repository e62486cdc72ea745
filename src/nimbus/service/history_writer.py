"""The history's writer: the service's flusher in a process of its own.

::

    service process (lifespan)                  writer process (python -m THIS_MODULE)
    Writer.run() --Popen; on stdin: one JSON--->  Registry + History, the queue Redis,
                   line (the registry's and the   Flusher(...).run() on its own event loop
                   queue Redis's URLs, the keys)
    cancelled (the service stops): closes stdin -> EOF: the flusher is cancelled, writes
                   and waits for the exit           what waits, the process exits
    the service dies, however (SIGKILL too): the kernel closes stdin -> the same: no orphan
    the writer dies: the service starts another within RESTART seconds; entries it took
                   and did not acknowledge are claimed by the next after CLAIM_IDLE

Why a process: a row's SQL insert costs 20-40 µs of Python and driver (the sqlite3 or
psycopg executemany binds each row holding the GIL, and releases it between rows), and in
the service's process that thread and the flusher's Redis work competed with the event
loop that answers agents and clients. Here they compete with nothing. Everything the
flusher promises holds as it did in the service's process (:mod:`nimbus.service.flusher`:
an entry is acknowledged only once its rows are committed), with SQLite as with
PostgreSQL: the writer opens the registry's database like the service does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from nimbus import _loop

__all__ = ["RESTART", "STOP_WAIT", "Writer", "main", "separate"]

RESTART = 1.0  # seconds before a writer that died is started again
# seconds the service waits for its writer's last writes as it stops: within the
# service's own bound on its jobs (app.STOP_WAIT, 10 s), so a queue Redis that went
# silent does not hold the stop; what was not written waits in it for the next start
STOP_WAIT = 8.0
POLL = 0.5  # seconds between two looks at whether the writer still runs

log = logging.getLogger("nimbus.service.history_writer")


def separate(registry_url: str) -> bool:
    """Whether another process can open the registry at ``registry_url`` (not an
    in-memory SQLite database, which only its own process sees)."""
    from sqlalchemy.engine import make_url

    url = make_url(registry_url)
    return not (url.drivername.startswith("sqlite") and url.database in (None, "", ":memory:"))


class Writer:
    """The writer process of one service process: :meth:`run` until cancelled."""

    def __init__(
        self, registry_url: str, redis_url: str, program_id: str, keep: float | None
    ) -> None:
        self.config = {
            "registry_url": registry_url,
            "redis_url": redis_url,
            "program_id": program_id,
            "keep": keep,
        }
        self.process: subprocess.Popen[bytes] | None = None
        self.started = 0  # writers started (more than one: one died)
        self.restart = RESTART
        self.stop_wait = STOP_WAIT

    def _start(self) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            # -P: not the service's directory first on the path (a module there, say a
            # project's msgpack.py, would shadow the writer's imports and kill every writer)
            [sys.executable, "-P", "-m", __name__],
            stdin=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C of the service's terminal: the service says when
        )
        assert process.stdin is not None
        # (the URLs on stdin, not argv: a PostgreSQL URL may hold a password)
        process.stdin.write(json.dumps(self.config).encode() + b"\n")
        process.stdin.flush()
        self.started += 1
        return process

    async def run(self) -> None:
        """Keep a writer running (another started if one dies); cancelled: stop it, and
        wait up to ``stop_wait`` for it to write what waits."""
        try:
            while True:
                try:
                    self.process = await asyncio.to_thread(self._start)
                except OSError as exc:
                    log.error("cannot start the history's writer (%s); retrying", exc)
                    await asyncio.sleep(self.restart)
                    continue
                while (code := self.process.poll()) is None:
                    await asyncio.sleep(POLL)
                self._close_stdin()
                log.error(
                    "the history's writer (pid %d) exited with %s; starting another (the "
                    "finished tasks wait in the queue Redis meanwhile)",
                    self.process.pid,
                    code,
                )
                await asyncio.sleep(self.restart)
        except asyncio.CancelledError:
            await self._stop()
            raise

    def _close_stdin(self) -> None:
        if self.process is not None and self.process.stdin is not None:
            with contextlib.suppress(OSError):  # (the writer gone: a broken pipe)
                self.process.stdin.close()

    async def _stop(self) -> None:
        process = self.process
        if process is None:
            return
        self._close_stdin()  # its EOF: write what waits, then exit
        deadline = time.monotonic() + self.stop_wait
        while process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(asyncio.CancelledError):  # (a second cancel: still wait)
                await asyncio.sleep(0.02)
        if process.poll() is None:
            log.error(
                "the history's writer did not stop within %.0f s; killed (what it had not "
                "written waits in the queue Redis for the next start)",
                self.stop_wait,
            )
            process.kill()
            process.wait()


async def _write(config: dict[str, Any]) -> None:
    """The flusher, until stdin closes or SIGTERM; then what waits is written."""
    from nimbus.service.flusher import Flusher
    from nimbus.service.history import History
    from nimbus.service.queues import TaskStore
    from nimbus.service.registry import Registry
    from nimbus.statestore import Keys, connect_async

    registry = await asyncio.to_thread(Registry, config["registry_url"])
    client = connect_async(config["redis_url"])
    try:
        history = await asyncio.to_thread(History, registry.engine)
        store = TaskStore(client, Keys(config["program_id"]), result_ttl=1)
        keep = config["keep"]
        job = asyncio.create_task(Flusher(store, history, keep).run())
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, job.cancel)

        def wait_for_eof() -> None:  # the service closed it, or died
            with contextlib.suppress(OSError):
                while sys.stdin.buffer.read(65536):
                    pass
            loop.call_soon_threadsafe(job.cancel)

        threading.Thread(target=wait_for_eof, name="nimbus-eof", daemon=True).start()
        with contextlib.suppress(asyncio.CancelledError):
            await job
    finally:
        await client.aclose()
        registry.close()


def main() -> int:
    """The writer process: its configuration is the first line of stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the service closes stdin when it stops)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    line = sys.stdin.buffer.readline()
    if not line:
        return 0  # the service stopped before it said anything
    _loop.serving_gc()
    asyncio.run(_write(json.loads(line)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
