"""One globals namespace per sending ``__main__`` for the functions sent by value.

cloudpickle gives each function of ``__main__`` it unpickles a globals dict of
its own (functions pickled in one call share one; pickled apart, they do not).
So a Pool's initializer that sets a global (``global G; G = v``) and the task
that reads it, pickled apart, see two dicts: ``NameError: name 'G' is not
defined`` wherever ``__main__`` travels by value (an endpoint, ``python -``,
``nimbus run -c``, Jupyter). Here the functions of one sending ``__main__``
share one namespace in the receiving process, as the functions of a module do:

- a process's ``__main__`` has a key (made on first use); a function whose
  globals are that ``__main__``'s, or a namespace made here for a key, is
  pickled with the key instead of a dict (:class:`CloudPickler`);
- the receiver binds it to its namespace for the key: its own ``__main__`` if
  the key is its own, else one made on first use (the newest
  ``NAMESPACES`` are kept, so a worker serving many programs does not grow);
- the globals the function carries go into that namespace unless the receiver
  rebound the name since the sender last set it: a child's own writes (the
  initializer's ``G``) stay, a value the sender rebinds (a notebook's new
  cell) arrives, and one program never sees another's names;
- a child that imported the program's main module itself (a guarded script,
  imported as spawn does, without its guarded block) adopts it (:func:`adopt`): the
  first other ``__main__``'s namespace there is that module, whose names as
  imported count as the sender's (so what the guarded block set, carried with
  a function, replaces them), and the child's own functions share it, as a
  forked child's do.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import threading
import types
import uuid
from collections import ChainMap, OrderedDict
from typing import Any

__all__ = ["CACHED", "NAMESPACES", "adopt", "dumps", "load_sent", "pickler"]

NAMESPACES = 16  # namespaces of other processes' mains kept (the least recently used go)
_ABSENT = object()


class _Space:
    """The namespace of one sender's ``__main__`` here, and what the sender last set in it."""

    __slots__ = ("globals", "own", "sent")

    def __init__(self, namespace: dict[str, Any], own: int | None) -> None:
        self.globals = namespace
        self.sent: dict[str, object] = {}
        self.own = own  # the pid whose __main__ it is (a fork's copy of it is not)


_spaces: OrderedDict[str, _Space] = OrderedDict()  # key -> space
_keys: dict[int, str] = {}  # id(namespace) -> key
# one key per __main__ when two threads pickle its functions at once, and no eviction
# while another thread reorders (no finalizer nor signal handler comes here)
_lock = threading.Lock()
_adopted: dict[str, Any] | None = None  # this process's imported main (see adopt)


def adopt(namespace: dict[str, Any]) -> None:
    """In a child that imported the program's main module: ``namespace`` (that module's)
    is the namespace of the first other ``__main__`` whose functions arrive here."""
    global _adopted
    with _lock:
        _adopted = namespace


