"""In a warm worker: fork the processes ``popen_nimbus.Popen`` starts, and watch them.

The warm worker only forks: the child is a copy of an interpreter that has
nimbus and the program's modules already imported, so a Process starts in
a few milliseconds and every started Process runs at once, however many.
Better still, each worker keeps children forked ahead of need (*standbys*,
already connected to the program's store once it is used): a start hands the process to one
through a pipe, and the fork is off the start's path. The worker forks one
again as soon as it is idle and the others once it has been quiet a while, so
a burst of starts does not compete with forks for the next.
The worker goes back to serving other starts; a thread in it waits for the
child and reports its exit code, which becomes ``Popen.returncode``, and the
sentinel (a pipe) becomes readable. ``terminate``/``kill`` signal the child
by pid (same host). A child dies with its worker (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import current_process, resource_tracker, spawn
from typing import Any

from nimbus import _install, local_history, serialization, statestore
from nimbus.environments import NODE_PATH, WORKER_VARIABLE
from nimbus.multiprocessing import _local, _main, _remote
from nimbus.multiprocessing import context as nimbus_context
from nimbus.records import TaskRecord, TaskState

__all__ = ["MAIN_KEYS", "STORE_MODULES", "WARM_MODULES", "import_main_ahead", "main_ahead", "start"]

PR_SET_PDEATHSIG = 1

MAIN_KEYS = ("init_main_from_name", "init_main_from_path")
_mains: set[tuple[str, str, str]] = set()

# A worker started in an environment (``Prepared.command``/``environ``): its import path
# (the environment's packages first) and the variables that say so, as it started. The
# parent's sys.path and os.environ, which its children take as spawn's do, lack them.
_OWN_PATH = [p for p in sys.path if p] if WORKER_VARIABLE in os.environ else None
_OWN_ENVIRON = {k: os.environ[k] for k in (WORKER_VARIABLE, NODE_PATH) if k in os.environ}


def _sys_path(prep: dict[str, Any]) -> list[str]:
    """The child's ``sys.path``: the parent's, but in an environment's worker the
    environment's own entries come right after the parent's first (its script's directory)."""
    path = list(prep.get("sys_path", sys.path))
    if _OWN_PATH is None or not path:
        return path
    return [path[0], *_OWN_PATH, *(p for p in path[1:] if p not in _OWN_PATH)]


def _child_environ(prep_environ: dict[str, str]) -> dict[str, str]:
    """The child's ``os.environ``: the parent's, keeping this environment's variables (and
    none of the parent's ``PYTHONPATH``, which would put its packages before the environment's)."""
    if not _OWN_ENVIRON:
        return prep_environ
    out = {k: v for k, v in prep_environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    out.update(_OWN_ENVIRON)
    return out


def _import_main(prep: dict[str, Any]) -> None:
    """Import the program's main module once in this worker, as spawn does in a child.

    Children forked afterwards find ``__main__`` functions by reference, with
    the globals they share. If the import fails, each child tries again (and
    fails with the traceback, as a spawned child would). A main module that
    starts a process while it is imported (no ``if __name__ == "__main__":``
    guard) fails this start with the stdlib's own ``RuntimeError`` saying so,
    which the parent raises (the script would otherwise start its processes
    again in every worker and child).
    """
    for key in MAIN_KEYS:
        if key not in prep:
            continue
        path = _sys_path(prep)
        # a directory's "__main__" is the one of its own sys.path[0]
        mark = (key, prep[key], path[0] if path and prep[key] == "__main__" else "")
        if mark not in _mains:
            try:
                with _bootstrapping():
                    _prepare({key: prep[key], "sys_path": path})
            except RuntimeError as exc:
                if _from_main_guard(exc):
                    raise
                return
            except BaseException:
                return
            _mains.add(mark)
        prep.pop(key, None)


def main_ahead() -> dict[str, Any] | None:
    """In the root, as it forks its warm workers: what they need to import the program's
    main module at once (``import_main_ahead``), or None. Only a file with the
    ``if __name__ == "__main__":`` guard (its import starts nothing) whose functions go by
    reference; a start's own preparation data decides again (the same main: done)."""
    from nimbus.multiprocessing import _site

    if _site.main_by_value() or not _site.main_guarded():
        return None
    prep = spawn.get_preparation_data("MainProcess")
    ahead = {key: prep[key] for key in (*MAIN_KEYS, "sys_path") if key in prep}
    return ahead if any(key in ahead for key in MAIN_KEYS) else None


def import_main_ahead(prep: dict[str, Any]) -> None:
    """In the root's first warm worker, just forked: import the program's main module as
    soon as it has said hello, as its first start would (on that start's path otherwise:
    milliseconds, more for a script importing much), while the root still starts the
    others and sends that start (which the manager gives to this worker, the first)."""
    from nimbus.runtime import worker

    worker.when_idle(functools.partial(_import_main, dict(prep)))


def _prepare(prep: dict[str, Any]) -> None:
    """``spawn.prepare``, and a package's or a directory's ``__main__`` module imported
    as ``__mp_main__`` too, which spawn leaves out (``python -m pkg``, ``python DIR``):
    the child finds the functions defined there, as a forked child does."""
    name = prep.get("init_main_from_name")
    package_main = name == "__main__" or (name or "").endswith(".__main__")
    if package_main:
        prep = {k: v for k, v in prep.items() if k != "init_main_from_name"}
    spawn.prepare(prep)
    if package_main:
        _import_package_main(str(name))


def _import_package_main(name: str) -> None:
    """Run module ``name`` (``__main__``: the one on ``sys.path[0]``) as ``__mp_main__``,
    as ``spawn`` runs a script's, and make it this process's ``__main__``."""
    import builtins
    import runpy
    import types

    if name == "__main__":
        _name, spec, code = runpy._get_main_module_details()  # type: ignore[attr-defined]
    else:
        _name, spec, code = runpy._get_module_details(name)  # type: ignore[attr-defined]
    main = types.ModuleType("__mp_main__")
    main.__dict__.update(
        __builtins__=builtins,
        __file__=spec.origin,
        __cached__=spec.cached,
        __loader__=spec.loader,
        __package__=spec.parent,
        __spec__=spec,
    )
    spawn.old_main_modules.append(sys.modules["__main__"])
    sys.modules["__main__"] = sys.modules["__mp_main__"] = main
    exec(code, main.__dict__)


@contextlib.contextmanager
def _bootstrapping() -> Iterator[None]:
    """While the main module is imported: a process started now is the stdlib's error.

    ``spawn._main`` marks its child as inheriting while it imports the main
    module, so that ``spawn.get_preparation_data`` (which our Popen calls too)
    raises the ``RuntimeError`` that explains the ``__main__`` guard.
    """
    me: Any = current_process()
    me._inheriting = True
    try:
        yield
    finally:
        del me._inheriting


_GUARD_CHECK = spawn._check_not_importing_main.__code__  # type: ignore[attr-defined]


def _from_main_guard(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by the stdlib's check for an unguarded main module."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is _GUARD_CHECK:
            return True
        tb = tb.tb_next
    return False


# imported once by the worker before its first fork, so children start warm
WARM_MODULES = (
    "multiprocessing.managers",
    "multiprocessing.pool",
    "nimbus.multiprocessing",
    "nimbus.multiprocessing.connection",
    "nimbus.multiprocessing.queues",
    "nimbus.multiprocessing.sharedctypes",
    "nimbus.multiprocessing.synchronize",
)
# the store's client (redis-py and messaging on it: 100-300 ms), imported by the worker
# only once a start says its program uses the store (``prep["store"]``): a program that
# never does (its Pools' queues are pipes, ``_hostqueue``) never imports it anywhere
STORE_MODULES = ("nimbus.messaging",)
WARM_QUIET = 0.05  # seconds without a start before a worker imports WARM_MODULES


_warming: set[Callable[[], None]] = set()  # asked for once each


def _warm_later(fn: Callable[[], None], quiet: float) -> None:
    if fn not in _warming:
        from nimbus.runtime import worker

        _warming.add(fn)
        worker.when_quiet(fn, quiet)


@functools.cache
def _warm_up() -> None:
    for name in WARM_MODULES:
        importlib.import_module(name)


@functools.cache
def _warm_store() -> None:
    for name in STORE_MODULES:
        importlib.import_module(name)


def start(
    token: str, prep: dict[str, Any], program: statestore.Program, data: bytes, buffers: list[Any]
) -> int:
    """Start the process in a standby child (or a new fork); the reaper reports its exit."""
    from nimbus.runtime import worker

    # a Pool's processes start together and then work: no warm-up nor standby forks take
    # CPU from them (nor hold up the reaper's exit notices) until the worker is quite quiet
    pool = prep.pop("pool", False)
    # not on the path of this start, nor of the next ones of a burst (a Pool's): after a
    # quiet moment (a forked worker imports its preload, the same modules, later still)
    _warm_later(_warm_up, POOL_QUIET if pool else WARM_QUIET)
    if prep.pop("store", False):  # the process will likely use it too: import it once
        _warm_store()  # here, for this worker's children, rather than in each of them
    _libc()  # loaded once here, not in every child
    if prep.get("install") and not prep.get("forward"):  # this local worker is the program's:
        _install.install()  # before main and the modules are imported, as in the parent
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
    if not pool:  # (a Pool's burst is of processes that stay: it starts no more soon)
        _keep = max(_keep, min(STANDBYS_MAX, running + 2))
    started = None
    while started is None and _standbys:
        standby = _standbys.pop()
        if standby.modules == len(sys.modules):
            started = standby.run(token, args)
        else:  # forked before modules this process needs were imported
            standby.discard()
    if started is None:
        _settle(program)
        started = _fork(args)

    # the next start skips the fork and the store's connection; this one is not held up
    _program = program
    if not _standbys and not pool:
        worker.when_idle(_refill)
    _top_up_later(POOL_QUIET if pool else STANDBY_QUIET)
    return started


def _fork(args: tuple[Any, ...], remote: tuple[statestore.Program, str] | None = None) -> int:
    """Fork a child that runs ``_child(*args)``; the reaper waits for it."""
    with _reaper.lock:
        pid = _fork_holding_interrupts()
        if pid == 0:
            _close_standby_pipes()
            _child(*args)  # never returns
        _reaper.add(pid, args[0], remote)
    return pid


def _fork_holding_interrupts() -> int:
    """``os.fork()``; the child holds SIGINT back until its process runs (``_child``).

    The parent passes a Ctrl-C on as soon as it knows the pid: one that came
    while the new child still cleared the signals it inherited (as Python does
    after a fork), or while a standby waited for its process, was lost. Held
    back, it is raised as the process starts, as in a forked child of the stdlib.
    """
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    pid = -1
    try:
        pid = os.fork()
    finally:
        if pid != 0:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
    return pid


def _let_interrupts_in() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _settle(program: statestore.Program) -> None:
    """The store's client settings, made once here for every fork, if a process of the
    program used the store already (else they, and redis-py, wait for a first use)."""
    if "redis" in sys.modules:
        statestore.link(program)


def _refill() -> None:
    """Fork a standby child if this worker has fewer than it keeps."""
    if len(_standbys) < _keep and _program is not None:
        _settle(_program)
        _standbys.append(_Standby(_program))


def _top_up() -> None:
    global _topping_up
    _topping_up = False
    _refill()
    _top_up_later(STANDBY_QUIET)


def _top_up_later(quiet: float) -> None:
    global _topping_up
    if not _topping_up and len(_standbys) < _keep:
        from nimbus.runtime import worker

        _topping_up = True
        worker.when_quiet(_top_up, quiet)


# Children each worker keeps forked ahead of need: two, or one more than the largest
# burst of starts it has served (processes started while its others ran), up to
# STANDBYS_MAX. When a start takes the last, one is forked as soon as the worker is
# idle; the others once it has been quiet for STANDBY_QUIET seconds, so that the
# CPU a burst of starts needs does not go to forking for the next burst. A Pool's
# processes (a burst of processes that stay and work) neither grow the number kept nor
# start a fork until the worker has been quiet for POOL_QUIET seconds.
STANDBYS_MAX = 3
STANDBY_QUIET = 0.02
POOL_QUIET = 0.25  # after a Pool's process started: the quiet before warm-up and standbys


class _Standby:
    """A child forked ahead of need: it waits on a pipe for the process it is to run.

    A start hands the process over (one write) instead of forking, so the new
    process runs at once and the fork happens after it, off the start's path.
    While it waits it connects to the store of the last process started (the
    next is most likely of the same program), if the program has used it, and
    reads its environment, so neither is on the path either.
    A standby that is dropped (or whose worker ends) reads end-of-file and exits.
    """

    def __init__(self, program: statestore.Program) -> None:
        self.modules = len(sys.modules)
        read, self.fd = os.pipe()
        with _reaper.lock:
            self.pid = _fork_holding_interrupts()
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
_program: statestore.Program | None = None  # of the last start: the standbys connect to its store
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


def _connect(program: statestore.Program) -> None:
    """Connect this thread's link to the program's store, so the process's first use is quick.

    Every local child does this first (a standby while it waits): a child's
    descriptors do not depend on how it was started. Not while the program's
    embedded store still boots (its first processes): they need none to start,
    and one that does waits for it at its first use.
    """
    global _connected
    if program.booting():  # the first processes of a program: not on their path
        return
    if "redis" not in sys.modules:  # no process of the program used the store yet: the
        return  # connection (and redis-py's import) waits for this one's first use
    try:
        statestore.link(program).call(("PING",))
    except Exception:  # the store is unreachable now: the process reports it, if it uses it
        return
    _connected = program.url


_connected: str | None = None  # the store this process's main thread is connected to


def _await_process(fd: int, program: statestore.Program) -> None:
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
        self.remote: dict[int, tuple[statestore.Program, str]] = {}  # of remote parents: inbox
        self.children = threading.Semaphore(0)
        self.thread: threading.Thread | None = None

    def add(
        self, pid: int, token: str | None, remote: tuple[statestore.Program, str] | None = None
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
                try:
                    worker.notify(["exit", token, os.waitstatus_to_exitcode(status)])
                except OSError:  # the manager is gone: its program ended, having had the
                    return  # exit code from the child itself (popen_nimbus), or not needing it

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
    token: str, prep: dict[str, Any], program: statestore.Program, data: bytes, buffers: list[Any]
) -> None:
    code = 1
    forwarder = None
    exit_fd = _exit_pipe(prep.pop("exit_to", None))
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
        if prep.pop("install", False):  # (an endpoint's worker, shared, stays as it is)
            _install.install()
        stdio = prep.pop("stdio", None)
        _share_tracker(prep.pop("tracker", None))
        _local.set_relay_address(prep.pop("relay", None))
        environ = prep.pop("environ", None)
        if environ is not None:
            _set_environ(_child_environ(environ))
        if "sys_path" in prep:
            prep["sys_path"] = _sys_path(prep)
        # sys.path, argv, cwd, the parent's authkey (handing over connections
        # checks it while unpickling) and the main module if not imported yet
        method = prep.pop("nimbus_start_method", None)
        with _bootstrapping():
            _prepare(prep)
        _main.become_main()
        if method:
            nimbus_context._default_context.set_start_method(method, force=True)
        if stdio is not None:  # the parent's stdout/stderr moved since the worker started
            for fd, handle in zip((1, 2), stdio, strict=True):
                new = handle.detach()
                os.dup2(new, fd)
                os.close(new)
        statestore.adopt(program)  # before unpickling: shared objects find their store
        if not inbox and _connected != program.url:  # as a standby is: every child alike
            _connect(program)
        process_obj = serialization.loads(data, buffers)
        began = time.time()
        _let_interrupts_in()  # a Ctrl-C held back since the fork is raised now
        code = process_obj._bootstrap(parent_sentinel=_parent_sentinel(process_obj._parent_pid))
        _keep_record(process_obj, began, code)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            local_history.ended()  # before os._exit: its records handed over
            sys.stdout.flush()
            sys.stderr.flush()
            if forwarder is not None:
                forwarder.close()
        finally:
            if exit_fd is not None:
                try:  # the parent has it at once, not after the reaper's notice's hops
                    os.write(exit_fd, _EXIT.pack(os.getpid(), code))
                except OSError:
                    pass
            os._exit(code)


_EXIT = struct.Struct("ii")  # popen_nimbus reads it: pid, exit code


def _exit_pipe(where: tuple[int, int, int] | None) -> int | None:
    """The write end of the Popen's sentinel pipe in the parent (pid, fd, the pipe's inode),
    opened through ``/proc`` (None where it cannot be: the parent learns the exit from the
    reaper's notice). Processes this one forks do not keep it (it must end at our exit)."""
    if where is None:
        return None
    pid, fd, inode = where
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if os.readlink(path) != f"pipe:[{inode}]":
            return None  # not the parent's pipe (another pid namespace): never write there
        exit_fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return None
    os.register_at_fork(after_in_child=functools.partial(_close_quietly, exit_fd))
    return exit_fd


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _keep_record(process_obj: Any, began: float, code: int) -> None:
    """This Process's record for ``nimbus dashboard`` (``local_history``; a no-op without
    a service in the runtime directory): its target's name, success if it exited 0."""
    target = getattr(process_obj, "_target", None)
    name = getattr(target, "__qualname__", "") or process_obj.name
    state = TaskState.SUCCESS if code == 0 else TaskState.FAILED
    record = TaskRecord(local_history.new_id(), state, name, f"process/{process_obj.name}",
                        socket.gethostname(), os.getpid(), began, began, began, time.time())  # fmt: skip
    local_history.keep(record)


def _share_tracker(tracker: tuple[int, int] | None) -> None:
    """Use the parent's resource tracker (else this child starts its own when it needs one)."""
    if tracker is None:
        return
    try:
        fd = os.open(f"/proc/{tracker[0]}/fd/{tracker[1]}", os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return
    mine: Any = resource_tracker._resource_tracker  # its _fd and _pid are private
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
