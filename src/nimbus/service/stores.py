"""State stores the service hands out: where a program on an endpoint keeps its shared state.

::

    client (NIMBUS_ENDPOINT=lab)                    service
    ----------------------------                    -------
    POST /v1/endpoints/{id}/store  --------------->  owner/share check of the endpoint
                                                      stores Redis started (first call)
    {"url": redis://nimbus-u-<user>:<pw>@host:port, <-- ACL SETUSER nimbus-u-<user>
     "key_prefix": "u-<user>", "online": ...}             ~nimbus:{u-<user>.*  (keys)
                                                          &nimbus:{u-<user>.*  (channels)
    program id "u-<user>.<random>"; the client and the endpoint's workers
    both connect to that URL (the Program travels in each task)

The *stores Redis* is a second embedded Redis the service runs for this, apart
from the one holding its task queues (which no user ever reaches). It listens
on TCP at ``NIMBUS_STORE_LISTEN`` (``127.0.0.1:0`` by default: loopback, any
free port; give an address the clients and the endpoints' workers both reach).
When the service serves TLS, that address speaks TLS with the service's
certificate (a tunnel to the Redis's Unix socket, ``nimbus.service.tunnel``)
and the URLs handed out are ``rediss://``.
Its ``default`` user is the admin: a random password that only the service
process holds and never hands out. Each user gets a Redis ACL user whose keys
and channels are limited to programs whose id starts with the user's prefix,
so two users never see each other's state (nor the service's). The ACL user's
password is derived from a per-start secret and the user id, so every program
of a user gets the same URL while the service runs; a restart of the service
starts a new stores Redis (the state of running programs is lost).

Commands refused to a user: ``@admin`` and ``@dangerous`` ones (``CONFIG``,
``FLUSHALL``, ``KEYS``, ``DEBUG`` ...) except the ``CLIENT`` subcommands the
locks use to tell whether a holder is alive (``ID``, ``SETNAME``, ``GETNAME``,
``REPLY``, ``LIST``). What a user can still learn of others: client names and
addresses (``CLIENT LIST``) and key *names* (``SCAN``, which the program's
keepalive needs; Redis does not filter it by ACL), never values. A store URL
stays valid while the service runs, until one of the user's own tokens is
revoked: then the ACL user is deleted (its connections closed, so the user's
running programs on endpoints lose their store) and the next URL carries a
new password. Revoking an endpoint's token leaves the store alone.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import ssl
import threading
from typing import Annotated, Any

import redis
from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from nimbus.config import Settings
from nimbus.errors import ServiceError, StateStoreError
from nimbus.service.context import ServiceContext
from nimbus.service.deps import context, current_user
from nimbus.service.registry import Principal
from nimbus.service.tunnel import TLSTunnel
from nimbus.statestore import EmbeddedRedis

__all__ = ["StoreServer", "key_prefix", "router"]

router = APIRouter(prefix="/v1")
User = Annotated[Principal, Depends(current_user)]
Ctx = Annotated[ServiceContext, Depends(context)]

# what a user's ACL user may run, after ``reset`` (which allows nothing)
USER_RULES = (
    "+@all",
    "-@admin",
    "-@dangerous",
    *("+client|id", "+client|setname", "+client|getname", "+client|reply", "+client|list"),
)
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def key_prefix(user_id: str) -> str:
    """The start of every program id of ``user_id`` (a valid ``Keys`` program id part)."""
    return "u-" + user_id


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class StoreServer:
    """The stores Redis and its ACL users; :meth:`store` gives one user's URL."""

    def __init__(self, settings: Settings, tls: ssl.SSLContext | None = None) -> None:
        host, port = settings.store_address
        self.host = host
        self.port = port or _free_port(host or "0.0.0.0")
        self._secret = secrets.token_bytes(32)
        # with TLS: Redis on its Unix socket only, TLS on the TCP address (service/tunnel.py)
        self._server = EmbeddedRedis(
            settings.ensure_runtime_dir(),
            tcp=None if tls else (host or "0.0.0.0", self.port),
            password=secrets.token_urlsafe(32),
        ).start()
        self.scheme = "rediss" if tls else "redis"
        self._tunnel: TLSTunnel | None = None
        if tls is not None:
            try:
                self._tunnel = TLSTunnel(
                    host or "0.0.0.0", self.port, self._server.socket_path, tls
                ).start()
            except OSError:
                self._server.stop()
                raise
        self._admin = redis.Redis(
            unix_socket_path=str(self._server.socket_path),
            password=self._server.password,
            driver_info=None,
        )
        self._users: set[str] = set()
        self._generations: dict[str, int] = {}  # a user's password changes when they forget it

    def forget(self, user_id: str) -> None:
        """Drop ``user_id``'s ACL user and its connections; the next URL has a new password."""
        self._generations[user_id] = self._generations.get(user_id, 0) + 1
        self._users.discard(user_id)
        self._admin.acl_deluser("nimbus-" + key_prefix(user_id))  # closes its connections

    def store(self, user_id: str, advertised_host: str) -> dict[str, Any]:
        """Create (once) the ACL user of ``user_id``; its URL and key prefix."""
        prefix = key_prefix(user_id)
        name = "nimbus-" + prefix
        generation = self._generations.get(user_id, 0)
        password = hmac.new(
            self._secret, f"{user_id}:{generation}".encode(), hashlib.sha256
        ).hexdigest()
        if user_id not in self._users:
            pattern = "nimbus:{" + prefix + ".*"
            self._admin.acl_setuser(
                name,
                enabled=True,
                reset=True,
                passwords=["+" + password],
                keys=[pattern],
                reset_channels=True,
                channels=[pattern],
                commands=list(USER_RULES),
            )
            self._users.add(user_id)
        host = self.host if self.host not in WILDCARD_HOSTS else advertised_host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        url = f"{self.scheme}://{name}:{password}@{host}:{self.port}/0"
        return {"url": url, "key_prefix": prefix}

    def close(self) -> None:
        if self._tunnel is not None:
            self._tunnel.close()
        self._admin.close()
        self._server.stop()


