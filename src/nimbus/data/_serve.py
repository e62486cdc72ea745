"""A node's file cache (and relayed objects) served to the other nodes of its endpoint.

::

    node A (holds the copy)                          node B (a task that needs it)
    Server (in its agent or block manager:           _file._cached: not in B's cache
      started with the node's Sweeper), address      -> fetch(staged.holder, ...):
      in <runtime data dir>/.server-<pid>-<n>           connects to A's server
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

The client renews the pin (its lease) through an ordinary task, which the endpoint runs
on any node: a node that does not hold the pin forwards the renewal to the holding
node's server (:func:`renew`: the same challenge, an HMAC with the copy's secret), so
the pin lives as long as the client holds the copy. Its freeing (the client let the copy
go) is forwarded the same way (:func:`free`), so the pin does not outlive it by a lease.

The holding node gone (its block ended, its manager killed) or no longer holding the
copy: the fetch fails with ``ReferenceLost`` naming the copy's pin, and the client that
staged it stages the file again from its endpoint and sends the task again
(``_submit.DataPath.recover``); a node merely busy ("busy") is asked again until the
request's timeout, then an ordinary error.

Limits that keep one client from stopping the server: at most ``PER_PEER`` connections
of one address and ``MAX_CONNECTIONS`` in all at once (more are told "busy" and closed:
the client tries again, with a jittered backoff, within its timeout), ``HANDSHAKE``
seconds for the whole request before the check; an accept that fails (no file descriptors left) is retried after a
short pause, never the end of serving.

An object relayed from another endpoint (``_direct.push_object``, the "put" op) lands in
the store of the node that expected it; its pin stays while the client holds the copy (a
second put of it, a relay run twice, is answered "OK" if its bytes are the ones stored,
else refused), and the endpoint's other nodes fetch the object with
the pin's secret (the "object" op, :func:`fetch_object`: the bytes, then their sha256
and an HMAC of it keyed by the secret); the pin's renewal renews the object, its
freeing removes it.

The server listens on ``NIMBUS_DATA_HOST`` (default ``127.0.0.1``), as offers do: on an
endpoint of several machines, set it on each node to the address the others reach it by.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import itertools
import json
import logging
import os
import random
import secrets
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nimbus.data._direct import connect, receive_hashed, recv_exactly, said
from nimbus.errors import DataError, ReferenceLost

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["Server", "advertised", "fetch", "fetch_object", "free", "renew", "server_address"]

log = logging.getLogger(__name__)

TIMEOUT = 120.0  # seconds a fetch may wait for its peer (the bytes)
FLOOR_RATE = 1 << 20  # bytes/s: a fetch of n bytes has TIMEOUT + n / FLOOR_RATE s in all
HANDSHAKE = 5.0  # seconds a client has for its whole request (length, header, mac)
LOCK_WAIT = 600.0  # seconds a task waits for another task of its node fetching the copy
MAX_CONNECTIONS = 64  # served at once; more are told "busy"
PER_PEER = 8  # served at once to one address (checked first): one peer cannot take them all
_BUSY = b"NObusy: the node serves too many at once; try again"  # instead of the challenge
ADDRESS = ".server-"  # in a runtime's data directory: ADDRESS<pid>-<n>, "host port pid start"
_MAX_HEADER = 4096
_WILDCARD = ("", "0.0.0.0", "::", "*")
_servers = itertools.count()
_live: weakref.WeakSet[Server] = weakref.WeakSet()


def _close_in_child() -> None:
    for server in list(_live):
        server._listener.close()


os.register_at_fork(after_in_child=_close_in_child)  # (once: closed servers go with _live)


def _mac(secret: bytes, challenge: bytes, header: bytes) -> bytes:
    return hmac.new(secret, b"nimbus-data/fetch\0" + challenge + header, "sha256").digest()


def advertised(host: str) -> str:
    """The address other nodes reach a listener on ``host`` by (``NIMBUS_DATA_HOST``):
    itself, or for a wildcard this machine's name when it does not resolve to loopback."""
    if host not in _WILDCARD:
        return host
    name = socket.gethostname()
    try:
        resolved = socket.gethostbyname(name)
    except OSError:
        resolved = "127.0.0.1"
    if resolved.startswith("127."):
        raise DataError(
            f"NIMBUS_DATA_HOST={host!r} listens on every address, but this node's name "
            f"{name!r} resolves to loopback ({resolved}): set NIMBUS_DATA_HOST to the "
            f"address the endpoint's other nodes reach this one by"
        )
    return name


