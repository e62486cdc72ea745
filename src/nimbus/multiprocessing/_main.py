"""The program's main module in its processes: ``__main__``, as a forked child sees it.

A warm worker imports the program's main module once (as ``__mp_main__``,
as spawn does, so its ``if __name__ == "__main__":`` block does not run) and
``sys.modules["__main__"]`` is that module in every child it forks. Modules
that bound ``__main__`` earlier, while the worker started, hold the worker's
own bootstrap module instead: ``dill`` does (``import __main__``), and looks
up the globals of the main script's functions it sends by value there
(pandarallel's ``row_func`` using ``math``). In a child, ``become_main()``
gives that module the main module's names, so both are the program's main,
as under the stdlib's fork.

A main module with no file to import (``python - < script.py``, ``python
-c``, an interactive session, an embedded interpreter) is not imported in
the workers: its functions and classes travel by value with the globals
they use (``nimbus.multiprocessing._site.main_by_value``), and the child's
``__main__`` gets the main module's names as they are at ``start()``
(:func:`with_main`): a function a library sends by value itself (``dill``,
``cloudpickle``) finds its globals there, as in a forked child.
"""

from __future__ import annotations

import sys
import types
import weakref
from typing import Any

from nimbus import serialization

__all__ = ["become_main", "with_main"]

# this process's own main module when nimbus was imported (a worker's bootstrap); weakly,
# so that a root's main module is cleared first at exit, as always
_original = weakref.ref(sys.modules["__main__"]) if "__main__" in sys.modules else None


def become_main() -> None:
    """In a child: the program's main module is named ``__main__`` (its code reads
    ``__name__`` as under fork), and modules holding the worker's ``__main__`` see it."""
    main = sys.modules.get("__main__")
    if main is not None and getattr(main, "__name__", None) == "__mp_main__":
        # as a forked child has it (imported as spawn does); runpy ran it in a dict of its
        # own that the module got a copy of: its functions' globals are that dict
        scopes = {id(f.__globals__): f.__globals__ for f in list(vars(main).values())
                  if isinstance(f, types.FunctionType)}  # fmt: skip
        for scope in [vars(main), *scopes.values()]:
            if scope.get("__name__") == "__mp_main__":
                scope["__name__"] = "__main__"
    original = _original() if _original is not None else None
    if main is None or original is None or main is original:
        return
    names = dict(vars(main))
    vars(original).clear()
    vars(original).update(names)


# the program's shared objects (pipes, queues, locks) go to a child only as arguments: a
# copy in its __main__ would take a reference each start
_NOT_COPIED = ("nimbus.", "multiprocessing.", "_thread", "threading", "socket", "_io", "io")


def _snapshot() -> dict[str, tuple[bytes, list[bytes]]]:
    """The main module's names, each pickled apart (what cannot be is left out)."""
    main = sys.modules.get("__main__")
    names: dict[str, tuple[bytes, list[bytes]]] = {}
    for name, value in list(vars(main).items()) if main is not None else ():
        if name.startswith("__") or type(value).__module__.startswith(_NOT_COPIED):
            continue
        try:
            data, buffers = serialization.dumps(value, main_by_value=True)
        except Exception:  # a lock, an open file: not the child's, as in spawn
            continue
        names[name] = (data, [bytes(b.raw()) for b in buffers])
    return names


def _restored(names: dict[str, tuple[bytes, list[bytes]]], obj: Any) -> Any:
    """In the child: put the parent's main names into ``__main__``; ``obj`` as it was."""
    values = {}
    for name, (data, buffers) in names.items():
        try:
            values[name] = serialization.loads(data, buffers)
        except Exception:  # a module this host lacks: as if never imported
            continue
    targets = {id(m): m for m in (sys.modules.get("__main__"), _original and _original())}
    for module in targets.values():
        if isinstance(module, types.ModuleType):
            for name, value in values.items():
                vars(module).setdefault(name, value)
    return obj


class _WithMain:
    """Pickles as ``obj``, with ``__main__``'s names put in place first (see :func:`with_main`)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restored, (_snapshot(), self.obj))


def with_main(obj: Any) -> Any:
    """``obj`` to pickle for a child whose main module has no file (it goes by value):
    unpickled, it is ``obj``, and the child's ``__main__`` has the parent's main names."""
    return _WithMain(obj)
