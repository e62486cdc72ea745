"""Who starts this process's children: the root's warm workers, asked directly or by relay.

::

    root process                                  a child (or grandchild ...) process
    ------------                                  -----------------------------------
    Runtime: Executor (warm workers) <-- start -- Relayed: Client(relay socket, authkey)
             relay listener --------- forked pid, exit code --------->  its Popens
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

import functools
import os
import sys
import threading
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing import AuthenticationError, connection, current_process, resource_sharer, util
from multiprocessing import process as stdlib_process
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nimbus.config import Settings

if TYPE_CHECKING:
    from nimbus.multiprocessing._remote import Output
    from nimbus.multiprocessing.popen_nimbus import Popen

__all__ = [
    "Relayed",
    "Remote",
    "Runtime",
    "Starter",
    "relay_address",
    "runtime",
    "set_relay_address",
]

StartFn = Callable[..., int]


class Starter:
    """The Popens of this process by token, and their exit codes as they come."""

    output: Output | None = None  # where remote children's output and exits arrive

    def __init__(self) -> None:
        self.popens: dict[str, Popen] = {}
        self.early: dict[str, int] = {}  # exits reported before start() finished
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.stdio = _stdio_ids()  # what the workers inherited
        # after multiprocessing's own exit work (a Pool's clean-up may start processes),
        # before the program's store closes (-100)
        util.Finalize(None, self.close, exitpriority=-50)

    def start(self, fn: StartFn, *args: Any) -> Future[int]:
        """Have a warm worker call ``fn(*args)`` (it forks); the future holds the pid."""
        raise NotImplementedError

    def redirected_stdio(self) -> list[Any] | None:
        """Handles to this process's stdout/stderr if they changed since the workers started."""
        if _stdio_ids() == self.stdio:
            return None
        return [resource_sharer.DupFd(fd) for fd in (1, 2)]

    def exited(self, token: str, code: int) -> None:
        with self.lock:
            popen = self.popens.pop(token, None)
            if popen is None:
                self.early[token] = code
                return
        popen._exited(code)

    def forget(self, token: str) -> None:
        with self.lock:
            self.popens.pop(token, None)

    def register(self, token: str, popen: Popen) -> None:
        with self.lock:
            code = self.early.pop(token, None)
            if code is None:
                self.popens[token] = popen
                return
        popen._exited(code)

    def join_children(self) -> None:
        """At exit: end daemonic children, join the others (as the stdlib's exit does)."""
        from nimbus.multiprocessing.popen_nimbus import Popen

        for child in stdlib_process.active_children():
            if isinstance(getattr(child, "_popen", None), Popen) and child.daemon:
                child.terminate()
        for child in stdlib_process.active_children():
            if isinstance(getattr(child, "_popen", None), Popen):
                child.join()

    def close(self) -> None:
        raise NotImplementedError


class Runtime(Starter):
    """The root's warm workers, and the relay that its descendants start processes through."""

    def __init__(self, preload: list[str]) -> None:
        from nimbus.executor import Executor, _live

        super().__init__()
        from nimbus.multiprocessing import _state

        # a root's workers are forks of it (it has nimbus and the program imported); a
        # process the program started that cannot reach the relay starts new interpreters
        backend = "forked" if _state.is_root() else "local"
        self.executor = Executor(backend=backend, on_notice=self.notice, preload=preload)
        _live.discard(self.executor)  # closed by close(), after joining children
        self.remote: dict[str, _Peer] = {}  # token -> the descendant that asked
        self.closed = False
        directory = Settings.load().ensure_runtime_dir()
        _remove_stale(directory)
        address = str(directory / f"relay-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.listener = connection.Listener(
            address, "AF_UNIX", authkey=bytes(current_process().authkey)
        )
        self.address = address
        threading.Thread(target=self._accept, name="nimbus-relay", daemon=True).start()

    def start(self, fn: StartFn, *args: Any) -> Future[int]:
        return self.executor.submit(fn, *args)

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


