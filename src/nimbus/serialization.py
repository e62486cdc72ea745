"""Payload serialization: pickle protocol 5 with out-of-band buffers.

``dumps(obj)`` returns ``(data, buffers)``: ``data`` is a small pickle and
``buffers`` are the large blocks of memory (numpy arrays, and ``bytes`` or
``bytearray`` values of 64 KiB or more at the top level of the object or of
its tuple, list or dict) that travel beside it without being copied into it.
``loads(data, buffers)`` rebuilds the object.

Plain ``pickle`` is tried first because it is several times faster; it falls
back to ``cloudpickle`` when the object holds something plain pickle cannot
send by value: lambdas, closures, and functions or classes defined in
``__main__`` (which a worker, running another main module, could not import).
cloudpickle (and what it imports: logging, typing, dataclasses, ...) is
imported on first use: a worker whose tasks pickle plainly never imports it,
and one that unpickles a function sent by value imports it then.

A ``__main__``'s functions sent by value are each pickled once while the globals
they read are unchanged (``_mainpickle``), and share one namespace per sending
``__main__`` where they arrive (``_mainspace``).
"""

from __future__ import annotations

import copyreg
import functools
import io
import os
import pickle
import sys
import threading
import types
from collections import ChainMap
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any, Protocol

from nimbus.errors import DeserializationError, SerializationError

__all__ = [
    "OOB_THRESHOLD",
    "PYTHON",
    "FunctionCache",
    "PickleSerializer",
    "Serializer",
    "adopt_main",
    "describe",
    "dumps",
    "dumps_exception",
    "dumps_function",
    "loads",
]

PROTOCOL = 5
PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"  # whose pickles these are: both sides match
OOB_THRESHOLD = 64 * 1024
Buffer = bytes | bytearray | memoryview


class Serializer(Protocol):
    """What a serializer of payloads must do."""

    def dumps(self, obj: object) -> tuple[bytes, list[pickle.PickleBuffer]]: ...

    def loads(self, data: Buffer, buffers: Sequence[Buffer] = ()) -> Any: ...


def _rebuild_bytes(buf: Buffer | pickle.PickleBuffer) -> bytes:
    """``bytes`` from a received buffer, without a copy when it already is one."""
    if type(buf) is bytes:
        return buf
    view = memoryview(buf)
    if isinstance(view.obj, bytes) and view.nbytes == len(view.obj):
        return view.obj
    return view.tobytes()


def _rebuild_bytearray(buf: Buffer | pickle.PickleBuffer) -> bytearray:
    """``bytearray`` from a received buffer, without a copy when it already is one."""
    if type(buf) is bytearray:
        return buf
    view = memoryview(buf)
    if isinstance(view.obj, bytearray) and view.nbytes == len(view.obj):
        return view.obj
    return bytearray(view)


class _OutOfBand:
    """Wraps a large bytes-like value so the pickler sends it out of band."""

    __slots__ = ("value",)

    def __init__(self, value: bytes | bytearray) -> None:
        self.value = value

    def __reduce_ex__(self, protocol: object) -> tuple[object, ...]:
        rebuild = _rebuild_bytes if isinstance(self.value, bytes) else _rebuild_bytearray
        return (rebuild, (pickle.PickleBuffer(self.value),))


def _wrap(value: object) -> object:
    if type(value) in (bytes, bytearray) and len(value) >= OOB_THRESHOLD:  # type: ignore[arg-type]
        return _OutOfBand(value)  # type: ignore[arg-type]
    return value


_UNMARKED = frozenset((int, float, str, bool, type(None)))  # never marked, nothing inside


def _wrap_top(obj: object) -> object:
    """Mark the large bytes values at the top of ``obj`` for out-of-band sending."""
    kind = type(obj)
    if kind in (bytes, bytearray):
        return _wrap(obj)
    if kind is tuple:
        if _UNMARKED.issuperset(map(type, obj)):  # type: ignore[call-overload]  # nothing to mark
            return obj
        items = tuple([_wrap_top(v) if type(v) in (tuple, dict) else _wrap(v) for v in obj])  # type: ignore[attr-defined]
        return items
    if kind is dict and not obj:
        return obj
    if kind is list:
        return [_wrap(v) for v in obj]  # type: ignore[attr-defined]
    if kind is dict:
        return {k: _wrap(v) for k, v in obj.items()}  # type: ignore[attr-defined]
    return obj


