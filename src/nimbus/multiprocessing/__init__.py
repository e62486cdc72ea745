"""``nimbus.multiprocessing``: the stdlib's multiprocessing API on nimbus.

Owns the stdlib's surface (processes, pools, queues, pipes, locks, shared
ctypes, managers) for programs on a local or remote site, built on the
runtime, messaging and the state store.

Change ``import multiprocessing`` to ``import nimbus.multiprocessing as
multiprocessing``: processes run on warm workers and shared state lives in
the state store (an embedded Redis by default, ``NIMBUS_REDIS_URL`` when set),
except ``Value``/``Array`` of a program on this host: in its shared memory.
The module map is the stdlib's (``context``, ``process``, ``pool``, ``queues``,
``connection``, ``synchronize``, ``sharedctypes``, ``managers``); modules that
are local to one process or host by nature (``util``, ``dummy``, ``reduction``,
``heap``, ``shared_memory``, ``resource_sharer``, ``resource_tracker``,
``spawn``, ``forkserver``, ``popen_*``) are the stdlib's.

``install()`` (or ``nimbus run``, or ``%load_ext nimbus``) makes every
``import multiprocessing`` of the program and of its libraries this package.
"""

from __future__ import annotations

import multiprocessing as _stdlib
import sys as _sys
from multiprocessing import AuthenticationError as AuthenticationError
from multiprocessing import BufferTooShort as BufferTooShort
from multiprocessing import ProcessError as ProcessError
from multiprocessing import TimeoutError as TimeoutError
from multiprocessing import (
    dummy,
    heap,
    reduction,
    resource_tracker,
    shared_memory,
    spawn,
    util,
)
from typing import Any

from nimbus._install import NIMBUS_MODULES as _NIMBUS_MODULES
from nimbus._install import STDLIB_MODULES as _STDLIB_MODULES
from nimbus._install import install as install
from nimbus._install import watch as _watch
from nimbus.multiprocessing import (
    _site,  # noqa: F401  (a root's program opens as the site says)
    context,
)

_watch()  # nimbus's modules import the stdlib's, even where multiprocessing is aliased to us

_LOCAL_MODULES = {
    "dummy": dummy,
    "heap": heap,
    "reduction": reduction,
    "resource_tracker": resource_tracker,
    "shared_memory": shared_memory,
    "spawn": spawn,
    "util": util,
}
for _name, _module in _LOCAL_MODULES.items():
    _sys.modules[f"{__name__}.{_name}"] = _module

_ctx = context._default_context
__all__ = [name for name in _stdlib.__all__ if not name.startswith("_")]

SUBDEBUG = util.SUBDEBUG
SUBWARNING = util.SUBWARNING
reducer = reduction
Process = context.Process


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(_ctx, name)
    if name in _NIMBUS_MODULES:  # ours, looked up as an attribute before it was imported
        import importlib  # (``mp.connection.wait`` in concurrent.futures under ``nimbus run``)

        return importlib.import_module(f"{__name__}.{name}")
    if name in _STDLIB_MODULES:  # the rest of the stdlib's module map, on first use
        import importlib

        from nimbus._install import real

        with real():
            module = importlib.import_module(f"multiprocessing.{name}")
        _sys.modules[f"{__name__}.{name}"] = module
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# the bound methods of the default context, as the stdlib exposes them
for _name in __all__:
    if _name not in globals() and hasattr(_ctx, _name):
        globals()[_name] = getattr(_ctx, _name)
