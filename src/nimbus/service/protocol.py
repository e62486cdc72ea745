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
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import msgpack

__all__ = [
    "PYTHON",
    "SERIALIZER",
    "pack",
    "pack_payload",
    "pack_result",
    "unpack",
    "unpack_payload",
    "unpack_result",
]

PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"
SERIALIZER = "pickle5+cloudpickle3"
API = "/v1"
WS_AGENT = API + "/ws/endpoint"
WS_CLIENT = API + "/ws/client"
MSGPACK = "application/msgpack"


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
