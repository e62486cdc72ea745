"""nimbus.serialization: pickle protocol 5 with out-of-band buffers, cloudpickle fallback."""

from __future__ import annotations

import pickle
import threading

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
