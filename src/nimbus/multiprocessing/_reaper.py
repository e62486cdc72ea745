"""The reaper: one thread per warm worker that waits for all the children it forked.

::

    _forking / a standby: with reaper.lock: pid = fork(); reaper.add(pid, token, remote)
    the thread: os.waitpid(-1) -> worker.notify(["exit", token, code])  (a local parent)
                                  _remote.report_exit(program, inbox, token, code)  (a remote one)

``tokens`` maps each live child to its process's token (None: a standby still
waiting for one); forks happen under ``lock``, so a child is known before it
can be reaped. Used by ``_forking`` and its standbys alone.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from nimbus import statestore
from nimbus.multiprocessing import _remote

__all__ = ["reaper"]


class Reaper:
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


reaper = Reaper()
