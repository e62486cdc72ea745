"""``nimbus.data.store()``: a user's key-value store on an endpoint, for task code.

::

    task on an endpoint --store().set(k, v)--> the service's stores Redis, as the user's ACL user:
                                               nimbus:{u-<user>.kv-<endpoint id>}:kv:<digest of k>,
                                               and k in the set ...:kv-index (what keys() reads)
    task run locally ----store().set(k, v)--> <root>/<namespace>/kv/<k as hex> (pickled, renamed in)
    task code ----------store().get(k)------> the value, or the default

The API (``kv = nimbus.data.store()``; keys are ``str`` of 1 to 200 bytes of UTF-8,
values anything picklable)::

    kv.set(key, value, ttl=DAY) kv[key] = value       store, replacing what was there
    kv.get(key, default=None)   kv[key]               the value (``kv[key]``: KeyError)
    kv.delete(key)              del kv[key]           remove; whether it was there (del: KeyError)
    key in kv                   kv.keys(), iter(kv)   membership; the keys, in no order

A key lives ``ttl`` seconds after it was last set (a day by default), then it is gone as
if deleted: a store shared by every user of a service keeps nothing forever that a
finished job forgot.

Where it lives (:func:`nimbus.data.store` picks one):

* **On an endpoint** (:class:`EndpointKeyValue`): the state store the service hands out
  to the Executor's tasks (the one they message each other through), under the task's
  user's key prefix and the endpoint's id. Every task of that user on that endpoint
  sees the same keys, whichever node it runs on and whichever Executor sent it, as
  funcX's ``get_redis_client()`` gives functions the Redis beside their endpoint.
  Another user's tasks cannot read them: the service's ACL user of each user may touch
  only keys under that user's prefix. A task of another endpoint sees other keys. The
  keys are lost when the service's stores Redis restarts (with the service), and they
  count against its ``NIMBUS_STORE_MAXMEMORY``, shared by all users: a write into a
  full store fails, naming it, and a value is at most :data:`MAX_VALUE` pickled
  (Redis's limit: a larger one is refused before it is sent). A task whose Executor got
  no store from the service (it says why in the task's messaging errors), and one that
  ``Client.run``/``batch_run`` sent (it carries no program), use the node's store below.
* **Locally, and on a node with no store handed out** (:class:`NodeKeyValue`): this
  runtime's data directory (one per ``NIMBUS_RUNTIME_DIR``, see ``_node.default_root``),
  removed with it when the runtime stops; writes are atomic (a part file renamed into
  place): a reader sees the old value or the new one, never half. Outside a task,
  ``store()`` is this user's store of this process's runtime.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nimbus import serialization
from nimbus.data._node import node_dir
from nimbus.errors import DataError

if TYPE_CHECKING:
    import redis

    from nimbus.statestore import Keys

__all__ = ["DAY", "EndpointKeyValue", "KeyValue", "NodeKeyValue"]

MAX_KEY = 200  # bytes of a key (its file name is twice that)
DAY = 86400.0  # a key's lifetime by default, seconds
MAX_TTL = 1e9  # seconds: what both stores take (Redis: PX below 2**63 ms)
MAX_VALUE = 512 << 20  # bytes of one value in Redis (a string, proto-max-bulk-len)
_CHECKS = 1000  # keys looked up a round trip by EndpointKeyValue.keys()
_MISSING = object()
_HEAD = struct.Struct("<dI")  # expires (time.time()), number of out-of-band buffers


def _checked(key: str) -> bytes:
    if not isinstance(key, str):
        raise TypeError(f"a key of nimbus.data.store() is a str, not {type(key).__name__}")
    raw = key.encode()
    if not raw or len(raw) > MAX_KEY:
        raise DataError(f"a key is 1 to {MAX_KEY} bytes of UTF-8, not {len(raw)}: {key[:40]!r}")
    return raw


def _lifetime(ttl: float) -> float:
    valid = isinstance(ttl, (int, float)) and not isinstance(ttl, bool)
    if not valid or not 0 < ttl <= MAX_TTL:  # (not NaN either)
        raise DataError(
            f"a key's ttl is a number of seconds above 0 and at most {MAX_TTL:.0f} "
            f"(about 30 years), not {ttl!r}"
        )
    return float(ttl)


def _packed(value: object, expires: float) -> list[Any]:
    """``value`` pickled as the store keeps it: a head, the buffers' sizes, the pickle,
    the buffers (parts to write one after the other)."""
    data, buffers = serialization.dumps(value)
    raws = [buf.raw() for buf in buffers]
    sizes = b"".join(raw.nbytes.to_bytes(8, "little") for raw in raws)
    return [_HEAD.pack(expires, len(raws)), sizes, data, *raws]


def _expires(raw: bytes) -> float:
    expires: float = _HEAD.unpack_from(raw)[0]
    return expires


def _unpacked(raw: bytes) -> Any:
    view = memoryview(raw)
    count = _HEAD.unpack_from(view)[1]
    at = _HEAD.size
    sizes = [int.from_bytes(view[at + 8 * i : at + 8 + 8 * i], "little") for i in range(count)]
    at += 8 * count
    end = len(raw) - sum(sizes)
    data, buffers = view[at:end], []
    for n in sizes:
        buffers.append(view[end : end + n])
        end += n
    return serialization.loads(data, buffers)


class KeyValue:
    """Keys (str) to picklable values of one user (``nimbus.data.store()``); the API of
    both stores, each of which gives :meth:`_read`, :meth:`_write`, :meth:`delete`,
    ``in`` and :meth:`keys`."""

    user = ""

    def _read(self, key: str) -> bytes | None:
        raise NotImplementedError

    def _write(self, key: str, parts: list[Any], ttl: float) -> None:
        raise NotImplementedError

    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it was there."""
        raise NotImplementedError

    def __contains__(self, key: str) -> bool:
        raise NotImplementedError

    def keys(self) -> Iterator[str]:
        """The keys stored, in no order."""
        raise NotImplementedError

    def set(self, key: str, value: object, ttl: float = DAY) -> None:
        """Store ``value`` under ``key`` (replacing what was there) for ``ttl`` seconds."""
        _checked(key)
        ttl = _lifetime(ttl)
        self._write(key, _packed(value, time.time() + ttl), ttl)

    def get(self, key: str, default: Any = None) -> Any:
        """The value under ``key``, or ``default``."""
        raw = self._read(key)
        return default if raw is None else _unpacked(raw)

    def __getitem__(self, key: str) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value: object) -> None:
        self.set(key, value)

    def __delitem__(self, key: str) -> None:
        if not self.delete(key):
            raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())


