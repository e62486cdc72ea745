"""Making an environment ready on this node: :func:`prepare`.

``prepare(env)`` returns a :class:`Prepared`: how to start a worker inside the
environment. It blocks while the environment is built (once per node, cached
by ``env.key``), is safe to call from many threads and processes at once, and
raises :class:`~nimbus.errors.EnvironmentBuildError` quoting the builder, or
:class:`~nimbus.errors.VersionMismatchError` naming both versions. A plain
environment (``env.plain``) is the node's own Python and needs nothing.

::

    prepare(env) --cached? (meta.json, same node Python)--> Prepared   (milliseconds)
        |  no
        +-- failed before? (<key>.failed) --> raise at once, the same message
        +-- flock <key>.lock  (another thread or process building it: wait)
              virtualenv (uv or pip)  ->  wraps (bwrap, podman)  ->  probe: the
              environment's Python and cloudpickle against the node's, nimbus imports
              -> meta.json, evict least recently used past environments_max_size
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle

from nimbus.config import Settings
from nimbus.environments import _isolate, _venv
from nimbus.environments._cache import Cache, tree_size
from nimbus.environments._report import cause
from nimbus.environments._spec import Environment
from nimbus.errors import ConfigError, EnvironmentBuildError, VersionMismatchError

__all__ = ["WORKER_VARIABLE", "Prepared", "cache", "prepare", "resolve"]

WORKER_VARIABLE = "NIMBUS_WORKER_ENVIRONMENT"
"""Set to the environment's name in its workers (a task can ask what it runs in);
unset in the workers of the node's own Python."""

PROBE_TIMEOUT = 120.0
PROBE = (
    "import json, sys\n"
    "out = {'python': '%d.%d.%d' % sys.version_info[:3]}\n"
    "try:\n"
    "    import cloudpickle\n"
    "    out['cloudpickle'] = cloudpickle.__version__\n"
    "    import nimbus.runtime.worker\n"
    "except BaseException as exc:\n"
    "    out['error'] = '%s: %s' % (type(exc).__name__, exc)\n"
    "print('NIMBUS-PROBE ' + json.dumps(out))\n"
)
_counter = itertools.count(1)
_made: list[str] = []  # work directories this process made, removed at its exit


def _python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))


def _node() -> dict[str, str]:
    """What a cached environment must match to be reused: the node's Python."""
    return {"python": _python_version(), "executable": os.path.realpath(sys.executable)}


@dataclass(frozen=True)
class Prepared:
    """An environment ready on this node: ``command(argv)`` starts a worker in it.

    ``wrap`` is the sandbox's or container's prefix, in which ``{workdir}`` is the
    worker's own writable directory; ``venv`` is the virtualenv (its Python replaces
    the first item of ``argv``); ``workdirs`` is where those directories are made.
    """

    environment: Environment
    python: str = sys.executable
    wrap: tuple[str, ...] = ()
    variables: Mapping[str, str] = field(default_factory=dict)
    build_seconds: float = 0.0
    venv: str | None = None
    workdirs: str | None = None
    installer: str = ""
    node_view: str | None = None

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` (whose first item is a Python) run inside the environment."""
        python = self.python if self.venv else argv[0]
        if not self.wrap:
            return [python, *argv[1:]]
        wrap = list(self.wrap)
        if _isolate.WORKDIR in wrap or any(_isolate.WORKDIR in a for a in wrap):
            workdir = self.workdir()
            wrap = [a.replace(_isolate.WORKDIR, workdir) for a in wrap]
        return [*wrap, python, *argv[1:]]

    def workdir(self) -> str:
        """A new writable directory for one worker (removed when this process exits)."""
        assert self.workdirs is not None
        root = Path(self.workdirs)
        root.mkdir(parents=True, exist_ok=True)
        path = root / f"{self.environment.key}-{os.getpid()}-{next(_counter)}"
        path.mkdir(mode=0o700)
        if not _made:
            atexit.register(_remove_workdirs)
        _made.append(str(path))
        return str(path)

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        """The worker's environment variables: ``base`` plus the environment's own and
        :data:`WORKER_VARIABLE`, its name.

        In a virtualenv, ``base``'s ``PYTHONPATH`` (the manager's import path) moves to
        ``NIMBUS_NODE_PATH``, which the virtualenv appends after its own packages.
        """
        out = {**base, **self.variables, WORKER_VARIABLE: self.environment.name}
        if self.venv is not None:
            paths = [p for p in out.pop("PYTHONPATH", "").split(os.pathsep) if p]
            paths += [p for p in _venv.node_paths() if p not in paths]
            out[_venv.NODE_PATH] = os.pathsep.join(_venv.worker_paths(paths, self.node_view))
            out.pop("PYTHONHOME", None)
        return out


def _remove_workdirs() -> None:
    for path in _made:
        shutil.rmtree(path, ignore_errors=True)


def cache(settings: Settings | None = None) -> Cache:
    """This node's cache of environments (``environments_dir``)."""
    if settings is None:
        root = Settings.lookup("environments_dir")
        if root is None:
            root = Settings.load().environments_path
    else:
        root = settings.environments_path
    return Cache(Path(root))


def resolve(text: str, given: str = "NIMBUS_ENVIRONMENT") -> Environment:
    """The environment ``text`` names: ``Environment.to_dict()`` as JSON, or the name of
    one built on this node (``nimbus environments build NAME ...``). Anything else is a
    :class:`ConfigError` naming ``given`` (the option or variable it came from) and
    what to give instead."""
    text = text.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{given}={text!r} is not JSON ({exc}); give a name built with `nimbus "
                f"environments build`, or json.dumps(Environment(...).to_dict())"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(f'{given}={text!r} is not a JSON object such as {{"name": "geo"}}')
        try:
            return Environment.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{given}={text!r}: {exc}") from None
    entries = cache().entries()
    built = [e for e in entries if e.state == "built" and text in e.names and e.spec]
    failed = [e for e in entries if e.state == "failed" and text in e.names and e.spec]
    if not built and failed:
        last = max(failed, key=lambda e: e.last_use)
        assert last.spec is not None
        raise ConfigError(
            f"{given}={text!r}: the build of that environment on this node failed: "
            f"{cause(last.message)}; fix the cause (or the spec) and try again: "
            f"`{retry_command(last.spec)}`"
        )
    if not built:
        raise ConfigError(
            f"{given}={text!r}: no environment of that name is built on this node; "
            f"`nimbus environments list` shows those that are, `nimbus environments build "
            f"{text or 'NAME'} -r PACKAGE` builds one"
        )
    spec = max(built, key=lambda e: e.last_use).spec
    assert spec is not None
    return dataclasses.replace(spec, name=text)


