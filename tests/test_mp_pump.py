"""A reading end's file descriptor (``_pump``): ``select``/``poll`` on nimbus Pipes."""

from __future__ import annotations

import os
import select
import selectors
import time
from multiprocessing import connection as stdlib_connection

import pytest

import nimbus.multiprocessing as nmp
from nimbus.multiprocessing.connection import Connection, Pipe, wait


def _readable(fd: int, timeout: float) -> bool:
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    return bool(poll.poll(timeout * 1000))


def test_descriptor_readable_exactly_while_a_message_is_in_hand() -> None:
    r, w = Pipe(duplex=False)
    fd = r.fileno()
    assert r.fileno() == fd
    assert not _readable(fd, 0.2)
    assert not r.poll(0)
    w.send("one")
    w.send("two")
    assert _readable(fd, 10)
    assert r.poll(0)
    assert r.recv() == "one"
    assert _readable(fd, 10)
    assert r.recv() == "two"
    assert not _readable(fd, 0.2)
    w.close()
    assert _readable(fd, 10)  # end-of-stream, as a closed OS pipe
    with pytest.raises(EOFError):
        r.recv()
    with pytest.raises(EOFError):
        r.recv()
    r.close()


def test_stdlib_wait_and_selectors_take_the_end() -> None:
    r, w = Pipe(duplex=False)
    other_r, other_w = Pipe(duplex=False)
    r.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(r, selectors.EVENT_READ)
        assert sel.select(0.1) == []
        w.send(1)
        assert [key.fileobj for key, _ in sel.select(10)] == [r]
    assert stdlib_connection.wait([r], 10) == [r]
    other_w.send(2)
    assert wait([other_r, r], 10) == [other_r, r]  # nimbus's wait: one with, one without
    assert (r.recv(), other_r.recv()) == (1, 2)
    for conn in (r, w, other_r, other_w):
        conn.close()


def test_a_closed_end_gives_its_message_in_hand_back() -> None:
    r, w = Pipe(duplex=False)
    w.send("kept")
    r2 = Connection(*r.__reduce__()[1])  # a second copy of the reading end
    r.fileno()
    assert _readable(r.fileno(), 10)  # the pump holds "kept"
    r.close()
    assert r2.recv() == "kept"
    w.close()
    r2.close()


def _poll_recv_one(r: Connection) -> None:
    assert _readable(r.fileno(), 30)
    print("child", r.recv(), flush=True)
    time.sleep(0.5)  # its pump takes the next message ahead meanwhile


@pytest.mark.timeout(120)
def test_child_exiting_with_a_message_in_hand_gives_it_back() -> None:
    r, w = nmp.Pipe(duplex=False)
    for i in range(3):
        w.send(i)
    p = nmp.Process(target=_poll_recv_one, args=(r,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert r.poll(10)
    assert (r.recv(), r.recv()) == (1, 2)
    r.close()
    w.close()


def test_forked_copy_forgets_the_pump() -> None:
    r, w = Pipe(duplex=False)
    r.fileno()
    pid = os.fork()
    if pid == 0:  # a forked Process's bootstrap: the pump and its message are the parent's
        code = 1
        try:
            r._finalize()  # the hook Connection registers with util.register_after_fork
            code = 0 if r._pump is None and r._pumps == [] else 2
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    w.send("x")
    assert r.recv() == "x"
    r.close()
    w.close()
