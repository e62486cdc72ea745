"""The state store of a program whose processes run on a provider's nodes.

::

    login node: the program's root                    a block's node
      EmbeddedRedis  unix socket (this host)             child processes, Pool workers
                     TCP <agent_listen's host>:<port> <-- redis://:<password>@host:port/0
                     requirepass <generated>

The embedded store listens only on a Unix socket, which a node cannot reach.
With ``NIMBUS_PROVIDER`` other than ``local`` (and no ``NIMBUS_REDIS_URL``) the
root's embedded store also listens on TCP, on the host of ``agent_listen`` (the
address the nodes already reach for the agent; ``0.0.0.0`` is advertised as
this host's name), with a password made for this program (the ``default``
user's, given to the server in a ``0600`` file, never on a command line). The
URL, password included, goes to the nodes as the program's own URL does: with
each process's start, never on a command line.
"""

from __future__ import annotations

import secrets
import socket
from typing import Any

from nimbus.errors import StateStoreError
from nimbus.statestore import EmbeddedRedis, StateStore

__all__ = ["store_for_nodes"]

_TRIES = 3  # a free port taken between the probe and redis-server's bind: try another


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def store_for_nodes(settings: Any) -> StateStore:
    """``settings``' store when it has a URL; else an embedded one the nodes reach over TCP."""
    if settings.redis_url:
        return StateStore.from_settings(settings)
    host, _, _ = settings.agent_listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    shown = socket.gethostname() if host in ("0.0.0.0", "::") else host
    if ":" in shown:
        shown = f"[{shown}]"
    password = secrets.token_urlsafe(32)
    error: StateStoreError | None = None
    for _ in range(_TRIES):
        port = _free_port(host)
        server = EmbeddedRedis(settings.ensure_runtime_dir(), tcp=(host, port), password=password)
        try:
            server.start()
        except StateStoreError as exc:  # the port went to someone else meanwhile
            error = exc
            continue
        return StateStore(f"redis://:{password}@{shown}:{port}/0", server)
    raise StateStoreError(
        f"the program's store for the nodes could not listen on {host} "
        f"(the host of agent_listen, NIMBUS_AGENT_LISTEN): {error}; set agent_listen to an "
        f"address of this host the nodes reach, or NIMBUS_REDIS_URL to a Redis they reach"
    )
