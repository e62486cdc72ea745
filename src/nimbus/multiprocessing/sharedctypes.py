"""ctypes objects shared by a program's processes: ``Value``, ``Array`` and their raw forms.

Where they live depends on where the program's processes run:

- **This host's shared memory**, for a program on the local runtime (the
  default): the objects are real ctypes objects over a block of
  ``nimbus.multiprocessing._heap``, as the stdlib's, so children write in place
  and ``np.frombuffer(arr.get_obj())`` works. They pickle as their block (any
  process of the program on this host maps the same memory), through the
  program's pickler as in the stdlib; plain ``pickle`` copies them.
- **The state store**, for a program on a remote endpoint, or with
  ``NIMBUS_SHARED_MEMORY=0``: processes that share no memory. Each object is one
  Redis string holding its raw ctypes bytes (``value:<name>`` / ``array:<name>``). A
  read fetches the bytes it needs (GETRANGE) and decodes them with
  ``from_buffer_copy``; a write encodes with ctypes (so wrong types fail as in
  ctypes) and SETRANGEs the bytes of the elements it changes. Objects pickle
  as (program, name, type, length). What differs from shared memory: a field
  of a ``Structure`` or an element of an array of structures is read as a copy;
  change it by assigning the whole field or element (``a[0] = Point(1, 2)``).
  Bit fields are not supported, nor is the buffer protocol.

``Value``/``Array`` with ``lock=True`` guard every access with a new
re-entrant lock kept where the object is: in shared memory a robust
process-shared mutex (``_mutex``, released for you if its holder dies), in
the store a nimbus ``RLock`` (released with its keys' expiry). For an object in
the store, an access that finds the lock free (or held by the calling
thread) runs as one Lua script that checks the lock and reads or writes:
acquire + access + release in one round trip.
"""

from __future__ import annotations

import contextlib
import copy as _copy
import ctypes
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from types import TracebackType
from typing import Any

from nimbus.errors import StateStoreError
from nimbus.multiprocessing import _heap as heap
from nimbus.multiprocessing import _mutex, _site
from nimbus.multiprocessing.synchronize import Lock, RLock
from nimbus.statestore import Keys, Program
from nimbus.statestore import link as _link
from nimbus.statestore.lua import (
    ARRAY_GUARDED as _GUARDED,
)

__all__ = ["Array", "RawArray", "RawValue", "Value", "copy", "synchronized"]

typecode_to_type: dict[str, Any] = {
    "c": ctypes.c_char,
    "u": ctypes.c_wchar,
    "b": ctypes.c_byte,
    "B": ctypes.c_ubyte,
    "h": ctypes.c_short,
    "H": ctypes.c_ushort,
    "i": ctypes.c_int,
    "I": ctypes.c_uint,
    "l": ctypes.c_long,
    "L": ctypes.c_ulong,
    "q": ctypes.c_longlong,
    "Q": ctypes.c_ulonglong,
    "f": ctypes.c_float,
    "d": ctypes.c_double,
}


def _ctype(typecode_or_type: Any) -> Any:
    ctype = typecode_to_type.get(typecode_or_type, typecode_or_type)
    if not (isinstance(ctype, type) and issubclass(ctype, ctypes._SimpleCData | ctypes.Structure)):
        raise TypeError(f"expected a type code or a ctypes type, not {typecode_or_type!r}")
    return ctype