def retry_command(env: Environment) -> str:
    """The ``nimbus environments build`` command line that builds ``env`` again."""
    words = ["nimbus", "environments", "build", env.name]
    for requirement in env.requirements:
        words += ["-r", requirement]
    if env.wheelhouse:
        words += ["--wheelhouse", env.wheelhouse]
    if env.image:
        words += ["--image", env.image]
    if env.sandbox:
        words.append("--sandbox")
    return shlex.join(words)


def prepare(env: Environment, *, retry: bool = False) -> Prepared:
    """Make ``env`` ready on this node (build it if needed) and say how to start in it.

    A build that failed before fails again at once with the same message, unless
    ``retry`` (``nimbus environments build`` retries).
    """
    if env.plain:
        return Prepared(env)
    store = cache()
    key = env.key
    if not retry:
        _raise_failure(store, env)
        ready = _cached(store, env)
        if ready is not None:
            return ready
    store.ensure()
    with store.locked(key):  # one build per node; the others wait here, then reuse it
        if retry:
            store.forget_failure(key)
        _raise_failure(store, env)
        ready = _cached(store, env)
        if ready is not None:
            return ready
        _check_input(env)  # refused before anything is built: not remembered as a failure
        started = time.monotonic()
        try:
            with store.building(env):
                prepared = _build(store, env)
        except EnvironmentBuildError as exc:
            shutil.rmtree(store.entry(key), ignore_errors=True)
            store.remember_failure(env, "build", str(exc))
            raise
        except VersionMismatchError as exc:
            shutil.rmtree(store.entry(key), ignore_errors=True)
            store.remember_failure(env, "version", str(exc))
            raise
        seconds = time.monotonic() - started
        entry = store.entry(key)
        meta = {
            "spec": env.to_dict(),
            "names": [env.name],
            "node": _node(),
            "build_seconds": seconds,
            "built": time.time(),
            "installer": prepared.installer,
            "size": tree_size(entry),
        }
        store.write_meta(key, meta)
        store.touch(key, env.name)
        store.claim(key, env.name)  # a name means one build: this one now
    limit = int(Settings.lookup("environments_max_size"))
    with contextlib.suppress(OSError):
        store.evict(limit, keep=key)
    return _prepared(store, env, meta, build_seconds=seconds)


def _raise_failure(store: Cache, env: Environment) -> None:
    failure = store.failure(env.key)
    if failure is None:
        return
    message = str(failure.get("message", "the build failed"))
    if failure.get("kind") == "version":
        raise VersionMismatchError(message)
    raise EnvironmentBuildError(
        f"{message}\n(remembered from an earlier build of this spec on this node: change the "
        f"spec, or run `nimbus environments build {env.name}` to try again)",
        env.name,
        env.key,
    )


def _cached(store: Cache, env: Environment) -> Prepared | None:
    meta = store.meta(env.key)
    if meta is None or meta.get("node") != _node():
        return None
    if env.requirements and not _venv.venv_python(store.entry(env.key) / "venv").exists():
        return None
    store.touch(env.key, env.name)
    return _prepared(store, env, meta, build_seconds=0.0)


