"""nimbus: run Python functions and unmodified multiprocessing programs on warm workers.

This package owns the SDK's public face: ``Executor``, ``Future``, ``Client``,
``TaskRecord``, ``TaskState``, ``NimbusError``, ``Environment``, and ``Ref`` /
``put`` / ``File`` (``nimbus.data``). Its subpackages, top down (the layers of DESIGN.md,
pinned by tests/test_layers.py): ``cli``; the SDK and ``multiprocessing``;
``backends``; ``runtime``, ``service``, ``endpoint``, ``messaging``; the state store; ``protocol``, ``serialization``, ``wire``,
``config``, ``errors`` and the other plumbing.

Public names are re-exported here and imported on first use (PEP 562), so that
``import nimbus`` costs nothing: a worker, which is a fresh interpreter that
imports ``nimbus.runtime.worker``, starts its first task sooner, and
``nimbus version`` stays fast.
"""

from __future__ import annotations

import importlib as _importlib

TYPE_CHECKING = False  # typing is not imported: `nimbus run` starts programs sooner
if TYPE_CHECKING:
    from typing import Any

    from nimbus.client import Client
    from nimbus.data import File, Ref, put
    from nimbus.environments import Environment
    from nimbus.errors import NimbusError
    from nimbus.executor import Executor, Future
    from nimbus.records import TaskRecord, TaskState
del TYPE_CHECKING, annotations  # plumbing, not public names (``dir(nimbus)``)

__version__ = "0.1.0"

__all__ = [
    "Client",
    "Environment",
    "Executor",
    "File",
    "Future",
    "NimbusError",
    "Ref",
    "TaskRecord",
    "TaskState",
    "__version__",
    "put",
]

# public name -> the module that defines it
_HOMES = {
    "Client": "nimbus.client",
    "Environment": "nimbus.environments",
    "Executor": "nimbus.executor",
    "Future": "nimbus.executor",
    "NimbusError": "nimbus.errors",
    "File": "nimbus.data",
    "Ref": "nimbus.data",
    "put": "nimbus.data",
    "TaskRecord": "nimbus.records",
    "TaskState": "nimbus.records",
}


def __getattr__(name: str) -> Any:
    if name == "data":  # nimbus.data.store() in task code, with only `import nimbus`
        return _importlib.import_module("nimbus.data")
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'nimbus' has no attribute {name!r}")
    value = getattr(_importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nimbus``: nimbus is ``multiprocessing`` in this kernel (see ``nimbus run``)."""
    from nimbus._install import install

    del ipython
    install()
