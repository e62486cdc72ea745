"""``wait()`` over nimbus connections, stdlib objects and file descriptors.

::

    wait([conn, conn2, sock, fd], timeout)
      store-only nimbus connections, one store --> one BLPOP over their lists
      + file descriptors ----------------------> BLPOP, and a thread that waits on the fds
                                                 and wakes it through a private list
      a connection reading directly (_handover) -> slices of _SLICE seconds in turn
                                                 (the whole wait, if it is alone)
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Iterable
from multiprocessing import connection as _std
from typing import TYPE_CHECKING, Any

from nimbus.statestore import Keys, link

if TYPE_CHECKING:
    from nimbus.multiprocessing.connection import Connection

__all__ = ["seconds", "wait"]

_SLICE = 0.01  # seconds: how long wait() looks at one source when it must take turns


def seconds(timeout: float) -> str:
    """A BLPOP timeout: never 0 (which would block forever)."""
    return f"{max(timeout, 0.001):.3f}"


def wait(object_list: Iterable[Any], timeout: float | None, kind: type[Connection]) -> list[Any]:
    """The objects of ``object_list`` ready to read, waiting up to ``timeout`` seconds.

    Takes nimbus :class:`Connection` s, and anything the stdlib's ``wait``
    takes (file descriptors, objects with ``fileno()``, stdlib connections,
    sockets, process sentinels). Without file descriptors it blocks in one
    BLPOP over every nimbus connection's list; with both, a helper thread waits
    on the descriptors and wakes the BLPOP through a private list. A connection
    reading directly from its writer is waited on in slices of ``_SLICE``
    seconds, in turn with the others (or alone, if it is the only one).
    """
    objects = list(object_list)
    # an end with a descriptor (its pump reads it, see ``_pump``) is waited on as one
    ours = [o for o in objects if isinstance(o, kind) and o._pump is None]
    others = [o for o in objects if not (isinstance(o, kind) and o._pump is None)]
    for conn in ours:
        conn._check_closed()
    deadline = None if timeout is None else time.monotonic() + timeout
    ready: list[Any] = _ours_ready(ours, block=False) + (_std.wait(others, 0) if others else [])
    if ready or (timeout is not None and timeout <= 0):
        return _in_order(objects, ready)
    if not ours:
        return _std.wait(others, timeout)
    while True:  # again when what woke it was only a switch marker (the end went direct)
        if any(c._direct_now() for c in ours):
            return _in_order(objects, _wait_sliced(ours, others, deadline))
        remaining = None if deadline is None else max(0.001, deadline - time.monotonic())
        if not others and len({c._program.url for c in ours}) == 1:
            ready = list(_blpop(ours, remaining, None))
        else:
            ready = _wait_mixed(ours, others, deadline)
        if ready or (deadline is not None and time.monotonic() >= deadline):
            return _in_order(objects, ready)


def _in_order(objects: list[Any], ready: list[Any]) -> list[Any]:
    ids = {id(o) for o in ready}
    return [o for o in objects if id(o) in ids]


def _ours_ready(ours: list[Connection], *, block: bool) -> list[Connection]:
    """The connections with messages; without ``block``, one LPOP each (pipelined)."""
    ready = [c for c in ours if c._ready()]
    if ready or block:
        return ready
    for conn in ours:
        if conn._poll(0):
            ready.append(conn)
    return ready


def _blpop(ours: list[Connection], timeout: float | None, wake: str | None) -> list[Connection]:
    """One BLPOP over the lists of ``ours`` (and ``wake``); the message goes to its reader."""
    prog = ours[0]._program
    keys = [c._read_key for c in ours] + ([wake] if wake else [])
    secs: Any = 0 if timeout is None else seconds(timeout)
    replies = link(prog).call(("BLPOP", *keys, secs))
    popped = replies[0]
    if popped is not None:
        key = popped[0].decode()
        for conn in ours:
            if conn._read_key == key:
                conn._buffer.append(popped[1])
                break
    return _ours_ready(ours, block=False) if popped is not None else []


def _wait_sliced(ours: list[Connection], others: list[Any], deadline: float | None) -> list[Any]:
    """Wait on direct connections and the rest in turn, a short slice each."""
    while True:
        direct = [c for c in ours if c._direct_now()]
        rest = [c for c in ours if not c._direct_now()]
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if len(direct) == 1 and not rest and not others:
            direct[0]._poll(remaining)  # the common case: no slicing
        else:
            piece = _SLICE if remaining is None else min(_SLICE, remaining)
            for conn in direct:
                conn._poll(piece / len(direct) if not rest and not others else 0.0)
            by_url: dict[str, list[Connection]] = collections.defaultdict(list)
            for conn in rest:
                by_url[conn._program.url].append(conn)
            for group in by_url.values():
                _blpop(group, piece / len(by_url), None)
            if others and not by_url:
                _std.wait(others, piece)
        ready = _ours_ready(ours, block=False) + (_std.wait(others, 0) if others else [])
        if ready or (deadline is not None and time.monotonic() >= deadline):
            return ready


def _wait_mixed(ours: list[Connection], others: list[Any], deadline: float | None) -> list[Any]:
    by_url: dict[str, list[Connection]] = collections.defaultdict(list)
    for conn in ours:
        by_url[conn._program.url].append(conn)
    if len(by_url) > 1:  # several stores: short slices in turn
        while True:
            for group in by_url.values():
                hits: list[Any] = [*_blpop(group, 0.01, None), *_std.wait(others, 0)]
                if hits:
                    return hits
            if deadline is not None and time.monotonic() >= deadline:
                return []
    prog = ours[0]._program
    wake = prog.keys.wakeup(Keys.new_name())
    stop_r, stop_w = os.pipe()
    found: list[Any] = []

    def watch() -> None:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        hits = _std.wait([*others, stop_r], remaining)
        if stop_r not in hits:
            found.extend(hits)
            link(prog).call(("RPUSH", wake, "1"), ("PEXPIRE", wake, prog.ttl_ms))

    thread = threading.Thread(target=watch, name="nimbus-wait", daemon=True)
    thread.start()
    try:
        remaining = None if deadline is None else max(0.001, deadline - time.monotonic())
        ready: list[Any] = list(_blpop(ours, remaining, wake))
    finally:
        os.write(stop_w, b"x")
        thread.join()
        os.close(stop_r)
        os.close(stop_w)
        link(prog).call(("DEL", wake))
    return ready + (_std.wait(others, 0) if others else [])
