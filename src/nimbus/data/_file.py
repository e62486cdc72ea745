"""Files as task arguments: ``nimbus.File("endpoint:path")`` and ``nimbus.File("path")``.

::

    ex.submit(fn, File("lab:/data/x.h5"))  client: lab known? path inside lab's exports?
        the task's own endpoint, or this machine on the local runtime: read in place
        another endpoint: a task there reads it (its owner's exports checked there),
        its bytes put once in the task's endpoint's store, cached by (endpoint, path,
        size, mtime): 16 tasks using one file transfer it once
    worker: the argument is a ``pathlib.Path``: the file itself, or its copy in the
        node's cache (``<node store>/files/``), size and sha256 checked when written
    out=File("lab:/results/{task_id}.npz"): the task gets a local ``pathlib.Path`` to
        write (``<cache>/out-<id>/<id>.npz``: the file's own name, ``{task_id}`` = <id>);
        after it ends the file is moved to the path, inside the exports of the endpoint
        the task runs on (or sent to another endpoint's node server, below), and
        ``out-<id>/`` removed (also when the task failed)

An input must exist when the task is submitted: a missing file of this machine (or of
an endpoint whose config is here) is refused by ``submit`` (``FileRefused`` naming it),
one on another endpoint when it is staged, one read in place on the task's endpoint
before the task runs. An ``out=`` file need not exist. Paths are absolute everywhere
(``File("rel/x")`` and ``File("")`` are refused, as on an endpoint).

Exports: ``exports`` in an endpoint's config (``endpoint.toml``), directories separated
by ``:``; a path outside them, with ``..``, or leaving them through a symlink is refused
(``FileRefused``). A file of this machine (``File("path")``) is the user's own: read as
it is, by the local runtime, or sent from the client to a remote endpoint.

A file of another endpoint goes endpoint to endpoint (``_direct``: a task on the target
offers a connection, a task on the source sends the file into it); only when the source
cannot connect to the target (``Unreachable``) does it travel through the client's link
(a task there reads it in parts, the client puts them where the task runs).

A copy sent directly is the only one on its node (no parts in the store to make it again
from): the target writes a pin beside it, an empty object leased like a Ref's, which the
client holds (``Staged.pin``, renewed, freed with its cache entry); the node's sweep keeps
a pinned copy however long the tasks that need it wait, and removes it once the pin is
freed, or its lease ran out (the client died), and nobody used it for a lease.

A file sent directly lands in the cache of the target node that offered to take it; a
task on another node of that endpoint (a block's manager, the agent) fetches it from
there once (``_fetch``; that node's agent or manager serves its cache to the holders of
the copy's secret: ``_serve``; sha256 checked) and finds it in its own cache after.

A copy whose holding node left (its block ended) before another node fetched it: a task
there fails to fetch it with ``ReferenceLost`` naming the copy's pin; the client stages
the file again from its endpoint (``_staging.restage``: once for all the tasks that found it
gone) and sends the task again with the new copy (``_submit``; ``RESTAGE`` times per task
at most). Its endpoint offline or the file gone there (no source left): the task fails
with that error. Tasks submitted later get the new copy; a renewal of the pin that found
its node gone (every third of a lease) drops the old one too.

An ``out=`` file of another endpoint (``out=File("lab:/r/{task_id}.npz")`` for a task on
hpc) goes the other way (``_direct.expect_out``, ``push_out``): at submit the client asks
lab to expect it (a task there checks lab's exports and that the directory can be
written, and writes a pin with the path's template and a secret; the client holds the
pin); the hpc tasks are sent once lab said yes (refused: they fail without running).
When a task has run well, its worker sends the file to lab's node server with the pin's
proof and the bytes' sha256 (``_serve``'s "out"), which fills ``{task_id}``, checks the
exports again, writes a temporary file beside the target and renames it into place. A
task that failed sends nothing; a file lab cannot take fails the task with lab's reason.
Where hpc's node cannot connect to lab's (``Unreachable``: ``NIMBUS_DATA_HOST``), the
worker leaves the file in its ``out-<id>/`` (swept after ``UNUSED`` s) and the task ends
with :class:`OutPending` (its result inside); the client carries the file (``_staging.
carry_out``: read from hpc in parts, put on lab, written there by a task, sha256
checked), then gives the task's future its result; failing that too, the task fails
naming both reasons.

Limits: a file carried through the client is read from whichever node of hpc takes the
read task (an endpoint of several nodes may not find it there), and held whole in
memory by the task that writes it on lab; the direct path writes as lab's agent (its
OS user), the carried one as lab's worker.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from nimbus.config import config_dir
from nimbus.data._node import hold_out, node_dir
from nimbus.data._ref import Ref, new_id
from nimbus.errors import DataError, FileRefused, ReferenceLost

__all__ = [
    "File",
    "Out",
    "Staged",
    "check_export",
    "check_out",
    "exports_of",
    "local_path",
    "missing",
    "read_export",
    "stat_export",
]

_SPEC = re.compile(r"^([A-Za-z0-9_.@-]{1,200}):(.+)$")


@dataclass(frozen=True, init=False)
class File:
    """A file on an endpoint (``"endpoint:path"``) or on this machine (``"path"``).

    As an argument, the task gets a ``pathlib.Path`` to it where it runs; as
    ``out=``, a ``pathlib.Path`` to write, moved there after the task ends.
    """

    endpoint: str | None
    path: str

    def __init__(self, spec: str | os.PathLike[str]) -> None:
        text = os.fspath(spec) if isinstance(spec, (str, os.PathLike)) else spec
        if not isinstance(text, str):
            raise TypeError(
                f"nimbus.File({spec!r}): a File takes a path as a str or pathlib.Path, "
                f'"ENDPOINT:/absolute/path" (on an endpoint) or "/absolute/path" (on this '
                f"machine), not {type(spec).__name__}"
            )
        found = _SPEC.match(text)
        endpoint, path = (found.group(1), found.group(2)) if found else (None, text)
        if not path:
            raise FileRefused("nimbus.File(''): an empty path names no file; give its path")
        if ".." in PurePosixPath(path).parts:
            if endpoint is not None:
                raise FileRefused(f"{text!r} has '..' in its path: name the file inside an export")
            raise FileRefused(  # a file of this machine: no exports to name
                f"{text!r} has '..' in its path, which a File may not have (as on an "
                f"endpoint); give the path resolved: nimbus.File({os.path.realpath(path)!r})"
            )
        if endpoint is not None and not path.startswith("/"):
            raise FileRefused(f"{text!r}: a path on an endpoint must be absolute")
        if not path.startswith("/"):  # as on an endpoint: the task may run elsewhere
            raise FileRefused(
                f"{text!r} is a relative path: a path must be absolute (as on an endpoint), "
                f"e.g. nimbus.File({os.path.abspath(path)!r})"
            )
        object.__setattr__(self, "endpoint", endpoint)
        object.__setattr__(self, "path", path)

    def __repr__(self) -> str:
        return f"nimbus.File({(self.endpoint + ':' if self.endpoint else '') + self.path!r})"


@dataclass(frozen=True)
class Staged:
    """A file put in the task's endpoint's store (``ref``): the worker caches it as ``key``."""

    refs: tuple[Ref, ...]  # its parts, in order
    key: str
    name: str
    size: int
    sha256: str
    pin: Ref | None = None  # sent directly: the copy's pin on its node (see ``_direct.offer``)
    # sent directly: where its node serves it, and the copy's secret (kept out of reprs;
    # it travels in the task's payload, as the Staged does)
    holder: tuple[str, int, str] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Out:
    """``out=File(...)``: where the task's file goes after it ends (``{task_id}`` filled)."""

    endpoint: str | None  # the endpoint id it is checked against; None: this machine
    template: str
    # another endpoint's file (``_direct.expect_out``): where that endpoint's node server
    # takes it, and the secret of its pin (kept out of reprs; it travels in the task's
    # payload, as ``Staged.holder`` does), the pin and its namespace there, its name
    target: tuple[str, int, str] | None = field(default=None, repr=False)
    pin: str = ""
    namespace: str = ""
    name: str = ""


