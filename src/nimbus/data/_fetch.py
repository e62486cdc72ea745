"""Asking another node's data server (``_serve``): a staged copy or a relayed object
fetched from it, a pin renewed or freed on it, an object put to it.

::

    node B (a task that needs it)                      node A (holds the copy)
    _file._cached: not in B's cache                    _serve.Server, listening where
    -> fetch(staged.holder, ...): B's lock on            staged.holder says
       the copy taken (a lock file beside the cache)
       -> request: connects ----------------------->
       <-- challenge (32 random bytes), or "NObusy" (asked again, jittered backoff)
       header (op, namespace, name, pin) | HMAC(copy's secret, challenge, header) -->
       <-- "OK" | size (8 bytes) | the bytes           checks the HMAC and the pin's lease
       written to a part file while hashed; size and
       sha256 checked against the Staged (from the
       client), renamed into B's cache

    fetch_object: op "object"; after the bytes, their sha256 and an HMAC of it keyed
    by the pin's secret (checked), renamed into B's store, leased
    renew, free: op "renew" / "free", answered "OK" (or why not)
    _direct.push_object: op "put", then the bytes as ``_direct`` sends them

One fetch of a copy per node at a time: the other tasks of the node wait for the lock
(``LOCK_WAIT`` s at most), then find the copy in their own cache like any other.

The client renews the pin (its lease) through an ordinary task, which the endpoint runs
on any node: a node that does not hold the pin forwards the renewal to the holding
node's server (:func:`renew`: the same challenge, an HMAC with the copy's secret), so
the pin lives as long as the client holds the copy. Its freeing (the client let the copy
go) is forwarded the same way (:func:`free`), so the pin does not outlive it by a lease.

The holding node gone (its block ended, its manager killed) or no longer holding the
copy: the fetch fails with ``ReferenceLost`` naming the copy's pin, and the client that
staged it stages the file again from its endpoint and sends the task again
(``_submit.DataPath.recover``); a node merely busy ("busy") is asked again until the
request's timeout, then an ordinary error. A fetch has ``TIMEOUT`` s and one more per
``FLOOR_RATE`` bytes in all: a holder that trickles does not keep the node's lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import json
import os
import random
import secrets
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nimbus.data._direct import connect, receive_hashed, recv_exactly, said
from nimbus.data._serve import BUSY, HANDSHAKE, TIMEOUT, request_mac
from nimbus.errors import DataError, ReferenceLost

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = ["fetch", "fetch_object", "free", "lock_of", "renew", "request"]

FLOOR_RATE = 1 << 20  # bytes/s: a fetch of n bytes has TIMEOUT + n / FLOOR_RATE s in all
LOCK_WAIT = 600.0  # seconds a task waits for another task of its node fetching the copy


class _Gone(DataError):
    """The holding node cannot serve the copy: it is not there (its block or agent
    stopped), or it no longer holds the copy (freed, its data directory removed)."""


class _Busy(DataError):
    """The node serves too many at once: try again later."""


def request(
    holder: tuple[str, int, str],
    header: dict[str, Any],
    what: str,
    timeout: float = TIMEOUT,
    connect: float | None = None,
    *,
    failed: Callable[[OSError], DataError] | None = None,
    where: str = "",
) -> tuple[socket.socket, str]:
    """A connection to ``holder``'s server with ``header`` sent (proved with the copy's
    secret) and its "OK" read; the socket (open) and how to name the node. A node that
    is not there or refuses (it holds no such copy): :class:`_Gone`; one busy (it serves
    too many at once) is asked again after a jittered backoff, for ``timeout`` s at most,
    then :class:`DataError`. Each try waits ``connect`` s (default ``timeout``) to reach
    the node and be answered: a node that answers "busy" is there. ``failed``: the error
    of a node that cannot be connected to instead; ``where``: how messages name the node
    ("from the node that holds it")."""
    deadline = time.monotonic() + timeout
    pause = 0.05
    while True:
        try:
            wait = timeout if connect is None else connect
            return _request_once(holder, header, what, wait, failed, where)
        except _Busy as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DataError(
                    f"{exc} (for {timeout:.0f} s); submit the task again once the node is less busy"
                ) from None
            time.sleep(min(left, pause * random.uniform(0.5, 1.5)))
            pause = min(pause * 2, 2.0)


def _request_once(
    holder: tuple[str, int, str],
    header: dict[str, Any],
    what: str,
    timeout: float,
    failed: Callable[[OSError], DataError] | None = None,
    where: str = "",
) -> tuple[socket.socket, str]:
    host, port, secret = holder
    where = where or f"from the node that holds it ({host}:{port})"
    sock = connect(
        host,
        port,
        timeout,
        failed
        or (
            lambda exc: _Gone(
                f"cannot {what} {where}: {exc}. That node's block or agent has stopped "
                f"(the copy went with it); or it is not reachable: if the nodes are separate "
                f"machines, set NIMBUS_DATA_HOST on each to an address the others reach it by"
            )
        ),
    )
    try:
        challenge = recv_exactly(sock, 32, "the node")
        if challenge == BUSY[:32]:  # (not the challenge: 32 random bytes are not that)
            raise _Busy(f"cannot {what} {where}: the node serves too many at once")
        body = json.dumps(header).encode()
        sock.sendall(len(body).to_bytes(4, "little") + body)
        sock.sendall(request_mac(bytes.fromhex(secret), challenge, body))
        status = sock.recv(2, socket.MSG_WAITALL)
        if status != b"OK":
            why = (status + said(sock)).decode(errors="replace")[2:]
            raise DataError(f"the node refused: {why or 'it closed the link'}")
    except _Busy:
        sock.close()
        raise
    except (DataError, OSError) as exc:
        sock.close()
        raise _Gone(f"cannot {what} {where}: {exc}") from None
    return sock, where


def renew(holder: tuple[str, int, str], namespace: str, pin: str, expires: float) -> None:
    """Move the lease of ``pin`` (a copy's, on the node ``holder``) to ``expires``."""
    header = {"op": "renew", "namespace": namespace, "pin": pin, "expires": expires}
    sock, _ = request(holder, header, "renew the pin of a staged file", 2 * HANDSHAKE)
    sock.close()


def free(holder: tuple[str, int, str], namespace: str, pin: str) -> None:
    """Free ``pin`` (a copy's, on the node ``holder``): its client let the copy go, so
    the node's sweep removes the copy once nobody used it for a lease."""
    header = {"op": "free", "namespace": namespace, "pin": pin}
    sock, _ = request(holder, header, "free the pin of a staged file", 2 * HANDSHAKE)
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
            sock, where = request(holder, header, f"fetch {name}")
        except _Gone as exc:
            raise ReferenceLost(
                f"the staged copy {name} is gone: {exc}; its client stages the file again "
                f"from its endpoint and sends the task again (a few times at most; then "
                f"submit it again)",
                pin,
            ) from None
        again = "submit the task again (a link that broke), or touch the file to stage it again"
        with _into(target, sock, f"fetch {name} {where}", again) as part:
            got = int.from_bytes(recv_exactly(sock, 8, "the node", deadline), "little")
            if got != size:
                raise DataError(f"it holds {got} bytes where {size} were staged")
            if _receive(sock, part, size, deadline).hexdigest() != sha256:
                raise DataError("the bytes' sha256 differs from the staged copy's")


def fetch_object(
    holder: tuple[str, int, str],
    namespace: str,
    pin: str,
    target: Path,
    expires: float,
    connect: float = TIMEOUT,
) -> None:
    """A relayed object (its ``pin``, on the node ``holder``: its server's host and port,
    the pin's secret) fetched into ``target``, a path of this node's store, leased until
    ``expires``; one fetch of it at a time on this node.

    That node gone, or holding the object no more: ``ReferenceLost`` naming the object
    (``connect``: seconds to reach it and be answered; one busy is asked again for
    ``TIMEOUT`` s)."""
    from nimbus.data._direct import _mac as transfer_mac

    name = pin[:32]
    with _fetching(target, name):
        if target.exists():
            return
        header = {"op": "object", "namespace": namespace, "pin": pin}
        try:
            sock, where = request(holder, header, f"fetch the object {name}", TIMEOUT, connect)
            sock.settimeout(TIMEOUT)
        except _Gone as exc:
            raise ReferenceLost(
                f"the object {name} is gone: {exc}; submit the tasks that made it again",
                name,
            ) from None
        again = "submit the task again (a link that broke)"
        with _into(target, sock, f"fetch the object {name} {where}", again) as part:
            size = int.from_bytes(recv_exactly(sock, 8, "the node"), "little")
            deadline = time.monotonic() + TIMEOUT + size / FLOOR_RATE
            digest = _receive(sock, part, size, deadline).digest()
            told = recv_exactly(sock, 64, "the node", deadline)
            key = bytes.fromhex(holder[2])
            if told[:32] != digest or not hmac.compare_digest(
                told[32:], transfer_mac(key, b"object", digest)
            ):
                raise DataError("the bytes' sha256 differs from the holder's")
            os.utime(part, (expires, expires))


@contextlib.contextmanager
def _into(target: Path, sock: socket.socket, what: str, again: str) -> Iterator[Path]:
    """A part file beside ``target`` to receive into from ``sock`` (closed after),
    renamed to ``target`` once received and checked; else removed, and a
    :class:`DataError` (cannot ``what``: why; ``again``)."""
    part = target.with_name(f".{target.name}.{secrets.token_hex(4)}.part")
    with sock:
        try:
            yield part
            os.rename(part, target)
        except (DataError, OSError) as exc:
            part.unlink(missing_ok=True)
            raise DataError(f"cannot {what}: {exc}; {again}") from None


def _receive(sock: socket.socket, part: Path, size: int, deadline: float) -> Any:
    """``size`` bytes from ``sock`` written to the new file ``part`` while hashed (by
    ``deadline``); their sha256 (a ``hashlib`` object)."""
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        return receive_hashed(sock, fd, size, "the node", deadline)
    finally:
        os.close(fd)


def lock_of(target: Path) -> Path:
    """The lock file of fetches into ``target`` (left for the next fetch of that copy;
    one into a path of its own, as the client's, removes it after)."""
    return target.with_name(f".{target.name}.lock")


@contextlib.contextmanager
def _fetching(target: Path, name: str) -> Iterator[None]:
    """This node's lock on fetching ``target`` (the copy ``name``) held, waiting
    ``LOCK_WAIT`` s at most for another task of this node fetching it."""
    fd = os.open(lock_of(target), os.O_RDWR | os.O_CREAT, 0o600)
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
