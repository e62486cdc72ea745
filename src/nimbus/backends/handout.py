"""The state store the service hands out for a program on an endpoint.

::

    nimbus.multiprocessing with NIMBUS_ENDPOINT --> open_store(settings)
        --> GET the endpoint's store from the service (Client.store): its URL, as an
            ACL user of this user's, and the start of this user's program ids
        --> probe_store: PING it from here (the endpoint's workers reach it too)
    an Executor on an endpoint --> hand_out(its client, endpoint): its tasks' program

A program on an endpoint keeps its state (queues, pipes, locks) in that store;
this module is the service's side of handing it out, for the service backend.
"""

from __future__ import annotations

from typing import NamedTuple

import redis

from nimbus.client import Client
from nimbus.config import Settings, untrusted_certificate
from nimbus.errors import ConfigError, NotFound, ServiceUnavailable, StateStoreError
from nimbus.statestore import connect, redacted

__all__ = ["Store", "hand_out", "open_store", "probe_store"]


class Store(NamedTuple):
    """What the service handed out for a program on an endpoint."""

    url: str  # the state store, as an ACL user of this user's
    key_prefix: str  # the start of this user's program ids
    yours: bool  # the endpoint is this user's own, not one shared with them
    workers: int  # the endpoint's workers (its cpu_count)
    endpoint_id: str  # the endpoint's id


def open_store(settings: Settings) -> Store:
    """The store the service hands out for programs on ``settings.endpoint``, probed."""
    endpoint = settings.endpoint
    assert endpoint
    try:
        client = Client(settings=settings)
    except ConfigError as exc:
        raise ConfigError(
            f"NIMBUS_ENDPOINT={endpoint} runs nimbus.multiprocessing on that endpoint "
            f"through the nimbus service: {exc}; or unset NIMBUS_ENDPOINT to run locally"
        ) from None
    with client:
        return hand_out(client, endpoint, f"NIMBUS_ENDPOINT={endpoint}")


def hand_out(client: Client, endpoint: str, who: str = "", *, probe: bool = True) -> Store:
    """The store the service of ``client`` hands out for ``endpoint``, probed unless
    ``probe`` is false (``who``: what asked for it, named in the errors)."""
    who = who or f"endpoint {endpoint!r}"
    try:
        store = client.store(endpoint)
    except NotFound:
        raise NotFound(
            f"{who}: no endpoint of that name is visible to you "
            f"on {client.service_url}; `nimbus endpoints list` shows those you can use",
            404,
        ) from None
    if not store["online"]:
        raise ServiceUnavailable(
            f"endpoint {endpoint!r} is offline (no agent connected to {client.service_url}): "
            f"start it with `nimbus endpoint start {endpoint}` on its machine, or unset "
            f"NIMBUS_ENDPOINT to run locally"
        )
    url = str(store["url"])
    if probe:
        probe_store(url, endpoint)
    return Store(
        url,
        str(store["key_prefix"]),
        bool(store["yours"]),
        int(store["workers"]),
        str(store["endpoint_id"]),
    )


def probe_store(url: str, endpoint: str) -> None:
    """PING the store handed out for ``endpoint``; a clear error when it does not answer."""
    try:
        with connect(url, own=True, timeout=5) as client:
            client.ping()
    except redis.RedisError as exc:
        untrusted = untrusted_certificate(exc, f"the state store at {redacted(url)}")
        if untrusted is not None:
            raise untrusted from None
        raise StateStoreError(
            f"cannot reach the state store the service handed out for endpoint {endpoint!r} "
            f"at {redacted(url)} ({redacted(str(exc))}); this machine and the endpoint's "
            f"workers must both reach it: set NIMBUS_STORE_LISTEN on the service to an address "
            f"both can reach"
        ) from None
