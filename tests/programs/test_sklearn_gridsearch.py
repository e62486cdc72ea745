"""scikit-learn's GridSearchCV through the joblib backend that nimbus registers."""

from __future__ import annotations

import pytest

joblib = pytest.importorskip("joblib")
pytest.importorskip("sklearn")

from sklearn.datasets import load_iris  # noqa: E402
from sklearn.linear_model import RidgeClassifier  # noqa: E402
from sklearn.model_selection import GridSearchCV  # noqa: E402
from sklearn.svm import SVC  # noqa: E402

import nimbus.joblib  # noqa: E402
from nimbus.joblib import register_joblib  # noqa: E402

GRIDS = [
    (SVC(), {"C": [0.1, 1.0, 10.0], "kernel": ["linear", "rbf"]}),
    (RidgeClassifier(), {"alpha": [0.01, 0.1, 1.0, 10.0]}),
]


def _fit(estimator, grid, n_jobs):
    X, y = load_iris(return_X_y=True)
    return GridSearchCV(estimator, grid, cv=3, n_jobs=n_jobs).fit(X, y)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("estimator", "grid"), GRIDS, ids=["svc", "ridge"])
def test_grid_search_on_nimbus_equals_sequential(
    estimator, grid, monkeypatch: pytest.MonkeyPatch
) -> None:
    register_joblib()
    backend = nimbus.joblib.NimbusBackend
    pools = []
    configure = backend.configure

    def spy(self, *args, **kwargs):
        n_jobs = configure(self, *args, **kwargs)
        pools.append((type(self._pool).__module__, n_jobs))
        return n_jobs

    monkeypatch.setattr(backend, "configure", spy)
    sequential = _fit(estimator, grid, n_jobs=1)
    assert pools == []
    with joblib.parallel_backend("nimbus"):
        parallel = _fit(estimator, grid, n_jobs=2)
    # the search ran on a two-process nimbus Pool
    assert pools == [("nimbus.multiprocessing.pool", 2)]

    assert parallel.best_params_ == sequential.best_params_
    assert parallel.best_score_ == sequential.best_score_
    for key in ("mean_test_score", "std_test_score", "rank_test_score"):
        assert list(parallel.cv_results_[key]) == list(sequential.cv_results_[key]), key
    assert list(parallel.cv_results_["params"]) == list(sequential.cv_results_["params"])


@pytest.mark.timeout(60)
def test_joblib_parallel_on_nimbus_runs_in_other_processes() -> None:
    import os

    register_joblib()
    with joblib.parallel_backend("nimbus", n_jobs=2):
        pids = joblib.Parallel(batch_size=1)(joblib.delayed(os.getpid)() for _ in range(8))
        squares = joblib.Parallel()(joblib.delayed(pow)(i, 2) for i in range(100))
    assert os.getpid() not in pids
    assert squares == [i * i for i in range(100)]


def test_missing_joblib_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "joblib", None)  # import joblib -> ImportError
    with pytest.raises(ImportError, match="pip install joblib"):
        register_joblib()
