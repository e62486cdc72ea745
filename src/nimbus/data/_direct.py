"""Bytes copied endpoint to endpoint, never through the client: files and Refs.

::

    client                    target endpoint (task: offer)     source endpoint (task: send_*)
      | offer(kind, name) -------> listens (a thread of the worker), returns
      |  <-- (host, port, secret)     host, port and a one-use secret
      | send_*(..., host, port, secret) ----------------------------> connects, sends:
      |         <-- proof (HMAC of the secret) | size (8 bytes) | the bytes (sendfile) | tag
      |                               checks the proof; receives into a few 1 MiB
      |                               buffers, writes each into the node's store while
      |                               a thread hashes the one before (sha256), checks
      |                               the tag, renames into place
      |  <-- (size, sha256)           --> "OK" | HMAC of its sha256  <-- returns when it
      |                                                                  matches its own

The client carries only the three small answers; the bytes cross the link between the
two endpoints once.

A relay (a kept future not done yet, ``_carry._relay``) needs no listener waiting: the
target's node server takes the object when it comes (``expect_object`` writes a pin with
its secret), and ``push_object``, held by the service until the object is made, sends it
there on the server's request (``_fetch.request``, ``_serve``'s "put") with the same proof, tag and answer.
An out= file of another endpoint goes the same way (``expect_out`` at submit, with the
path's template kept in the pin; ``push_out`` by the task's worker when it has run;
``_serve``'s "out" writes it where the pin says). The target listens on ``NIMBUS_DATA_HOST`` (default ``127.0.0.1``:
endpoints of one machine; set it to the address the other endpoints reach it by). A
sender that cannot connect raises :class:`Unreachable` (the client then falls back to
carrying the bytes itself); any other failure (damaged bytes, a wrong secret, a peer
that died) fails the transfer with what went wrong, within ``TIMEOUT`` seconds at most.

What the check protects against: the secret itself never crosses the link (the sender
proves it knows it with an HMAC), and the bytes' sha256 travels as an HMAC keyed by it
(the ``tag``), as does the receiver's answer. So a party that did not get the secret from
the client cannot deliver bytes to the offer, and bytes damaged on the way or altered by
anyone on the path (who can read and rewrite the stream, but not forge the tag) are
refused, as are a truncated transfer and a forged "OK". It does not hide the bytes: the
link is not encrypted (use endpoints on a trusted network, or the path through the
client and service, which is TLS). The sender hashes the file with a second read of
it beside ``sendfile``'s: a file rewritten in place during the transfer fails it when
the two reads saw different bytes; one changed before is caught by the mtime the client
got from its stat.

Costs (measured on 2 loaded cores with SHA-NI, per GB): a raw loopback copy takes
about 1.1 CPU-seconds, this transfer about 3.0: two sha256 passes (one each side, each
on a thread of its own beside the copy) are 1.7 of it. sha256 is the cheapest
tamper-evident check the standard library has on such a CPU (``blake2b`` runs at 0.4x
its speed there), so on loopback, where the copy itself is CPU, the transfer runs at
about half a raw copy's rate; on a network link (1 Gbit/s) the hashing hides behind it.
The receiver takes the bytes into a few 1 MiB buffers and ``pwrite``s them into place
(no mapping of a size the peer announced, no page fault per 4 KiB) while a thread hashes
the buffer before.
"""

from __future__ import annotations

import contextlib
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
from typing import TYPE_CHECKING, Any

from nimbus.config import Settings
from nimbus.data._node import node_dir
from nimbus.errors import DataError

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "Unreachable",
    "connect",
    "expect_object",
    "expect_out",
    "offer",
    "push_object",
    "push_out",
    "receive_hashed",
    "recv_exactly",
    "said",
    "send_export",
    "send_object",
]

TIMEOUT = 120.0  # seconds a transfer may wait for its peer (to connect, or for bytes)
_STEP = 1 << 20  # bytes received, written and hashed at once (a buffer kept in the cache)
_BUFFERS = 4  # buffers in flight on the receiving side
_OK = b"OK"


