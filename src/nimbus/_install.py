"""``install()``: nimbus as ``multiprocessing``, for the program and every library it uses.

::

    import multiprocessing            -> nimbus.multiprocessing (the package)
    import multiprocessing.pool       -> nimbus.multiprocessing.pool        (nimbus's modules)
    import multiprocessing.heap       -> the stdlib's multiprocessing.heap  (local by nature)
    nimbus's own modules              -> the real stdlib modules, whatever sys.modules says

A finder first on ``sys.meta_path`` answers imports of ``multiprocessing``
and its submodules with nimbus's modules (or the stdlib's, for those that are
the stdlib's in nimbus's module map), on first import: a program that never
imports ``multiprocessing`` pays nothing. Modules imported before
``install()`` are aliased at once; a library that bound the stdlib's module
before (``concurrent.futures.process`` in an IPython kernel, say) keeps it.

nimbus is built on the stdlib's modules, and so are the stdlib's modules on
each other: every module of the ``nimbus`` package executes with the real
stdlib modules in ``sys.modules`` (``real()``); the stdlib's modules import
their siblings relatively (``from .queues import SimpleQueue`` in
``BaseContext.SimpleQueue``), so their ``__package__`` is re-homed under
``HOME``, where the finder answers with the stdlib's modules; and each nimbus
module that stands in for a stdlib one also answers the stdlib's names it does
not define (loky's ``synchronize.SemLock``, a child's ``context._force_start_method``).
A stdlib class that a nimbus one shadows (``multiprocessing.pool.Pool``) no
longer pickles by reference while installed: nimbus's registers its own
where the stdlib would send one (``SyncManager``'s ``Pool``).

The children of an installed program install it too (``popen_nimbus`` says
so, and the warm worker installs before it imports the main module).

Ctrl-C: the terminal signals its foreground process group, and nimbus's
processes, forked by warm workers, are not in it. While SIGINT's handler is
Python's own, a process that imported ``nimbus.multiprocessing`` (installed or
not) passes an interrupt on to its live nimbus children first
(``pass_interrupts``); they do the same, so a Process started by a Process
sees it too, as every process of the group does under the stdlib.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.machinery
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from types import ModuleType

TYPE_CHECKING = False  # typing is not imported: `nimbus run` starts programs sooner
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "NIMBUS_MODULES",
    "ON_STDLIB",
    "STDLIB_MODULES",
    "install",
    "installed",
    "pass_interrupts",
    "real",
    "watch",
]

# the submodules that are nimbus's own, standing in for the stdlib's
NIMBUS_MODULES = (
    "connection",
    "context",
    "managers",
    "pool",
    "popen_nimbus",
    "process",
    "queues",
    "sharedctypes",
    "synchronize",
)
# the stdlib's, in nimbus's module map as they are: local to one process or host by nature
STDLIB_MODULES = (
    "dummy",
    "dummy.connection",
    "forkserver",
    "heap",
    "popen_fork",
    "popen_forkserver",
    "popen_spawn_posix",
    "reduction",
    "resource_sharer",
    "resource_tracker",
    "shared_memory",
    "spawn",
    "util",
)

# libraries built on the stdlib's internals (its queues' pipes, its SemLock), with their
# own contexts and processes: they run on the stdlib's modules, as nimbus's own do (loky,
# joblib's default backend and so scikit-learn's ``n_jobs``; its workers are its own)
ON_STDLIB = ("joblib.externals.loky", "loky")

NAME = "multiprocessing"
PACKAGE = "nimbus.multiprocessing"
_lock = threading.RLock()
_real: dict[str, ModuleType] = {}  # the stdlib's modules by name, as imported
_installed = False


def _ours(name: str) -> bool:
    return name == NAME or name.startswith(NAME + ".")


def _aliased() -> bool:
    module = sys.modules.get(NAME)
    return module is not None and module.__name__ != NAME


def _remember() -> None:
    """Keep the stdlib's modules imported so far (while none is aliased)."""
    for name, module in list(sys.modules.items()):
        if _ours(name) and module.__name__ == name:
            _real[name] = module
            if _installed or _aliased():
                _rehome(module)


# where the stdlib's modules find each other once `multiprocessing` is nimbus
HOME = "nimbus._stdlib"


def _rehome(module: ModuleType) -> None:
    """Make the stdlib module's relative imports (``from .queues import SimpleQueue``
    in ``BaseContext.SimpleQueue``) find the stdlib's modules, not nimbus's.

    Its ``__package__`` (and ``__spec__``, which must agree) name the stdlib's
    package under ``HOME``, where the finder answers with the stdlib's modules.
    """
    home = HOME + module.__name__[len(NAME) :]
    spec = module.__spec__
    if spec is not None and spec.name != home:
        spec = copy.copy(spec)
        spec.name = home
        module.__spec__ = spec
    module.__package__ = spec.parent if spec is not None else home.rpartition(".")[0]


