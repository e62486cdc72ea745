"""A wrong use of a command, found after parsing: reported as argparse reports its own.

``raise UsageError("nimbus netbench", "give --offline or --endpoint NAME")`` prints
``nimbus netbench: give --offline or --endpoint NAME (see `nimbus netbench --help`)``
and exits with status 2, as a bad argument does; called from Python it is a
:class:`~nimbus.errors.ConfigError`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from nimbus.errors import ConfigError

__all__ = ["UsageError", "writable_file"]


class UsageError(ConfigError):
    """Arguments that parse but do not go together: ``prog`` and what to give instead."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(f"{prog}: {message}")
        self.prog, self.message = prog, message

    def line(self) -> str:
        return f"{self.prog}: {self.message} (see `{self.prog} --help`)"


def writable_file(prog: str, flag: str, path: Path) -> None:
    """Refuse a ``flag`` file (``--url-file``) whose directory cannot be made or written
    in, before the command starts anything; the directory is made (mode 0o700)."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as exc:
        raise UsageError(
            prog,
            f"{flag} {path}: cannot write there ({exc.strerror}); give a file in a directory "
            "you can write to",
        ) from None