class NodeKeyValue(KeyValue):
    """One user's keys in ``directory``, on this node: a file a key."""

    def __init__(self, directory: Path, user: str = "") -> None:
        self.dir = directory
        self.user = user
        node_dir(directory)

    def _path(self, key: str) -> Path:
        return self.dir / _checked(key).hex()

    def _write(self, key: str, parts: list[Any], ttl: float) -> None:
        path = self._path(key)
        part = self.dir / f".{uuid.uuid4().hex}"
        with open(part, "wb") as out:
            for piece in parts:
                out.write(piece)
        os.rename(part, path)

    def _read(self, key: str) -> bytes | None:
        return self._load(key, whole=True)

    def _load(self, key: str, *, whole: bool) -> bytes | None:
        """The file of ``key`` (only its head unless ``whole``: ``in`` and :meth:`keys`
        read no values), or None: there is none, or it expired, and then it is unlinked
        unless a newer value was renamed in since it was opened (another inode; held
        open, so its number is not reused meanwhile)."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        with open(fd, "rb", buffering=0) as file:
            raw = file.read() if whole else file.read(_HEAD.size)
            if _expires(raw) > time.time():
                return raw
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    os.unlink(path)
        return None

    def delete(self, key: str) -> bool:
        if self._load(key, whole=False) is None:
            return False  # (not there, or expired: as in Redis)
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def __contains__(self, key: str) -> bool:
        return self._load(key, whole=False) is not None

    def keys(self) -> Iterator[str]:
        for name in os.listdir(self.dir):
            if not name.startswith("."):
                key = bytes.fromhex(name).decode()
                if self._load(key, whole=False) is not None:
                    yield key

    def __repr__(self) -> str:
        return f"<nimbus.data.store of {self.user or 'this user'} at {self.dir}>"


def _hint(exc: Exception) -> str:
    """What to do about the Redis error ``exc`` of an endpoint's store."""
    import redis

    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return (
            ": the service's stores Redis is full (NIMBUS_STORE_MAXMEMORY, shared by "
            "every user): delete keys no longer needed, or ask its operator for more"
        )
    if isinstance(exc, redis.exceptions.AuthenticationError):
        return (
            ": the service no longer lets this task's Executor into its stores Redis (a "
            "token of the user was revoked, or that Redis restarted, empty): submit from a "
            "new Executor"
        )
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return (
            ": the stores Redis's ACL lets a user run the commands and scripts of the "
            "service's nimbus on their own keys only: run the endpoint on the service's "
            "nimbus version"
        )
    if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        return (
            ": this node does not reach the service's stores Redis; its address is "
            "NIMBUS_STORE_LISTEN on the service, which the endpoint's nodes must reach"
        )
    return ""


