"""Bytes copied endpoint to endpoint, never through the client: files and Refs.

::

    client                    target endpoint (task: offer)     source endpoint (task: send_*)
      | offer(kind, name) -------> listens (a thread of the worker), returns
      |  <-- (host, port, secret)     host, port and a one-use secret
      | send_*(..., host, port, secret) ----------------------------> connects, sends:
      |                    <-- secret | size (8 bytes) | the bytes (sendfile) | sha256
      |                               checks the secret, receives into the node's
      |                               store (mapped), hashes as it goes (a thread),
      |                               compares the digests, renames into place
      |  <-- (size, sha256)           --> "OK" (or why not)       <-- returns when OK

The client carries only the three small answers; the bytes cross the link between the
two endpoints once. The target listens on ``NIMBUS_DATA_HOST`` (default ``127.0.0.1``:
endpoints of one machine; set it to the address the other endpoints reach it by). A
sender that cannot connect raises :class:`Unreachable` (the client then falls back to
carrying the bytes itself); any other failure (damaged bytes, a wrong secret, a peer
that died) fails the transfer with what went wrong, within ``TIMEOUT`` seconds at most.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import mmap
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

from nimbus.config import Settings
from nimbus.errors import DataError

__all__ = ["Unreachable", "offer", "send_export", "send_object"]

TIMEOUT = 120.0  # seconds a transfer may wait for its peer (to connect, or for bytes)
_STEP = 8 << 20  # bytes hashed at once
_OK = b"OK"


class Unreachable(DataError, ConnectionError):
    """The source endpoint cannot connect to the target's offer (no direct path)."""


def _target(kind: str, name: str) -> Path:
    from nimbus.data._task import _node, _scope  # the task's user's store on this node

    node = _node(_scope().namespace)
    if kind == "obj":
        return node.path(name)
    if kind == "file":
        files = node.dir / "files"
        files.mkdir(parents=True, exist_ok=True)
        if "/" in name or name.startswith("."):
            raise DataError(f"{name!r} is not a cache name")
        return files / name
    raise DataError(f"unknown kind of transfer {kind!r}")


def offer(kind: str, name: str, expires: float = 0.0) -> tuple[str, int, str]:
    """A task on the target endpoint: wait (in a thread) for the bytes named ``name``
    (``kind`` ``"file"``: the node's file cache; ``"obj"``: an object of the store, its
    lease ``expires``); where to send them, and the secret to send first."""
    target = _target(kind, name)
    host = Settings.load().data_host  # NIMBUS_DATA_HOST
    listener = socket.create_server((host, 0))
    listener.settimeout(TIMEOUT)
    secret = secrets.token_bytes(32)
    threading.Thread(
        target=_receive,
        args=(listener, secret, target, expires),
        name="nimbus-data-receive",
        daemon=True,
    ).start()
    port = listener.getsockname()[1]
    return host, port, secret.hex()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise DataError(f"the sender closed the link after {len(out)} of {n} bytes")
        out += got
    return bytes(out)


def _receive(listener: socket.socket, secret: bytes, target: Path, expires: float) -> None:
    try:
        with listener:
            conn, _ = listener.accept()
    except OSError:
        return  # nobody came within TIMEOUT (the sender failed first and said so)
    with conn:
        conn.settimeout(TIMEOUT)
        try:
            if not hmac.compare_digest(_recv_exactly(conn, 32), secret):
                conn.sendall(b"NO: a wrong secret")
                return
            size = int.from_bytes(_recv_exactly(conn, 8), "little")
            digest = _receive_into(conn, target, size, expires)
            conn.sendall(_OK + digest)
        except Exception as exc:  # said to the sender, whose task fails with it
            with contextlib.suppress(OSError):
                conn.sendall(f"NO: {type(exc).__name__}: {exc}".encode()[:2000])


