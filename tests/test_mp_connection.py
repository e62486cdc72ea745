"""nimbus.multiprocessing.connection: Pipe, Connection and wait over a real state store."""

from __future__ import annotations

import array
import gc
import multiprocessing
import os
import pickle
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from nimbus.errors import StateStoreError
from nimbus.multiprocessing import connection
from nimbus.multiprocessing.connection import BufferTooShort, Pipe, wait
from nimbus.statestore import EmbeddedRedis, Keys, Link, Program, link, program

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def spawn() -> multiprocessing.context.SpawnContext:
    program()  # the store is started before any child needs it
    return multiprocessing.get_context("spawn")


def _echo(conn: connection.Connection) -> None:
    while True:
        try:
            obj = conn.recv()
        except EOFError:
            break
        conn.send(obj)
    conn.close()


def _send_many(conn: connection.Connection, n: int) -> None:
    for i in range(n):
        conn.send(i)
    conn.close()


def test_send_recv_objects_and_bytes() -> None:
    a, b = Pipe()
    a.send({"x": [1, 2, 3]})
    assert b.recv() == {"x": [1, 2, 3]}
    b.send_bytes(b"hello world", 6, 5)
    assert a.recv_bytes() == b"world"
    a.send_bytes(b"")
    assert b.recv_bytes() == b""
    big = os.urandom(200_000)
    a.send((big, "tail"))  # large buffers travel out of band
    assert b.recv() == (big, "tail")
    a.send_bytes(pickle.dumps([1]))
    assert b.recv() == [1]


def test_send_bytes_argument_errors() -> None:
    a, _ = Pipe()
    with pytest.raises(ValueError):
        a.send_bytes(b"abc", -1)
    with pytest.raises(ValueError):
        a.send_bytes(b"abc", 4)
    with pytest.raises(ValueError):
        a.send_bytes(b"abc", 1, 3)
    with pytest.raises(ValueError):
        a.send_bytes(b"abc", 0, -1)


def test_recv_bytes_into_and_too_short() -> None:
    a, b = Pipe()
    a.send_bytes(b"abcdef")
    buf = bytearray(10)
    assert b.recv_bytes_into(buf, 2) == 6
    assert buf == bytearray(b"\0\0abcdef\0\0")
    arr = array.array("i", [0] * 4)
    a.send_bytes(array.array("i", [1, 2, 3]))
    assert b.recv_bytes_into(arr) == 12
    assert arr.tolist() == [1, 2, 3, 0]
    a.send_bytes(b"x" * 20)
    with pytest.raises(BufferTooShort) as info:
        b.recv_bytes_into(bytearray(5))
    assert info.value.args[0] == b"x" * 20
    with pytest.raises(ValueError):
        b.recv_bytes_into(bytearray(5), -1)


def test_recv_bytes_maxlength() -> None:
    a, b = Pipe()
    with pytest.raises(ValueError):
        b.recv_bytes(-1)
    a.send_bytes(b"x" * 10)
    with pytest.raises(OSError):
        b.recv_bytes(5)


def test_poll_timeouts() -> None:
    a, b = Pipe()
    assert b.poll() is False
    assert b.poll(-1) is False
    start = time.monotonic()
    assert b.poll(0.2) is False
    assert 0.15 < time.monotonic() - start < 2
    a.send(1)
    assert b.poll(1) is True
    assert b.poll() is True
    assert b.recv() == 1


def test_one_way_pipe() -> None:
    r, w = Pipe(duplex=False)
    assert (r.readable, r.writable, w.readable, w.writable) == (True, False, False, True)
    with pytest.raises(OSError):
        r.send(1)
    with pytest.raises(OSError):
        w.recv()
    w.send(5)
    assert r.recv() == 5


def test_closed_handle_and_eof() -> None:
    a, b = Pipe()
    a.send("last")
    a.close()
    assert a.closed
    for op in (a.recv, a.poll, a.fileno, lambda: a.send(1)):
        with pytest.raises(OSError):
            op()
    a.close()  # twice is fine
    assert b.recv() == "last"
    assert b.poll() is True  # at end of stream
    with pytest.raises(EOFError):
        b.recv()
    with pytest.raises(EOFError):
        b.recv_bytes()


def test_context_manager_and_fileno() -> None:
    a, b = Pipe()
    with a:
        assert isinstance(a.fileno(), int)  # a reading end's descriptor (tests/test_mp_pump.py)
    assert a.closed
    _r, w = Pipe(duplex=False)
    with pytest.raises(OSError):
        w.fileno()  # a write-only end has none
    with pytest.raises(EOFError):
        b.recv()


def test_cross_process_echo_and_eof(spawn: multiprocessing.context.SpawnContext) -> None:
    conn, child = Pipe()
    p = spawn.Process(target=_echo, args=(child,))
    p.start()
    child.close()  # before the child has started: its copy keeps the end open
    for obj in ("a", 1, list(range(100)), b"x" * 1024):
        conn.send(obj)
        assert conn.recv() == obj
    conn.close()  # the child sees EOF, closes its end and exits
    p.join(20)
    assert p.exitcode == 0


