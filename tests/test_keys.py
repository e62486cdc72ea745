from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest
import redis

from nimbus.errors import ConfigError
from nimbus.statestore import EmbeddedRedis, Keys


def _all_keys(keys: Keys) -> list[str]:
    return [
        keys.queue("q"),
        keys.lock("q"),
        keys.semaphore("q"),
        keys.event("q"),
        keys.condition("q"),
        keys.barrier("q"),
        keys.value("q"),
        keys.array("q"),
        keys.pipe("q", 0),
        keys.pipe("q", 1),
        keys.pipe_refs("q", 1),
        keys.pipe_holder("q", 1),
        keys.pipe_writer("q", 1),
        keys.pipe_mode("q", 1),
        keys.pipe_writer_users("q", 1),
        keys.giveup("i"),
        keys.dict("q"),
        keys.list("q"),
        keys.refcount("q"),
        keys.instance("i"),
        keys.directory(),
        keys.inbox("i"),
        keys.messaging_token(),
        keys.task("t"),
        keys.endpoint_queue("e"),
        keys.endpoint_inflight("e"),
        keys.endpoint_status("e"),
        keys.user_tasks("u"),
        keys.group("g"),
        keys.data("d"),
    ]


def test_layout() -> None:
    keys = Keys("abc")
    assert keys.queue("jobs") == "nimbus:{abc}:queue:jobs"
    assert keys.pipe("p", 1) == "nimbus:{abc}:pipe:p:1"
    assert keys.directory() == "nimbus:{abc}:directory"
    assert keys.pattern() == "nimbus:{abc}:*"
    # the layout of the keys that used to be built beside keys.py (kept: live programs)
    assert keys.pipe_writer_users("p", 0) == "nimbus:{abc}:pipe:p:0:writer:users"
    assert keys.giveup("i") == "nimbus:{abc}:queue:i:giveup"


def test_every_key_is_built_here() -> None:
    """No module builds a store key by extending another key's string."""
    src = Path(__file__).resolve().parent.parent / "src" / "nimbus"
    for path in src.rglob("*.py"):
        text = path.read_text()
        assert ':users"' not in text, path
        assert 'queue_field(instance, "giveup")' not in text, path


def test_kinds_never_collide() -> None:
    made = _all_keys(Keys("abc"))
    assert len(set(made)) == len(made)


def test_two_programs_differ_and_match_only_their_own_pattern() -> None:
    a, b = Keys(Keys.program_id_new()), Keys(Keys.program_id_new())
    assert a.program_id != b.program_id
    for key in _all_keys(a):
        assert fnmatch.fnmatchcase(key, a.pattern())
        assert not fnmatch.fnmatchcase(key, b.pattern())
    assert not set(_all_keys(a)) & set(_all_keys(b))
    # an id that is a prefix of another still does not match it
    assert not fnmatch.fnmatchcase(Keys("ab1").queue("q"), Keys("ab").pattern())


def test_pattern_against_real_redis_scan(tmp_path: Path) -> None:
    a, b = Keys("p1"), Keys("p10")
    with EmbeddedRedis(tmp_path) as server, redis.Redis.from_url(server.url) as client:
        for key in _all_keys(a) + _all_keys(b):
            client.set(key, b"x")
        found = {k.decode() for k in client.scan_iter(match=a.pattern())}
    assert found == set(_all_keys(a))


def test_new_names_are_unique_and_short() -> None:
    names = {Keys.new_name() for _ in range(1000)}
    assert len(names) == 1000
    assert all(len(n) == 16 for n in names)


@pytest.mark.parametrize("bad", ["", "a:b", "a*", "{x}", "a b"])
def test_bad_program_id(bad: str) -> None:
    with pytest.raises(ConfigError):
        Keys(bad)
