"""One thread's connection to one state store: the wire under every shared object.

::

    Pipe / Queue / Lock ... --> link(program) --> Link (this thread, this store)
                                                    |  hiredis-packed commands, one write
                                                    v
                                                  Redis --> replies read with a hiredis Reader

redis-py opens the connection (URL, TLS, AUTH, SELECT); commands and replies
then go straight through its socket and a hiredis reader: no pool, no retries,
one round trip a call, a few times less client overhead than redis-py's command
path for small messages. Sends that cannot fail (a Pipe's push) ask the store
not to reply (``CLIENT REPLY SKIP``), so they cost one write and no read. A
holder's release of its Lock is sent without waiting for its reply: the reply
is read before the next one on the link (:attr:`Link.pending`), and a release
that found the lock already released is noted in :attr:`Link.late`. Closing a
link (at thread or process exit, or after a fork) loses nothing: its commands
are with the store.

Every thread has its own links (a thread blocked in BLPOP must not hold up the
others), and a forked child makes new ones: it must not use its parent's
sockets.
"""

from __future__ import annotations

import _socket
import collections
import functools
import os
import select
import socket
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import hiredis

from nimbus import telemetry
from nimbus._lazy import lazy
from nimbus.errors import StateStoreError
from nimbus.statestore._connect import connect, forget, no_retry
from nimbus.statestore._program import Program, on_leave
from nimbus.statestore._script import Script

if TYPE_CHECKING:
    import redis
else:  # imported on first use (redis-py: at the first connection)
    redis = lazy("redis", globals())

__all__ = [
    "MIN_WAIT",
    "SKIP_REPLY",
    "Link",
    "kept_presence",
    "link",
    "pack",
    "preload",
    "presence",
]


def pack(*args: Any) -> bytes:
    """One command in the store's wire format."""
    return bytes(hiredis.pack_command(args))


SKIP_REPLY = pack("CLIENT", "REPLY", "SKIP")  # the store sends no reply to the next command
# The socket methods themselves, for a plain (not TLS) socket: a worker wraps
# ``socket.socket``'s to count a task's bytes, at microseconds per call; a Link
# counts into the same totals (as ``nimbus.messaging._stream`` does).
_raw_sendall = _socket.socket.sendall
_raw_recv = _socket.socket.recv
_COUNTS = telemetry.COUNTS
_PRELOAD: list[bytes] = []  # SCRIPT LOADs sent (without replies) on every new connection


def preload(script: Script) -> Script:
    """Load ``script`` on every new connection: for scripts called without a reply."""
    _PRELOAD.append(SKIP_REPLY + pack("SCRIPT", "LOAD", script.source))
    return script


