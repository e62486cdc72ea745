"""nimbus.serialization: pickle protocol 5 with out-of-band buffers, cloudpickle fallback."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from nimbus import serialization
from nimbus.errors import DeserializationError, RemoteError, SerializationError
from nimbus.serialization import FunctionCache, dumps, dumps_exception, loads

BIG = 1 << 20


def roundtrip(obj: object) -> object:
    data, buffers = dumps(obj)
    return loads(data, buffers)


def double(x: int) -> int:
    return 2 * x


def triple(x: int) -> int:
    return 3 * x


@pytest.mark.parametrize(
    "obj",
    [
        None,
        True,
        0,
        -(10**40),
        1.5,
        complex(1, 2),
        "text ünïcode",
        b"",
        b"small",
        bytearray(b"abc"),
        (1, (2, 3)),
        [1, [2, [3]]],
        {"a": 1, 2: "b", (3,): [4]},
        {1, 2, 3},
        frozenset({"x"}),
        range(3, 10, 2),
        slice(1, 5),
        ValueError("boom"),
    ],
    ids=repr,
)
def test_builtins_round_trip(obj: object) -> None:
    back = roundtrip(obj)
    if isinstance(obj, BaseException):
        assert type(back) is type(obj) and back.args == obj.args
    else:
        assert back == obj
        assert type(back) is type(obj)


def test_lambda_round_trip() -> None:
    fn = roundtrip(lambda x: x + 1)
    assert fn(1) == 2


def test_closure_round_trip() -> None:
    base = 10

    def add(x: int) -> int:
        return x + base

    fn = roundtrip(add)
    assert fn(5) == 15


def test_dynamic_main_class_uses_cloudpickle() -> None:
    cls = type("Dynamic", (), {"__module__": "__main__", "value": 7, "get": lambda self: 42})
    obj = cls()
    obj.attr = "x"
    # plain pickle cannot send it by reference (no such attribute in __main__)
    with pytest.raises(pickle.PicklingError):
        pickle.dumps(obj, protocol=5)
    back = roundtrip(obj)
    assert back.attr == "x"
    assert back.value == 7
    assert back.get() == 42


@pytest.mark.parametrize(
    "make",
    [
        lambda b: b,
        lambda b: bytearray(b),
        lambda b: (b, 1),
        lambda b: [1, b],
        lambda b: {"k": b},
        lambda b: ((b,), {"kw": b}),  # the (args, kwargs) shape the executor sends
    ],
    ids=["bytes", "bytearray", "tuple", "list", "dict", "args-kwargs"],
)
def test_large_top_level_bytes_go_out_of_band(make) -> None:
    payload = bytes(range(256)) * (BIG // 256)
    obj = make(payload)
    data, buffers = dumps(obj)
    assert buffers, "a large top-level bytes value should travel out of band"
    assert len(data) < 1024
    back = loads(data, buffers)
    assert back == obj
    assert type(back) is type(obj)


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview], ids=lambda k: k.__name__)
@pytest.mark.parametrize("value_type", [bytes, bytearray], ids=lambda k: k.__name__)
def test_large_bytes_load_from_received_buffers(kind, value_type) -> None:
    """BUG: the receiver has plain buffers (from nimbus.wire), not PickleBuffer objects."""
    value = value_type(b"r" * BIG)
    data, buffers = dumps((value,))
    received = [kind(bytes(b.raw())) for b in buffers]  # what Channel.receive hands over
    (back,) = loads(data, received)
    assert type(back) is value_type and back == value


def test_small_bytes_stay_in_band() -> None:
    data, buffers = dumps(b"x" * 100)
    assert buffers == []
    assert loads(data) == b"x" * 100


def test_numpy_arrays_go_out_of_band() -> None:
    np = pytest.importorskip("numpy")
    for arr in (np.arange(100_000, dtype=np.float64), np.asfortranarray(np.ones((300, 400)))):
        data, buffers = dumps(arr)
        assert buffers
        assert len(data) < 1024
        back = loads(data, [b.raw() for b in buffers])
        np.testing.assert_array_equal(back, arr)


def test_function_cache_same_key_for_same_function() -> None:
    cache = FunctionCache()
    key1, data1 = cache.get(double)
    key2, data2 = cache.get(double)
    assert key1 == key2
    assert data1 is data2  # pickled once
    assert FunctionCache().get(double)[0] == key1  # the key is a hash of the pickle
    assert loads(data1)(4) == 8


def test_function_cache_differs_for_different_functions() -> None:
    cache = FunctionCache()
    keys = {cache.get(f)[0] for f in (double, triple, lambda x: x, lambda x: x * 5, pow)}
    assert len(keys) == 5


def test_function_cache_is_bounded() -> None:
    cache = FunctionCache(size=4)
    fns = [lambda x, i=i: x + i for i in range(10)]
    for fn in fns:
        cache.get(fn)
    assert len(cache._entries) <= 4


def _main_function(source: str, name: str) -> tuple[dict[str, Any], Any]:
    """A function defined in ``__main__`` (so pickled by value), and its module's globals."""
    scope: dict[str, Any] = {"__name__": "__main__"}
    exec(textwrap.dedent(source), scope)
    return scope, scope[name]


