"""emcee's EnsembleSampler with a nimbus Pool: the chain equals the sequential one."""

from __future__ import annotations

from typing import Any

import pytest

np = pytest.importorskip("numpy")
emcee = pytest.importorskip("emcee")

NDIM, NWALKERS, NSTEPS = 3, 10, 60
MEAN = np.array([1.0, -2.0, 0.5])
INV_COV = np.linalg.inv(np.diag([1.0, 0.5, 2.0]))


def log_prob(x: Any, mean: Any, inv_cov: Any) -> float:
    diff = x - mean
    return float(-0.5 * diff @ inv_cov @ diff)


def _sample(pool: Any) -> Any:
    start = np.random.RandomState(7).randn(NWALKERS, NDIM)
    sampler = emcee.EnsembleSampler(NWALKERS, NDIM, log_prob, args=(MEAN, INV_COV), pool=pool)
    sampler.random_state = np.random.RandomState(42).get_state()
    sampler.run_mcmc(start, NSTEPS, progress=False)
    return sampler


@pytest.mark.timeout(60)
def test_chain_with_nimbus_pool_equals_sequential(nimbus_pool: Any) -> None:
    sequential = _sample(None)
    parallel = _sample(nimbus_pool)
    np.testing.assert_array_equal(parallel.get_chain(), sequential.get_chain())
    np.testing.assert_array_equal(parallel.get_log_prob(), sequential.get_log_prob())
    np.testing.assert_array_equal(parallel.acceptance_fraction, sequential.acceptance_fraction)
