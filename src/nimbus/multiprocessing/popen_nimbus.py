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
The worker goes back to serving other starts; a thread in it waits for the
child and reports its exit code, which becomes ``Popen.returncode``, and the
sentinel (a pipe) becomes readable. ``terminate``/``kill`` signal the child
by pid (same host). A child dies with its worker (``PR_SET_PDEATHSIG``).

With ``NIMBUS_ENDPOINT`` set the warm workers are the endpoint's, reached
through the service; exits, output and signals then travel through the
program's state store (see ``_remote``).
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable
from multiprocessing import context as stdlib_context
from multiprocessing import process as stdlib_process
from multiprocessing import resource_sharer, spawn, util
from typing import Any

from nimbus import serialization
from nimbus.multiprocessing import _remote, _state
from nimbus.multiprocessing import context as nimbus_context

__all__ = ["Popen"]

PR_SET_PDEATHSIG = 1


class _Runtime:
    """The warm workers that fork this program's processes, and their notices."""

    def __init__(self) -> None:
        from nimbus.config import Settings
        from nimbus.executor import Executor, _live

        self.popens: dict[str, Popen] = {}
        self.early: dict[str, int] = {}  # exits reported before start() finished
        self.lock = threading.Lock()
        self.program = _state.program()
        self.output: _remote.Output | None = None
        if self.program.remote:
            settings = Settings.load()
            self.executor = Executor(settings=settings, endpoint=settings.endpoint)
            self.output = _remote.Output(self.program, lambda t, c: self.notice(["exit", t, c]))
        else:
            self.executor = Executor(on_notice=self.notice, preload=[__name__, *WARM_MODULES])
        _live.discard(self.executor)  # closed by close(), after joining children
        self.pid = os.getpid()
        self.stdio = _stdio_ids()  # what the workers inherited
        # after multiprocessing's own exit work (a Pool's clean-up may start processes),
        # before the program's store closes (-100)
        util.Finalize(None, self.close, exitpriority=-50)

    def redirected_stdio(self) -> list[Any] | None:
        """Handles to this process's stdout/stderr if they changed since the workers started."""
        if self.output is not None or _stdio_ids() == self.stdio:
            return None  # remote children's output comes through the store
        return [resource_sharer.DupFd(fd) for fd in (1, 2)]

    def notice(self, payload: Any) -> None:
        if not (isinstance(payload, list) and payload and payload[0] == "exit"):
            return
        _, token, code = payload
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

    def close(self) -> None:
        """At exit: end daemonic children, join the others, stop the workers."""
        if os.getpid() != self.pid:
            return
        for child in stdlib_process.active_children():
            if isinstance(child._popen, Popen) and child.daemon:
                child.terminate()
        for child in stdlib_process.active_children():
            if isinstance(child._popen, Popen):
                child.join()
        self.executor.shutdown(wait=True)
        if self.output is not None:
            self.output.close()


_runtime: _Runtime | None = None
_runtime_lock = threading.Lock()


def runtime() -> _Runtime:
    global _runtime
    with _runtime_lock:
        if _runtime is None or _runtime.pid != os.getpid():
            _runtime = _Runtime()
        return _runtime


def _stdio_ids() -> list[tuple[int, int] | None]:
    ids: list[tuple[int, int] | None] = []
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
            ids.append((st.st_dev, st.st_ino))
        except OSError:
            ids.append(None)
    return ids


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
        # the fork is under way when start() returns; its pid is awaited on first use
        self._forked = rt.executor.submit(_start, self._token, prep, program, data, buffers)
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
    """Fork a child that runs the process; the reaper reports its exit code."""
    _warm_up()
    _libc()  # loaded once here, not in every child
    _import_main(prep)
    for name in prep.pop("modules", ()):
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except BaseException:  # the child imports it again and reports the error
                pass
    inbox = prep.get("forward")  # a remote parent's: exits and output go there
    watcher = _remote.watch_signals(program, inbox, token) if inbox else None
    with _reaper.lock:
        pid = os.fork()
        if pid == 0:
            _child(token, prep, program, data, buffers)  # never returns
        _reaper.add(pid, token, (program, inbox) if inbox else None)
    if watcher is not None:
        alive = lambda: pid in _reaper.tokens  # noqa: E731
        _remote.deliver_signals(watcher, program, token, alive, _reaper.killer(pid))
    return pid


class _Reaper:
    """One thread per worker that waits for all its forked children."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tokens: dict[int, str] = {}
        self.remote: dict[int, tuple[_state.Program, str]] = {}  # of remote parents: inbox
        self.children = threading.Semaphore(0)
        self.thread: threading.Thread | None = None

    def add(self, pid: int, token: str, remote: tuple[_state.Program, str] | None = None) -> None:
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


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def _set_environ(environ: dict[str, str]) -> None:
    """Make ``os.environ`` equal ``environ``, touching only what differs (putenv is slow)."""
    current = os.environ
    for name in [name for name in current if name not in environ]:
        del current[name]
    for name, value in environ.items():
        if current.get(name) != value:
            current[name] = value


def _parent_sentinel(pid: int) -> int:
    """An fd that becomes readable when the process that started us ends."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        read, _write = os.pipe()  # never readable: we cannot watch that parent
        return read
