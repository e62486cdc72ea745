"""The local sites: the root's warm workers, asked directly or by relay.

::

    root process                                    a child (or grandchild ...) process
    ------------                                    -----------------------------------
    LocalSite: Executor (warm workers) <-- start -- RelayedSite: Client(relay socket, authkey)
               relay listener ------- forked pid, exit code ------->  its Popens
                |  submit start(...)
                v
             warm worker forks the new process; its reaper's exit notice comes back

The program's root runs the warm workers, forks of itself (the ``forked``
backend): it has nimbus and the program's modules imported, so its first
start does not wait for new interpreters to import them; each worker still
imports the main module as ``__mp_main__`` (spawn's semantics, as before).
A process that the program started
(a task on a warm worker) does not start warm workers of its own: it asks the
root to start its children through the root's *relay*, a Unix socket in the
user's private runtime directory, authenticated with the program's authkey
like the stdlib's forkserver. So a child that starts children pays a few
milliseconds per start, as the root does, not a second cold start. A process
that cannot reach the relay (it runs on another host, or the root is gone)
falls back to warm workers of its own.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import os
import socket
import threading
import time
import traceback
import uuid
from concurrent.futures import Future
from multiprocessing import (
    AuthenticationError,
    connection,
    current_process,
    resource_sharer,
    resource_tracker,
    util,
)
from pathlib import Path
from typing import Any

from nimbus.backends import local as _backend  # noqa: F401  (the forked backend, imported now)
from nimbus.config import Settings
from nimbus.executor import Executor
from nimbus.multiprocessing._site import Site, StartFn
from nimbus.statestore import Program, is_root, later

__all__ = [
    "LocalSite",
    "RelayedSite",
    "relay_address",
    "relayed",
    "set_relay_address",
]


class _Here(Site):
    """A site on this host: children are signalled by pid and share this process's
    resource tracker, and its stdout/stderr when they moved since the workers started."""

    same_host = True

    def __init__(self, program: Program) -> None:
        super().__init__(program)
        self.stdio = _stdio_ids()  # what the workers inherited

    def signal(self, token: str, forked: Future[int], sig: int) -> None:
        try:
            os.kill(forked.result(), sig)
        except ProcessLookupError:
            pass

    def prepare(self, prep: dict[str, Any]) -> None:
        prep["stdio"] = self.redirected_stdio()
        prep["relay"] = relay_address()
        prep["tracker"] = _tracker()

    def redirected_stdio(self) -> list[Any] | None:
        """Handles to this process's stdout/stderr if they changed since the workers started."""
        if _stdio_ids() == self.stdio:
            return None
        return [resource_sharer.DupFd(fd) for fd in (1, 2)]


