"""nimbus: run Python functions and unmodified multiprocessing programs on warm workers.

Public names are re-exported here; ``Executor``, ``Future`` and ``Client`` are imported on
first use so that ``nimbus version`` and worker start-up stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nimbus.errors import NimbusError
from nimbus.records import TaskRecord, TaskState

if TYPE_CHECKING:
    from nimbus.client import Client
    from nimbus.executor import Executor, Future

__version__ = "0.1.0"

__all__ = [
    "Client",
    "Executor",
    "Future",
    "NimbusError",
    "TaskRecord",
    "TaskState",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in ("Executor", "Future"):
        from nimbus import executor

        return getattr(executor, name)
    if name == "Client":
        from nimbus.client import Client

        return Client
    raise AttributeError(f"module 'nimbus' has no attribute {name!r}")
