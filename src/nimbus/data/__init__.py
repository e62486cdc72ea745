"""``nimbus.data``: data between functions, kept where it is made.

::

    nimbus.put(obj, endpoint)  --> Ref  (the object in that endpoint's node store)
    ex.map(fn, xs, keep=True)  --> futures whose results stay where they were made
    ex.submit(g, ref, future)  --> g runs with the objects read where it runs (run())
    inside a task: nimbus.data.store()  (the user's key-value store there)

Modules: ``_node`` (a node's object store: files in a private memory directory,
mapped on read, leases as modification times), ``_ref`` (``Ref``, the client's
sessions: counting, leases, freeing), ``_task`` (the worker side: resolving,
keeping, ``store()``), ``_kv`` (the key-value store).
"""

from __future__ import annotations

from nimbus.data._bind import bind, open_session, uses_data, waiting_on, when_done
from nimbus.data._kv import KeyValue
from nimbus.data._node import NodeStore, default_root
from nimbus.data._ref import LEASE, MAX_SCAN, Ref, Scope, Session, get, pure, put, register, session
from nimbus.data._task import free_objects, identity, renew_objects, run, store

__all__ = [
    "LEASE",
    "MAX_SCAN",
    "KeyValue",
    "NodeStore",
    "Ref",
    "Scope",
    "Session",
    "bind",
    "default_root",
    "free_objects",
    "get",
    "identity",
    "open_session",
    "pure",
    "put",
    "register",
    "renew_objects",
    "run",
    "session",
    "store",
    "uses_data",
    "waiting_on",
    "when_done",
]