def _mac(secret: bytes, what: bytes, *parts: bytes) -> bytes:
    """The HMAC-SHA256 of ``parts`` keyed by the transfer's secret, for ``what``."""
    return hmac.new(secret, b"nimbus-data/" + what + b"\0" + b"".join(parts), "sha256").digest()


def _tag(secret: bytes, size: int, sha: bytes) -> bytes:
    return _mac(secret, b"bytes", size.to_bytes(8, "little"), sha)


class Unreachable(DataError, ConnectionError):
    """The source endpoint cannot connect to the target's offer (no direct path)."""


def _target(kind: str, name: str) -> Path:
    from nimbus.data._task import _node, _scope  # the task's user's store on this node

    node = _node(_scope().namespace)
    if kind == "obj":
        return node.path(name)
    if kind == "file":
        files = node_dir(node.dir / "files")
        if "/" in name or name.startswith("."):
            raise DataError(f"{name!r} is not a cache name")
        return files / name
    raise DataError(f"unknown kind of transfer {kind!r}")


def offer(
    kind: str, name: str, expires: float = 0.0, pin: str = ""
) -> tuple[str, int, str, tuple[str, int, str] | None]:
    """A task on the target endpoint: wait (in a thread) for the bytes named ``name``
    (``kind`` ``"file"``: the node's file cache; ``"obj"``: an object of the store, its
    lease ``expires``); where to send them, the secret to send first, and (a pinned file)
    where this node serves the copy to the endpoint's other nodes with the copy's own
    secret (``_serve``; None for an object, or a node that serves nothing).

    ``pin`` (a file): the id of an object leased until ``expires`` that the client
    holds as a Ref while it may send tasks that use the copy: the node's sweep keeps a
    copy whose pin is leased (``_node.pinned``), however long its tasks wait; it holds
    the copy's secret, which the node's server checks."""
    target = _target(kind, name)
    holder = None
    if kind == "file" and pin:
        from nimbus.data._serve import server_address
        from nimbus.data._task import _node, _scope

        if not pin.startswith(name.split("-", 1)[0]):
            raise DataError(f"the pin {pin!r} does not name the copy {name!r}")
        node = _node(_scope().namespace)
        copy_secret = secrets.token_hex(32)
        node.write_secret(pin, copy_secret, expires)
        served = server_address(node.dir.parent)
        holder = None if served is None else (*served, copy_secret)
    from nimbus.data._serve import advertised

    host = Settings.load().data_host  # NIMBUS_DATA_HOST
    shown = advertised(host)  # (a wildcard: this node's name, or refused)
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
    return shown, port, secret.hex(), holder


def recv_exactly(
    sock: socket.socket, n: int, who: str = "the sender", deadline: float | None = None
) -> bytes:
    """``n`` bytes of ``sock`` (a DataError naming ``who`` if it closes the link first);
    by ``deadline`` (``time.monotonic()``) if given, else within the socket's timeout
    for each read."""
    out = bytearray()
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DataError(f"{who} sent {len(out)} of {n} bytes in the time allowed")
            sock.settimeout(left)
        got = sock.recv(n - len(out))
        if not got:
            raise DataError(f"{who} closed the link after {len(out)} of {n} bytes")
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
            if not hmac.compare_digest(recv_exactly(conn, 32), _mac(secret, b"connect")):
                conn.sendall(b"NO: a wrong secret")
                return
            size = int.from_bytes(recv_exactly(conn, 8), "little")
            digest = _receive_into(conn, target, size, expires, secret)
            conn.sendall(_OK + _mac(secret, b"ok", digest))
        except Exception as exc:  # said to the sender, whose task fails with it
            with contextlib.suppress(OSError):
                conn.sendall(f"NO: {type(exc).__name__}: {exc}".encode()[:2000])


