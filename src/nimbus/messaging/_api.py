"""The calls a task makes: this process's instance, ``send`` and ``recv``.

The first call makes the calling process an *instance* of its program: it
binds a Unix socket in the program's private socket directory (and a TCP
socket when ``NIMBUS_MESSAGING_HOST`` names an interface to listen on),
publishes its address in the directory and starts taking messages. A task
started by ``nimbus.multiprocessing`` belongs to its parent's program; any
other process is the root of its own. ``NIMBUS_MESSAGING_DIRECT=0`` sends
every message through the state store (for comparison and as a kill switch).
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import shutil
import threading
from multiprocessing import util
from typing import TYPE_CHECKING, Any

import redis

from nimbus import statestore
from nimbus.config import Settings
from nimbus.errors import PeerUnknown, StateStoreError
from nimbus.messaging._directory import socket_dir
from nimbus.messaging._instance import Instance
from nimbus.messaging._receiving import ANY

if TYPE_CHECKING:
    from nimbus.statestore import Program

__all__ = [
    "ANY",
    "close",
    "current",
    "direct_enabled",
    "instance_id",
    "recv",
    "recv_with_source",
    "send",
]

TOKEN_ENV = "NIMBUS_MESSAGING_TOKEN"
_lock = threading.Lock()
_current: Instance | None = None
_pid = os.getpid()  # of this process: kept current across forks, not asked per call


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def _token(prog: Program) -> bytes:
    """The program's auth token: made by its first instance, read by the others.

    It is handed down to child processes in the environment (readable by this
    user only, like the store's socket), so a new instance does not wait for
    the store before it can connect.
    """
    inherited = os.environ.get(TOKEN_ENV, "")
    program_id, _, hex_token = inherited.partition(":")
    if program_id == prog.program_id and hex_token:
        return bytes.fromhex(hex_token)
    try:
        pipe = prog.client().pipeline(transaction=False)
        pipe.set(prog.keys.messaging_token(), secrets.token_bytes(32), nx=True)
        pipe.get(prog.keys.messaging_token())
        found: Any = pipe.execute()[1]
    except redis.RedisError as exc:
        raise StateStoreError(f"cannot read the messaging token: {exc}") from exc
    token = bytes(found)
    os.environ[TOKEN_ENV] = f"{prog.program_id}:{token.hex()}"
    return token


def current() -> Instance:
    """This process's instance (made on first use, again after a fork)."""
    global _current
    instance = _current
    if instance is not None and instance.pid == _pid:
        return instance
    with _lock:
        if _current is None or _current.pid != os.getpid():
            # the program (and its store) of this process, as the state store keeps it
            prog = statestore.program()
            settings = Settings.load()
            directory = socket_dir(settings.ensure_runtime_dir(), prog.program_id)
            _current = Instance(
                prog.client,
                prog.keys,
                _token(prog),
                directory,
                tcp_host=settings.messaging_host,
                ttl_ms=prog.ttl_ms,
                direct=direct_enabled(),
            )
            # at exit: coalesced messages go out, peers get a goodbye; a process of
            # nimbus.multiprocessing ends with os._exit after the stdlib's finalizers
            atexit.register(_current.close)
            util.Finalize(None, _current.close, exitpriority=5)
            if statestore.is_root():  # the program's socket directory goes with its root
                util.Finalize(
                    None, shutil.rmtree, (directory,), {"ignore_errors": True}, exitpriority=-90
                )
        return _current


def direct_enabled() -> bool:
    """False when ``NIMBUS_MESSAGING_DIRECT=0``: every message goes through the store."""
    direct: bool = Settings.lookup("messaging_direct")
    return direct


def close() -> None:
    """Stop being an instance: flush, say goodbye, stop listening (again on next use)."""
    global _current
    with _lock:
        instance, _current = _current, None
    if instance is not None and instance.pid == os.getpid():
        instance.close()


def instance_id() -> str:
    """The instance id of the calling task (it becomes addressable now)."""
    return current().id


_ID = re.compile(r"[0-9a-f]{16}")  # what ``Instance`` makes: secrets.token_hex(8)
_ids: set[str] = set()  # ids checked already (a set lookup per send, not a match)


def _check_id(peer: object) -> None:
    """Raise :class:`PeerUnknown` if ``peer`` cannot be an instance's id.

    An id of the right form is taken even if no instance has it yet: its
    messages wait in the store until it listens (see :func:`send`).
    """
    if type(peer) is str and _ID.fullmatch(peer):
        if len(_ids) >= 65536:
            _ids.clear()
        _ids.add(peer)
        return
    raise PeerUnknown(
        f"{peer!r} is not an instance id (an id is the 16 hex digits "
        f"nimbus.messaging.instance_id() returns in that instance): send to an id "
        f"the instance gave you, e.g. in its first message"
    )


def send(peer: str, obj: object) -> None:
    """Send ``obj`` to instance ``peer``.

    Goes straight over a socket when ``peer`` listens, through the state store
    while it does not yet; messages from one sender arrive once and in order.
    Raises :class:`~nimbus.errors.PeerLost` when ``peer`` died or its link
    broke, :class:`~nimbus.errors.PeerExited` when it exited normally, and
    :class:`~nimbus.errors.PeerUnknown` when ``peer`` is not an instance id.
    """
    if type(peer) is not str or peer not in _ids:
        _check_id(peer)
    instance = _current
    if instance is None or instance.pid != _pid:
        instance = current()
    instance.send(peer, obj)


def recv(source: str | None = ANY, timeout: float | None = None) -> Any:
    """The next message from ``source`` (default: from any instance).

    Raises :class:`~nimbus.errors.MessagingTimeout` after ``timeout`` seconds,
    :class:`~nimbus.errors.PeerLost` within a heartbeat when ``source`` dies,
    and :class:`~nimbus.errors.MessageDecodeError` (naming the sender) for a
    message that cannot be unpickled here, and :class:`~nimbus.errors.PeerUnknown`
    when ``source`` is not an instance id.
    """
    if source is not ANY and (type(source) is not str or source not in _ids):
        _check_id(source)
    instance = _current
    if instance is None or instance.pid != _pid:
        instance = current()
    return instance.recv_with_source(source, timeout)[1]


def recv_with_source(source: str | None = ANY, timeout: float | None = None) -> tuple[str, Any]:
    """Like :func:`recv`, returning ``(sender instance id, obj)``."""
    if source is not ANY and (type(source) is not str or source not in _ids):
        _check_id(source)
    return current().recv_with_source(source, timeout)
