"""``nimbus.multiprocessing._terminate``: a SIGTERM to a process whose children run
elsewhere is passed on to them and ends the process, even one whose main thread is
stuck in C code (no Python handler runs there: review 8)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

STUCK = r"""
import ctypes, sys
from nimbus.multiprocessing import _terminate
_terminate.pass_on()
libc = ctypes.CDLL(None)
mutex = ctypes.create_string_buffer(64)  # PTHREAD_MUTEX_INITIALIZER (zeros, glibc)
libc.pthread_mutex_lock(mutex)
print("stuck", flush=True)
libc.pthread_mutex_lock(mutex)  # C code that never returns
"""


def test_a_sigterm_ends_a_process_stuck_in_c_code_as_by_default() -> None:
    proc = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "stuck\n"
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == -signal.SIGTERM
        assert time.monotonic() - start < 15
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
