"""This node's cache of built environments: one directory per spec hash.

::

    <environments_dir>/
        <key>/meta.json      the spec, names it was asked for by, build time, size
        <key>/last_use       its modification time is the last use (LRU eviction)
        <key>/venv/          the virtualenv, when the spec has requirements
        <key>.lock           flock'd while the entry is built: one build per node
                             (not kept by a process forked meanwhile)
        <key>.failed         a build that failed: its message, until the spec changes
        <key>.building       the spec of a build under way (while its lock is held)
        names.lock           flock'd while a name moves from one build to another
        work/<key>-<pid>-<n> the writable directory of one sandboxed worker

``meta.json`` is written last: an entry without it is half built (a build that
was killed) and is built again. A failed build is remembered in
``<key>.failed`` so that a second :func:`~nimbus.environments.prepare` fails at
once; a different spec has a different key, and ``nimbus environments build``
tries again.

A name refers to one build: building a name with another spec moves the name to
the new build (:meth:`Cache.claim`); the previous one stays, under its other names
or none, for the tasks still using it, until evicted or removed by its key. Builds
of one spec share a key: removing one of their names (:meth:`Cache.forget`) keeps
the build for the others, and removes it with the last.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nimbus.environments._spec import Environment

__all__ = ["Cache", "Entry"]

META = "meta.json"
LAST_USE = "last_use"
NAMES = "names"  # the lock taken while names move between builds (<root>/names.lock)


@dataclass(frozen=True)
class Entry:
    """One built (or failed) environment on this node, as ``nimbus environments list`` shows it."""

    key: str
    names: tuple[str, ...]
    spec: Environment | None
    state: str  # "built" or "failed"
    size: int
    last_use: float
    build_seconds: float
    message: str = ""


class Cache:
    """The environments directory of this node (``environments_dir``)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def ensure(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root

    def entry(self, key: str) -> Path:
        return self.root / key

    # -- the lock: one build of a key at a time, across threads and processes
    @contextlib.contextmanager
    def locked(self, key: str) -> Iterator[None]:
        self.ensure()
        fd = _open_lock(self.root / f"{key}.lock", os.O_RDWR | os.O_CREAT)
        mine = os.getpid()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # per open file: threads of one process too
            yield
        finally:
            _close_lock(fd, mine)  # releases the lock

    def busy(self, key: str) -> bool:
        """True while another thread or process holds ``key``'s lock (builds it)."""
        path = self.root / f"{key}.lock"
        if not path.exists():
            return False
        fd = _open_lock(path, os.O_RDWR)
        mine = os.getpid()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            _close_lock(fd, mine)
        return False

    # -- built entries
    def meta(self, key: str) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads((self.entry(key) / META).read_text())
        except (OSError, ValueError):
            return None
        return data

    def write_meta(self, key: str, meta: dict[str, Any]) -> None:
        path = self.entry(key) / META
        tmp = path.with_name(f"{META}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
        os.replace(tmp, path)

    def touch(self, key: str, name: str) -> None:
        """Record a use now (the LRU clock), and the name it was used by if that name
        refers to no other build yet (a name means one build: :meth:`claim` moves it)."""
        entry = self.entry(key)
        (entry / LAST_USE).touch()
        meta = self.meta(key)
        if meta is None or name in meta.get("names", []):
            return
        with self.locked(NAMES):
            if self.named(name) is None:
                self._rename(key, add=name)

    def named(self, name: str) -> str | None:
        """The key of the build ``name`` refers to on this node, if any."""
        for entry in self.entries():
            if entry.state == "built" and name in entry.names:
                return entry.key
        return None

    def claim(self, key: str, name: str) -> list[str]:
        """Make ``name`` refer to ``key`` alone (a build of ``name`` with another spec
        replaces what it meant). Returns the keys it referred to before; those builds
        stay (tasks may still run in them) under their other names, or none."""
        with self.locked(NAMES):
            before = [
                e.key
                for e in self.entries()
                if e.state == "built" and name in e.names and e.key != key
            ]
            for other in before:
                self._rename(other, drop=name)
            self._rename(key, add=name)
            self.unname_failures(name, but=key)
        return before

    def unname_failures(self, name: str, but: str = "") -> list[str]:
        """Failed builds of ``name`` (other than ``but``) keep their record, shown by key
        alone: ``name`` refers to its good build. Returns their keys."""
        keys = [
            e.key
            for e in self.entries()
            if e.state == "failed" and name in e.names and e.key != but
        ]
        for key in keys:
            record = self.failure(key)
            if record is not None:
                record["unnamed"] = True
                path = self.root / f"{key}.failed"
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(record, indent=1))
                os.replace(tmp, path)
        return keys

    def forget(self, name: str) -> list[tuple[str, str]]:
        """``nimbus environments remove NAME``: ``name`` no longer refers to anything here;
        a build no other name refers to any more is removed. ``name`` may be a key: that
        build goes, whatever its names. Returns ``(key, what became of it)`` per build
        touched: ``"removed"`` or ``"kept for NAMES"``."""
        out: list[tuple[str, str]] = []
        with self.locked(NAMES):
            for entry in self.entries():
                if entry.key == name:
                    self.remove(entry.key)
                    out.append((entry.key, "removed"))
                elif name in entry.names:
                    if entry.state == "failed":
                        self.forget_failure(entry.key)
                        out.append((entry.key, "removed"))
                        continue
                    left = self._rename(entry.key, drop=name)
                    if left:
                        out.append((entry.key, f"kept for {', '.join(left)}"))
                    else:
                        self.remove(entry.key)
                        out.append((entry.key, "removed"))
        return out

    def _rename(self, key: str, add: str = "", drop: str = "") -> list[str]:
        meta = self.meta(key)
        if meta is None:
            return []
        names = [n for n in meta.get("names", []) if n != drop]
        if add and add not in names:
            names.append(add)
        if names != meta.get("names", []):
            meta["names"] = names
            self.write_meta(key, meta)
        return names

    def last_use(self, key: str) -> float:
        try:
            return (self.entry(key) / LAST_USE).stat().st_mtime
        except OSError:
            return 0.0

    def fresh(self, key: str) -> Path:
        """An empty directory for ``key``'s entry (a half-built one is removed first)."""
        self.ensure()
        entry = self.entry(key)
        if entry.exists():
            shutil.rmtree(entry)
        entry.mkdir()
        return entry

    def remove(self, key: str) -> None:
        shutil.rmtree(self.entry(key), ignore_errors=True)
        self.forget_failure(key)

    @contextlib.contextmanager
    def building(self, env: Environment) -> Iterator[None]:
        """Say, while the caller (holding ``env``'s lock) builds it, that it is built."""
        path = self.root / f"{env.key}.building"
        path.write_text(json.dumps({"spec": env.to_dict(), "since": time.time()}))
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    # -- failures
    def failure(self, key: str) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads((self.root / f"{key}.failed").read_text())
        except (OSError, ValueError):
            return None
        return data

    def remember_failure(self, env: Environment, kind: str, message: str) -> None:
        self.ensure()
        path = self.root / f"{env.key}.failed"
        record = {"kind": kind, "message": message, "spec": env.to_dict(), "when": time.time()}
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)

    def forget_failure(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / f"{key}.failed").unlink()

    # -- listing and eviction
    def entries(self) -> list[Entry]:
        if not self.root.is_dir():
            return []
        out: list[Entry] = []
        for path in sorted(self.root.iterdir()):
            if path.is_dir() and (path / META).is_file():
                meta = self.meta(path.name) or {}
                out.append(
                    Entry(
                        key=path.name,
                        names=tuple(meta.get("names", [])),
                        spec=_spec(meta.get("spec")),
                        state="built",
                        size=int(meta.get("size", 0)),
                        last_use=self.last_use(path.name),
                        build_seconds=float(meta.get("build_seconds", 0.0)),
                    )
                )
            elif path.name.endswith(".failed"):
                failure = self.failure(path.name[: -len(".failed")]) or {}
                spec = _spec(failure.get("spec"))
                out.append(
                    Entry(
                        key=path.name[: -len(".failed")],
                        names=(spec.name,) if spec and not failure.get("unnamed") else (),
                        spec=spec,
                        state="failed",
                        size=0,
                        last_use=float(failure.get("when", 0.0)),
                        build_seconds=0.0,
                        message=str(failure.get("message", "")),
                    )
                )
        return out

    def report(self) -> list[dict[str, Any]]:
        """The entries as rows of scalars ``{key, name, state, size, last_use,
        build_seconds, message}`` (what a node tells its agent), with the builds under
        way here as state ``building``."""
        rows = [
            {
                "key": e.key,
                "name": ",".join(e.names) or e.key,
                "state": e.state,
                "size": e.size,
                "last_use": e.last_use,
                "build_seconds": round(e.build_seconds, 3),
                "message": e.message.splitlines()[0][:500] if e.message else "",
            }
            for e in self.entries()
        ]
        have = {row["key"] for row in rows}
        for path in sorted(self.root.glob("*.building")) if self.root.is_dir() else ():
            key = path.name[: -len(".building")]
            if key in have or not self.busy(key):
                continue  # done meanwhile, or a build that was killed
            try:
                info = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            spec = _spec(info.get("spec"))
            rows.append(
                {
                    "key": key,
                    "name": spec.name if spec else key,
                    "state": "building",
                    "size": 0,
                    "last_use": float(info.get("since", 0.0)),
                }
            )
        return rows

    def evict(self, limit: int, keep: str) -> list[str]:
        """Remove the least recently used built entries until they total ``limit`` bytes
        at most; never ``keep`` (just built) nor one being built. Returns the keys removed."""
        built = [e for e in self.entries() if e.state == "built"]
        total = sum(e.size for e in built)
        removed: list[str] = []
        for entry in sorted(built, key=lambda e: e.last_use):
            if total <= limit:
                break
            if entry.key == keep or self.busy(entry.key):
                continue
            shutil.rmtree(self.entry(entry.key), ignore_errors=True)
            total -= entry.size
            removed.append(entry.key)
        return removed


