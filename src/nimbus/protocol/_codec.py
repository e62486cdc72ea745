"""The wire's codec: msgpack, packed payloads and results, frames, limits and close codes.

Every WebSocket frame is a binary msgpack map with a known ``op``
(:func:`decode_frame`; the messages themselves are the dataclasses of
:mod:`nimbus.protocol._messages`); any other frame ends the connection with a
close code and a reason: 1003 for a text frame, 1007 for bytes that are not
msgpack, 1008 for msgpack of the wrong shape.

``payload`` is :func:`pack_payload` of the pickled ``(args, kwargs)`` and its
out-of-band buffers (:func:`check_payload` checks that framing without
unpickling); ``result`` is :func:`pack_result` of what the worker sent
back. The service stores and forwards both as bytes.

A payload or result larger than the service's ``inline_payload`` (``GET
/v1/limits``) travels through its data store instead: the sender ``PUT``s the
packed bytes to ``/v1/data`` and sends the reference ``{"data": data_id}`` in
their place; the receiver ``GET``s ``/v1/data/{data_id}``. Messages are cut at
about ``MESSAGE_BYTES`` (:func:`batches`).

Message sizes are bounded on every side: the service accepts messages of at
most ``max_message`` bytes (``NIMBUS_MAX_MESSAGE``) from clients and agents,
which cut theirs at ``MESSAGE_BYTES``; it registers function bodies of at most
``FUNCTION_MAX`` bytes, so what it sends (a batch cut at ``MESSAGE_BYTES``, or
one function body with one inline payload) stays under ``RECEIVE_MAX``, the
most the SDK and agents accept from it (a larger message closes the connection
with 1009, and they reconnect).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any

import msgpack

from nimbus.config import INLINE_MAX, INLINE_MIN
from nimbus.errors import PayloadTooLargeError, ProtocolError
from nimbus.serialization import PYTHON

__all__ = [
    "DELETED",
    "FUNCTION_MAX",
    "INLINE_MIN",
    "MESSAGE_BYTES",
    "PYTHON",
    "RECEIVE_MAX",
    "REPLACED",
    "REVOKED",
    "SERIALIZER",
    "batches",
    "brief",
    "check_payload",
    "data_ref",
    "decode_frame",
    "is_result",
    "is_uuid",
    "pack",
    "pack_payload",
    "pack_result",
    "payload_size",
    "slices",
    "str_list",
    "too_large",
    "unpack",
    "unpack_payload",
    "unpack_result",
]

SERIALIZER = "pickle5+cloudpickle3"
API = "/v1"
WS_AGENT = API + "/ws/endpoint"
WS_CLIENT = API + "/ws/client"
DATA = API + "/data"
LIMITS = API + "/limits"
MSGPACK = "application/msgpack"
REVOKED = 4401  # WebSocket close code: the connection's token was revoked
REPLACED = 4409  # close code: the endpoint was registered again, a new token replaced this one
DELETED = 4410  # close code: the endpoint was deleted by its owner
MESSAGE_BYTES = 8 << 20  # payload bytes per WebSocket message (one larger row goes alone)
TEXT_FRAME, NOT_MSGPACK, WRONG_SHAPE = 1003, 1007, 1008  # WebSocket close codes
FUNCTION_MAX = 16 << 20  # bytes of a registered function's body (pass large data as arguments)
RECEIVE_MAX = 4 * MESSAGE_BYTES  # bytes of a message the SDK and agents accept from the service
assert RECEIVE_MAX > FUNCTION_MAX + INLINE_MAX + (1 << 20)  # one row with its framing fits


def _wire(obj: Any) -> Any:
    """What msgpack cannot pack by itself: a reference's ``wire()``, a buffer's bytes."""
    wire = getattr(obj, "wire", None)
    if wire is not None:
        return wire()
    try:
        return memoryview(obj)
    except TypeError:
        raise TypeError(f"cannot pack {brief(obj)} for the wire") from None


def pack(obj: object) -> bytes:
    """``obj`` as msgpack; tuples (the rows) pack as lists, str Enums as their values."""
    data: bytes = msgpack.packb(obj, use_bin_type=True, default=_wire)
    return data


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


def pack_payload(data: bytes, buffers: Sequence[Any] = ()) -> bytes:
    return pack([data, [memoryview(b) for b in buffers]])


def unpack_payload(blob: bytes) -> tuple[bytes, list[bytes]]:
    """The pickle and buffers of a packed payload; ``ValueError`` saying what is wrong."""
    if not isinstance(blob, bytes | bytearray | memoryview) or not blob:
        raise ValueError(f"expected the bytes of pack_payload, got {brief(blob)}")
    try:
        value = msgpack.unpackb(blob, raw=False)
    except Exception as exc:
        raise ValueError(f"not msgpack ({type(exc).__name__}: {exc})") from None
    if type(value) is list and len(value) == 2 and type(value[0]) is bytes and value[1] == []:
        return value[0], value[1]  # the usual payload: a pickle without buffers
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not isinstance(value[0], bytes)
        or not isinstance(value[1], list)
        or not all(isinstance(b, bytes) for b in value[1])
    ):
        raise ValueError("msgpack of the wrong shape: expected [pickle bytes, [buffer bytes, ...]]")
    return value[0], value[1]


def check_payload(blob: object) -> int:
    """The pickle and buffer bytes in a packed payload, its framing checked (never unpickled).

    ``ValueError`` says what is wrong: empty, not msgpack, or not
    ``[pickle bytes, [buffer bytes, ...]]``.
    """
    data, buffers = unpack_payload(blob)  # type: ignore[arg-type]
    return len(data) + sum(len(b) for b in buffers)


def pack_result(status: int, data: bytes, buffers: Sequence[Any] = ()) -> bytes:
    return pack([status, data, [memoryview(b) for b in buffers]])


def unpack_result(blob: bytes) -> tuple[int, bytes, list[bytes]]:
    status, data, buffers = unpack(blob)
    return status, data, buffers


def traceback_text(result: bytes | None, limit: int = 1 << 20) -> str:
    """The traceback text inside a failed task's result, read from the pickle's opcodes
    without unpickling it (the service never runs what a worker sent); '' if none."""
    import pickletools  # only the dashboard and `nimbus tasks show` read tracebacks

    if not result or len(result) > limit:
        return ""
    try:
        _, data, _ = unpack_result(result)
        texts = [
            arg
            for _, arg, _ in pickletools.genops(bytes(data))
            if isinstance(arg, str) and "Traceback (most recent call last)" in arg
        ]
    except Exception:  # not a result nimbus packed: nothing to show
        return ""
    return texts[-1] if texts else ""


def payload_size(data: bytes, buffers: Sequence[Any] = ()) -> int:
    """The bytes of a pickle and its out-of-band buffers."""
    if not buffers:  # the usual task: its arguments or result all in the pickle
        return len(data)
    return len(data) + sum(memoryview(b).nbytes for b in buffers)


def decode_frame(frame: str | bytes | None, ops: Collection[str]) -> dict[str, Any]:
    """A received WebSocket frame as a msgpack map whose ``op`` is one of ``ops``.

    :class:`~nimbus.errors.ProtocolError` otherwise, its ``code`` the close code
    that answers it (1003 text frame, 1007 not msgpack, 1008 wrong shape).
    """
    if isinstance(frame, str):
        raise ProtocolError("a text frame: this socket speaks binary msgpack maps", TEXT_FRAME)
    if not frame:
        raise ProtocolError("an empty frame: expected a msgpack map with an 'op'", NOT_MSGPACK)
    try:
        msg = unpack(frame)
    except Exception as exc:
        raise ProtocolError(f"not msgpack ({type(exc).__name__})", NOT_MSGPACK) from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"expected a msgpack map with an 'op', got {brief(msg)}", WRONG_SHAPE)
    op = msg.get("op")
    if not isinstance(op, str) or op not in ops:
        raise ProtocolError(
            f"unknown op {str(op)[:40]!r}: expected one of {', '.join(sorted(ops))}", WRONG_SHAPE
        )
    return msg


def is_result(value: object) -> bool:
    """Whether ``value`` is a result as sent inline: ``[status, data, [buffer, ...]]``."""
    return (
        isinstance(value, list)
        and len(value) == 3
        and isinstance(value[0], int)
        and not isinstance(value[0], bool)
        and -1 <= value[0] <= 255
        and isinstance(value[1], bytes)
        and isinstance(value[2], list)
        and all(isinstance(b, bytes) for b in value[2])
    )


def str_list(msg: dict[str, Any], name: str, *, default: list[str] | None = None) -> list[str]:
    """``msg[name]`` as a list of strings; ProtocolError (1008) naming the field otherwise."""
    value = msg.get(name, default)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ProtocolError(
            f"{msg.get('op')}.{name}: expected a list of strings, got {brief(value)}", WRONG_SHAPE
        )
    return value


def brief(value: object) -> str:
    """What a value is, for an error message (its type, and a short repr)."""
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def data_ref(value: object) -> str | None:
    """The data id of a data-store reference ``{"data": id}``, None for an inline value."""
    if isinstance(value, dict):
        ref = value.get("data")
        if isinstance(ref, str):
            return ref
    return None


def batches(
    rows: Iterable[Any], size: Callable[[Any], int], limit: int = MESSAGE_BYTES, most: int = 5000
) -> Iterator[list[Any]]:
    """``rows`` cut into lists of at most ``most`` rows and about ``limit`` bytes each."""
    out: list[Any] = []
    total = 0
    for row in rows:
        n = size(row)
        if out and (total + n > limit or len(out) >= most):
            yield out
            out, total = [], 0
        out.append(row)
        total += n
    if out:
        yield out


def slices(blob: bytes, size: int = 1 << 20) -> Iterator[memoryview]:
    """``blob`` in views of ``size`` bytes (no copies), for streaming it out."""
    view = memoryview(blob)
    for start in range(0, len(view), size):
        yield view[start : start + size]


def too_large(what: str, size: int, limit: int) -> PayloadTooLargeError:
    """The error of ``what`` (``size`` bytes) over the service's ``limit``, naming both."""
    return PayloadTooLargeError(
        f"{what} of {size} bytes exceeds the limit of {limit} bytes "
        f"(NIMBUS_MAX_PAYLOAD on the service)"
    )


def is_uuid(text: str) -> bool:
    """Whether ``text`` is a UUID (an id), not a name: how an endpoint reference is read."""
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True
