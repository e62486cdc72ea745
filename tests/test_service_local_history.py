"""A local Executor's records handed to the service in files: written whole, ingested
once into the SQL history, a claimed file of a dead process taken again once stale."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from nimbus import _service_state
from nimbus import local_history as writer_side
from nimbus.config import Settings
from nimbus.records import TaskRecord, TaskState
from nimbus.service import local_history
from nimbus.service.history import History, Query
from nimbus.service.registry import Registry

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _running_here(settings: Settings, pid: int | None = None) -> None:
    """The state file of a service running on ``settings``' runtime directory (as
    ``nimbus.service.server`` writes it), its process ``pid`` (this one by default)."""
    settings.service_dir.mkdir(parents=True, exist_ok=True)
    pid = pid or os.getpid()
    state = {"url": "http://127.0.0.1:1", "pid": pid, "started": _service_state.start_time(pid)}
    (settings.service_dir / _service_state.STATE_FILE).write_text(json.dumps(state))


def test_records_are_handed_over_in_files_and_ingested_once(tmp_path: Path) -> None:
    settings = Settings.load({"NIMBUS_RUNTIME_DIR": str(tmp_path / "rt")})
    assert not writer_side.enabled(settings)  # no service here: nothing is kept
    Registry(settings.registry_url).close()
    assert not writer_side.enabled(settings)  # one ran here once: not enough
    _running_here(settings)
    assert writer_side.enabled(settings)
    writer = writer_side.LocalHistory(settings)
    for i in range(30):
        writer.add(TaskRecord(f"task-{i}", TaskState.SUCCESS, "shout", submitted=1000.0 + i))
    writer.close()
    folder = writer_side.directory(settings)
    [handed] = list(folder.iterdir())  # one file, whole (no partial name left)
    engine = create_engine(settings.registry_url)
    history = History(engine)
    try:
        fresh = folder / "1.0-1-x.msgpack.taken-aaaa"  # another process is ingesting it
        fresh.write_bytes(handed.read_bytes())
        assert local_history.ingest(settings, history) == 30
        assert local_history.ingest(settings, history) == 0
        assert [p.name for p in folder.iterdir()] == [fresh.name]
        rows, _ = history.page(Query(None, endpoint=writer_side.ENDPOINT), None, 100)
        assert [row[0] for row in rows] == [f"task-{i}" for i in reversed(range(30))]
        old = time.time() - local_history.STALE - 1  # that process died: taken again
        os.utime(fresh, (old, old))
        assert local_history.ingest(settings, history) == 30
        assert history.count() == 30 and not list(folder.iterdir())
    finally:
        engine.dispose()


def test_a_file_naming_an_owner_not_local_is_removed_unread(tmp_path: Path) -> None:
    """The files give local tasks only: one that names a service user's owner (anyone who
    can write the folder) adds nothing to that user's history."""
    import msgpack

    settings = Settings.load({"NIMBUS_RUNTIME_DIR": str(tmp_path / "rt")})
    Registry(settings.registry_url).close()
    folder = writer_side.directory(settings)
    folder.mkdir(parents=True, exist_ok=True)
    record = TaskRecord("forged", TaskState.SUCCESS, "shout", submitted=1000.0)
    (folder / "1.0-1-x.msgpack").write_bytes(msgpack.packb(["alice", [record.to_wire()]]))
    engine = create_engine(settings.registry_url)
    try:
        history = History(engine)
        assert local_history.ingest(settings, history) == 0
        assert history.count() == 0 and not list(folder.iterdir())
    finally:
        engine.dispose()


_POOL = """\
import sys, time
import nimbus.multiprocessing as mp

def f(x):
    return x

if __name__ == "__main__":
    with mp.Pool(2) as pool:
        for _ in range(3):
            assert pool.map(f, range(200), chunksize=1) == list(range(200))
"""


def _run(tmp_path: Path, program: str) -> subprocess.CompletedProcess[str]:
    """``program`` run as a script in a process of its own, on runtime ``tmp_path/rt``."""
    script = tmp_path / "program.py"
    script.write_text(program)
    env = os.environ | {"NIMBUS_RUNTIME_DIR": str(tmp_path / "rt"), "PYTHONPATH": SRC}
    env.pop("NIMBUS_REDIS_URL", None)
    return subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )


