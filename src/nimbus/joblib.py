"""A joblib parallel backend that runs joblib's batches on a nimbus ``Pool``.

::

    import joblib
    from nimbus.joblib import register_joblib

    register_joblib()
    with joblib.parallel_backend("nimbus"):
        GridSearchCV(estimator, grid, n_jobs=4).fit(X, y)

Any code that parallelises through joblib (scikit-learn, ...) then runs its
batches in ``nimbus.multiprocessing.Pool`` processes, the way Lithops and
Ray register theirs. The backend is joblib's own multiprocessing backend
(auto-batching, callbacks, abort) with the pool swapped for nimbus's; the
memmapping options (``max_nbytes``, ``mmap_mode``, ``temp_folder``) do not
apply, since arguments travel through the state store. ``initializer``,
``initargs`` and ``maxtasksperchild`` given to ``parallel_backend("nimbus",
...)`` reach the pool. joblib is imported on first use: nimbus does not
depend on it.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["BACKEND_NAME", "register_joblib"]  # and NimbusBackend, built on first use

BACKEND_NAME = "nimbus"

# the pool's own keyword arguments; joblib's other backend kwargs are ignored
_POOL_KWARGS = ("initializer", "initargs", "maxtasksperchild")

_backend_class: type[Any] | None = None


def _import_joblib() -> Any:
    try:
        return importlib.import_module("joblib")
    except ImportError as exc:
        raise ImportError(
            "the nimbus joblib backend needs joblib: pip install joblib "
            "(or pip install scikit-learn, which brings it)"
        ) from exc


def _make_backend_class() -> type[Any]:
    joblib = _import_joblib()
    backends = importlib.import_module("joblib._parallel_backends")
    base: type[Any] = backends.MultiprocessingBackend
    fallback: type[Exception] = backends.FallbackToBackend
    sequential: type[Any] = backends.SequentialBackend
    del joblib

    class NimbusBackend(base):
        """joblib's ``MultiprocessingBackend`` on a ``nimbus.multiprocessing.Pool``."""

        supports_retrieve_callback = True
        supports_return_generator = False
        supports_sharedmem = False
        uses_threads = False

        def effective_n_jobs(self, n_jobs: int | None) -> int:
            if n_jobs == 0:
                raise ValueError("n_jobs == 0 in Parallel has no meaning")
            if n_jobs is None:
                return 1
            if n_jobs < 0:
                import nimbus.multiprocessing

                n_jobs = max(nimbus.multiprocessing.cpu_count() + 1 + n_jobs, 1)
            # joblib's checks: no nested process pools inside daemonic pool
            # processes or below threads (they fall back to one job)
            checked: int = super().effective_n_jobs(n_jobs)
            return checked

        def configure(
            self,
            n_jobs: int = 1,
            parallel: Any = None,
            prefer: str | None = None,
            require: str | None = None,
            **backend_kwargs: Any,
        ) -> int:
            """Start the nimbus pool and return the number of workers."""
            import nimbus.multiprocessing
            from nimbus.multiprocessing.pool import Pool

            n_jobs = self.effective_n_jobs(n_jobs)
            if n_jobs == 1:
                raise fallback(sequential(nesting_level=self.nesting_level))
            options = {**self.backend_kwargs, **backend_kwargs}
            pool_kwargs = {key: options[key] for key in _POOL_KWARGS if key in options}
            self._pool = Pool(n_jobs, context=nimbus.multiprocessing.get_context(), **pool_kwargs)
            self.parallel = parallel
            return n_jobs

    # pickled by reference as nimbus.joblib.NimbusBackend (found by __getattr__)
    NimbusBackend.__module__ = __name__
    NimbusBackend.__qualname__ = "NimbusBackend"
    return NimbusBackend


def _backend() -> type[Any]:
    global _backend_class
    if _backend_class is None:
        _backend_class = _make_backend_class()
    return _backend_class


def register_joblib(make_default: bool = False) -> None:
    """Register the ``"nimbus"`` backend with joblib (idempotent).

    ``make_default=True`` makes every ``joblib.Parallel`` without an explicit
    backend use nimbus.
    """
    joblib = _import_joblib()
    joblib.register_parallel_backend(BACKEND_NAME, _backend(), make_default=make_default)


def __getattr__(name: str) -> Any:
    # ``from nimbus.joblib import NimbusBackend``: built (and joblib imported) on first use
    if name == "NimbusBackend":
        return _backend()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
