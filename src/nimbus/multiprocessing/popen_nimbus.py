"""Start a Process on a warm worker: the stdlib's Popen contract, run remotely.

::

    parent: Process.start() -> Popen(process) --task start(token, data)---> warm worker
                                     |                                        | fork()
            pid <----------------- result ------------------------------------+
                                                                              |  child: _bootstrap()
            returncode, sentinel <- (pid, code, start) to the sentinel's pipe <--+ as it ends
                                 <- its pidfd readable: it has ended               |
                              (or) <- notice ["exit", token, code] <- reaper thread (waitpid)

The warm worker only forks (``_forking``): the child is a copy of an
interpreter that has nimbus and the program's modules already imported, so a
Process starts in a few milliseconds and every started Process runs at once.
Its exit code becomes ``Popen.returncode`` and the sentinel (a pipe) becomes
readable: a local child writes its code to that pipe itself (opened through
``/proc``) and the parent, reading it, waits for the child's pidfd, so a join
does not wait for the worker's reaper and its notice's hops; a child killed
(or that could not write) ends by the notice, which wakes the pipe too.
``terminate``/``kill`` signal the child by pid (same host); a Ctrl-C passed on
(``pass_on``, from the signal handler) goes to those whose pid is known at once
and to the others as their pid arrives.
The warm workers are where this process's *site* says (``_site``): the
program root's (``_local``; a process the program started asks the root to
start its own children, through its relay), or with ``NIMBUS_ENDPOINT`` set
the endpoint's, reached through the service, exits, output and signals then
travelling through the program's state store (``_remote``).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
import uuid
from multiprocessing import context as stdlib_context
from multiprocessing import process as stdlib_process
from multiprocessing import resource_sharer, spawn
from multiprocessing.reduction import ForkingPickler
from typing import Any

from nimbus import _install
from nimbus.multiprocessing import _forking, _main, _site
from nimbus.multiprocessing import context as nimbus_context
from nimbus.multiprocessing._forking import EXIT, WARM_MODULES, started
from nimbus.multiprocessing._main import MAIN_KEYS

__all__ = ["Popen", "pass_on"]


def site() -> _site.Site:
    """This process's site (the root's warm workers, a relay to them, or an endpoint's)."""
    return _site.site([__name__, _forking.__name__, *WARM_MODULES])


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
        self._pid: int | None = None  # known once the fork is done (_on_forked)
        self._held: list[int] = []  # signals passed on before the pid was known
        self._done = threading.Event()
        # raises the stdlib's RuntimeError about the __main__ guard in a child importing main
        prep = spawn.get_preparation_data(process_obj._name)
        if _site.main_by_value():  # `python - < script.py`, or no __main__ guard: as with
            for key in MAIN_KEYS:  # fork, __main__'s functions go by value
                prep.pop(key, None)
        self.sentinel, self._exit_w = os.pipe()
        self._pipe_r = -1  # the pipe's read end, once the sentinel is the child's pidfd
        self._seen: tuple[int, int, int] | None = None  # (pid, code, start) the child wrote
        self._reading = threading.Lock()
        self._token = uuid.uuid4().hex
        # the child's default context: its process's own method, else the parent's default
        prep.pop("start_method", None)
        prep["nimbus_start_method"] = (
            process_obj._start_method or nimbus_context._default_context.get_start_method()
        )
        prep["modules"] = _modules_of(process_obj)
        prep["environ"] = dict(os.environ)  # as at start(), as a forked or spawned child has it
        prep["install"] = _install.installed()  # nimbus is `multiprocessing` there too
        prep["store"] = "redis" in sys.modules  # the program uses its store: warm its client
        prep["pool"] = getattr(process_obj, "_nimbus_pool", False)  # a Pool's process
        stdlib_context.set_spawning_popen(self)  # type: ignore[arg-type]
        try:
            program = _site.program()
            # no main module to import there: its names go with the process, as fork has them
            _copying.locks = prep["nimbus_start_method"] == "fork"  # its thread locks, as fork
            data, buffers = _site.dumps(
                _main.with_main(process_obj) if _site.main_by_value() else process_obj
            )
        except BaseException:
            self._close_pipe()
            raise
        finally:
            _copying.locks = False
            stdlib_context.set_spawning_popen(None)
        self._site = where = site()
        where.register(self._token, self)
        prep["authkey"] = bytes(prep["authkey"])
        where.prepare(prep)
        if where.same_host:  # the child writes its exit code to the sentinel's pipe itself
            prep["exit_to"] = (os.getpid(), self._exit_w, os.fstat(self._exit_w).st_ino)
        # the fork is under way when start() returns; its pid is awaited on first use
        # the root's first start imports main in a worker (a relayed one's root did already);
        # awaited only if main may start processes as it is imported (no guard found): the
        # other starts of a guarded program's Pool go at once
        first = (
            not _main_imported
            and where.imports_main
            and any(key in prep for key in MAIN_KEYS)
            and not _site.main_guarded()
        )
        try:
            self._forked = where.start(_forking.start, self._token, prep, program, data, buffers)
            if first:
                _await_main_import(self._forked)
        except BaseException:
            where.forget(self._token)
            self._close_pipe()
            raise
        self._forked.add_done_callback(self._on_forked)

    @property
    def pid(self) -> int:
        """The child's pid (waits for the fork, a few milliseconds at most)."""
        if self._pid is None:
            self._pid = self._forked.result()
        return self._pid

    def _on_forked(self, future: Any) -> None:
        """The pid is known: the signals held for it go. A start that failed (the worker
        died, say) ends the process with code 1."""
        exc = None if future.cancelled() else future.exception()
        if exc is None:
            self._pid = future.result()
            self._send_held()
        elif self.returncode is None:
            import traceback

            self._site.forget(self._token)
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
        with self._reading:
            if self._exit_w >= 0:
                try:  # wakes a wait() on the sentinel that a grandchild's copy keeps open
                    os.write(self._exit_w, b"x")
                except OSError:
                    pass
                os.close(self._exit_w)
                self._exit_w = -1

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        if flag & os.WNOHANG:
            if self.returncode is None:
                self._await_exit(0.0)
            return self.returncode
        return self.wait()

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None:
            self._await_exit(timeout)
        return self.returncode

    def _await_exit(self, timeout: float | None) -> None:
        """Wait for the exit: its code, which the child writes to the sentinel's pipe as
        it ends (a local one), and its end, which its pidfd tells; or the worker's notice
        (``_exited``: a child killed, or that could not write) which wakes the pipe too.
        The sentinel is readable at either, so this waits on it, not on a thread."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._seen is None:
                if self.sentinel < 0:  # closed: only the notice can tell
                    self._done.wait(left)
                    return
                try:
                    ready = _readable(self.sentinel, left)
                except (OSError, ValueError):  # closed meanwhile by close()
                    self._done.wait(left)
                    return
                if not ready or self.returncode is not None:
                    return
                with self._reading:
                    if self.returncode is not None or self._seen is not None:
                        continue
                    try:
                        if not _readable(self.sentinel, 0):
                            continue  # another thread read it
                        got = os.read(self.sentinel, EXIT.size)
                    except (OSError, ValueError):  # closed meanwhile by close()
                        got = b""
                if len(got) != EXIT.size:  # end of file: the notice closed the pipe
                    self._done.wait(left)
                    return
                self._seen = EXIT.unpack(got)
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                pid, code, began = self._seen
                if not _ended(pid, began, left):
                    self._await_end(pid, began)
                    return
            pid, code, began = self._seen
            if not _ended(pid, began, left):
                return
            self._exited(code)

    def _await_end(self, pid: int, began: int) -> None:
        """The code read here, the child not yet ended (it is ending): the sentinel becomes
        the child's pidfd (``dup2``), readable once it has ended, as a stdlib sentinel is,
        so that a wait on it does not return at once until then (the pipe, read, has
        nothing in it to say so); a byte in the pipe wakes a wait already under way on it,
        which then waits on the pidfd rather than for the worker's notice, and a watch
        kept by the file rather than by its number (epoll, ``add_reader``), for which
        the pipe is kept open. (Without a pidfd, the byte alone: a wait on the sentinel
        returns at once until the end.)"""
        with self._reading:  # (close() takes it too: never a dup2 onto a closed number)
            if self.returncode is not None or self.sentinel < 0:
                return
            try:
                fd = _pidfd(pid, began)
            except OSError:  # no pidfds here
                fd = None
            if fd is not None:
                try:
                    self._pipe_r = os.dup(self.sentinel)
                    os.dup2(fd, self.sentinel, inheritable=False)
                finally:
                    os.close(fd)
            if self._exit_w >= 0:
                try:
                    os.write(self._exit_w, b"x")
                except OSError:  # no reader left: nobody waits on the pipe
                    pass

    def _interrupt(self, sig: int) -> None:
        """From a signal handler: ``sig`` to the child now if its pid is known, else as
        it arrives. No lock, no wait: the thread that delivers the pid (the relay's
        reader) may be waiting for a lock that the interrupted code holds (``site.lock``)."""
        self._held.append(sig)
        if self._pid is not None:  # (set before _on_forked sends what is held: none lost)
            self._send_held()

    def _send_held(self) -> None:
        """Send the signals held for the pid, each once (``list.pop`` is atomic: the
        handler and the thread that learns the pid may both be here)."""
        while True:
            try:
                sig = self._held.pop(0)
            except IndexError:
                return
            if self.returncode is None and self._pid is not None:
                self._site.signal_nowait(self._token, self._pid, sig)

    def _send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self._site.signal(self._token, self._forked, sig)

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
        with self._reading:
            for fd in (self.sentinel, self._pipe_r):
                if fd >= 0:
                    os.close(fd)
            self.sentinel = self._pipe_r = -1


def pass_on(sig: int) -> None:
    """From a signal handler: ``sig`` to each live child this process started
    (``_install``'s Ctrl-C). Takes no lock and waits for nothing."""
    where = _site.this_site()
    if where is None:
        return
    for popen in list(where.popens.values()):  # (one C call: no lock needed)
        if popen.returncode is None:
            popen._interrupt(sig)


def _ended(pid: int, began: int, timeout: float | None) -> bool:
    """Whether process ``pid``, started at ``began`` (a child that wrote its exit code),
    ended within ``timeout``: its pidfd is readable once it has (its files closed, its
    memory freed), or it is gone: reaped by its worker, its pid then free or another's."""
    try:
        fd = _pidfd(pid, began)
    except OSError:  # no pidfd here (Linux < 5.3): it ends within moments of writing it
        while timeout is None or timeout > 0:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            if began and started(pid) != began:
                return True
            time.sleep(0.001)
            timeout = None if timeout is None else timeout - 0.001
        return False
    if fd is None:
        return True
    try:
        return _readable(fd, timeout)
    finally:
        os.close(fd)


def _pidfd(pid: int, began: int) -> int | None:
    """A pidfd of process ``pid`` started at ``began``; None once it is gone (reaped by
    its worker, its pid then free or another's). OSError where there are no pidfds."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    # (the pidfd first: the process it names is the one whose start time is read)
    if began and started(pid) != began:
        os.close(fd)
        return None  # reaped, and its pid reused: waiting on it would wait for another
    return fd


def _readable(fd: int, timeout: float | None) -> bool:
    """Whether ``fd`` is readable (or at its end) within ``timeout`` seconds (any fd
    number: ``select.select`` takes none above 1023)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000 + 0.999))))


