"""Every Redis key nimbus uses, built in one place.

Keys look like ``nimbus:{<program id>}:<kind>:<name>``. The braces are a Redis
Cluster hash tag: all keys of one program hash to one slot, so multi-key
commands and scripts over a program's objects work on a cluster too. Program
ids are random, so two programs sharing a Redis never see each other's keys;
:meth:`Keys.pattern` matches exactly one program's keys (for cleanup).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

from nimbus.errors import ConfigError

__all__ = ["PREFIX", "Keys"]

PREFIX = "nimbus"
_ID = re.compile(r"^[A-Za-z0-9_.-]+$")  # no glob characters, braces or colons


@dataclass(frozen=True)
class Keys:
    """The key builder of one program: ``Keys(program_id).queue("q")``."""

    program_id: str

    def __post_init__(self) -> None:
        if not _ID.match(self.program_id):
            raise ConfigError(
                f"program id {self.program_id!r} must be letters, digits, '_', '.' or '-'"
            )

    @staticmethod
    def program_id_new() -> str:
        """A fresh random program id."""
        return secrets.token_hex(8)

    @staticmethod
    def new_name() -> str:
        """A short unique name for a new shared object."""
        return secrets.token_hex(8)

    def _key(self, kind: str, *parts: str) -> str:
        return ":".join((PREFIX, "{" + self.program_id + "}", kind, *parts))

    def pattern(self) -> str:
        """A SCAN/KEYS pattern matching every key of this program and no other."""
        return self._key("*")  # braces are literal in Redis globs; the id has no glob chars

    def kv(self, key: str) -> str:
        """The key of ``key`` of ``nimbus.data.store()`` on an endpoint, whose id here is
        ``<user's prefix>.kv-<endpoint id>``: named by a digest of ``key``, so the names
        that other users' SCAN shows say nothing of it (nor match their globs); ``key``
        itself is listed in :meth:`kv_index`, which only its user reads."""
        return self._key("kv", hashlib.blake2b(key.encode(), digest_size=16).hexdigest())

    def kv_index(self) -> str:
        """The set of the keys of ``nimbus.data.store()`` set under :meth:`kv` (its keys()
        reads it, not a SCAN of the whole store)."""
        return self._key("kv-index")

    def queue(self, name: str) -> str:
        return self._key("queue", name)

    def lock(self, name: str) -> str:
        return self._key("lock", name)

    def semaphore(self, name: str) -> str:
        return self._key("semaphore", name)

    def event(self, name: str) -> str:
        return self._key("event", name)

    def condition(self, name: str) -> str:
        return self._key("condition", name)

    def barrier(self, name: str) -> str:
        return self._key("barrier", name)

    def value(self, name: str) -> str:
        return self._key("value", name)

    def array(self, name: str) -> str:
        return self._key("array", name)

    def pipe(self, name: str, end: int | str) -> str:
        """One direction of a pipe: ``end`` names the end that reads it."""
        return self._key("pipe", name, str(end))

    def dict(self, name: str) -> str:
        return self._key("dict", name)

    def list(self, name: str) -> str:
        return self._key("list", name)

    def refcount(self, name: str) -> str:
        return self._key("refcount", name)

    def instance(self, instance_id: str) -> str:
        return self._key("instance", instance_id)

    def directory(self) -> str:
        """The hash of this program's instances and their addresses."""
        return self._key("directory")

    def inbox(self, instance_id: str) -> str:
        """Messages for an instance that went through the store (its fallback path)."""
        return self._key("inbox", instance_id)

    def messaging_token(self) -> str:
        """The program's messaging auth token, set once by its first instance."""
        return self._key("messaging", "token")

    def pipe_refs(self, name: str, end: int | str) -> str:
        """The count of the open copies of one end of a pipe."""
        return self._key("pipe", name, str(end), "refs")

    def pipe_holder(self, name: str, end: int | str) -> str:
        """The instance that reads one direction of a pipe directly (its claim)."""
        return self._key("pipe", name, str(end), "holder")

    def pipe_writer(self, name: str, end: int | str) -> str:
        """The writers of one direction of a pipe switched to direct sends (writer -> claim)."""
        return self._key("pipe", name, str(end), "writer")

    def pipe_writer_users(self, name: str, end: int | str) -> str:
        """The processes that have written one direction of a pipe (a set)."""
        return self._key("pipe", name, str(end), "writer", "users")

    def pipe_mode(self, name: str, end: int | str) -> str:
        """Set once a second process read one direction of a pipe: store only, for good."""
        return self._key("pipe", name, str(end), "mode")

    def queue_field(self, name: str, field: str) -> str:
        """A counter or wake-up list of queue ``name`` (``count``, ``unfinished`` ...)."""
        return self._key("queue", name, field)

    def giveup(self, instance_id: str) -> str:
        """The list where instance ``instance_id`` finds the direct-read claims it must give
        up (the handover engine's; among the queue fields, as it always was)."""
        return self._key("queue", instance_id, "giveup")

    def wakeup(self, name: str) -> str:
        """A short-lived list that wakes one blocked waiter (``connection.wait``)."""
        return self._key("wakeup", name)

    def lock_owners(self, name: str) -> str:
        """Who may hold lock ``name``: a set of owners (each registered before it acquires)."""
        return self._key("lock", name, "owners")

    def lock_held(self, name: str, owner: str) -> str:
        """Where lock ``name``'s token sits while ``owner`` holds it (``owner`` "": the prefix)."""
        return self._key("lock", name, "held", owner)

    def waiters(self, name: str) -> str:
        """The wake-up lists of the threads waiting on event or condition ``name``."""
        return self._key("waiters", name)

    def waiter(self, name: str) -> str:
        """One waiting thread's wake-up list (``name`` is unique per wait)."""
        return self._key("waiter", name)

    def stdio(self, name: str) -> str:
        """The output chunks and exit codes of the remote children of one parent process."""
        return self._key("stdio", name)

    def signal(self, token: str) -> str:
        """Signals (``terminate``/``kill``) for the remote process started as ``token``."""
        return self._key("signal", token)

    # ------------------------------------------------------------ the service
    # The service is one "program": ``Keys(service_id)``; its keys name tasks,
    # endpoints and users by their UUIDs.

    def task(self, task_id: str) -> str:
        """A task's hash: state, owner, endpoint, function, payload, result, record."""
        return self._key("task", task_id)

    def task_dependents(self, task_id: str) -> str:
        """The set of ids of tasks held until task ``task_id`` ends (they take its result):
        ``task(task_id)`` and a suffix (the task store's scripts join the two)."""
        return self._key("task", task_id, "then")

    def endpoint_queue(self, endpoint_id: str) -> str:
        """The list of task ids waiting for an endpoint (oldest at the head)."""
        return self._key("endpoint", endpoint_id, "queue")

    def endpoint_held(self, endpoint_id: str) -> str:
        """The set of ids of an endpoint's tasks held until their inputs end (in neither its
        queue nor its inflight hash: deleting the endpoint fails them too)."""
        return self._key("endpoint", endpoint_id, "held")

    def endpoint_inflight(self, endpoint_id: str) -> str:
        """The hash of task id -> agent connection id of tasks sent to an endpoint."""
        return self._key("endpoint", endpoint_id, "inflight")

    def endpoint_status(self, endpoint_id: str) -> str:
        """An endpoint's live status: connected, workers, python, last heartbeat."""
        return self._key("endpoint", endpoint_id, "status")

    def user_tasks(self, user_id: str) -> str:
        """The sorted set of a user's task ids, scored by submit time."""
        return self._key("user", user_id, "tasks")

    def all_tasks(self) -> str:
        """The sorted set of every task id, scored by submit time (the admin's dashboard)."""
        return self._key("tasks")

    def user_queued(self, user_id: str) -> str:
        """A user's hash of tasks and inline payload bytes queued or running (the quota)."""
        return self._key("user", user_id, "queued")

    def dashboard_session(self, session_id: str) -> str:
        """A dashboard login's hash: user id and name, token digest, CSRF token."""
        return self._key("dashboard", "session", session_id)

    def group(self, group_id: str) -> str:
        """The list of task ids of a task group (one batch submit)."""
        return self._key("group", group_id)

    def data(self, data_id: str) -> str:
        """A data-store blob's hash: owner, size, and the task and endpoint it serves."""
        return self._key("data", data_id)
