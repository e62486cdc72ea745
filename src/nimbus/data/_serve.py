"""A node's file cache (and relayed objects) served to the other nodes of its endpoint.

::

    node A (holds the copy)                          node B (a task that needs it)
    Server (in its agent or block manager:           _file._cached: not in B's cache
      started with the node's Sweeper), address      -> _fetch.fetch(staged.holder, ...):
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

This module is the serving side; ``_fetch`` asks it (fetch, fetch_object, renew, free,
and the "put" of ``_direct.push_object``). The request's proof (:func:`request_mac`),
the "busy" answer and the timeouts are the two sides' contract, defined here.

A file sent endpoint to endpoint (``_direct``) lands in the cache of the one node whose
task offered to take it. Its offer also gives the client where that node serves its
cache and a secret of the copy's own (``Staged.holder``); a task scheduled on another
node of the endpoint fetches the copy from there once (``_fetch``), then finds it in its
own cache like any other.

What the check protects against: only a holder of the copy's secret (the client that
staged it, and the tasks it gave it to) is served, and only that copy, while its pin is
leased; the bytes' sha256 is the one the client got when the copy was made, so bytes
altered on the way are refused. The secret never crosses the link (a challenge and an
HMAC). The link is not encrypted, as ``_direct``'s.

A pin is renewed ("renew") and freed ("free") here on behalf of a node that does not
hold it (``_fetch.renew``, ``_fetch.free``): renewed, the pin lives as long as the client
holds the copy; freed, it does not outlive it by a lease.

Limits that keep one client from stopping the server: at most ``PER_PEER`` connections
of one address and ``MAX_CONNECTIONS`` in all at once (more are told "busy" and closed:
the client tries again, with a jittered backoff, within its timeout), ``HANDSHAKE``
seconds for the whole request before the check; an accept that fails (no file descriptors left) is retried after a
short pause, never the end of serving.

An object relayed from another endpoint (``_direct.push_object``, the "put" op) lands in
the store of the node that expected it; its pin stays while the client holds the copy (a
second put of it, a relay run twice, is answered "OK" if its bytes are the ones stored,
else refused), and the endpoint's other nodes fetch the object with
the pin's secret (the "object" op, ``_fetch.fetch_object``: the bytes, then their sha256
and an HMAC of it keyed by the secret); the pin's renewal renews the object, its
freeing removes it. A result kept on this node (``keep=True``, ``nimbus.put``) has such a
pin too (``_task._holder``), and is served, renewed and freed the same way.

An out= file of a task of another endpoint (``_direct.push_out``, the "out" op) is
written where the pin says (``_direct.expect_out`` kept the path's template in it, so the
sender chooses only the task's id, 32 hex digits), inside the endpoint's exports checked
again, through a temporary file renamed into place; the pin stays for the next task's.

The server listens on ``NIMBUS_DATA_HOST`` (default ``127.0.0.1``), as offers do: on an
endpoint of several machines, set it on each node to the address the others reach it by.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import itertools
import json
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from nimbus.data._direct import recv_exactly
from nimbus.errors import DataError

__all__ = [
    "BUSY",
    "HANDSHAKE",
    "TIMEOUT",
    "Server",
    "advertised",
    "request_mac",
    "server_address",
]

log = logging.getLogger(__name__)

TIMEOUT = 120.0  # seconds a fetch may wait for its peer (the bytes)
HANDSHAKE = 5.0  # seconds a client has for its whole request (length, header, mac)
MAX_CONNECTIONS = 64  # served at once; more are told "busy"
PER_PEER = 8  # served at once to one address (checked first): one peer cannot take them all
BUSY = b"NObusy: the node serves too many at once; try again"  # instead of the challenge
ADDRESS = ".server-"  # in a runtime's data directory: ADDRESS<pid>-<n>, "host port pid start pidns"
_MAX_HEADER = 4096
_WILDCARD = ("", "0.0.0.0", "::", "*")
_servers = itertools.count()
_live: weakref.WeakSet[Server] = weakref.WeakSet()


def _close_in_child() -> None:
    for server in list(_live):
        server._listener.close()


os.register_at_fork(after_in_child=_close_in_child)  # (once: closed servers go with _live)


def request_mac(secret: bytes, challenge: bytes, header: bytes) -> bytes:
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
    newest live server's of this pid namespace (the files of servers whose process died
    are removed; those of another namespace are left to it: ``_node.alive``)."""
    from nimbus.data._node import alive, pid_namespace

    found: list[tuple[float, str, int]] = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(ADDRESS)]
    except OSError:
        return None
    for name in names:
        try:
            path = root / name
            shown, port, pid, start, *namespace = path.read_text().split()
            if namespace and namespace[0] != pid_namespace():
                continue  # (a container's that shares /dev/shm: maybe not reachable)
            if alive(pid, start):
                found.append((path.stat().st_mtime, shown, int(port)))
            else:
                path.unlink(missing_ok=True)  # its process died
        except (OSError, ValueError):
            pass
    if not found:
        return None
    _, shown, number = max(found)
    return shown, number


