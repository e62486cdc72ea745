"""A node's object store: the objects references name, as files in a private directory.

::

    <base>/<runtime>/<namespace>/obj/<ref id>   MAGIC | pickle length | buffer lengths |
                                                pickle | buffers (mtime = end of its lease)
    <base>/<runtime>/<namespace>/kv/<key>       one value of ``nimbus.data.store()``
    <base>/<runtime>/<namespace>/files/         the node's file cache (mtime = last use;
                                                kept while an object <key><id> is leased)
    <base>/<runtime>/.holders/<pid>-<start>-<n>.<pid namespace>
                                                a process using this runtime's data

``base`` is ``/dev/shm/nimbus-data-<uid>`` (memory; mode 0o700) where there is one, else a
directory of the same name under the system's temporary directory. ``runtime`` is
``r`` + a hash of the runtime directory (``NIMBUS_RUNTIME_DIR``, see :func:`default_root`,
the one place that names it): two runtimes never see each other's objects or keys,
and a runtime's workers, which inherit its environment, find the same directory. A
namespace is one user's (see :class:`~nimbus.data.Scope`). An object is written once,
to a part file renamed into place; it is read by mapping the file, so out-of-band
buffers (numpy arrays, large bytes) are not copied on their way into the reader's
pickle. Its modification time is the end of its lease: the holder renews it, and
:meth:`sweep` removes what nobody renewed (a client that crashed does not leak its
objects forever).

Who cleans up: every agent (an embedded runtime's, an endpoint's) holds its runtime's
directory (:func:`hold`) and sweeps the whole ``base`` at start and every
``SWEEP_EVERY`` s (:func:`sweep_all`: expired objects, file copies unused for a lease,
the directories of runtimes whose processes all died once nothing in them is leased);
when the last process holding a runtime's directory releases it (the runtime stops),
the directory is removed. A holder is judged alive or dead only by a process of its pid
namespace (:func:`alive`): one in a namespace of its own that shares ``/dev/shm`` (a
container, a sandbox) sees other pids.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import logging
import mmap
import os
import shutil
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from nimbus import serialization
from nimbus.errors import ConfigError, DataError

__all__ = ["NodeStore", "Sweeper", "data_base", "default_root", "hold", "release", "sweep_all"]

MAGIC = b"NREF1\0\0\0"
SECRET = b"NPIN1\0\0\0"  # a pin's file: this, then its secret (hex), nothing pickled
_HEAD = struct.Struct("<QQ")  # pickle length, number of buffers
_LEN = struct.Struct("<Q")
SWEEP_EVERY = 10.0  # seconds between sweeps a writer makes
PART_AGE = 3600.0  # seconds after which a part file (a writer that died) is removed
UNUSED = 300.0  # seconds after which a file copy nobody used is removed (a lease)
HOLDERS = ".holders"


def data_base() -> Path:
    """This user's private directory of the node stores of all their runtimes."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"nimbus-data-{os.getuid()}"  # not nimbus-<uid>: multiprocessing's heaps


def _runtime_dir() -> Path:
    from nimbus.config import Settings
    from nimbus.errors import ConfigError

    try:
        return Settings.load().runtime_dir
    except ConfigError:  # a broken config fails where it is used (the runtime), not here
        return Path(tempfile.gettempdir()) / f"nimbus-{os.getuid()}"


_roots: dict[tuple[str | None, ...], Path] = {}


def default_root(runtime_dir: Path | str | None = None) -> Path:
    """The data directory of the runtime of ``runtime_dir`` (default: this process's,
    ``Settings.load().runtime_dir``, i.e. ``NIMBUS_RUNTIME_DIR``).

    The one function that names it: the client, the agent and the workers (which
    inherit the agent's environment) agree on it.
    """
    if runtime_dir is None:
        key = tuple(
            os.environ.get(k)
            for k in ("NIMBUS_RUNTIME_DIR", "XDG_RUNTIME_DIR", "NIMBUS_CONFIG", "XDG_CONFIG_HOME")
        )
        found = _roots.get(key)
        if found is None:
            found = _roots[key] = default_root(_runtime_dir())
        return found
    text = os.path.abspath(os.path.expanduser(os.fspath(runtime_dir)))
    return data_base() / ("r" + hashlib.sha256(text.encode()).hexdigest()[:16])