def test_no_file_is_written_while_no_service_runs(tmp_path: Path) -> None:
    """review6 #5: once a service had run on a runtime directory (its registry stays),
    every program wrote its records in files that nobody read, for ever."""
    settings = Settings.load({"NIMBUS_RUNTIME_DIR": str(tmp_path / "rt")})
    Registry(settings.registry_url).close()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _running_here(settings, gone.pid)  # a service that died without removing its file
    done = _run(tmp_path, _POOL)
    assert done.returncode == 0, done.stderr
    folder = writer_side.directory(settings)
    assert not folder.exists() or not list(folder.iterdir())
    _running_here(settings)  # and the same program while one runs: kept
    done = _run(tmp_path, _POOL)
    assert done.returncode == 0, done.stderr
    assert list(folder.iterdir())


def test_a_writer_stops_writing_once_its_service_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_side, "LOOK_EVERY", 0.2)
    settings = Settings.load({"NIMBUS_RUNTIME_DIR": str(tmp_path / "rt")})
    service = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _running_here(settings, service.pid)
        writer = writer_side.LocalHistory(settings)
        writer.add(TaskRecord("before", TaskState.SUCCESS, "shout", submitted=1000.0))
        writer.hand_over_now()
        folder = writer_side.directory(settings)
        assert len(list(folder.iterdir())) == 1
    finally:
        service.kill()
        service.wait()
    time.sleep(0.3)
    for i in range(3):
        writer.add(TaskRecord(f"after-{i}", TaskState.SUCCESS, "shout", submitted=1001.0))
        writer.hand_over_now()
    writer.close()
    assert len(list(folder.iterdir())) == 1  # dropped: nobody would read them


def test_files_beyond_the_bound_are_dropped_oldest_first_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import msgpack

    monkeypatch.setattr(local_history, "KEEP_BYTES", 3000)
    settings = Settings.load({"NIMBUS_RUNTIME_DIR": str(tmp_path / "rt")})
    folder = writer_side.directory(settings)
    folder.mkdir(parents=True)
    for i in range(10):  # ~1 kB each, oldest first by name (time-pid-random)
        records = [
            TaskRecord(f"t{i}-{j}", TaskState.SUCCESS, "x" * 80, submitted=1000.0 + i).to_wire()
            for j in range(10)
        ]
        (folder / f"{1000 + i}.000000-1-x.msgpack").write_bytes(
            msgpack.packb(["local:me", records])
        )
    size = (folder / "1000.000000-1-x.msgpack").stat().st_size
    kept = 3000 // size
    engine = create_engine(settings.registry_url)
    try:
        history = History(engine)
        with caplog.at_level("WARNING", logger=local_history.__name__):
            assert local_history.ingest(settings, history) == 10 * kept
        said = [r for r in caplog.records if "dropped unread" in r.getMessage()]
        assert len(said) == 1, caplog.text
        rows, _ = history.page(Query(None, endpoint=writer_side.ENDPOINT), None, 1000)
        assert {row[0].split("-")[0] for row in rows} == {f"t{i}" for i in range(10 - kept, 10)}
    finally:
        engine.dispose()


def test_a_state_file_left_by_a_killed_service_is_no_service_once_its_pid_is_reused(
    tmp_path: Path,
) -> None:
    """Review 7 #7: a service killed without removing its state file (SIGKILL, the OOM
    killer) left it naming a pid; once any process had that pid, programs wrote history
    files again that nobody read. The pid's start time is in the file now and must agree;
    and programs and the CLI read it with the one reader (they disagreed)."""
    from nimbus.service import running

    settings = Settings.load({"NIMBUS_RUNTIME_DIR": str(tmp_path / "rt")})
    settings.service_dir.mkdir(parents=True)
    state_file = settings.service_dir / _service_state.STATE_FILE
    for stale in (
        {"url": "http://127.0.0.1:1", "pid": 1},  # (as an older service wrote it)
        {"url": "http://127.0.0.1:1", "pid": os.getpid(), "started": "1"},  # a reused pid
    ):
        state_file.write_text(json.dumps(stale))
        assert writer_side.service_state(settings) is None
        assert not writer_side.enabled(settings)
        assert running.running_service(settings) is None
    state_file.write_text(_service_state.text("http://127.0.0.1:2"))  # as the service does
    assert running.running_service(settings) == "http://127.0.0.1:2"
    assert writer_side.enabled(settings)


