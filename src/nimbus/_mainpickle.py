"""The functions of a ``__main__`` sent by value, each pickled once (``serialization``).

Under ``nimbus run`` a guarded ``__main__``'s functions go to the children by value,
with the globals they read (``multiprocessing._site.main_sent_by_value``), so what the
guarded block set up reaches them as under fork; a Pool's tasks each carry one. So:

- a function of ``__main__`` is pickled (by cloudpickle, its key of ``_mainspace``
  with it) once while the globals it reads are unchanged: it reduces to
  ``_mainspace.load_sent(digest, pickle)``, and a Pool's tasks each carrying it
  pickle plainly (:class:`MainAware`); another class or function of ``__main__``
  stops the plain pickler, for cloudpickle to pickle all (:class:`CloudSendsOnce`);
- one whose pickle, globals included, is over :data:`LARGE_MAIN` and that is
  defined at the main module's top level goes by reference to a receiver that
  imported that module (a local guarded main's workers: ``imported``), as spawn
  sends it; to another (an endpoint) by value each time.

``serialization.dumps`` uses the picklers :func:`picklers` makes, and :func:`dump`.
"""

from __future__ import annotations

import functools
import io
import pickle
import sys
import threading
import types
from collections import ChainMap, OrderedDict
from collections.abc import Callable, MutableMapping
from typing import Any, Protocol

from nimbus import _mainspace

__all__ = ["LARGE_MAIN", "dump", "picklers"]

LARGE_MAIN = 64 << 10  # a function of a guarded main whose pickle, globals it reads
# included, is larger goes by reference when its workers import it (as spawn sends it):
# carried in every task, a 370 KB global made Pool.map of 500 tasks 100x slower
_BY_NAME: tuple[Any, ...] = ()  # what _sent_once says for those


class _Carried(Protocol):
    """The globals a function carried when pickled (``serialization._Globals``)."""

    bound: list[Any]
    pickled: list[Any]

    def current(self) -> bool: ...


class _ToCloud(Exception):
    """Raised by :class:`MainAware` at a class or function of ``__main__`` it leaves to
    cloudpickle (sent by value)."""


class _SendsOnce:
    """A pickler sending each function of a ``__main__`` as its pickle made once while the
    globals it reads are unchanged (:func:`_sent_once`)."""

    cloud: type[pickle.Pickler]  # the cloudpickle pickler that makes that pickle
    protocol: int  # the pickle protocol it makes it with
    carried: Callable[[types.FunctionType, tuple[str, ...]], _Carried]  # its globals' watch
    sent = False  # a function went so
    named = False  # a function went by reference (a large one its worker imports)
    imported = False  # the receiver imported the main module (a local guarded main's)
    whole: object = None  # the function being pickled for that (not as its own pickle)

    def _send_once(self, fn: types.FunctionType) -> tuple[Any, ...] | None:
        if fn is self.whole:
            return None
        reduced = _sent_once(self, fn)
        if reduced is not None and reduced is not _BY_NAME:
            self.sent = True
        return reduced


class MainAware(_SendsOnce, pickle.Pickler):
    """The plain pickler, for ``__main__`` by value: a function of ``__main__`` goes as its
    pickle made once (a Pool's tasks each carrying it pickle plainly); another class or
    function of ``__main__`` stops it, for cloudpickle to pickle all."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is types.FunctionType:
            if obj.__module__ != "__main__":
                return NotImplemented
            reduced = self._send_once(obj)
            if reduced is None:
                raise _ToCloud
            if reduced is _BY_NAME:
                self.named = True
                return NotImplemented  # by reference: its worker imported it
            return reduced
        if isinstance(obj, type) and obj.__module__ == "__main__":
            raise _ToCloud
        return NotImplemented


def _cloud_reducer_override(self: Any, obj: Any) -> Any:
    """cloudpickle's, a function of ``__main__`` sent as its pickle made once."""
    if type(obj) is types.FunctionType and obj.__module__ == "__main__":
        reduced = self._send_once(obj)
        if reduced is not None and reduced is not _BY_NAME:
            return reduced
    return super(_SendsOnce, self).reducer_override(obj)