# ---------------------------------------------------------------- holding a runtime's data


def start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"


def pid_namespace() -> str:
    """This process's pid namespace ('' where ``/proc`` does not say)."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def alive(pid: str, start: str, namespace: str = "") -> bool:
    """Whether process ``pid``, started at ``start`` (:func:`start_time`) in the pid
    namespace ``namespace`` ('': unknown, a mark of before), may still run. One of
    another namespace counts as alive: its pids are not the ones seen here (its own
    namespace's processes judge it), where taking it for dead removed the marks and
    server files of live agents (the runtime's data went with the next release)."""
    if namespace and namespace != pid_namespace():
        return True
    return pid.isdigit() and start_time(int(pid)) in (start, "?")


_held = itertools.count()


def hold(root: Path | None = None) -> Path:
    """Mark ``root`` (default: this runtime's data directory) in use by this process
    until :func:`release`; the mark (removed by release, ignored once this process died)."""
    root = default_root() if root is None else root
    holders = _private_dir(root) / HOLDERS
    holders.mkdir(mode=0o700, exist_ok=True)
    pid = os.getpid()  # (the namespace after the count: "<pid>-<start>-" as before)
    mark = holders / f"{pid}-{start_time(pid)}-{next(_held)}.{pid_namespace()}"
    mark.touch()
    return mark


def _live_holders(root: Path) -> int:
    live = 0
    try:
        names = os.listdir(root / HOLDERS)
    except FileNotFoundError:
        return 0
    for name in names:
        pid, _, rest = name.partition("-")
        start, _, count = rest.rpartition("-")
        if alive(pid, start, count.partition(".")[2]):
            live += 1
        else:
            try:
                os.unlink(root / HOLDERS / name)  # its process died
            except FileNotFoundError:
                pass
    return live


def release(mark: Path) -> bool:
    """Drop the mark :func:`hold` made; when no live process holds its runtime's
    directory any more, remove the directory (objects, keys, file copies). Whether it did."""
    try:
        mark.unlink()
    except FileNotFoundError:
        pass
    root = mark.parent.parent
    if _live_holders(root):
        return False
    shutil.rmtree(root, ignore_errors=True)
    return True


def _idle(top: Path, now: float) -> bool:
    """Nothing in ``top`` leased (objects) or used within ``UNUSED`` s (anything else)."""
    for path, _, names in os.walk(top):
        leased = os.path.basename(path) == "obj"
        for name in names:
            try:
                mtime = os.lstat(os.path.join(path, name)).st_mtime
            except FileNotFoundError:
                continue
            if mtime >= (now if leased and not name.startswith(".") else now - UNUSED):
                return False
    return True


def pinned(objects: Path, now: float) -> set[str]:
    """The cache keys whose file copies are pinned: a leased object of ``objects`` named
    ``<key><id>`` (64 hex digits; written when the copy was staged, held as a Ref by the
    client that may still send tasks using it, gone with its last Ref or its lease)."""
    keys = set()
    try:
        with os.scandir(objects) as entries:
            for entry in entries:
                if len(entry.name) == 64 and not entry.name.startswith("."):
                    try:
                        if entry.stat().st_mtime >= now:
                            keys.add(entry.name[:32])
                    except FileNotFoundError:
                        pass
    except (FileNotFoundError, NotADirectoryError):
        pass
    return keys


def _sweep_files(files: Path, now: float) -> int:
    """Remove the file copies of ``files`` nobody used for ``UNUSED`` s and nobody pins
    (:func:`pinned`: tasks that need it may be queued), part files and fetch locks
    ``PART_AGE`` old (a lock only while no fetch holds it), and the ``out-<id>``
    directories of out= files ``UNUSED`` old that no task holds (its worker was killed);
    how many."""
    removed = 0
    keep = pinned(files.parent / "obj", now)
    with os.scandir(files) as entries:
        for entry in entries:
            if entry.name.split("-", 1)[0] in keep:
                continue
            try:
                age = now - entry.stat(follow_symlinks=False).st_mtime
                if entry.name.startswith("out-") and entry.is_dir(follow_symlinks=False):
                    if age > UNUSED and _unused(entry.path):
                        shutil.rmtree(entry.path, ignore_errors=True)
                        removed += 1
                    continue
                if age > (PART_AGE if entry.name.startswith(".") else UNUSED) and entry.is_file(
                    follow_symlinks=False
                ):
                    if entry.name.endswith(".lock") and not _unused(entry.path):
                        continue
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:
                pass
    return removed


def _unused(path: str) -> bool:
    """No process holds a lock on ``path`` (a fetch's lock file, a task's out= directory:
    ``hold_out``)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def hold_out(directory: Path) -> int:
    """Mark ``directory`` (a task's out= directory) in use until the fd it returns is
    closed, by the task's end or its worker's death: the sweep leaves it alone."""
    fd = os.open(directory, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _sweep_namespace(space: Path, now: float) -> int:
    removed = 0
    for sub, sweep in (("obj", _sweep), ("files", _sweep_files)):
        try:
            removed += sweep(space / sub, now)
        except (FileNotFoundError, NotADirectoryError):
            pass
    return removed


def sweep_all(now: float | None = None, base: Path | None = None) -> int:
    """Sweep every runtime of this user on this node (``base``): expired objects, file
    copies unused for ``UNUSED`` s; the directory of a runtime no live process holds
    once nothing in it is leased or recently used (a runtime killed), and stores of the
    layout before runtimes (namespaces right under ``base``) likewise. How many files
    or directories it removed.

    A ``now`` ahead of the clock (a test's) needs its own ``base``: over this user's real
    one it would remove the objects and file copies of every live runtime of the node
    (leased, pinned, their tasks queued) as if their leases had run out."""
    base = data_base() if base is None else base
    if now is not None and now > time.time() + 1 and base.name == f"nimbus-data-{os.getuid()}":
        raise DataError(
            "sweep_all(now=<a time ahead of the clock>) sweeps every runtime of this user "
            "on this node as if their leases had run out; give it its own base="
        )
    now = time.time() if now is None else now
    removed = 0
    try:
        entries = [e for e in os.scandir(base) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return 0
    for entry in entries:
        top = Path(entry.path)
        try:
            runtime = entry.name.startswith("r") and len(entry.name) == 17
            spaces = [p for p in top.iterdir() if p.name != HOLDERS] if runtime else [top]
            for space in spaces:
                removed += _sweep_namespace(space, now)
            if (not runtime or not _live_holders(top)) and _idle(top, now):
                shutil.rmtree(top, ignore_errors=True)
                removed += 1
        except OSError:
            pass
    return removed


class Sweeper:
    """A thread that runs :func:`sweep_all` now and every ``every`` s until closed, for
    the agent of a runtime or a block's manager (which also holds its data directory
    while it runs, and serves its file cache to the other nodes: ``_serve``)."""

    def __init__(self, every: float = SWEEP_EVERY, *, serve: bool = True) -> None:
        self.mark = hold()
        # (serve=False: a runtime of one node, which no other node fetches from)
        self.server = _serve_cache(self.mark.parent.parent) if serve else None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(every,), name="nimbus-data-sweep", daemon=True
        )
        self._thread.start()

    def _run(self, every: float) -> None:
        while True:
            try:
                sweep_all()
            except Exception:  # never the agent's failure: the next sweep tries again
                pass
            if self._stop.wait(every):
                return

    def close(self) -> None:
        """Stop sweeping and release the runtime's directory (removed if it was the last)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        if self.server is not None:
            self.server.close()
        release(self.mark)


def _serve_cache(root: Path) -> Any:
    """This node's file cache served to the endpoint's other nodes (``_serve``); None
    where it cannot listen (the copies it holds are then used only here)."""
    from nimbus.config import Settings
    from nimbus.data._serve import Server

    host = "127.0.0.1"
    try:
        host = Settings.load().data_host
        return Server(root, host)
    except (OSError, ConfigError, DataError) as exc:
        logging.getLogger(__name__).warning(
            "this node does not serve its file cache to the endpoint's other nodes (tasks "
            "there cannot use files staged here): cannot listen on NIMBUS_DATA_HOST=%r: %s; "
            "set it to an address of this node the others reach",
            host,
            exc,
        )
        return None


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ConfigError(
            f"{path} must belong to this user with mode 0o700 (it holds task data); "
            f"remove it or fix its owner and mode"
        )
    return path


def node_dir(path: Path) -> Path:
    """``path`` (a directory inside a namespace of a runtime's data directory: its file
    cache, its keys) made if it is not there, the runtime's directory with it private:
    ``mkdir(parents=True)`` alone would remake a runtime directory a sweep removed with
    the default mode, refused from then on by every store of that runtime."""
    _private_dir(path.parent.parent)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
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


def secret_of(pin: Path) -> str | None:
    """The secret of the pin file ``pin`` (:meth:`NodeStore.write_secret`'s; None: not a
    pin); read only, nothing made (the data server reads it before any check)."""
    found = _pin_text(pin)
    return None if found is None else found.split("\n", 1)[0]


def note_of(pin: Path) -> str:
    """What the pin file ``pin`` holds after its secret (``write_secret``'s ``note``)."""
    found = _pin_text(pin)
    return "" if found is None or "\n" not in found else found.split("\n", 1)[1]


_NOTE = 8192  # bytes a pin's note may take (an out= file's path)


def _pin_text(pin: Path) -> str | None:
    with open(pin, "rb") as f:
        data = f.read(len(SECRET) + 200 + _NOTE)
    return data[len(SECRET) :].decode() if data.startswith(SECRET) else None


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
        return self.write_dumped(ref_id, serialization.dumps(obj), expires)

    def write_dumped(self, ref_id: str, dumped: tuple[Any, list[Any]], expires: float) -> int:
        """:meth:`write` of an object already pickled (``serialization.dumps``'s)."""
        data, buffers = dumped
        views = [b.raw() for b in buffers]
        head = MAGIC + _HEAD.pack(len(data), len(views))
        head += b"".join(_LEN.pack(v.nbytes) for v in views)
        final = self.path(ref_id)
        part = self.objects / f".{ref_id}.part"
        try:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except FileNotFoundError:  # the runtime's directory was removed (it stopped): again
            _private_dir(self.dir.parent)
            self.objects.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            try:
                _write_all(fd, head)
                _write_all(fd, data)
                for view in views:
                    _write_all(fd, view)
            finally:
                os.close(fd)
            os.utime(part, (expires, expires))
            os.rename(part, final)
        except BaseException:  # (no room: what fit goes too, not at a sweep an hour later)
            part.unlink(missing_ok=True)
            raise
        self.maybe_sweep()
        return len(head) + len(data) + sum(int(v.nbytes) for v in views)

    def write_secret(self, ref_id: str, secret: str, expires: float, note: str = "") -> None:
        """A pin (``_direct.offer``): an object leased until ``expires`` holding only a
        secret (and a ``note``: where an out= file goes, ``_direct.expect_out``), read
        back by :meth:`read_secret` and :func:`note_of` without unpickling anything (the
        node's manager reads it: it never unpickles what a user's task wrote)."""
        if "\n" in secret or len(note.encode()) > _NOTE:
            raise DataError(f"a pin's note takes {_NOTE} bytes at most, and its secret no line")
        part = self.objects / f".{ref_id}.part"
        final = self.path(ref_id)
        self.objects.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, SECRET + secret.encode() + (b"\n" + note.encode() if note else b""))
        finally:
            os.close(fd)
        os.utime(part, (expires, expires))
        os.rename(part, final)

    def read_secret(self, ref_id: str) -> str | None:
        """The secret of a pin written by :meth:`write_secret` (None: not one)."""
        return secret_of(self.path(ref_id))

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
