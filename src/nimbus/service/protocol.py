"""What the service, its endpoint agents and the SDK say to each other.

WebSocket messages are msgpack maps with an ``op``::

    agent  -> service   hello {python, serializer, workers, window, held}
                        results {results: [[task_id, state, [status, data, buffers],
                        record], ...]}  (stored as pack_result bytes and packed record)
                        running {ids}  (tasks on a worker for 50 ms or more)
                        beat {t}
    service -> agent    tasks {tasks: [[task_id, function_id, body | None, payload,
                        timeout], ...]}  (a function's body comes once per connection)
                        ack {ids}  (results stored: the agent may forget them)
                        cancel {ids}   beat {t} (the echo of a heartbeat)
    client -> service   submit {ref, endpoint_id, tasks: [[function_id, payload, timeout]]}
                        watch {ids}   cancel {ids}
    service -> client   accepted {ref, ids} | refused {ref, status, detail}
                        results {results: [[task_id, state, result, record], ...]}
                        (as the agent sent them, or, from storage, result and
                        record as msgpack bytes)

``payload`` is :func:`pack_payload` of the pickled ``(args, kwargs)`` and its
out-of-band buffers; ``result`` is :func:`pack_result` of what the worker sent
back. The service stores and forwards both as bytes.

A payload or result larger than the service's ``inline_payload`` (``GET
/v1/limits``) travels through its data store instead: the sender ``PUT``s the
packed bytes to ``/v1/data`` and sends the reference ``{"data": data_id}`` in
their place; the receiver ``GET``s ``/v1/data/{data_id}``. Messages are cut at
about ``MESSAGE_BYTES`` (:func:`batches`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import msgpack

from nimbus.config import INLINE_MIN
from nimbus.errors import PayloadTooLargeError

__all__ = [
    "DELETED",
    "INLINE_MIN",
    "MESSAGE_BYTES",
    "PYTHON",
    "REPLACED",
    "REVOKED",
    "SERIALIZER",
    "batches",
    "data_ref",
    "pack",
    "pack_payload",
    "pack_result",
    "payload_size",
    "slices",
    "too_large",
    "unpack",
    "unpack_payload",
    "unpack_result",
]

PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"
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


def pack(obj: object) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


def pack_payload(data: bytes, buffers: Sequence[Any] = ()) -> bytes:
    return pack([data, [memoryview(b) for b in buffers]])


def unpack_payload(blob: bytes) -> tuple[bytes, list[bytes]]:
    data, buffers = unpack(blob)
    return data, buffers


def pack_result(status: int, data: bytes, buffers: Sequence[Any] = ()) -> bytes:
    return pack([status, data, [memoryview(b) for b in buffers]])


def unpack_result(blob: bytes) -> tuple[int, bytes, list[bytes]]:
    status, data, buffers = unpack(blob)
    return status, data, buffers


def payload_size(data: bytes, buffers: Sequence[Any] = ()) -> int:
    """The bytes of a pickle and its out-of-band buffers."""
    return len(data) + sum(memoryview(b).nbytes for b in buffers)


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