# An flock belongs to the open file, which a forked child shares: a process forked while
# a build held its lock (a worker, a Process of a task; a pip exec'ing drops it at once)
# would hold it until it exits, and a removal waiting for the build would wait for it.
# So a forked child closes its copies of the lock files open here (which does not
# unlock them: its parent's stay open). They are opened and closed under _forks, which
# a fork holds, so none is forked half registered.
_forks = threading.Lock()
_open: set[int] = set()  # this process's open lock files


def _open_lock(path: Path, flags: int) -> int:
    with _forks:
        fd = os.open(path, flags, 0o600)
        _open.add(fd)
    return fd


def _close_lock(fd: int, opened_by: int) -> None:
    if os.getpid() != opened_by:  # a fork's child that leaves the block: it closed its copy
        return  # at the fork, and the number may be another file's now
    with _forks:
        _open.discard(fd)
        os.close(fd)


def _close_in_child() -> None:
    global _forks
    for fd in _open:
        with contextlib.suppress(OSError):
            os.close(fd)
    _open.clear()
    _forks = threading.Lock()


os.register_at_fork(
    before=lambda: _forks.acquire(),
    after_in_parent=lambda: _forks.release(),
    after_in_child=_close_in_child,
)


def _spec(data: object) -> Environment | None:
    if not isinstance(data, dict):
        return None
    try:
        return Environment.from_dict(data)
    except ValueError:
        return None


def tree_size(path: Path) -> int:
    """Bytes of the files under ``path`` (each hard-linked file once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            ident = (st.st_dev, st.st_ino)
            if ident not in seen:
                seen.add(ident)
                total += st.st_blocks * 512 if st.st_blocks else st.st_size
    return total