def test_ordering_across_processes(spawn: multiprocessing.context.SpawnContext) -> None:
    r, w = Pipe(duplex=False)
    p = spawn.Process(target=_send_many, args=(w, 10_000))
    p.start()
    w.close()
    got = []
    while True:
        try:
            got.append(r.recv())
        except EOFError:
            break
    p.join(20)
    assert got == list(range(10_000))


def test_an_end_collected_mid_link_call_is_released_by_another_thread() -> None:
    """The cyclic GC runs finalizers in whichever thread allocates, here in the
    middle of this thread's own call on its link (its commands sent, their replies
    not yet read): the collected end's release must not use that link (its replies
    would be read by the wrong caller), so it is queued; the releasing thread
    sends it, and the peer still reads end-of-stream."""
    a, b = Pipe()
    b.cycle = b  # type: ignore[attr-defined]  # only the cyclic GC frees it
    del b
    store = link(program())
    fired = []

    def collect_in_first_read(frame: object, event: str, arg: object) -> None:
        if event == "call" and frame.f_code is Link.read.__code__ and not fired:  # type: ignore[attr-defined]
            fired.append(gc.collect())  # the finalizer runs here

    gc.disable()
    sys.settrace(collect_in_first_read)  # type: ignore[arg-type]
    try:
        replies = store.call(("ECHO", "one"), ("ECHO", "two"))
    finally:
        sys.settrace(None)
        gc.enable()
    assert fired and fired[0] > 0
    assert replies == [b"one", b"two"]
    assert a.poll(10)
    with pytest.raises(EOFError):  # b's only copy was released: end-of-stream
        a.recv()
    assert store.command("PING") == b"PONG"  # the link is in step


def test_wait_on_connections() -> None:
    a, b = Pipe()
    c, d = Pipe()
    assert wait([b, d], 0) == []
    start = time.monotonic()
    assert wait([b, d], 0.2) == []
    assert time.monotonic() - start >= 0.15
    c.send(1)
    assert wait([b, d], 5) == [d]
    assert d.recv() == 1
    a.close()
    assert wait([b, d], 5) == [b]  # end of stream counts as ready


def test_wait_on_a_mix(spawn: multiprocessing.context.SpawnContext) -> None:
    a, b = Pipe()
    std_r, std_w = multiprocessing.Pipe(duplex=False)
    s1, s2 = socket.socketpair()
    rfd, wfd = os.pipe()
    try:
        objects = [b, std_r, s1, rfd]
        assert wait(objects, 0.05) == []
        std_w.send("hi")
        assert wait(objects, 5) == [std_r]
        std_r.recv()
        os.write(wfd, b"x")
        assert wait(objects, 5) == [rfd]
        os.read(rfd, 1)
        a.send(1)
        s2.send(b"x")
        assert wait(objects, 5) == [b, s1]
        # a wait blocked in the store wakes up for a file descriptor
        p = spawn.Process(target=time.sleep, args=(0.3,))
        p.start()
        start = time.monotonic()
        b.recv()
        s1.recv(1)
        assert wait([b, p.sentinel], 10) == [p.sentinel]
        assert time.monotonic() - start < 8
        p.join()
    finally:
        s1.close()
        s2.close()
        os.close(rfd)
        os.close(wfd)


def test_stdlib_reexports() -> None:
    from multiprocessing import connection as std

    for name in ("Listener", "Client", "answer_challenge", "deliver_challenge"):
        assert getattr(connection, name) is getattr(std, name)
    with connection.Listener(family="AF_UNIX", authkey=b"k") as listener:
        assert listener.address


def test_store_failures_under_recv_are_clear_errors(tmp_path: Path) -> None:
    """A receive waiting in the store: a refused command and a store that dies are
    StateStoreErrors naming the store, not a hang; a failed receive loses nothing."""
    server = EmbeddedRedis(tmp_path).start()
    try:
        prog = Program(server.url, Keys.program_id_new(), 30.0)
        a, b = Pipe(prog=prog)
        a.send("kept")  # waits in the list while b's receive is refused
        client = prog.client()
        reading = b._read_key
        assert reading is not None
        client.rename(reading, "aside")
        client.set(reading, "not a list")
        with pytest.raises(StateStoreError, match=r"refused a command.*WRONGTYPE"):
            b.recv()
        client.delete(reading)
        client.rename("aside", reading)
        assert b.recv() == "kept"
        stop = threading.Timer(0.3, server.stop)
        stop.start()
        with pytest.raises(StateStoreError, match="unreachable") as caught:
            b.recv()  # waiting in the store when it stops
        assert server.url in str(caught.value)
        stop.join()
    finally:
        server.stop()
