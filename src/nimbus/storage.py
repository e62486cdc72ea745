"""Storage for files that a program's processes share, wherever they run.

A :class:`Storage` needs three methods: ``open`` a file by its path (any
``open()`` mode), ``list`` a directory (names with size and kind) and
``remove`` a file. Everything else (``exists``, ``getsize``, ``walk`` ...) is
built on these in ``nimbus.multiprocessing.files``. :class:`LocalStorage`, a
directory of this machine, is the default; other stores (an object store, a
shared file system) register a factory in :data:`STORAGES` by URL scheme.

Paths are POSIX-style and relative to the storage's root: ``"out/part-1.txt"``.
A path that would leave the root (``../x``) raises ``ValueError``.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, NamedTuple, Protocol
from urllib.parse import urlparse

from nimbus.errors import ConfigError

__all__ = ["STORAGES", "Entry", "LocalStorage", "Storage", "open_storage"]


class Entry(NamedTuple):
    """One item of a directory listing."""

    name: str
    size: int
    is_dir: bool


class Storage(Protocol):
    """Where shared files live."""

    def open(self, path: str, mode: str = "r", **kwargs: Any) -> IO[Any]: ...

    def list(self, path: str) -> list[Entry]: ...

    def remove(self, path: str) -> None: ...


def normalize(path: str | os.PathLike[str]) -> str:
    """``path`` relative to the storage root (``/a`` is ``a``); ``ValueError`` if it leaves it."""
    text = os.fspath(path).replace("\\", "/").lstrip("/")
    norm = posixpath.normpath(text) if text else "."
    if norm == ".." or norm.startswith("../"):
        raise ValueError(f"path {os.fspath(path)!r} leaves the storage root")
    return "" if norm == "." else norm


class LocalStorage:
    """A directory of this machine (processes of one host share it)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()
        self.root.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    def _real(self, path: str | os.PathLike[str]) -> Path:
        return self.root / normalize(path)

    def open(self, path: str, mode: str = "r", **kwargs: Any) -> IO[Any]:
        real = self._real(path)
        if any(flag in mode for flag in "wax+"):
            real.parent.mkdir(parents=True, exist_ok=True)
        return open(real, mode, **kwargs)

    def list(self, path: str) -> list[Entry]:
        entries = []
        with os.scandir(self._real(path)) as scan:
            for item in scan:
                is_dir = item.is_dir()
                entries.append(Entry(item.name, 0 if is_dir else item.stat().st_size, is_dir))
        return sorted(entries)

    def remove(self, path: str) -> None:
        real = self._real(path)
        if real.is_dir():
            real.rmdir()
        else:
            real.unlink()

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Optional: stores without directories need not have it."""
        self._real(path).mkdir(parents=True, exist_ok=exist_ok)


def _file(url: str) -> Storage:
    parsed = urlparse(url)
    return LocalStorage(parsed.path if parsed.scheme else url)


STORAGES: dict[str, Callable[[str], Storage]] = {"": _file, "file": _file}


def open_storage(url: str | os.PathLike[str]) -> Storage:
    """The storage at ``url``: a directory path or ``file://`` URL, or a registered scheme."""
    text = os.fspath(url)
    scheme = urlparse(text).scheme
    factory = STORAGES.get(scheme)
    if factory is None:
        known = ", ".join(sorted(s for s in STORAGES if s)) or "none"
        raise ConfigError(
            f"no storage for {text!r}: scheme {scheme!r} is not registered (known: {known}); "
            "register a factory in nimbus.storage.STORAGES"
        )
    return factory(text)