class LocalSite(_Here):
    """The root's warm workers, and the relay that its descendants start processes through."""

    imports_main = True  # its first start imports the main module in a worker

    def __init__(self, program: Program, preload: list[str]) -> None:
        super().__init__(program)
        self.remote: dict[str, _Peer] = {}  # token -> the descendant that asked
        self.closed = False
        directory = Settings.load().ensure_runtime_dir()
        later(functools.partial(_remove_stale, directory))  # (off the first start)
        address = str(directory / f"relay-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.listener = connection.Listener(
            address, "AF_UNIX", authkey=bytes(current_process().authkey)
        )
        self.address = address
        # a root's workers are forks of it (it has nimbus and the program imported); a
        # process the program started that cannot reach the relay starts new interpreters.
        # The executor's thread forks them while this one goes on, and the chores' thread
        # sweeps beside it: each descriptor of a sweep is opened and closed under
        # popen_fork.no_fork(), so that no worker keeps one (nor its children)
        backend = "forked" if is_root() else "local"
        if backend == "forked":  # each imports the main module as it is forked
            from nimbus.multiprocessing import _main
            from nimbus.runtime import popen_fork

            ahead = _main.main_ahead()
            if ahead is not None:
                main = functools.partial(_main.import_main_ahead, ahead)
                popen_fork.at_worker_start(main, once=True)  # the first (its first start)
        # shut down by close(), after joining children
        self.executor = Executor(
            backend=backend,
            on_notice=self.notice,
            preload=preload,
            shutdown_at_exit=False,
            _program=False,  # its processes adopt the program themselves
        )
        threading.Thread(target=self._accept, name="nimbus-relay", daemon=True).start()

    def start(self, fn: StartFn, token: str, *args: Any) -> Future[int]:
        return self.executor.submit(fn, token, *args)

    def notice(self, payload: Any) -> None:
        if not (isinstance(payload, list) and payload and payload[0] == "exit"):
            return
        _, token, code = payload
        with self.lock:
            peer = self.remote.pop(token, None)
        if peer is not None:
            peer.send(("exit", token, code))
        else:
            self.exited(token, code)

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except AuthenticationError:
                continue  # not one of ours: refused by the challenge
            except OSError:
                return  # closed
            peer = _Peer(conn)
            threading.Thread(
                target=self._serve, args=(peer,), name="nimbus-relay-peer", daemon=True
            ).start()

    def _serve(self, peer: _Peer) -> None:
        """Start what one descendant asks for; tell it each pid and exit code."""
        while True:
            try:
                fn, token, args = peer.conn.recv()
            except (EOFError, OSError):
                break
            with self.lock:
                self.remote[token] = peer
            try:
                future = self.start(fn, token, *args)
            except Exception as exc:  # e.g. the executor is shut down: the program is ending
                with self.lock:
                    self.remote.pop(token, None)
                peer.send(("failed", token, "".join(traceback.format_exception(exc))))
                continue
            future.add_done_callback(functools.partial(peer.forked, token))
        peer.close()

    def close(self) -> None:
        """At exit: join children, stop the relay and the workers."""
        if os.getpid() != self.pid or self.closed:
            return
        self.closed = True
        self.join_children()
        try:
            self.listener.close()  # unlinks the socket
        except OSError:
            pass
        self.executor.shutdown(wait=True)


