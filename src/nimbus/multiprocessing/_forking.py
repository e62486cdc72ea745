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

::

    popen_nimbus: site.start(_forking.start, token, prep, program, data, buffers)
    start -> _main.import_main(prep)            (the program's main module, once a worker)
          -> _standby.hand_over(...)            (a standby runs it: one write to its pipe)
             or _fork(args) -> _child.run(...)  (a new fork; SIGINT held back until it runs)
          <- pid; the reaper (``_reaper``) reports its exit, the child writes it to the
             Popen's pipe itself (``exit_to``: an ``EXIT`` record, pid and code)

Its parts, imported by this module and by each other alone (``tests/test_layers.py``
pins it): the child (``_child``), the standbys (``_standby``) and the reaper
(``_reaper``); the main module's import in a worker is ``_main``'s.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

from nimbus import _install, statestore
from nimbus.multiprocessing import _child, _main, _remote, _standby
from nimbus.multiprocessing._child import EXIT, started
from nimbus.multiprocessing._reaper import reaper

__all__ = ["EXIT", "STORE_MODULES", "WARM_MODULES", "start", "started"]


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
    # a Pool's processes start together and then work: no warm-up nor standby forks take
    # CPU from them (nor hold up the reaper's exit notices) until the worker is quite quiet
    pool = prep.pop("pool", False)
    # not on the path of this start, nor of the next ones of a burst (a Pool's): after a
    # quiet moment (a forked worker imports its preload, the same modules, later still)
    _warm_later(_warm_up, _standby.POOL_QUIET if pool else WARM_QUIET)
    if prep.pop("store", False):  # the process will likely use it too: import it once
        _warm_store()  # here, for this worker's children, rather than in each of them
    _child.libc()  # loaded once here, not in every child
    if prep.get("install") and not prep.get("forward"):  # this local worker is the program's:
        _install.install()  # before main and the modules are imported, as in the parent
    _main.import_main(prep)
    for name in prep.pop("modules", ()):
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except BaseException:  # the child imports it again and reports the error
                pass
    args = (token, prep, program, data, buffers)
    inbox = prep.get("forward")  # a remote parent's: exits and output go there
    if inbox:
        parent = prep.pop("presence", None)  # the child ends once the parent's is gone
        watcher = _remote.watch_signals(program, inbox, token)
        pid = _fork(args, (program, inbox))
        alive = lambda: pid in reaper.tokens  # noqa: E731
        _remote.deliver_signals(watcher, program, token, alive, reaper.killer(pid), parent, pid)
        return pid
    started = _standby.hand_over(token, args, pool)
    if started is None:
        _standby.settle(program)
        started = _fork(args)
    _standby.after_start(program, pool)  # the next start skips the fork
    return started


def _fork(args: tuple[Any, ...], remote: tuple[statestore.Program, str] | None = None) -> int:
    """Fork a child that runs ``_child.run(*args)``; the reaper waits for it."""
    with reaper.lock:
        pid = _child.fork()
        if pid == 0:
            _standby.close_pipes()
            _child.run(*args)  # never returns
        reaper.add(pid, args[0], remote)
    return pid
