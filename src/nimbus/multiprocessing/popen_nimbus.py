"""Start a Process on a warm worker: the stdlib's Popen contract, run remotely.

::

    parent: Process.start() -> Popen(process) --task _start(token, data)--> warm worker
                                     |                                        | fork()
            pid <----------------- result ------------------------------------+
                                                                              |  child: _bootstrap()
            returncode, sentinel <- notice ["exit", token, code] <- reaper thread (waitpid)

The warm worker only forks: the child is a copy of an interpreter that has
nimbus and the program's modules already imported, so a Process starts in
a few milliseconds and every started Process runs at once, however many.
Better still, each worker keeps children forked ahead of need (*standbys*,
already connected to the program's store): a start hands the process to one
through a pipe, and the fork is off the start's path. The worker forks one
again as soon as it is idle and the others once it has been quiet a while, so
a burst of starts does not compete with forks for the next.
The worker goes back to serving other starts; a thread in it waits for the
child and reports its exit code, which becomes ``Popen.returncode``, and the
sentinel (a pipe) becomes readable. ``terminate``/``kill`` signal the child
by pid (same host). A child dies with its worker (``PR_SET_PDEATHSIG``).
The warm workers are the program root's; a process the program started asks
the root to start its own children (``_runtime``: the relay).

With ``NIMBUS_ENDPOINT`` set the warm workers are the endpoint's, reached
through the service; exits, output and signals then travel through the
program's state store (see ``_remote``).
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
import pickle
import signal
import sys
import threading
import uuid
from collections.abc import Callable
from multiprocessing import context as stdlib_context
from multiprocessing import process as stdlib_process
from multiprocessing import resource_sharer, resource_tracker, spawn
from typing import Any

from nimbus import serialization
from nimbus.multiprocessing import _link, _remote, _runtime, _state
from nimbus.multiprocessing import context as nimbus_context

__all__ = ["Popen"]

PR_SET_PDEATHSIG = 1


def runtime() -> _runtime.Starter:
    """This process's runtime (the root's warm workers, or a relay to them)."""
    return _runtime.runtime([__name__, *WARM_MODULES])


_preload: list[str] = []


def set_preload(module_names: list[str]) -> None:
    """Modules every warm worker imports before it forks (``set_forkserver_preload``)."""
    if not all(isinstance(name, str) for name in module_names):
        raise TypeError("module_names must be a list of strings")
    _preload[:] = module_names


def _modules_of(process_obj: stdlib_process.BaseProcess) -> list[str]:
    """Modules for the worker to import before it forks, so the child starts warm.

    The modules of the process's class and target, and those named with
    ``set_forkserver_preload``; children import anything else at first use,
    as the stdlib's spawn children do.
    """
    names = {type(process_obj).__module__, getattr(process_obj._target, "__module__", None)}
    own = sorted(n for n in names if n and n not in ("__main__", "__mp_main__", "builtins"))
    return own + [name for name in _preload if name not in own]


class Popen:
    """What ``BaseProcess`` drives: ``poll``, ``wait``, ``terminate``, ``kill``, ``close``."""

    method = "nimbus"

    def __init__(self, process_obj: stdlib_process.BaseProcess) -> None:
        self.returncode: int | None = None
        self.finalizer = None
        self._done = threading.Event()
        self.sentinel, self._exit_w = os.pipe()
        self._token = uuid.uuid4().hex
        prep = spawn.get_preparation_data(process_obj._name)
        # the child's default context: its process's own method, else the parent's default
        prep.pop("start_method", None)
        prep["nimbus_start_method"] = (
            process_obj._start_method or nimbus_context._default_context.get_start_method()
        )
        prep["modules"] = _modules_of(process_obj)
        prep["environ"] = dict(os.environ)  # as at start(), as a forked or spawned child has it
        stdlib_context.set_spawning_popen(self)  # type: ignore[arg-type]
        try:
            program = _state.program()
            data, buffers = _state.dumps(process_obj)
        except BaseException:
            self._close_pipe()
            raise
        finally:
            stdlib_context.set_spawning_popen(None)
        rt = runtime()
        rt.register(self._token, self)
        prep["authkey"] = bytes(prep["authkey"])
        prep["stdio"] = rt.redirected_stdio()
        self._program = program
        if rt.output is not None:
            prep["forward"] = rt.output.inbox  # output through the store; __main__ came by value
            for key in MAIN_KEYS:
                prep.pop(key, None)
            if _state.on_shared_endpoint():  # your token stays off a machine others run
                prep["environ"].pop("NIMBUS_TOKEN", None)
            prep["relay"] = None  # a relayed child would have no output list to report to
        else:
            prep["relay"] = _runtime.relay_address()
            prep["tracker"] = _tracker()
        # the fork is under way when start() returns; its pid is awaited on first use
        try:
            self._forked = rt.start(_start, self._token, prep, program, data, buffers)
        except BaseException:
            rt.forget(self._token)
            self._close_pipe()
            raise
        self._forked.add_done_callback(self._on_forked)
        self._pid: int | None = None

    @property
    def pid(self) -> int:
        """The child's pid (waits for the fork, a few milliseconds at most)."""
        if self._pid is None:
            self._pid = self._forked.result()
        return self._pid

    def _on_forked(self, future: Any) -> None:
        """A start that failed (the worker died, say) ends the process with code 1."""
        exc = None if future.cancelled() else future.exception()
        if exc is not None and self.returncode is None:
            import traceback

            runtime().forget(self._token)
            traceback.print_exception(exc)
            self._exited(1)

    # used by the stdlib's reductions while the process object is pickled
    @staticmethod
    def duplicate_for_child(fd: int) -> int:
        return fd

    @staticmethod
    def DupFd(fd: int) -> Any:
        return resource_sharer.DupFd(fd)

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()
        if self._exit_w >= 0:
            os.close(self._exit_w)
            self._exit_w = -1

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        if flag & os.WNOHANG:
            return self.returncode
        return self.wait()

    def wait(self, timeout: float | None = None) -> int | None:
        self._done.wait(timeout)
        return self.returncode

    def _send_signal(self, sig: int) -> None:
        if self.returncode is None:
            if self._program.remote:
                _remote.send_signal(self._program, self._token, sig)
                return
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self._send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self._send_signal(signal.SIGKILL)

    def _close_pipe(self) -> None:
        for fd in (self.sentinel, self._exit_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.sentinel = self._exit_w = -1

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


# -- in the warm worker ----------------------------------------------------
MAIN_KEYS = ("init_main_from_name", "init_main_from_path")
_mains: set[tuple[str, str]] = set()


def _import_main(prep: dict[str, Any]) -> None:
    """Import the program's main module once in this worker, as spawn does in a child.

    Children forked afterwards find ``__main__`` functions by reference, with
    the globals they share. If the import fails, each child tries again (and
    fails with the traceback, as a spawned child would).
    """
    for key in MAIN_KEYS:
        if key in prep and (key, prep[key]) not in _mains:
            try:
                spawn.prepare({key: prep[key], "sys_path": prep.get("sys_path", sys.path)})
            except BaseException:
                return
            _mains.add((key, prep[key]))
        prep.pop(key, None)


# imported once by the worker before its first fork, so children start warm
WARM_MODULES = (
    "multiprocessing.managers",
    "multiprocessing.pool",
    "nimbus.messaging",
    "nimbus.multiprocessing",
    "nimbus.multiprocessing.connection",
    "nimbus.multiprocessing.queues",
    "nimbus.multiprocessing.sharedctypes",
    "nimbus.multiprocessing.synchronize",
)


@functools.cache
def _warm_up() -> None:
    for name in WARM_MODULES:
        importlib.import_module(name)


def _start(
    token: str, prep: dict[str, Any], program: _state.Program, data: bytes, buffers: list[Any]
) -> int:
    """Start the process in a standby child (or a new fork); the reaper reports its exit."""
    _warm_up()
    _libc()  # loaded once here, not in every child
    _import_main(prep)
    for name in prep.pop("modules", ()):
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except BaseException:  # the child imports it again and reports the error
                pass
    args = (token, prep, program, data, buffers)
    inbox = prep.get("forward")  # a remote parent's: exits and output go there
    if inbox:
        watcher = _remote.watch_signals(program, inbox, token)
        pid = _fork(args, (program, inbox))
        alive = lambda: pid in _reaper.tokens  # noqa: E731
        _remote.deliver_signals(watcher, program, token, alive, _reaper.killer(pid))
        return pid
    global _program, _keep
    with _reaper.lock:  # processes of this worker running now: is this start part of a burst?
        running = sum(1 for token in _reaper.tokens.values() if token is not None)
    _keep = max(_keep, min(STANDBYS_MAX, running + 2))
    started = None
    while started is None and _standbys:
        standby = _standbys.pop()
        if standby.modules == len(sys.modules):
            started = standby.run(token, args)
        else:  # forked before modules this process needs were imported
            standby.discard()
    if started is None:
        _link.link(program)  # its settings (a client's), made once here for every fork
        started = _fork(args)
    from nimbus.runtime import worker

    # the next start skips the fork and the store's connection; this one is not held up
    _program = program
    if not _standbys:
        worker.when_idle(_refill)
    _top_up_later()
    return started


def _fork(args: tuple[Any, ...], remote: tuple[_state.Program, str] | None = None) -> int:
    """Fork a child that runs ``_child(*args)``; the reaper waits for it."""
    with _reaper.lock:
        pid = os.fork()
        if pid == 0:
            _close_standby_pipes()
            _child(*args)  # never returns
        _reaper.add(pid, args[0], remote)
    return pid


def _refill() -> None:
    """Fork a standby child if this worker has fewer than it keeps."""
    if len(_standbys) < _keep and _program is not None:
        _link.link(_program)  # the store's client settings, made once for all the children
        _standbys.append(_Standby(_program))


def _top_up() -> None:
    global _topping_up
    _topping_up = False
    _refill()
    _top_up_later()


def _top_up_later() -> None:
    global _topping_up
    if not _topping_up and len(_standbys) < _keep:
        from nimbus.runtime import worker

        _topping_up = True
        worker.when_quiet(_top_up, STANDBY_QUIET)


# Children each worker keeps forked ahead of need: two, or one more than the largest
# burst of starts it has served (processes started while its others ran), up to
# STANDBYS_MAX. When a start takes the last, one is forked as soon as the worker is
# idle; the others once it has been quiet for STANDBY_QUIET seconds, so that the
# CPU a burst of starts needs does not go to forking for the next burst.
STANDBYS_MAX = 3
STANDBY_QUIET = 0.02


class _Standby:
    """A child forked ahead of need: it waits on a pipe for the process it is to run.

    A start hands the process over (one write) instead of forking, so the new
    process runs at once and the fork happens after it, off the start's path.
    While it waits it connects to the store of the last process started (the
    next is most likely of the same program) and reads its environment, so
    neither is on the path either.
    A standby that is dropped (or whose worker ends) reads end-of-file and exits.
    """

    def __init__(self, program: _state.Program) -> None:
        self.modules = len(sys.modules)
        read, self.fd = os.pipe()
        with _reaper.lock:
            self.pid = os.fork()
            if self.pid == 0:
                os.close(self.fd)
                _close_standby_pipes()
                _await_process(read, program)  # never returns
            _reaper.add(self.pid, None)
        os.close(read)

    def run(self, token: str, args: tuple[Any, ...]) -> int | None:
        """Give the process to this child; its pid, or None if it is gone (fork afresh)."""
        payload = pickle.dumps(args, protocol=5)
        with _reaper.lock:
            if self.pid not in _reaper.tokens:  # died idle, and reaped
                os.close(self.fd)
                return None
            _reaper.tokens[self.pid] = token
        try:
            with open(self.fd, "wb") as pipe:  # closed after: end of the message
                pipe.write(payload)
        except OSError:
            with _reaper.lock:
                if _reaper.tokens.get(self.pid) != token:
                    return self.pid  # already reaped: its exit code went to the parent
                _reaper.tokens[self.pid] = None
            return None
        return self.pid

    def discard(self) -> None:
        os.close(self.fd)


_standbys: list[_Standby] = []  # the last one is handed a process first
_program: _state.Program | None = None  # of the last start: the standbys connect to its store
_topping_up = False
_keep = 2  # standbys this worker keeps (grows with the bursts it serves)


def _close_standby_pipes() -> None:
    """In a child just forked: close its copies of the standbys' pipes.

    A standby reads its process until end-of-file, which comes only once
    every copy of the pipe's write end is closed.
    """
    for standby in _standbys:
        try:
            os.close(standby.fd)
        except OSError:
            pass
    _standbys.clear()


def _connect(program: _state.Program) -> None:
    """Connect this thread's link to the program's store, so the process's first use is quick.

    Every local child does this first (a standby while it waits): a child's
    descriptors do not depend on how it was started.
    """
    global _connected
    try:
        _link.link(program).call(("PING",))
    except Exception:  # the store is unreachable now: the process reports it, if it uses it
        return
    _connected = program.url


_connected: str | None = None  # the store this process's main thread is connected to


def _await_process(fd: int, program: _state.Program) -> None:
    """In a standby child: wait for a process to run, or end quietly."""
    from nimbus.runtime import worker

    worker.close_in_child()
    if sys.platform == "linux":
        _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _connect(program)
    global _environ
    _environ = dict(os.environ)
    try:
        with open(fd, "rb") as pipe:
            payload = pipe.read()
        if not payload:
            os._exit(0)
        args = pickle.loads(payload)
    except BaseException:
        os._exit(0)
    _child(*args)


class _Reaper:
    """One thread per worker that waits for all its forked children."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tokens: dict[int, str | None] = {}  # pid -> token (None: a standby)
        self.remote: dict[int, tuple[_state.Program, str]] = {}  # of remote parents: inbox
        self.children = threading.Semaphore(0)
        self.thread: threading.Thread | None = None

    def add(
        self, pid: int, token: str | None, remote: tuple[_state.Program, str] | None = None
    ) -> None:
        self.tokens[pid] = token
        if remote is not None:
            self.remote[pid] = remote
        if self.thread is None:
            self.thread = threading.Thread(target=self.run, name="nimbus-reaper", daemon=True)
            self.thread.start()
        self.children.release()

    def run(self) -> None:
        from nimbus.runtime import worker

        while True:
            self.children.acquire()  # one child to wait for, at least
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                continue
            with self.lock:
                token = self.tokens.pop(pid, None)
                remote = self.remote.pop(pid, None)
            if remote is not None and token is not None:
                _remote.report_exit(*remote, token, os.waitstatus_to_exitcode(status))
            elif token is not None:
                worker.notify(["exit", token, os.waitstatus_to_exitcode(status)])

    def killer(self, pid: int) -> Callable[[int], None]:
        """``kill(sig)`` for child ``pid``, a no-op once it is reaped (its pid may be reused)."""

        def kill(sig: int) -> None:
            with self.lock:
                if pid in self.tokens:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass

        return kill


_reaper = _Reaper()


def _child(
    token: str, prep: dict[str, Any], program: _state.Program, data: bytes, buffers: list[Any]
) -> None:
    code = 1
    forwarder = None
    try:
        from nimbus.runtime import worker

        worker.close_in_child()
        if sys.platform == "linux":
            _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        inbox = prep.pop("forward", None)
        if inbox:
            forwarder = _remote.Forwarder(program, inbox, token)
            if not os.path.isdir(prep.get("dir", "")):
                prep.pop("dir", None)  # the parent's cwd does not exist here
        stdio = prep.pop("stdio", None)
        _share_tracker(prep.pop("tracker", None))
        _runtime.set_relay_address(prep.pop("relay", None))
        environ = prep.pop("environ", None)
        if environ is not None:
            _set_environ(environ)
        # sys.path, argv, cwd, the parent's authkey (handing over connections
        # checks it while unpickling) and the main module if not imported yet
        method = prep.pop("nimbus_start_method", None)
        spawn.prepare(prep)
        if method:
            nimbus_context._default_context.set_start_method(method, force=True)
        if stdio is not None:  # the parent's stdout/stderr moved since the worker started
            for fd, handle in zip((1, 2), stdio, strict=True):
                new = handle.detach()
                os.dup2(new, fd)
                os.close(new)
        _state.adopt(program)  # before unpickling: shared objects find their store
        if not inbox and _connected != program.url:  # as a standby is: every child alike
            _connect(program)
        process_obj = serialization.loads(data, buffers)
        code = process_obj._bootstrap(parent_sentinel=_parent_sentinel(process_obj._parent_pid))
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            if forwarder is not None:
                forwarder.close()
        finally:
            os._exit(code)


def _tracker() -> tuple[int, int] | None:
    """This process's resource tracker, if it runs one: (pid, fd of its pipe).

    A stdlib child shares its parent's tracker (spawn passes the fd), so a
    ``SharedMemory`` it attaches is not unlinked when it exits; ours, forked
    by a worker, opens the same pipe through ``/proc``.
    """
    fd = resource_tracker._resource_tracker._fd
    return None if fd is None else (os.getpid(), fd)


def _share_tracker(tracker: tuple[int, int] | None) -> None:
    """Use the parent's resource tracker (else this child starts its own when it needs one)."""
    if tracker is None:
        return
    try:
        fd = os.open(f"/proc/{tracker[0]}/fd/{tracker[1]}", os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return
    mine = resource_tracker._resource_tracker
    if mine._fd is not None:
        os.close(mine._fd)  # the worker's, inherited
    mine._fd, mine._pid = fd, None  # as a spawned child's


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def _set_environ(environ: dict[str, str]) -> None:
    """Make ``os.environ`` equal ``environ``, touching only what differs (putenv is slow)."""
    global _environ
    # os.environ decodes every name and value it is asked for: compare plain dicts
    current = _environ if _environ is not None else dict(os.environ)
    _environ = None
    for name in current.keys() - environ.keys():
        del os.environ[name]
    for name, value in environ.items():
        if current.get(name) != value:
            os.environ[name] = value


_environ: dict[str, str] | None = None  # a standby's os.environ, read while it waits


def _parent_sentinel(pid: int) -> int:
    """An fd that becomes readable when the process that started us ends."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        read, _write = os.pipe()  # never readable: we cannot watch that parent
        return read
