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

How a worker imports it (:func:`import_main`, once per main module, from a start's
preparation data or ahead of the first start: :func:`main_ahead`): ``spawn.prepare``,
and a package's or a directory's ``__main__`` too, with the stdlib's own
``RuntimeError`` for a main module that starts processes as it is imported. A worker
started in an environment keeps its own import path and variables in its children
(:func:`sys_path`, :func:`child_environ`).

A main module with no file to import (``python - < script.py``, ``python
-c``, an interactive session, an embedded interpreter) is not imported in
the workers: its functions and classes travel by value with the globals
they use (``nimbus.multiprocessing._site.main_by_value``), and the child's
``__main__`` gets the main module's names as they are at ``start()``
(:func:`with_main`): a function a library sends by value itself (``dill``,
``cloudpickle``) finds its globals there, as in a forked child.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import types
import weakref
from collections.abc import Iterator
from multiprocessing import current_process, spawn
from typing import Any

from nimbus import serialization
from nimbus.environments import NODE_PATH, WORKER_VARIABLE

__all__ = [
    "MAIN_KEYS",
    "become_main",
    "bootstrapping",
    "child_environ",
    "import_main",
    "import_main_ahead",
    "main_ahead",
    "prepare",
    "sys_path",
    "with_main",
]

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
        # its functions sent by value (``_site.main_sent_by_value``) bring their globals here
        serialization.adopt_main(vars(main))
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


MAIN_KEYS = ("init_main_from_name", "init_main_from_path")
_mains: set[tuple[str, str, str]] = set()

# A worker started in an environment (``Prepared.command``/``environ``): its import path
# (the environment's packages first) and the variables that say so, as it started. The
# parent's sys.path and os.environ, which its children take as spawn's do, lack them.
_OWN_PATH = [p for p in sys.path if p] if WORKER_VARIABLE in os.environ else None
_OWN_ENVIRON = {k: os.environ[k] for k in (WORKER_VARIABLE, NODE_PATH) if k in os.environ}


def sys_path(prep: dict[str, Any]) -> list[str]:
    """The child's ``sys.path``: the parent's, but in an environment's worker the
    environment's own entries come right after the parent's first (its script's directory)."""
    path = list(prep.get("sys_path", sys.path))
    if _OWN_PATH is None or not path:
        return path
    return [path[0], *_OWN_PATH, *(p for p in path[1:] if p not in _OWN_PATH)]


def child_environ(prep_environ: dict[str, str]) -> dict[str, str]:
    """The child's ``os.environ``: the parent's, keeping this environment's variables (and
    none of the parent's ``PYTHONPATH``, which would put its packages before the environment's)."""
    if not _OWN_ENVIRON:
        return prep_environ
    out = {k: v for k, v in prep_environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    out.update(_OWN_ENVIRON)
    return out


def import_main(prep: dict[str, Any]) -> None:
    """Import the program's main module once in this worker, as spawn does in a child.

    Children forked afterwards find ``__main__`` functions by reference, with
    the globals they share. If the import fails, each child tries again (and
    fails with the traceback, as a spawned child would). A main module that
    starts a process while it is imported (no ``if __name__ == "__main__":``
    guard) fails this start with the stdlib's own ``RuntimeError`` saying so,
    which the parent raises (the script would otherwise start its processes
    again in every worker and child).
    """
    for key in MAIN_KEYS:
        if key not in prep:
            continue
        path = sys_path(prep)
        # a directory's "__main__" is the one of its own sys.path[0]
        mark = (key, prep[key], path[0] if path and prep[key] == "__main__" else "")
        if mark not in _mains:
            try:
                with bootstrapping():
                    prepare({key: prep[key], "sys_path": path})
            except RuntimeError as exc:
                if _from_main_guard(exc):
                    raise
                return
            except BaseException:
                return
            _mains.add(mark)
        prep.pop(key, None)


def main_ahead() -> dict[str, Any] | None:
    """In the root, as it forks its warm workers: what they need to import the program's
    main module at once (``import_main_ahead``), or None. Only a file with the
    ``if __name__ == "__main__":`` guard (its import starts nothing) whose functions go by
    reference; a start's own preparation data decides again (the same main: done)."""
    from nimbus.multiprocessing import _site

    if _site.main_by_value() or not _site.main_guarded():
        return None
    prep = spawn.get_preparation_data("MainProcess")
    ahead = {key: prep[key] for key in (*MAIN_KEYS, "sys_path") if key in prep}
    return ahead if any(key in ahead for key in MAIN_KEYS) else None


def import_main_ahead(prep: dict[str, Any]) -> None:
    """In the root's first warm worker, just forked: import the program's main module as
    soon as it has said hello, as its first start would (on that start's path otherwise:
    milliseconds, more for a script importing much), while the root still starts the
    others and sends that start (which the manager gives to this worker, the first)."""
    from nimbus.runtime import worker

    worker.when_idle(functools.partial(import_main, dict(prep)))


def prepare(prep: dict[str, Any]) -> None:
    """``spawn.prepare``, and a package's or a directory's ``__main__`` module imported
    as ``__mp_main__`` too, which spawn leaves out (``python -m pkg``, ``python DIR``):
    the child finds the functions defined there, as a forked child does."""
    name = prep.get("init_main_from_name")
    package_main = name == "__main__" or (name or "").endswith(".__main__")
    if package_main:
        prep = {k: v for k, v in prep.items() if k != "init_main_from_name"}
    spawn.prepare(prep)
    if package_main:
        _import_package_main(str(name))


def _import_package_main(name: str) -> None:
    """Run module ``name`` (``__main__``: the one on ``sys.path[0]``) as ``__mp_main__``,
    as ``spawn`` runs a script's, and make it this process's ``__main__``."""
    import builtins
    import runpy
    import types

    if name == "__main__":
        _name, spec, code = runpy._get_main_module_details()  # type: ignore[attr-defined]
    else:
        _name, spec, code = runpy._get_module_details(name)  # type: ignore[attr-defined]
    main = types.ModuleType("__mp_main__")
    main.__dict__.update(
        __builtins__=builtins,
        __file__=spec.origin,
        __cached__=spec.cached,
        __loader__=spec.loader,
        __package__=spec.parent,
        __spec__=spec,
    )
    spawn.old_main_modules.append(sys.modules["__main__"])
    sys.modules["__main__"] = sys.modules["__mp_main__"] = main
    exec(code, main.__dict__)


@contextlib.contextmanager
def bootstrapping() -> Iterator[None]:
    """While the main module is imported: a process started now is the stdlib's error.

    ``spawn._main`` marks its child as inheriting while it imports the main
    module, so that ``spawn.get_preparation_data`` (which our Popen calls too)
    raises the ``RuntimeError`` that explains the ``__main__`` guard.
    """
    me: Any = current_process()
    me._inheriting = True
    try:
        yield
    finally:
        del me._inheriting


_GUARD_CHECK = spawn._check_not_importing_main.__code__  # type: ignore[attr-defined]


def _from_main_guard(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by the stdlib's check for an unguarded main module."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is _GUARD_CHECK:
            return True
        tb = tb.tb_next
    return False