def test_function_cache_main_function_carries_current_globals() -> None:
    scope, times_k = _main_function(
        """
        K = 10
        def times_k(x):
            return x * K
        """,
        "times_k",
    )
    cache = FunctionCache()
    key1, data1 = cache.get(times_k)
    assert loads(data1)(2) == 20
    assert cache.get(times_k) == (key1, data1)  # unchanged: the cached pickle
    scope["K"] = 20
    key2, data2 = cache.get(times_k)
    assert key2 != key1
    assert loads(data2)(2) == 40
    assert cache.get(times_k)[1] is data2  # cached again, under the new key
    scope["K"] = 10
    assert cache.get(times_k)[0] == key1  # the same pickle, the same key


def test_function_cache_sees_globals_of_called_functions_and_in_place_changes() -> None:
    scope, outer = _main_function(
        """
        SCALE = {"factor": 2}
        OFFSETS = [1]
        def helper(x):
            return x * SCALE["factor"]
        def outer(x, extra=[]):
            return helper(x) + sum(OFFSETS) + sum(extra)
        """,
        "outer",
    )
    cache = FunctionCache()
    assert loads(cache.get(outer)[1])(5) == 11
    scope["OFFSETS"].append(100)  # in place
    assert loads(cache.get(outer)[1])(5) == 111
    scope["SCALE"]["factor"] = 3  # read by the function it calls
    assert loads(cache.get(outer)[1])(5) == 116
    outer.__defaults__[0].append(1000)  # a mutable default
    assert loads(cache.get(outer)[1])(5) == 1116
    scope["helper"] = lambda x: 0  # rebound
    assert loads(cache.get(outer)[1])(5) == 1101


def test_function_cache_large_array_global_by_identity() -> None:
    np = pytest.importorskip("numpy")
    scope, first = _main_function(
        """
        def first(_):
            return float(ARRAY[0])
        """,
        "first",
    )
    scope["ARRAY"] = np.zeros(1 << 17)
    cache = FunctionCache()
    key, _ = cache.get(first)
    scope["ARRAY"][0] = 5.0  # in place: not seen (documented)
    assert cache.get(first)[0] == key
    scope["ARRAY"] = np.ones(1 << 17)  # a new array: seen
    key2, data2 = cache.get(first)
    assert key2 != key
    assert loads(data2)(0) == 1.0


def test_function_cache_global_plain_pickle_cannot_take_is_pickled_each_time() -> None:
    scope, apply = _main_function(
        """
        N = 1
        HANDLERS = {"add": lambda x: x + N}  # plain pickle cannot take a lambda; cloudpickle can
        def apply(x):
            return HANDLERS["add"](x)
        """,
        "apply",
    )
    cache = FunctionCache()
    assert loads(cache.get(apply)[1])(1) == 2
    assert id(apply) not in cache._entries
    scope["N"] = 2
    assert loads(cache.get(apply)[1])(1) == 3


