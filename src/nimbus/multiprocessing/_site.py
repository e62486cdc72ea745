"""Sites: where a program's processes run. Local or remote is decided here, once.

::

                      open_program(settings)                site()
                      (a root's first program())            (a process's first start)
                                |                              |
           NIMBUS_ENDPOINT set? +-- yes: the store the         +-- program remote?  RemoteSite
                                |   service hands out             (``_remote``: the endpoint's
                                |   (ServiceBackend.open_store)    workers, via the service)
                                +-- no: the settings' store    +-- relay to a root? RelayedSite
                                    + this host's shared           (``_local``: ask the root)
                                    memory for Values/Arrays   +-- else:            LocalSite
                                                                   (``_local``: warm workers)

    Popen.__init__ -> site.prepare(prep); site.start(_forking.start, token, ...) -> Future[pid]
    Popen.terminate/kill -> site.signal(token, forked, sig)
    Ctrl-C passed on     -> site.signal_nowait(token, pid, sig)   (from the signal handler)
    an exit code arrives  -> site.exited(token, code) -> Popen._exited(code)

A :class:`Site` starts processes (:meth:`Site.start`), signals them
(:meth:`Site.signal`) and is closed at exit (:meth:`Site.close`, after joining
them); around those it keeps the program's Popens by token, so that an exit
(which may come before ``start`` returns) reaches its Popen. Every other
module asks the site: nothing else branches on local or remote.
"""

from __future__ import annotations

import functools
import os
import pickle
import re
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing import process as stdlib_process
from multiprocessing import util
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

from nimbus import serialization, statestore
from nimbus.config import Settings
from nimbus.errors import ConfigError, SerializationError
from nimbus.multiprocessing import _heap as heap
from nimbus.statestore import Keys, Program, Root, StateStore, adopt, current, is_root, program

if TYPE_CHECKING:
    from nimbus.multiprocessing.popen_nimbus import Popen

__all__ = [
    "Site",
    "StartFn",
    "adopt",
    "cpu_count",
    "current",
    "dumps",
    "is_root",
    "main_by_value",
    "main_guarded",
    "main_sent_by_value",
    "on_shared_endpoint",
    "open_program",
    "program",
    "refuse_in_sandbox",
    "shared_program",
    "site",
]

StartFn = Callable[..., int]


class Site(ABC):
    """Where this process's children run: start them, signal them, learn their exits."""

    imports_main = False  # its first start imports the main module in a worker (awaited)
    same_host = False  # its children run on this host (they write their exit to the Popen)

    def __init__(self, program: Program) -> None:
        self.program = program
        self.popens: dict[str, Popen] = {}
        self.early: dict[str, int] = {}  # exits reported before start() finished
        self.lock = threading.Lock()
        self.pid = os.getpid()
        # after multiprocessing's own exit work (a Pool's clean-up may start processes),
        # before the program's store closes (-100)
        util.Finalize(None, self.close, exitpriority=-50)

    @abstractmethod
    def start(self, fn: StartFn, token: str, *args: Any) -> Future[int]:
        """Have a warm worker call ``fn(token, *args)`` (it forks); the future holds the pid."""

    @abstractmethod
    def signal(self, token: str, forked: Future[int], sig: int) -> None:
        """Send ``sig`` to process ``token`` (``forked``: what :meth:`start` returned)."""

    @abstractmethod
    def close(self) -> None:
        """At exit: join the children, stop what starts them."""

    def signal_nowait(self, token: str, pid: int, sig: int) -> None:
        """Send ``sig`` to process ``token`` (whose ``pid`` is known), from a signal
        handler: taking no lock and waiting for nothing. By pid, here: a site whose
        children run on another host says otherwise."""
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def prepare(self, prep: dict[str, Any]) -> None:
        """Add to a child's preparation data what it needs to know of this site:
        by default nothing but that it has no relay to start its own children through."""
        prep["relay"] = None

    # -- their exits, which may come before start() has returned

    def register(self, token: str, popen: Popen) -> None:
        with self.lock:
            code = self.early.pop(token, None)
            if code is None:
                self.popens[token] = popen
                return
        popen._exited(code)

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

    def join_children(self) -> None:
        """At exit: end daemonic children, join the others (as the stdlib's exit does)."""
        from nimbus.multiprocessing.popen_nimbus import Popen

        for child in stdlib_process.active_children():
            if isinstance(getattr(child, "_popen", None), Popen) and child.daemon:
                child.terminate()
        for child in stdlib_process.active_children():
            if isinstance(getattr(child, "_popen", None), Popen):
                child.join()


