"""``nimbus.data.store()``: a key-value store of one user on this node, for task code.

::

    task code --store().set(k, v)--> <root>/<namespace>/kv/<key as hex>  (pickled, renamed in)
    task code --store().get(k)-----> the value, or the default

The API (``kv = nimbus.data.store()``; keys are ``str`` of 1 to 200 bytes of UTF-8,
values anything picklable)::

    kv.set(key, value)          kv[key] = value       store, replacing what was there
    kv.get(key, default=None)   kv[key]               the value (``kv[key]``: KeyError)
    kv.delete(key)                                    remove; whether it was there
    key in kv                   kv.keys()             membership; the keys, in no order

Where it lives: on an endpoint, the node's store of the task's user; locally, this
runtime's data directory (one per ``NIMBUS_RUNTIME_DIR``, see ``_node.default_root``),
removed with it when the runtime stops. Outside a task, ``store()`` is this user's
store of this process's runtime.

funcX gives functions on an endpoint a Redis beside it (``get_redis_client()``); this is
the same idea with the isolation of references: a task sees only its own user's keys
(the namespace of its :class:`~nimbus.data.Scope`). Writes are atomic (a part file
renamed into place): a reader sees the old value or the new one, never half.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nimbus import serialization
from nimbus.data._node import node_dir
from nimbus.errors import DataError

__all__ = ["KeyValue"]

MAX_KEY = 200  # bytes of a key (its file name is twice that)
_MISSING = object()


class KeyValue:
    """Keys (str) to picklable values, in ``directory``: one user's, on this node."""

    def __init__(self, directory: Path, user: str = "") -> None:
        self.dir = directory
        self.user = user
        node_dir(directory)

    def _path(self, key: str) -> Path:
        if not isinstance(key, str):
            raise TypeError(f"a key of nimbus.data.store() is a str, not {type(key).__name__}")
        raw = key.encode()
        if not raw or len(raw) > MAX_KEY:
            raise DataError(f"a key is 1 to {MAX_KEY} bytes of UTF-8, not {len(raw)}: {key[:40]!r}")
        return self.dir / raw.hex()

    def set(self, key: str, value: object) -> None:
        """Store ``value`` under ``key`` (replacing what was there)."""
        path = self._path(key)
        data, buffers = serialization.dumps(value)
        part = self.dir / f".{uuid.uuid4().hex}"
        with open(part, "wb") as out:
            out.write(len(buffers).to_bytes(4, "little"))
            for buf in buffers:
                out.write(buf.raw().nbytes.to_bytes(8, "little"))
            out.write(data)
            for buf in buffers:
                out.write(buf.raw())
        os.rename(part, path)

    def get(self, key: str, default: Any = None) -> Any:
        """The value under ``key``, or ``default``."""
        try:
            raw = self._path(key).read_bytes()
        except FileNotFoundError:
            return default
        view = memoryview(raw)
        count = int.from_bytes(view[:4], "little")
        sizes = [int.from_bytes(view[4 + 8 * i : 12 + 8 * i], "little") for i in range(count)]
        at = 4 + 8 * count
        end = len(raw) - sum(sizes)
        data, buffers = view[at:end], []
        for n in sizes:
            buffers.append(view[end : end + n])
            end += n
        return serialization.loads(data, buffers)

    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it was there."""
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def __contains__(self, key: str) -> bool:
        return self._path(key).exists()

    def keys(self) -> Iterator[str]:
        """The keys stored, in no order."""
        for name in os.listdir(self.dir):
            if not name.startswith("."):
                yield bytes.fromhex(name).decode()

    def __getitem__(self, key: str) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value: object) -> None:
        self.set(key, value)

    def __repr__(self) -> str:
        return f"<nimbus.data.store of {self.user or 'this user'} at {self.dir}>"
