"""Contexts: the stdlib's ``BaseContext``, with processes and state on nimbus.

``nimbus.multiprocessing`` plugs into the stdlib at its own extension point:
a context whose ``Process`` starts through a nimbus Popen (a warm worker
forks it, see ``popen_nimbus``) and whose queues, locks, pipes and shared
values live in the state store. Everything else (``Pool``, ``Manager``,
``current_process``, ``active_children`` ...) is the stdlib's code running
on top of these.

Start methods: ``get_context('spawn' | 'fork' | 'forkserver')`` and
``set_start_method`` are accepted and reported as the stdlib does, and all
run the same way. Every one behaves like *spawn* as far as the program's
state goes: the target and its arguments are pickled at ``start()``
(functions and classes of ``__main__`` by value, with the globals they use),
so a child sees the parent's state as it was at ``start()``, never later
changes; module-level state the child needs must be passed or recomputed.
"""

from __future__ import annotations

from multiprocessing import context as stdlib_context
from multiprocessing import process as stdlib_process
from typing import Any

__all__ = ["DefaultContext", "NimbusContext", "Process"]

START_METHODS = ("fork", "spawn", "forkserver")


class Process(stdlib_process.BaseProcess):
    """A process that runs on a nimbus warm worker."""

    _start_method: str | None = None

    @staticmethod
    def _Popen(process_obj: stdlib_process.BaseProcess) -> Any:
        from nimbus.multiprocessing.popen_nimbus import Popen

        return Popen(process_obj)

    @staticmethod
    def _after_fork() -> None:
        pass


class NimbusContext(stdlib_context.BaseContext):
    """A context whose processes, queues, locks and shared values are nimbus's."""

    Process = Process

    def __init__(self, name: str = "spawn") -> None:
        self._name = name

    def get_start_method(self, allow_none: bool = False) -> str:
        return self._name

    def get_all_start_methods(self) -> list[str]:
        return list(START_METHODS)

    def get_context(self, method: str | None = None) -> Any:
        if method is None:
            return self
        if method in START_METHODS:
            return _contexts[method]
        # a library's own context, registered where the stdlib keeps them (loky's
        # ``multiprocessing.context._concrete_contexts["loky"]``): the stdlib's answer
        try:
            ctx = stdlib_context._concrete_contexts[method]
        except KeyError:
            raise ValueError(f"cannot find context for {method!r}") from None
        ctx._check_available()
        return ctx

    def set_forkserver_preload(self, module_names: list[str]) -> None:
        """Modules the warm workers import once before they fork processes.

        Processes then start with them imported (for a Pool, before its first
        task); otherwise a child imports what it needs at first use.
        """
        from nimbus.multiprocessing.popen_nimbus import set_preload

        set_preload(module_names)

    def cpu_count(self) -> int:
        """The workers the backend offers (the cores of this machine by default; with
        ``NIMBUS_ENDPOINT``, the endpoint's workers)."""
        from nimbus.multiprocessing import _site

        return _site.cpu_count()

    # -- state in the store ----------------------------------------------
    def Lock(self) -> Any:
        from nimbus.multiprocessing.synchronize import Lock

        return Lock(ctx=self.get_context())

    def RLock(self) -> Any:
        from nimbus.multiprocessing.synchronize import RLock

        return RLock(ctx=self.get_context())

    def Condition(self, lock: Any = None) -> Any:
        from nimbus.multiprocessing.synchronize import Condition

        return Condition(lock, ctx=self.get_context())

    def Semaphore(self, value: int = 1) -> Any:
        from nimbus.multiprocessing.synchronize import Semaphore

        return Semaphore(value, ctx=self.get_context())

    def BoundedSemaphore(self, value: int = 1) -> Any:
        from nimbus.multiprocessing.synchronize import BoundedSemaphore

        return BoundedSemaphore(value, ctx=self.get_context())

    def Event(self) -> Any:
        from nimbus.multiprocessing.synchronize import Event

        return Event(ctx=self.get_context())

    def Barrier(self, parties: int, action: Any = None, timeout: float | None = None) -> Any:
        from nimbus.multiprocessing.synchronize import Barrier

        return Barrier(parties, action, timeout, ctx=self.get_context())

    def Queue(self, maxsize: int = 0) -> Any:
        from nimbus.multiprocessing.queues import Queue

        return Queue(maxsize, ctx=self.get_context())

    def JoinableQueue(self, maxsize: int = 0) -> Any:
        from nimbus.multiprocessing.queues import JoinableQueue

        return JoinableQueue(maxsize, ctx=self.get_context())

    def SimpleQueue(self) -> Any:
        from nimbus.multiprocessing.queues import SimpleQueue

        return SimpleQueue(ctx=self.get_context())

    def Pipe(self, duplex: bool = True) -> Any:
        from nimbus.multiprocessing.connection import Pipe

        return Pipe(duplex)

    def RawValue(self, typecode_or_type: Any, *args: Any) -> Any:
        from nimbus.multiprocessing.sharedctypes import RawValue

        return RawValue(typecode_or_type, *args)

    def RawArray(self, typecode_or_type: Any, size_or_initializer: Any) -> Any:
        from nimbus.multiprocessing.sharedctypes import RawArray

        return RawArray(typecode_or_type, size_or_initializer)

    def Value(self, typecode_or_type: Any, *args: Any, lock: Any = True) -> Any:
        from nimbus.multiprocessing.sharedctypes import Value

        return Value(typecode_or_type, *args, lock=lock, ctx=self.get_context())

    def Array(self, typecode_or_type: Any, size_or_initializer: Any, *, lock: Any = True) -> Any:
        from nimbus.multiprocessing.sharedctypes import Array

        return Array(typecode_or_type, size_or_initializer, lock=lock, ctx=self.get_context())

    # -- the stdlib's code, on our processes -------------------------------
    def Manager(self) -> Any:
        from nimbus.multiprocessing.managers import SyncManager

        manager = SyncManager(ctx=self.get_context())
        manager.start()
        return manager

    def Pool(
        self,
        processes: int | None = None,
        initializer: Any = None,
        initargs: tuple[Any, ...] = (),
        maxtasksperchild: int | None = None,
    ) -> Any:
        from nimbus.multiprocessing.pool import Pool

        return Pool(processes, initializer, initargs, maxtasksperchild, context=self.get_context())