_swept: dict[str, float] = {}  # a directory out= files are written to -> when swept


def _sweep_temporaries(folder: Path, now: float | None = None) -> None:
    """Remove the temporary files of out= files in ``folder`` that a server stopped in
    the middle of writing left (``PART_AGE`` s old), at most once a ``PART_AGE`` per
    directory (a directory of many results is not read at every write)."""
    from nimbus.data._node import PART_AGE

    now = time.time() if now is None else now
    if now - _swept.get(str(folder), 0.0) < PART_AGE:
        return
    if len(_swept) > 1024:
        _swept.clear()
    _swept[str(folder)] = now
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            if entry.name.startswith((".nimbus-out-", "..nimbus-out-")):
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if entry.is_file(follow_symlinks=False) and st.st_mtime < now - PART_AGE:
                        os.unlink(entry.path)


def _key(pin: Path) -> bytes:
    """The secret of the pin file ``pin``, which ``Server._pin`` checked a request by."""
    from nimbus.data._node import secret_of

    secret = secret_of(pin)
    assert secret is not None  # (_pin checked it)
    return bytes.fromhex(secret)


def _ready(conn: socket.socket, key: bytes) -> int:
    """The receiving side of a file sent here (``_direct._send`` through a request):
    this node's proof of the pin's secret (a sender sends nothing to a listener without
    it), the sender's proof, then the size it sends."""
    from nimbus.data._direct import _mac as transfer_mac

    conn.sendall(b"OK" + transfer_mac(key, b"ready"))
    if not hmac.compare_digest(recv_exactly(conn, 32), transfer_mac(key, b"connect")):
        raise DataError("a wrong secret")
    return int.from_bytes(recv_exactly(conn, 8), "little")


