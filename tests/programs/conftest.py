"""Shared fixtures for the real-program tests: a nimbus Pool."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def nimbus_pool() -> Iterator[Any]:
    """A two-process ``nimbus.multiprocessing.Pool``, closed and joined afterwards."""
    import nimbus.multiprocessing as nmp

    pool = nmp.Pool(2)
    try:
        yield pool
    finally:
        pool.close()
        pool.join()