_start_lock = threading.Lock()


def forget_users(state: Any, user_ids: set[str]) -> None:
    """After their tokens were revoked: the store URLs handed to these users stop working."""
    with _start_lock:
        server: StoreServer | None = getattr(state, "store_server", None)
        if server is not None:
            for user_id in user_ids:
                server.forget(user_id)


def _user_store(state: Any, settings: Settings, user_id: str, host: str) -> dict[str, Any]:
    """``user_id``'s store on the app's stores Redis, started on first use."""
    with _start_lock:
        server: StoreServer | None = getattr(state, "store_server", None)
        try:
            if server is None:
                server = state.store_server = StoreServer(settings, getattr(state, "tls", None))
            return server.store(user_id, host)
        except (OSError, redis.RedisError, StateStoreError) as exc:
            raise ServiceError(
                f"the service cannot run its state store on {settings.store_listen} ({exc}); "
                f"check NIMBUS_STORE_LISTEN on the service",
                503,
            ) from exc


@router.post("/endpoints/{endpoint_id}/store", tags=["endpoints"])
async def endpoint_store(
    endpoint_id: str, request: Request, user: User, ctx: Ctx
) -> dict[str, Any]:
    """A state store for your multiprocessing programs on this endpoint.

    Returns a Redis ``url`` (an ACL user limited to keys of program ids
    starting with ``key_prefix``), reachable by you and by the endpoint's
    workers, the endpoint's status (``online``, ``workers``) and whether it
    is ``yours`` (not one shared with you).
    """
    info = await ctx.endpoint(user, endpoint_id)
    status = await ctx.endpoint_status(info)
    advertised = request.url.hostname or "127.0.0.1"
    store = await run_in_threadpool(
        _user_store, request.app.state, ctx.settings, user.user_id, advertised
    )
    return {
        **store,
        **{k: status[k] for k in ("endpoint_id", "name", "online", "workers")},
        "yours": info.owner_id == user.user_id,
    }
