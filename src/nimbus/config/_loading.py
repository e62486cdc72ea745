"""Where settings come from, and reading them once: defaults < TOML file < environment.

::

    Settings.load()          -> once(make): the same object while what it is made of stays
                                the same (NIMBUS_* variables, HOME and XDG_*, the user, the
                                config file's bytes); make() otherwise
    Settings._load(env, file) -> read(env, file, FIELDS): each value, and where it came from

The file is ``$NIMBUS_CONFIG`` if set, else the default one if it exists; an unknown
key in it is an error (with the closest known one), an unknown ``NIMBUS_*`` variable
close to a setting's a warning (:data:`HANDED_OVER` are no settings, and no typos).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from nimbus._lazy import lazy
from nimbus.config._fields import ENV_PREFIX, Spec, coerce
from nimbus.config._places import default_config_file, default_runtime_dir
from nimbus.errors import ConfigError

TYPE_CHECKING = False
if TYPE_CHECKING:
    import tomllib
else:  # imported when a config file is read
    tomllib = lazy("tomllib", globals())

__all__ = ["CONFIG_ENV", "HANDED_OVER", "once", "read"]

CONFIG_ENV = "NIMBUS_CONFIG"
T = TypeVar("T")


def read(
    env: Mapping[str, str], file: Path | None, fields: Mapping[str, Spec]
) -> tuple[dict[str, object], dict[str, str]]:
    """The values of ``fields`` set in the file (``file``, else the one ``env`` names or
    the default one) and in ``env``, checked, and where each setting's value came from
    (``default``, ``file <path>``, ``env <VAR>``)."""
    values: dict[str, object] = {"runtime_dir": default_runtime_dir(env)}
    sources = dict.fromkeys(fields, "default")

    if file is None:
        explicit = env.get(CONFIG_ENV, "").strip()
        if explicit:
            file = Path(explicit).expanduser()
            if not file.is_file():
                raise ConfigError(
                    f"{CONFIG_ENV}={explicit!r}: no such file; point it at a TOML file or unset it"
                )
        else:
            default = default_config_file(env)
            file = default if default.is_file() else None
    if file is not None:
        for name, raw in _read_toml(file, fields).items():
            values[name] = coerce(fields[name], raw, f"{file}: key {name!r}")
            sources[name] = f"file {file}"

    for name, spec in fields.items():
        if spec.env in env:
            values[name] = coerce(spec, env[spec.env], spec.env)
            sources[name] = f"env {spec.env}"
    _warn_misspelled(env, fields)
    return values, sources


_PLACES = ("HOME", "XDG_CONFIG_HOME", "XDG_RUNTIME_DIR")  # where the file and runtime are
_loaded: list[object] = [None, None]  # Settings.load()'s inputs and what it made of them


def once(make: Callable[[], T]) -> T:
    """What ``make()`` (``Settings.load()``'s reading) made last, if what it is made of is
    the same now: a process's many callers share one object (it is frozen), and a fork's
    children inherit it."""
    key = _inputs()
    if key is not None and key == _loaded[0]:
        return _loaded[1]  # type: ignore[return-value]
    made = make()
    if key is not None:
        _loaded[:] = [key, made]
    return made


def _inputs() -> tuple[object, ...] | None:
    """What ``Settings.load()`` is made of now: the ``NIMBUS_*`` variables, those of
    :data:`_PLACES`, the user and the config file's bytes (a few tens of microseconds,
    where parsing and checking them all takes a millisecond). None: the file cannot be
    read (load says why)."""
    env = os.environ
    names = tuple(sorted((k, v) for k, v in env.items() if k.startswith(ENV_PREFIX)))
    places = tuple(env.get(k) for k in _PLACES)
    explicit = env.get(CONFIG_ENV, "").strip()
    path = Path(explicit).expanduser() if explicit else default_config_file(env)
    try:
        with open(path, "rb") as f:
            content: bytes | None = f.read()
    except FileNotFoundError:
        if explicit:
            return None
        content = None
    except OSError:
        return None
    return names, places, os.getuid(), str(path), content


def _read_toml(file: Path, fields: Mapping[str, Spec]) -> dict[str, object]:
    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"config file {file} cannot be read ({exc.strerror})") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {file} is not valid TOML: {exc}") from exc
    table = data.pop("nimbus", {})
    if not isinstance(table, dict):
        raise ConfigError(f"config file {file}: 'nimbus' must be a table, got {table!r}")
    both = sorted(set(data) & set(table))
    if both:
        raise ConfigError(
            f"config file {file}: {', '.join(both)} set twice (top level and [nimbus])"
        )
    merged: dict[str, object] = {**data, **table}
    unknown = sorted(set(merged) - set(fields))
    if unknown:
        guesses = {key: _close(key, fields) for key in unknown}
        named = ", ".join(
            f"{key} (did you mean {guesses[key]!r}?)" if guesses[key] else key for key in unknown
        )
        known = "" if all(guesses.values()) else f"; known keys: {', '.join(fields)}"
        raise ConfigError(f"config file {file}: unknown key(s) {named}{known}")
    return merged


# NIMBUS_* variables that are no setting: hand-overs to the processes nimbus starts
HANDED_OVER = frozenset(
    {
        "NIMBUS_MESSAGING_TOKEN",
        "NIMBUS_AGENT_ADDRESS",
        "NIMBUS_AGENT_SECRET",
        "NIMBUS_BLOCK_ID",
        "NIMBUS_NODE_PATH",
        "NIMBUS_WORKER_ENVIRONMENT",
        "NIMBUS_MODULES",
        "NIMBUS_NODE",
    }
)
_warned: set[str] = set()


def _close(name: str, known: Any) -> str | None:
    import difflib

    found = difflib.get_close_matches(name, list(known), n=1, cutoff=0.8)
    return found[0] if found else None


def _warn_misspelled(env: Mapping[str, str], fields: Mapping[str, Spec]) -> None:
    """Warn once for each NIMBUS_* variable that is no setting but is close to one (as
    Dask warns of unknown config): a typo, which would be ignored."""
    known = frozenset(spec.env for spec in fields.values())
    names = [k for k in env if k.startswith(ENV_PREFIX) and k not in known]
    for name in names:
        if name in _warned or name in HANDED_OVER or name == CONFIG_ENV:
            continue
        guess = _close(name, known)
        if guess is not None:
            import warnings

            _warned.add(name)
            warnings.warn(
                f"{name} is no nimbus setting and is ignored: did you mean {guess}?",
                UserWarning,
                stacklevel=3,
            )
