"""How many workers one node can hold: the bound on ``max_workers`` / ``NIMBUS_WORKERS``.

Every worker is started at once (a fresh executor spreads long tasks over all of
them, as the stdlib's fork pool does), so an absurd count would start that many
interpreters before the first task: the bound refuses it with a ``ConfigError``.
It is the least of what the node allows:

- memory: a warm worker is a Python interpreter, about ``WORKER_BYTES`` resident
  when idle (measured: 15 MB RSS on CPython 3.11); more than the node's memory
  holds of them would swap before any task runs;
- processes: the soft ``RLIMIT_NPROC`` (each worker is one process of this user);
- descriptors: the soft ``RLIMIT_NOFILE`` less ``SPARE_FDS`` (the runtime holds
  one socket per worker).
"""

from __future__ import annotations

import os

__all__ = ["WORKER_BYTES", "max_workers"]

WORKER_BYTES = 16 * 1024 * 1024
SPARE_FDS = 64


def max_workers() -> tuple[int, str]:
    """The most workers this node can start, and what sets that bound."""
    bounds: list[tuple[int, str]] = []
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        bounds.append((memory // WORKER_BYTES, f"{memory >> 20} MiB of memory, ~16 MiB a worker"))
    except (ValueError, OSError):
        pass
    try:
        import resource

        nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
        if nproc != resource.RLIM_INFINITY:
            bounds.append((nproc, f"RLIMIT_NPROC (ulimit -u) {nproc}"))
        files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if files != resource.RLIM_INFINITY:
            bounds.append((files - SPARE_FDS, f"RLIMIT_NOFILE (ulimit -n) {files}"))
    except (ImportError, ValueError, OSError):
        pass
    if not bounds:
        return 4096, "the default bound"
    limit, why = min(bounds)
    return max(1, limit), why