# ---------------------------------------------------------------- exports


def exports_of(endpoint: str) -> tuple[str, list[Path]] | None:
    """The name and exports of ``endpoint`` (a name or an id) if its config is here
    (``<config dir>/endpoints/<name>/endpoint.toml``, as ``nimbus.endpoint.config``)."""
    root = config_dir() / "endpoints"
    for path in sorted(root.glob("*/endpoint.toml")) if root.is_dir() else ():
        try:
            config = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError):
            continue
        if endpoint in (config.get("name"), config.get("endpoint_id")):
            dirs = str(config.get("exports", "")).split(os.pathsep)
            return str(config["name"]), [Path(d).expanduser() for d in dirs if d.strip()]
    return None


def check_export(path: str, exports: list[Path], endpoint: str) -> Path:
    """``path`` resolved, if it is inside one of ``exports``; else ``FileRefused``."""
    if ".." in PurePosixPath(path).parts:
        raise FileRefused(f"{endpoint}:{path} has '..' in its path")
    real = Path(os.path.realpath(path))
    for top in exports:
        if real.is_relative_to(os.path.realpath(top)):
            return real
    shown = ", ".join(map(str, exports)) or "nothing"
    escaped = " (a symlink leads out of them)" if Path(os.path.abspath(path)) != real else ""
    raise FileRefused(
        f"{endpoint}:{path} is outside the directories endpoint {endpoint!r} exports "
        f"({shown}){escaped}; its owner exports more with `nimbus endpoint configure "
        f"{endpoint} --exports DIR[:DIR...]`"
    )