def _unlock_in_child() -> None:
    """A fork's copy of the lock, which another thread may have held as it forked."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_unlock_in_child)


def _key_of(namespace: dict[str, Any]) -> str | None:
    """The key of ``namespace``: this process's ``__main__``'s, or one made here; else None."""
    with _lock:
        key = _keys.get(id(namespace))
        if key is not None:
            space = _spaces.get(key)
            if (
                space is not None
                and space.globals is namespace
                and space.own in (None, os.getpid())
            ):
                return key
        main = sys.modules.get("__main__")
        if main is None or vars(main) is not namespace:
            return None
        key = uuid.uuid4().hex
        _spaces[key] = _Space(namespace, os.getpid())
        _keys[id(namespace)] = key
        return key


def _space(key: str, base: dict[str, Any]) -> _Space:
    """The namespace for ``key`` here (made with ``base``'s module attributes if new)."""
    with _lock:
        space = _spaces.get(key)
        if space is not None and space.own in (None, os.getpid()):
            _spaces.move_to_end(key)
            return space
        global _adopted
        if _adopted is not None and id(_adopted) not in _keys:
            namespace, _adopted = _adopted, None
            space = _spaces[key] = _Space(namespace, None)
            space.sent = dict(namespace)  # as imported: the sender's (a fork's copy of them)
        else:
            namespace = dict(base)
            namespace.setdefault("__builtins__", __builtins__)
            space = _spaces[key] = _Space(namespace, None)
        _keys[id(namespace)] = key
        others = [k for k, s in _spaces.items() if s.own is None]
        for old in others[: max(0, len(others) - NAMESPACES)]:
            _keys.pop(id(_spaces.pop(old).globals), None)
        return space


def _make(key: str, base: dict[str, Any], code: types.CodeType, name: str | None,
          argdefs: tuple[Any, ...] | None, closure: tuple[Any, ...] | None) -> types.FunctionType:  # fmt: skip
    return types.FunctionType(code, _space(key, base).globals, name, argdefs, closure)


def _setstate(fn: types.FunctionType, state: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """cloudpickle's, with the globals merged into the shared namespace (see the module)."""
    from cloudpickle import cloudpickle as cp

    own, slots = state
    carried = slots["__globals__"]
    slots["__globals__"] = {}
    namespace = fn.__globals__
    builtins = namespace.get("__builtins__", _ABSENT)
    cp._function_setstate(fn, (own, slots))
    if builtins is not _ABSENT:
        namespace["__builtins__"] = builtins  # (cloudpickle's would replace a module's)
    _merge(namespace, carried)
    loading = getattr(_loading, "merged", None)
    if loading is not None:
        loading.append((namespace, carried))


def _merge(namespace: dict[str, Any], carried: dict[str, Any]) -> None:
    """The globals a function carried, into its namespace (see the module)."""
    key = _keys.get(id(namespace))
    space = _spaces.get(key) if key is not None else None
    sent = space.sent if space is not None else {}
    for name, value in carried.items():
        current = namespace.get(name, _ABSENT)
        if current is _ABSENT or current is sent.get(name, _ABSENT):
            namespace[name] = value
            sent[name] = value


# A function of a __main__ is pickled once while the globals it reads are unchanged
# (``serialization``: a Pool's tasks, each with the function, cost what a reference
# does) as ``load_sent(digest, pickle)``, and unpickled once per pickle in a receiver,
# whose cached copy merges the globals it carried again at each use, as a new copy would.
CACHED = 256  # functions kept on each side (the least recently used go)
_received: OrderedDict[bytes, tuple[types.FunctionType, list[tuple[dict, dict]]]] = OrderedDict()
_loading = threading.local()  # the (namespace, globals) merged while one is unpickled


def load_sent(digest: bytes, data: bytes) -> types.FunctionType:
    """The function ``data`` holds: unpickled once here, its globals merged at each use."""
    entry = _received.get(digest)
    if entry is not None:
        for namespace, carried in entry[1]:
            _merge(namespace, carried)
        return entry[0]
    outer = getattr(_loading, "merged", None)
    merged: list[tuple[dict[str, Any], dict[str, Any]]] = []
    _loading.merged = merged
    try:
        fn: types.FunctionType = pickle.loads(data)
    finally:
        _loading.merged = outer
    with _lock:
        _received[digest] = (fn, merged)
        while len(_received) > CACHED:
            _received.popitem(last=False)
    return fn


def _code_reduce(code: types.CodeType) -> tuple[Any, ...]:
    """cloudpickle's, keeping the code's file name (its ``<dynamic-code>`` instead would
    leave a child's traceback without the script's file and source lines)."""
    from cloudpickle import cloudpickle as cp

    make, args = cp._code_reduce(code)
    args = list(args)
    for i, arg in enumerate(args[:-1]):
        if arg == "<dynamic-code>" and args[i + 1] == code.co_name:
            args[i] = code.co_filename
            break
    return make, tuple(args)


_pickler: type[pickle.Pickler] | None = None


def pickler() -> type[pickle.Pickler]:
    """cloudpickle's Pickler, sending the functions of a ``__main__`` with its key."""
    global _pickler
    if _pickler is None:
        import cloudpickle

        class CloudPickler(cloudpickle.Pickler):
            dispatch_table = ChainMap(
                {types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table
            )

            def _dynamic_function_reduce(self, func: types.FunctionType) -> tuple[Any, ...]:
                reduced: tuple[Any, ...] = super()._dynamic_function_reduce(func)
                key = _key_of(func.__globals__)
                if key is None:
                    return reduced
                _make_fn, (code, base, name, argdefs, closure), state, *rest = reduced
                return (_make, (key, base, code, name, argdefs, closure), state, *rest[:2],
                        _setstate)  # fmt: skip

        _pickler = CloudPickler
    return _pickler


def dumps(obj: object, *, protocol: int, buffer_callback: Any = None) -> bytes:
    """``cloudpickle.dumps`` with :func:`pickler`."""
    out = io.BytesIO()
    pickler()(out, protocol=protocol, buffer_callback=buffer_callback).dump(obj)
    return out.getvalue()
