"""nimbus.multiprocessing._releasing: finalizers' work run later, on a thread of its own."""

from __future__ import annotations

import os
import threading
import time

import pytest

from nimbus.multiprocessing import _releasing

pytestmark = pytest.mark.timeout(30)


def _wait_for(done: threading.Event) -> bool:
    return done.wait(10)


def test_queued_work_runs_in_order_on_another_thread() -> None:
    ran: list[tuple[int, int]] = []
    done = threading.Event()

    def record(i: int) -> None:
        ran.append((i, threading.get_ident()))
        if i == 99:
            done.set()

    for i in range(100):
        _releasing.later(record, (i,))
    assert _wait_for(done)
    assert [i for i, _ in ran] == list(range(100))
    assert {t for _, t in ran} != {threading.get_ident()}


def test_a_forked_child_runs_its_own_work_and_none_of_its_parents() -> None:
    """The parent's queue and thread stay the parent's: a child's ``later`` starts
    its own thread, and work the parent queued is not run again in the child."""
    started = threading.Event()
    _releasing.later(started.set, ())
    assert _wait_for(started)  # the parent's thread runs
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its own work ran, and nothing else did
        try:
            os.close(r)
            ran: list[str] = []
            done = threading.Event()
            _releasing.later(lambda: (ran.append("child"), done.set()), ())
            ok = done.wait(10) and ran == ["child"]
            os.write(w, b"ok" if ok else b"no")
        finally:
            os._exit(0)
    os.close(w)
    try:
        deadline = time.monotonic() + 20
        answer = b""
        while not answer and time.monotonic() < deadline:
            answer = os.read(r, 2)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert answer == b"ok"


_TWO_FIRST_CALLS = """
import os, sys, threading, time
from nimbus.multiprocessing import _releasing

def tasks():
    return len(os.listdir("/proc/self/task"))

before = tasks()
done = threading.Event()
reentered = []

def trace(frame, event, arg):
    # the first call, about to make its pipe: a second first call comes in (as a
    # finalizer the collector runs there, or another thread, would)
    if frame.f_code is _releasing.later.__code__ and event == "line" and not reentered:
        if "os.pipe()" in open(frame.f_code.co_filename).readlines()[frame.f_lineno - 1]:
            reentered.append(1)
            _releasing.later(lambda: None, ())
    return trace

sys.settrace(trace)
_releasing.later(done.set, ())
sys.settrace(None)
assert reentered, "the trace did not find the pipe's line"
assert done.wait(10)
time.sleep(0.2)
print(tasks() - before)
"""


def test_two_first_calls_start_one_thread() -> None:
    """A second ``later`` while the first is starting the thread starts no other."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", _TWO_FIRST_CALLS],
        capture_output=True,
        text=True,
        timeout=20,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
