"""nimbus settings: one typed, validated, frozen object.

Values come from three layers, later ones winning::

    defaults  <  TOML file  <  environment (NIMBUS_*)

The file is ``$NIMBUS_CONFIG`` if set, else ``$XDG_CONFIG_HOME/nimbus/config.toml``
(``~/.config/nimbus/config.toml``) if it exists. Its keys are the field names,
at top level or in a ``[nimbus]`` table. Unknown keys, wrong types and bad
values raise :class:`~nimbus.errors.ConfigError` naming the variable or key,
the value, and what is accepted.

This package owns every ``NIMBUS_*`` variable: each setting is declared once,
as a field of :class:`Settings` (``_settings``), declared with ``_fields``'s
``setting()``; where values are read from, and the load-once cache, are in
``_loading``; the checks of values are in ``_coerce``, and where nimbus keeps things
on this machine in ``_places``.
No other module reads a ``NIMBUS_*`` variable to configure itself.

Each name is imported from its module on first use (``import nimbus.config``
costs nothing): ``nimbus run`` asks where the config file is before every
program, and needs neither ``Settings`` nor the checks of values for that.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False
if TYPE_CHECKING:
    from nimbus.config._coerce import (
        INLINE_MAX,
        INLINE_MIN,
        MAX_TIMEOUT,
        NAME,
        NAME_RULE,
        Bad,
        check_timeout,
        optional_bandwidth,
        optional_cpus,
        optional_size,
        parse_bandwidth,
        size,
    )
    from nimbus.config._places import (
        config_dir,
        credentials_file,
        default_config_file,
        default_config_path,
        private_dir,
        saved_credentials,
        untrusted_certificate,
    )
    from nimbus.config._settings import CONFIG_ENV, Settings

__all__ = [
    "CONFIG_ENV",
    "INLINE_MAX",
    "INLINE_MIN",
    "MAX_TIMEOUT",
    "NAME",
    "NAME_RULE",
    "Bad",
    "Settings",
    "check_timeout",
    "config_dir",
    "credentials_file",
    "default_config_file",
    "default_config_path",
    "optional_bandwidth",
    "optional_cpus",
    "optional_size",
    "parse_bandwidth",
    "private_dir",
    "saved_credentials",
    "size",
    "untrusted_certificate",
]

_HOMES = {
    **dict.fromkeys(
        ("INLINE_MAX", "INLINE_MIN", "MAX_TIMEOUT", "NAME", "NAME_RULE", "Bad", "check_timeout"),
        "_coerce",
    ),
    **dict.fromkeys(
        ("optional_bandwidth", "optional_cpus", "optional_size", "parse_bandwidth", "size"),
        "_coerce",
    ),
    **dict.fromkeys(
        (
            "config_dir",
            "credentials_file",
            "default_config_file",
            "default_config_path",
            "private_dir",
            "saved_credentials",
            "untrusted_certificate",
        ),
        "_places",
    ),
    **dict.fromkeys(("CONFIG_ENV", "Settings"), "_settings"),
}


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later uses are plain lookups
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
