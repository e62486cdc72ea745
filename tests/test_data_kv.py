"""``nimbus.data.store()``'s two stores (``nimbus.data._kv``) on their own: an endpoint's
(the service's real stores Redis, as a user's ACL user) and a node's (files). Their use
from tasks on endpoints is in tests/test_data.py (``users_there``, ``full_endpoint``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from nimbus.config import Settings
from nimbus.data import EndpointKeyValue
from nimbus.service.dashboard._directory import _pattern, directories
from nimbus.service.stores import StoreServer
from nimbus.statestore import Keys, connect

MB = 1 << 20


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreServer]:
    runtime = tmp_path_factory.mktemp("rt")
    server = StoreServer(Settings(runtime_dir=runtime, store_maxmemory=256 * MB))
    yield server
    server.close()


def endpoint_kv(url: str, user: str) -> EndpointKeyValue:
    """``user``'s store on endpoint "ep" at ``url``, on a client of its own (closed by the
    caller: ``kv._client.close()``)."""
    return EndpointKeyValue(connect(url, own=True), Keys(f"u-{user}.kv-ep").kv(), "ep", user)


def test_a_users_key_named_like_a_directory_leaves_the_dashboards_page_alone(
    stores: StoreServer,
) -> None:
    """A key "x}:directory" is nimbus:{u-<user>.kv-ep}:kv:x}:directory, which the directory
    page's glob nimbus:{u-<user>.*}:directory matches: its HLEN (WRONGTYPE) made the page
    a 503, the admin's (every user's programs) too."""
    kv = endpoint_kv(stores.store("joe", "127.0.0.1")["url"], "joe")
    try:
        kv["x}:directory"] = 1
        for admin in (False, True):
            programs, _ = directories(stores.client, _pattern("joe", admin))
            assert all("kv" not in program.program_id for program in programs)
    finally:
        kv._client.close()