_PLACEHOLDER = re.compile(r"\{[^{}/]*\}")


def check_out(out: File, here: bool) -> None:
    """Refuse an ``out=`` file before its task runs: a placeholder other than
    ``{task_id}`` in its path; ``here`` (its directory is on this machine): a directory
    that cannot be made or written (as after the task, when its output would be lost)."""
    unknown = sorted({p for p in _PLACEHOLDER.findall(out.path) if p != "{task_id}"})
    if unknown:
        raise FileRefused(
            f"out={out!r}: unknown placeholder {', '.join(unknown)} in its path; the only "
            f"one is {{task_id}} (the task's id): use it, or leave the braces out"
        )
    if not here:
        return
    top = Path(out.path).parent
    while not top.exists() and top != top.parent:  # (the directories made after the task)
        top = top.parent
    try:
        if not top.is_dir():
            raise NotADirectoryError(f"{top} is not a directory")
        fd, probe = tempfile.mkstemp(dir=top, prefix=".nimbus-out-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise FileRefused(
            f"out={out!r} cannot be written: a file cannot be made in {top} ({why}); "
            f"give an out= path in a directory you can write"
        ) from None


def _exported(endpoint: str, path: str) -> Path:
    found = exports_of(endpoint)
    if found is None:
        raise FileRefused(
            f"endpoint {endpoint!r} is not configured on this machine; `nimbus endpoint "
            f"list` shows those that are"
        )
    return check_export(path, found[1], found[0])


def read_export(endpoint: str, path: str, offset: int, length: int, mtime: float) -> bytes:
    """A task on the owning endpoint: ``length`` bytes of the file from ``offset``."""
    real = _exported(endpoint, path)
    with open(real, "rb") as f:
        if os.fstat(f.fileno()).st_mtime != mtime:
            raise DataError(f"{endpoint}:{path} changed while it was staged; submit again")
        f.seek(offset)
        return f.read(length)


def stat_export(endpoint: str, path: str, name: str = "") -> tuple[int, float]:
    """A task on the owning endpoint: the file's size and mtime (its cache key); ``name``:
    the endpoint as the user named it (for the message)."""
    real = _exported(endpoint, path)
    try:
        st = real.stat()
    except FileNotFoundError:
        name = name or endpoint
        raise missing(f"{name}:{path}", f"on endpoint {name!r}") from None
    return st.st_size, st.st_mtime


def missing(name: str, where: str) -> FileRefused:
    """An input file that is not there (an ``out=`` file need not exist yet)."""
    return FileRefused(
        f"the input file {name} does not exist {where}: an input must exist when the "
        f"task is submitted (only an out= file may not exist yet); check its path"
    )


# ---------------------------------------------------------------- the worker's side


