"""A program on a remote endpoint: ``NIMBUS_ENDPOINT`` set (and a service login).

::

    parent (this machine)                 endpoint worker (forks)          child process
    ---------------------                 -----------------------          -------------
    ServiceBackend.open_store(): the service
      hands out a Redis URL + the key prefix
    RemoteSite.start: Executor(endpoint) ------> watch_signals(token)
                                                  fork ------------------> fd 1, 2 -> pipes
                                                  deliver_signals(token)   Forwarder thread:
    Output thread: BLPOP stdio:<inbox> <-------- RPUSH ["exit", token] <-- RPUSH ["out"|"err"]
      out/err -> fd 1/2 of the parent             reaper (after waitpid)
      exit -> Popen.returncode
    RemoteSite.signal: RPUSH signal:<token> ---> BLPOP -> os.kill(pid)
    its presence (a connection) <-------------- CLIENT LIST ID: gone -> SIGTERM, SIGKILL
    SIGTERM: passed on (``_terminate``) -------> as RemoteSite.signal

Everything between the parent and its children goes through the program's
state store, which both sides reach: one list of output chunks and exit codes
per parent process (``Keys.stdio(inbox)``: a child's chunks are all pushed
before it exits, so its exit comes after its output; children that start
children have their own inbox) and one list of signals per child
(``Keys.signal``). A child's watcher (the thread that delivers its signals)
holds a store connection whose id the parent learns first: if it closes with
no exit code, the worker died and took the child along (exit code -SIGKILL).
The other way round, the watcher looks every ``CHECK`` seconds for the
parent's presence (``statestore.kept_presence``: a connection the kernel
closes when the parent dies, even by SIGKILL, and that the parent makes again,
under the same name, when the store drops it): once it is gone at two looks,
the child's output and exit code have nowhere to go, and the watcher ends it (SIGTERM, then
SIGKILL ``KILL_AFTER`` seconds later), daemonic or not, as it does when the
store has been unreachable for ``STORE_GRACE`` (the parent has given its
children up by then). A child that started children of its own is one of
their parents: they end after it. A SIGTERM to the parent (``kill``,
``timeout``, a batch scheduler) is passed on to its children first, as a
Ctrl-C is (``_terminate``).
On the endpoint a child runs as a local one does (forked by a warm worker),
except that its stdout and stderr are pipes to the store rather than the
terminal, and the program's ``__main__`` travels by value (the endpoint may
not have the script).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, cast

import msgpack

from nimbus._lazy import lazy
from nimbus.config import Settings
from nimbus.errors import StateStoreError
from nimbus.multiprocessing import _terminate
from nimbus.multiprocessing._site import Site, StartFn, on_shared_endpoint
from nimbus.statestore import Keys, Program, connect, kept_presence, redacted

if TYPE_CHECKING:
    import redis
else:  # imported on first use (redis-py: at the first connection)
    redis = lazy("redis", globals())

__all__ = [
    "Forwarder",
    "Output",
    "RemoteSite",
    "deliver_signals",
    "report_exit",
    "send_signal",
    "watch_signals",
]

CHUNK = 1 << 16
HOLD = 0.05  # seconds a child's line may wait for its end before it goes as it is
WAKE = 1.0  # seconds: how often a blocked reader checks whether it should stop
STORE_GRACE = 5.0  # seconds the store may be unreachable before the children are given up
CHECK = 1.0  # seconds between a watcher's looks for its child's parent
KILL_AFTER = 2.0  # seconds a child whose parent is gone has from SIGTERM to SIGKILL

log = logging.getLogger(__name__)


def _push(program: Program, key: str, *items: bytes | int) -> None:
    client = program.client()
    with client.pipeline(transaction=False) as pipe:
        pipe.rpush(key, *items)
        pipe.pexpire(key, program.ttl_ms)
        pipe.execute()


# ---------------------------------------------------------------- the parent


class Output:
    """The parent's thread that writes its children's output and reports their exits."""

    def __init__(
        self,
        program: Program,
        on_exit: Callable[[str, int], None],
        on_lost: Callable[[str], None],
    ) -> None:
        self.program = program
        self.inbox = Keys.new_name()  # where this process's children report
        self.on_exit = on_exit
        self.on_lost = on_lost  # the store is gone: no exit will come
        self._watched: dict[str, int] = {}  # token -> store client id of its signal watcher
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nimbus-output", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        client = self.program.client()
        key = self.program.keys.stdio(self.inbox)
        checked = time.monotonic()
        failing: float | None = None  # since when the store has not answered
        while not self._stop.is_set():
            try:
                item = client.blpop([key], timeout=WAKE)
                failing = None
                if item is not None:
                    self._handle(cast(bytes, item[1]))
                if self._watched and time.monotonic() - checked >= WAKE:
                    self._check_watchers(client, key)
                    checked = time.monotonic()
            except redis.RedisError as exc:
                now = time.monotonic()
                if failing is None:
                    failing = now
                elif now - failing >= STORE_GRACE:
                    self._watched.clear()
                    self.on_lost(
                        f"lost the program's state store at {redacted(self.program.url)} "
                        f"({type(exc).__name__}: {exc}) for {now - failing:.0f} s: "
                        "the exit codes of its processes on the endpoint cannot arrive"
                    )
                    failing = now  # said once per outage (and again if it lasts)
                if self._stop.wait(WAKE):
                    return

    def _handle(self, message: bytes) -> None:
        kind, token, data = msgpack.unpackb(message)
        if kind == "exit":
            self._watched.pop(token, None)
            self.on_exit(token, data)
        elif kind == "watch":
            self._watched[token] = data
        elif kind in ("out", "err"):
            _write_all(1 if kind == "out" else 2, data)

    def _check_watchers(self, client: redis.Redis, key: str) -> None:
        """Children whose worker is gone (its watcher's connection closed) were killed with it."""
        ids = set(self._watched.values())
        listed = client.execute_command("CLIENT", "LIST", "ID", *ids)
        alive = {int(f[3:]) for f in listed.decode().split() if f.startswith("id=")}
        if ids <= alive:
            return
        while (message := client.lpop(key)) is not None:  # what they sent before going
            self._handle(cast(bytes, message))
        for token, client_id in list(self._watched.items()):
            if client_id not in alive:
                del self._watched[token]
                _write_all(2, f"nimbus: the endpoint worker of process {token} was lost\n".encode())
                self.on_exit(token, -signal.SIGKILL)  # what its child got (PR_SET_PDEATHSIG)

    def close(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(2 * WAKE + 1)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    with contextlib.suppress(OSError):
        while view:
            view = view[os.write(fd, view) :]


def send_signal(program: Program, token: str, sig: int) -> None:
    """Ask the worker that forked process ``token`` to send it ``sig``."""
    try:
        _push(program, program.keys.signal(token), int(sig))
    except redis.RedisError as exc:
        raise StateStoreError(f"cannot signal the remote process: {exc}") from exc


class RemoteSite(Site):
    """The warm workers of the endpoint ``NIMBUS_ENDPOINT`` names, through the service.

    Children's output, exits and signals travel through the program's store;
    none of them reach this machine's relay.
    """

    def __init__(self, program: Program) -> None:
        from nimbus.executor import Executor

        super().__init__(program)
        settings = Settings.load()
        self.executor = Executor(
            settings=settings, endpoint=settings.endpoint, shutdown_at_exit=False, _program=False
        )  # shut down by close(), after joining children
        self.output = Output(program, self.exited, self.lost)
        # signals from a signal handler, sent by a thread (a store call takes locks)
        self._signals: queue.SimpleQueue[tuple[str, int] | None] = queue.SimpleQueue()
        threading.Thread(target=self._send_signals, name="nimbus-signals", daemon=True).start()
        _terminate.pass_on()  # a SIGTERM reaches the children first, as a Ctrl-C does

    def start(self, fn: StartFn, token: str, *args: Any) -> Future[int]:
        return self.executor.submit(fn, token, *args)

    def signal(self, token: str, forked: Future[int], sig: int) -> None:
        send_signal(self.program, token, sig)

    def signal_nowait(self, token: str, pid: int, sig: int) -> None:
        self._signals.put((token, sig))  # (SimpleQueue.put is safe in a signal handler)

    def _send_signals(self) -> None:
        while (item := self._signals.get()) is not None:
            with contextlib.suppress(StateStoreError):  # the store is gone: so are they
                send_signal(self.program, *item)

    def prepare(self, prep: dict[str, Any]) -> None:
        from nimbus.multiprocessing._main import MAIN_KEYS

        prep["forward"] = self.output.inbox  # output through the store; __main__ came by value
        prep["presence"] = kept_presence(self.program.url)  # the child ends when this is gone
        for key in MAIN_KEYS:
            prep.pop(key, None)
        if on_shared_endpoint():  # your token stays off a machine others run
            prep["environ"].pop("NIMBUS_TOKEN", None)
        super().prepare(prep)  # no relay: a relayed child would have no output list to report to
        prep["stdio"] = None  # the children's output comes through the store

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
        self._signals.put(None)
        self.executor.shutdown(wait=True)
        self.output.close()


# ---------------------------------------------------------------- the endpoint worker


def watch_signals(program: Program, inbox: str, token: str) -> redis.Redis:
    """In the worker, before it forks ``token``: the connection of its signal watcher.

    The parent learns its client id (before the child can exit, so before its
    exit code): when that connection closes without an exit code, the worker
    (and with it the child) is gone. :func:`deliver_signals` then uses it.
    """
    client = connect(program.url, own=True, single=True)
    try:
        client_id = client.client_id()
        _push(program, program.keys.stdio(inbox), msgpack.packb(["watch", token, client_id]))
    except BaseException:
        client.close()
        raise
    return client


def deliver_signals(
    client: redis.Redis,
    program: Program,
    token: str,
    alive: Callable[[], bool],
    kill: Callable[[int], None],
    parent: tuple[int, str] | None = None,
    pid: int = 0,
) -> None:
    """A thread that sends process ``token`` the signals its parent asks for, and
    ends it once its parent is gone.

    ``parent``: the parent's presence (its client id and name,
    :func:`statestore.kept_presence`), ``pid``: the child's (for the worker's log),
    looked for every ``CHECK`` seconds; gone at two looks (the parent died, even by
    SIGKILL; a parent alive makes its presence again at once when the store drops it),
    or the store unreachable for ``STORE_GRACE``, the child is ended (:func:`_end`).
    The thread ends when :func:`report_exit` wakes it (or, as a backstop, when
    ``alive()`` turns false).
    """

    def run() -> None:
        key = program.keys.signal(token)
        watched = None if parent is None else (int(parent[0]), str(parent[1]))
        # (None: not looked for, CLIENT LIST not allowed here)
        looked = time.monotonic()
        missed = False  # the parent's presence was not there at the last look
        failing: float | None = None  # since when the store has not answered
        try:
            while alive():
                try:
                    item = client.blpop([key], timeout=CHECK if watched else 30)
                    failing = None
                    sent = None if item is None else cast(bytes, item[1])
                    if sent is None and watched and time.monotonic() - looked >= CHECK:
                        looked = time.monotonic()
                        found = _present(client, *watched)
                        if found is not None:
                            watched, missed = (found, watched[1]), False
                        elif not missed:  # its connection closed: it may be making another
                            missed = True
                        else:
                            sent = cast("bytes | None", client.lpop(key))  # sent as it went
                            if sent is None:
                                _end(f"{token} (pid {pid})", alive, kill, "its parent is gone")
                                break
                    if sent is not None:
                        sig = int(sent)
                        if sig == 0:
                            break
                        kill(sig)
                        looked = time.monotonic()  # (a parent's SIGTERM passed on, then
                        # its end: the child ends by the signal, not by the parent's lapse)
                except redis.ResponseError:  # CLIENT LIST refused: the parent cannot be seen
                    watched = None
                except redis.RedisError:
                    now = time.monotonic()
                    failing = now if failing is None else failing
                    if now - failing >= STORE_GRACE:  # the parent has given it up
                        _end(f"{token} (pid {pid})", alive, kill, "its state store is unreachable")
                        return
                    time.sleep(CHECK)
            with contextlib.suppress(redis.RedisError):
                client.delete(key)
        finally:
            client.close()

    threading.Thread(target=run, name="nimbus-signals", daemon=True).start()


def _present(client: redis.Redis, client_id: int, name: str) -> int | None:
    """The client id of the presence ``name`` (``client_id`` when last seen), if connected."""
    listed = client.execute_command("CLIENT", "LIST", "ID", client_id)
    if f" name={name} ".encode() in listed:
        return client_id
    # gone: its process, alive, may have made it again (the store closed it) under its name
    for line in client.execute_command("CLIENT", "LIST", "TYPE", "normal").splitlines():
        if f" name={name} ".encode() in line:
            return int(line.split(maxsplit=1)[0].removeprefix(b"id="))
    return None


def _end(name: str, alive: Callable[[], bool], kill: Callable[[int], None], why: str) -> None:
    """End process ``name``, whose output and exit code have nowhere to go: SIGTERM
    (a process with children of its own passes it on), SIGKILL if it outlives ``KILL_AFTER``."""
    if not alive():
        return
    log.warning("ending process %s: %s", name, why)
    kill(signal.SIGTERM)
    deadline = time.monotonic() + KILL_AFTER
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive():
        kill(signal.SIGKILL)


def report_exit(program: Program, inbox: str, token: str, code: int) -> None:
    """In the worker: process ``token`` exited with ``code`` (after all its output)."""
    with contextlib.suppress(redis.RedisError):
        _push(program, program.keys.stdio(inbox), msgpack.packb(["exit", token, code]))
        _push(program, program.keys.signal(token), 0)  # ends its signal watcher


# ---------------------------------------------------------------- the child


class Forwarder:
    """In the child: fds 1 and 2 become pipes, and a thread pushes what comes out of them,
    whole lines at a time: a line's start waits up to ``HOLD`` for its end (a pipe's
    stdout is written in 8 KiB blocks, so other children's lines came between its
    halves); a longer wait (a prompt, a progress bar) or ``CHUNK`` bytes go as they are."""

    def __init__(self, program: Program, inbox: str, token: str) -> None:
        self.program = program
        self.key = program.keys.stdio(inbox)
        self.token = token
        self._fds: dict[int, str] = {}
        self._held: dict[int, bytes] = {}  # fd -> the start of a line, not sent yet
        for fd, kind in ((1, "out"), (2, "err")):
            read, write = os.pipe()
            os.dup2(write, fd)
            os.close(write)
            self._fds[read] = kind
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="nimbus-stdio", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        fds = dict(self._fds)
        while fds:
            wait = HOLD if self._held else None
            ready, _, _ = select.select([*fds, self._wake_r], [], [], wait)
            if not ready:  # no line's end came: what was held goes as it is
                for fd in list(self._held):
                    self._send(fds[fd], self._held.pop(fd))
            if self._wake_r in ready:  # the child is done: take what is left, then stop
                for fd in fds:
                    os.set_blocking(fd, False)
                    while self._forward(fd, fds[fd]):
                        pass
                    self._send(fds[fd], self._held.pop(fd, b""))
                return
            for fd in ready:
                if not self._forward(fd, fds[fd]):
                    self._send(fds[fd], self._held.pop(fd, b""))
                    del fds[fd]

    def _forward(self, fd: int, kind: str) -> bool:
        try:
            data = os.read(fd, CHUNK)
        except OSError:  # drained (EAGAIN)
            return False
        if not data:
            return False
        data = self._held.pop(fd, b"") + data
        cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
        if cut == 0 and len(data) < CHUNK:
            self._held[fd] = data
        elif cut == 0 or cut == len(data):
            self._send(kind, data)
        else:
            self._send(kind, data[:cut])
            self._held[fd] = data[cut:]
        return True

    def _send(self, kind: str, data: bytes) -> None:
        if data:
            with contextlib.suppress(redis.RedisError):
                _push(self.program, self.key, msgpack.packb([kind, self.token, data]))

    def close(self) -> None:
        """At the child's exit, after its last flush: push the rest of its output."""
        for fd in (1, 2):
            with contextlib.suppress(OSError):
                os.close(fd)
        os.write(self._wake_w, b"x")
        self._thread.join()
