"""A built-in traffic server and client, and entering a namespace from one thread.

The server (``serve``) reads a 9-byte request, ``D`` or ``U`` and a byte
count (0: until the client closes), then sends that many bytes or swallows
them (and, at the end, says how many arrived). The client
(:func:`transfer`) asks for one direction for a number of seconds and returns
the payload bytes that arrived and the time it took. No
iperf3 to install: two sockets and ``sendall``/``recv_into`` of 1 MiB.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
import time

__all__ = ["enter", "serve", "transfer"]

CLONE_NEWNET = 0x40000000
BLOCK = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)


def enter(ns: str) -> None:
    """Move the calling thread into network namespace ``ns`` (``ip netns`` name)."""
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _serve_one(conn: socket.socket) -> None:
    with conn:
        head = b""
        while len(head) < 9:
            part = conn.recv(9 - len(head))
            if not part:
                return
            head += part
        kind, size = head[:1], struct.unpack("!Q", head[1:])[0]
        try:
            if kind == b"D":
                block = memoryview(bytes(BLOCK))
                sent = 0
                while size == 0 or sent < size:
                    n = BLOCK if size == 0 else min(BLOCK, size - sent)
                    conn.sendall(block[:n])
                    sent += n
            else:
                buf = bytearray(BLOCK)
                got = 0
                while n := conn.recv_into(buf):
                    got += n
                conn.sendall(struct.pack("!Q", got))  # what arrived, not what was queued
        except OSError:
            pass


def serve(listener: socket.socket, stop: threading.Event) -> None:
    """Answer clients on ``listener`` (one thread each) until ``stop`` is set."""
    listener.settimeout(0.2)
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        conn.settimeout(None)
        threading.Thread(target=_serve_one, args=(conn,), daemon=True).start()


def transfer(address: tuple[str, int], direction: str, seconds: float) -> tuple[int, float]:
    """Download (``down``) or upload (``up``) for ``seconds``: (payload bytes, seconds)."""
    sock = socket.create_connection(address, timeout=30)
    try:
        sock.sendall((b"D" if direction == "down" else b"U") + struct.pack("!Q", 0))
        moved = 0
        started = time.monotonic()
        end = started + seconds
        if direction == "down":
            buf = bytearray(BLOCK)
            while time.monotonic() < end:
                n = sock.recv_into(buf)
                if not n:
                    break
                moved += n
        else:
            block = memoryview(bytes(BLOCK))
            while time.monotonic() < end:
                sock.send(block)
            sock.shutdown(socket.SHUT_WR)  # the server says how much arrived, once all has
            answer = b""
            while len(answer) < 8:
                part = sock.recv(8 - len(answer))
                if not part:
                    raise ConnectionError("the netbench server closed without its count")
                answer += part
            moved = struct.unpack("!Q", answer)[0]
        return moved, time.monotonic() - started
    finally:
        sock.close()
