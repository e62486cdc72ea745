"""``multiprocessing.process`` for nimbus: the stdlib's process bookkeeping.

``current_process``, ``parent_process`` and ``active_children`` are the
stdlib's, so they see nimbus processes and stdlib ones alike.
"""

from __future__ import annotations

from multiprocessing.process import (
    AuthenticationString,
    BaseProcess,
    active_children,
    current_process,
    parent_process,
)

from nimbus.multiprocessing.context import Process

__all__ = [
    "AuthenticationString",
    "BaseProcess",
    "Process",
    "active_children",
    "current_process",
    "parent_process",
]
