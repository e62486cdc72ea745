"""``nimbus.statestore``: the state store (Redis), the one home of everything about it.

::

    multiprocessing (queues, locks, pipes ...)      messaging (instances, directory)      service
            |  program() -> Program                      |  program(), current()           |
            |  link(program) -> Link (hiredis)           |  connect(url)                    |
            v                                            v                                  v
    Program(url, program_id, key_ttl)   Root: keepalive, cleanup   adopt(): a worker's child joins
            |                                                                               |
    connect(url): the one way to a connection   keys: every key   Script: Lua by SHA1       |
            |                                                                               |
    StateStore.open(url | None) ---- EmbeddedRedis (private redis-server, Unix socket) <----+

It owns: the embedded Redis (``EmbeddedRedis``, ``redis_server_binary``), the
one way to open a connection (``connect``, and a thread's hiredis ``Link``
made from its settings; a process's ``presence``, the client id of a connection
that closes when the process dies), every key (``Keys``, in ``keys``), a program's
place in the store (``Program``, its root's keepalive and cleanup, ``adopt``
for the processes it starts, ``join``/``leave`` for a warm worker's task of an
Executor, whose tasks are instances of one program) and the Lua scripts run there (``Script``, every
one of them in ``lua``).
Everything above it (multiprocessing, messaging, the service) uses only
these names.
"""

from __future__ import annotations

from nimbus.statestore import keys, lua
from nimbus.statestore._chores import later
from nimbus.statestore._connect import connect, connect_async, probe, redacted, tls_options
from nimbus.statestore._embedded import EmbeddedRedis, redis_server_binary
from nimbus.statestore._link import (
    MIN_WAIT,
    SKIP_REPLY,
    Link,
    kept_presence,
    link,
    pack,
    preload,
    presence,
)
from nimbus.statestore._program import (
    Opener,
    Program,
    Root,
    adopt,
    current,
    is_root,
    join,
    leave,
    on_leave,
    open_local,
    open_store,
    program,
    root,
    set_opener,
    start_asked,
)
from nimbus.statestore._script import Script, scripts
from nimbus.statestore._store import StateStore
from nimbus.statestore.keys import Keys

__all__ = [
    "MIN_WAIT",
    "SKIP_REPLY",
    "EmbeddedRedis",
    "Keys",
    "Link",
    "Opener",
    "Program",
    "Root",
    "Script",
    "StateStore",
    "adopt",
    "connect",
    "connect_async",
    "current",
    "is_root",
    "join",
    "kept_presence",
    "keys",
    "later",
    "leave",
    "link",
    "lua",
    "on_leave",
    "open_local",
    "open_store",
    "pack",
    "preload",
    "presence",
    "probe",
    "program",
    "redacted",
    "redis_server_binary",
    "root",
    "scripts",
    "set_opener",
    "start_asked",
    "tls_options",
]
