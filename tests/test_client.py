"""The SDK's public names and the pieces it is built of (no service needed)."""

from __future__ import annotations

import functools
import pickle

import cloudpickle
import pytest

import nimbus
from nimbus import serialization
from nimbus.backends import BACKENDS
from nimbus.client import Client, error_for
from nimbus.config import Settings
from nimbus.errors import (
    AuthError,
    ConfigError,
    NimbusError,
    NotFound,
    PayloadTooLargeError,
    ServiceError,
    VersionMismatchError,
)


def here(x: int) -> int:
    return x + 1


def test_dir_lists_no_plumbing() -> None:
    """``dir(nimbus)``: the public names, none of the module's own plumbing (stranger 7 F7:
    ``TYPE_CHECKING``, ``annotations`` and ``importlib`` were listed)."""
    public = [n for n in dir(nimbus) if not n.startswith("_")]
    assert set(nimbus.__all__) - {"__version__"} <= set(public), public
    assert not {"TYPE_CHECKING", "annotations", "importlib"} & set(public), public


def test_public_names() -> None:
    assert nimbus.__all__ == [
        "Client",
        "Environment",
        "Executor",
        "File",
        "Future",
        "NimbusError",
        "Ref",
        "TaskRecord",
        "TaskState",
        "__version__",
        "put",
    ]
    assert nimbus.Client is Client
    assert set(BACKENDS) == {"local", "forked", "service"}


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (401, AuthError),
        (403, AuthError),
        (404, NotFound),
        (413, PayloadTooLargeError),
        (409, ServiceError),
        (500, ServiceError),
    ],
)
def test_http_errors_become_nimbus_errors(status: int, kind: type[Exception]) -> None:
    error = error_for(status, "version mismatch: x" if status == 409 else "no")
    assert isinstance(error, kind) and isinstance(error, NimbusError)
    if status == 409:
        assert isinstance(error, VersionMismatchError)


def test_client_needs_a_service(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    # the credentials file is looked up in this process's config dir: not the user's own login
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    settings = Settings.load({"HOME": "/nonexistent", "XDG_CONFIG_HOME": str(tmp_path)})
    with pytest.raises(ConfigError, match="nimbus login"):
        Client(settings=settings)


def test_own_functions_pickle_by_value_installed_ones_by_reference() -> None:
    by_value = serialization.dumps_function(here, by_value=True)
    by_ref = serialization.dumps_function(here)
    assert b"test_client" in by_ref and len(by_value) > len(by_ref)
    assert cloudpickle.loads(by_value)(1) == 2
    # a partial of nimbus code around the caller's function: the function goes by value
    wrapped = functools.partial(serialization.describe, here)
    assert serialization._user_modules(wrapped)[0].__name__ == __name__
    # installed packages are expected on the endpoint: by reference, as before
    assert serialization.dumps_function(pickle.dumps, by_value=True) == (
        serialization.dumps_function(pickle.dumps)
    )
