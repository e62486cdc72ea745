"""A wrong use of a command, found after parsing: reported as argparse reports its own.

``raise UsageError("nimbus netbench", "give --offline or --endpoint NAME")`` prints
``nimbus netbench: give --offline or --endpoint NAME (see `nimbus netbench --help`)``
and exits with status 2, as a bad argument does; called from Python it is a
:class:`~nimbus.errors.ConfigError`.
"""

from __future__ import annotations

from nimbus.errors import ConfigError

__all__ = ["UsageError"]


class UsageError(ConfigError):
    """Arguments that parse but do not go together: ``prog`` and what to give instead."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(f"{prog}: {message}")
        self.prog, self.message = prog, message

    def line(self) -> str:
        return f"{self.prog}: {self.message} (see `{self.prog} --help`)"
