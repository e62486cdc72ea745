"""nimbus.wire: frames over a real socketpair."""

from __future__ import annotations

import os
import queue
import select
import socket
import struct
import threading
from collections.abc import Iterator

import pytest

from nimbus.wire import HEADER, SCRATCH, Channel, Frame, ProtocolError, pack, unpack


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def receive_n(channel: Channel, n: int, timeout: float = 10.0) -> list[Frame]:
    """Receive exactly ``n`` frames from a non-blocking channel."""
    frames: list[Frame] = []
    while len(frames) < n:
        ready, _, _ = select.select([channel.sock], [], [], timeout)
        assert ready, f"timed out with {len(frames)} of {n} frames"
        got = channel.receive()
        assert got is not None, "unexpected end of stream"
        frames.extend(got)
    return frames


def raw_frame(kind: int, meta: bytes, buffers: list[bytes]) -> bytes:
    """The exact bytes a Channel writes for one frame."""
    a, b = socket.socketpair()
    with a, b:
        out = Channel(a)
        out.send(kind, meta, buffers)
        total = out.pending_output
        sender = threading.Thread(target=out.flush)
        sender.start()
        data = bytearray()
        while len(data) < total:
            data += b.recv(1 << 20)
        sender.join()
    return bytes(data)


def test_pack_unpack() -> None:
    obj = ["3.11", [[1, "key", None, b"\x00\x01", 2, True]], {"a": 1, 2: "b"}]
    assert unpack(pack(obj)) == obj


def test_many_small_frames(pair) -> None:
    a, b = pair
    out, inp = Channel(a), Channel(b)
    b.setblocking(False)
    n = 5000  # enough to cross the scratch buffer boundary many times
    received: list[Frame] = []
    for i in range(n):
        out.send(i % 200, pack([i, "x" * (i % 37)]))
        if i % 500 == 499:
            assert out.flush()
            received.extend(receive_n(inp, 500))
    assert len(received) == n
    for i, frame in enumerate(received):
        assert frame.kind == i % 200
        assert unpack(frame.meta) == [i, "x" * (i % 37)]
        assert frame.buffers == []
    assert out.bytes_out == inp.bytes_in


@pytest.mark.parametrize("nbufs", [0, 1, 2, 5, 100, 600])  # 600 > MAX_IOV
def test_frames_with_buffers(pair, nbufs: int) -> None:
    a, b = pair
    out, inp = Channel(a), Channel(b)
    b.setblocking(False)
    buffers = [bytes([i % 256]) * (i * 13 % 1000) for i in range(nbufs)]  # includes empty ones
    out.send(7, pack({"n": nbufs}), buffers)
    out.send(8, b"")  # an empty meta right after
    sender = threading.Thread(target=out.flush)
    sender.start()
    frames = receive_n(inp, 2)
    sender.join()
    assert frames[0].kind == 7
    assert unpack(frames[0].meta) == {"n": nbufs}
    assert [bytes(x) for x in frames[0].buffers] == buffers
    assert frames[1].kind == 8 and frames[1].meta == b"" and frames[1].buffers == []


def test_buffer_kinds(pair) -> None:
    a, b = pair
    out, inp = Channel(a), Channel(b)
    b.setblocking(False)
    data = os.urandom(200_000)
    out.send(1, b"m", [data, bytearray(data[:1000]), memoryview(data)[5:70_000]])
    sender = threading.Thread(target=out.flush)
    sender.start()
    (frame,) = receive_n(inp, 1)
    sender.join()
    assert [bytes(x) for x in frame.buffers] == [data, data[:1000], data[5:70_000]]


def test_50mb_buffer(pair) -> None:
    a, b = pair
    out, inp = Channel(a), Channel(b)
    big = os.urandom(1 << 20) * 50
    out.send(3, pack("big"), [b"head", big, b"tail"])
    sender = threading.Thread(target=out.flush)
    sender.start()
    frames: list[Frame] = []
    while not frames:
        got = inp.receive(block=True)
        assert got is not None
        frames.extend(got)
    sender.join()
    (frame,) = frames
    assert unpack(frame.meta) == "big"
    assert bytes(frame.buffers[0]) == b"head"
    assert len(frame.buffers[1]) == len(big) and frame.buffers[1] == big
    assert bytes(frame.buffers[2]) == b"tail"


def test_frame_split_at_every_byte_boundary() -> None:
    raw = raw_frame(5, pack({"k": list(range(20))}), [b"", b"abc", bytes(range(256))])
    for cut in range(1, len(raw)):
        a, b = socket.socketpair()
        with a, b:
            b.setblocking(False)
            inp = Channel(b)
            a.sendall(raw[:cut])
            assert inp.receive() == [], f"a frame completed after {cut} of {len(raw)} bytes"
            a.sendall(raw[cut:])
            (frame,) = receive_n(inp, 1)
            assert frame.kind == 5
            assert unpack(frame.meta) == {"k": list(range(20))}
            assert [bytes(x) for x in frame.buffers] == [b"", b"abc", bytes(range(256))]


