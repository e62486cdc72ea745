"""Standbys: children a warm worker forks ahead of need, each waiting for a process.

::

    _forking.start -> hand_over(token, args, pool): a standby's pid (one write to its
                      pipe), or None (_forking forks afresh)
                   -> after_start(program, pool): the next forked when the worker is idle
    a standby: die_with_worker(); connect to the last program's store; read os.environ;
               wait on its pipe -> _child.run(*args), or end-of-file -> os._exit(0)

Forking is off a start's path: the worker forks a standby again as soon as it is
idle (the first) or quiet (the others). Used by ``_forking`` alone.
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any

from nimbus import statestore
from nimbus.multiprocessing import _child
from nimbus.multiprocessing._reaper import reaper

__all__ = ["POOL_QUIET", "after_start", "close_pipes", "hand_over", "settle"]

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
        with reaper.lock:
            self.pid = _child.fork()
            if self.pid == 0:
                os.close(self.fd)
                close_pipes()
                _await_process(read, program)  # never returns
            reaper.add(self.pid, None)
        os.close(read)

    def run(self, token: str, args: tuple[Any, ...]) -> int | None:
        """Give the process to this child; its pid, or None if it is gone (fork afresh)."""
        payload = pickle.dumps(args, protocol=5)
        with reaper.lock:
            if self.pid not in reaper.tokens:  # died idle, and reaped
                os.close(self.fd)
                return None
            reaper.tokens[self.pid] = token
        try:
            with open(self.fd, "wb") as pipe:  # closed after: end of the message
                pipe.write(payload)
        except OSError:
            with reaper.lock:
                if reaper.tokens.get(self.pid) != token:
                    return self.pid  # already reaped: its exit code went to the parent
                reaper.tokens[self.pid] = None
            return None
        return self.pid

    def discard(self) -> None:
        os.close(self.fd)


_standbys: list[_Standby] = []  # the last one is handed a process first
_program: statestore.Program | None = None  # of the last start: the standbys connect to its store
_topping_up = False
_keep = 2  # standbys this worker keeps (grows with the bursts it serves)


def close_pipes() -> None:
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


def hand_over(token: str, args: tuple[Any, ...], pool: bool) -> int | None:
    """Give the process to a standby: its pid, or None (none is left: fork one). A start
    while others of this worker run is part of a burst: it keeps more standbys."""
    global _keep
    with reaper.lock:  # processes of this worker running now: is this start part of a burst?
        running = sum(1 for token in reaper.tokens.values() if token is not None)
    if not pool:  # (a Pool's burst is of processes that stay: it starts no more soon)
        _keep = max(_keep, min(STANDBYS_MAX, running + 2))
    while _standbys:
        standby = _standbys.pop()
        if standby.modules == len(sys.modules):
            started = standby.run(token, args)
            if started is not None:
                return started
        else:  # forked before modules this process needs were imported
            standby.discard()
    return None


def after_start(program: statestore.Program, pool: bool) -> None:
    """After a start: the next skips the fork and the store's connection (a standby forked
    when the worker is idle, the others once it is quiet); this one is not held up."""
    global _program
    _program = program
    if not _standbys and not pool:
        from nimbus.runtime import worker

        worker.when_idle(_refill)
    _top_up_later(POOL_QUIET if pool else STANDBY_QUIET)


def settle(program: statestore.Program) -> None:
    """The store's client settings, made once here for every fork, if a process of the
    program used the store already (else they, and redis-py, wait for a first use)."""
    if "redis" in sys.modules:
        statestore.link(program)


def _refill() -> None:
    """Fork a standby child if this worker has fewer than it keeps."""
    if len(_standbys) < _keep and _program is not None:
        settle(_program)
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


def _await_process(fd: int, program: statestore.Program) -> None:
    """In a standby child: wait for a process to run, or end quietly."""
    _child.die_with_worker()
    _child.connect(program)
    _child.read_environ()
    try:
        with open(fd, "rb") as pipe:
            payload = pipe.read()
        if not payload:
            os._exit(0)
        args = pickle.loads(payload)
    except BaseException:
        os._exit(0)
    _child.run(*args)