_site: Site | None = None
_site_lock = threading.Lock()


def _unlock_in_child() -> None:
    """A fork's copy of the lock: the root's warm workers are forked (by the manager's
    thread) while this process may be making its site under the lock."""
    global _site_lock
    _site_lock = threading.Lock()


os.register_at_fork(after_in_child=_unlock_in_child)


def site(preload: list[str]) -> Site:
    """This process's site (made on first use): the endpoint's workers for a remote
    program, else the root's warm workers, asked directly or through its relay."""
    global _site
    with _site_lock:
        if _site is None or _site.pid != os.getpid():
            from nimbus.multiprocessing import _local

            _site = None
            prog = program()
            if prog.remote:
                from nimbus.multiprocessing._remote import RemoteSite

                _site = RemoteSite(prog)
            else:
                _site = _local.relayed(prog)
            if _site is None:
                _site = _local.LocalSite(prog, preload)
        return _site


def shared_program() -> Program:
    """The program, for a shared object made in this process (a Queue, a lock ...).

    Such an object uses the store, so the store's client (redis-py, and
    messaging on it) is imported now, not at the package's import (a program
    that only starts processes never needs it): in a root, before it forks
    its warm workers, which then have it, as have the processes they start
    (each would import it at its first use otherwise).
    """
    refuse_in_sandbox()
    _import_clients()
    return program()


def refuse_in_sandbox() -> None:
    """Raise ``ConfigError`` if the program's processes run in a sandbox, which cannot
    reach its shared state (the store, this host's shared memory and pipes)."""
    _refuse_in_sandbox(Settings.lookup("environment"))


@functools.lru_cache(maxsize=4)
def _refuse_in_sandbox(environment: str | None) -> None:
    """Shared state lives in the program's store (and this host's shared memory), which a
    process in a sandbox (``Environment(sandbox=True)``: no network, its own /tmp, /dev
    and IPC) cannot reach: a shared object made for such processes would leave them
    waiting for ever. It is refused here, where it is made, saying so."""
    if not environment or environment.lower() == "none":
        return
    from nimbus.environments import resolve

    try:
        env = resolve(environment)
    except ConfigError:
        return  # (the program's Executor says what is wrong with it)
    if env.sandbox:
        raise ConfigError(
            f"the program's processes run in the sandboxed environment {env.name!r} "
            f"(NIMBUS_ENVIRONMENT, sandbox=True), which cannot reach the program's state "
            f"store: shared state (Pool, Queue, Pipe, Lock, Value, Array) is not available "
            f"in a sandbox; use an environment without sandbox=True, or Process with "
            f"arguments and exit codes alone, or nimbus.Executor, whose tasks return results"
        )


@functools.cache
def _import_clients() -> None:
    import redis  # noqa: F401

    import nimbus.messaging  # noqa: F401


def this_site() -> Site | None:
    """This process's site if it has made one (never makes one)."""
    found = _site
    return found if found is not None and found.pid == os.getpid() else None


# ---------------------------------------------------------------- the program's store


class _EndpointRoot(Root):
    """The root of a program on an endpoint: what the service said of the endpoint."""

    def __init__(self, store: StateStore, program: Program, workers: int, yours: bool) -> None:
        super().__init__(store, program)
        self.workers = workers
        self.shared_endpoint = not yours


def open_program(settings: Settings) -> Root:
    """How a root opens its program (``statestore.program()``'s opener).

    With ``NIMBUS_ENDPOINT``: the store the service hands out for the endpoint,
    under this user's key prefix. Else the settings' store, with the program's
    Values and Arrays in this host's shared memory (unless
    ``NIMBUS_SHARED_MEMORY=0``), removed at the root's exit.
    """
    if settings.endpoint:
        from nimbus.backends.service import ServiceBackend

        handed = ServiceBackend.open_store(settings)
        program_id = f"{handed.key_prefix}.{Keys.program_id_new()}"
        prog = Program(handed.url, program_id, settings.key_ttl, True, endpoint=handed.endpoint_id)
        return _EndpointRoot(StateStore(handed.url), prog, handed.workers, handed.yours)
    # processes on a provider's nodes (NIMBUS_PROVIDER=slurm) are remote: their output
    # and exits come through the store, which they reach over TCP, and this host's
    # memory is not theirs
    remote = settings.provider != "local"
    if remote:
        from nimbus.providers import store_for_nodes

        store = store_for_nodes(settings)
        store.stop_at_close_only()  # Pools' and Queues' exit finalizers still use it
    else:
        store = statestore.open_store(settings)  # booting while the program goes on
    program_id = Keys.program_id_new()
    shared = None
    if settings.shared_memory and not remote:
        shared = heap.directory(settings.runtime_dir, program_id)
    on_close = None if shared is None else functools.partial(heap.remove, shared)
    prog = Program(store.url, program_id, settings.key_ttl, remote=remote, shared=shared)
    return Root(store, prog, on_close)


