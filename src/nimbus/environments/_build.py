"""Making an environment ready on this node: :func:`prepare`.

``prepare(env)`` returns a :class:`Prepared`: how to start a worker inside the
environment. It blocks while the environment is built (once per node, cached
by ``env.key``), is safe to call from many threads and processes at once, and
raises :class:`~nimbus.errors.ConfigError`-rooted errors naming what failed.
A plain environment (``env.plain``) is the node's own Python and needs nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from nimbus.environments._spec import Environment

__all__ = ["Prepared", "prepare"]


@dataclass(frozen=True)
class Prepared:
    """An environment ready on this node: ``command(argv)`` starts a worker in it."""

    environment: Environment
    python: str = sys.executable
    wrap: tuple[str, ...] = ()
    variables: Mapping[str, str] = field(default_factory=dict)
    build_seconds: float = 0.0

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` (whose first item is a Python) run inside the environment."""
        return [*self.wrap, self.python, *argv[1:]]

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        """The worker's environment variables: ``base`` plus the environment's own."""
        return {**base, **self.variables}


def prepare(env: Environment) -> Prepared:
    """Make ``env`` ready on this node (build it if needed) and say how to start in it."""
    if env.plain:
        return Prepared(env)
    raise NotImplementedError("environments with software are built by the builders (issue 18)")