def test_a_program_writes_no_file_while_the_service_is_the_bound_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 7 #7: the bound on the files waiting was kept only by a running service's
    ingest; programs now write none while the folder holds KEEP_BYTES already."""
    monkeypatch.setattr(writer_side, "KEEP_BYTES", 1000)
    settings = Settings.load({"NIMBUS_RUNTIME_DIR": str(tmp_path / "rt")})
    _running_here(settings)
    folder = writer_side.directory(settings)
    folder.mkdir(parents=True)
    (folder / "1000.000000-1-x.msgpack").write_bytes(b"x" * 1000)  # not taken yet
    writer = writer_side.LocalHistory(settings)
    writer.add(TaskRecord("t", TaskState.SUCCESS, "shout", submitted=1000.0))
    writer.close()
    assert [p.name for p in folder.iterdir()] == ["1000.000000-1-x.msgpack"]
    (folder / "1000.000000-1-x.msgpack").unlink()  # taken: the next look writes again
    writer = writer_side.LocalHistory(settings)
    writer.add(TaskRecord("t", TaskState.SUCCESS, "shout", submitted=1000.0))
    writer.close()
    assert len(list(folder.iterdir())) == 1


def test_programs_look_for_the_state_file_the_service_writes(tmp_path: Path) -> None:
    from nimbus.service import running

    settings = Settings.load({"NIMBUS_RUNTIME_DIR": str(tmp_path / "rt")})
    _running_here(settings)
    state = writer_side.service_state(settings)
    assert state is not None and running.running_service(settings) == state["url"]


_INTERRUPTED = """\
import os, signal, sys
from nimbus import local_history
from nimbus.multiprocessing import pool
from nimbus.records import TaskRecord, TaskState

class Interrupting(TaskRecord):
    def to_wire(self):  # the pool's SIGTERM comes as its worker hands over at its end
        os.kill(os.getpid(), signal.SIGTERM)
        return super().to_wire()

signal.signal(signal.SIGTERM, pool._terminated)  # a pool worker's handler (_worker)
local_history.keep(TaskRecord("first", TaskState.SUCCESS, "square", submitted=1000.0))
local_history.keep(Interrupting("second", TaskState.SUCCESS, "square", submitted=1001.0))
local_history.keep(TaskRecord("third", TaskState.SUCCESS, "_worker", submitted=1002.0))
local_history.ended()  # _child.run, before os._exit
sys.exit(0)  # not reached: the SIGTERM's default action once the hand-over is done
"""


def test_a_pool_workers_sigterm_during_its_last_hand_over_loses_no_record(
    tmp_path: Path,
) -> None:
    """CI (test_cli_dashboard, under load): a pool worker that got the pool's sentinel
    handed its records over at its end (``ended()``) as ``Pool.terminate``'s SIGTERM came;
    the handler's own ``ended()`` waited WRITE_WAIT s for the lock its thread held, then
    the process ended by the signal with the records that hand-over had taken off the
    queue: no Pool task on the tasks page. Now the interrupted hand-over finishes first,
    then the process ends by the SIGTERM, at once."""
    import msgpack

    settings = Settings.load({"NIMBUS_RUNTIME_DIR": str(tmp_path / "rt")})
    _running_here(settings)
    done = _run(tmp_path, _INTERRUPTED)
    assert done.returncode == -signal.SIGTERM, done.stderr
    folder = writer_side.directory(settings)
    handed = [msgpack.unpackb(path.read_bytes()) for path in sorted(folder.iterdir())]
    assert [fields[0] for _, wire in handed for fields in wire] == ["first", "second", "third"]