def describe(obj: object, limit: int = 80) -> str:
    """A short description of ``obj`` for error messages."""
    try:
        text = repr(obj)
    except Exception:  # a broken __repr__ must not hide the real error
        text = object.__repr__(obj)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(obj).__module__}.{type(obj).__qualname__} {text}"


def _find_culprit(obj: object, depth: int = 0) -> object:
    """The innermost part of ``obj`` that fails to pickle (best effort)."""
    import cloudpickle

    if depth > 4:
        return obj
    if isinstance(obj, list | tuple | set | frozenset):
        parts: list[object] = list(obj)
    elif isinstance(obj, dict):
        parts = list(obj.values())
    else:
        parts = list(getattr(obj, "__dict__", {}).values())
    for part in parts:
        try:
            cloudpickle.dumps(part, protocol=PROTOCOL)
        except Exception:
            return _find_culprit(part, depth + 1)
    return obj


Reducers = MutableMapping[Any, Any]
_picklers: dict[int, tuple[type[pickle.Pickler], type[pickle.Pickler], type[pickle.Pickler]]] = {}
_NO_REDUCERS: Reducers = {}


def adopt_main(namespace: dict[str, Any]) -> None:
    """In a child that imported the program's main module (as spawn does): the functions
    of its parent's ``__main__`` sent by value get ``namespace`` (that module's) as their
    globals, with what they carry in it (``_mainspace.adopt``)."""
    from nimbus import _mainspace

    _mainspace.adopt(namespace)


def _picklers_for(
    reducers: Reducers,
) -> tuple[type[pickle.Pickler], type[pickle.Pickler], type[pickle.Pickler]]:
    """Plain, main-aware plain and cloudpickle picklers that also use ``reducers`` (a
    live mapping); the last two send a ``__main__``'s functions once (``_mainpickle``)."""
    from nimbus import _mainpickle

    found = _picklers.get(id(reducers))
    if found is None:
        table = ChainMap(reducers, copyreg.dispatch_table)
        plain = type("Pickler", (pickle.Pickler,), {"dispatch_table": table})
        aware, cloud = _mainpickle.picklers(table, reducers, protocol=PROTOCOL, carried=_Globals)
        found = _picklers[id(reducers)] = (plain, aware, cloud)
    return found


def _dump_with(
    pickler: type[pickle.Pickler], obj: object, buffers: list[pickle.PickleBuffer]
) -> bytes:
    out = io.BytesIO()
    pickler(out, protocol=PROTOCOL, buffer_callback=buffers.append).dump(obj)
    return out.getvalue()


