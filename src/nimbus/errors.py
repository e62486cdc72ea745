"""The exceptions nimbus raises.

Every nimbus error roots at :class:`NimbusError`. Where nimbus replaces a stdlib
class, its error also subclasses the stdlib's, so ``except BrokenProcessPool``
or ``except TimeoutError`` written for the stdlib keeps working::

    NimbusError
    ├── ConfigError (ValueError)              a setting or argument is wrong
    ├── SerializationError (PicklingError,    a payload cannot be pickled
    │                       TypeError)        (the stdlib raises TypeError)
    ├── DeserializationError (UnpicklingError) a payload cannot be unpickled
    ├── VersionMismatchError                  worker and caller Pythons differ
    ├── EnvironmentBuildError                 an environment could not be made ready
    │                                         on a node (the builder's message quoted)
    ├── PayloadTooLargeError (ValueError)     a payload exceeds the set limit
    ├── StateStoreError (ConnectionError)     Redis cannot be started or reached
    ├── RemoteError                           a task failed with an exception
    │                                         that could not be sent back as is
    ├── RemoteTraceback                       carries a remote traceback as the
    │                                         ``__cause__`` of a task's exception
    ├── TaskTimeoutError (TimeoutError)       a task ran past its timeout
    ├── TaskInterrupted                       a task raised SystemExit or
    │                                         KeyboardInterrupt
    ├── MemoryLimitExceeded (MemoryError)     a task went over its worker's memory
    │                                         limit (the worker's cgroup killed it)
    ├── MessagingError                        direct messaging between instances
    │   ├── PeerUnknown (ValueError)          not an instance id (not one that
    │   │                                     ``instance_id()`` gives)
    │   ├── PeerUnreachable (ConnectionError) no address or no answer in time
    │   ├── PeerLost (ConnectionError)        the peer died or its link broke
    │   ├── PeerExited (EOFError)             the peer exited; nothing more comes
    │   ├── PeerRefused (ConnectionError)     the handshake was refused (token,
    │   │                                     program or version)
    │   ├── MessageDecodeError                a message failed to unpickle; names
    │   │    (DeserializationError)           the sender
    │   └── MessagingTimeout (TimeoutError)   ``recv`` waited past its timeout
    ├── ServiceError                          the nimbus service refused or failed
    │   ├── AuthError (PermissionError)       a missing, wrong or too weak token
    │   ├── NotFound (LookupError)            no such function, endpoint or task
    │   │                                     (or not visible to this user)
    │   ├── AmbiguousEndpointError            an endpoint name matches several you
    │   │                                     can use; ``choices`` lists owner/name
    │   ├── QuotaExceeded                     a per-user limit of the service
    │   │                                     (queued tasks or bytes, functions,
    │   │                                     endpoints) is reached (429)
    │   ├── TaskLost                          the service no longer knows a task it
    │   │                                     accepted (its queues restarted empty)
    │   ├── ProtocolError (ValueError)        a message or record of the wrong
    │   │                                     shape (a WebSocket frame, a queue row)
    │   └── ServiceUnavailable (ConnectionError)  the service cannot be reached
    ├── ProviderError                         a provider cannot give nodes: the
    │                                         scheduler refused a block (its message
    │                                         quoted) or its command is missing
    ├── DataError                             references (``nimbus.Ref``) and the
    │   │                                     endpoint's data (``nimbus.data``)
    │   ├── ReferenceLost (LookupError)       the object a Ref names is gone (its
    │   │                                     holder died or its lease ran out) and
    │   │                                     its task cannot be run again
    │   ├── DataAccessError (PermissionError) a Ref of another user, or of another
    │   │                                     endpoint than the task's
    │   ├── InputFailed                       a task's input (a future passed to it)
    │   │                                     failed or was cancelled: it did not run
    │   └── FileRefused (PermissionError)     a ``nimbus.File`` outside what its
    │                                         endpoint exports, escaping it (``..``,
    │                                         a symlink), or of an unknown endpoint
    └── WorkerLost (BrokenProcessPool)        the worker running a task died
        └── RuntimeClosed                     the runtime shut down under a task

Errors of the libraries underneath (redis, socket, pickle) are translated into
these at the boundary where nimbus calls them.

``WorkerLost`` and ``RuntimeClosed`` are made on first use (PEP 562): their
stdlib base lives in ``concurrent.futures.process``, which imports
multiprocessing, logging and more (about 40 ms), and a worker, which imports
this module at its start, never needs them.
"""

from __future__ import annotations

import pickle
import threading
from typing import TYPE_CHECKING