@pytest.mark.parametrize("big", [False, True], ids=["small", "big-buffer"])
def test_frames_fed_one_byte_at_a_time(pair, big: bool) -> None:
    """A blocking sender thread writes the frames byte by byte, in lock step."""
    a, b = pair
    size = SCRATCH // 4 + 1000 if big else 300  # big: received into its own bytearray
    payload = os.urandom(size)
    raw = raw_frame(9, pack(["one"]), [payload]) + raw_frame(10, pack(["two"]), [])
    step = 97 if big else 1
    go: queue.Queue[int] = queue.Queue()

    def sender() -> None:
        for start in range(0, len(raw), step):
            go.get()
            a.sendall(raw[start : start + step])

    thread = threading.Thread(target=sender)
    thread.start()
    b.setblocking(False)
    inp = Channel(b)
    frames: list[Frame] = []
    for start in range(0, len(raw), step):
        go.put(1)
        while True:  # wait for the chunk, then take what is complete
            ready, _, _ = select.select([b], [], [], 5)
            assert ready
            got = inp.receive()
            assert got is not None
            frames.extend(got)
            if inp.bytes_in >= min(start + step, len(raw)):
                break
        if start + step < len(raw) - len(raw_frame(10, pack(["two"]), [])):
            assert not frames, f"frame completed early at byte {start + step}"
    thread.join()
    assert [f.kind for f in frames] == [9, 10]
    assert bytes(frames[0].buffers[0]) == payload
    assert unpack(frames[1].meta) == ["two"]


def test_nonblocking_partial_writes_with_flush(pair) -> None:
    a, b = pair
    a.setblocking(False)
    out = Channel(a)
    data = os.urandom(1 << 20) * 8
    out.send(4, pack("first"), [data])
    out.send(5, pack("second"), [b"x" * 10])
    total = out.pending_output
    assert out.flush() is False  # the socket buffer cannot take 8 MB at once
    assert 0 < out.pending_output < total

    inp = Channel(b)
    frames: list[Frame] = []

    def reader() -> None:
        while len(frames) < 2:
            got = inp.receive(block=True)
            assert got is not None
            frames.extend(got)

    thread = threading.Thread(target=reader)
    thread.start()
    while not out.flush():
        _, writable, _ = select.select([], [a], [], 5)
        assert writable
    thread.join(10)
    assert out.pending_output == 0
    assert out.bytes_out == total == inp.bytes_in
    assert [f.kind for f in frames] == [4, 5]
    assert frames[0].buffers[0] == data
    assert bytes(frames[1].buffers[0]) == b"x" * 10


def test_flush_on_empty_channel(pair) -> None:
    assert Channel(pair[0]).flush() is True


def test_eof_returns_none(pair) -> None:
    a, b = pair
    out, inp = Channel(a), Channel(b)
    out.send(1, b"last")
    out.flush()
    a.close()
    frames = inp.receive(block=True)
    assert frames is not None and frames[0].meta == b"last"
    assert inp.receive(block=True) is None


def test_frames_before_a_reset_are_returned_then_none(pair) -> None:
    """A peer that dies with bytes unread (a worker with tasks queued to it) resets the
    stream: the frames completed before the reset still come, then None. The read that
    completes a large buffer fills its room, and the next one met the reset: the frame
    was dropped with it (the worker's last result lost, its task failed as WorkerLost)."""
    a, b = pair
    raw = raw_frame(12, b"result", [b"r" * (SCRATCH // 2)])  # a large buffer: read apart
    inp = Channel(b)
    b.setblocking(False)
    a.sendall(raw[:1000])
    assert receive_n(inp, 0) == [] and inp.receive() == []  # the large buffer begun
    b.sendall(b"tasks queued to it, never read")
    a.sendall(raw[1000:])
    a.close()  # with unread bytes: ECONNRESET, not an end of stream
    frames = inp.receive()
    assert frames is not None and [f.meta for f in frames] == [b"result"]
    assert bytes(frames[0].buffers[0]) == b"r" * (SCRATCH // 2)
    assert inp.receive() is None


def test_eof_mid_frame_returns_none(pair) -> None:
    a, b = pair
    raw = raw_frame(1, b"meta", [b"x" * 1000])
    a.sendall(raw[: len(raw) // 2])
    a.close()
    inp = Channel(b)
    got = inp.receive(block=True)
    while got == []:
        got = inp.receive(block=True)
    assert got is None


def test_nonblocking_receive_with_nothing_returns_empty(pair) -> None:
    pair[1].setblocking(False)
    assert Channel(pair[1]).receive() == []


def test_bad_magic_raises_protocol_error(pair) -> None:
    a, b = pair
    a.sendall(HEADER.pack(b"XX", 1, 1, 0, 0))
    with pytest.raises(ProtocolError):
        Channel(b).receive(block=True)


def test_bad_version_raises_protocol_error(pair) -> None:
    a, b = pair
    a.sendall(HEADER.pack(b"NB", 99, 1, 0, 0))
    with pytest.raises(ProtocolError):
        Channel(b).receive(block=True)


def test_garbage_raises_protocol_error(pair) -> None:
    a, b = pair
    a.sendall(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(ProtocolError):
        Channel(b).receive(block=True)


def test_header_layout() -> None:
    raw = raw_frame(12, b"meta", [b"ab", b"cde"])
    magic, version, kind, nbufs, meta_len = HEADER.unpack_from(raw)
    assert (magic, version, kind, nbufs, meta_len) == (b"NB", 1, 12, 2, 4)
    assert struct.unpack_from("<2Q", raw, HEADER.size) == (2, 3)
    assert raw[HEADER.size + 16 :] == b"metaabcde"
