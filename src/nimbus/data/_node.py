"""A node's object store: the objects references name, as files in a private directory.

::

    <root>/<namespace>/obj/<ref id>   MAGIC | pickle length | buffer lengths | pickle | buffers
                                      (mtime = when its lease runs out)
    <root>/<namespace>/kv/<key>       one value of ``nimbus.data.store()``

``root`` is ``/dev/shm/nimbus-data-<uid>`` (memory; mode 0o700) where there is one, else a
directory of the same name under the system's temporary directory. A namespace is one
user's (see :class:`~nimbus.data.Scope`). An object is written once, to a part file
renamed into place; it is read by mapping the file, so out-of-band buffers (numpy
arrays, large bytes) are not copied on their way into the reader's pickle. Its
modification time is the end of its lease: the holder renews it, and :meth:`sweep`
removes what nobody renewed (a client that crashed does not leak its objects forever).
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

from nimbus import serialization
from nimbus.errors import ConfigError, DataError

__all__ = ["NodeStore", "default_root"]

MAGIC = b"NREF1\0\0\0"
_HEAD = struct.Struct("<QQ")  # pickle length, number of buffers
_LEN = struct.Struct("<Q")
SWEEP_EVERY = 10.0  # seconds between sweeps a writer makes
PART_AGE = 3600.0  # seconds after which a part file (a writer that died) is removed


def default_root() -> Path:
    """This user's private directory of node stores (made 0o700 on first use)."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"nimbus-data-{os.getuid()}"  # not nimbus-<uid>: multiprocessing's heaps


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ConfigError(
            f"{path} must belong to this user with mode 0o700 (it holds task data); "
            f"remove it or fix its owner and mode"
        )
    return path


def _write_all(fd: int, data: Any) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        written = os.write(fd, view)
        view = view[written:]


def _sweep(objects: Path, now: float) -> int:
    """Remove the objects in ``objects`` whose lease ran out, and part files a writer left
    (``PART_AGE`` ago); how many."""
    removed = 0
    with os.scandir(objects) as entries:
        for entry in entries:
            try:
                part = entry.name.startswith(".")
                if entry.stat().st_mtime < (now - PART_AGE if part else now):
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:
                pass
    return removed


class NodeStore:
    """The objects of one namespace on this node."""

    def __init__(self, namespace: str, root: Path | None = None) -> None:
        if not namespace or "/" in namespace or namespace.startswith("."):
            raise ConfigError(f"a data namespace is a plain name, not {namespace!r}")
        self.namespace = namespace
        top = _private_dir(root if root is not None else default_root())
        self.dir = top / namespace
        self.objects = self.dir / "obj"
        self.objects.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._swept = 0.0

    def path(self, ref_id: str) -> Path:
        if not ref_id.isalnum():
            raise DataError(f"{ref_id!r} is not a reference id")
        return self.objects / ref_id

    def write(self, ref_id: str, obj: object, expires: float) -> int:
        """Store ``obj`` under ``ref_id`` until ``expires`` (a time); its size in bytes."""
        data, buffers = serialization.dumps(obj)
        views = [b.raw() for b in buffers]
        head = MAGIC + _HEAD.pack(len(data), len(views))
        head += b"".join(_LEN.pack(v.nbytes) for v in views)
        final = self.path(ref_id)
        part = self.objects / f".{ref_id}.part"
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, head)
            _write_all(fd, data)
            for view in views:
                _write_all(fd, view)
        finally:
            os.close(fd)
        os.utime(part, (expires, expires))
        os.rename(part, final)
        self.maybe_sweep()
        return len(head) + len(data) + sum(v.nbytes for v in views)

    def read(self, ref_id: str) -> Any:
        """The object stored under ``ref_id``; FileNotFoundError when it is not here."""
        fd = os.open(self.path(ref_id), os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        finally:
            os.close(fd)
        if mapped is None or mapped[: len(MAGIC)] != MAGIC:
            raise DataError(f"the stored object {ref_id} is damaged (no header); make it again")
        view = memoryview(mapped)
        at = len(MAGIC)
        length, count = _HEAD.unpack_from(view, at)
        at += _HEAD.size
        sizes = [_LEN.unpack_from(view, at + i * _LEN.size)[0] for i in range(count)]
        at += count * _LEN.size
        data = view[at : at + length]
        at += length
        buffers = []
        for n in sizes:
            buffers.append(view[at : at + n])
            at += n
        return serialization.loads(data, buffers)

    def exists(self, ref_id: str) -> bool:
        return self.path(ref_id).exists()

    def free(self, ref_ids: list[str]) -> int:
        """Remove these objects; how many were here."""
        freed = 0
        for ref_id in ref_ids:
            try:
                self.path(ref_id).unlink()
                freed += 1
            except FileNotFoundError:
                pass
        return freed

    def renew(self, ref_ids: list[str], expires: float) -> list[str]:
        """Move these objects' leases to ``expires``; the ids of those not here (lost)."""
        lost = []
        for ref_id in ref_ids:
            try:
                os.utime(self.path(ref_id), (expires, expires))
            except FileNotFoundError:
                lost.append(ref_id)
        return lost

    def sweep(self, now: float | None = None) -> int:
        """Remove the objects whose lease ran out (and part files left a lease ago)."""
        now = time.time() if now is None else now
        self._swept = now
        return _sweep(self.objects, now)

    def maybe_sweep(self) -> None:
        """Every ``SWEEP_EVERY`` s at most: sweep every namespace of this node (a user who
        never comes back leaves nothing behind once the leases ran out)."""
        if time.time() - self._swept > SWEEP_EVERY:
            self._swept = time.time()
            for entry in os.scandir(self.dir.parent):
                objects = Path(entry.path) / "obj"
                if entry.is_dir(follow_symlinks=False) and objects.is_dir():
                    try:
                        _sweep(objects, time.time())
                    except OSError:
                        pass

    def statistics(self) -> dict[str, int]:
        """``objects`` held here and their ``bytes``."""
        count = size = 0
        with os.scandir(self.objects) as entries:
            for entry in entries:
                if not entry.name.startswith("."):
                    count += 1
                    size += entry.stat().st_size
        return {"objects": count, "bytes": size}
