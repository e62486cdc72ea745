"""An instance: a running task's listening socket, peers (links to them), mailbox.

::

    send(peer, obj)                                                   recv(source, timeout)
      pickle-5 -> link to peer? --yes--> frames over the socket -+         ^
                       |                                          v         |
                       no (not listening yet, or unreachable)   poll() -> mailbox, in order
                       +--> RPUSH inbox:<peer> in the store --> inbox thread (BLPOP) -+

The sending half (links out, numbering, coalescing, the store fallback) is
:class:`~nimbus.messaging._sending.Sender`; the receiving half (links in read
into the mailbox, the waits of ``recv`` and ``recv_next``) is
:class:`~nimbus.messaging._receiving.Receiver`. This module makes an instance of
the two: it listens, accepts links in, takes the messages that went through the
store (the inbox thread), publishes its directory entry, and closes.
"""

from __future__ import annotations

import _thread
import dataclasses
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import redis

from nimbus.errors import StateStoreError
from nimbus.messaging import _peer
from nimbus.messaging._directory import ALIVE, EXITED, Directory, Entry, host_id, socket_path
from nimbus.messaging._receiving import ANY, Receiver
from nimbus.messaging._sending import Sender
from nimbus.statestore import Keys
from nimbus.wire import unpack

__all__ = ["Instance", "Transport"]

IDLE_POLL = 5  # seconds an idle inbox waits in the store before it looks again
log = logging.getLogger("nimbus.messaging")


@runtime_checkable
class Transport(Protocol):
    """What carries messages between instances: the plug point (``Instance`` is one)."""

    def send(self, peer: str, obj: object) -> None: ...

    def recv(self, source: str | None = ANY, timeout: float | None = None) -> Any: ...


