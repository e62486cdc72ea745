"""``nimbus.data.store()``'s two stores (``nimbus.data._kv``) on their own: an endpoint's
(the service's real stores Redis, as a user's ACL user) and a node's (files). Their use
from tasks on endpoints is in tests/test_data.py (``users_there``, ``full_endpoint``)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nimbus.config import Settings
from nimbus.data import EndpointKeyValue, NodeKeyValue
from nimbus.errors import DataError
from nimbus.service.dashboard._directory import _pattern, directories
from nimbus.service.stores import StoreServer
from nimbus.statestore import Keys, connect
from service_support import free_port

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
    return EndpointKeyValue(connect(url, own=True), Keys(f"u-{user}.kv-ep"), "ep", user)


def test_a_value_over_redis_limit_is_refused_before_it_is_sent(stores: StoreServer) -> None:
    """Redis takes 512 MiB in one value: a larger one is refused naming the limit and
    nimbus.put, at once (it reset the connection halfway through the send, a DataError
    of 'Connection reset by peer'), and the store goes on."""
    kv = endpoint_kv(stores.store("hal", "127.0.0.1")["url"], "hal")
    try:
        huge = bytes(512 * MB + 1)  # (calloc'd: its pages are never touched)
        start = time.monotonic()
        with pytest.raises(DataError, match=r"cannot set 'big'.* over the 512 MiB.*nimbus\.put"):
            kv.set("big", huge)
        assert time.monotonic() - start < 1.0
        kv["small"] = "fits"
        assert kv["small"] == "fits" and "big" not in kv
    finally:
        kv._client.close()


def test_a_store_that_cannot_be_used_says_why_and_what_to_do(stores: StoreServer) -> None:
    """Its ACL user gone (a token of the user revoked): the DataError says so; a key or
    command its ACL refuses: it names the versions; no store listening where the URL
    says: it names NIMBUS_STORE_LISTEN."""
    kv = endpoint_kv(stores.store("ida", "127.0.0.1")["url"], "ida")
    try:
        kv["k"] = 1
        stores.forget("ida")
        with pytest.raises(DataError, match=r"could not get 'k'.*revoked.*new Executor"):
            kv.get("k")
    finally:
        kv._client.close()
    url = stores.store("ida", "127.0.0.1")["url"]
    theirs = EndpointKeyValue(connect(url, own=True), Keys("u-ivy.kv-ep"), "ep", "ida")
    try:  # (a row that names another user's prefix; or a service of another version)
        with pytest.raises(DataError, match=r"could not get 'k'.*ACL.*service's nimbus version"):
            theirs.get("k")
    finally:
        theirs._client.close()
    nowhere = endpoint_kv(f"redis://127.0.0.1:{free_port()}/0", "ida")
    try:
        with pytest.raises(DataError, match=r"could not set 'k'.*NIMBUS_STORE_LISTEN"):
            nowhere["k"] = 1
    finally:
        nowhere._client.close()


def test_a_users_keys_named_like_a_directory_leave_the_dashboards_page_alone(
    stores: StoreServer,
) -> None:
    """A user's own keys (their URL reaches any key under their prefix) that the directory
    page's glob nimbus:{u-<user>.*}:directory matches, not a hash: their HLEN (WRONGTYPE)
    made the page a 503, the admin's (every user's programs) too. (A key of
    nimbus.data.store() "x}:directory" was one such, before its names were digests.)"""
    kv = endpoint_kv(stores.store("joe", "127.0.0.1")["url"], "joe")
    try:
        kv._client.set("nimbus:{u-joe.kv-ep}:kv:x}:directory", 1)
        kv._client.set("nimbus:{u-joe.1234}:directory", 1)
        for admin in (False, True):
            programs, _ = directories(stores.client, _pattern("joe", admin))
            assert not [p.program_id for p in programs if p.program_id.startswith("u-joe")]
    finally:
        kv._client.close()


def test_other_users_see_no_key_of_a_users_store(stores: StoreServer) -> None:
    """Every user may SCAN the stores Redis (a program's keepalive does) and so see every
    key's name: a key of nimbus.data.store() is named by its digest, and its text is only
    in the user's index, which the ACL keeps to them (its name was the key's text)."""
    kv = endpoint_kv(stores.store("oli", "127.0.0.1")["url"], "oli")
    other = connect(stores.store("pam", "127.0.0.1")["url"], own=True)
    try:
        kv["patient-0042-diagnosis"] = "private"
        names = list(other.scan_iter(match="*", count=1000))
        assert names and not [name for name in names if b"patient" in name]
        assert list(kv.keys()) == ["patient-0042-diagnosis"]
    finally:
        kv._client.close()
        other.close()


def _read_bytes() -> int:
    """Bytes this process read so far (read(2) and friends: /proc/self/io's rchar)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_a_node_stores_keys_and_membership_read_no_values(tmp_path: Path) -> None:
    """``in`` and keys() read a key's head (its expiry), not its value: they read the
    whole file, 64 MB here, each time."""
    kv = NodeKeyValue(tmp_path / "kv")
    kv.set("big", b"v" * (64 * MB), ttl=60)
    before = _read_bytes()
    assert "big" in kv and list(kv.keys()) == ["big"]
    assert _read_bytes() - before < MB
    assert kv["big"] == b"v" * (64 * MB)


def test_a_node_stores_expired_key_was_not_there(tmp_path: Path) -> None:
    """delete() of a key whose life ended says it was not there (as Redis does), read or
    not; it said True until a read had unlinked the file."""
    kv = NodeKeyValue(tmp_path / "kv")
    kv.set("k", 1, ttl=0.05)
    time.sleep(0.1)
    assert not kv.delete("k") and not any(p.name[0] != "." for p in kv.dir.iterdir())


def test_reading_an_expired_key_leaves_a_value_set_meanwhile(tmp_path: Path) -> None:
    """A reader that found the key expired unlinks it only if it is still the file it read:
    it unlinked whatever had been renamed in meanwhile, a value set for a minute."""
    kv = NodeKeyValue(tmp_path / "kv")
    old = bytes(64 * MB)
    lost = []
    for i in range(8):
        kv.set("k", old, ttl=0.001)
        time.sleep(0.01)  # (expired)
        reader = threading.Thread(target=kv.get, args=("k",))
        reader.start()
        time.sleep(0.002)  # (the reader opened the old file and reads it)
        kv.set("k", i, ttl=60)
        reader.join()
        if kv.get("k", "gone") != i:
            lost.append(i)
    assert not lost, f"values set while an expired one was read were lost: {lost}"


def test_a_keys_ttl_is_a_number_both_stores_take(tmp_path: Path, stores: StoreServer) -> None:
    """True (a bool), NaN, and lives Redis refuses (PX over 2**63 ms: a Redis error that
    named no ttl, while the node store took them) are refused by both stores alike."""
    node = NodeKeyValue(tmp_path / "kv")
    endpoint = endpoint_kv(stores.store("kim", "127.0.0.1")["url"], "kim")
    try:
        for kv in (node, endpoint):
            for bad in (True, math.nan, 0, -1.0, 1e300, 10**400, "1"):
                with pytest.raises(DataError, match="ttl"):
                    kv.set("k", 1, ttl=bad)  # type: ignore[arg-type]
            kv.set("k", 1, ttl=1e9)  # about 30 years
            assert kv["k"] == 1
    finally:
        endpoint._client.close()


def test_both_stores_iterate_and_del_as_a_dict_does(tmp_path: Path, stores: StoreServer) -> None:
    """``for key in kv`` and ``del kv[key]``: a TypeError each (Python's old iteration
    protocol called kv[0], "a key ... is a str, not int"; no __delitem__)."""
    node = NodeKeyValue(tmp_path / "kv")
    endpoint = endpoint_kv(stores.store("lea", "127.0.0.1")["url"], "lea")
    try:
        for kv in (node, endpoint):
            kv["a"], kv["b"] = 1, 2
            assert sorted(kv) == ["a", "b"]
            del kv["a"]
            assert sorted(kv) == ["b"] and "a" not in kv
            with pytest.raises(KeyError):
                del kv["a"]
    finally:
        endpoint._client.close()


def _commands(server: StoreServer) -> int:
    """Commands the stores Redis ran so far (INFO's total_commands_processed)."""
    return int(server.client.info("stats")["total_commands_processed"])


def test_an_endpoint_stores_keys_cost_its_own_keys_not_the_whole_store(
    stores: StoreServer,
) -> None:
    """keys() reads the user's index on that endpoint, not a SCAN of the store every user
    shares: 100,000 keys of others cost it nothing (they cost ~100 SCANs, 0.15 s here for
    400,000 and a round trip each); a key that expired is struck off the index, and the
    index lives as long as its longest-lived key."""
    admin = stores.client
    pipe = admin.pipeline(transaction=False)
    for i in range(100_000):
        pipe.set(f"nimbus:{{u-others.{i // 100}}}:queue:{i}", b"x", px=60_000)
    pipe.execute()
    kv = endpoint_kv(stores.store("max", "127.0.0.1")["url"], "max")
    try:
        for i in range(10):
            kv.set(f"k{i}", i, ttl=60)
        kv.set("brief", 0, ttl=0.05)
        time.sleep(0.1)
        before = _commands(stores)
        assert sorted(kv.keys()) == [f"k{i}" for i in range(10)]
        assert _commands(stores) - before < 30  # (1 SMEMBERS, 11 EXISTS, 1 SREM, INFO)
        index = Keys("u-max.kv-ep").kv_index()
        assert b"brief" not in admin.smembers(index) and admin.pttl(index) > 50_000
        for i in range(10):
            kv.delete(f"k{i}")
        assert list(kv.keys()) == [] and admin.exists(index) == 0
        kv.set("short", 1, ttl=0.05)
        time.sleep(0.1)
        assert admin.exists(index) == 0  # (gone with its last key)
    finally:
        kv._client.close()
        admin.flushdb()


def test_a_large_value_refused_by_a_full_store_is_not_made_into_text(tmp_path: Path) -> None:
    """The set is one pipeline (the value, then its key listed): Redis's OOM comes back as
    Redis said it, not in redis-py's message of a failed pipeline command, which holds
    the command made into text (4 s a 50 MB value, here, then cut to 100 characters)."""
    server = StoreServer(Settings(runtime_dir=tmp_path / "rt", store_maxmemory=16 * MB))
    kv = endpoint_kv(server.store("ned", "127.0.0.1")["url"], "ned")
    try:
        with pytest.raises(DataError, match="NIMBUS_STORE_MAXMEMORY"):
            for i in range(64):  # 32 MiB into 16
                kv.set(f"k{i}", b"m" * (512 << 10))
        with pytest.raises(DataError, match="NIMBUS_STORE_MAXMEMORY") as raised:
            kv.set("big", b"m" * (32 * MB))
        assert "pipeline" not in str(raised.value) and len(str(raised.value)) < 1000
    finally:
        kv._client.close()
        server.close()
