"""Environments: a worker's first task in a virtualenv, a sandbox, a container.

::

    python bench/environments.py [--quick] [--repeat N] [--only ROW] [--json out.json]

Each row starts real nimbus workers (``tests/environment_support.py``: a
socketpair and ``python -u -c WORKER_MAIN FD`` through ``Prepared.command`` /
``Prepared.environ``, as a manager starts them) and times start -> one task's
result, against the plain worker (the node's own Python) measured in the same
run, the repeats alternating plain, environment, plain, environment ...

* ``venv5-first``: a new virtualenv of 5 packages from a local wheelhouse
  (made here from PyPI with ``pip download``): ``prepare`` (build) + a cold
  worker + a task importing all five; the installer's cache is fresh each time.
  Target <= 10 s (Ray ``runtime_env``: 10-40 s). Once with uv, once with pip.
* ``venv5-built``: the same environment already built: a cold worker and one
  task that imports one of its packages (iniconfig: importing all five costs
  ~0.4 s under load by itself, attrs and idna mostly, whatever the environment).
  Target <= 300 ms.
* ``sandbox``: a bubblewrap sandbox (``sandbox=True``), cold worker + a no-op.
  Target <= 50 ms over plain.
* ``container``: a podman container (runc) of a base image made here (``podman
  import``, no registry), cold worker + a no-op. Target <= 2 s over plain.

The warm-routing rows (3,000 tasks over 4 environments, warming-aware vs random
routing) belong to the runtime's side and follow below when they land.
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/multiprocessing.py sits beside this file: keep this directory off sys.path
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.append(str(HERE.parent / "tests"))  # environment_support: the worker driver
sys.path.append(str(HERE))  # after the stdlib: _report only

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

from _report import alternate, fmt, grid  # noqa: E402

PACKAGES = ["six==1.16.0", "idna==3.4", "attrs==23.2.0", "packaging==24.0", "iniconfig==2.0.0"]


def use_five() -> str:
    import attrs  # type: ignore[import-not-found]
    import idna  # type: ignore[import-not-found]
    import iniconfig  # type: ignore[import-not-found]  # noqa: F401
    import packaging  # type: ignore[import-not-found]
    import six  # type: ignore[import-not-found]

    return f"{six.__version__} {idna.__version__} {attrs.__version__} {packaging.__version__}"


def noop() -> None:
    return None


def use_one() -> str:
    import iniconfig  # type: ignore[import-not-found]

    return str(iniconfig.__file__)  # (importlib.metadata would scan every distribution)


@dataclass
class Row:
    name: str
    what: str
    target: str
    limit: float  # seconds: absolute (over=False) or over the plain worker (over=True)
    over: bool
    plain: list[float] = field(default_factory=list)
    env: list[float] = field(default_factory=list)
    note: str = ""
    error: str = ""

    def cells(self) -> list[str]:
        if self.error:
            return [self.name, "-", "-", "-", "-", self.target, "ERROR"]
        plain, env = statistics.median(self.plain), statistics.median(self.env)
        extra = env - plain
        ok = (extra if self.over else env) <= self.limit
        return [
            self.name,
            fmt(plain, "ms"),
            fmt(env, "ms"),
            f"{env / plain:.2f}x",
            f"{extra * 1e3:+,.0f} ms",
            self.target,
            "PASS" if ok else "MISS",
        ]


# ---------------------------------------------------------------- the rows


def cold(prepared: Any, fn: Callable[[], Any]) -> float:
    """Seconds from a worker's start in ``prepared`` to its first task's result."""
    from environment_support import first_task

    return first_task(prepared, fn)[1]


def plain_side() -> Callable[[], float]:
    from nimbus.environments import PLAIN, prepare

    prepared = prepare(PLAIN)
    return lambda: cold(prepared, noop)


def row_venv5_first(ctx: Context, installer: str) -> Row:
    from nimbus.environments import Environment, _venv, prepare

    row = Row(f"venv5-first ({installer})", "new 5-package venv + first task", "<= 10 s", 10, False)
    if installer == "uv" and _venv.installer()[0] != "uv":
        row.error = "uv is not installed (pip install uv, or uv on PATH)"
        return row
    real = _venv.installer
    if installer == "pip":
        _venv.installer = lambda: ("pip", sys.executable)  # type: ignore[assignment]
    spec = Environment(f"new-{installer}", requirements=PACKAGES, wheelhouse=ctx.wheels)

    def first() -> float:
        # built from nothing each time: its entry removed, the installer's cache fresh
        os.environ["UV_CACHE_DIR"] = tempfile.mkdtemp(dir=ctx.tmp, prefix="uvcache-")
        started = time.perf_counter()
        prepared = prepare(spec)
        result = cold(prepared, use_five)
        del result
        shutil.rmtree(str(Path(prepared.venv or "").parent), ignore_errors=True)
        return time.perf_counter() - started

    try:
        side = alternate(ctx.repeat, {"plain": plain_side(), "env": first})
    finally:
        _venv.installer = real  # type: ignore[assignment]
        os.environ.pop("UV_CACHE_DIR", None)
    row.plain, row.env = side["plain"], side["env"]
    return row


def row_venv5_built(ctx: Context) -> Row:
    from nimbus.environments import Environment, prepare

    row = Row("venv5-built", "built venv, cold worker, one task", "<= 300 ms", 0.3, False)
    prepared = prepare(Environment("five", requirements=PACKAGES, wheelhouse=ctx.wheels))
    side = alternate(ctx.repeat, {"plain": plain_side(), "env": lambda: cold(prepared, use_one)})
    row.plain, row.env = side["plain"], side["env"]
    return row


def row_sandbox(ctx: Context) -> Row:
    from nimbus.environments import Environment, prepare

    row = Row("sandbox", "bubblewrap, cold worker, no-op", "<= +50 ms", 0.05, True)
    if shutil.which("bwrap") is None:
        row.error = "bubblewrap is not installed"
        return row
    prepared = prepare(Environment("jail", sandbox=True))
    side = alternate(ctx.repeat, {"plain": plain_side(), "env": lambda: cold(prepared, noop)})
    row.plain, row.env = side["plain"], side["env"]
    return row


def row_container(ctx: Context) -> Row:
    from environment_support import base_image, podman_unavailable
    from nimbus.environments import Environment, prepare

    row = Row("container", "podman (runc), cold worker, no-op", "<= +2 s", 2.0, True)
    why = podman_unavailable()
    if why:
        row.error = why
        return row
    image = base_image(Path(ctx.tmp))
    ctx.made_image = True
    prepared = prepare(Environment("box", image=image))
    side = alternate(ctx.repeat, {"plain": plain_side(), "env": lambda: cold(prepared, noop)})
    row.plain, row.env = side["plain"], side["env"]
    return row


# ---------------------------------------------------------------- the run


@dataclass
class Context:
    repeat: int
    tmp: str
    wheels: str
    made_image: bool = False


def wheelhouse(where: str) -> str:
    path = os.path.join(where, "wheels")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--only-binary=:all:",
            "-d",
            path,
            *PACKAGES,
        ],
        check=True,
        timeout=300,
    )
    return path


ROWS: dict[str, Callable[[Context], Row]] = {
    "venv5-first-uv": lambda ctx: row_venv5_first(ctx, "uv"),
    "venv5-first-pip": lambda ctx: row_venv5_first(ctx, "pip"),
    "venv5-built": row_venv5_built,
    "sandbox": row_sandbox,
    "container": row_container,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats (a smoke run)")
    parser.add_argument("--repeat", type=int, default=5, help="repeats of each side (default 5)")
    parser.add_argument("--only", action="append", choices=sorted(ROWS), help="these rows only")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    repeat = 2 if args.quick else args.repeat
    tmp = tempfile.mkdtemp(prefix="nimbus-bench-env-")
    os.environ["NIMBUS_ENVIRONMENTS_DIR"] = os.path.join(tmp, "environments")
    ctx = Context(repeat=repeat, tmp=tmp, wheels=wheelhouse(tmp))
    rows: list[Row] = []
    crashed = False
    try:
        for name in args.only or list(ROWS):
            try:
                rows.append(ROWS[name](ctx))
            except Exception as exc:  # a benchmark: the other rows still run
                crashed = True
                rows.append(Row(name, "", "", 0, False, error=f"{type(exc).__name__}: {exc}"))
    finally:
        if ctx.made_image:
            from environment_support import remove_image

            remove_image()
        shutil.rmtree(tmp, ignore_errors=True)
    header = ["workload", "plain", "environment", "ratio", "over plain", "target", "result"]
    print(f"first task on a cold worker, median of {repeat} (plain = the node's own Python)")
    print(grid(header, [row.cells() for row in rows]))
    for row in rows:
        if row.error:
            print(f"{row.name}: {row.error}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
