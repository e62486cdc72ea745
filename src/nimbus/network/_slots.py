"""Slots: which worker link owns which /30 of ``10.213.0.0/16`` on this host.

A slot is a file ``/run/nimbus-net/<n>`` holding its owner's pid; a slot whose
owner is dead is taken over (its leftovers removed first by the caller: what is
left in its cgroup is killed). Slots are claimed under one lock file (``.slots``:
threads and processes alike), else a claimer could read another's slot file made
but not yet written, find no owner and take it over: two workers in one slot,
each one's manager killing the other's worker as it takes over or releases it.
Many managers on one host therefore never share a subnet.
"""

from __future__ import annotations

import os
from pathlib import Path

from nimbus._lockfile import lock_file

__all__ = ["SLOTS", "Slot", "addresses", "claim", "in_use"]

SLOTS = 16384  # /30 subnets in 10.213.0.0/16
DIR = Path("/run/nimbus-net")
LOCK = ".slots"  # the lock file of the claims, in DIR
CLAIM_TIMEOUT = 30.0  # seconds a claim waits for the others' (each takes microseconds)


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
    """The first free slot from ``start`` (wrapping); a dead owner's counts as free.

    Under the slots' lock: a slot file is made and written, or read and taken
    over, by one claimer at a time (an empty one is a claimer's that died).
    """
    DIR.mkdir(mode=0o755, exist_ok=True)
    me = str(os.getpid()).encode()
    with lock_file(DIR / LOCK, CLAIM_TIMEOUT):
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
                path.write_bytes(me)
                return Slot(number, stale=True)
            try:
                os.write(fd, me)
            finally:
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