def _receive_into(
    conn: socket.socket, target: Path, size: int, expires: float, secret: bytes
) -> bytes:
    part = target.with_name(f".{target.name}.{secrets.token_hex(4)}.part")
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        sha = receive_hashed(conn, fd, size)
        theirs = recv_exactly(conn, 32)
        if not hmac.compare_digest(theirs, _tag(secret, size, sha.digest())):
            raise DataError(
                f"{size} bytes arrived whose sha256 differs from the sender's: the transfer "
                f"was damaged or altered on the way; submit again"
            )
        if expires:
            os.utime(fd, (expires, expires))
        os.rename(part, target)
        digest: bytes = sha.digest()
        return digest
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def receive_hashed(
    conn: socket.socket,
    fd: int,
    size: int,
    who: str = "the sender",
    deadline: float | None = None,
) -> Any:
    """``size`` bytes of ``conn`` written into ``fd`` (``pwrite``, from offset 0) through a
    few 1 MiB buffers while a thread hashes the buffer before (hashlib frees the GIL);
    their sha256 (a hashlib object). By ``deadline`` (``time.monotonic()``) if given, as
    well as within the socket's timeout for each read."""
    sha = hashlib.sha256()
    free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
    full: queue.SimpleQueue[tuple[bytearray, int] | None] = queue.SimpleQueue()
    for _ in range(_BUFFERS):
        free.put(bytearray(_STEP))
    hasher = threading.Thread(target=_hash, args=(sha, full, free), daemon=True)
    hasher.start()
    try:
        got = 0
        while got < size:
            buffer = free.get()
            n = _fill(conn, memoryview(buffer), min(_STEP, size - got), got, size, who, deadline)
            os.pwrite(fd, memoryview(buffer)[:n], got)
            got += n
            full.put((buffer, n))
    finally:
        full.put(None)
        hasher.join()
    return sha


def _fill(
    conn: socket.socket,
    view: memoryview,
    want: int,
    got: int,
    size: int,
    who: str,
    deadline: float | None = None,
) -> int:
    """``want`` bytes of the link into ``view`` (by ``deadline``, if given)."""
    n = 0
    each = conn.gettimeout()
    while n < want:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DataError(f"{who} sent {got + n} of {size} bytes in the time allowed")
            conn.settimeout(left if each is None else min(each, left))
        k = conn.recv_into(view[n:want])
        if not k:
            raise DataError(f"{who} closed the link after {got + n} of {size} bytes")
        n += k
    return n


def _hash(
    sha: Any,
    full: queue.SimpleQueue[tuple[bytearray, int] | None],
    free: queue.SimpleQueue[bytearray],
) -> None:
    while (item := full.get()) is not None:
        buffer, n = item
        sha.update(memoryview(buffer)[:n])
        free.put(buffer)


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


def _hashing(f: Any, path: Path) -> tuple[threading.Thread, list[bytes]]:
    """The sha256 of the open file ``f`` (at ``path``) made on a thread, a second reader,
    while its bytes go: the thread, started, and the list it appends the digest to (read
    it once the thread is joined)."""
    st = os.fstat(f.fileno())
    digest: list[bytes] = []
    key = (str(path), st.st_size, st.st_mtime)
    hasher = threading.Thread(target=lambda: digest.append(_file_digest(f.fileno(), key)))
    hasher.start()
    return hasher, digest


