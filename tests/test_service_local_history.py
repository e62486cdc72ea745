"""A local Executor's records handed to the service in files: written whole, ingested
once into the SQL history, a claimed file of a dead process taken again once stale."""

from __future__ import annotations

import os
import time
from pathlib import Path

from sqlalchemy import create_engine

from nimbus import local_history as writer_side
from nimbus.config import Settings
from nimbus.records import TaskRecord, TaskState
from nimbus.service import local_history
from nimbus.service.history import History, Query
from nimbus.service.registry import Registry


def test_records_are_handed_over_in_files_and_ingested_once(tmp_path: Path) -> None:
    settings = Settings.load({"NIMBUS_RUNTIME_DIR": str(tmp_path / "rt")})
    assert not writer_side.enabled(settings)  # no service here: nothing is kept
    Registry(settings.registry_url).close()
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