def _replies(pipe: redis.client.Pipeline) -> list[Any]:
    """The replies of ``pipe``, run; its first error raised as Redis said it (redis-py's
    own raise puts the command in the message: a value of 500 MB made into text)."""
    replies: list[Any] = pipe.execute(raise_on_error=False)
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


class EndpointKeyValue(KeyValue):
    """One user's keys on endpoint ``endpoint``: ``keys.kv(key)``, listed in
    ``keys.kv_index()``, in the Redis of ``client`` (the store the service handed out, as
    the user's ACL user)."""

    def __init__(self, client: redis.Redis, keys: Keys, endpoint: str, user: str = "") -> None:
        self._client = client
        self._keys = keys
        self._index = keys.kv_index()
        self.endpoint = endpoint
        self.user = user

    def _name(self, key: str) -> str:
        _checked(key)
        return self._keys.kv(key)

    @contextlib.contextmanager
    def _failing(self, what: str) -> Iterator[None]:
        """A Redis error as a :class:`DataError` saying what failed (and, when the store is
        full, what to do)."""
        import redis

        try:
            yield
        except redis.RedisError as exc:
            raise DataError(
                f"nimbus.data.store() of endpoint {self.endpoint} could not {what}: "
                f"{exc}{_hint(exc)}"
            ) from None

    def _write(self, key: str, parts: list[Any], ttl: float) -> None:
        size = sum(memoryview(part).nbytes for part in parts)
        if size > MAX_VALUE:  # (Redis would reset the connection, halfway through)
            raise DataError(
                f"nimbus.data.store() of endpoint {self.endpoint} cannot set {key[:40]!r}: "
                f"its value pickles to {size} bytes, over the {MAX_VALUE >> 20} MiB a value "
                f"may be in the store (Redis's limit); place it with nimbus.put(value, "
                f"endpoint=...) and pass the Ref to the tasks that need it"
            )
        from nimbus.statestore.lua import KV_LISTED  # (imported by store() already)

        ms = max(1, int(ttl * 1000))
        with self._failing(f"set {key[:40]!r}"):
            # one round trip; a key the SET refused (OOM) may stay listed: keys() skips it
            pipe = self._client.pipeline(transaction=False)
            pipe.set(self._name(key), b"".join(parts), px=ms)
            pipe.evalsha(KV_LISTED.sha, 1, self._index, key, ms)
            _replies(pipe)

    def _read(self, key: str) -> bytes | None:
        with self._failing(f"get {key[:40]!r}"):
            raw = self._client.get(self._name(key))
        assert raw is None or isinstance(raw, bytes)  # (the client decodes nothing)
        return raw

    def delete(self, key: str) -> bool:
        with self._failing(f"delete {key[:40]!r}"):
            pipe = self._client.pipeline(transaction=False)
            pipe.delete(self._name(key))
            pipe.srem(self._index, key)
            return bool(_replies(pipe)[0])

    def __contains__(self, key: str) -> bool:
        with self._failing(f"look up {key[:40]!r}"):
            return bool(self._client.exists(self._name(key)))

    def keys(self) -> Iterator[str]:
        """The keys listed in the index that are still there (those that expired are
        struck off): two round trips and one per ``_CHECKS`` keys, whatever else the
        store holds (a SCAN would read every key of every user's)."""
        with self._failing("list its keys"):
            listed: list[bytes] = list(self._client.smembers(self._index))  # type: ignore[arg-type]
            found: list[bytes] = []
            gone: list[bytes] = []
            for start in range(0, len(listed), _CHECKS):
                chunk = listed[start : start + _CHECKS]
                pipe = self._client.pipeline(transaction=False)
                for key in chunk:
                    pipe.exists(self._keys.kv(key.decode()))
                for key, there in zip(chunk, _replies(pipe), strict=True):
                    (found if there else gone).append(key)
            if gone:
                self._client.srem(self._index, *gone)
        return (key.decode() for key in found)

    def __repr__(self) -> str:
        return f"<nimbus.data.store of {self.user or 'this user'} on endpoint {self.endpoint}>"