def dumps(
    obj: object,
    *,
    reducers: Reducers | None = None,
    main_by_value: bool = True,
    main_imported: bool = False,
) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Pickle ``obj``; large buffers are returned apart, not copied.

    ``reducers`` maps types to reduce functions used before the defaults
    (for example ``multiprocessing.reduction.ForkingPickler._extra_reducers``,
    which hands file descriptors of connections to another process). With
    ``main_by_value=False``, functions and classes of ``__main__`` are pickled
    by reference, for a receiver that imports the same main module; with
    ``main_imported`` too (the receiver imported it, as a local guarded main's
    workers do), a function of it whose pickle with the globals it reads is over
    ``_mainpickle.LARGE_MAIN`` goes by reference.
    Raises :class:`SerializationError` naming the part that cannot be pickled.
    """
    buffers: list[pickle.PickleBuffer] = []
    wrapped = _wrap_top(obj)
    try:
        if main_by_value:
            from nimbus import _mainpickle

            aware = _picklers_for(_NO_REDUCERS if reducers is None else reducers)[1]
            data = _mainpickle.dump(aware, wrapped, buffers.append, imported=main_imported)
            if data is not None:
                return data, buffers
        elif reducers is None:
            return pickle.dumps(wrapped, protocol=PROTOCOL, buffer_callback=buffers.append), buffers
        else:
            return _dump_with(_picklers_for(reducers)[0], wrapped, buffers), buffers
    except Exception:
        pass
    cloud = _picklers_for(_NO_REDUCERS if reducers is None else reducers)[2]
    buffers = []
    try:
        data = _dump_with(cloud, wrapped, buffers)
    except Exception as exc:
        culprit = _find_culprit(obj)
        raise SerializationError(
            f"cannot pickle {describe(culprit)}: {type(exc).__name__}: {exc}. "
            "Pass only picklable objects (no open files, sockets, locks or generators)."
        ) from exc
    return data, buffers


def loads(data: Buffer, buffers: Sequence[Buffer] = ()) -> Any:
    """Unpickle what :func:`dumps` made."""
    try:
        return pickle.loads(data, buffers=buffers)
    except Exception as exc:
        raise DeserializationError(f"cannot unpickle payload: {type(exc).__name__}: {exc}") from exc


class PickleSerializer:
    """The default :class:`Serializer`: :func:`dumps` and :func:`loads`."""

    dumps = staticmethod(dumps)
    loads = staticmethod(loads)


def dumps_function(fn: Callable[..., object], *, by_value: bool = False) -> bytes:
    """Pickle a callable by value where needed (cloudpickle).

    With ``by_value``, a function of the caller's own code (a module outside the
    standard library and the installed packages) is pickled with its code, for a
    receiver on another machine that cannot import that module.
    """
    import cloudpickle

    from nimbus import _mainspace

    modules = _user_modules(fn) if by_value else []
    try:
        if modules:
            with _lock:
                for module in modules:
                    cloudpickle.register_pickle_by_value(module)
                try:
                    data: bytes = _mainspace.dumps(fn, protocol=PROTOCOL)
                finally:
                    for module in modules:
                        cloudpickle.unregister_pickle_by_value(module)
        else:
            data = _mainspace.dumps(fn, protocol=PROTOCOL)
        return data
    except Exception as exc:
        raise SerializationError(_function_refusal(fn, exc)) from exc


_TYPE_NAMES = {"_thread.lock": "threading.Lock", "_thread.RLock": "threading.RLock"}


def _function_name(fn: object) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if not isinstance(name, str):
        return describe(fn)
    module = getattr(fn, "__module__", None)
    return f"{name} (module {module})" if module else name


def _function_refusal(fn: object, exc: Exception) -> str:
    """Why ``fn`` cannot be pickled: the global, closure variable or default it carries
    that cannot be (best effort), else the error itself."""
    import cloudpickle

    what = f"cannot pickle the function {_function_name(fn)}"
    cause = f"{type(exc).__name__}: {exc}"
    code = getattr(fn, "__code__", None)
    names: list[tuple[str, str, object]] = []
    if code is not None:
        namespace = getattr(fn, "__globals__", {})
        names += [("global", n, namespace[n]) for n in code.co_names if n in namespace]
        for n, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or (), strict=False):
            try:
                names.append(("variable of its closure", n, cell.cell_contents))
            except ValueError:  # an empty cell
                pass
        for value in getattr(fn, "__defaults__", None) or ():
            names.append(("default", describe(value, 40), value))
    for kind, name, value in names:
        if isinstance(value, types.FunctionType | types.ModuleType):
            continue  # functions and modules: looked at through their own pickling
        try:
            cloudpickle.dumps(value, protocol=PROTOCOL)
        except Exception as inner:
            held = type(value)
            typename = f"{held.__module__}.{held.__qualname__}"
            typename = _TYPE_NAMES.get(typename, typename)
            return (
                f"{what}: it refers to {kind} {name!r}, a {typename}, which cannot be pickled "
                f"({type(inner).__name__}: {inner}); create it in the task, or pass what "
                "the task needs as an argument"
            )
    return f"{what}: {cause}"


_lock = threading.Lock()


def _user_modules(fn: object) -> list[types.ModuleType]:
    """The modules of ``fn`` (and of a partial's callables, nested too) that are the caller's
    own code."""
    import sysconfig

    targets = [fn]
    while any(isinstance(t, functools.partial) for t in targets):  # partials of partials too
        targets = [
            x
            for t in targets
            for x in ([t.func, *t.args] if isinstance(t, functools.partial) else [t])
        ]
    installed = [
        os.path.realpath(sysconfig.get_paths()[k]) + os.sep
        for k in ("stdlib", "platstdlib", "purelib", "platlib")
    ]
    out: list[types.ModuleType] = []
    for target in targets:
        if not callable(target):
            continue
        name = getattr(target, "__module__", None)
        if not isinstance(name, str) or name == "__main__" or name.split(".")[0] == "nimbus":
            continue  # __main__ goes by value anyway; nimbus is on every endpoint
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if module is None or not path or module in out:
            continue
        if not any(os.path.realpath(path).startswith(p) for p in installed):
            out.append(module)
    return out


def _fixed(fn: object) -> bool:
    """Whether pickling ``fn`` gives the same bytes while its globals are unchanged.

    Functions without a closure, builtins and classes qualify, and partials
    of them whose arguments are such callables too. Closures, bound methods
    and callable objects carry state that may change between calls.
    """
    if isinstance(fn, types.FunctionType):
        return fn.__closure__ is None
    if isinstance(fn, types.BuiltinFunctionType | type):
        return True
    if isinstance(fn, functools.partial):
        return (
            _fixed(fn.func) and not fn.keywords and all(callable(a) and _fixed(a) for a in fn.args)
        )
    return False


# by id (hashing a code object hashes its bytecode): the code, kept alive, and its names
_code_names: dict[int, tuple[types.CodeType, tuple[str, ...]]] = {}


def _names(code: types.CodeType) -> tuple[str, ...]:
    """The global names ``code`` (and the functions nested in it) may read, sorted."""
    entry = _code_names.get(id(code))
    if entry is not None and entry[0] is code:
        return entry[1]
    found = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found.update(_names(const))
    if len(_code_names) >= 4096:
        _code_names.clear()
    names = tuple(sorted(found))
    _code_names[id(code)] = (code, names)
    return names


def _by_reference(fn: types.FunctionType, by_value: tuple[str, ...]) -> bool:
    """Whether cloudpickle pickles ``fn`` by reference (the receiver imports it)."""
    name = fn.__module__
    if name == "__main__" or name in by_value:
        return False
    obj: object = sys.modules.get(name)
    for part in fn.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is fn


_SCALARS = frozenset({int, float, complex, str, bytes, bool, type(None)})
_BY_IDENTITY = (types.FunctionType, types.ModuleType, type, types.BuiltinFunctionType)
_ABSENT = object()


class _Globals:
    """The globals and defaults a function sent by value carried when it was pickled.

    cloudpickle copies into the pickle of a function of ``__main__`` (or of a
    module sent by value) the globals it reads, and those of the functions it
    calls. :meth:`current` says whether they are still the same: each name
    still bound to the same object, or to an equal number or string; lists,
    dicts and other objects among them also equal as pickled. Large blocks of
    memory (a numpy array, a ``bytearray`` of 64 KiB or more), bound to a name
    or inside such an object, are compared by identity only: a change of their
    contents in place is not seen (bind the name to a new array instead).
    Raises (``pickle.PicklingError`` and others) for values that plain pickle
    cannot take; such a function is pickled at every submit.
    """

    __slots__ = ("bound", "data", "large", "pickled")

    def __init__(self, fn: object, by_value: tuple[str, ...]) -> None:
        self.bound: list[tuple[dict[str, Any], str, object]] = []  # scope, name, object
        self.pickled: list[Callable[[], object]] = []  # read again at each check
        todo = [fn.func, *fn.args] if isinstance(fn, functools.partial) else [fn]
        seen: set[int] = set()
        while todo:
            f = todo.pop()
            if not isinstance(f, types.FunctionType) or id(f) in seen:
                continue
            if _by_reference(f, by_value):
                continue
            seen.add(id(f))
            if f.__defaults__ or f.__kwdefaults__:
                self.pickled.append(functools.partial(_defaults, f))
            scope = f.__globals__
            for name in _names(f.__code__):
                value = scope.get(name, _ABSENT)  # absent: a builtin, or an attribute's name
                if value is _ABSENT:
                    continue
                self.bound.append((scope, name, value))
                if isinstance(value, types.FunctionType):
                    todo.append(value)
                elif not (
                    type(value) in _SCALARS
                    or isinstance(value, _BY_IDENTITY)
                    or _large_buffer(value)
                ):
                    self.pickled.append(functools.partial(scope.get, name))
        self.data, self.large = self._dump()

    def _dump(self) -> tuple[bytes, list[object]]:
        if not self.pickled:
            return b"", []
        large: list[object] = []

        def in_band(buf: pickle.PickleBuffer) -> bool:
            view = memoryview(buf)
            if view.nbytes < OOB_THRESHOLD:
                return True
            large.append(view.obj)
            return False

        values = [read() for read in self.pickled]
        return pickle.dumps(values, protocol=PROTOCOL, buffer_callback=in_band), large

    def current(self) -> bool:
        for scope, name, old in self.bound:
            value = scope.get(name, _ABSENT)
            if value is not old and (
                type(value) is not type(old) or type(value) not in _SCALARS or value != old
            ):
                return False
        if not self.pickled:
            return True
        data, large = self._dump()
        if data != self.data or len(large) != len(self.large):
            return False
        return all(new is old for new, old in zip(large, self.large, strict=True))


def _large_buffer(value: object) -> bool:
    """Whether ``value`` is a large block of memory (a numpy array): compared by identity."""
    try:
        return memoryview(value).nbytes >= OOB_THRESHOLD  # type: ignore[arg-type]
    except TypeError:
        return False


def _defaults(fn: types.FunctionType) -> object:
    return fn.__defaults__, fn.__kwdefaults__


class FunctionCache:
    """Serialized functions by object, keyed by a hash of their pickle.

    Pickling a function with cloudpickle costs tens of microseconds, so a
    function whose pickle cannot change (see :func:`_fixed`) is pickled once;
    workers in turn keep the unpickled function by its key. A function sent by
    value (one of ``__main__``) carries the globals it reads: it is pickled
    again, under a new key, when one of them changes (see :class:`_Globals`;
    a large array changed in place is not seen). Others (closures, bound
    methods) are pickled at each call, so they carry current values.
    Bounded: the oldest entries are dropped.
    """

    def __init__(self, size: int = 1024, *, by_value: bool = False) -> None:
        self._size = size
        self._by_value = by_value
        self._entries: dict[int, tuple[Callable[..., object], str, bytes, _Globals | None]] = {}

    def get(self, fn: Callable[..., object]) -> tuple[str, bytes]:
        entry = self._entries.get(id(fn))
        if entry is not None and entry[0] is fn:
            carried = entry[3]
            try:
                if carried is None or carried.current():
                    return entry[1], entry[2]
            except Exception:
                pass  # a global plain pickle cannot take any more: pickle the function again
        cacheable = _fixed(fn)
        carried = None
        if cacheable:
            try:  # before pickling: a change made meanwhile is seen at the next call
                carried = _Globals(fn, self._modules(fn))
            except Exception:
                cacheable = False  # globals plain pickle cannot take: pickled at each call
            else:
                if not carried.bound and not carried.pickled:
                    carried = None  # nothing that can change
        data = dumps_function(fn, by_value=self._by_value)
        import hashlib

        key = hashlib.blake2b(data, digest_size=12).hexdigest()
        if cacheable:
            if len(self._entries) >= self._size:
                del self._entries[next(iter(self._entries))]
            self._entries[id(fn)] = (fn, key, data, carried)
        return key, data

    def _modules(self, fn: object) -> tuple[str, ...]:
        """Modules other than ``__main__`` that ``fn`` is sent by value with."""
        if not self._by_value:
            return ()
        return tuple(module.__name__ for module in _user_modules(fn))


def dumps_exception(exc: BaseException, tb_text: str) -> bytes:
    """Pickle an exception with its traceback text; never raises."""
    import cloudpickle

    try:
        data: bytes = cloudpickle.dumps((exc, tb_text), protocol=PROTOCOL)
        pickle.loads(data)  # an exception that pickles may still fail to unpickle
        return data
    except Exception:
        from nimbus.errors import RemoteError

        name = f"{type(exc).__module__}.{type(exc).__qualname__}"
        fallback = RemoteError(f"{name}: {_safe_str(exc)}", name, tb_text)
        return pickle.dumps((fallback, tb_text), protocol=PROTOCOL)


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return "<unprintable>"