__all__ = [
    "AmbiguousEndpointError",
    "AuthError",
    "ConfigError",
    "DataAccessError",
    "DataError",
    "DeserializationError",
    "EnvironmentBuildError",
    "FileRefused",
    "InputFailed",
    "MemoryLimitExceeded",
    "MessageDecodeError",
    "MessagingError",
    "MessagingTimeout",
    "NimbusError",
    "NotFound",
    "PayloadTooLargeError",
    "PeerExited",
    "PeerLost",
    "PeerRefused",
    "PeerUnknown",
    "PeerUnreachable",
    "ProtocolError",
    "ProviderError",
    "QuotaExceeded",
    "ReferenceLost",
    "RemoteError",
    "RemoteTraceback",
    "RuntimeClosed",
    "SerializationError",
    "ServiceError",
    "ServiceUnavailable",
    "StateStoreError",
    "TaskInterrupted",
    "TaskLost",
    "TaskTimeoutError",
    "VersionMismatchError",
    "WorkerLost",
]


class NimbusError(Exception):
    """The root of every error nimbus raises."""


class ConfigError(NimbusError, ValueError):
    """A setting, environment variable or argument has a wrong value."""


class SerializationError(NimbusError, pickle.PicklingError, TypeError):
    """An object could not be pickled; the message names it."""


class DeserializationError(NimbusError, pickle.UnpicklingError):
    """A payload could not be unpickled on the receiving side."""


class VersionMismatchError(NimbusError):
    """The caller and the worker run different Python minor versions."""


class EnvironmentBuildError(NimbusError):
    """An environment could not be built on a node: a package that does not exist, a
    wheel that does not build, a container image that is missing. The message quotes
    the builder (uv, pip, podman, bubblewrap); the failure stays until the spec changes."""

    def __init__(self, message: str, environment: str = "", key: str = "") -> None:
        super().__init__(message)
        self.environment = environment
        self.key = key

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.environment, self.key))


class PayloadTooLargeError(NimbusError, ValueError):
    """A payload is larger than the configured maximum."""


class StateStoreError(NimbusError, ConnectionError):
    """The state store (Redis) could not be started or reached."""


class RemoteError(NimbusError):
    """A task raised an exception that could not be sent back as itself.

    ``type_name`` is the qualified name of the original exception type and
    ``remote_traceback`` its formatted traceback.
    """

    def __init__(self, message: str, type_name: str = "", remote_traceback: str = "") -> None:
        super().__init__(message)
        self.type_name = type_name
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0], self.type_name, self.remote_traceback))


class RemoteTraceback(NimbusError):
    """The traceback of an exception raised in a worker, shown as its cause."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


class TaskTimeoutError(NimbusError, TimeoutError):
    """A task ran longer than its timeout; its worker was replaced."""


class MemoryLimitExceeded(NimbusError, MemoryError):
    """A task used more memory than its worker may (``worker_memory``): it was killed.

    Raised in place of a lost worker; the message names the limit and how to raise it.
    """


class TaskInterrupted(NimbusError):
    """A task raised ``SystemExit`` or ``KeyboardInterrupt``.

    The runtime does not let these escape into the worker; ``code`` holds the
    exit code for ``SystemExit`` (``None`` for ``KeyboardInterrupt``).
    """

    def __init__(self, message: str, code: object = None) -> None:
        super().__init__(message)
        self.code = code

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0], self.code))


if TYPE_CHECKING:  # as mypy sees them; made on first use by _make_worker_lost below
    from concurrent.futures.process import BrokenProcessPool

    class WorkerLost(NimbusError, BrokenProcessPool): ...

    class RuntimeClosed(WorkerLost): ...


class MessagingError(NimbusError):
    """Direct messaging between instances failed (see ``nimbus.messaging``)."""


class PeerUnknown(MessagingError, ValueError):
    """The peer named is not an instance id: no instance can ever have it."""


class PeerUnreachable(MessagingError, ConnectionError):
    """The peer has no address yet or does not answer; nothing was sent directly."""


class PeerLost(MessagingError, ConnectionError):
    """The peer died, or the connection to it broke, while talking to it."""


class PeerExited(MessagingError, EOFError):
    """The peer exited normally and everything it sent has been received."""


class PeerRefused(MessagingError, ConnectionError):
    """The peer refused the handshake: another program, a wrong token or version.

    Raised by the send that opens the link, or, to a peer on another host (TCP,
    whose small first message goes out behind the handshake), by the next send
    to it (logged at exit when there is none).
    """


class MessageDecodeError(MessagingError, DeserializationError):
    """A received message could not be unpickled; ``sender`` is the instance that sent it.

    The message is consumed; the connection stays usable for the next one.
    """

    def __init__(self, message: str, sender: str = "") -> None:
        super().__init__(message)
        self.sender = sender

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0], self.sender))


class MessagingTimeout(MessagingError, TimeoutError):
    """``recv`` waited longer than its timeout."""


class ServiceError(NimbusError):
    """The nimbus service answered with an error; ``status`` is its HTTP status."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0], self.status))