class Server:
    """Serves the file copies of ``root`` (a runtime's data directory on this node) to
    the holders of their secrets, and renews their pins; a thread, until :meth:`close`."""

    def __init__(self, root: Path, host: str) -> None:
        from nimbus.data._node import pid_namespace, start_time

        self.root = root
        shown = advertised(host)
        self._listener = socket.create_server((host, 0))
        self.address = (shown, int(self._listener.getsockname()[1]))
        pid = os.getpid()
        self._file = root / f"{ADDRESS}{pid}-{next(_servers)}"
        part = root / f".part-server-{secrets.token_hex(4)}"
        part.write_text(f"{shown} {self.address[1]} {pid} {start_time(pid)} {pid_namespace()}\n")
        os.replace(part, self._file)  # one file per server: readers pick a live one
        self._closed = False
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._conns: set[socket.socket] = set()  # being served (closed by close())
        self._peers: dict[str, int] = {}  # address -> connections being served
        self._counts = {"served": 0, "bytes": 0, "renewed": 0, "freed": 0, "refused": 0, "busy": 0}
        self._counts["received"] = 0  # objects sent here by another endpoint (``_put``)
        self._counts["written"] = 0  # out= files of another endpoint's tasks (``_out``)
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
                    conn.send(BUSY)
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
            if asked.get("op") == "out":
                self._out(conn, challenge, header, mac, asked)
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
            mac, request_mac(bytes.fromhex(secret), challenge, header)
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

        space, pin = str(asked["namespace"]), str(asked["pin"])
        pin_path = self._pin(challenge, header, mac, space, pin)
        stored = pin_path.with_name(pin[:32])
        key = _key(pin_path)
        expires = pin_path.stat().st_mtime
        size = _ready(conn, key)
        if stored.exists():  # a relay that ran twice, or whose "OK" was lost: the same bytes
            digest = self._again(conn, stored, size, key)
        else:
            digest = _receive_into(conn, stored, size, expires, key)
            self._count(received=1)
        # the pin stays while its client holds the copy: the endpoint's other nodes fetch
        # the object with its secret (``_fetch.fetch_object``); a second put of it is answered
        # as the first was if its bytes are the ones stored, else refused
        conn.sendall(_OK + transfer_mac(key, b"ok", digest))

    def _out(
        self,
        conn: socket.socket,
        challenge: bytes,
        header: bytes,
        mac: bytes,
        asked: dict[str, Any],
    ) -> None:
        """An out= file sent by a task of another endpoint once it ended well
        (``_direct.push_out``), written where the pin says (``_direct.expect_out``: the
        template, ``{task_id}`` filled with the request's id), inside the exports checked
        again now (the config or a symlink may have changed); received as ``_put``
        receives, into a temporary name beside it, then renamed into place (atomic)."""
        from nimbus.data._direct import _OK, _is_id, _receive_into
        from nimbus.data._direct import _mac as transfer_mac
        from nimbus.data._file import _exported
        from nimbus.data._node import note_of

        space, pin, out_id = str(asked["namespace"]), str(asked["pin"]), str(asked["id"])
        pin_path = self._leased(challenge, header, mac, space, pin, "the place of an out= file")
        if not _is_id(out_id, 32):
            raise DataError(f"{out_id[:100]!r} is not the id of a task's out= file")
        try:
            place = json.loads(note_of(pin_path))
            endpoint, name, template = place["endpoint"], place["name"], place["template"]
        except (ValueError, KeyError, TypeError):
            raise DataError("that pin names no place for an out= file") from None
        path = _exported(endpoint, template.replace("{task_id}", out_id))
        key = _key(pin_path)
        temp = path.parent / f".nimbus-out-{secrets.token_hex(8)}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError as exc:  # (said before the bytes come)
            raise DataError(
                f"{name}:{path} cannot be written there ({exc.strerror or exc}); give an "
                f"out= path in a directory the endpoint can write"
            ) from None
        try:
            digest = _receive_into(conn, temp, _ready(conn, key), 0.0, key)
            os.chmod(temp, 0o644)  # (as a file a task writes: the node's store's are private)
            os.replace(temp, path)
        finally:
            with contextlib.suppress(OSError):  # (renamed; or its directory is not one)
                temp.unlink()
        self._count(written=1)
        conn.sendall(_OK + transfer_mac(key, b"ok", digest))
        _sweep_temporaries(path.parent)

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
        from nimbus.data._direct import _hashing
        from nimbus.data._direct import _mac as transfer_mac

        space, pin = str(asked["namespace"]), str(asked["pin"])
        pin_path = self._leased(challenge, header, mac, space, pin, f"the object {pin[:32]}")
        key = _key(pin_path)
        stored = pin_path.with_name(pin[:32])
        if not stored.is_file():
            raise DataError(f"the object {pin[:32]} has not come to this node (yet)")
        with open(stored, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            hasher, digest = _hashing(f, stored)  # (made while the bytes go)
            try:
                conn.sendall(b"OK" + size.to_bytes(8, "little"))
                if size:
                    conn.sendfile(f, 0, size)
            finally:
                hasher.join()
            conn.sendall(digest[0] + transfer_mac(key, b"object", digest[0]))
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
        """Copies ``served`` (and their ``bytes``), objects ``received``, out= files of
        another endpoint's tasks ``written``, pins ``renewed``
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
