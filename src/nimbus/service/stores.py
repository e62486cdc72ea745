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
starts a new stores Redis (the state of running programs is lost). So does
the death of the stores Redis: the next request for a store starts it again,
empty, with new passwords, so the programs that used it fail clearly (their
store is gone) instead of going on with an empty one.

A user runs only what nimbus's own calls need (``USER_COMMANDS``: the commands
``nimbus.multiprocessing`` sends, and those its Lua scripts call, which Redis
checks against the same ACL), and of scripts only nimbus's own: the admin loads
every :class:`nimbus.statestore.Script` at start, and the ACL allows
``EVALSHA`` with their SHA1s as first argument and no other (Redis 6.2, the
embedded binary, has no FUNCTIONs; a SHA1 names one script, and no user can
load or flush scripts). So no user can run a script of their own that stalls
everyone (``BUSY``), nor ``SCRIPT``, ``KEYS``, ``RANDOMKEY``, ``DBSIZE``,
``INFO``, ``MEMORY``, ``PUBSUB``, ``CONFIG``, ``FLUSH*``, ``DEBUG``, ``MONITOR``...
What a user can still learn of others: client names and addresses
(``CLIENT LIST``, which the locks use to tell whether a holder is alive) and
key *names* (``SCAN``, which the program's keepalive needs; Redis does not
filter it by ACL), never values: random program ids, and for
``nimbus.data.store()`` digests of the keys (``Keys.kv``), whose text is in a
set only its user reads (``Keys.kv_index``).

Limits: the store holds at most ``NIMBUS_STORE_MAXMEMORY`` bytes
(``maxmemory``, policy ``noeviction``: nothing is evicted under a running
program; once full, a command that writes fails with ``OOM``, raised as
:class:`~nimbus.errors.StateStoreError` by calls that wait for their reply,
while a send made without one, a Pipe's, is lost). Redis has no per-user
memory or key quota, so that limit is shared by all users; a program's keys
also expire ``NIMBUS_KEY_TTL`` after its last keepalive. A script running
longer than ``lua-time-limit`` (500 ms; nimbus's take microseconds) makes
others get ``BUSY`` until it ends.

A store URL stays valid while the service runs, until one of the user's own
tokens is revoked: then the ACL user is deleted (its connections closed, so
the user's running programs on endpoints lose their store) and the next URL
carries a new password. Revoking an endpoint's token leaves the store alone.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
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
from nimbus.statestore import EmbeddedRedis, Script, connect, scripts

__all__ = ["USER_COMMANDS", "StoreServer", "key_prefix", "router", "user_rules"]

router = APIRouter(prefix="/v1")
User = Annotated[Principal, Depends(current_user)]
Ctx = Annotated[ServiceContext, Depends(context)]

# What nimbus.multiprocessing runs on a program's store (through redis-py, its
# Links and its scripts); a user's ACL user may run these and nothing else.
USER_COMMANDS = (
    *("get", "set", "mget", "getrange", "setrange", "incr", "decr", "decrby"),
    *("del", "unlink", "exists", "pexpire", "pttl", "scan"),
    *("rpush", "lpush", "lpop", "blpop", "lmove", "blmove", "llen", "lindex", "lrange"),
    *("linsert", "lrem", "ltrim"),
    *("hset", "hget", "hgetall", "hlen", "hdel", "sadd", "srem", "smembers"),
    *("ping", "hello"),
    # a lock's holder is alive while its presence connection is (CLIENT LIST ID ...)
    *("client|id", "client|setname", "client|reply", "client|list"),
)
LUA_TIME_LIMIT_MS = 500
log = logging.getLogger(__name__)
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def key_prefix(user_id: str) -> str:
    """The start of every program id of ``user_id`` (a valid ``Keys`` program id part)."""
    return "u-" + user_id


def program_scripts() -> list[Script]:
    """The Lua scripts programs run on their store (``nimbus.statestore.lua``)."""
    return sorted(scripts(), key=lambda script: script.sha)


def user_rules() -> list[str]:
    """The ACL rules of a user (after ``reset``, which allows nothing)."""
    return [
        *("+" + command for command in USER_COMMANDS),
        *("+evalsha|" + script.sha for script in program_scripts()),
    ]


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
        self._secret = b""  # set by _prepare
        self._server = EmbeddedRedis(
            settings.ensure_runtime_dir(),
            tcp=None if tls else (host or "0.0.0.0", self.port),
            password=secrets.token_urlsafe(32),
            options=(
                *("--maxmemory", str(settings.store_maxmemory)),
                *("--maxmemory-policy", "noeviction"),
                *("--lua-time-limit", str(LUA_TIME_LIMIT_MS)),
            ),
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
        self._admin = connect(self._server.url, own=True, password=self._server.password)
        self._rules = user_rules()
        self._users: set[str] = set()
        self._generations: dict[str, int] = {}  # a user's password changes when they forget it
        self._prepare()

    def _prepare(self) -> None:
        """A new (or restarted, so empty) stores Redis: nimbus's scripts in it, no ACL
        users yet, and a new secret (URLs handed out before stop working)."""
        for script in program_scripts():  # users may run these, and cannot load any
            self._admin.script_load(script.source)
        self._secret = secrets.token_bytes(32)
        self._users.clear()

    @property
    def client(self) -> redis.Redis:
        """The admin's connection (the dashboard reads the programs' directories with it)."""
        return self._admin

    def revive(self) -> None:
        """Start the stores Redis again if it died: empty, with new passwords, so the
        programs that used it fail clearly (their store is gone) instead of finding it empty."""
        if self._server.alive():
            return
        log.error(
            "the state-store Redis for endpoint programs (pid %d) died; starting it again, "
            "empty: the programs using it lost their state",
            self._server.server_pid,
        )
        self._admin.connection_pool.disconnect()
        self._server.restart()
        self._prepare()

    def forget(self, user_id: str) -> None:
        """Drop ``user_id``'s ACL user and its connections; the next URL has a new password."""
        self.revive()
        self._generations[user_id] = self._generations.get(user_id, 0) + 1
        self._users.discard(user_id)
        self._admin.acl_deluser("nimbus-" + key_prefix(user_id))  # closes its connections

    def store(self, user_id: str, advertised_host: str) -> dict[str, Any]:
        """Create (once) the ACL user of ``user_id``; its URL and key prefix."""
        self.revive()
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
                commands=self._rules,
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
