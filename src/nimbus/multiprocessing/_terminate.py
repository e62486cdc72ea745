"""SIGTERM to a process whose children run elsewhere: to them first, then its own end.

::

    SIGTERM (kill PID, timeout, a batch scheduler)
      handler (main thread): one byte to a pipe -------> the passer thread
                                                           each live child: Popen._send_signal
                                                           (at most PASS_WITHIN seconds)
      handler again: SIG_DFL, SIGTERM to itself  <------- SIGTERM to itself
      the process ends by SIGTERM, as without this

Children on an endpoint's workers are not this machine's processes: a SIGTERM
that ends their parent does not reach them, as a Ctrl-C from the terminal
does not (``_install.pass_interrupts``). This passes it on, as a signal sent
to a whole process group reaches each process of it. Sending a signal to a
remote child is a store call, which takes locks (redis-py's) the interrupted
main thread may hold: the handler only writes to a pipe and a thread sends
them. Installed by a site whose children run elsewhere (``_remote``), from
the main thread, where SIGTERM's handler is the default one (a program's own
stays); a child of such a parent that starts children installs it too, so
its children get it in turn. A parent that dies by SIGKILL runs nothing: the
workers then see its presence gone (``_remote.deliver_signals``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any

from nimbus.multiprocessing import _site

__all__ = ["PASS_WITHIN", "pass_on"]

PASS_WITHIN = 2.0  # seconds the children's signals may take before this process ends anyway


class _State:
    pid = 0  # the process that installed the handler (a fork of it ends as by default)
    wake = -1  # the pipe's write end
    passing = False
    passed = False


def pass_on() -> None:
    """From now on a SIGTERM to this process goes to its live children first.

    Only from the main thread (where handlers are set) and while SIGTERM's
    handler is the default one (or this one, inherited across a fork); once per process.
    """
    if _State.pid == os.getpid() or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, _on_terminate):
        return  # (ours: inherited from a worker that installed it, in a process it forked)
    read, write = os.pipe2(os.O_CLOEXEC)
    os.set_blocking(write, False)
    _State.pid, _State.wake, _State.passing, _State.passed = os.getpid(), write, False, False
    threading.Thread(target=_passer, args=(read,), name="nimbus-sigterm", daemon=True).start()
    signal.signal(signal.SIGTERM, _on_terminate)
    # the C-level handler writes the signal's number there at once, even while the main
    # thread is in C code that never returns (where no Python handler runs); unless the
    # program has a wakeup fd of its own (asyncio's): then the handler's byte alone
    with contextlib.suppress(ValueError, OSError):
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)


def _forked() -> None:
    if _State.wake != -1 and threading.current_thread() is threading.main_thread():
        with contextlib.suppress(ValueError, OSError):
            previous = signal.set_wakeup_fd(-1)  # the parent's pipe: not this process's
            if previous != _State.wake:  # (not ours: left as it was)
                signal.set_wakeup_fd(previous)


os.register_at_fork(after_in_child=_forked)


def _on_terminate(signum: int, frame: Any) -> None:
    """SIGTERM: wake the passer (no lock, no wait); once it passed it on, end as by default."""
    if _State.pid != os.getpid() or _State.passed:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if not _State.passing:  # (a second one while it is passed on: the same end)
        _State.passing = True
        with contextlib.suppress(OSError):
            os.write(_State.wake, b"T")


def _passer(read: int) -> None:
    """The thread that passes a SIGTERM on, then has this process end by it."""
    term = bytes([signal.SIGTERM])
    try:
        while True:  # (the wakeup fd also has the numbers of the other handled signals)
            got = os.read(read, 64)
            if not got or b"T" in got or term in got:
                break
    finally:
        os.close(read)
    _State.passing = True
    sender = threading.Thread(target=_send, name="nimbus-sigterm-send", daemon=True)
    sender.start()
    sender.join(PASS_WITHIN)  # an unreachable store does not keep the process alive
    _State.passed = True
    os.kill(os.getpid(), signal.SIGTERM)  # the handler, in the main thread, ends it
    # a main thread in C code that does not return runs no handler: ended as by default
    time.sleep(PASS_WITHIN)
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).signal(signal.SIGTERM, 0)  # SIG_DFL, below Python's handler
    os.kill(os.getpid(), signal.SIGTERM)


def _send() -> None:
    """SIGTERM to each live child this process started."""
    site = _site.this_site()
    if site is None:
        return
    for popen in list(site.popens.values()):
        with contextlib.suppress(Exception):  # one that just ended, a store gone
            popen._send_signal(signal.SIGTERM)
