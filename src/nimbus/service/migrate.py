"""The registry's columns added after its tables were first made.

``create_all`` makes missing tables, never missing columns: :func:`add_columns`
adds those of :data:`ADDED_COLUMNS` a database made by an older nimbus lacks.
Services starting together on one database may both find a column missing:
PostgreSQL adds it ``IF NOT EXISTS``; on SQLite the second one's "duplicate
column" is taken as the column being there, once the table says so.
"""

from __future__ import annotations

from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError

__all__ = ["ADDED_COLUMNS", "add_columns"]

# (table, column, SQL type) added after the table was first made
ADDED_COLUMNS = (("functions", "environment", "TEXT"),)


def add_columns(engine: Engine) -> None:
    """Add the columns of :data:`ADDED_COLUMNS` that ``engine``'s database lacks."""
    postgres = engine.dialect.name == "postgresql"
    for table, column, kind in ADDED_COLUMNS:
        if _has(engine, table, column):
            continue
        exists = " IF NOT EXISTS" if postgres else ""
        try:
            with engine.begin() as connection:
                connection.execute(text(f"ALTER TABLE {table} ADD COLUMN{exists} {column} {kind}"))
        except OperationalError:  # SQLite: another process added it meanwhile?
            if not _has(engine, table, column):
                raise


def _has(engine: Engine, table: str, column: str) -> bool:
    return column in {c["name"] for c in inspect(engine).get_columns(table)}