class _Raw:
    """Bytes in the store laid out as ``length`` items of ``ctype`` (length None: one item)."""

    def __init__(
        self, program: Program, key: str, name: str, ctype: Any, length: int | None
    ) -> None:
        self._program = program
        self._key = key
        self._name = name
        self._ctype = ctype
        self._length = length
        self._size = ctypes.sizeof(ctype)
        self._guard: Lock | None = None  # set on the view a synchronized wrapper uses

    def _guarded_view(self, lock: Lock) -> Any:
        """This object, with every access checking ``lock`` (see the module doc)."""
        view = _copy.copy(self)
        view._guard = lock
        return view

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._program, self._key, self._name, self._ctype, self._length))

    def _create(self, data: bytes) -> None:
        _link(self._program).command("SET", self._key, data, "PX", self._program.ttl_ms)

    def _get(self, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of the object."""
        if stop <= start:
            return b""
        guard = self._guard
        if guard is None:
            data = _link(self._program).command("GETRANGE", self._key, start, stop - 1)
        else:
            data = self._guarded(guard, "get", start, stop - 1)
        if len(data) != stop - start:
            raise StateStoreError(
                f"{self!r} is gone from the state store at {self._program.url} "
                f"(its program ended or its keys expired)"
            )
        return bytes(data)

    def _put(self, offset: int, data: bytes) -> None:
        guard = self._guard
        if guard is None:
            _link(self._program).command("SETRANGE", self._key, offset, data)
        else:
            self._guarded(guard, "set", offset, data)

    def _guarded(self, guard: Lock, op: str, a: Any, b: Any) -> Any:
        link = _link(self._program)
        if guard._depth(link):  # this thread holds the lock: the access is already guarded
            return link.command("GETRANGE" if op == "get" else "SETRANGE", self._key, a, b)
        keys = (guard._tokens, self._key)
        reply = link.eval(_GUARDED, keys, (op, a, b))
        if reply[0] == 1:
            return reply[1] if op == "get" else None
        with guard:  # held by another thread or process: wait for it
            return link.command("GETRANGE" if op == "get" else "SETRANGE", self._key, a, b)

    def _copy(self) -> Any:
        """A private ctypes object with the current contents."""
        raise NotImplementedError

    def __repr__(self) -> str:
        kind = self._ctype.__name__ + ("" if self._length is None else f"[{self._length}]")
        return f"<shared {kind} {self._name} of program {self._program.program_id}>"


class SharedValue(_Raw):
    """One ctypes value: ``.value`` for simple types, the fields for a ``Structure``."""

    @property
    def value(self) -> Any:
        if issubclass(self._ctype, ctypes.Structure):
            raise AttributeError(f"{self._ctype.__name__} has no attribute 'value'")
        return self._ctype.from_buffer_copy(self._get(0, self._size)).value

    @value.setter
    def value(self, value: Any) -> None:
        self._put(0, bytes(self._ctype(value)))

    def _fields(self) -> dict[str, Any]:
        return {f[0]: f for f in getattr(self._ctype, "_fields_", ())}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self._fields():
            raise AttributeError(name)
        field = getattr(self._ctype, name)
        data = self._get(field.offset, field.offset + field.size)
        whole = bytes(field.offset) + data + bytes(self._size - field.offset - field.size)
        return getattr(self._ctype.from_buffer_copy(whole), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name not in self._fields():
            object.__setattr__(self, name, value)
            return
        field = getattr(self._ctype, name)
        scratch = self._ctype()
        setattr(scratch, name, value)
        self._put(field.offset, bytes(scratch)[field.offset : field.offset + field.size])

    def _copy(self) -> Any:
        return self._ctype.from_buffer_copy(self._get(0, self._size))


class SharedArray(_Raw):
    """A fixed-length array: indexing, slices, ``len``, iteration; ``value``/``raw`` for chars."""

    _length: int

    def __len__(self) -> int:
        return self._length

    def _decode(self, data: bytes) -> Any:
        return (self._ctype * (len(data) // self._size)).from_buffer_copy(data)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            if step == 1:
                return self._decode(self._get(start * self._size, max(start, stop) * self._size))[:]
            return self._decode(self._get(0, self._length * self._size))[index]
        i = self._index(index)
        return self._decode(self._get(i * self._size, (i + 1) * self._size))[0]

    def __setitem__(self, index: int | slice, value: Any) -> None:
        if isinstance(index, slice):
            positions = range(*index.indices(self._length))
            if len(value) != len(positions):
                raise ValueError("Can only assign sequence of same size")
            scratch = (self._ctype * len(positions))()
            scratch[:] = value
            if not positions:
                return
            if positions.step == 1:
                self._put(positions.start * self._size, bytes(scratch))
                return
            data = bytes(scratch)
            with self._guard if self._guard is not None else contextlib.nullcontext():
                for n, i in enumerate(positions):
                    self._put(i * self._size, data[n * self._size : (n + 1) * self._size])
            return
        scratch = (self._ctype * 1)()
        scratch[0] = value
        self._put(self._index(index) * self._size, bytes(scratch))

    def _index(self, index: int) -> int:
        i = index + self._length if index < 0 else index
        if not 0 <= i < self._length:
            raise IndexError("invalid index")
        return i

    def __iter__(self) -> Iterator[Any]:
        return iter(self[:])

    def _copy(self) -> Any:
        return self._decode(self._get(0, self._length * self._size))

    @property
    def value(self) -> Any:
        if self._ctype not in (ctypes.c_char, ctypes.c_wchar):
            raise AttributeError("only arrays of 'c' or 'u' have a value")
        return self._copy().value

    @value.setter
    def value(self, value: Any) -> None:
        if self._ctype not in (ctypes.c_char, ctypes.c_wchar):
            raise AttributeError("only arrays of 'c' or 'u' have a value")
        scratch = (self._ctype * self._length)()
        scratch.value = value  # validates (type, length) as ctypes does
        n = min(len(value) + 1, self._length) * self._size
        self._put(0, bytes(scratch)[:n])

    @property
    def raw(self) -> bytes:
        if self._ctype is not ctypes.c_char:
            raise AttributeError("only arrays of 'c' have raw")
        return self._get(0, self._length)

    @raw.setter
    def raw(self, value: bytes) -> None:
        if self._ctype is not ctypes.c_char:
            raise AttributeError("only arrays of 'c' have raw")
        (ctypes.c_char * self._length)().raw = value  # validates as ctypes does
        self._put(0, bytes(value))


# ---------------------------------------------------------------- constructors


def RawValue(typecode_or_type: Any, *args: Any, program: Program | None = None) -> Any:
    """A shared ctypes value, initialised as ``ctype(*args)``; no lock."""
    ctype = _ctype(typecode_or_type)
    prog = program if program is not None else _site.shared_program()
    return _new(prog, ctype, None, bytes(ctype(*args)))


def RawArray(
    typecode_or_type: Any, size_or_initializer: Any, *, program: Program | None = None
) -> Any:
    """A shared ctypes array of a length or of the items of a sequence; no lock."""
    ctype = _ctype(typecode_or_type)
    prog = program if program is not None else _site.shared_program()
    if isinstance(size_or_initializer, int):
        if size_or_initializer < 0:
            raise ValueError("array size must be >= 0")
        return _new(prog, ctype, size_or_initializer, ctypes.sizeof(ctype) * size_or_initializer)
    items = list(size_or_initializer)
    return _new(prog, ctype, len(items), bytes((ctype * len(items))(*items)))


def _new(prog: Program, ctype: Any, length: int | None, data: bytes | int) -> Any:
    """A new shared object of ``data`` (an int: that many zero bytes; ``length`` None:
    one ``ctype``), where ``prog`` keeps them."""
    if prog.shared is not None:
        return _rebuild(ctype, length, heap.Block.new(prog.shared, data))
    if isinstance(data, int):
        data = bytes(data)
    name = Keys.new_name()
    obj: _Raw
    if length is None:
        obj = SharedValue(prog, prog.keys.value(name), name, ctype, None)
    else:
        obj = SharedArray(prog, prog.keys.array(name), name, ctype, length)
    obj._create(data)
    return obj


def _rebuild(ctype: Any, length: int | None, block: heap.Block) -> Any:
    """The ctypes object (``length`` None: one ``ctype``) over a block of shared memory."""
    typ = ctype if length is None else ctype * length
    obj = typ.from_buffer(block.map)
    obj._block = block
    ForkingPickler.register(typ, _reduce)  # as the stdlib: the program's pickler shares it
    return obj


def _reduce(obj: Any) -> tuple[Any, ...]:
    block = getattr(obj, "_block", None)
    if isinstance(obj, ctypes.Array):
        if block is None:  # a private array of a type some shared one has: a copy
            return (_private, (obj._type_, obj._length_, bytes(obj)))
        return (_rebuild, (obj._type_, obj._length_, block))
    if block is None:
        return obj.__reduce__()  # type: ignore[no-any-return]
    return (_rebuild, (type(obj), None, block))


def _private(ctype: Any, length: int, data: bytes) -> Any:
    return (ctype * length).from_buffer_copy(data)


def Value(
    typecode_or_type: Any,
    *args: Any,
    lock: Any = True,
    ctx: object = None,
    program: Program | None = None,
) -> Any:
    """A shared value guarded by ``lock`` (True: a new RLock; False: none, a raw value)."""
    prog = program if program is not None else _site.shared_program()
    if lock not in (True, False, None):
        _checked(lock)
    obj = RawValue(typecode_or_type, *args, program=prog)
    if lock is False:
        return obj
    return _synchronized(obj, _new_lock(prog) if lock in (True, None) else lock)


def Array(
    typecode_or_type: Any,
    size_or_initializer: Any,
    *,
    lock: Any = True,
    ctx: object = None,
    program: Program | None = None,
) -> Any:
    """A shared array guarded by ``lock`` (True: a new RLock; False: none, a raw array)."""
    prog = program if program is not None else _site.shared_program()
    if lock not in (True, False, None):
        _checked(lock)
    obj = RawArray(typecode_or_type, size_or_initializer, program=prog)
    if lock is False:
        return obj
    return _synchronized(obj, _new_lock(prog) if lock in (True, None) else lock)


def _new_lock(prog: Program) -> Any:
    """A new RLock where ``prog`` keeps its objects: this host's shared memory, or the store."""
    if prog.shared is not None and _mutex.available():
        return _mutex.HostRLock.new(prog.shared)
    return RLock(program=prog)


def _checked(lock: Any) -> None:
    if not hasattr(lock, "acquire"):
        raise AttributeError(f"{lock!r} has no method 'acquire'")


_CDATA = (ctypes._SimpleCData, ctypes.Structure, ctypes.Union, ctypes.Array)


def copy(obj: Any) -> Any:
    """A new shared object with the type and current contents of ``obj``."""
    if isinstance(obj, SynchronizedBase):
        obj = obj.get_obj()
    if isinstance(obj, _Raw):
        return _new(obj._program, obj._ctype, obj._length, bytes(obj._copy()))
    if isinstance(obj, ctypes.Array):
        return _new(_site.program(), obj._type_, obj._length_, bytes(obj))
    if isinstance(obj, _CDATA):
        return _new(_site.program(), type(obj), None, bytes(obj))
    raise TypeError(f"copy() needs a ctypes object or a shared one, not {type(obj).__name__}")


def synchronized(obj: Any, lock: Any = None, ctx: object = None) -> Any:
    """Wrap a raw shared object so every access holds ``lock`` (default: a new RLock)."""
    if isinstance(obj, SynchronizedBase):
        raise TypeError("object already synchronized")
    if not isinstance(obj, (_Raw, *_CDATA)):
        raise TypeError(f"synchronized() needs a ctypes object, not {type(obj).__name__}")
    if lock is None:
        lock = _new_lock(obj._program if isinstance(obj, _Raw) else _site.program())
    return _synchronized(obj, lock)


def _synchronized(obj: Any, lock: Any) -> Any:
    if isinstance(obj, SharedArray | ctypes.Array):
        item = obj._ctype if isinstance(obj, SharedArray) else obj._type_
        if item is ctypes.c_char:
            return SynchronizedString(obj, lock)
        return SynchronizedArray(obj, lock)
    return Synchronized(obj, lock)


# ---------------------------------------------------------------- synchronized wrappers


class SynchronizedBase:
    """A raw object and the lock every access holds, as in the stdlib."""

    def __init__(self, obj: Any, lock: Any) -> None:
        self._obj = obj
        self._lock = lock
        self.acquire = lock.acquire
        self.release = lock.release
        # nimbus locks are checked inside one script per access (see the module doc)
        self._fast = (
            isinstance(obj, _Raw)
            and isinstance(lock, Lock)
            and lock._program.url == obj._program.url
        )
        self._view = obj._guarded_view(lock) if self._fast else obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._obj, self._lock))

    def __enter__(self) -> Any:
        return self._lock.__enter__()

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Any:
        return self._lock.__exit__(typ, exc, tb)

    def get_obj(self) -> Any:
        return self._obj

    def get_lock(self) -> Any:
        return self._lock

    def _run(self, fn: Any, *args: Any) -> Any:
        if self._fast:
            return fn(self._view, *args)
        lock = self._lock
        lock.acquire()
        try:
            return fn(self._obj, *args)
        finally:
            lock.release()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} wrapper for {self._obj!r}>"


class Synchronized(SynchronizedBase):
    @property
    def value(self) -> Any:
        return self._run(getattr, "value")

    @value.setter
    def value(self, value: Any) -> None:
        self._run(setattr, "value", value)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return self._run(getattr, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name in ("acquire", "release", "value"):
            object.__setattr__(self, name, value)
        else:
            self._run(setattr, name, value)


class SynchronizedArray(SynchronizedBase):
    def __len__(self) -> int:
        return len(self._obj)

    def __getitem__(self, index: int | slice) -> Any:
        return self._run(type(self._obj).__getitem__, index)

    def __setitem__(self, index: int | slice, value: Any) -> None:
        self._run(type(self._obj).__setitem__, index, value)

    def __iter__(self) -> Iterator[Any]:
        return iter(self[:])


class SynchronizedString(SynchronizedArray):
    @property
    def value(self) -> Any:
        return self._run(getattr, "value")

    @value.setter
    def value(self, value: Any) -> None:
        self._run(setattr, "value", value)

    @property
    def raw(self) -> bytes:
        return bytes(self._run(getattr, "raw"))

    @raw.setter
    def raw(self, value: bytes) -> None:
        self._run(setattr, "raw", value)