def picklers(
    table: ChainMap[Any, Any],
    reducers: MutableMapping[Any, Any],
    *,
    protocol: int,
    carried: Callable[[types.FunctionType, tuple[str, ...]], _Carried],
) -> tuple[type[pickle.Pickler], type[pickle.Pickler]]:
    """The main-aware plain pickler with dispatch ``table`` and the cloudpickle pickler
    also using ``reducers`` (a live mapping), both sending a ``__main__``'s functions
    once, pickled with ``protocol``, while the globals ``carried`` watches are unchanged."""
    cloud_table: ChainMap[Any, Any] = _mainspace.pickler().dispatch_table  # type: ignore[assignment]
    made = {"protocol": protocol, "carried": staticmethod(carried)}
    cloud = type(
        "CloudPickler",
        (_SendsOnce, _mainspace.pickler()),
        {
            "dispatch_table": ChainMap(reducers, *cloud_table.maps),
            "reducer_override": _cloud_reducer_override,
            **made,
        },
    )
    cloud.cloud = cloud  # type: ignore[attr-defined]
    aware = type("Pickler", (MainAware,), {"dispatch_table": table, "cloud": cloud, **made})
    return aware, cloud


def dump(
    aware: type[pickle.Pickler],
    obj: object,
    buffer_callback: Callable[[pickle.PickleBuffer], object],
    *,
    imported: bool,
) -> bytes | None:
    """``obj`` pickled by ``aware`` (of :func:`picklers`), or None where cloudpickle must
    pickle it (a ``__main__``'s class, or function not sent once, left in it).
    ``imported``: the receiver imported the main module (a large top-level function
    of it goes by reference). Raises what pickling raises."""
    out = io.BytesIO()
    pickler = aware(out, protocol=aware.protocol, buffer_callback=buffer_callback)  # type: ignore[attr-defined]
    pickler.imported = imported  # type: ignore[attr-defined]
    try:
        pickler.dump(obj)
    except _ToCloud:
        return None
    data = out.getvalue()
    if pickler.sent or pickler.named or b"__main__" not in data:  # type: ignore[attr-defined]
        return data
    return None


_sent: OrderedDict[int, tuple[types.FunctionType, tuple[Any, ...], _Carried | None]] = OrderedDict()
_lock = threading.Lock()


def _sent_once(pickler: _SendsOnce, fn: types.FunctionType) -> tuple[Any, ...] | None:
    """What ``fn`` reduces to: ``_mainspace.load_sent`` of its pickle made once (by
    ``pickler.cloud``) while the globals it reads are unchanged, or None: to be
    pickled in place (a closure, globals plain pickle cannot take, no ``__main__``'s)."""
    entry = _sent.get(id(fn))
    if entry is not None and entry[0] is fn and entry[1] is _BY_NAME:
        if pickler.imported:
            return _BY_NAME
    elif entry is not None and entry[0] is fn:
        try:
            if entry[2] is None or entry[2].current():
                return entry[1]
        except Exception:
            return None
    if fn.__closure__ is not None or _mainspace._key_of(fn.__globals__) is None:
        return None
    try:
        carried = pickler.carried(fn, ())
    except Exception:
        return None
    import hashlib

    out = io.BytesIO()
    one = pickler.cloud(out, protocol=pickler.protocol)
    one.whole = fn  # type: ignore[attr-defined]
    one.dump(fn)
    data = out.getvalue()
    reduced = (_mainspace.load_sent, (hashlib.blake2b(data, digest_size=16).digest(), data))
    if len(data) > LARGE_MAIN and _importable(fn):
        with _lock:  # for good: checking its globals again would pickle them each time
            _sent[id(fn)] = (fn, _BY_NAME, None)
        return _BY_NAME if pickler.imported else reduced  # (to an endpoint: by value each time)
    with _lock:
        _sent[id(fn)] = (fn, reduced, carried if carried.bound or carried.pickled else None)
        while len(_sent) > _mainspace.CACHED:
            _sent.popitem(last=False)
    return reduced


def _importable(fn: types.FunctionType) -> bool:
    """Whether ``fn`` is a function of ``__main__`` that a worker importing the main module
    finds under its name: defined at its top level (not under its guard, nor in a function:
    the source's top-level definitions are looked up, a guarded block's are not)."""
    main = sys.modules.get("__main__")
    if main is None or getattr(main, fn.__name__, None) is not fn or "<" in fn.__qualname__:
        return False
    return fn.__name__ in _top_level_defs(getattr(main, "__file__", None))


@functools.cache
def _top_level_defs(path: str | None) -> frozenset[str]:
    """The names a module's source defines with ``def`` at its top level (not in an ``if``)."""
    import ast

    try:
        with open(path or "", "rb") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    return frozenset(node.name for node in tree.body if isinstance(node, defs))
