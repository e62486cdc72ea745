"""Environments: the software a worker runs in.

``_spec`` says what an environment is; ``_build`` makes one ready on a node
(:func:`prepare`) and says how a worker starts in it; ``_cache`` keeps what is
built on this node (:func:`cache`: list, remove, evict); ``_venv`` makes
virtualenvs (uv, else pip); ``_isolate`` wraps a worker in bubblewrap or podman;
``_report`` says what an endpoint's nodes hold (:func:`held`, from each manager's
:func:`pools`).
"""

from __future__ import annotations

from nimbus.environments._build import WORKER_VARIABLE, Prepared, cache, prepare, resolve
from nimbus.environments._cache import Cache, Entry
from nimbus.environments._report import cause, held, pools
from nimbus.environments._spec import PLAIN, Environment, as_environment
from nimbus.environments._venv import NODE_PATH

__all__ = [
    "NODE_PATH",
    "PLAIN",
    "WORKER_VARIABLE",
    "Cache",
    "Entry",
    "Environment",
    "Prepared",
    "as_environment",
    "cache",
    "cause",
    "held",
    "pools",
    "prepare",
    "resolve",
]