def local_path(value: File | Staged | Out, files: Path, here: str | None) -> Path:
    """What the task gets for ``value``: a path on this node (``files``: its cache)."""
    if type(value) is File:  # an input: there before the task runs
        path = Path(value.path) if value.endpoint is None else _exported(value.endpoint, value.path)
        if not path.exists():
            shown = f"{value.endpoint}:{value.path}" if value.endpoint else value.path
            where = f"on endpoint {value.endpoint!r}" if value.endpoint else "where the task runs"
            raise missing(shown, where)
        return path
    if type(value) is Staged:
        return _cached(value, files)
    assert isinstance(value, Out)  # the last kind left
    return _out_path(value, files)


_out_holds: dict[str, int] = {}  # a running task's out= directory -> its held fd


def _out_path(out: Out, files: Path) -> Path:
    """A private directory ``out-<id>`` in ``files`` with the out= file's own name inside
    (``{task_id}`` filled with ``<id>``): writers that add or check a suffix (``np.savez``,
    ``to_hdf``) write the name the task was given."""
    out_id = new_id()
    private = node_dir(files) / f"out-{out_id}"
    private.mkdir()
    _out_holds[str(private)] = hold_out(private)  # the sweep leaves it while the task runs
    name = out.template.rsplit("/", 1)[-1].replace("{task_id}", out_id)
    return private / (name or "out")


def out_id(written: Path) -> str:
    """The id that fills ``{task_id}`` for the path :func:`local_path` gave an out= file."""
    return written.parent.name.removeprefix("out-")


def discard_out(written: Path, keep: bool = False) -> None:
    """When the task has ended: remove the private directory of an out= file (what it
    wrote, if not moved, and any temporary files beside it); ``keep``: left for its
    client to carry (:class:`OutPending`), to the node's sweep after ``UNUSED`` s."""
    if keep:
        os.utime(written.parent)
    else:
        shutil.rmtree(written.parent, ignore_errors=True)
    fd = _out_holds.pop(str(written.parent), None)
    if fd is not None:
        os.close(fd)


def _cached(staged: Staged, files: Path) -> Path:
    from nimbus.data._task import _node  # the node store of the task's user

    target = files / f"{staged.key}-{staged.name}"
    try:
        if target.stat().st_size == staged.size:
            os.utime(target)  # used now: the sweep removes copies unused for a lease
            return target
    except FileNotFoundError:
        pass
    if not staged.refs and staged.holder is not None and staged.pin is not None:
        from nimbus.data._fetch import fetch  # sent directly into another node's cache

        node_dir(files)
        fetch(
            staged.holder,
            files.parent.name,
            target.name,
            staged.pin.id,
            staged.size,
            staged.sha256,
            target,
        )
        return target
    if not staged.refs:  # sent here endpoint to endpoint: into another node's cache
        raise ReferenceLost(
            f"{staged.name} is not in this node's file cache: it was staged to another node "
            f"of this endpoint (the cache is per node), or removed since; its client stages "
            f"it again (or touch the file to stage it again)",
            staged.pin.id if staged.pin is not None else "",
        )
    node = _node(files.parent.name)
    try:
        body = b"".join(bytes(node.read(ref.id)) for ref in staged.refs)
    except FileNotFoundError:  # its parts are on another node, or were lost
        missing_ref = next(r for r in staged.refs if not node.exists(r.id))
        raise ReferenceLost(
            f"{staged.name}: a part of it ({missing_ref.id[:12]}) is not in this node's "
            f"store (the node that kept it lost it); its client stages it again",
            missing_ref.id,
        ) from None
    if len(body) != staged.size or hashlib.sha256(body).hexdigest() != staged.sha256:
        raise DataError(
            f"{staged.name}: {len(body)} bytes arrived, {staged.size} were sent, or their "
            f"sha256 differs: the transfer was damaged; submit the task again"
        )
    node_dir(files)
    tmp = files / f".{new_id()}"
    tmp.write_bytes(body)
    tmp.replace(target)
    return target


