"""Shared files for a program's processes: ``open`` and ``os`` over nimbus storage.

As in the Lithops paper, processes that run elsewhere read and write shared
files through these instead of the local file system::

    from nimbus.multiprocessing.files import open, os

    with open("out/part-1.txt", "w") as f:      # in a child
        f.write(text)
    os.listdir("out"); os.path.getsize("out/part-1.txt")  # in the parent

Paths are relative to the program's storage: ``NIMBUS_STORAGE_DIR`` (a
directory path or a URL of a registered store, see ``nimbus.storage``),
``<runtime_dir>/files`` by default.
"""

from __future__ import annotations

import functools
import posixpath
import types
from collections.abc import Iterator
from typing import IO, Any

from nimbus.config import Settings
from nimbus.storage import Entry, Storage, normalize, open_storage

__all__ = ["open", "os", "storage"]


@functools.cache
def storage() -> Storage:
    """This program's storage (from the settings of this process)."""
    return open_storage(Settings.load().files_dir)


def open(file: str, mode: str = "r", **kwargs: Any) -> IO[Any]:
    """``open()`` a file of the program's storage."""
    return storage().open(normalize(file), mode, **kwargs)


def _entry(path: str) -> Entry | None:
    rel = normalize(path)
    if not rel:
        return Entry("", 0, True)
    parent, name = posixpath.split(rel)
    try:
        listing = storage().list(parent)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return next((e for e in listing if e.name == name), None)


def _stat(path: str) -> Entry:
    entry = _entry(path)
    if entry is None:
        raise FileNotFoundError(2, "No such file or directory", path)
    return entry


def exists(path: str) -> bool:
    return _entry(path) is not None


def isfile(path: str) -> bool:
    entry = _entry(path)
    return entry is not None and not entry.is_dir


def isdir(path: str) -> bool:
    entry = _entry(path)
    return entry is not None and entry.is_dir


def getsize(path: str) -> int:
    return _stat(path).size


def listdir(path: str = "") -> list[str]:
    return [entry.name for entry in storage().list(normalize(path))]


def remove(path: str) -> None:
    storage().remove(normalize(path))


def makedirs(path: str, exist_ok: bool = False) -> None:
    """Create a directory (a no-op for stores without directories)."""
    make = getattr(storage(), "makedirs", None)
    if make is not None:
        make(normalize(path), exist_ok=exist_ok)


def walk(top: str = "") -> Iterator[tuple[str, list[str], list[str]]]:
    """Like ``os.walk``, top-down."""
    entries = storage().list(normalize(top))
    dirs = [e.name for e in entries if e.is_dir]
    yield top, dirs, [e.name for e in entries if not e.is_dir]
    for name in dirs:
        yield from walk(posixpath.join(top, name))


os = types.SimpleNamespace(
    listdir=listdir,
    remove=remove,
    unlink=remove,
    makedirs=makedirs,
    walk=walk,
    sep="/",
    path=types.SimpleNamespace(
        exists=exists,
        isfile=isfile,
        isdir=isdir,
        getsize=getsize,
        join=posixpath.join,
        basename=posixpath.basename,
        dirname=posixpath.dirname,
        split=posixpath.split,
        splitext=posixpath.splitext,
        normpath=posixpath.normpath,
    ),
)
