"""Providers: where an endpoint's nodes come from (see ``_base`` for the interface).

:data:`PROVIDERS` is the explicit registry, by the ``provider`` setting's
value. Factories take keyword settings (``partition``, ``walltime``,
``worker_init``...) and ignore those they do not use.
"""

from __future__ import annotations

from collections.abc import Callable

from nimbus.providers._base import (
    BlockState,
    BlockStatus,
    Launcher,
    Provider,
    SingleNodeLauncher,
    SrunLauncher,
)
from nimbus.providers._store import store_for_nodes
from nimbus.providers.local import LocalProvider
from nimbus.providers.slurm import SlurmProvider, walltime_seconds

__all__ = [
    "PROVIDERS",
    "BlockState",
    "BlockStatus",
    "Launcher",
    "LocalProvider",
    "Provider",
    "SingleNodeLauncher",
    "SlurmProvider",
    "SrunLauncher",
    "store_for_nodes",
    "walltime_seconds",
]

PROVIDERS: dict[str, Callable[..., Provider]] = {"local": LocalProvider, "slurm": SlurmProvider}