class Relayed(Starter):
    """A descendant's runtime: its starts go to the root through the relay."""

    def __init__(self, address: str) -> None:
        super().__init__()
        self.conn = connection.Client(address, "AF_UNIX", authkey=bytes(current_process().authkey))
        self.address = address
        self.pending: dict[str, Future[int]] = {}
        self.send_lock = threading.Lock()
        threading.Thread(target=self._read, name="nimbus-relay", daemon=True).start()

    def start(self, fn: StartFn, *args: Any) -> Future[int]:
        token, rest = args[0], args[1:]
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


class Remote(Starter):
    """The warm workers of the endpoint ``NIMBUS_ENDPOINT`` names, through the service.

    Children's output, exits and signals travel through the program's store
    (``_remote``); none of them reach this machine's relay.
    """

    def __init__(self) -> None:
        from nimbus.executor import Executor, _live
        from nimbus.multiprocessing import _remote, _state

        super().__init__()
        settings = Settings.load()
        self.executor = Executor(settings=settings, endpoint=settings.endpoint)
        _live.discard(self.executor)  # closed by close(), after joining children
        self.output = _remote.Output(_state.program(), self.exited, self.lost)

    def start(self, fn: StartFn, *args: Any) -> Future[int]:
        return self.executor.submit(fn, *args)

    def redirected_stdio(self) -> list[Any] | None:
        return None  # the children's output comes through the store

    def lost(self, why: str) -> None:
        """The store is gone: end every child still running with exit code 1, saying why."""
        with self.lock:
            popens, self.popens = self.popens, {}
        if popens:
            sys.stderr.write(f"nimbus: {why}; {len(popens)} process(es) end with exit code 1\n")
            sys.stderr.flush()
        for popen in popens.values():
            popen._exited(1)

    def close(self) -> None:
        if os.getpid() != self.pid:
            return
        self.join_children()
        self.executor.shutdown(wait=True)
        if self.output is not None:
            self.output.close()


def _remove_stale(directory: Path) -> None:
    """Remove the relay sockets of roots that died without closing them (SIGKILL)."""
    for path in directory.glob("relay-*"):
        try:
            os.kill(int(path.name.split("-")[1]), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (ValueError, IndexError, OSError):
            pass  # not ours, or a live process of another user


def _stdio_ids() -> list[tuple[int, int] | None]:
    ids: list[tuple[int, int] | None] = []
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
            ids.append((st.st_dev, st.st_ino))
        except OSError:
            ids.append(None)
    return ids


_runtime: Starter | None = None
_runtime_lock = threading.Lock()


def _unlock_in_child() -> None:
    """A fork's copy of the lock: the root's warm workers are forked (by the manager's
    thread) while this process may be making its runtime under the lock."""
    global _runtime_lock
    _runtime_lock = threading.Lock()


os.register_at_fork(after_in_child=_unlock_in_child)
_relay: str | None = None  # the root's relay, for a process the program started


def set_relay_address(address: str | None) -> None:
    """In a started process: where the program's root takes start requests."""
    global _relay
    _relay = address


def relay_address() -> str | None:
    """The relay that this process's children use to start theirs."""
    rt = _runtime if _runtime is not None and _runtime.pid == os.getpid() else None
    if isinstance(rt, Runtime):
        return rt.address
    return _relay


def runtime(preload: list[str]) -> Starter:
    """This process's runtime: the root's own, or a relay to it (made on first use)."""
    global _runtime
    with _runtime_lock:
        if _runtime is None or _runtime.pid != os.getpid():
            from nimbus.multiprocessing import _state

            _runtime = None
            if _state.program().remote:
                _runtime = Remote()
            elif _relay is not None:
                try:
                    _runtime = Relayed(_relay)
                except (OSError, AuthenticationError) as exc:
                    util.debug(f"nimbus: relay {_relay} unreachable ({exc}); own workers")
            if _runtime is None:
                _runtime = Runtime(preload)
        return _runtime
