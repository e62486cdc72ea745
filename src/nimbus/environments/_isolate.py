"""How a worker is started inside a sandbox (bubblewrap) or a container (podman).

Both are a prefix of the worker's command line (a *wrap*) in which ``{workdir}``
stands for the worker's own writable directory (made per worker by
:meth:`Prepared.command`).

**bubblewrap** (``sandbox=True``)::

    prlimit --as=N -- bwrap --unshare-net --unshare-pid --unshare-ipc --unshare-uts
        --die-with-parent --ro-bind / / --dev /dev --proc /proc --tmpfs /tmp
        --ro-bind P P ...            (the Python, nimbus, the virtualenv, if under /tmp)
        --bind {workdir} {workdir} --chdir {workdir}  -- python ...

no network but loopback of its own, the whole system read-only, a private
``/tmp``, one writable directory, its own process tree, and an address-space
limit (``sandbox_memory``). The channel to the manager is an inherited socket:
it needs no network.

**podman** (``image=...``), with runc::

    bash -c LAUNCH podman run --rm -i --pull=never --runtime runc --env-host
        -v P:P:ro ... -v {workdir}:{workdir} -w {workdir} IMAGE python ...

The image supplies the system (its libraries, files, tools); the node's Python
and nimbus are mounted read-only at their own paths, so the versions always
match the node's. An image is never pulled: it must be on the node
(``podman image exists``). The network is the host's unless ``sandbox=True``
too (then none, a read-only root and no capabilities). LAUNCH passes the
worker's inherited descriptors into the container (``--preserve-fds``, which
wants 3..N all open: the gaps are filled with ``/dev/null``), and removes the
container when the worker's process is killed (a timeout, a cancel).
"""

from __future__ import annotations

import os
import resource
import shutil
import sys
from collections.abc import Iterable

from nimbus.environments._spec import Environment
from nimbus.errors import EnvironmentBuildError

__all__ = ["WORKDIR", "bwrap_wrap", "podman_wrap", "require"]

WORKDIR = "{workdir}"
CONTAINER_NPROC = 4096  # processes of a container worker (podman's default is refused here)

# Fill the descriptor gaps below the highest inherited one and run podman with
# --preserve-fds inserted after "podman run", under a unique --name. A guard (a
# process substitution reading a pipe only this bash writes) removes the container
# when this bash dies, even of SIGKILL (a manager stopping a worker): podman's own
# CLI dying would leave the container running. After a normal exit the guard is
# stopped instead.
LAUNCH = (
    "top=2; for f in /proc/$$/fd/*; do n=${f##*/}; "
    '[ "$n" -gt "$top" ] && [ "$n" -lt 255 ] && [ -e "$f" ] && top=$n; done; '
    'for ((i=3; i<top; i++)); do [ -e /proc/$$/fd/$i ] || eval "exec $i</dev/null"; done; '
    'pf=(); [ "$top" -gt 2 ] && pf=(--preserve-fds=$((top-2))); '
    "name=nimbus-$$-$RANDOM$RANDOM; "
    'exec {guard}> >(for ((i=3; i<=top; i++)); do eval "exec $i>&-"; done; '
    'read -r _; exec "$1" rm -f -t 0 "$name" >/dev/null 2>&1); guarded=$!; '
    '"$1" "$2" --name "$name" "${pf[@]}" "${@:3}" {guard}>&-; rc=$?; '
    'kill "$guarded" 2>/dev/null; exit $rc'
)

INSTALL_HINT = "apt-get install -y podman runc bubblewrap (as root)"


def require(tool: str, env: Environment) -> str:
    found = shutil.which(tool)
    if found is None:
        raise EnvironmentBuildError(
            f"environment {env.name!r} needs {tool}, which is not installed on this node: "
            f"{INSTALL_HINT}",
            env.name,
            env.key,
        )
    return found


def _under_tmp(paths: Iterable[str]) -> list[str]:
    out = []
    for path in paths:
        if (path == "/tmp" or path.startswith("/tmp/")) and os.path.exists(path):
            out.append(path)
    return out


def bwrap_wrap(env: Environment, grants: Iterable[str], memory: int) -> tuple[str, ...]:
    """The prefix that runs a worker of ``env`` in a bubblewrap sandbox."""
    bwrap = require("bwrap", env)
    prlimit = require("prlimit", env)
    wrap = [
        prlimit,
        f"--as={memory}",
        "--",
        bwrap,
        "--unshare-net",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--die-with-parent",
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        "/tmp",
    ]
    for path in _under_tmp(grants):  # hidden by the private /tmp: shown again, read-only
        wrap += ["--ro-bind", path, path]
    wrap += [
        "--bind",
        WORKDIR,
        WORKDIR,
        "--chdir",
        WORKDIR,
        "--setenv",
        "HOME",
        WORKDIR,
        "--setenv",
        "TMPDIR",
        "/tmp",
        "--",
    ]
    return tuple(wrap)


def podman_wrap(env: Environment, grants: Iterable[str], memory: int) -> tuple[str, ...]:
    """The prefix that runs a worker of ``env`` in a podman container of its image."""
    assert env.image is not None
    podman = require("podman", env)
    require("runc", env)
    bash = require("bash", env)
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    nproc = min(CONTAINER_NPROC, resource.getrlimit(resource.RLIMIT_NPROC)[1])
    wrap = [
        bash,
        "-c",
        LAUNCH,
        "nimbus-podman",
        podman,
        "run",
        "--rm",
        "-i",
        "--pull=never",
        "--runtime",
        "runc",
        "--log-driver",
        "none",
        "--env-host",
        f"--ulimit=nofile={nofile[0]}:{nofile[1]}",
        f"--ulimit=nproc={nproc}:{nproc}",
        f"--ulimit=data={memory}:{memory}",  # podman has no "as": data (heap, mmap)
    ]
    if env.sandbox:
        wrap += [
            "--network=none",
            "--read-only",
            "--cap-drop=all",
            "--security-opt=no-new-privileges",
        ]
    else:
        wrap += ["--network=host"]
    prefixes = {sys.base_prefix, sys.prefix}
    for path in sorted({*prefixes, *grants}):
        if os.path.exists(path):
            wrap += ["-v", f"{path}:{path}:ro"]
    wrap += [
        "-v",
        f"{WORKDIR}:{WORKDIR}",
        "-w",
        WORKDIR,
        "-e",
        f"HOME={WORKDIR}",
        "-e",
        "TMPDIR=/tmp",
        env.image,
    ]
    return tuple(wrap)