def _send(
    path: Path,
    host: str,
    port: int,
    secret: str,
    mtime: float | None,
    opened: Callable[[], socket.socket] | None = None,
) -> tuple[int, str]:
    """``path`` sent to the offer at ``host``:``port`` (or on the socket ``opened``
    gives: a node's server that took a request to receive it, and proves the pin's
    secret before any byte goes); its size and sha256."""
    mac_key = bytes.fromhex(secret)
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if mtime is not None and st.st_mtime != mtime:
            raise DataError(f"{path} changed while it was staged; submit again")
        size = st.st_size
        hasher, digest = _hashing(f, path)  # (made while the bytes go)
        try:
            sock = (
                opened()
                if opened is not None
                else connect(
                    host,
                    port,
                    TIMEOUT,
                    lambda exc: Unreachable(
                        f"cannot connect to the target endpoint at {host}:{port} ({exc}): "
                        f"set NIMBUS_DATA_HOST on its agent to an address this endpoint reaches"
                    ),
                )
            )
            with sock:
                try:
                    if opened is not None and not hmac.compare_digest(
                        recv_exactly(sock, 32, "the node"), _mac(mac_key, b"ready")
                    ):  # (an "OK" proves nothing: whoever listens where the node was said)
                        raise DataError(
                            f"{host}:{port} did not prove the pin's secret: not the node that "
                            f"expects the object; nothing was sent"
                        )
                    sock.sendall(_mac(mac_key, b"connect") + size.to_bytes(8, "little"))
                    sent = sock.sendfile(f, 0, size) if size else 0
                    if sent != size:
                        raise DataError(f"{path}: {sent} of {size} bytes went; submit again")
                    hasher.join()
                    sock.sendall(_tag(mac_key, size, digest[0]))
                    answer = sock.recv(2000)
                except OSError as exc:  # the receiver stopped: what it said, if it did
                    answer = said(sock) or f"the link broke ({exc})".encode()
                    digest.append(b"")
        finally:
            hasher.join()
    if len(digest) != 1 or answer != _OK + _mac(mac_key, b"ok", digest[0]):
        why = answer.decode(errors="replace") or "the receiver closed the link"
        raise DataError(f"{path}: the target endpoint refused the transfer: {why}")
    return size, digest[0].hex()


def connect(
    host: str, port: int, timeout: float, failed: Callable[[OSError], DataError]
) -> socket.socket:
    """A connection to ``host``:``port``; where there is none, ``failed(the OSError)``
    raised (the error naming what was to be done)."""
    try:
        return socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise failed(exc) from None


def said(sock: socket.socket) -> bytes:
    """What the peer said (2,000 bytes at most, within 5 s); nothing where it said none."""
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


def send_object(
    ref_id: str, host: str, port: int, secret: str, holder: tuple[str, int, str, str] | None = None
) -> Any:
    """A task on the Ref's endpoint (of its user): send the stored object to the offer;
    kept on another node of the endpoint (``holder``: ``Ref.holder``), fetched from it
    into this node's store first (``_fetch.fetch_object``, as a task there does)."""
    from nimbus.data._ref import Ref
    from nimbus.data._task import _node, _scope

    node = _node(_scope().namespace)
    if holder is not None and holder[3][:32] == ref_id and not node.path(ref_id).exists():
        from nimbus.data._fetch import fetch_object

        host_, port_, secret_, pin = holder
        expires = time.time() + _scope().lease
        fetch_object((host_, port_, secret_), node.namespace, pin, node.path(ref_id), expires)
    try:
        return _send(node.path(ref_id), host, port, secret, None)
    except FileNotFoundError:
        from nimbus.data._ref import lost

        raise lost(Ref(ref_id, node.namespace, _scope().user, _scope().endpoint, 0)) from None


# ---------------------------------------------------------------- a relay (no client wait)


def expect_object(ref_id: str, pin: str, expires: float) -> tuple[str, int, str] | None:
    """A task on the target endpoint: let the node's server (``_serve``) take the object
    ``ref_id`` from a sender that proves the secret of ``pin`` (written here, leased until
    ``expires``); where the server listens and that secret (None: it serves nothing).

    Unlike :func:`offer`, nothing waits here: the sender may come much later (when the
    task that makes the object has run, held by the service meanwhile)."""
    from nimbus.data._serve import server_address
    from nimbus.data._task import _node, _scope

    if not ref_id.isalnum() or not pin.startswith(ref_id) or len(pin) != 64:
        raise DataError(f"the pin {pin!r} does not name the object {ref_id!r}")
    node = _node(_scope().namespace)
    served = server_address(node.dir.parent)
    if served is None:
        return None
    secret = secrets.token_hex(32)
    node.write_secret(pin, secret, expires)
    return served[0], served[1], secret


