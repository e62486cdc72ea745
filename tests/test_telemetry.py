"""nimbus.telemetry: socket byte counting and the TaskMeter, in this process."""

from __future__ import annotations

import io
import multiprocessing
import socket
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest

from nimbus.telemetry import TaskMeter, install_socket_counters, socket_bytes


@pytest.fixture(autouse=True)
def counters() -> None:
    install_socket_counters()
    install_socket_counters()  # idempotent: wrapping twice would count twice


@pytest.fixture(params=["socketpair", "tcp"])
def pair(request) -> Iterator[tuple[socket.socket, socket.socket]]:
    if request.param == "socketpair":
        a, b = socket.socketpair()
    else:
        with socket.create_server(("127.0.0.1", 0)) as server:
            a = socket.create_connection(server.getsockname())
            b, _ = server.accept()
    yield a, b
    a.close()
    b.close()


class Delta:
    def __enter__(self) -> Delta:
        self.start = socket_bytes()
        return self

    def __exit__(self, *exc: object) -> None:
        end = socket_bytes()
        self.bytes_in = end[0] - self.start[0]
        self.bytes_out = end[1] - self.start[1]


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk
        data += chunk
    return bytes(data)


def test_send_and_recv(pair) -> None:
    a, b = pair
    with Delta() as d:
        assert a.send(b"hello") == 5
        assert recv_exactly(b, 5) == b"hello"
    assert (d.bytes_in, d.bytes_out) == (5, 5)


def test_sendall_and_recv_into(pair) -> None:
    a, b = pair
    data = b"z" * 300_000
    with Delta() as d:
        sender = threading.Thread(target=a.sendall, args=(data,))
        sender.start()
        buf = bytearray(len(data))
        view = memoryview(buf)
        got = 0
        while got < len(data):
            got += b.recv_into(view[got:])
        sender.join()
    assert buf == data
    assert (d.bytes_in, d.bytes_out) == (len(data), len(data))


def test_sendall_memoryview_of_multibyte_items(pair) -> None:
    a, b = pair
    arr = memoryview(bytearray(4000)).cast("I")  # 1000 items of 4 bytes
    with Delta() as d:
        a.sendall(arr)
        recv_exactly(b, 4000)
    assert (d.bytes_in, d.bytes_out) == (4000, 4000)


def test_sendmsg_recvmsg_recvfrom(pair) -> None:
    a, b = pair
    with Delta() as d:
        assert a.sendmsg([b"ab", b"cd"]) == 4
        data, _, _, _ = b.recvmsg(2)
        assert data == b"ab"
        data, _ = b.recvfrom(2)
        assert data == b"cd"
        a.send(b"xyz")
        buf = bytearray(3)
        n, _ = b.recvfrom_into(buf)
        assert n == 3
    assert (d.bytes_in, d.bytes_out) == (7, 7)


def test_sendfile_counts_once(pair, tmp_path) -> None:
    a, b = pair
    path = tmp_path / "f.bin"
    data = bytes(range(256)) * 400
    path.write_bytes(data)
    with Delta() as d, path.open("rb") as f:
        assert a.sendfile(f) == len(data)
        assert recv_exactly(b, len(data)) == data
    assert (d.bytes_in, d.bytes_out) == (len(data), len(data))


def test_sendfile_fallback_to_send_counts_once(pair) -> None:
    """sendfile on a file object without a descriptor falls back to self.send: a nested call."""
    a, b = pair
    data = b"q" * 100_000
    with Delta() as d:
        result: list[int] = []
        sender = threading.Thread(target=lambda: result.append(a.sendfile(io.BytesIO(data))))
        sender.start()
        assert recv_exactly(b, len(data)) == data
        sender.join()
    assert result == [len(data)]
    assert (d.bytes_in, d.bytes_out) == (len(data), len(data))


def test_makefile_reads_and_writes_are_counted(pair) -> None:
    a, b = pair
    with Delta() as d:
        with a.makefile("wb") as w:
            w.write(b"line one\n")
        with b.makefile("rb") as r:
            assert r.readline() == b"line one\n"
    assert (d.bytes_in, d.bytes_out) == (9, 9)


def test_failed_nonblocking_recv_counts_nothing(pair) -> None:
    _a, b = pair
    b.setblocking(False)
    with Delta() as d, pytest.raises(BlockingIOError):
        b.recv(10)
    assert (d.bytes_in, d.bytes_out) == (0, 0)


def test_nested_calls_count_once() -> None:
    class Chatty(socket.socket):
        def send(self, data, flags=0):  # type: ignore[override]
            return super().send(data, flags)

        def sendall(self, data, flags=0):  # type: ignore[override]
            view = memoryview(data)
            while view:
                view = view[self.send(view, flags) :]

    left, right = socket.socketpair()
    a = Chatty(fileno=left.detach())
    try:
        with Delta() as d:
            a.sendall(b"n" * 1000)
            recv_exactly(right, 1000)
        assert (d.bytes_in, d.bytes_out) == (1000, 1000)
    finally:
        a.close()
        right.close()


def _metered_task(out: Connection) -> None:
    meter = TaskMeter()
    started = meter.begin()
    clock = time.time()  # the wall clock as the task began
    block = bytearray(30 << 20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    deadline = time.process_time() + 0.1
    while time.process_time() < deadline:  # (each read of that clock is a system call:
        sum(range(2000))  # user time between them, or the loop is mostly system time)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"m" * 1234)
        recv_exactly(b, 1234)
    out.send((started, clock, *meter.end()))


def test_task_meter_values() -> None:
    # in a forked child: the counters are per process, and this one has the store
    # threads of earlier tests (keepalive, watchers), whose bytes would count too
    ctx = multiprocessing.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_metered_task, args=(writer,))
    child.start()
    writer.close()
    started, clock, ended, cpu_user, cpu_system, peak, net_in, net_out = reader.recv()
    child.join(10)
    assert abs(started - clock) < 1.0
    assert started <= ended
    assert ended - started < 10
    assert cpu_user > 0.01
    assert cpu_system >= 0
    assert cpu_user + cpu_system >= 0.09
    assert cpu_user + cpu_system <= (ended - started) + 0.5
    assert peak >= 30 << 20  # bytes, not KiB
    assert peak < 64 << 30
    assert (net_in, net_out) == (1234, 1234)


def test_task_meter_is_per_task() -> None:
    meter = TaskMeter()
    meter.begin()
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"x" * 100)
        recv_exactly(b, 100)
    first = meter.end()
    meter.begin()
    second = meter.end()
    assert first[4:] == (100, 100)
    assert second[4:] == (0, 0)
    assert second[1] < 0.05  # nothing ran