class DefaultContext(NimbusContext):
    """The module-level context: ``set_start_method`` chooses what it reports."""

    def __init__(self) -> None:
        super().__init__("fork")
        self._actual: stdlib_context.BaseContext | None = None

    def get_context(self, method: str | None = None) -> Any:
        if method is None:
            if self._actual is None:
                self._actual = _contexts["fork"]
            return self._actual
        return super().get_context(method)

    def set_start_method(self, method: str | None, force: bool = False) -> None:
        if self._actual is not None and not force:
            raise RuntimeError("context has already been set")
        if method is None and force:
            self._actual = None
            return
        self._actual = self.get_context(method)

    def get_start_method(self, allow_none: bool = False) -> str | None:
        if self._actual is None:
            if allow_none:
                return None
            self._actual = _contexts["fork"]
        name: str = self._actual._name
        return name


class ForkProcess(Process):
    _start_method = "fork"


class SpawnProcess(Process):
    _start_method = "spawn"


class ForkServerProcess(Process):
    _start_method = "forkserver"


class ForkContext(NimbusContext):
    Process = ForkProcess


class SpawnContext(NimbusContext):
    Process = SpawnProcess


class ForkServerContext(NimbusContext):
    Process = ForkServerProcess


_contexts: dict[str, NimbusContext] = {
    "fork": ForkContext("fork"),
    "spawn": SpawnContext("spawn"),
    "forkserver": ForkServerContext("forkserver"),
}
_default_context = DefaultContext()

# imported with the package, not at the first start() or Queue(): a new program's
# first Process and Pool are on its path (issue 16: <= 50 ms, <= 0.06 s), and the
# root's warm workers, forks of it, then have them too (none imports them again)
from nimbus.multiprocessing import popen_nimbus, queues, synchronize  # noqa: E402, F401