def finish_out(out: Out, written: Path, task_id: str) -> tuple[Any, ...] | None:
    """After the task: move what it wrote to ``out``'s path (inside the exports); to
    another endpoint's (``out.target``), sent to its node server (``_direct.push_out``);
    where this node cannot connect to it, what the client needs to carry it instead
    (``OutPending.pending``: the file is left in its private directory)."""
    path = out.template.replace("{task_id}", task_id)
    if not written.exists():
        others = sorted(p.name for p in written.parent.iterdir()) if written.parent.is_dir() else []
        instead = f"; it wrote {', '.join(others)} beside it instead" if others else ""
        raise DataError(
            f"the task wrote nothing to {written} (its out= file {path}){instead}: "
            f"write the path the task is given, as it is"
        )
    if out.target is not None:
        from nimbus.data._direct import Unreachable, push_out

        try:
            push_out(written, out, task_id)
        except Unreachable as exc:  # no path there: the client carries it (OutPending)
            with open(written, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                sha = hashlib.file_digest(f, "sha256").hexdigest()
            return (out, task_id, written.name, size, sha, getattr(exc, "reason", str(exc)))
        return None
    target = Path(path) if out.endpoint is None else _exported(out.endpoint, path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(written, target)  # a rename, or a copy from the node's memory store
    except OSError as exc:  # (checked at submit: changed since, or another node's)
        raise DataError(
            f"the task ran, but its out= file cannot be written to {target} "
            f"({exc.strerror or exc}); give an out= path in a directory it can write"
        ) from None
    return None


class OutPending(DataError):
    """A task ran well, but the out= files of another endpoint it wrote could not be sent
    there (no path from its node: ``Unreachable``): left on its node (``out-<id>/``, for
    ``UNUSED`` s at most) for its client to carry (``DataPath.recover`` ->
    ``_staging.carry_out``); ``value``: what the task returned, given to its future once
    they are there; ``pending``: :func:`finish_out`'s answers."""

    def __init__(self, message: str, value: Any = None, pending: tuple[Any, ...] = ()) -> None:
        super().__init__(message)
        self.value = value
        self.pending = pending

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0], self.value, self.pending))


def _kept_out(out_id: str, name: str) -> Path:
    """An out= file left on this node for its client (:class:`OutPending`)."""
    from nimbus.data._task import _node, _scope

    if len(out_id) != 32 or not out_id.isalnum() or "/" in name or name.startswith("."):
        raise DataError(f"{out_id!r}/{name!r} names no out= file")
    return _node(_scope().namespace).dir / "files" / f"out-{out_id}" / name


def read_out(out_id: str, name: str, offset: int, length: int) -> bytes:
    """A task on the endpoint whose task wrote it: ``length`` bytes of an out= file left
    there (:class:`OutPending`) from ``offset``."""
    try:
        with open(_kept_out(out_id, name), "rb") as f:
            f.seek(offset)
            return f.read(length)
    except FileNotFoundError:
        raise DataError(
            f"the out= file {name} is no longer on this node (its node's sweep removed it, "
            f"or the task ran on another node of the endpoint)"
        ) from None


def drop_out(out_id: str) -> None:
    """A task there: remove an out= file left for its client once carried."""
    shutil.rmtree(_kept_out(out_id, "x").parent, ignore_errors=True)


def write_out(endpoint: str, name: str, template: str, out_id: str, sha: str, *parts: bytes) -> int:
    """A task on the endpoint an out= file goes to: ``parts`` (its bytes, carried by
    the client) checked against ``sha`` and written where ``template`` says
    (``{task_id}`` = ``out_id``) inside the exports, through a temporary file renamed
    into place; its size."""
    body = b"".join(parts)
    if hashlib.sha256(body).hexdigest() != sha:
        raise DataError(f"{len(body)} bytes arrived whose sha256 differs from the task's")
    if len(out_id) != 32 or not out_id.isalnum():
        raise DataError(f"{out_id!r} is not the id of a task's out= file")
    path = _exported(endpoint, template.replace("{task_id}", out_id))
    temp = path.parent / f".nimbus-out-{new_id()[:16]}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp.write_bytes(body)
        os.chmod(temp, 0o644)
        os.replace(temp, path)
    except OSError as exc:
        raise DataError(
            f"{name}:{path} cannot be written there ({exc.strerror or exc}); give an "
            f"out= path in a directory the endpoint can write"
        ) from None
    finally:
        with contextlib.suppress(OSError):  # (renamed; or its directory is not one)
            temp.unlink()
    return len(body)