def _receive_into(conn: socket.socket, target: Path, size: int, expires: float) -> bytes:
    part = target.with_name(f".{target.name}.{secrets.token_hex(4)}.part")
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size) if size else None
        view = memoryview(mapped) if mapped is not None else memoryview(b"")
        try:
            sha = hashlib.sha256()
            got = [0]
            ready = threading.Condition()
            hasher = threading.Thread(target=_follow, args=(view, size, got, ready, sha))
            hasher.start()  # hashes what arrived while more arrives (hashlib frees the GIL)
            try:
                while got[0] < size:
                    n = conn.recv_into(view[got[0] : got[0] + _STEP])
                    if not n:
                        raise DataError(
                            f"the sender closed the link after {got[0]} of {size} bytes"
                        )
                    with ready:
                        got[0] += n
                        ready.notify()
            finally:
                with ready:
                    got[0] = size if got[0] >= size else -1 - got[0]  # done, or stopped
                    ready.notify()
                hasher.join()
            theirs = _recv_exactly(conn, 32)
        finally:
            view.release()
            if mapped is not None:
                mapped.close()
        if not hmac.compare_digest(theirs, sha.digest()):
            raise DataError(
                f"{size} bytes arrived whose sha256 differs from the sender's: the transfer "
                f"was damaged; submit again"
            )
        if expires:
            os.utime(fd, (expires, expires))
        os.rename(part, target)
        return sha.digest()
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def _follow(
    view: memoryview, size: int, got: list[int], ready: threading.Condition, sha: Any
) -> None:
    done = 0
    while done < size:
        with ready:
            while got[0] >= 0 and got[0] - done < min(_STEP, size - done):
                ready.wait()
            upto = got[0]
        if upto < 0:
            return  # the receive stopped
        sha.update(view[done:upto])
        done = upto


# ---------------------------------------------------------------- the source's side

_hashes: dict[tuple[str, int, float], bytes] = {}  # a file's digest, by (path, size, mtime)


def _file_digest(fd: int, key: tuple[str, int, float]) -> bytes:
    found = _hashes.get(key)
    if found is not None:
        return found
    sha = hashlib.sha256()
    buffer = bytearray(_STEP)
    offset = 0
    while n := os.preadv(fd, [buffer], offset):
        sha.update(memoryview(buffer)[:n])
        offset += n
    if len(_hashes) > 256:
        _hashes.clear()
    _hashes[key] = sha.digest()
    return _hashes[key]


def _send(path: Path, host: str, port: int, secret: str, mtime: float | None) -> tuple[int, str]:
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if mtime is not None and st.st_mtime != mtime:
            raise DataError(f"{path} changed while it was staged; submit again")
        size = st.st_size
        digest: list[bytes] = []
        key = (str(path), size, st.st_mtime)
        hasher = threading.Thread(target=lambda: digest.append(_file_digest(f.fileno(), key)))
        hasher.start()  # the digest is made while the bytes go (a second reader of the file)
        try:
            try:
                sock = socket.create_connection((host, port), timeout=TIMEOUT)
            except OSError as exc:
                raise Unreachable(
                    f"cannot connect to the target endpoint at {host}:{port} ({exc}): set "
                    f"NIMBUS_DATA_HOST on its agent to an address this endpoint reaches"
                ) from None
            with sock:
                try:
                    sock.sendall(bytes.fromhex(secret) + size.to_bytes(8, "little"))
                    sent = sock.sendfile(f, 0, size) if size else 0
                    if sent != size:
                        raise DataError(f"{path}: {sent} of {size} bytes went; submit again")
                    hasher.join()
                    sock.sendall(digest[0])
                    answer = sock.recv(2000)
                except OSError as exc:  # the receiver stopped: what it said, if it did
                    answer = _said(sock) or f"the link broke ({exc})".encode()
                    digest.append(b"")
        finally:
            hasher.join()
    if answer[:2] != _OK or answer[2:] != digest[0] or len(digest) != 1:
        said = answer.decode(errors="replace") or "the receiver closed the link"
        raise DataError(f"{path}: the target endpoint refused the transfer: {said}")
    return size, digest[0].hex()


def _said(sock: socket.socket) -> bytes:
    try:
        sock.settimeout(5.0)
        return sock.recv(2000)
    except OSError:
        return b""


def send_export(endpoint: str, path: str, mtime: float, host: str, port: int, secret: str) -> Any:
    """A task on the source endpoint: send its exported file to the target's offer."""
    from nimbus.data._file import _exported  # the owner's exports, checked here

    started = time.monotonic()
    size, sha = _send(_exported(endpoint, path), host, port, secret, mtime)
    return size, sha, time.monotonic() - started


def send_object(ref_id: str, host: str, port: int, secret: str) -> Any:
    """A task on the Ref's endpoint (of its user): send the stored object to the offer."""
    from nimbus.data._ref import Ref
    from nimbus.data._task import _node, _scope

    node = _node(_scope().namespace)
    try:
        return _send(node.path(ref_id), host, port, secret, None)
    except FileNotFoundError:
        from nimbus.data._ref import lost

        raise lost(Ref(ref_id, node.namespace, _scope().user, _scope().endpoint, 0)) from None
