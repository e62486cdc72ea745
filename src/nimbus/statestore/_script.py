"""Lua scripts run on a state store, by their SHA1.

::

    module of nimbus:   _X = Script(lua)  -> listed by scripts()
    a Link:             EVALSHA sha ...   -> NOSCRIPT? EVAL lua ... (loads it)
    the service:        user_rules(): +evalsha|<sha> for each script made, nothing else
"""

from __future__ import annotations

import hashlib

__all__ = ["Script", "scripts"]


class Script:
    """A Lua script nimbus runs on a store, called by its SHA1 (loaded when the store lacks it).

    Every script made is listed by :func:`scripts`: the service's stores Redis
    loads them and lets its users run those and no other (``EVALSHA`` of their SHA1s).
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        _SCRIPTS.setdefault(self.sha, self)


_SCRIPTS: dict[str, Script] = {}


def scripts() -> list[Script]:
    """Every :class:`Script` made in this process so far: all of ``nimbus.statestore.lua``
    (imported with the package), and any made since."""
    return list(_SCRIPTS.values())
