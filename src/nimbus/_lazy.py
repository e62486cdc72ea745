"""``lazy(name, globals())``: a module imported on first use instead of with its importer.

::

    redis = lazy("redis", globals())   # costs nothing now
    ...
    except redis.RedisError:           # first use: imports redis, and the importer's
                                       # global `redis` becomes the module itself

redis-py (with asyncio, ssl, email and OpenTelemetry behind it) is about half
of what ``import nimbus.multiprocessing`` would cost, and a program that
starts processes without shared state never talks to the store: its import
waits until a connection is made. The stand-in puts the real module in its
importer's namespace on first use, so later uses are plain global lookups.
The import itself is the interpreter's (thread-safe); an ``except`` clause
naming the stand-in's attribute is evaluated only when an exception reaches it.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["lazy"]


class _Lazy:
    """Stands in for module ``name`` in ``namespace[alias]`` until an attribute is asked for."""

    __slots__ = ("_alias", "_name", "_namespace")

    def __init__(self, name: str, namespace: dict[str, Any], alias: str) -> None:
        self._name = name
        self._namespace = namespace
        self._alias = alias

    def _load(self) -> ModuleType:
        module = importlib.import_module(self._name)
        if self._namespace.get(self._alias) is self:
            self._namespace[self._alias] = module
        return module

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._load(), attr)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"


def lazy(name: str, namespace: dict[str, Any], alias: str | None = None) -> Any:
    """Module ``name`` for ``namespace[alias]`` (default: its last part), imported on first use.

    Already imported: the module itself.
    """
    alias = alias or name.rpartition(".")[2]
    found = sys.modules.get(name)
    return found if found is not None else _Lazy(name, namespace, alias)
