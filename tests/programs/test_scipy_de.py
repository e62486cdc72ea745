"""scipy.optimize.differential_evolution with a nimbus Pool's map as its workers."""

from __future__ import annotations

from typing import Any

import pytest

np = pytest.importorskip("numpy")
optimize = pytest.importorskip("scipy.optimize")

BOUNDS = [(-2.0, 2.0)] * 3


def _solve(workers: Any) -> Any:
    return optimize.differential_evolution(
        optimize.rosen,
        BOUNDS,
        workers=workers,
        updating="deferred",
        seed=1234,
        maxiter=60,
        popsize=10,
        tol=1e-8,
        polish=False,
    )


@pytest.mark.timeout(60)
def test_differential_evolution_with_nimbus_pool_equals_sequential(nimbus_pool: Any) -> None:
    sequential = _solve(1)
    parallel = _solve(nimbus_pool.map)
    np.testing.assert_array_equal(parallel.x, sequential.x)
    assert parallel.fun == sequential.fun
    assert parallel.nfev == sequential.nfev
    assert parallel.nit == sequential.nit
    np.testing.assert_array_equal(parallel.population, sequential.population)
