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
        the task runs on, and ``out-<id>/`` removed (also when the task failed)

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
the file again from its endpoint (:func:`restage`: once for all the tasks that found it
gone) and sends the task again with the new copy (``_submit``; ``RESTAGE`` times per task
at most). Its endpoint offline or the file gone there (no source left): the task fails
with that error. Tasks submitted later get the new copy; a renewal of the pin that found
its node gone (every third of a lease) drops the old one too.

Limits: ``out=`` writes only to the endpoint the task runs on (or this machine, on the
local runtime).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import os
import re
import shutil
import tempfile
import threading
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from nimbus.config import config_dir
from nimbus.data._direct import Unreachable
from nimbus.data._node import hold_out, node_dir
from nimbus.data._ref import Ref, new_id
from nimbus.errors import DataError, FileRefused, NotFound, ReferenceLost

__all__ = ["File", "Out", "Staged", "check_export", "exports_of", "read_export", "stage"]

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
        if ".." in PurePosixPath(path).parts and endpoint is not None:
            raise FileRefused(f"{text!r} has '..' in its path: name the file inside an export")
        if ".." in PurePosixPath(path).parts:  # a file of this machine: no exports to name
            raise FileRefused(
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


def discard_out(written: Path) -> None:
    """When the task has ended: remove the private directory of an out= file (what it
    wrote, if not moved, and any temporary files beside it)."""
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


def finish_out(out: Out, written: Path, task_id: str) -> None:
    """After the task: move what it wrote to ``out``'s path (inside the exports)."""
    path = out.template.replace("{task_id}", task_id)
    if not written.exists():
        others = sorted(p.name for p in written.parent.iterdir()) if written.parent.is_dir() else []
        instead = f"; it wrote {', '.join(others)} beside it instead" if others else ""
        raise DataError(
            f"the task wrote nothing to {written} (its out= file {path}){instead}: "
            f"write the path the task is given, as it is"
        )
    target = Path(path) if out.endpoint is None else _exported(out.endpoint, path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(written, target)  # a rename, or a copy from the node's memory store
    except OSError as exc:  # (checked at submit: changed since, or another node's)
        raise DataError(
            f"the task ran, but its out= file cannot be written to {target} "
            f"({exc.strerror or exc}); give an out= path in a directory it can write"
        ) from None


# ---------------------------------------------------------------- the client's side

_pool = cf.ThreadPoolExecutor(4, thread_name_prefix="nimbus-file")
_parts = cf.ThreadPoolExecutor(4, thread_name_prefix="nimbus-file-part")  # puts at once
_lock = threading.Lock()
_cache: dict[tuple[str, str, str, int, float], cf.Future[Staged]] = {}


def _endpoint_id(executor: Any, name: str) -> str:
    client = getattr(executor._backend, "client", None)
    if client is None:
        if exports_of(name) is None:  # (no service: only the endpoints configured here)
            raise FileRefused(
                f"endpoint {name!r} is not configured on this machine, and this Executor "
                f"has no service to ask: `nimbus endpoint list` shows the endpoints "
                f"configured here (`nimbus endpoint configure NAME --exports DIR`, logged "
                f"in to a service, adds one); "
                f"a file of this machine is named without an endpoint: nimbus.File('/path')"
            )
        return name
    try:
        info = client.get_endpoint(name)
    except NotFound:
        raise FileRefused(
            f"endpoint {name!r} is not known to the service: `nimbus endpoints list` shows "
            f"those you can use; `nimbus endpoint configure {name}` registers it (on the "
            f"machine it is to run on)"
        ) from None
    if not info.get("online", True) and info["endpoint_id"] != executor_place(executor):
        raise DataError(
            f"endpoint {name!r} is offline: its files cannot be staged; start its agent "
            f"(`nimbus endpoint start {name}`) and submit again"
        )
    return str(info["endpoint_id"])


def executor_place(executor: Any) -> str:
    return str(getattr(executor._backend, "endpoint_id", executor._endpoint))


def _source(executor: Any, endpoint_id: str) -> Any:
    with _lock:  # an Executor of the same user, to the file's endpoint
        sources = executor.__dict__.setdefault("_file_sources", {})
        if endpoint_id not in sources:
            sources[endpoint_id] = type(executor)(endpoint=endpoint_id, settings=executor.settings)
        return sources[endpoint_id]


def close_sources(executor: Any) -> None:
    for source in executor.__dict__.pop("_file_sources", {}).values():
        source.shutdown(wait=False)


TIMEOUT = 600.0  # seconds a part of a file may take to come from its endpoint


def _answer(future: cf.Future[Any], file: File) -> Any:
    try:
        return future.result(timeout=TIMEOUT)
    except cf.TimeoutError:
        future.cancel()
        raise DataError(
            f"{file!r}: its endpoint did not answer within {TIMEOUT:.0f} s; is its agent "
            f"running? Submit again once it is"
        ) from None


def _step(executor: Any) -> int:
    """The size of the parts a file travels in: half what the service takes at once."""
    client = getattr(executor._backend, "client", None)
    limit = int(client.limits().get("max_payload", 0)) if client is not None else 0
    return max(limit // 2, 64 * 1024) if limit else 64 * 1024 * 1024


def _fetch(executor: Any, file: File, source_id: str | None, place: str) -> cf.Future[Staged]:
    """The future of ``file`` staged into ``place``'s store (once per size and mtime)."""
    from nimbus.data._ref import put

    if source_id is None:
        st = os.stat(file.path)
        size, mtime = st.st_size, st.st_mtime
    else:
        asked = _source(executor, source_id).submit(
            stat_export, source_id, file.path, file.endpoint or ""
        )
        size, mtime = _answer(asked, file)
    key = (place, source_id or "", file.path, size, mtime)
    step = _step(executor)
    with _lock:
        found = _cache.get(key)
        if found is not None and not (
            found.done() and (found.exception() or _gone(executor, found))
        ):
            return found

        name = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
        base = PurePosixPath(file.path).name

        def transfer() -> Staged:
            if source_id is not None:  # endpoint to endpoint, unless there is no path
                try:
                    return _direct(executor, file, source_id, mtime, f"{name}-{base}")
                except Unreachable:
                    pass  # carried through this client instead (below)
            if source_id is None:
                body = Path(file.path).read_bytes()
                parts = [body[i : i + step] for i in range(0, len(body), step)] or [b""]
            else:
                source = _source(executor, source_id)
                reads = [
                    source.submit(read_export, source_id, file.path, i, step, mtime)
                    for i in range(0, size, step)
                ] or [source.submit(read_export, source_id, file.path, 0, 0, mtime)]
                parts = [_answer(r, file) for r in reads]
            sha = hashlib.sha256()
            for part in parts:
                sha.update(part)
            refs = tuple(_parts.map(lambda part: put(part, endpoint=place), parts))
            total = sum(map(len, parts))
            return Staged(refs, name, base, total, sha.hexdigest())

        future = _cache[key] = _pool.submit(transfer)
        future.staging = (file, source_id, place, key)  # type: ignore[attr-defined]
        if len(_cache) > 256:
            _cache.pop(next(iter(_cache)))
    return future


def copy_names(staging: Any) -> set[str]:
    """The ids a task names (``ReferenceLost.ref_id``) when the copy that ``staging``
    (a future :func:`stage` gave) made is gone: its pin's, its parts'."""
    if getattr(staging, "staging", None) is None or not staging.done():
        return set()
    if staging.cancelled() or staging.exception() is not None:
        return set()
    staged: Staged = staging.result()
    return {r.id for r in staged.refs} | ({staged.pin.id} if staged.pin is not None else set())


def restage(executor: Any, staging: cf.Future[Staged]) -> cf.Future[Staged]:
    """The file of ``staging`` staged again from its endpoint (its copy is gone: the node
    that held it left before the others fetched it): the future of the new copy, one for
    all the tasks that found the old one gone. Its endpoint offline, or the transfer
    failing: the future's error, which fails the tasks."""
    file, source_id, place, key = staging.staging  # type: ignore[attr-defined]
    with _lock:
        found = _cache.get(key)
        if found is not None and found is not staging:
            return found  # staged again already (another task found the copy gone)
        _cache.pop(key, None)
    try:
        if source_id is not None:  # offline: said now, not a task queued there for long
            _endpoint_id(executor, file.endpoint or source_id)
        return _fetch(executor, file, source_id, place)
    except BaseException as exc:
        failed: cf.Future[Staged] = cf.Future()
        failed.set_exception(exc)
        return failed


def _gone(executor: Any, staged: cf.Future[Staged]) -> bool:
    """A copy sent directly whose node a renewal of its pin found gone (its block
    ended): staged again rather than given to tasks that would fail to fetch it."""
    pin = staged.result().pin
    return pin is not None and pin.id in executor._path.open().gone


def _direct(executor: Any, file: File, source_id: str, mtime: float, name: str) -> Staged:
    """``file`` sent by its endpoint straight into the cache of the task's endpoint's
    node (``_direct``): this client carries only where to and the secret."""
    import time

    from nimbus.data._direct import offer, send_export

    where = executor._path.open()  # the pin: leased there, held (renewed) by this client
    key, base = name.split("-", 1)
    pin = key + new_id()
    expires = time.time() + where.lease
    answer = _answer(executor._path.call(offer, "file", name, expires, pin), file)
    host, port, secret = answer[:3]
    served = answer[3] if len(answer) > 3 else None  # (None from an older endpoint)
    holder = None if not served else (str(served[0]), int(served[1]), str(served[2]))
    held = where.adopt(Ref(pin, where.namespace, where.user, where.endpoint, 0))
    if holder is not None:
        where.served(pin, holder)  # renewed through that node, wherever the renewal runs
    sent = _source(executor, source_id).submit(
        send_export, source_id, file.path, mtime, host, port, secret
    )
    got, sha, _ = _answer(sent, file)
    return Staged((), key, base, got, sha, held, holder)


def stage(executor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``args`` and ``kwargs`` with their Files made ready for the task (checked now)."""
    remote = executor._endpoint is not None
    place = executor_place(executor) if remote else ""

    def one(value: Any, out: bool = False) -> Any:
        if type(value) is not File:
            return value
        owner = None if value.endpoint is None else _endpoint_id(executor, value.endpoint)
        local = exports_of(owner) if owner is not None else None
        if local is not None:  # its owner's config is here: refused now if outside
            check_export(value.path, local[1], local[0])
        if out:
            if remote and owner != place:
                raise DataError(
                    f"out={value!r}: a task's file can be written only to the endpoint it "
                    f"runs on ({executor._endpoint!r}) for now"
                )
            if not remote and value.endpoint is not None and local is None:
                raise FileRefused(f"out={value!r}: endpoint {value.endpoint!r} is not here")
            check_out(value, local is not None or not remote)  # (its directory is here)
            return Out(owner, value.path)
        if value.endpoint is None and not os.path.exists(value.path):
            raise missing(value.path, "on this machine")
        if local is not None and not os.path.exists(value.path):
            raise missing(f"{value.endpoint}:{value.path}", f"on endpoint {value.endpoint!r}")
        if not remote:
            return value
        if owner == place:  # on the task's own endpoint: read in place there
            return File(f"{owner}:{value.path}")
        return _fetch(executor, value, owner, place)

    new_args = tuple(one(a) for a in args)
    new_kwargs = {k: one(v, out=(k == "out")) for k, v in kwargs.items()}
    return new_args, new_kwargs


def has_files(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return any(type(v) is File for v in (*args, *kwargs.values()))
