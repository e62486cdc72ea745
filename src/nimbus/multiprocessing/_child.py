"""A warm worker's forked child, from the fork to ``os._exit``: it runs one process.

::

    fork()  (SIGINT held back)  ->  run(token, prep, program, data, buffers)
        die_with_worker(); sys.path, environ, stdio, the main module as in a spawned child
        statestore.adopt(program); connect(program)       (a standby did both while it waited)
        SIGINT let in -> process_obj._bootstrap() -> its record kept
        EXIT (pid, code, start time) written to the parent's Popen pipe (exit_to) -> os._exit(code)

Every child connects its link to the program's store before its process runs
(:func:`connect`), however it was started, so a child's descriptors do not depend
on that. Used by ``_forking`` and its standbys alone.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import socket
import struct
import sys
import time
from multiprocessing import resource_tracker
from typing import Any

from nimbus import _install, local_history, serialization, statestore
from nimbus.multiprocessing import _local, _main, _remote
from nimbus.multiprocessing import context as nimbus_context
from nimbus.records import TaskRecord, TaskState

__all__ = ["EXIT", "connect", "die_with_worker", "fork", "libc", "read_environ", "run", "started"]

PR_SET_PDEATHSIG = 1
EXIT = struct.Struct("iiQ")  # what a child writes to its Popen's pipe (popen_nimbus): pid,
# exit code, start time (``started``)


def fork() -> int:
    """``os.fork()``; the child holds SIGINT back until its process runs (:func:`run`).

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


def die_with_worker() -> None:
    """In a child just forked: drop the worker's own connections, and die with it."""
    from nimbus.runtime import worker

    worker.close_in_child()
    if sys.platform == "linux":
        libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def connect(program: statestore.Program) -> None:
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


def read_environ() -> None:
    """In a standby while it waits: read ``os.environ`` now (its process's start compares
    with it, not with ``os.environ``, which decodes every name and value asked for)."""
    global _environ
    _environ = dict(os.environ)


def run(
    token: str, prep: dict[str, Any], program: statestore.Program, data: bytes, buffers: list[Any]
) -> None:
    """Run the process ``data`` holds as the parent would have it run, then exit."""
    code = 1
    forwarder = None
    exit_fd = _exit_pipe(prep.pop("exit_to", None))
    began_at = started(os.getpid()) if exit_fd is not None else 0
    try:
        die_with_worker()
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
            _set_environ(_main.child_environ(environ))
        if "sys_path" in prep:
            prep["sys_path"] = _main.sys_path(prep)
        # sys.path, argv, cwd, the parent's authkey (handing over connections
        # checks it while unpickling) and the main module if not imported yet
        method = prep.pop("nimbus_start_method", None)
        with _main.bootstrapping():
            _main.prepare(prep)
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
            connect(program)
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
                    os.write(exit_fd, EXIT.pack(os.getpid(), code, began_at))
                except OSError:
                    pass
            os._exit(code)


def started(pid: int) -> int:
    """When process ``pid`` started (clock ticks since boot; 0 if it is gone): with its
    pid this names the process (its pid may be reused once it is reaped, never both)."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        stat = os.read(fd, 4096)
    except OSError:
        return 0
    finally:
        os.close(fd)
    fields = stat.rpartition(b")")[2].split()  # (its name may hold spaces and parentheses)
    return int(fields[19]) if len(fields) > 19 else 0  # field 22 of proc(5)


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
def libc() -> ctypes.CDLL:
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