def server_address(root: Path) -> tuple[str, int] | None:
    """Where the cache of the runtime whose data directory is ``root`` is served: the
    newest live server's (the files of servers whose process died are removed)."""
    from nimbus.data._node import start_time

    found: list[tuple[float, str, int]] = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(ADDRESS)]
    except OSError:
        return None
    for name in names:
        try:
            path = root / name
            shown, port, pid, start = path.read_text().split()
            if start_time(int(pid)) in (start, "?"):
                found.append((path.stat().st_mtime, shown, int(port)))
            else:
                path.unlink(missing_ok=True)  # its process died
        except (OSError, ValueError):
            pass
    if not found:
        return None
    _, shown, number = max(found)
    return shown, number


class Server:
    """Serves the file copies of ``root`` (a runtime's data directory on this node) to
    the holders of their secrets, and renews their pins; a thread, until :meth:`close`."""

    def __init__(self, root: Path, host: str) -> None:
        from nimbus.data._node import start_time

        self.root = root
        shown = advertised(host)
        self._listener = socket.create_server((host, 0))
        self.address = (shown, int(self._listener.getsockname()[1]))
        pid = os.getpid()
        self._file = root / f"{ADDRESS}{pid}-{next(_servers)}"
        part = root / f".part-server-{secrets.token_hex(4)}"
        part.write_text(f"{shown} {self.address[1]} {pid} {start_time(pid)}\n")
        os.replace(part, self._file)  # one file per server: readers pick a live one
        self._closed = False
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._conns: set[socket.socket] = set()  # being served (closed by close())
        self._peers: dict[str, int] = {}  # address -> connections being served
        self._counts = {"served": 0, "bytes": 0, "renewed": 0, "freed": 0, "refused": 0, "busy": 0}
        self._counts["received"] = 0  # objects sent here by another endpoint (``_put``)
        _live.add(self)  # a worker forked later closes its copy of the listener
        threading.Thread(target=self._accept, name="nimbus-data-serve", daemon=True).start()

    def _count(self, **added: int) -> None:
        with self._lock:
            for key, n in added.items():
                self._counts[key] += n

    def _accept(self) -> None:
        told = False
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                if not told:  # (no file descriptors left, a connection aborted): later
                    log.warning("the node's data server cannot accept now (%s); retrying", exc)
                    told = True
                time.sleep(0.2)
                continue
            address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
            with self._lock:
                mine = self._peers.get(address, 0) < PER_PEER
                if mine:
                    self._peers[address] = self._peers.get(address, 0) + 1
            if not mine or not self._slots.acquire(blocking=False):
                if mine:
                    self._unpeer(address)
                self._count(busy=1)
                with conn, contextlib.suppress(OSError):
                    conn.setblocking(False)
                    conn.send(_BUSY)
                continue
            with self._lock:
                self._conns.add(conn)
            try:
                threading.Thread(target=self._serve, args=(conn, address), daemon=True).start()
            except RuntimeError:  # no thread could start
                self._forget(conn, address)

    def _serve(self, conn: socket.socket, address: str) -> None:
        try:
            self._answer(conn)
        finally:
            self._forget(conn, address)

    def _unpeer(self, address: str) -> None:
        with self._lock:
            left = self._peers.pop(address, 1) - 1
            if left:
                self._peers[address] = left

    def _forget(self, conn: socket.socket, address: str) -> None:
        with self._lock:
            self._conns.discard(conn)
        conn.close()
        self._unpeer(address)
        self._slots.release()

    def _answer(self, conn: socket.socket) -> None:
        try:
            deadline = time.monotonic() + HANDSHAKE
            challenge = secrets.token_bytes(32)
            conn.settimeout(HANDSHAKE)
            conn.sendall(challenge)
            length = int.from_bytes(recv_exactly(conn, 4, "the peer", deadline), "little")
            if length > _MAX_HEADER:
                raise DataError("a header too long")
            header = recv_exactly(conn, length, "the peer", deadline)
            mac = recv_exactly(conn, 32, "the peer", deadline)
            conn.settimeout(TIMEOUT)
            asked = json.loads(header)
            if asked.get("op") == "renew":
                self._renew(challenge, header, mac, asked)
                self._count(renewed=1)  # (before its answer: counted once the peer knows)
                conn.sendall(b"OK")
                return
            if asked.get("op") == "put":
                self._put(conn, challenge, header, mac, asked)
                return
            if asked.get("op") == "free":
                space, pin = str(asked["namespace"]), str(asked["pin"])
                self._pin(challenge, header, mac, space, pin).unlink(missing_ok=True)
                # a relayed object goes with its pin (``_put``: the object is pin[:32])
                (self.root / space / "obj" / pin[:32]).unlink(missing_ok=True)
                self._count(freed=1)  # (before its answer: counted once the peer knows)
                conn.sendall(b"OK")
                return
            if asked.get("op") == "object":
                self._object(conn, challenge, header, mac, asked)
                return
            path = self._check(challenge, header, mac, asked)
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                conn.sendall(b"OK" + size.to_bytes(8, "little"))
                if size:
                    conn.sendfile(f, 0, size)
                os.utime(f.fileno())  # used now (the sweep keeps it a lease longer)
            self._count(served=1, bytes=size)
        except Exception as exc:  # said to the peer, whose task fails with it
            self._count(refused=1)
            said = str(exc) if isinstance(exc, DataError) else "it could not read the request"
            with contextlib.suppress(OSError):
                conn.sendall(f"NO{said}".encode()[:2000])

    def _pin(self, challenge: bytes, header: bytes, mac: bytes, space: str, pin: str) -> Path:
        """The pin's path, once the request's HMAC proves its secret (one answer for an
        unknown pin and a wrong secret)."""
        for part in (space, pin):
            if not part or "/" in part or part.startswith(".") or "\0" in part:
                raise DataError(f"{part!r} is not a plain name")
        if len(pin) != 64 or not all(c in "0123456789abcdef" for c in pin):
            raise DataError(f"{pin!r} is not the id of a copy's pin")
        from nimbus.data._node import secret_of

        path = self.root / space / "obj" / pin
        try:  # (nothing made on this path before the check: no NodeStore; nothing unpickled)
            secret = secret_of(path)
        except (OSError, ValueError):
            secret = None
        if secret is None or not hmac.compare_digest(
            mac, _mac(bytes.fromhex(secret), challenge, header)
        ):
            raise DataError(
                "refused: this node holds no such copy for that secret (its pin was freed "
                "and removed, or the node's data directory was removed)"
            )
        return path

    def _leased(
        self, challenge: bytes, header: bytes, mac: bytes, space: str, pin: str, what: str
    ) -> Path:
        """:meth:`_pin`, refused (naming ``what`` it holds) once its lease ran out."""
        path = self._pin(challenge, header, mac, space, pin)
        try:
            leased = path.stat().st_mtime >= time.time()
        except FileNotFoundError:
            leased = False
        if not leased:
            raise DataError(
                f"{what} is no longer held on this node: its pin's lease ran out (its "
                f"client freed it, or did not renew it: it stopped)"
            )
        return path

    def _renew(self, challenge: bytes, header: bytes, mac: bytes, asked: dict[str, Any]) -> None:
        pin = self._pin(challenge, header, mac, str(asked["namespace"]), str(asked["pin"]))
        expires = float(asked["expires"])
        try:
            os.utime(pin, (expires, expires))
        except FileNotFoundError:
            raise DataError("refused: the pin was removed meanwhile") from None
        with contextlib.suppress(FileNotFoundError):  # a relayed object lives as its pin
            os.utime(pin.with_name(pin.name[:32]), (expires, expires))

    def _put(
        self,
        conn: socket.socket,
        challenge: bytes,
        header: bytes,
        mac: bytes,
        asked: dict[str, Any],
    ) -> None:
        """An object sent by a task of another endpoint into this node's store, as the
        pin's holder expects (``_direct.expect_object``); received as ``_direct``'s offer
        receives (the pin's secret, the bytes' tag), leased as the pin was; the pin stays."""
        from nimbus.data._direct import _OK, _receive_into
        from nimbus.data._direct import _mac as transfer_mac
        from nimbus.data._node import secret_of

        space, pin = str(asked["namespace"]), str(asked["pin"])
        pin_path = self._pin(challenge, header, mac, space, pin)
        stored = pin_path.with_name(pin[:32])
        secret = secret_of(pin_path)
        assert secret is not None  # (_pin checked it)
        key = bytes.fromhex(secret)
        expires = pin_path.stat().st_mtime
        conn.sendall(b"OK")
        if not hmac.compare_digest(recv_exactly(conn, 32), transfer_mac(key, b"connect")):
            raise DataError("a wrong secret")
        size = int.from_bytes(recv_exactly(conn, 8), "little")
        if stored.exists():  # a relay that ran twice, or whose "OK" was lost: the same bytes
            digest = self._again(conn, stored, size, key)
        else:
            digest = _receive_into(conn, stored, size, expires, key)
            self._count(received=1)
        # the pin stays while its client holds the copy: the endpoint's other nodes fetch
        # the object with its secret (``fetch_object``); a second put of it is answered
        # as the first was if its bytes are the ones stored, else refused
        conn.sendall(_OK + transfer_mac(key, b"ok", digest))

    @staticmethod
    def _again(conn: socket.socket, stored: Path, size: int, key: bytes) -> bytes:
        """A second put of the object ``stored``: its bytes received beside it and
        compared (the sender cannot be told before it sends); its sha256, the same."""
        from nimbus.data._direct import _receive_into

        with open(stored, "rb") as f:
            held = os.fstat(f.fileno()).st_size
            mine = hashlib.file_digest(f, "sha256").digest()
        again = stored.with_name(f".{stored.name}.{secrets.token_hex(4)}.again")
        try:
            digest = _receive_into(conn, again, size, 0.0, key)
        finally:
            again.unlink(missing_ok=True)
        if held != size or digest != mine:
            raise DataError(
                f"refused: that pin's object was sent already, with other bytes ({held} "
                f"bytes stored, {size} sent; one object a pin)"
            )
        return digest

    def _object(
        self,
        conn: socket.socket,
        challenge: bytes,
        header: bytes,
        mac: bytes,
        asked: dict[str, Any],
    ) -> None:
        """A relayed object (``_put``) sent to another node of this endpoint that proves
        its pin's secret, while the pin is leased: "OK", its size, its bytes, then its
        sha256 and an HMAC of it keyed by the secret (bytes altered on the way, or a
        forged digest, are refused by the fetcher)."""
        from nimbus.data._direct import _mac as transfer_mac
        from nimbus.data._node import secret_of

        space, pin = str(asked["namespace"]), str(asked["pin"])
        pin_path = self._leased(challenge, header, mac, space, pin, f"the object {pin[:32]}")
        secret = secret_of(pin_path)
        assert secret is not None  # (_pin checked it)
        stored = pin_path.with_name(pin[:32])
        if not stored.is_file():
            raise DataError(f"the object {pin[:32]} has not come to this node (yet)")
        with open(stored, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            digest = hashlib.file_digest(f, "sha256").digest()  # /dev/shm: a fast pass
            conn.sendall(b"OK" + size.to_bytes(8, "little"))
            if size:
                conn.sendfile(f, 0, size)
            tag = transfer_mac(bytes.fromhex(secret), b"object", digest)
            conn.sendall(digest + tag)
        self._count(served=1, bytes=size)

    def _check(self, challenge: bytes, header: bytes, mac: bytes, asked: dict[str, Any]) -> Path:
        space, name, pin = str(asked["namespace"]), str(asked["name"]), str(asked["pin"])
        if not name or "/" in name or name.startswith(".") or "\0" in name:
            raise DataError(f"{name!r} is not a plain name")
        key = name.split("-", 1)[0]
        if len(key) != 32 or pin[:32] != key:
            raise DataError(f"the pin {pin!r} does not name the copy {name!r}")
        self._leased(challenge, header, mac, space, pin, name)
        path = self.root / space / "files" / name
        if not path.is_file():
            raise DataError(f"{name} is no longer in this node's file cache")
        return path

    def statistics(self) -> dict[str, int]:
        """Copies ``served`` (and their ``bytes``), objects ``received``, pins ``renewed``
        and ``freed``, requests ``refused``
        or failed, connections turned away ``busy``."""
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        _live.discard(self)
        with self._lock:  # no copy is read from a directory about to be released
            serving = list(self._conns)
        for conn in serving:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._file.unlink(missing_ok=True)


class _Gone(DataError):
    """The holding node cannot serve the copy: it is not there (its block or agent
    stopped), or it no longer holds the copy (freed, its data directory removed)."""


class _Busy(DataError):
    """The node serves too many at once: try again later."""


def _request(
    holder: tuple[str, int, str], header: dict[str, Any], what: str, timeout: float = TIMEOUT
) -> tuple[socket.socket, str]:
    """A connection to ``holder``'s server with ``header`` sent (proved with the copy's
    secret) and its "OK" read; the socket (open) and how to name the node. A node that
    is not there or refuses (it holds no such copy): :class:`_Gone`; one busy (it serves
    too many at once) is asked again after a jittered backoff, for ``timeout`` s at most,
    then :class:`DataError`."""
    deadline = time.monotonic() + timeout
    pause = 0.05
    while True:
        try:
            return _request_once(holder, header, what, timeout)
        except _Busy as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DataError(
                    f"{exc} (for {timeout:.0f} s); submit the task again once the node is less busy"
                ) from None
            time.sleep(min(left, pause * random.uniform(0.5, 1.5)))
            pause = min(pause * 2, 2.0)


def _request_once(
    holder: tuple[str, int, str], header: dict[str, Any], what: str, timeout: float
) -> tuple[socket.socket, str]:
    host, port, secret = holder
    where = f"the node that holds it ({host}:{port})"
    sock = connect(
        host,
        port,
        timeout,
        lambda exc: _Gone(
            f"cannot {what} from {where}: {exc}. That node's block or agent has stopped "
            f"(the copy went with it); or it is not reachable: if the nodes are separate "
            f"machines, set NIMBUS_DATA_HOST on each to an address the others reach it by"
        ),
    )
    try:
        challenge = recv_exactly(sock, 32, "the node")
        if challenge == _BUSY[:32]:  # (not the challenge: 32 random bytes are not that)
            raise _Busy(f"cannot {what} from {where}: the node serves too many at once")
        body = json.dumps(header).encode()
        sock.sendall(len(body).to_bytes(4, "little") + body)
        sock.sendall(_mac(bytes.fromhex(secret), challenge, body))
        status = sock.recv(2, socket.MSG_WAITALL)
        if status != b"OK":
            why = (status + said(sock)).decode(errors="replace")[2:]
            raise DataError(f"the node refused: {why or 'it closed the link'}")
    except _Busy:
        sock.close()
        raise
    except (DataError, OSError) as exc:
        sock.close()
        raise _Gone(f"cannot {what} from {where}: {exc}") from None
    return sock, where


def renew(holder: tuple[str, int, str], namespace: str, pin: str, expires: float) -> None:
    """Move the lease of ``pin`` (a copy's, on the node ``holder``) to ``expires``."""
    header = {"op": "renew", "namespace": namespace, "pin": pin, "expires": expires}
    sock, _ = _request(holder, header, "renew the pin of a staged file", 2 * HANDSHAKE)
    sock.close()


def free(holder: tuple[str, int, str], namespace: str, pin: str) -> None:
    """Free ``pin`` (a copy's, on the node ``holder``): its client let the copy go, so
    the node's sweep removes the copy once nobody used it for a lease."""
    header = {"op": "free", "namespace": namespace, "pin": pin}
    sock, _ = _request(holder, header, "free the pin of a staged file", 2 * HANDSHAKE)
    sock.close()


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
    cache; one fetch of it at a time on this node (waiting ``LOCK_WAIT`` s at most).

    That node gone, or holding the copy no more: ``ReferenceLost`` naming the copy's pin
    (the client stages the file again and sends the task again: ``_submit.recover``)."""
    with _fetching(target, name):
        with contextlib.suppress(FileNotFoundError):
            if target.stat().st_size == size:
                return
        header = {"op": "fetch", "namespace": namespace, "name": name, "pin": pin}
        deadline = time.monotonic() + TIMEOUT + size / FLOOR_RATE  # (a holder that trickles)
        try:
            sock, where = _request(holder, header, f"fetch {name}")
        except _Gone as exc:
            raise ReferenceLost(
                f"the staged copy {name} is gone: {exc}; its client stages the file again "
                f"from its endpoint and sends the task again (a few times at most; then "
                f"submit it again)",
                pin,
            ) from None
        part = target.with_name(f".{target.name}.{secrets.token_hex(4)}.part")
        with sock:
            try:
                got = int.from_bytes(recv_exactly(sock, 8, "the node", deadline), "little")
                if got != size:
                    raise DataError(f"it holds {got} bytes where {size} were staged")
                fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    digest = receive_hashed(sock, fd, size, "the node", deadline).hexdigest()
                finally:
                    os.close(fd)
                if digest != sha256:
                    raise DataError("the bytes' sha256 differs from the staged copy's")
                os.rename(part, target)
            except (DataError, OSError) as exc:
                part.unlink(missing_ok=True)
                raise DataError(
                    f"cannot fetch {name} from {where}: {exc}; submit the task again (a link "
                    f"that broke), or touch the file to stage it again"
                ) from None


def fetch_object(
    holder: tuple[str, int, str], namespace: str, pin: str, target: Path, expires: float
) -> None:
    """A relayed object (its ``pin``, on the node ``holder``: its server's host and port,
    the pin's secret) fetched into ``target``, a path of this node's store, leased until
    ``expires``; one fetch of it at a time on this node.

    That node gone, or holding the object no more: ``ReferenceLost`` naming the object."""
    from nimbus.data._direct import _mac as transfer_mac

    name = pin[:32]
    with _fetching(target, name):
        if target.exists():
            return
        header = {"op": "object", "namespace": namespace, "pin": pin}
        try:
            sock, where = _request(holder, header, f"fetch the object {name}")
        except _Gone as exc:
            raise ReferenceLost(
                f"the object {name} is gone: {exc}; submit the tasks that made it again",
                name,
            ) from None
        part = target.with_name(f".{target.name}.{secrets.token_hex(4)}.part")
        with sock:
            try:
                size = int.from_bytes(recv_exactly(sock, 8, "the node"), "little")
                deadline = time.monotonic() + TIMEOUT + size / FLOOR_RATE
                fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    digest = receive_hashed(sock, fd, size, "the node", deadline).digest()
                    told = recv_exactly(sock, 64, "the node", deadline)
                finally:
                    os.close(fd)
                key = bytes.fromhex(holder[2])
                if told[:32] != digest or not hmac.compare_digest(
                    told[32:], transfer_mac(key, b"object", digest)
                ):
                    raise DataError("the bytes' sha256 differs from the holder's")
                os.utime(part, (expires, expires))
                os.rename(part, target)
            except (DataError, OSError) as exc:
                part.unlink(missing_ok=True)
                raise DataError(
                    f"cannot fetch the object {name} from {where}: {exc}; submit the task "
                    f"again (a link that broke)"
                ) from None


@contextlib.contextmanager
def _fetching(target: Path, name: str) -> Iterator[None]:
    """This node's lock on fetching ``target`` (the copy ``name``) held, waiting
    ``LOCK_WAIT`` s at most for another task of this node fetching it."""
    lock = target.with_name(f".{target.name}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + LOCK_WAIT
        while True:  # another task of this node may be fetching it
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise DataError(
                        f"{name}: another task of this node has been fetching it for "
                        f"{LOCK_WAIT:.0f} s; submit the task again once the node is less busy"
                    ) from None
                time.sleep(0.1)
        os.utime(fd)  # in use (the sweep leaves a lock file held, or recently made, alone)
        yield
    finally:
        os.close(fd)  # (the lock file stays: the sweep removes it with old part files)
