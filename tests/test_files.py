"""Shared files: nimbus.storage and nimbus.multiprocessing.files, with real processes."""

from __future__ import annotations

import pytest

import nimbus.multiprocessing as mp
from nimbus.errors import ConfigError
from nimbus.multiprocessing import files
from nimbus.storage import LocalStorage, normalize, open_storage


@pytest.fixture
def shared(tmp_path, monkeypatch):
    monkeypatch.setenv("NIMBUS_STORAGE_DIR", str(tmp_path / "store"))
    files.storage.cache_clear()
    yield tmp_path / "store"
    files.storage.cache_clear()


def write_part(i: int) -> None:
    with files.open(f"out/part-{i}.txt", "w") as f:
        f.write(str(i) * (i + 1))


def test_normalize_keeps_paths_inside_the_root() -> None:
    assert normalize("a/b/../c") == "a/c"
    assert normalize("/x/y") == "x/y"
    assert normalize("") == ""
    for bad in ("..", "../x", "a/../../x"):
        with pytest.raises(ValueError, match="leaves the storage root"):
            normalize(bad)


def test_local_storage_open_list_remove(tmp_path) -> None:
    store = LocalStorage(tmp_path)
    with store.open("d/f.bin", "wb") as f:
        f.write(b"12345")
    assert [e.name for e in store.list("")] == ["d"]
    assert store.list("d")[0].size == 5
    store.remove("d/f.bin")
    assert store.list("d") == []
    with pytest.raises(FileNotFoundError):
        store.open("missing.txt")


def test_unknown_scheme_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="s3"):
        open_storage("s3://bucket/x")


@pytest.mark.timeout(60)
def test_processes_write_files_the_parent_reads(shared) -> None:
    procs = [mp.Process(target=write_part, args=(i,)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert sorted(files.os.listdir("out")) == [f"part-{i}.txt" for i in range(4)]
    assert files.os.path.getsize("out/part-3.txt") == 4
    assert files.os.path.isdir("out") and files.os.path.isfile("out/part-0.txt")
    assert not files.os.path.exists("out/nope")
    with files.open("out/part-2.txt") as f:
        assert f.read() == "222"
    files.os.remove("out/part-2.txt")
    assert len(files.os.listdir("out")) == 3
    assert (shared / "out" / "part-1.txt").read_text() == "11"
    walked = list(files.os.walk(""))
    assert walked[0][1] == ["out"] and len(walked[1][2]) == 3
    with pytest.raises(FileNotFoundError):
        files.os.path.getsize("out/nope")