class _Peer:
    """The root's end of one descendant's relay connection."""

    def __init__(self, conn: connection.Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        with self.lock:
            try:
                self.conn.send(message)
            except OSError:
                pass  # it is gone; its children die with the program

    def forked(self, token: str, future: Future[int]) -> None:
        exc = None if future.cancelled() else future.exception()
        if exc is None:
            self.send(("forked", token, future.result()))
        else:
            self.send(("failed", token, "".join(traceback.format_exception(exc))))

    def close(self) -> None:
        with self.lock:
            self.conn.close()


class RelayedSite(_Here):
    """A descendant's site: its starts go to the root through the relay."""

    imports_main = False  # the root's first start did

    def __init__(self, program: Program, address: str) -> None:
        super().__init__(program)
        self.conn = connection.Client(address, "AF_UNIX", authkey=bytes(current_process().authkey))
        self.address = address
        self.pending: dict[str, Future[int]] = {}
        self.send_lock = threading.Lock()
        threading.Thread(target=self._read, name="nimbus-relay", daemon=True).start()

    def start(self, fn: StartFn, token: str, *args: Any) -> Future[int]:
        rest = args
        future: Future[int] = Future()
        with self.lock:
            self.pending[token] = future
        try:
            with self.send_lock:
                self.conn.send((fn, token, rest))
        except OSError as exc:
            with self.lock:
                self.pending.pop(token, None)
            raise OSError(f"the program's root process is gone: {exc}") from exc
        return future

    def _read(self) -> None:
        while True:
            try:
                what, token, value = self.conn.recv()
            except (EOFError, OSError):
                break
            if what == "exit":
                self.exited(token, value)
                continue
            with self.lock:
                future = self.pending.pop(token, None)
            if future is None:
                continue
            if what == "forked":
                future.set_result(value)
            else:
                future.set_exception(RuntimeError(f"the process could not start:\n{value}"))
        # the root is gone (the program ends): nothing will start or report any more
        with self.lock:
            pending, self.pending = list(self.pending.values()), {}
            popens, self.popens = list(self.popens.values()), {}
        for future in pending:
            future.set_exception(OSError("the program's root process is gone"))
        for popen in popens:
            popen._exited(1)

    def close(self) -> None:
        if os.getpid() != self.pid:
            return
        self.join_children()
        self.conn.close()


def _remove_stale(directory: Path) -> None:
    """Remove what programs that died without a word (SIGKILL) left in the runtime
    directory, in one pass as a program starts: the relay sockets of dead roots (a
    reused pid is told by its start time, later than its socket's), and the messaging
    sockets no process listens on, with their program's directory (``m-<id>``).

    It runs on the chores' thread while warm workers are forked: every descriptor it
    opens is closed before a fork (``_no_fork``), none is a worker's."""
    names = _listdir(directory)
    for name in fnmatch.filter(names, "relay-*"):
        path = directory / name
        try:
            if not _alive_since(int(name.split("-")[1]), path.lstat().st_mtime):
                path.unlink(missing_ok=True)
        except (ValueError, IndexError, OSError):
            pass  # not ours
    folders = [
        (
            directory / d,
            [directory / d / s for s in fnmatch.filter(_listdir(directory / d), "*.sock")],
        )
        for d in fnmatch.filter(names, "m-*")
    ]
    bound = _bound_sockets()  # read after the listing: a socket bound before it is here
    if bound is None:
        return
    for folder, sockets in folders:
        removed = 0
        for sock in sockets:
            if str(sock) not in bound and _refused(sock):
                sock.unlink(missing_ok=True)
                removed += 1
        try:
            old = time.time() - folder.stat().st_mtime > _EMPTY_GRACE_S
            if (removed or old) and not _listdir(folder):
                folder.rmdir()  # (a program binding its first socket now makes it again)
        except OSError:
            pass


def _no_fork() -> contextlib.AbstractContextManager[None]:
    """No warm worker is forked meanwhile (a descriptor opened inside is none of theirs)."""
    from nimbus.runtime import popen_fork

    return popen_fork.no_fork()


def _listdir(directory: Path) -> list[str]:
    """The names in ``directory`` ([] if it cannot be read)."""
    try:
        with _no_fork():
            return os.listdir(directory)
    except OSError:
        return []


_EMPTY_GRACE_S = 60.0  # an empty m-<id> of no dead socket is removed only this old


def _alive_since(pid: int, when: float) -> bool:
    """Whether process ``pid`` runs and started by ``when`` (else it is a reused pid)."""
    try:
        with _no_fork(), open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with _no_fork(), open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime"))
    except FileNotFoundError:
        return False
    except (OSError, StopIteration, IndexError, ValueError):
        try:  # no /proc: whether it runs
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass
        return True
    if fields[0] == b"Z":
        return False
    started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return started <= when + 1.0  # btime is in whole seconds


def _bound_sockets() -> set[str] | None:
    """The paths of the Unix sockets bound in this network namespace (None: unknown)."""
    try:
        with _no_fork(), open("/proc/net/unix") as f:
            return {parts[7] for line in f if len(parts := line.split()) >= 8}
    except OSError:
        return None


def _refused(path: Path) -> bool:
    """Whether no process listens on the Unix socket ``path`` (one in another network
    namespace is not in this one's list, but it accepts)."""
    with _no_fork():  # (0.2 s at most: a listener that does not accept)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(0.2)
            probe.connect(str(path))
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
        finally:
            probe.close()
    return False


def _stdio_ids() -> list[tuple[int, int] | None]:
    ids: list[tuple[int, int] | None] = []
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
            ids.append((st.st_dev, st.st_ino))
        except OSError:
            ids.append(None)
    return ids


_relay: str | None = None  # the root's relay, for a process the program started


def set_relay_address(address: str | None) -> None:
    """In a started process: where the program's root takes start requests."""
    global _relay
    _relay = address


def relay_address() -> str | None:
    """The relay that this process's children use to start theirs."""
    from nimbus.multiprocessing._site import this_site

    found = this_site()
    if isinstance(found, LocalSite):
        return found.address
    return _relay


def relayed(program: Program) -> RelayedSite | None:
    """A site that starts through the root's relay, if this process was given one and
    reaches it (else None: it runs warm workers of its own)."""
    if _relay is None:
        return None
    try:
        return RelayedSite(program, _relay)
    except (OSError, AuthenticationError) as exc:
        util.debug(f"nimbus: relay {_relay} unreachable ({exc}); own workers")
        return None


def _tracker() -> tuple[int, int] | None:
    """This process's resource tracker, if it runs one: (pid, fd of its pipe).

    A stdlib child shares its parent's tracker (spawn passes the fd), so a
    ``SharedMemory`` it attaches is not unlinked when it exits; ours, forked
    by a worker, opens the same pipe through ``/proc``.
    """
    fd = resource_tracker._resource_tracker._fd
    return None if fd is None else (os.getpid(), fd)