_main_imported = False  # a start of this process's has imported the main module in a worker


def _await_main_import(forked: Any) -> None:
    """Wait for the first start, which imports the main module: raise if that starts processes.

    A script without the ``if __name__ == "__main__":`` guard starts its
    processes again when a worker imports it; the worker refuses with the
    stdlib's ``RuntimeError`` that explains the guard, and so does this
    ``start()``, once, instead of children that fail and are replaced for ever.
    """
    global _main_imported
    try:
        forked.result()
    except BaseException as exc:
        if type(exc) is RuntimeError:  # the stdlib's (a lost worker's is a subclass)
            # the worker's traceback shows the same line of the script as this one
            raise RuntimeError(str(exc)) from None
        return  # reported by _on_forked, as any failed start
    _main_imported = True


# A thread lock passed to a Process: a forked child has a copy of it, in the state it was
# in; so does a nimbus child of the fork method, a fresh lock of the same kind, locked if
# it was (an RLock held by the starting thread is held by the child's main thread, as
# many times). Elsewhere (spawn, a queue) it is the stdlib's TypeError.

_copying = threading.local()


def _refuse(lock: Any) -> None:
    raise TypeError(f"cannot pickle '{type(lock).__module__}.{type(lock).__name__}' object")


def _rebuild_lock(locked: bool) -> Any:
    lock = threading.Lock()
    if locked:
        lock.acquire()
    return lock


def _rebuild_rlock(count: int) -> Any:
    lock = threading.RLock()
    for _ in range(count):
        lock.acquire()
    return lock


def _reduce_lock(lock: Any) -> tuple[Any, ...]:
    if not getattr(_copying, "locks", False):
        _refuse(lock)
    return _rebuild_lock, (lock.locked(),)


def _reduce_rlock(lock: Any) -> tuple[Any, ...]:
    if not getattr(_copying, "locks", False):
        _refuse(lock)
    held = lock._is_owned()  # by this thread, the one that starts the child
    count = int(repr(lock).split("count=")[1].split()[0]) if held else 0
    return _rebuild_rlock, (count,)


ForkingPickler.register(type(threading.Lock()), _reduce_lock)
ForkingPickler.register(type(threading.RLock()), _reduce_rlock)
