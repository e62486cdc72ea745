"""The directory: instance id -> address and liveness, kept in the state store.

::

    instance                                 state store                  a peer
    -------------------                      -----------                  ------
    local map {id: Entry}  --publish(changes)--> HSET/HDEL directory --> lookup(id): HGET,
    (only what changed)                                                  cached; invalidate()
                                                                         on a failed send

Each process that hosts instances keeps its *local map* and publishes only the
entries that changed, so whoever aggregates maps (the embedded runtime now: the
program's hash in the store; the service later) merges a global one. A lookup
never waits for a heartbeat: it reads the store on demand, and its answer is
cached until a send through it fails. While the directory is small (up to BULK
entries) a lookup reads it whole in that one round trip, so the next peers' lookups
(the rest of a group, an all-to-all exchange) take none; and a peer that connected
told its entry in its handshake (:meth:`Directory.learn`), so a reply needs no lookup. Peers on the same host skip the store
altogether: an instance's Unix socket lives at a path built from the program id
and its instance id (:func:`socket_path`), in a directory only the user can use.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from nimbus.config import Settings, private_dir
from nimbus.errors import ConfigError, StateStoreError
from nimbus.statestore import Keys
from nimbus.statestore.lua import DIRECTORY_LOOKUP
from nimbus.wire import pack, unpack

__all__ = ["ALIVE", "EXITED", "Directory", "Entry", "host_id", "socket_dir", "socket_path"]

ALIVE = "alive"
EXITED = "exited"
NEGATIVE_TTL = 0.02  # seconds a "not in the directory" answer is trusted
BULK = 256  # a directory of up to this many entries is read whole by a lookup
_SUN_PATH = 107


def host_id() -> str:
    """This host: its name and boot id (two containers of one name differ)."""
    override: str | None = Settings.lookup("messaging_host_id")
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


_NAMED = 24  # the longest program id a socket directory is named by as it is


def socket_dir(runtime_dir: Path, program_id: str) -> Path:
    """The program's private directory of instance sockets (mode 0o700).

    Named by the program id, or by a digest of a long one (an endpoint's, behind its
    user's prefix), so its sockets' paths fit in a Unix socket address."""
    if len(program_id) > _NAMED:
        program_id = hashlib.blake2b(program_id.encode(), digest_size=12).hexdigest()
    return private_dir(
        runtime_dir / f"m-{program_id}",
        "socket directory",
        "set NIMBUS_RUNTIME_DIR to a private directory",
    )


def socket_path(directory: Path, instance_id: str) -> Path:
    path = directory / f"{instance_id}.sock"
    if len(os.fsencode(path)) > _SUN_PATH:
        raise ConfigError(
            f"Unix socket path {path} is longer than {_SUN_PATH} bytes; "
            "set NIMBUS_RUNTIME_DIR to a shorter directory"
        )
    return path


@dataclass(frozen=True)
class Entry:
    """Where an instance listens, and whether it is alive."""

    host: str
    pid: int
    unix: str | None
    tcp: tuple[str, int] | None
    state: str = ALIVE

    def dumps(self) -> bytes:
        tcp = list(self.tcp) if self.tcp else None
        return pack([self.host, self.pid, self.unix, tcp, self.state])

    @classmethod
    def loads(cls, data: bytes) -> Entry:
        host, pid, unix, tcp, state = unpack(data)
        return cls(host, pid, unix, (tcp[0], int(tcp[1])) if tcp else None, state)


class Directory:
    """One process's view of a program's directory: its local map and a lookup cache."""

    def __init__(self, client: Callable[[], redis.Redis], keys: Keys, ttl_ms: int) -> None:
        self._client = client
        self._key = keys.directory()
        self._ttl_ms = ttl_ms
        self.local: dict[str, Entry] = {}
        self._published: dict[str, Entry] = {}
        self._cache: dict[str, Entry] = {}
        self._read: dict[bytes, bytes] = {}  # id -> entry as read whole, decoded when asked
        self._missing: dict[str, float] = {}

    def set_local(self, instance_id: str, entry: Entry | None) -> None:
        """Change the local map (``None`` removes the instance); :meth:`publish` sends it."""
        if entry is None:
            self.local.pop(instance_id, None)
        else:
            self.local[instance_id] = entry

    def changes(self) -> dict[str, Entry | None]:
        """What differs between the local map and what was last published."""
        out: dict[str, Entry | None] = {
            k: v for k, v in self.local.items() if self._published.get(k) != v
        }
        out.update({k: None for k in self._published if k not in self.local})
        return out

    def publish(self) -> dict[str, Entry | None]:
        """Send only the changes of the local map to the store; returns them."""
        changes = self.changes()
        if not changes:
            return changes
        pipe = self._client().pipeline(transaction=False)
        put = {k: v.dumps() for k, v in changes.items() if v is not None}
        if put:
            pipe.hset(self._key, mapping=put)  # type: ignore[arg-type]
        gone = [k for k, v in changes.items() if v is None]
        if gone:
            pipe.hdel(self._key, *gone)
        pipe.pexpire(self._key, self._ttl_ms)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            raise StateStoreError(f"cannot publish to the directory: {exc}") from exc
        for k, v in changes.items():
            if v is None:
                self._published.pop(k, None)
            else:
                self._published[k] = v
        return changes

    def lookup(self, instance_id: str) -> Entry | None:
        """The entry of ``instance_id``: cached, else read from the store now (with
        every other entry, while the directory has at most BULK: all cached)."""
        found = self.local.get(instance_id) or self._cache.get(instance_id)
        if found is not None:
            return found
        raw = self._read.pop(instance_id.encode(), None)
        if raw is None:
            missed = self._missing.get(instance_id)
            if missed is not None and time.monotonic() - missed < NEGATIVE_TTL:
                return None
            try:
                flat = self._lookup(instance_id)
            except redis.RedisError as exc:
                raise StateStoreError(f"cannot read the directory: {exc}") from exc
            self._read = dict(zip(flat[::2], flat[1::2], strict=True))
            raw = self._read.pop(instance_id.encode(), None)
        return self._found(instance_id, None if raw is None else Entry.loads(raw))

    def _lookup(self, instance_id: str) -> Any:
        """DIRECTORY_LOOKUP by its SHA1 (a store the service hands out runs no other
        Lua), loaded first where the store lacks it."""
        client, script = self._client(), DIRECTORY_LOOKUP
        try:
            return client.evalsha(script.sha, 1, self._key, instance_id, BULK)
        except redis.exceptions.NoScriptError:
            return client.eval(script.source, 1, self._key, instance_id, BULK)

    def refresh(self, instance_id: str) -> Entry | None:
        """Read the entry from the store, bypassing the cache."""
        try:
            raw: Any = self._client().hget(self._key, instance_id)
        except redis.RedisError as exc:
            raise StateStoreError(f"cannot read the directory: {exc}") from exc
        return self._found(instance_id, None if raw is None else Entry.loads(raw))

    def _found(self, instance_id: str, entry: Entry | None) -> Entry | None:
        """Cache what the store said of ``instance_id`` (None: not there, for a while)."""
        if entry is None:
            self._cache.pop(instance_id, None)
            self._missing[instance_id] = time.monotonic()
            return None
        self._missing.pop(instance_id, None)
        self._cache[instance_id] = entry
        return entry

    def learn(self, instance_id: str, packed: bytes) -> None:
        """Cache the entry ``instance_id`` told (packed, in its authenticated HELLO),
        unless one is cached already; a malformed one is ignored."""
        if instance_id not in self._cache:
            try:
                self._cache[instance_id] = Entry.loads(packed)
            except (ValueError, TypeError, IndexError, KeyError):
                pass

    def invalidate(self, instance_id: str) -> None:
        """Forget what is cached about ``instance_id`` (a send through it failed)."""
        self._cache.pop(instance_id, None)
        self._read.pop(instance_id.encode(), None)
        self._missing.pop(instance_id, None)