@contextlib.contextmanager
def real() -> Iterator[None]:
    """While inside: ``multiprocessing`` and its submodules in ``sys.modules`` are the stdlib's.

    Modules of the stdlib that are first imported meanwhile are kept for later.
    """
    with _lock:
        if not _aliased():
            yield
            return
        aliases = {name: m for name, m in sys.modules.items() if _ours(name)}
        for name in aliases:
            del sys.modules[name]
        sys.modules.update(_real)
        try:
            yield
        finally:
            for name, module in list(sys.modules.items()):
                if _ours(name):
                    _real[name] = module
                    del sys.modules[name]
                    _rehome(module)
            sys.modules.update(aliases)


def _stdlib(name: str) -> ModuleType:
    """The real stdlib module ``name`` (``multiprocessing.heap`` ...), imported if need be."""
    with real():
        return importlib.import_module(name)


def _nimbus(sub: str) -> ModuleType:
    """nimbus's module standing in for ``multiprocessing.<sub>`` ('' for the package)."""
    name = "nimbus.multiprocessing" + (f".{sub}" if sub else "")
    with real():
        module = importlib.import_module(name)
    _answer_for(module)
    return module


def _answer_stdlib_names(module: ModuleType, stdlib: ModuleType | None) -> None:
    """Let ``module`` answer the names of the stdlib module it stands in for.

    The stdlib's own code imports its siblings lazily (``from . import
    context`` then ``context._force_start_method``): with nimbus's module in
    their place, it finds the stdlib's names it does not define there.
    """
    if stdlib is None or "__getattr__" in vars(module):
        return

    def __getattr__(name: str) -> Any:
        try:
            return getattr(stdlib, name)
        except AttributeError:
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}") from None

    module.__getattr__ = __getattr__  # type: ignore[method-assign]


def _answer_for(module: ModuleType) -> None:
    """If ``module`` is nimbus's stand-in for a stdlib module: let it answer the stdlib's names."""
    sub = module.__name__.rpartition(".")[2]
    if module.__name__ == f"nimbus.multiprocessing.{sub}" and sub in NIMBUS_MODULES:
        stdlib = _stdlib(f"{NAME}.{sub}") if sub != "popen_nimbus" else None
        _answer_stdlib_names(module, stdlib)


def _target(name: str) -> ModuleType | None:
    """What ``import <name>`` gives once installed (None: not ours to answer)."""
    if name == NAME:
        return _nimbus("")
    sub = name[len(NAME) + 1 :]
    if sub in NIMBUS_MODULES:
        return _nimbus(sub)
    if sub in STDLIB_MODULES:
        return _stdlib(name)
    return None