statestore.set_opener(open_program)


def cpu_count() -> int:
    """The workers the backend offers: the cores of this machine (``NIMBUS_WORKERS``),
    or with ``NIMBUS_ENDPOINT`` the endpoint's workers."""
    settings = Settings.load()
    if settings.endpoint and is_root():
        program(settings)
        root = statestore.root()
        if isinstance(root, _EndpointRoot) and root.workers:
            return root.workers
    return settings.workers or (os.cpu_count() or 1)


def on_shared_endpoint() -> bool:
    """Whether this root's processes run on an endpoint someone else runs (shared with us)."""
    root = statestore.root()
    return isinstance(root, _EndpointRoot) and root.shared_endpoint


# ---------------------------------------------------------------- what goes to a child


@functools.cache
def main_by_value() -> bool:
    """Whether ``__main__`` must travel by value: children cannot import it (an
    interactive session, ``python -c``, or ``python - < script.py``: no file)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    path = getattr(main, "__file__", None)
    if path is None or not os.path.isfile(path):
        return getattr(spec, "name", None) is None
    from nimbus import _install

    # under `nimbus run` (or install()) an unmodified fork-style program runs; with nimbus
    # imported by name, the README's guard is asked for, with the stdlib's own message
    return _install.installed() and not _guarded(path)


def main_sent_by_value() -> bool:
    """Whether the functions and classes of ``__main__`` go to children by value, with the
    globals they read: when they cannot import it (:func:`main_by_value`), and under
    ``nimbus run`` (or ``install()``) for a guarded main too, whose workers import it
    without its guarded block: what that block set up (a global, a function defined
    there) reaches the children as a forked child has it (``_mainspace``)."""
    from nimbus import _install

    return main_by_value() or _install.installed()


@functools.cache
def main_guarded() -> bool:
    """Whether the main module is a file with an ``if __name__ == "__main__":`` block at
    its top level (its import in a worker starts no processes, as a rule)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return path is not None and os.path.isfile(path) and _guarded(path)


_GUARD = re.compile(
    rb"^if\s+\(?\s*(__name__\s*==\s*['\"]__main__['\"]|['\"]__main__['\"]\s*==\s*__name__)", re.M
)


def _guarded(path: str) -> bool:
    """Whether the main module at ``path`` has an ``if __name__ == "__main__":`` block at
    its top level. One that has none (fork-style: it starts its processes at its top
    level) is not imported by the children: its names go by value, as fork has them."""
    try:
        with open(path, "rb") as f:
            return _GUARD.search(f.read()) is not None
    except OSError:
        return True


def dumps(obj: object) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Pickle an object that goes to another process of the program.

    As the stdlib does: with its reducers (connections, sockets and fds are
    handed over) and ``__main__`` by reference (children import the main
    module as the stdlib's spawn does), unless the main module cannot be
    imported (``python -c``, an interactive session) or the program runs on a
    remote endpoint (which may not have the script): then by value; under
    ``nimbus run`` a guarded main's functions by value too, with the globals
    they read (:func:`main_sent_by_value`), but for large ones its local
    children imported (``_mainpickle.LARGE_MAIN``).
    """
    from nimbus import _install

    prog = current()
    remote = prog is not None and prog.remote
    unimportable = main_by_value()  # (a file looked at: once a pickle)
    try:
        return serialization.dumps(
            obj,
            reducers=ForkingPickler._extra_reducers,
            main_by_value=unimportable or _install.installed() or remote,
            main_imported=not unimportable and not remote,
        )
    except SerializationError as exc:
        # SerializationError is a TypeError and a PicklingError, what the stdlib
        # raises most; an object's own error (a __reduce__ raising) goes as itself
        cause = exc.__cause__
        if cause is not None and not isinstance(cause, TypeError | pickle.PicklingError):
            raise cause from None
        raise