class Instance(Receiver, Sender):
    """One instance: ``send``/``recv`` to and from other instances of the program."""

    def __init__(
        self,
        client: Callable[[], redis.Redis],
        keys: Keys,
        token: bytes,
        directory: Path,
        *,
        instance_id: str | None = None,
        tcp_host: str | None = None,
        ttl_ms: int = 3_600_000,
        direct: bool = True,
        host: str | None = None,
    ) -> None:
        Sender.__init__(self)
        self.id = instance_id or secrets.token_hex(8)
        self.pid = os.getpid()
        self._client = client  # called when needed: making a client is slow on a busy host
        self._keys = keys
        self._token = token
        self._ttl_ms = ttl_ms
        self._sockdir = directory
        self.direct = direct  # False: every message goes through the store (for comparison)
        self.directory = Directory(client, keys, ttl_ms)
        Receiver.__init__(self)  # links in, the mailbox
        self._closed = False
        # listening
        self._path = socket_path(directory, self.id)
        self._listeners = [self._listen_unix()]
        tcp = None
        if tcp_host:
            lsock = socket.create_server((tcp_host, 0), backlog=128)
            lsock.settimeout(None)
            self._listeners.append(lsock)
            tcp = (tcp_host, lsock.getsockname()[1])
        self.entry = Entry(host or host_id(), self.pid, str(self._path), tcp, ALIVE)
        self.directory.set_local(self.id, self.entry)
        # daemon threads started without waiting for them to run (Thread.start waits,
        # which costs milliseconds on a busy host, in the path of a new instance)
        for lsock in self._listeners:
            _thread.start_new_thread(self._acceptor, (lsock,))
        _thread.start_new_thread(self._inbox, ())

    def _listen_unix(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(None)  # whatever socket.setdefaulttimeout() says: accept() waits
        try:
            self._path.unlink()
        except FileNotFoundError:
            pass
        try:
            sock.bind(str(self._path))
        except FileNotFoundError:  # its directory went as the last instance in it closed
            self._path.parent.mkdir(mode=0o700, exist_ok=True)
            sock.bind(str(self._path))
        os.chmod(self._path, 0o600)
        sock.listen(128)
        return sock

    # ------------------------------------------------------------ background

    def _acceptor(self, lsock: socket.socket) -> None:
        while not self._closed:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return  # closed
            try:
                link = _peer.accept(
                    conn, me=self.id, program_id=self._keys.program_id, token=self._token
                )
                if link is not None and link.entry is not None:
                    # where it listens, as it said: no lookup to reply
                    self.directory.learn(link.peer, link.entry)
            except Exception as exc:  # whatever a peer sent, the acceptor goes on
                log.warning("nimbus.messaging: %s dropped a connection: %r", self.id, exc)
                conn.close()
                continue
            if link is None:
                continue
            if self._closed:  # (answered while this instance closed: not taken)
                link.close()
                return
            self._link_in(link)
            peer = link.peer
            if (
                self.direct
                and lsock.family != socket.AF_UNIX
                and peer not in self._out
                and peer not in self._opening
            ):  # a peer on another host: a link back, off this thread (``_call_back``)
                try:
                    _thread.start_new_thread(self._call_back, (peer,))
                except RuntimeError as exc:  # no thread to be had: the first send opens one
                    log.debug("nimbus.messaging: %s did not call %s back: %r", self.id, peer, exc)

    def _inbox(self) -> None:
        """Publish this instance, then take the messages that went through the store.

        Peers on this host find the socket by its path at once; the directory
        entry (for peers elsewhere) goes out here, off the path of a new instance.
        """
        try:
            self.directory.publish()
        except StateStoreError:
            pass  # lookups from other hosts fail until the next publish (at close)
        if self.direct and self.entry.tcp is not None:
            self._spare_connection()
        key = self._keys.inbox(self.id)
        while not self._closed:
            try:
                popped: Any = self._client().blpop([key], timeout=IDLE_POLL)
                if popped is None:
                    continue
                sender, seq, tag, parts, readonly = unpack(popped[1])
            except (redis.RedisError, OSError, ValueError, TypeError) as exc:
                if self._closed:
                    return
                log.debug("nimbus.messaging: inbox of %s: %r", self.id, exc)
                time.sleep(0.1)
                continue
            self._mailbox.put(sender, seq, tag, parts[0], _peer.writable_as_sent(parts, readonly))
            self._wake()

    def _spare_connection(self) -> None:
        """Leave a connection to the store in the pool beside the one BLPOP will hold.

        An instance on TCP sends to peers on other hosts, each looked up in the
        store first: its first lookup would otherwise connect to the store then,
        in the path of its first message (a few ms across a link, as long as the
        lookup itself). Made here, off that path.
        """
        pool = self._client().connection_pool
        try:
            held = pool.get_connection()  # the publish's: BLPOP takes it back below
            try:
                pool.release(pool.get_connection())  # a second, made now
            finally:
                pool.release(held)
        except (redis.RedisError, OSError) as exc:
            log.debug("nimbus.messaging: no spare store connection for %s: %r", self.id, exc)

    # ------------------------------------------------------------ closing

    def close(self) -> None:
        """Say goodbye to the peers, stop listening and mark this instance exited."""
        if self._closed or os.getpid() != self.pid:
            return
        self._flush_dirty()
        self._closed = True
        self._flush_soon.set()
        self._say_goodbye()
        for lsock in self._listeners:
            try:
                lsock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            lsock.close()
        try:
            self._path.unlink()
        except FileNotFoundError:
            pass
        try:  # the program's socket directory, unless another instance here listens in it
            os.rmdir(self._sockdir)  # (else one a program piles up in a long-lived process)
        except OSError:
            pass
        try:
            self.directory.set_local(self.id, dataclasses.replace(self.entry, state=EXITED))
            self.directory.publish()
            # wake the inbox thread out of its BLPOP so that it ends now
            key = self._keys.inbox(self.id)
            pipe = self._client().pipeline(transaction=False)
            pipe.rpush(key, b"")
            pipe.pexpire(key, 1000)
            pipe.execute()
        except (StateStoreError, redis.RedisError):
            pass
        self._close_links_in()

    def statistics(self) -> dict[str, int]:
        """Links out and in, messages waiting, and bytes moved over sockets."""
        links = [*self._out.values(), *self._opening.values(), *self._in.values()]
        return {
            "links_out": len(self._out) + len(self._opening),
            "links_in": len(self._in),
            "waiting": self._mailbox.count(),
            "bytes_out": sum(link.channel.bytes_out for link in links),
            "bytes_in": sum(link.channel.bytes_in for link in links),
        }
