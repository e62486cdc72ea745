"""A node's file cache served to the other nodes of its endpoint.

::

    node A (holds the copy)                          node B (a task that needs it)
    Server (in its agent or block manager:           _file._cached: not in B's cache
      started with the node's Sweeper), address      -> fetch(staged.holder, ...):
      in <runtime data dir>/.server                     connects to A's server
      <-- connect ------------------------------------
      challenge (32 random bytes) ------------------>
      <-- header (namespace, name, pin) | HMAC(copy's secret, challenge, header)
      reads the pin object (the copy's secret, written by ``_direct.offer``; leased
      while the client holds the copy), checks the HMAC, then
      "OK" | size (8 bytes) | the bytes (sendfile) -->  written to a part file while
                                                        hashed; size and sha256 checked
                                                        against the Staged (from the
                                                        client), renamed into B's cache

A file sent endpoint to endpoint (``_direct``) lands in the cache of the one node whose
task offered to take it. Its offer also gives the client where that node serves its
cache and a secret of the copy's own (``Staged.holder``); a task scheduled on another
node of the endpoint fetches the copy from there once (one fetch per node at a time: a
lock file beside the cache), then finds it in its own cache like any other.

What the check protects against: only a holder of the copy's secret (the client that
staged it, and the tasks it gave it to) is served, and only that copy, while its pin is
leased; the bytes' sha256 is the one the client got when the copy was made, so bytes
altered on the way are refused. The secret never crosses the link (a challenge and an
HMAC). The link is not encrypted, as ``_direct``'s.

The server listens on ``NIMBUS_DATA_HOST`` (default ``127.0.0.1``), as offers do: on an
endpoint of several machines, set it on each node to the address the others reach it by.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import queue
import secrets
import socket
import threading
import time
from pathlib import Path

from nimbus.errors import DataError

__all__ = ["Server", "fetch", "server_address"]

TIMEOUT = 120.0  # seconds a fetch may wait for its peer
ADDRESS = ".server"  # in a runtime's data directory: "host port" of a live server
_STEP = 1 << 20
_MAX_HEADER = 4096


def _mac(secret: bytes, challenge: bytes, header: bytes) -> bytes:
    return hmac.new(secret, b"nimbus-data/fetch\0" + challenge + header, "sha256").digest()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise DataError(f"the peer closed the link after {len(out)} of {n} bytes")
        out += got
    return bytes(out)


def server_address(root: Path) -> tuple[str, int] | None:
    """Where the cache of the runtime whose data directory is ``root`` is served."""
    try:
        host, port = (root / ADDRESS).read_text().split()
        return host, int(port)
    except (OSError, ValueError):
        return None


class Server:
    """Serves the file copies of ``root`` (a runtime's data directory on this node) to
    the holders of their secrets; a thread, until :meth:`close`."""

    def __init__(self, root: Path, host: str) -> None:
        self.root = root
        self._listener = socket.create_server((host, 0))
        self.address = (host, int(self._listener.getsockname()[1]))
        self._text = f"{host} {self.address[1]}\n"
        part = root / f"{ADDRESS}.{secrets.token_hex(4)}"
        part.write_text(self._text)
        os.replace(part, root / ADDRESS)  # the newest live holder's: any serves the same
        self._closed = False
        self._counts = {"served": 0, "bytes": 0, "refused": 0}
        os.register_at_fork(after_in_child=self._listener.close)  # a worker forked later
        threading.Thread(target=self._accept, name="nimbus-data-serve", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(TIMEOUT)
            try:
                challenge = secrets.token_bytes(32)
                conn.sendall(challenge)
                length = int.from_bytes(_recv_exactly(conn, 4), "little")
                if length > _MAX_HEADER:
                    raise DataError("a header too long")
                header = _recv_exactly(conn, length)
                mac = _recv_exactly(conn, 32)
                path = self._check(challenge, header, mac)
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    conn.sendall(b"OK" + size.to_bytes(8, "little"))
                    if size:
                        conn.sendfile(f, 0, size)
                    os.utime(f.fileno())  # used now (the sweep keeps it a lease longer)
                self._counts["served"] += 1
                self._counts["bytes"] += size
            except Exception as exc:  # said to the fetcher, whose task fails with it
                self._counts["refused"] += 1
                with contextlib.suppress(OSError):
                    conn.sendall(f"NO{type(exc).__name__}: {exc}".encode()[:2000])

    def _check(self, challenge: bytes, header: bytes, mac: bytes) -> Path:
        asked = json.loads(header)
        space, name, pin = str(asked["namespace"]), str(asked["name"]), str(asked["pin"])
        for part in (space, name, pin):
            if not part or "/" in part or part.startswith(".") or "\0" in part:
                raise DataError(f"{part!r} is not a plain name")
        if not pin.isalnum() or not pin.startswith(name.split("-", 1)[0]):
            raise DataError(f"the pin {pin!r} does not name the copy {name!r}")
        pin_path = self.root / space / "obj" / pin
        try:
            leased = pin_path.stat().st_mtime >= time.time()
        except FileNotFoundError:
            leased = False
        if not leased:
            raise DataError(f"{name} is no longer held on this node (its client freed it)")
        from nimbus.data._node import NodeStore

        secret = NodeStore(space, self.root).read_secret(pin)  # (nothing unpickled)
        if secret is None or not hmac.compare_digest(
            mac, _mac(bytes.fromhex(secret), challenge, header)
        ):
            raise DataError("a wrong secret for this copy")
        path = self.root / space / "files" / name
        if not path.is_file():
            raise DataError(f"{name} is no longer in this node's file cache")
        return path

    def statistics(self) -> dict[str, int]:
        """Copies ``served`` (and their ``bytes``), requests ``refused`` or failed."""
        return dict(self._counts)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with contextlib.suppress(OSError):  # ours still: no other holder wrote it since
            if (self.root / ADDRESS).read_text() == self._text:
                (self.root / ADDRESS).unlink()


def fetch(
    holder: tuple[str, int, str],
    namespace: str,
    name: str,
    pin: str,
    size: int,
    sha256: str,
    target: Path,
) -> None:
    """The copy ``name`` (``size`` bytes, ``sha256``) from the node ``holder`` (its
    server's host and port, the copy's secret) into ``target``, a path of this node's
    cache; one fetch of it at a time on this node."""
    host, port, secret = holder
    lock = target.with_name(f".{target.name}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another task of this node may be fetching it
        with contextlib.suppress(FileNotFoundError):
            if target.stat().st_size == size:
                return
        _fetch(host, port, bytes.fromhex(secret), namespace, name, pin, size, sha256, target)
    finally:
        os.close(fd)  # (the lock file stays: the sweep removes it with old part files)


def _fetch(
    host: str,
    port: int,
    secret: bytes,
    namespace: str,
    name: str,
    pin: str,
    size: int,
    sha256: str,
    target: Path,
) -> None:
    where = f"{name} from the node that holds it ({host}:{port})"
    try:
        sock = socket.create_connection((host, port), timeout=TIMEOUT)
    except OSError as exc:
        raise DataError(
            f"cannot fetch {where}: {exc}; is that node's manager running? If the nodes "
            f"are separate machines, set NIMBUS_DATA_HOST on each to an address the others "
            f"reach it by; submit the task again"
        ) from None
    part = target.with_name(f".{target.name}.{secrets.token_hex(4)}.part")
    with sock:
        try:
            challenge = _recv_exactly(sock, 32)
            header = json.dumps({"namespace": namespace, "name": name, "pin": pin}).encode()
            sock.sendall(len(header).to_bytes(4, "little") + header)
            sock.sendall(_mac(secret, challenge, header))
            status = sock.recv(2, socket.MSG_WAITALL)
            if status != b"OK":
                said = (status + _rest(sock)).decode(errors="replace")[2:]
                raise DataError(f"the node refused: {said or 'it closed the link'}")
            got = int.from_bytes(_recv_exactly(sock, 8), "little")
            if got != size:
                raise DataError(f"it holds {got} bytes where {size} were staged")
            if _receive(sock, part, size) != sha256:
                raise DataError("the bytes' sha256 differs from the staged copy's")
            os.rename(part, target)
        except (DataError, OSError) as exc:
            part.unlink(missing_ok=True)
            raise DataError(f"cannot fetch {where}: {exc}; submit the task again") from None


def _receive(sock: socket.socket, part: Path, size: int) -> str:
    """``size`` bytes of ``sock`` written to ``part`` while a thread hashes the buffer
    before (as ``_direct``'s receiver); their sha256."""
    from nimbus.data._direct import _BUFFERS, _fill, _hash

    sha = hashlib.sha256()
    free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
    full: queue.SimpleQueue[tuple[bytearray, int] | None] = queue.SimpleQueue()
    for _ in range(_BUFFERS):
        free.put(bytearray(_STEP))
    hasher = threading.Thread(target=_hash, args=(sha, full, free), daemon=True)
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    hasher.start()
    try:
        got = 0
        while got < size:
            buffer = free.get()
            n = _fill(sock, memoryview(buffer), min(_STEP, size - got), got, size)
            os.pwrite(fd, memoryview(buffer)[:n], got)
            got += n
            full.put((buffer, n))
    finally:
        full.put(None)
        hasher.join()
        os.close(fd)
    return sha.hexdigest()


def _rest(sock: socket.socket) -> bytes:
    with contextlib.suppress(OSError):
        sock.settimeout(5.0)
        return sock.recv(2000)
    return b""