class AuthError(ServiceError, PermissionError):
    """The token is missing or wrong (401), or may not do this (403)."""


class NotFound(ServiceError, LookupError):
    """No such function, endpoint or task, or it is not visible to this user (404)."""


class ServiceUnavailable(ServiceError, ConnectionError):
    """The service cannot be reached (connection refused, reset, timed out)."""


class AmbiguousEndpointError(ServiceError):
    """A 409 from the service: an endpoint name matches several endpoints you can use.

    ``choices`` are their ``owner/name``; give one of them instead of the bare name.
    """

    def __init__(self, message: str, status: int = 409, choices: list[str] | None = None):
        super().__init__(message, status)
        self.choices = list(choices or [])

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0], self.status, self.choices))


class QuotaExceeded(ServiceError):
    """A per-user limit of the service is reached (429): the message names the setting."""


class TaskLost(ServiceError):
    """The service no longer knows a task it accepted (410): its task queues' Redis
    restarted empty (a service without ``--persist``), or the task's result expired.
    The task may or may not have run; submit it again."""


class ProtocolError(ServiceError, ValueError):
    """A message or stored record does not have the shape the protocol says.

    ``code`` is the WebSocket close code that answers it: 1003 (a text frame where
    binary msgpack was expected), 1007 (not msgpack), 1008 (msgpack of the wrong shape).
    """

    def __init__(self, message: str, code: int = 1008) -> None:
        super().__init__(message, 422)
        self.code = code

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0], self.code))


class ProviderError(NimbusError):
    """A provider could not submit, query or cancel a block; the message quotes the
    scheduler (``sbatch: error: invalid partition specified: nope``) or names the
    setting to fix (``provider``, ``partition``...)."""


class DataError(NimbusError):
    """Something about a reference (``nimbus.Ref``) or the endpoint's data is wrong."""


class ReferenceLost(DataError, LookupError):
    """The object a reference names is gone: the node that held it died, or its lease ran
    out (its holder stopped renewing it), and the task that made it is not known to be
    pure, so it is not run again. ``ref_id`` names the reference; make the object again
    (``nimbus.put`` or the task that made it) and pass the new reference."""

    def __init__(self, message: str, ref_id: str = "") -> None:
        super().__init__(message)
        self.ref_id = ref_id

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0], self.ref_id))


class DataAccessError(DataError, PermissionError):
    """A reference was passed where it cannot be used: it belongs to another user, or
    it lives on another endpoint than the one the task runs on."""


class InputFailed(DataError):
    """A task did not run because a task whose result it takes (a future passed as its
    argument) failed or was cancelled; ``input_id`` names that task (the input's own
    error is its ``__cause__`` where the client still has the input's future)."""

    def __init__(self, message: str, input_id: str = "") -> None:
        super().__init__(message)
        self.input_id = input_id

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0], self.input_id))


class FileRefused(DataError, PermissionError):
    """A ``nimbus.File`` cannot be read or written: its path is outside the directories
    its endpoint's owner exports (``exports`` in the endpoint's config), escapes them
    with ``..`` or a symlink, or its endpoint is not known."""


_make_lock = threading.Lock()


def _make_worker_lost() -> None:
    global WorkerLost, RuntimeClosed
    try:
        from concurrent.futures.process import BrokenProcessPool
    except RuntimeError:  # first needed as the interpreter exits (a second Ctrl-C): its base
        from concurrent.futures import BrokenExecutor as BrokenProcessPool  # type: ignore[assignment]

    class WorkerLost(NimbusError, BrokenProcessPool):
        """The worker running a task died (killed, ``os._exit``, segfault)."""

    class RuntimeClosed(WorkerLost):
        """The runtime shut down while the task was still in it."""


def __getattr__(name: str) -> type[Exception]:
    if name not in ("WorkerLost", "RuntimeClosed"):
        raise AttributeError(f"module 'nimbus.errors' has no attribute {name!r}")
    with _make_lock:  # made once: every ``except WorkerLost`` must see the same class
        if "WorkerLost" not in globals():
            _make_worker_lost()
    made: type[Exception] = globals()[name]
    return made
