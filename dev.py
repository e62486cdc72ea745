#!/usr/bin/env python3
"""The one entry point for working on nimbus.

    python3 dev.py demo          set up .venv, run the demo on the embedded default
    python3 dev.py test [ARGS]   set up .venv, run ruff, ruff format, mypy, pytest [ARGS]

Setup creates ``.venv`` with the Python running this script (3.11 or newer) and
installs ``-e '.[dev]'`` into it; it is skipped while pyproject.toml is unchanged
since the last successful install (a stamp file in .venv holds its hash).
Only the standard library is used here, so this runs on a bare python3.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / "bin"
STAMP = VENV / ".nimbus-install-stamp"
MIN_PYTHON = (3, 11)


def say(message: str) -> None:
    print(f"dev.py: {message}", file=sys.stderr, flush=True)


def run(cmd: list[str], env: dict[str, str] | None = None) -> int:
    say("$ " + " ".join(cmd))
    return subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode


def check_python() -> None:
    if sys.version_info < MIN_PYTHON:
        want = ".".join(map(str, MIN_PYTHON))
        say(
            f"nimbus needs Python {want} or newer; this is {sys.version.split()[0]} "
            f"({sys.executable}). Run dev.py with python{want}, e.g. `python{want} dev.py test`."
        )
        sys.exit(2)


def venv_python_ok() -> bool:
    python = BIN / "python"
    if not python.exists():
        return False
    probe = subprocess.run(
        [str(python), "-c", "import sys; print(sys.version_info[:2] >= (3, 11))"],
        capture_output=True,
        text=True,
        check=False,
    )
    return probe.returncode == 0 and probe.stdout.strip() == "True"


def setup() -> None:
    """Create .venv and install nimbus with its dev extra, unless already done."""
    check_python()
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if not venv_python_ok():
        if VENV.exists():
            say(f"{VENV} is broken or uses an old Python; recreating it")
            shutil.rmtree(VENV)
        say(f"creating {VENV} with {sys.executable} ({sys.version.split()[0]})")
        if run([sys.executable, "-m", "venv", str(VENV)]) != 0:
            say("could not create the virtualenv (on Debian/Ubuntu: apt install python3-venv)")
            sys.exit(1)
    elif STAMP.exists() and STAMP.read_text().strip() == digest:
        return
    pip = [str(BIN / "python"), "-m", "pip", "--disable-pip-version-check"]
    if run([*pip, "install", "--quiet", "--upgrade", "pip"]) != 0:
        say("could not upgrade pip (is PyPI reachable?)")
        sys.exit(1)
    if run([*pip, "install", "--quiet", "-e", ".[dev]"]) != 0:
        say("pip install -e '.[dev]' failed; see the output above")
        sys.exit(1)
    STAMP.write_text(digest + "\n")


def cmd_demo(args: list[str]) -> int:
    setup()
    return run([str(BIN / "nimbus"), "demo", *args])


def cmd_test(args: list[str]) -> int:
    setup()
    steps = [
        ("ruff check", [str(BIN / "ruff"), "check", "."]),
        ("ruff format", [str(BIN / "ruff"), "format", "--check", "."]),
        ("mypy", [str(BIN / "mypy"), "src/nimbus"]),
        ("pytest", [str(BIN / "pytest"), *args]),
    ]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("VIRTUAL_ENV", None)
    results: list[tuple[str, str, float]] = []
    failed = False
    for name, cmd in steps:
        if failed:
            results.append((name, "skipped", 0.0))
            continue
        start = time.monotonic()
        code = run(cmd, env=env)
        elapsed = time.monotonic() - start
        if code == 0:
            results.append((name, "ok", elapsed))
        else:
            results.append((name, f"FAILED (exit {code})", elapsed))
            failed = True
    print("\n==== dev.py test summary ====", file=sys.stderr)
    for name, outcome, elapsed in results:
        timing = f"{elapsed:6.1f}s" if outcome != "skipped" else "       "
        print(f"  {name:<12} {timing}  {outcome}", file=sys.stderr)
    print("  result: " + ("FAILED" if failed else "all checks passed"), file=sys.stderr)
    return 1 if failed else 0


COMMANDS = {"demo": cmd_demo, "test": cmd_test}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print((__doc__ or "").strip(), file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
