"""Virtualenvs for an environment's ``requirements``, made with the node's Python.

The installer is **uv** when it is installed (the ``uv`` wheel from PyPI, or
``uv`` on ``PATH``), else **pip** (the node's own, run with ``--python``): on a
5-package wheelhouse uv makes the virtualenv and installs in 0.3 s, 0.03 s
from its cache, where ``venv`` + pip take 2.2-2.7 s (pip's own start-up and
resolver dominate); both are well inside the 10 s of a first task. Failures
read the same: the installer's own message, quoted.

The virtualenv does not see the node's site-packages (``--system-site-packages``
would expose the *base* interpreter's, whatever they hold, not nimbus's). A
``.pth`` file instead appends the directories listed in ``NIMBUS_NODE_PATH`` to
``sys.path`` after the virtualenv's own site-packages: the worker imports
nimbus and its dependencies from the node, and the environment's packages win
where both have one. :meth:`Prepared.environ` sets ``NIMBUS_NODE_PATH`` from the
manager's ``PYTHONPATH`` (and the node's own paths) and removes ``PYTHONPATH``,
which would otherwise come first.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from nimbus._lazy import lazy
from nimbus.environments._spec import Environment
from nimbus.errors import EnvironmentBuildError

if TYPE_CHECKING:
    from importlib import metadata
else:  # imported when a package's version is looked up (an environment is built)
    metadata = lazy("importlib.metadata", globals())

__all__ = [
    "NODE_PATH",
    "build_venv",
    "installer",
    "node_paths",
    "node_view",
    "venv_python",
    "worker_paths",
]

NODE_PATH = "NIMBUS_NODE_PATH"
PTH_NAME = "_nimbus_node_path.pth"
PTH = (
    "import os, sys; sys.path.extend(p for p in os.environ.get('NIMBUS_NODE_PATH', '')"
    ".split(os.pathsep) if p and p not in sys.path)\n"
)
INSTALL_TIMEOUT = 900.0
QUOTED_LINES = 25


def installer() -> tuple[str, str]:
    """``("uv", path)`` when uv is installed, else ``("pip", sys.executable)``."""
    try:
        from uv import find_uv_bin

        return "uv", str(find_uv_bin())
    except (ImportError, FileNotFoundError):
        pass
    found = shutil.which("uv")
    if found:
        return "uv", found
    return "pip", sys.executable


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def node_paths() -> list[str]:
    """This process's import path without the standard library: where nimbus and its
    dependencies come from on this node."""
    stdlib = {
        os.path.realpath(p)
        for p in (sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib"))
        if p
    }
    out: list[str] = []
    for entry in sys.path:
        path = os.path.abspath(entry or os.getcwd())
        real = os.path.realpath(path)
        if real in stdlib or path.endswith(".zip") or real.endswith("lib-dynload"):
            continue
        if path not in out:
            out.append(path)
    return out


def build_venv(env: Environment, venv: Path) -> str:
    """Make the virtualenv of ``env`` at ``venv`` and install its requirements; returns
    the installer used. Raises :class:`EnvironmentBuildError` quoting the installer."""
    tool, exe = installer()  # (a wheelhouse missing here was refused before: _build)
    if tool == "uv":
        make = [exe, "venv", "--quiet", "--python", sys.executable, str(venv)]
        install = [exe, "pip", "install", "--quiet", "--python", str(venv_python(venv))]
        if env.wheelhouse is not None:
            install += ["--offline", "--no-index", "--find-links", env.wheelhouse]
        else:
            for var, flag in (
                ("PIP_INDEX_URL", "--index-url"),
                ("PIP_EXTRA_INDEX_URL", "--extra-index-url"),
            ):
                if os.environ.get(var) and not os.environ.get(f"UV_{var[4:]}"):
                    install += [flag, os.environ[var]]
    else:
        make = [sys.executable, "-m", "venv", "--without-pip", str(venv)]
        install = [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv_python(venv)),
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-input",
        ]
        if env.wheelhouse is not None:
            install += ["--no-index", "--find-links", env.wheelhouse]
    _run(env, tool, make)
    site = _site_packages(venv)
    (site / PTH_NAME).write_text(PTH)
    _run(env, tool, [*install, *env.requirements])
    return tool


def _site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python*/site-packages"))
    if not found:
        raise EnvironmentBuildError(f"no site-packages in the new virtualenv {venv}")
    return found[0]


def _run(env: Environment, tool: str, argv: list[str]) -> None:
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    try:
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=environ,
            timeout=INSTALL_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise EnvironmentBuildError(
            f"environment {env.name!r}: {tool} did not finish in {INSTALL_TIMEOUT:.0f} s "
            f"({' '.join(argv[:4])} ...)",
            env.name,
            env.key,
        ) from None
    except OSError as exc:
        raise EnvironmentBuildError(
            f"environment {env.name!r}: cannot run {argv[0]} ({exc.strerror})", env.name, env.key
        ) from None
    if proc.returncode != 0:
        said = "\n".join((proc.stderr.strip() or proc.stdout.strip()).splitlines()[-QUOTED_LINES:])
        raise EnvironmentBuildError(
            f"environment {env.name!r}: {tool} failed (exit {proc.returncode}) installing "
            f"{', '.join(env.requirements) or 'the virtualenv'}:\n{said}",
            env.name,
            env.key,
        )


def _site_dirs() -> set[str]:
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return {os.path.realpath(d) for d in dirs if d}


def _is_site(path: str) -> bool:
    real = os.path.realpath(path)
    return real in _site_dirs() or real.endswith(("site-packages", "dist-packages"))


@functools.lru_cache(maxsize=1)
def _runtime_links() -> tuple[tuple[str, str], ...]:
    """``(name, target)`` of every top-level module of nimbus and of its runtime
    dependencies (their closure, extras left out), where installed on this node."""
    wanted, seen = ["nimbus"], set()
    links: dict[str, str] = {}
    while wanted:
        name = re.sub(r"[-_.]+", "-", wanted.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for requirement in dist.requires or ():
            if "extra ==" not in requirement.replace('extra=="', 'extra == "'):
                found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
                if found:
                    wanted.append(found.group(1))
        for file in dist.files or ():
            top = file.parts[0] if file.parts else ""
            if (
                not top
                or top == ".."
                or top.endswith((".dist-info", ".pth"))
                or top
                in (
                    "__pycache__",
                    "bin",
                )
            ):
                continue
            target = os.path.realpath(str(dist.locate_file(top)))
            if os.path.exists(target):
                links.setdefault(top, target)
    return tuple(sorted(links.items()))


def node_view(root: Path) -> str:
    """A directory (under ``root``, made once per set of versions) that shows nimbus and
    its runtime dependencies alone, by symbolic links: what an environment's workers
    import from the node instead of the node's whole site-packages."""
    installed = []  # what is installed where (cheap: the dist-info names carry versions)
    for where in sorted(_site_dirs()):
        with contextlib.suppress(OSError):
            installed.append((where, sorted(os.listdir(where))))
    tag = hashlib.sha256(repr((sys.executable, installed)).encode()).hexdigest()[:16]
    view = root / f"node-{tag}"
    if view.is_dir():
        return str(view)
    links = _runtime_links()
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".node-{tag}.{os.getpid()}.{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, target in links:
        (tmp / name).symlink_to(target)
    try:
        tmp.rename(view)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(view)


def worker_paths(paths: list[str], view: str | None) -> list[str]:
    """``paths`` (the manager's import path) for an environment's worker: the
    site-packages directories replaced by ``view`` (nimbus's runtime alone)."""
    if view is None:
        return paths
    return [p for p in paths if not _is_site(p)] + [view]
