"""A setting's declaration: one field of ``Settings`` with its check and its meaning.

::

    prefetch: int = setting(8, c.int_at_least(1), "tasks in flight per worker")
    specs(Settings)["prefetch"] -> Spec("NIMBUS_PREFETCH", c.int_at_least(1), "tasks in ...")
    coerce(spec, "0", "NIMBUS_PREFETCH") -> ConfigError naming the variable, the value and
                                           what is accepted

What :func:`setting` declares is kept in the field's metadata; :func:`specs` reads it
back as a :class:`Spec` per field, with its environment variable (``NIMBUS_`` + the
name in capitals).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

from nimbus.config._coerce import Bad
from nimbus.errors import ConfigError

__all__ = ["ENV_PREFIX", "Spec", "coerce", "setting", "specs"]

ENV_PREFIX = "NIMBUS_"
_SPEC = "nimbus.setting"  # the key of a field's (coerce, help) in its metadata


class Spec(NamedTuple):
    """What a setting's field declares, besides its name, type and default."""

    env: str
    coerce: Callable[[object], Any]
    help: str


def setting(
    default: object,
    coerce: Callable[[object], Any],
    help: str,
    *,
    factory: Callable[[], object] | None = None,
) -> Any:
    """One field of :class:`Settings`: its default, its check, its meaning.

    ``factory``: the default is computed (``default`` is then None and unused).
    """
    meta = {_SPEC: (coerce, help)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def specs(cls: type) -> dict[str, Spec]:
    """Each field of the dataclass ``cls`` declared with :func:`setting`: name -> Spec."""
    return {
        f.name: Spec(ENV_PREFIX + f.name.upper(), *f.metadata[_SPEC])
        for f in dataclasses.fields(cls)
    }


def coerce(spec: Spec, value: object, label: str) -> Any:
    """``value`` checked and converted as ``spec`` says; ``label`` names where it was set."""
    try:
        return spec.coerce(value)
    except Bad as bad:
        raise ConfigError(f"{label}={value!r} is invalid: expected {bad}") from None