def _prepared(
    store: Cache, env: Environment, meta: Mapping[str, Any], build_seconds: float
) -> Prepared:
    venv = store.entry(env.key) / "venv" if env.requirements else None
    python = str(_venv.venv_python(venv)) if venv is not None else sys.executable
    # what a sandbox must still see where a private /tmp would hide it (a checkout
    # or a virtualenv under /tmp): the node's Python, its import path, the venv
    prefixes = [sys.prefix, sys.base_prefix]
    view = _venv.node_view(store.root) if venv is not None else None
    grants = [*prefixes, *_venv.node_paths(), *([str(venv), view] if view else [])]
    memory = int(Settings.lookup("sandbox_memory"))
    wrap: tuple[str, ...] = ()
    if env.image is not None:
        wrap = _isolate.podman_wrap(env, grants, memory)
    elif env.sandbox:
        wrap = _isolate.bwrap_wrap(env, grants, memory)
    return Prepared(
        env,
        python=python,
        wrap=wrap,
        build_seconds=build_seconds,
        venv=str(venv) if venv is not None else None,
        workdirs=str(store.root / "work") if wrap else None,
        installer=str(meta.get("installer", "")),
        node_view=view,
    )


def _build(store: Cache, env: Environment) -> Prepared:
    entry = store.fresh(env.key)
    tool = ""
    if env.requirements:
        tool = _venv.build_venv(env, entry / "venv")
    prepared = _prepared(store, env, {"installer": tool}, build_seconds=0.0)
    _probe(prepared)
    return prepared


def _check_input(env: Environment) -> None:
    """What this node lacks for ``env`` (its wheelhouse, its image): an EnvironmentBuildError
    before the build, which is not remembered (``nimbus environments list`` shows no failed
    build for a path or image mistyped; the next use looks again)."""
    if env.wheelhouse is not None and not os.path.isdir(env.wheelhouse):
        raise EnvironmentBuildError(
            f"environment {env.name!r}: wheelhouse {env.wheelhouse} is not a directory on "
            f"this node; make it (pip wheel -w DIR ...) or drop wheelhouse= to use the index",
            env.name,
            env.key,
        )
    if env.image is not None:
        _check_image(env)


def _check_image(env: Environment) -> None:
    podman = _isolate.require("podman", env)
    _isolate.require("runc", env)
    proc = subprocess.run(
        [podman, "image", "exists", str(env.image)],
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT,
        check=False,
    )
    if proc.returncode == 1:
        raise EnvironmentBuildError(
            f"environment {env.name!r}: image {env.image!r} is not on this node, and nimbus "
            f"never pulls one: `podman pull`, `podman load` or `podman build` it here first",
            env.name,
            env.key,
        )
    if proc.returncode != 0:
        raise EnvironmentBuildError(
            f"environment {env.name!r}: podman cannot look up image {env.image!r}: "
            f"{proc.stderr.strip()}",
            env.name,
            env.key,
        )


def _probe(prepared: Prepared) -> None:
    """Start the environment's Python as a worker would and compare versions with the node."""
    env = prepared.environment
    argv = prepared.command([sys.executable, "-c", PROBE])
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    base["PYTHONPATH"] = os.pathsep.join(_venv.node_paths())
    try:
        proc = subprocess.run(
            argv,
            env=prepared.environ(base),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise EnvironmentBuildError(
            f"environment {env.name!r}: its Python did not start within {PROBE_TIMEOUT:.0f} s",
            env.name,
            env.key,
        ) from None
    line = next((s for s in proc.stdout.splitlines() if s.startswith("NIMBUS-PROBE ")), None)
    if proc.returncode != 0 or line is None:
        said = "\n".join((proc.stderr.strip() or proc.stdout.strip()).splitlines()[-25:])
        how = "a container of its image" if env.image else "its sandbox" if env.sandbox else "it"
        raise EnvironmentBuildError(
            f"environment {env.name!r}: a Python cannot start in {how} "
            f"(exit {proc.returncode}):\n{said}",
            env.name,
            env.key,
        )
    found = json.loads(line.split(" ", 1)[1])
    ours = {"python": _python_version(), "cloudpickle": cloudpickle.__version__}
    theirs_py = ".".join(str(found.get("python", "?")).split(".")[:2])
    if theirs_py != ".".join(ours["python"].split(".")[:2]) or (
        "cloudpickle" in found and found["cloudpickle"] != ours["cloudpickle"]
    ):
        raise VersionMismatchError(
            f"environment {env.name!r} runs Python {found.get('python')} with cloudpickle "
            f"{found.get('cloudpickle', '(none)')}, but this node runs Python {ours['python']} "
            f"with cloudpickle {ours['cloudpickle']}: tasks could not be exchanged; pin "
            f"cloudpickle=={ours['cloudpickle']} in its requirements (or drop the pin)"
        )
    if "error" in found:
        raise EnvironmentBuildError(
            f"environment {env.name!r}: nimbus cannot be imported in it ({found['error']}); "
            f"a requirement may replace one of nimbus's own dependencies with an "
            f"incompatible version",
            env.name,
            env.key,
        )