def push_object(ref_id: str, target: tuple[str, int, str], pin: str) -> tuple[int, str]:
    """A task on the Ref's endpoint (held by the service until the task that makes the
    object has run): send the stored object ``ref_id`` to the node of the target
    endpoint that expects it (:func:`expect_object`: its server, the pin's secret);
    its size and sha256."""
    from nimbus.data._fetch import request
    from nimbus.data._ref import Ref, lost
    from nimbus.data._task import _node, _scope

    node = _node(_scope().namespace)
    header = {"op": "put", "namespace": node.namespace, "pin": pin, "ref": pin[:32]}
    host, port, secret = target
    try:
        return _send(
            node.path(ref_id),
            host,
            port,
            secret,
            None,
            lambda: request(target, header, "send an object")[0],
        )
    except FileNotFoundError:
        raise lost(Ref(ref_id, node.namespace, _scope().user, _scope().endpoint, 0)) from None


# ---------------------------------------------------------------- an out= file (no wait)


SERVER_WAIT = 2.0  # seconds an endpoint's node server may take to start (its agent's)


def _is_id(text: str, n: int) -> bool:
    return len(text) == n and all(c in "0123456789abcdef" for c in text)


def expect_out(
    endpoint: str, name: str, template: str, pin: str, expires: float
) -> tuple[str, int, str] | None:
    """A task on the endpoint an out= file of a task of another endpoint goes to (its
    owner's exports, checked here): let the node's server (``_serve``'s "out") take the
    files of ``template`` (``{task_id}`` filled by the sender) from a sender that proves
    the secret of ``pin`` (written here with the template, leased until ``expires``:
    the sender cannot choose the path); where the server listens and that secret (None:
    it serves nothing). ``name``: the endpoint as the user named it (for messages).

    As :func:`expect_object`, nothing waits here: the file comes when its task ends."""
    from nimbus.data._file import File, _exported, check_out
    from nimbus.data._serve import server_address
    from nimbus.data._task import _node, _scope

    if not _is_id(pin, 64):
        raise DataError(f"{pin!r} is not the id of a pin")
    _exported(endpoint, template.replace("{task_id}", "0" * 32))  # (outside: FileRefused)
    check_out(File(f"{name}:{template}"), here=True)  # its directory can be written
    node = _node(_scope().namespace)
    served = server_address(node.dir.parent)
    deadline = time.monotonic() + SERVER_WAIT
    while served is None and time.monotonic() < deadline:  # (an agent that just started)
        time.sleep(0.05)
        served = server_address(node.dir.parent)
    if served is None:
        return None
    secret = secrets.token_hex(32)
    place = json.dumps({"endpoint": endpoint, "name": name, "template": template})
    node.write_secret(pin, secret, expires, place)
    return served[0], served[1], secret


def push_out(written: Path, out: Any, task_id: str) -> tuple[int, str]:
    """A task that wrote an out= file of another endpoint (``out``: a ``_file.Out`` whose
    ``target`` :func:`expect_out` gave), once it ended well: the file sent to that
    endpoint's node server, which writes it where the pin says (``_serve``'s "out");
    its size and sha256. Any failure (the endpoint gone, the write refused there, the
    bytes damaged) raises a DataError naming the endpoint and the file, within
    ``TIMEOUT`` s."""
    from nimbus.data._fetch import request

    assert out.target is not None
    host, port, _ = out.target
    shown = f"{out.name}:{out.template.replace('{task_id}', task_id)}"
    header = {"op": "out", "namespace": out.namespace, "pin": out.pin, "id": task_id}

    def unreachable(exc: OSError) -> DataError:
        return Unreachable(
            f"cannot connect to the node of endpoint {out.name!r} at {host}:{port} ({exc}): "
            f"its agent has stopped, or this endpoint cannot reach it: set NIMBUS_DATA_HOST "
            f"on the agent of {out.name!r} to an address this endpoint reaches"
        )

    def opened() -> socket.socket:
        where = f"to the node of endpoint {out.name!r} ({host}:{port})"
        return request(out.target, header, "write an out= file", failed=unreachable, where=where)[0]

    try:
        return _send(written, host, port, out.target[2], None, opened)
    except DataError as exc:
        kind = Unreachable if isinstance(exc, Unreachable) else DataError
        failed = kind(
            f"the task ran, but its out= file {shown} could not be sent to endpoint "
            f"{out.name!r}: {exc}"
        )
        failed.reason = str(exc)  # type: ignore[attr-defined]  # (without the file's name)
        raise failed from None
