"""The history's writer process (``nimbus.service.history_writer``): it writes the tasks
that end to the SQL history (SQLite and a real PostgreSQL) from a real Redis with the
real queue scripts, everything waiting as the service stops; it ends when its service
dies, whatever killed it (no orphan), after writing what waited; one that dies is
replaced and nothing it had taken is lost."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from nimbus.service.history import History
from nimbus.service.history_writer import Writer, separate
from nimbus.service.queues import TaskStore
from nimbus.service.registry import Registry
from test_service_history import _finished, _task_store
from test_service_postgres import postgres  # noqa: F401  (the fixture)

# a service's stand-in: its writer, its pid on stdout, until killed
STAND_IN = """
import asyncio, sys
from nimbus.service.history_writer import Writer

async def main():
    writer = Writer(sys.argv[1], sys.argv[2], sys.argv[3], None)
    job = asyncio.create_task(writer.run())
    while writer.process is None:
        await asyncio.sleep(0.01)
    print(writer.process.pid, flush=True)
    await job

asyncio.run(main())
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"  # (exited, not yet reaped by its new parent)


async def _until(condition: Callable[[], bool], seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within the time allowed"
        await asyncio.sleep(0.05)


def _with_store(
    registry_url: str,
    store_url: str,
    scenario: Callable[[History, TaskStore], Awaitable[None]],
) -> None:
    """Run ``scenario`` on the history of the registry at ``registry_url`` and a task store
    in the Redis at ``store_url``."""

    async def run(history: History) -> None:
        async with _task_store(store_url, history) as store:
            await scenario(history, store)

    registry = Registry(registry_url)
    try:
        asyncio.run(run(History(registry.engine)))
    finally:
        registry.close()


@contextlib.asynccontextmanager
async def _service_writer(
    registry_url: str, store_url: str, store: TaskStore, restart: float | None = None
) -> AsyncIterator[Writer]:
    """The writer as a service runs it (``Writer.run`` a job of its loop, ``restart``: its
    pause before replacing a writer that died), cancelled, as the service stops, at the end."""
    writer = Writer(registry_url, store_url, store.keys.program_id, None)
    if restart is not None:
        writer.restart = restart
    job = asyncio.create_task(writer.run())
    try:
        yield writer
    finally:
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'registry.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def registry_url(request: pytest.FixtureRequest) -> str:
    if request.param == "sqlite":
        url: str = request.getfixturevalue("sqlite_url")
        return url
    url = request.getfixturevalue("postgres").url
    registry = Registry(url)
    with registry.engine.begin() as connection:
        connection.exec_driver_sql("DROP TABLE IF EXISTS task_history")
    registry.close()
    return url


def test_the_writer_process_writes_what_ends_and_all_that_waits_as_the_service_stops(
    store_url: str, registry_url: str
) -> None:
    async def scenario(history: History, store: TaskStore) -> None:
        async with _service_writer(registry_url, store_url, store) as writer:
            first = await _finished(store, "alice", "ep", 5)
            await _until(lambda: set(history.info(first)) == set(first))
            assert writer.process is not None and writer.process.pid != os.getpid()
            last = await _finished(store, "alice", "ep", 200)
        assert writer.process.poll() == 0  # it stopped, and stopped well
        assert set(history.info(last)) == set(last)  # what waited was written first
        assert await store.redis.xlen(store.finished) == 0
        assert writer.started == 1

    _with_store(registry_url, store_url, scenario)


def test_the_writer_ends_when_its_service_is_killed_after_writing_what_waited(
    store_url: str, sqlite_url: str
) -> None:
    async def scenario(history: History, store: TaskStore) -> None:
        service = subprocess.Popen(
            [sys.executable, "-c", STAND_IN, sqlite_url, store_url, store.keys.program_id],
            stdout=subprocess.PIPE,
        )
        try:
            assert service.stdout is not None
            pid = int(await asyncio.to_thread(service.stdout.readline))
            ids = await _finished(store, "bob", "ep", 20)
            service.send_signal(signal.SIGKILL)  # no goodbye: its writer sees stdin close
            await asyncio.to_thread(service.wait)
            await _until(lambda: _gone(pid))
            assert set(history.info(ids)) == set(ids)
        finally:
            service.kill()
            service.wait()
            assert service.stdout is not None
            service.stdout.close()

    _with_store(sqlite_url, store_url, scenario)


def test_a_writer_that_dies_is_replaced_and_what_it_took_is_written_by_the_next(
    store_url: str, sqlite_url: str
) -> None:
    async def scenario(history: History, store: TaskStore) -> None:
        async with _service_writer(sqlite_url, store_url, store, restart=0.1) as writer:
            await _until(lambda: writer.process is not None)
            assert writer.process is not None
            first = writer.process
            first.send_signal(signal.SIGKILL)
            ids = await _finished(store, "carol", "ep", 10)  # while no writer runs
            await _until(lambda: writer.process is not first and writer.started == 2)
            await _until(lambda: set(history.info(ids)) == set(ids))
            assert first.poll() == -signal.SIGKILL
        assert writer.process is not None and writer.process.poll() == 0

    _with_store(sqlite_url, store_url, scenario)


def test_a_module_in_the_services_directory_does_not_shadow_the_writers_imports(
    store_url: str, sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 7: the writer ran as ``python -m`` in the service's directory, so a project's
    own ``msgpack.py`` there killed every writer at import, for ever, and no history was
    written."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "msgpack.py").write_text("raise ImportError('the project's own msgpack.py')\n")
    monkeypatch.chdir(project)

    async def scenario(history: History, store: TaskStore) -> None:
        async with _service_writer(sqlite_url, store_url, store, restart=0.1) as writer:
            ids = await _finished(store, "dave", "ep", 5)
            await _until(lambda: set(history.info(ids)) == set(ids), 30)
            assert writer.started == 1

    _with_store(sqlite_url, store_url, scenario)


def test_an_in_memory_registry_is_written_by_the_services_own_process() -> None:
    assert not separate("sqlite://")
    assert not separate("sqlite:///:memory:")
    assert separate("sqlite:////var/lib/nimbus/registry.db")
    assert separate("postgresql://nimbus@db/nimbus")