class Link:
    """This thread's own connection to one store."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._sock: socket.socket | None = None
        self._plain = False  # the socket is a plain one (see ``_connect``)
        # made from the pool's settings, not by the pool: the pool counts what it makes
        # (100 at most), and a process whose threads come and go makes links without end
        make, kwargs = _connection_settings(url)
        self.conn = cast(redis.connection.AbstractConnection, make(**kwargs))
        self.conn.retry = no_retry()  # a dead store is an error at once
        self._reader = hiredis.Reader(replyError=redis.ResponseError)
        self._owner: str | None = None
        self.held: dict[str, int] = {}  # lock owners key -> this thread's depth, as last known
        self.pending: collections.deque[str] = collections.deque()  # releases sent, unread
        self.late: set[str] = set()  # lock owners keys whose release found it released
        self.registered: dict[str, float] = {}  # lock owners key -> when to register again
        self.packed: dict[tuple[str, str], bytes] = {}  # (what, key) -> commands, packed
        self.pushes: dict[str, tuple[bytes, bytes]] = {}  # list -> what goes around a push

    def __del__(self) -> None:
        # A thread's links go with the thread. Close the socket now: the redis-py
        # connection that also holds it sits in a reference cycle, and the cycle
        # collector may finalize the socket first (an "unclosed socket" warning).
        # (``_sock`` is the connection's socket once connected; the connection may
        # also have connected by itself.)
        conn = getattr(self, "conn", None)
        sock = conn._sock if conn is not None else None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    @property
    def owner(self) -> str:
        """host:pid:thread id:client id of this process's presence connection."""
        if self._owner is None:
            cid = presence(self.url)
            self._owner = f"{_HOST}:{os.getpid()}:{threading.get_ident()}:{cid}"
        return self._owner

    def error(self, exc: BaseException) -> StateStoreError:
        """The store's error, translated."""
        return _error(self.url, exc)

    def _connect(self) -> socket.socket:
        try:
            self.conn.connect()
        except redis.RedisError as exc:
            raise self.error(exc) from exc
        sock = self.conn._sock
        if sock is None:
            raise self.error(redis.ConnectionError("no socket after connecting"))
        self._sock = sock
        self._plain = type(sock) is socket.socket  # not TLS: its raw methods will do
        self._reader = hiredis.Reader(replyError=redis.ResponseError)
        if _PRELOAD:  # reply-less scripts need loading: the store may be new or restarted
            self.write(b"".join(_PRELOAD))  # loaded before the next command: no reply awaited
        return sock

    def _broken(self, exc: BaseException) -> StateStoreError:
        """Forget the connection (its stream is in an unknown state) and say why."""
        self.conn.disconnect()
        self._sock = None
        self.pending.clear()  # their replies are gone with the stream
        if isinstance(exc, redis.RedisError):
            return self.error(exc)
        return self.error(redis.ConnectionError(f"{type(exc).__name__}: {exc}"))

    # -- writing

    def write(self, packed: bytes) -> None:
        """Send commands already packed (see :func:`pack`)."""
        sock = self._sock if self._sock is not None else self._connect()
        try:
            if self._plain:
                _raw_sendall(sock, packed)
                _COUNTS[1] += len(packed)
            else:
                sock.sendall(packed)
        except OSError as exc:
            raise self._broken(exc) from exc

    def send(self, *args: Any) -> None:
        """Send one command; its reply is read with :meth:`read`."""
        self.write(pack(*args))

    def push(self, key: str, message: bytes, ttl_ms: int) -> None:
        """RPUSH ``message`` and renew the list's TTL; no replies, so one write.

        The commands around the message are packed once per key: only the
        message's length is formatted per push (and a large message is not copied).
        """
        around = self.pushes.get(key)
        if around is None:
            if len(self.pushes) > 4096:
                self.pushes.clear()
            name = key.encode()
            head = SKIP_REPLY + b"*3\r\n$5\r\nRPUSH\r\n$%d\r\n%s\r\n$" % (len(name), name)
            tail = b"\r\n" + SKIP_REPLY + pack("PEXPIRE", key, ttl_ms)
            around = self.pushes[key] = (head, tail)
        head, tail = around
        if len(message) < 65536:
            packed = b"".join((head, b"%d\r\n" % len(message), message, tail))
            sock = self._sock
            if sock is None or not self._plain:
                self.write(packed)
                return
            try:  # as ``write``, inline: a Pipe's every send comes here
                _raw_sendall(sock, packed)
            except OSError as exc:
                raise self._broken(exc) from exc
            _COUNTS[1] += len(packed)
        else:  # no copy of a large message
            self.write(head + b"%d\r\n" % len(message))
            self.write(message)
            self.write(tail)

    # -- reading

    def read(self) -> Any:
        """The next reply; an error reply is raised as ``redis.ResponseError``."""
        while self.pending:  # the replies of Lock releases sent before (LMOVE: nil if late)
            key = self.pending.popleft()
            try:
                if self._read() is None:
                    self.late.add(key)
            except redis.ResponseError:
                self.late.add(key)
        return self._read()

    def _read(self) -> Any:
        reader = self._reader
        reply = reader.gets()
        while reply is False:
            try:
                sock = self._sock
                if sock is None:
                    raise redis.ConnectionError("not connected")
                if self._plain:
                    data = _raw_recv(sock, 262144)
                    _COUNTS[0] += len(data)
                else:
                    data = sock.recv(262144)
                if not data:
                    raise redis.ConnectionError("connection closed by server")
            except (OSError, redis.RedisError) as exc:
                raise self._broken(exc) from exc
            except BaseException as exc:  # e.g. KeyboardInterrupt: the reply is still coming
                self._broken(exc)
                raise
            reader.feed(data)
            reply = reader.gets()
        if isinstance(reply, redis.ResponseError):
            if str(reply).startswith("NOSCRIPT"):
                raise redis.exceptions.NoScriptError(str(reply))
            raise reply
        return reply

    # -- calls

    def request(self, packed: bytes) -> Any:
        """One command already packed, one round trip; its reply (after those of the
        releases pending, as :meth:`read`). Inline for a plain socket: a Pipe's
        every wait and a Lock's every acquire go through here."""
        sock = self._sock
        if sock is None or not self._plain:
            self.write(packed)
            try:
                return self.read()
            except redis.ResponseError as exc:
                raise self.error(exc) from exc
        reader = self._reader
        pending = self.pending
        try:
            _raw_sendall(sock, packed)
            while True:
                reply = reader.gets()
                while reply is False:
                    data = _raw_recv(sock, 262144)
                    if not data:
                        raise redis.ConnectionError("connection closed by server")
                    _COUNTS[0] += len(data)
                    reader.feed(data)
                    reply = reader.gets()
                if not pending:
                    break
                key = pending.popleft()  # a release's reply (LMOVE: nil if late)
                if reply is None or isinstance(reply, redis.ResponseError):
                    self.late.add(key)
        except (OSError, redis.RedisError) as exc:
            raise self._broken(exc) from exc
        except BaseException as exc:  # e.g. KeyboardInterrupt: the reply is still coming
            self._broken(exc)
            raise
        _COUNTS[1] += len(packed)
        if isinstance(reply, redis.ResponseError):
            raise self.error(reply)
        return reply

    def command(self, *args: Any) -> Any:
        """One command, one round trip; its reply."""
        self.send(*args)
        try:
            return self.read()
        except redis.ResponseError as exc:
            raise self.error(exc) from exc

    def call(self, *commands: Sequence[Any]) -> list[Any]:
        """Several commands in one round trip; their replies (the first error is raised)."""
        self.write(b"".join([pack(*command) for command in commands]))
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(self.read())
            except redis.ResponseError as exc:
                replies.append(exc)
        for reply in replies:
            if isinstance(reply, redis.ResponseError):
                raise self.error(reply)
        return replies

    def eval(self, script: Script, keys: Sequence[str], args: Sequence[Any] = ()) -> Any:
        self.send("EVALSHA", script.sha, len(keys), *keys, *args)
        return self.read_eval(script, keys, args)

    def read_eval(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """The reply of an EVALSHA already sent; loads the script if the store lacks it."""
        try:
            return self.read()
        except redis.exceptions.NoScriptError:
            return self.command("EVAL", script.source, len(keys), *keys, *args)
        except redis.ResponseError as exc:
            raise self.error(exc) from exc

    def blpop(self, key: str, timeout: float | None) -> bool:
        """Pop one element of ``key``, waiting up to ``timeout`` seconds (None: forever)."""
        if timeout is not None and timeout < MIN_WAIT:
            return self.command("LPOP", key) is not None
        wait = 0 if timeout is None else round(timeout, 3)
        return self.command("BLPOP", key, wait) is not None


MIN_WAIT = 0.001  # Redis blocking timeouts have millisecond resolution; 0 means forever
_HOST = socket.gethostname()
_local = threading.local()  # this thread's links by store URL (new in a forked child)
# url -> this process's presence there: its connection, client id and name (kept across
# reconnections, ``kept_presence``)
_presences: dict[str, tuple[redis.connection.AbstractConnection, int, str]] = {}
_presence_lock = threading.Lock()
_kept: set[str] = set()  # the urls whose presence a thread renews when it closes


def _after_fork() -> None:
    global _local, _presence_lock
    _local = threading.local()  # the child must not use its parent's sockets
    for conn, _, _ in _presences.values():  # the parent's: close our copies of its sockets
        if conn._sock is not None:
            conn._sock.close()
    _presences.clear()
    _kept.clear()  # (the threads that renewed them are not here)
    _presence_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def _error(url: str, exc: BaseException) -> StateStoreError:
    """The error of the store at ``url``, translated."""
    if isinstance(exc, redis.ResponseError):
        return StateStoreError(f"the state store at {url} refused a command: {exc}")
    return StateStoreError(f"the state store at {url} is unreachable: {exc}; is Redis running?")


@functools.cache
def _connection_settings(url: str) -> tuple[Any, dict[str, Any]]:
    """How to connect to ``url``: kept across forks (a child skips making a client)."""
    pool = connect(url).connection_pool
    return pool.connection_class, dict(pool.connection_kwargs)


def link(program: Program) -> Link:
    """This thread's link to ``program``'s store."""
    try:
        return _local.links[program.url]  # type: ignore[no-any-return]
    except AttributeError:
        links = _local.links = {}
    except KeyError:
        links = _local.links
    found = links[program.url] = Link(program.url)
    return found


def presence(url: str) -> int:
    """The client id of this process's idle connection to ``url``: gone when the process is.

    Made on first use and kept for the process's life: the kernel closes it when the
    process dies, even by SIGKILL, and Redis never reuses a client id, so ``CLIENT
    LIST ID`` tells others whether the process is alive (its locks' waiters, the
    workers running the processes it started). Not reconnected, unless
    :func:`kept_presence` keeps it.
    """
    with _presence_lock:
        if url not in _presences:
            _presences[url] = _present(url, f"nimbus-presence-{os.getpid()}-{os.urandom(6).hex()}")
        return _presences[url][1]


def kept_presence(url: str) -> tuple[int, str]:
    """This process's presence at ``url`` (its client id now, and its name), made again
    whenever the store closes it while the process lives (an idle timeout, a failover,
    ``CLIENT KILL``), under the same name: who watches it looks for that name once the
    id is gone (``CLIENT LIST``) before taking the process for dead."""
    presence(url)
    with _presence_lock:
        if url not in _kept:
            _kept.add(url)
            threading.Thread(
                target=_keep, args=(url, _presences[url]), name="nimbus-presence", daemon=True
            ).start()
        _, client_id, name = _presences[url]
    return client_id, name


RENEW = 0.2  # seconds between two tries to make a closed presence again


def _keep(url: str, kept: tuple[redis.connection.AbstractConnection, int, str]) -> None:
    """The thread that makes ``url``'s presence again, under its name, when it closes."""
    while True:
        conn, _, name = kept
        sock = conn._sock
        if sock is not None:
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN)
            poller.poll()  # an idle connection's only event: its end
        conn.disconnect()
        while True:
            with _presence_lock:
                if _presences.get(url) is not kept:
                    return  # forgotten (a fork)
                try:
                    kept = _presences[url] = _present(url, name)
                    break
                except StateStoreError:
                    pass  # the store is away (restarting, failing over): again
            time.sleep(RENEW)


def _let_go(program: Program) -> None:
    """A warm worker's task of a remote ``program`` ended (``statestore.leave``): this
    thread's link, the presence and the clients of its store go (the next task in this
    process may be another user's, whose URL is not this one)."""
    if not program.remote:
        return
    url = program.url
    links = getattr(_local, "links", None)
    found = links.pop(url, None) if links is not None else None
    if found is not None:
        found.__del__()
    with _presence_lock:
        _kept.discard(url)
        kept = _presences.pop(url, None)
    if kept is not None:
        kept[0].disconnect()
    _connection_settings.cache_clear()
    forget(url)


on_leave(_let_go)  # first registered, last run: after the instance's goodbye


def _present(url: str, name: str) -> tuple[redis.connection.AbstractConnection, int, str]:
    """A new presence connection to ``url`` named ``name``: it, its client id, its name."""
    make, kwargs = _connection_settings(url)
    conn = cast(redis.connection.AbstractConnection, make(**kwargs))  # kept for life
    try:
        conn.send_command("CLIENT", "SETNAME", name)
        conn.read_response()
        conn.send_command("CLIENT", "ID")
        return conn, int(conn.read_response()), name
    except redis.RedisError as exc:
        conn.disconnect()
        raise _error(url, exc) from exc
