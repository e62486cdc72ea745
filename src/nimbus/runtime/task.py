"""The runtime's view of a task: what to run and what came back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nimbus.environments import PLAIN, Environment
from nimbus.records import TaskRecord

__all__ = ["Task", "environment_tag"]


def environment_tag(env: Environment | None) -> str:
    """The worker type of ``env``: "" for the node's own Python, else ``name@key``.

    Workers are typed by name and content: two names with the same software
    (plain named environments, say) are still two worker types, as a user who
    named them asked; their builds are shared on a node (the cache is by key).
    """
    if env is None or env == PLAIN:
        return ""
    return f"{env.name}@{env.key}"


class Task:
    """One invocation travelling through the runtime.

    ``payload`` and ``buffers`` are the pickled ``(args, kwargs)`` (see
    ``nimbus.serialization.dumps``), or ``(args, kwargs, limits)`` for a task with
    limits of its own (``Executor.options(cpus=...)``: set by its worker around it); ``fn_bytes`` is the pickled function and
    ``fn_key`` its hash. ``owner`` belongs to whoever submitted the task (the
    runtime never looks inside it). When the task ends, ``status``, ``data``
    and ``result_buffers`` hold what the worker sent back. ``environment`` is
    what its worker runs in (None: the node's own Python) and ``env`` its
    worker type (:func:`environment_tag`), computed once by the submitter. ``wraps``
    is the SHA-256 of the pickle of the function ``fn_bytes`` wraps, if it wraps one
    (an executor's ``nimbus.data.run`` partial on an endpoint), else "".
    """

    __slots__ = (
        "attempts",
        "buffers",
        "cancelled",
        "data",
        "env",
        "environment",
        "fn_bytes",
        "fn_key",
        "owner",
        "payload",
        "record",
        "result_buffers",
        "route",
        "seq",
        "skip_only",
        "started",
        "status",
        "suspect",
        "timeout",
        "wraps",
    )

    def __init__(
        self,
        seq: int,
        fn_key: str,
        fn_bytes: bytes,
        payload: bytes,
        buffers: Sequence[Any],
        record: TaskRecord,
        *,
        timeout: float | None = None,
        owner: Any = None,
        environment: Environment | None = None,
        env: str | None = None,
        wraps: str = "",
    ) -> None:
        self.seq = seq
        self.fn_key = fn_key
        self.fn_bytes = fn_bytes
        self.payload = payload
        self.buffers = buffers
        self.record = record
        self.timeout = timeout
        self.owner = owner
        self.environment = environment
        self.env = environment_tag(environment) if env is None else env
        self.wraps = wraps
        self.cancelled = False
        self.attempts = 0
        self.route: Any = None  # the manager the agent gave it to
        self.started = False  # its worker said it is running it
        self.skip_only = False  # cancelled at shutdown: skipped if not started, never killed
        self.suspect = False  # it was with a worker that died, not known to be running
        self.status = -1
        self.data: Any = b""
        # () until a result comes (no list a task: the collector walks each one a task holds)
        self.result_buffers: Sequence[Any] = ()
