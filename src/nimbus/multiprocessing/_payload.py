"""What one element of a Pipe's or a Queue's list is, and one direct message.

::

    "B" + pickle                       a message (a plain pickle)
    "B" + "O" count sizes data bufs    a message framed with its out-of-band buffers
    "E"                                end of stream
    "S" claim "|" writer               a writer's switch marker (_handover)
    "R"                                a writer's last direct message

A direct message (``nimbus.multiprocessing._handover``) is such an element
(bytes), or an object's pickle and its buffers (a tuple, sent without framing:
the buffers go straight to the socket), or a batch of elements (a list).
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from typing import Any

from nimbus import serialization
from nimbus.errors import DeserializationError
from nimbus.multiprocessing import _site as _state

__all__ = [
    "EOS",
    "MESSAGE",
    "REVERT",
    "SWITCH",
    "Item",
    "as_message",
    "frame",
    "load",
    "pack",
    "undecodable",
    "unpack",
]

MESSAGE = b"B"
EOS = b"E"
SWITCH = b"S"
REVERT = b"R"
FRAMED = ord("O")  # the first byte of a message framed with its buffers (``frame``)
_COPIED = 4096  # a plain pickle up to this size is unpickled from a copy: cheaper than a view

Item = bytes | tuple[Any, ...]


def frame(prefix: bytes, data: bytes, buffers: Sequence[Any]) -> bytes:
    """One message of a pickle and its out-of-band buffers: ``prefix`` "O" sizes data..."""
    raws = [b.raw() if isinstance(b, pickle.PickleBuffer) else memoryview(b) for b in buffers]
    head = struct.pack(f"<I{len(raws) + 1}Q", len(raws), len(data), *(r.nbytes for r in raws))
    return b"".join((prefix, b"O", head, data, *raws))


def as_message(item: Item) -> bytes:
    """The list element (``MESSAGE`` + bytes) of a direct message."""
    if isinstance(item, bytes):
        return item
    return frame(MESSAGE, item[0], item[1:])


def pack(obj: object, prefix: bytes = b"") -> bytes:
    """Pickle ``obj`` into one message (after ``prefix``): a plain pickle, or framed
    with its buffers (joined once: no second copy of a large buffer for the prefix)."""
    data, buffers = _state.dumps(obj)
    if not buffers:
        return prefix + data
    return frame(prefix, data, buffers)


def unpack(message: bytes | memoryview) -> Any:
    """The object that :func:`pack` made (or a plain pickle)."""
    view = memoryview(message)
    if not view or view[0] != FRAMED:
        try:
            return pickle.loads(view)
        except Exception as exc:
            raise undecodable(exc, view) from exc
    (count,) = struct.unpack_from("<I", view, 1)
    sizes = struct.unpack_from(f"<{count + 1}Q", view, 5)
    pos = 5 + 8 * (count + 1)
    parts = []
    for size in sizes:
        parts.append(view[pos : pos + size])
        pos += size
    buffers: list[Any] = [pickle.PickleBuffer(p) for p in parts[1:]]
    try:
        return serialization.loads(parts[0], buffers)
    except DeserializationError as exc:
        exc.message = (parts[0], buffers)  # type: ignore[attr-defined]
        raise


def load(message: bytes) -> Any:
    """The object in a message element (``MESSAGE`` + what :func:`pack` made)."""
    if len(message) > 1 and message[1] != FRAMED:  # a plain pickle: the common case
        data = message[1:] if len(message) <= _COPIED else memoryview(message)[1:]
        try:
            return pickle.loads(data)
        except Exception as exc:
            raise undecodable(exc) from exc
    return unpack(memoryview(message)[1:])


def undecodable(exc: Exception, message: Any = None) -> DeserializationError:
    """The error of a message that cannot be unpickled here (as ``serialization.loads``);
    its ``message`` (a plain pickle, or one and its buffers) kept on it, for a Pool's worker
    to name the task that failed."""
    error = DeserializationError(f"cannot unpickle payload: {type(exc).__name__}: {exc}")
    error.message = message  # type: ignore[attr-defined]
    return error