def test_function_cache_imported_function_is_cached_by_reference() -> None:
    cache = FunctionCache()
    cache.get(double)
    assert cache._entries[id(double)][3] is None  # pickled by reference: nothing carried


@pytest.mark.timeout(120)
def test_executor_main_function_sees_the_global_changed_between_submits(tmp_path: Path) -> None:
    """The README's case: ``K`` changed from 10 to 20 in a script gives the result for 20."""
    script = tmp_path / "prog.py"
    script.write_text(
        textwrap.dedent(
            """
            from nimbus import Executor

            K = 10

            def times_k(x):
                return x * K

            if __name__ == "__main__":
                with Executor(max_workers=1) as ex:
                    first = ex.submit(times_k, 2).result()
                    K = 20
                    second = ex.submit(times_k, 2).result()
                    print(first, second)
            """
        )
    )
    res = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=100, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["20", "40"]


def test_serialization_error_names_the_culprit() -> None:
    lock = threading.Lock()
    with pytest.raises(SerializationError) as info:
        dumps([1, {"inner": ("x", lock)}])
    assert "lock" in str(info.value)
    assert isinstance(info.value, pickle.PicklingError)


def test_serialization_error_names_culprit_in_object_attributes() -> None:
    class Holder:
        def __init__(self) -> None:
            self.fine = 1
            self.gen = (i for i in range(3))

    with pytest.raises(SerializationError, match="generator"):
        dumps(Holder())


def test_describe_survives_broken_repr() -> None:
    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    text = serialization.describe(Broken())
    assert "Broken" in text


def test_describe_truncates() -> None:
    assert len(serialization.describe("x" * 1000)) < 200


def test_loads_garbage_raises_deserialization_error() -> None:
    with pytest.raises(DeserializationError):
        loads(b"definitely not a pickle")


def test_dumps_exception_round_trip() -> None:
    data = dumps_exception(KeyError("k"), "Traceback: here")
    exc, tb = loads(data)
    assert isinstance(exc, KeyError) and exc.args == ("k",)
    assert tb == "Traceback: here"


class _UnpicklableAttribute(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


class _NeedsTwoArgs(Exception):
    def __init__(self, a: str, b: str) -> None:  # pickles, but cannot be rebuilt
        super().__init__(a)
        self.b = b


class _BadStr(Exception):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def __str__(self) -> str:
        raise RuntimeError("no str either")


@pytest.mark.parametrize(
    "exc",
    [_UnpicklableAttribute("has a lock"), _NeedsTwoArgs("a", "b"), _BadStr()],
    ids=["unpicklable-attribute", "not-rebuildable", "bad-str"],
)
def test_dumps_exception_never_raises(exc: BaseException) -> None:
    data = dumps_exception(exc, "remote tb text")
    back, tb = loads(data)
    assert isinstance(back, RemoteError)
    assert type(exc).__qualname__ in back.type_name
    assert back.remote_traceback == "remote tb text"
    assert tb == "remote tb text"
    # RemoteError itself survives another round trip
    again = pickle.loads(pickle.dumps(back))
    assert again.type_name == back.type_name


def test_a_main_function_over_a_global_lock_is_named_with_the_global() -> None:
    namespace = {"__name__": "__main__", "lock": threading.Lock()}
    exec("def uses_lock():\n    with lock:\n        return 1\n", namespace)
    with pytest.raises(SerializationError) as info:
        serialization.dumps_function(namespace["uses_lock"])
    message = str(info.value)
    assert message.startswith("cannot pickle the function uses_lock (module __main__): ")
    assert "global 'lock', a threading.Lock, which cannot be pickled" in message
    assert "create it in the task" in message
    assert "builtins.function" not in message
