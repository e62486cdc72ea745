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
    "instance_for",
    "instance_id",
    "recv",
    "recv_with_source",
    "send",
]

TOKEN_ENV = "NIMBUS_MESSAGING_TOKEN"
_lock = threading.Lock()
_current: Instance | None = None
_current_program = ""  # the program id of _current
_swept: set[str] = set()  # programs whose socket directory goes at this root's exit
_at_exit: list[bool] = []  # [True] once _close_at_exit is registered in this process
_pid = os.getpid()  # of this process: kept current across forks, not asked per call


def _forked() -> None:
    global _pid
    _pid = os.getpid()
    _at_exit.clear()  # (a process of nimbus.multiprocessing starts with no finalizers)


os.register_at_fork(after_in_child=_forked)


def _token(prog: Program, *, hand_down: bool = True) -> bytes:
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
    if hand_down:  # (not an instance beside this process's own: instance_for)
        os.environ[TOKEN_ENV] = f"{prog.program_id}:{token.hex()}"
    return token


def current() -> Instance:
    """This process's instance (made on first use, again after a fork)."""
    global _current, _current_program
    instance = _current
    if instance is not None and instance.pid == _pid:
        return instance
    with _lock:
        if _current is None or _current.pid != os.getpid():
            # the program (and its store) of this process, as the state store keeps it
            prog = statestore.program()
            _current = _new_instance(prog, hand_down=True)
            _current_program = prog.program_id
            directory = _current._sockdir
            if not _at_exit:  # once per process: a warm worker makes one instance a task
                _at_exit.append(True)
                atexit.register(_close_at_exit)
                util.Finalize(None, _close_at_exit, exitpriority=5)
            if statestore.is_root() and prog.program_id not in _swept:
                # the program's socket directory goes with its root
                _swept.add(prog.program_id)
                util.Finalize(
                    None, shutil.rmtree, (directory,), {"ignore_errors": True}, exitpriority=-90
                )
        return _current


def instance_for(prog: Program) -> Instance:
    """A new instance of ``prog`` in this process, beside its own (:func:`current`): the
    client of an Executor whose tasks run on an endpoint, in their program. Its owner
    closes it."""
    return _new_instance(prog, hand_down=False)


def _new_instance(prog: Program, *, hand_down: bool) -> Instance:
    settings = Settings.load()
    return Instance(
        prog.client,
        prog.keys,
        _token(prog, hand_down=hand_down),
        socket_dir(settings.ensure_runtime_dir(), prog.program_id),
        tcp_host=settings.messaging_host,
        ttl_ms=prog.ttl_ms,
        direct=direct_enabled(),
    )


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


def _close_at_exit() -> None:
    """At exit, this process's instance: coalesced messages go out, peers get a goodbye
    (an exit handler, and a finalizer for a process of nimbus.multiprocessing, which ends
    with os._exit after the stdlib's finalizers)."""
    instance = _current
    if instance is not None:
        instance.close()  # (not in a fork that did not make it: its pid is checked)


def _left(prog: Program) -> None:
    """A warm worker's task of ``prog`` ended (``statestore.leave``): its instance says
    goodbye (a later send to its id raises PeerExited) and its token goes from the
    environment (the worker's next task may be another program's)."""
    instance = _current
    if instance is None or _current_program != prog.program_id:
        return
    close()
    if os.environ.get(TOKEN_ENV, "").partition(":")[0] == prog.program_id:
        del os.environ[TOKEN_ENV]


statestore.on_leave(_left)


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
