"""Real workers in environments, for tests and bench/environments.py.

:class:`EnvWorker` starts a real nimbus worker process through
``Prepared.command`` / ``Prepared.environ`` exactly as a manager does (a
socketpair, ``python -u -c WORKER_MAIN FD``) and runs tasks through it over its
channel. :func:`base_image` makes a container image on this machine without any
registry: a root filesystem of the shared libraries the node's Python needs,
plus a marker file, ``podman import``-ed. For the tests of environments through a
service: its ``service`` fixture, ``nimbus environments`` in a process, what an
endpoint reports, a wheel made here.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nimbus import serialization
from nimbus.environments import Prepared
from nimbus.runtime.messages import PYTHON, Kind, Status
from nimbus.runtime.pool import WORKER_MAIN, worker_environment
from nimbus.wire import Channel, pack, unpack

IMAGE = "localhost/nimbus-test-base:1"
MARKER = "/etc/nimbus-test-image"


class EnvWorker:
    """One real worker started in a prepared environment."""

    def __init__(self, prepared: Prepared, *, timeout: float = 60.0) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = prepared.command([sys.executable, "-u", "-c", WORKER_MAIN, str(child.fileno())])
        try:
            self.proc = subprocess.Popen(
                argv,
                pass_fds=(child.fileno(),),
                env=prepared.environ(worker_environment()),
                stdin=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        finally:
            child.close()
        parent.settimeout(timeout)
        self.channel = Channel(parent)
        self.seq = 0
        self.hello: dict[str, Any] | None = None

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the worker; its result, or its exception raised here."""
        self.seq += 1
        fn_bytes = serialization.dumps_function(fn, by_value=True)
        payload, buffers = serialization.dumps((args, {}))
        rows = [[self.seq, f"fn{self.seq}", fn_bytes, payload, len(buffers), False]]
        self.channel.send(Kind.TASKS, pack([PYTHON, rows]), buffers)
        self.channel.flush()
        while True:
            frames = self.channel.receive(block=True)
            if frames is None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"the worker closed its channel: {err[-2000:]}")
            for frame in frames:
                if frame.kind == Kind.HELLO:
                    self.hello = unpack(frame.meta)
                elif frame.kind == Kind.RESULTS:
                    results, _started = unpack(frame.meta)
                    for row in results:
                        status, data = row[1], row[2]
                        if data is None:
                            data = frame.buffers[0]
                        value = serialization.loads(data)
                        if status == Status.OK:
                            return value
                        _error, traceback_text = value
                        raise RuntimeError(f"the task failed in its worker:\n{traceback_text}")

    def close(self) -> None:
        self.channel.sock.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()

    def __enter__(self) -> EnvWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def first_task(prepared: Prepared, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """Start a worker, run one task, stop it: (result, seconds from start to result)."""
    started = time.perf_counter()
    with EnvWorker(prepared) as worker:
        result = worker.run(fn, *args)
        return result, time.perf_counter() - started


# ---------------------------------------------------------------- a base image


def podman_unavailable() -> str | None:
    for tool in ("podman", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install -y podman runc, as root)"
    return None


def _shared_libraries(paths: list[Path]) -> set[str]:
    files = [str(p) for p in paths]
    libs: set[str] = set()
    for start in range(0, len(files), 200):
        out = subprocess.run(
            ["ldd", *files[start : start + 200]], capture_output=True, text=True, check=False
        ).stdout
        libs.update(re.findall(r"(/\S+\.so[^\s:]*) \(0x", out))
    return {lib for lib in libs if not lib.startswith(sys.base_prefix)}


def base_image(workdir: Path) -> str:
    """Import :data:`IMAGE` (if missing): the node Python's shared libraries and a marker."""
    have = subprocess.run(["podman", "image", "exists", IMAGE], check=False).returncode == 0
    if have:
        return IMAGE
    import sysconfig

    objects = [Path(os.path.realpath(sys.executable))]
    objects += list(Path(sys.base_prefix, "lib").glob("libpython*.so*"))
    objects += list(Path(sysconfig.get_path("platstdlib"), "lib-dynload").glob("*.so"))
    for package in ("msgpack", "psutil", "hiredis"):  # what a worker imports, compiled
        objects += list(Path(sysconfig.get_path("platlib"), package).rglob("*.so"))
    rootfs = workdir / "rootfs"
    for name in ("tmp", "etc", "proc", "dev", "sys", "root", "run"):
        (rootfs / name).mkdir(parents=True, exist_ok=True)
    for lib in _shared_libraries(objects) | {"/lib64/ld-linux-x86-64.so.2"}:
        target = rootfs / lib.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if os.path.exists(lib) and not target.exists():
            shutil.copy2(os.path.realpath(lib), target)
    (rootfs / MARKER.lstrip("/")).write_text("made by tests/environment_support.py\n")
    (rootfs / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/false\n")
    tarball = workdir / "rootfs.tar"
    with tarfile.open(tarball, "w") as tar:
        tar.add(rootfs, arcname=".")
    subprocess.run(["podman", "import", "-q", str(tarball), IMAGE], check=True, capture_output=True)
    shutil.rmtree(rootfs, ignore_errors=True)
    tarball.unlink()
    return IMAGE


def remove_image() -> None:
    subprocess.run(["podman", "rmi", "-f", IMAGE], check=False, capture_output=True)


# ---------------------------------------------------------------- through a service

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
)


def environments_service(factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real service for a test module (its ``service`` fixture): the endpoints started
    from its ``env`` build their environments in a directory of its own."""
    from service_support import serve

    yield from serve(factory, NIMBUS_ENVIRONMENTS_DIR=str(factory.mktemp("envs")))


def environments_cli(
    service: Any, token: str, *args: str, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """``nimbus environments ARGS`` as ``token``'s user of ``service``, in a process."""
    from service_support import CLI

    env = service.env | {"NIMBUS_SERVICE_URL": service.url, "NIMBUS_TOKEN": token}
    return subprocess.run(
        [sys.executable, "-c", CLI, "environments", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def rows_until(client: Any, endpoint: str, ok: Any, timeout: float) -> list[dict[str, Any]]:
    """The environments ``endpoint`` reports, once ``ok(rows)`` (its beats carry them)."""
    deadline = time.monotonic() + timeout
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        rows = client.get_endpoint(endpoint)["environments"]
        if ok(rows):
            return rows
        time.sleep(0.3)
    raise AssertionError(f"after {timeout} s the endpoint reports {rows}")


def task_record(client: Any, task_id: str) -> dict[str, Any]:
    return dict(client.get_task(task_id)["record"])


def wheel(where: Path, name: str = "orderpkg", version: str = "1.0") -> str:
    """A pure-Python wheel made here (no package index): ``import orderpkg`` says its version."""
    import base64
    import hashlib
    import zipfile

    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n",
        f"{name}-{version}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        ),
        f"{name}-{version}.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{name}-{version}.dist-info/RECORD,,")
    files[f"{name}-{version}.dist-info/RECORD"] = "\n".join(record) + "\n"
    where.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(where / f"{name}-{version}-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)
    return str(where)
