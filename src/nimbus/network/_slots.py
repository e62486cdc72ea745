"""Slots: which worker link owns which /30 of ``10.213.0.0/16`` on this host.

A slot is a file ``/run/nimbus-net/<n>`` made with ``O_EXCL`` holding its
owner's pid; a slot whose owner is dead is taken over (its leftovers removed
first by the caller). Many managers on one host therefore never share a subnet.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["SLOTS", "Slot", "addresses", "claim", "in_use"]

SLOTS = 16384  # /30 subnets in 10.213.0.0/16
DIR = Path("/run/nimbus-net")


class Slot:
    def __init__(self, number: int, stale: bool) -> None:
        self.number = number
        self.stale = stale  # a dead owner's: its namespace and links may still exist

    def free(self) -> None:
        try:
            (DIR / str(self.number)).unlink()
        except FileNotFoundError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim(start: int = 0) -> Slot:
    """The first free slot from ``start`` (wrapping); a dead owner's counts as free."""
    DIR.mkdir(mode=0o755, exist_ok=True)
    me = str(os.getpid()).encode()
    for i in range(SLOTS):
        number = (start + i) % SLOTS
        path = DIR / str(number)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner = int(path.read_text() or "0")
            except (OSError, ValueError):
                continue
            if owner and _alive(owner):
                continue
            path.write_bytes(me)  # taken over: a race here loses nothing but a retry
            return Slot(number, stale=True)
        os.write(fd, me)
        os.close(fd)
        return Slot(number, stale=False)
    raise OSError(f"all {SLOTS} worker network slots of this host are taken")


def addresses(number: int) -> tuple[str, str]:
    """(node side, worker side) addresses of slot ``number``'s /30."""
    base = number * 4
    prefix = f"10.213.{base >> 8}."
    return prefix + str((base & 255) + 1), prefix + str((base & 255) + 2)


def in_use() -> list[int]:
    """The slots claimed on this host (a dead owner's too, until taken over)."""
    try:
        return [int(name) for name in os.listdir(DIR) if name.isdigit()]
    except OSError:
        return []
