"""emcee with a multiprocessing Pool, scipy's differential_evolution(workers=2),
scikit-learn's GridSearchCV(n_jobs=2) on joblib's multiprocessing backend, and
joblib's default backend (loky): cross_val_score(n_jobs=2) and a Parallel(n_jobs=2)."""

import multiprocessing
import sys

import numpy as np


def log_prob(x):
    return -0.5 * np.sum(x**2)


def rosen(x):
    return sum(100.0 * (x[1:] - x[:-1] ** 2.0) ** 2.0 + (1 - x[:-1]) ** 2.0)


def emcee_run():
    import emcee

    with multiprocessing.Pool(2) as pool:
        sampler = emcee.EnsembleSampler(8, 2, log_prob, pool=pool)
        sampler.random_state = np.random.RandomState(42).get_state()
        sampler.run_mcmc(np.random.RandomState(7).randn(8, 2), 40, progress=False)
    print("emcee", np.round(sampler.get_chain()[-1].sum(), 8), sampler.acceptance_fraction.sum())


def scipy_run():
    from scipy.optimize import differential_evolution

    result = differential_evolution(
        rosen, [(-2, 2)] * 3, workers=2, updating="deferred", seed=3, maxiter=30, polish=False
    )
    print("scipy", np.round(result.x, 8).tolist(), result.nfev)


def sklearn_run():
    import joblib
    from sklearn.datasets import load_iris
    from sklearn.model_selection import GridSearchCV
    from sklearn.svm import SVC

    X, y = load_iris(return_X_y=True)
    with joblib.parallel_backend("multiprocessing", n_jobs=2):
        search = GridSearchCV(SVC(), {"C": [0.1, 1, 10], "kernel": ["linear", "rbf"]}, cv=3)
        search.fit(X, y)
    print("sklearn", search.best_params_, round(search.best_score_, 8))


def cube(x):
    return x**3


def loky_run():
    from joblib import Parallel, delayed
    from sklearn.datasets import load_iris
    from sklearn.model_selection import cross_val_score
    from sklearn.tree import DecisionTreeClassifier

    print("multiprocessing is", multiprocessing.__name__, file=sys.stderr)
    X, y = load_iris(return_X_y=True)
    scores = cross_val_score(DecisionTreeClassifier(random_state=0), X, y, cv=3, n_jobs=2)
    print("loky sklearn", np.round(scores, 8).tolist())
    print("loky joblib", Parallel(n_jobs=2)(delayed(cube)(i) for i in range(6)))


if __name__ == "__main__":
    runs = {"emcee": emcee_run, "scipy": scipy_run, "sklearn": sklearn_run, "loky": loky_run}
    runs[sys.argv[1]]()
