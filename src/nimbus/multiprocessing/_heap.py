"""Blocks of this host's shared memory for a program's ctypes objects (as the stdlib's ``heap``).

A program whose processes all run on this host (the local backend) keeps its
``Value``s and ``Array``s in real shared memory, as the stdlib does: children
write into them in place and ``np.frombuffer(arr.get_obj())`` works. A block is
one file of the program's directory, mapped by every process that unpickles it::

    /dev/shm/nimbus-<uid>/<pid namespace>-<root pid>-<root start time>-<program id>/<name>

The directory has mode 0700 (only the user reaches it). The root removes it
at exit; after a SIGKILL of the root, the next program this user starts on
this host removes it (:func:`sweep`: its root's pid is gone, or belongs to a
process started at another time). Without ``/dev/shm``, the directories are in
the runtime directory.
"""

from __future__ import annotations

import functools
import mmap
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from nimbus._lazy import lazy
from nimbus.config import private_dir
from nimbus.errors import StateStoreError
from nimbus.statestore import Keys, later

if TYPE_CHECKING:
    import psutil
else:  # imported where there is no /proc only (see _started)
    psutil = lazy("psutil", globals())

__all__ = ["Block", "directory", "remove", "sweep"]

_SHM = Path("/dev/shm")


def directory(runtime_dir: Path, program_id: str) -> str:
    """A new private directory for the blocks of the program this process is the root of."""
    base = _base(runtime_dir)
    later(functools.partial(sweep, base))  # (off the program's first start)
    pid = os.getpid()
    path = base / f"{_namespace()}-{pid}-{_started(pid)}-{program_id}"
    path.mkdir(mode=0o700)
    return str(path)


def remove(path: str) -> None:
    """Remove a program's directory and its blocks (mapped blocks stay valid where mapped)."""
    shutil.rmtree(path, ignore_errors=True)


def sweep(base: Path) -> None:
    """Remove the directories under ``base`` whose root process is gone.

    Only those of roots in this process's pid namespace: a container sharing
    ``/dev/shm`` sees other pids.
    """
    mine = _namespace()
    for entry in base.iterdir():
        parts = entry.name.split("-", 3)
        if len(parts) < 4 or parts[0] != mine or not parts[1].isdigit():
            continue
        if _started(int(parts[1])) != parts[2]:
            remove(str(entry))


def _namespace() -> str:
    """This process's pid namespace ('0' where there are none)."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def _base(runtime_dir: Path) -> Path:
    usable = _SHM.is_dir() and os.access(_SHM, os.W_OK | os.X_OK)
    return private_dir(
        _SHM / f"nimbus-{os.getuid()}" if usable else runtime_dir / "shm",
        "shared memory directory",
        "remove it, or set NIMBUS_SHARED_MEMORY=0 to keep Values and Arrays in the store",
    )


def _started(pid: int) -> str:
    """When process ``pid`` started, in hundredths of a second ('' if there is none):
    ``psutil.Process(pid).create_time()``'s figure, read from ``/proc`` as psutil does
    (psutil itself is imported only where there is no ``/proc``: a program's first
    start asks this of its root)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = f.read().rsplit(b")", 1)[1].split()[19]
        return str(int((float(ticks) / _clock_ticks() + _boot_time()) * 100))
    except FileNotFoundError:
        return ""
    except (OSError, IndexError, ValueError):
        pass
    try:
        return str(int(psutil.Process(pid).create_time() * 100))
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return ""


@functools.cache
def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


@functools.cache
def _boot_time() -> float:
    with open("/proc/stat", "rb") as f:
        return next(float(line.split()[1]) for line in f if line.startswith(b"btime"))


class Block:
    """``size`` bytes of shared memory: one file of a program's directory, mapped here.

    Pickles as its path and size; unpickling maps the same file.
    """

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.size = size
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise StateStoreError(
                f"shared memory block {path} is gone: its program ended, or the object "
                "was made on another host (keep Values and Arrays in the store with "
                "NIMBUS_SHARED_MEMORY=0 to share them across hosts)"
            ) from None
        try:
            self.map = mmap.mmap(fd, max(size, 1))
        finally:
            os.close(fd)

    @classmethod
    def new(cls, directory: str, data: bytes | int) -> Block:
        """A new block in ``directory`` holding ``data`` (an int: that many zero bytes)."""
        path = os.path.join(directory, Keys.new_name())
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileNotFoundError:
            raise StateStoreError(
                f"the program's shared memory directory {directory} is gone (its root "
                "process ended); shared objects cannot be made after it"
            ) from None
        size = data if isinstance(data, int) else len(data)
        try:
            os.ftruncate(fd, max(size, 1))
            if not isinstance(data, int):
                os.pwrite(fd, data, 0)
        finally:
            os.close(fd)
        return cls(path, size)

    def __reduce__(self) -> tuple[type[Block], tuple[str, int]]:
        return (Block, (self.path, self.size))

    def __repr__(self) -> str:
        return f"<shared memory block {self.path} of {self.size} bytes>"
