"""An ``Executor``'s arguments, checked before it starts anything.

Each refusal names the argument or the ``NIMBUS_*`` variable it came from (``given``)
and what to pass instead: an environment not built on this node, more workers than
the node can start, a module to preload that this Python cannot find, a timeout that
is not a number of seconds. Used by ``nimbus.executor`` alone (``tests/test_layers.py``
pins it); a task's own limits are checked by ``nimbus.network.task_limits``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nimbus.config import check_timeout as _in_range
from nimbus.environments import Environment, as_environment
from nimbus.environments import resolve as resolve_environment
from nimbus.errors import ConfigError
from nimbus.runtime.task import environment_tag

__all__ = ["check_environment", "check_preload", "check_timeout", "check_workers"]


def check_environment(
    env: Any, given: str = "NIMBUS_ENVIRONMENT"
) -> tuple[Environment | None, str]:
    """``env`` and its worker type; a name not built on this node is refused with what to
    pass instead."""
    if env is None:
        return None, ""
    if isinstance(env, str):  # a name built on this node (nimbus environments build), or JSON
        env = resolve_environment(env, given)
    env = as_environment(env)  # ConfigError, as the client's, for anything else
    return env, environment_tag(env)


def check_workers(count: object, given: str, *, here: bool) -> None:
    """A count of workers: an int > 0 and, ``here`` (a local runtime), no more than this
    node can start (they all start at once)."""
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"max_workers must be an int, not {count!r}")
    if count <= 0:
        raise ValueError("max_workers must be greater than 0")
    if not here:
        return
    from nimbus.runtime.limits import max_workers

    limit, why = max_workers()
    if count > limit:
        raise ConfigError(
            f"{given}={count} is more workers than this node can start: at most {limit} "
            f"({why}); every worker starts at once, so choose a smaller {given}"
        )


def check_preload(names: Sequence[str]) -> None:
    """A module to preload that is nowhere on this Python's path: refused now, by name."""
    import importlib.util

    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # its package is missing, or the name is not one
            found = False
        if not found:
            raise ConfigError(
                f"preload names module {name!r}, which this Python cannot find; "
                "check its spelling, or install it where the workers run"
            )


def check_timeout(timeout: float | None, what: str) -> float | None:
    """A number of seconds or None (``TypeError``), in range (``config.check_timeout``)."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)):
        raise TypeError(f"{what} must be a number of seconds or None, not {timeout!r}")
    return _in_range(timeout, what)  # finite, > 0, at most MAX_TIMEOUT (ValueError)
