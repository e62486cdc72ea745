"""nimbus._loop's collector thresholds of a serving process, in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys

from nimbus import _loop

PROGRAM = """
import gc, json, os, sys
stdlib = gc.get_threshold()
from nimbus import _loop
_loop.serving_gc()
_loop.serving_gc()  # (twice: one reset at fork, not two)
served = gc.get_threshold()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, json.dumps(gc.get_threshold()).encode())
    os._exit(0)
os.waitpid(pid, 0)
print(json.dumps([stdlib, served, json.loads(os.read(r, 100)), gc.get_threshold()]))
"""


def test_a_serving_process_collects_less_often_and_its_forks_as_the_stdlib() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    stdlib, served, forked, after = (tuple(t) for t in json.loads(out))
    assert served == after == _loop.SERVING_GC
    assert served[0] > stdlib[0]
    assert forked == stdlib
