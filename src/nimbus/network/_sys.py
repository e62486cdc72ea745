"""Running ``ip``, ``tc`` and ``iptables``: one place, failures as one clear line.

Every command that sets up a worker's network goes through :func:`run`; a
failure raises :class:`~nimbus.errors.ConfigError` naming the command, what it
said, and what to change (root, or ``net_accounting=socket``).
"""

from __future__ import annotations

import os
import shutil
import subprocess

from nimbus.errors import ConfigError

__all__ = ["FIX", "can_manage", "run", "try_run"]

FIX = "run the endpoint as root, or set net_accounting=socket and no worker limits"


def can_manage() -> str | None:
    """None if this process may make namespaces, veths and tc rules; else why not."""
    if os.geteuid() != 0:
        return "network namespaces, veth links and tc need root (this process is not root)"
    for tool in ("ip", "tc", "iptables", "nsenter"):
        if shutil.which(tool) is None:
            return f"the command {tool!r} is not installed"
    return None


def run(*argv: str, stdin: str | None = None) -> str:
    """Run one command; its output, or a ConfigError naming it and the fix."""
    try:
        done = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"worker network: {' '.join(argv[:4])} failed ({exc}); {FIX}") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise ConfigError(
            f"worker network: {' '.join(argv[:6])} failed: {' / '.join(said) if said else done.returncode}"
            f"; {FIX}"
        )
    return done.stdout


def try_run(*argv: str, stdin: str | None = None) -> bool:
    """Run a clean-up command; False if it failed (the thing was gone already)."""
    try:
        return (
            subprocess.run(
                argv, input=stdin, capture_output=True, text=True, timeout=30, check=False
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