class _Given:
    """A loader of a module that already exists."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        pass


class _OnRealStdlib:
    """A nimbus module's own loader, executing it with the stdlib's modules in place."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self.loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        with real():
            self.loader.exec_module(module)
        _answer_for(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename ... for tracebacks
        return getattr(self.loader, name)


class _Finder:
    """First on ``sys.meta_path`` once nimbus is imported; acts only when installed or aliased."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if _busy.active:
            return None
        if _installed and _on_stdlib(fullname):
            return self._on_stdlib_spec(fullname, path, target)
        if fullname == NAME and _installed:  # the program's first `import multiprocessing`
            _alias_first()
            return _given(fullname, sys.modules[NAME])
        if not _aliased():
            if not (_installed and fullname == PACKAGE and PACKAGE not in sys.modules):
                return None
            # the program's first import is nimbus's package (`import
            # nimbus.multiprocessing.connection`): the stdlib's package first, then ours
            # on it, as for `import multiprocessing`
            _alias_first()
            return _given(fullname, sys.modules[PACKAGE])
        if fullname == HOME or fullname.startswith(HOME + "."):
            module = _stdlib(NAME + fullname[len(HOME) :])
            _rehome(module)
            return _given(fullname, module)
        if _ours(fullname):
            target = _target(fullname)
            return None if target is None else _given(fullname, target)
        if fullname.startswith("nimbus."):
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _OnRealStdlib(spec.loader)  # type: ignore[assignment]
            return spec
        return None

    def _on_stdlib_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None
    ) -> importlib.machinery.ModuleSpec | None:
        """The spec the other finders give, its module executed on the stdlib's modules."""
        if NAME not in sys.modules:  # (else its `import multiprocessing` would be the first)
            _alias_first()
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec: importlib.machinery.ModuleSpec | None = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _OnRealStdlib(spec.loader)  # type: ignore[assignment]
                return spec
        return None


def _on_stdlib(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in ON_STDLIB)


def _alias_first() -> None:
    """Import the stdlib's package, then alias ``multiprocessing`` to nimbus's map."""
    _busy.active = True
    try:
        with real():
            importlib.import_module(NAME)  # the stdlib's, which nimbus imports
        _alias_all()
    finally:
        _busy.active = False


def _given(fullname: str, module: ModuleType) -> importlib.machinery.ModuleSpec:
    """The spec of an import of ``fullname`` that gives ``module``."""
    return importlib.machinery.ModuleSpec(fullname, _Given(module))  # type: ignore[arg-type]


class _Busy(threading.local):
    active = False


_busy = _Busy()
_finder = _Finder()


def watch() -> None:
    """Put the finder first on ``sys.meta_path`` (nimbus's package does, when imported),
    and pass Ctrl-C on to this process's nimbus children from then on."""
    with _lock:
        pass_interrupts()
        _remember()
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def _alias_all() -> None:
    """Point ``multiprocessing`` and its imported submodules at nimbus's map, now."""
    _remember()
    nimbus_package = _nimbus("")  # imports nimbus's package on the stdlib's
    for sub in NIMBUS_MODULES:
        module = sys.modules.get(f"nimbus.multiprocessing.{sub}")
        if module is not None:
            _answer_for(module)
    for name in [n for n in sys.modules if _ours(n) and n != NAME]:
        module = _target(name)
        if module is not None:
            sys.modules[name] = module
        else:  # a stdlib module outside nimbus's map: the stdlib's, under its own name
            del sys.modules[name]
    sys.modules[NAME] = nimbus_package


def install() -> None:
    """Make ``multiprocessing`` nimbus in this interpreter, for every module that imports it.

    ``import multiprocessing`` (and ``from multiprocessing.pool import
    Pool`` ...) in the program and in the libraries it uses then gives
    ``nimbus.multiprocessing``; ``concurrent.futures.ProcessPoolExecutor``
    imported afterwards runs its processes on nimbus too. Idempotent; nothing
    is imported until the program imports ``multiprocessing``, unless it has.
    """
    global _installed
    with _lock:
        pass_interrupts()  # (again in a child forked from an installed worker)
        if _installed:
            return
        watch()
        _installed = True
        if NAME in sys.modules:
            _alias_all()


def installed() -> bool:
    """Whether ``install()`` ran in this process."""
    return _installed


class _Interrupts:
    """The SIGINTs this process received and passed on (see :func:`_on_interrupt`)."""

    received = 0
    passed = 0
    passing = False


def _reset_interrupts() -> None:
    """A fork starts with none received nor being passed on (the thread that forked may
    have done so while the main thread was inside the handler)."""
    _Interrupts.received = _Interrupts.passed = 0
    _Interrupts.passing = False


os.register_at_fork(after_in_child=_reset_interrupts)


def _on_interrupt(signum: int, frame: Any) -> None:
    """SIGINT: to the live nimbus children first, then ``KeyboardInterrupt`` here.

    Each SIGINT reaches each child, as each of a terminal's reaches every process
    of its group: a second one that comes while the first is passed on (Python
    runs this handler again inside it; two Ctrl-C, or a signal sent to the group
    twice, as ``timeout`` does) is passed on after it, not instead of the rest of it.
    Passing on takes no lock and waits for nothing (``popen_nimbus.pass_on``): the
    thread that would end a wait may be waiting for a lock the interrupted code holds.
    """
    _Interrupts.received += 1
    if _Interrupts.passing:
        return  # the call this one interrupted passes it on, and raises
    try:
        while _Interrupts.passed < _Interrupts.received:
            _Interrupts.passing = True
            while _Interrupts.passed < _Interrupts.received:
                _Interrupts.passed += 1
                _pass_on()
            _Interrupts.passing = False  # (one that came just before this is seen: loop)
    finally:
        _Interrupts.passing = False  # (an error passing it on leaves Ctrl-C working)
    signal.default_int_handler(signum, frame)


def _pass_on() -> None:
    """One SIGINT to each live nimbus child (none started yet: nothing to do)."""
    popen_nimbus = sys.modules.get("nimbus.multiprocessing.popen_nimbus")
    if popen_nimbus is not None:
        popen_nimbus.pass_on(signal.SIGINT)


def pass_interrupts() -> None:
    """Pass Ctrl-C on to this process's nimbus children, which the terminal does not reach.

    Only while SIGINT's handler is Python's own (an ignored one, or the
    program's, stays), and only from the main thread (where handlers are set).
    """
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGINT, _on_interrupt)
