"""``nimbus.service.registry``: a function's environment kept in the registry (SQLite and
PostgreSQL), and the column added to an older registry once (``nimbus.service.migrate``)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from nimbus import Environment
from service_support import postgres_cluster


@pytest.fixture(params=["sqlite", "postgresql"])
def registry_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A registry database of each kind: a SQLite file, a private PostgreSQL cluster."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'registry.db'}"
        return
    with postgres_cluster() as pg:
        yield pg.url


def test_the_registry_keeps_a_functions_environment_and_adds_the_column_to_an_old_one(
    registry_url: str,
) -> None:
    from sqlalchemy import text

    from nimbus.service.registry import Registry

    old = Registry(registry_url)  # as an older nimbus made it: no environment column
    with old.engine.begin() as db:
        db.execute(text("ALTER TABLE functions DROP COLUMN environment"))
    old.create_user_token("ada")
    ada = old.user_ids(["ada"])["ada"]
    with old.engine.begin() as db:
        db.execute(
            text(
                "INSERT INTO functions (id, owner_id, name, digest, body, python, serializer,"
                " public, created) VALUES ('f-old', :ada, 'old', :digest, :body, '3.11', 's',"
                " false, 1.0)"
            ),
            {"ada": ada, "digest": hashlib.sha256(b"old").hexdigest(), "body": b"old"},
        )
    old.close()
    registry = Registry(registry_url)  # adds the column; the old row has none
    try:
        info = registry.function("f-old")
        assert info is not None and info.environment is None
        geo = Environment("geo", requirements=["six"], sandbox=True).to_dict()
        fid = registry.add_function(ada, "f", b"body", "3.11", "s", environment=geo)
        stored = registry.function(fid)
        assert stored is not None and stored.environment == geo
        assert stored.as_dict()["environment"] == geo
        same = dict(reversed(list(geo.items())))  # the same spec, keys in another order
        assert registry.add_function(ada, "f", b"body", "3.11", "s", environment=same) == fid
        assert registry.add_function(ada, "f", b"body", "3.11", "s") == fid  # found, as is
        box = Environment("box", image="localhost/x:1").to_dict()
        other = registry.add_function(ada, "f", b"body", "3.11", "s", environment=box)
        assert other != fid and registry.function(fid).environment == geo  # type: ignore[union-attr]
        assert registry.add_function(ada, "f", b"body", "3.11", "s") == other
        # a wrapper of those bytes (an executor's scope): their latest registration's
        wrapper = registry.add_function(
            ada, "w", b"wrapper", "3.11", "s", wraps=hashlib.sha256(b"body").hexdigest()
        )
        assert registry.function(wrapper).environment == box  # type: ignore[union-attr]
        plain = registry.add_function(ada, "w", b"w2", "3.11", "s", wraps="0" * 64)
        assert registry.function(plain).environment is None  # type: ignore[union-attr]
        assert registry.add_function(ada, "f", b"old", "3.11", "s") == "f-old"
    finally:
        registry.close()


def test_services_starting_together_add_a_missing_column_once(registry_url: str) -> None:
    """Two services on one database both find the column missing: neither fails."""
    from sqlalchemy import text

    from nimbus.service.migrate import add_columns
    from nimbus.service.registry import Registry

    first, second = Registry(registry_url), Registry(registry_url)
    try:
        for _ in range(5):
            with first.engine.begin() as db:
                db.execute(text("ALTER TABLE functions DROP COLUMN environment"))
            barrier = threading.Barrier(2)
            failed: list[BaseException] = []

            def start(
                registry: Registry, barrier: threading.Barrier, failed: list[BaseException]
            ) -> None:
                barrier.wait()
                try:
                    add_columns(registry.engine)
                except BaseException as exc:
                    failed.append(exc)

            threads = [
                threading.Thread(target=start, args=(r, barrier, failed)) for r in (first, second)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert failed == []
            first.create_user_token("ada")  # the table works with its column
            ada = first.user_ids(["ada"])["ada"]
            geo = Environment("geo").to_dict()
            fid = second.add_function(ada, "f", b"body", "3.11", "s", environment=geo)
            assert first.function(fid).environment == geo  # type: ignore[union-attr]
            with first.engine.begin() as db:
                db.execute(text("DELETE FROM functions"))
    finally:
        first.close()
        second.close()
