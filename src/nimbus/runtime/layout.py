"""A node's worker slots by environment, and the builds that make environments ready.

::

    reserve(tag) / the manager's plan --> Layout.slots {tag: n}  (sum <= size)
                                              |
    the loop reconciles: too few of a tag --> Builds.start(env) --thread--> prepare(env)
                                              |        (never on the loop)      |
                                              |   <------- done (tag) ----------+
                                              +--> the pool starts its workers

A :class:`Layout` says how many of the node's worker slots each environment
has (its *slots*); a slot of no environment is *unused*. Callers on any thread
change it (:meth:`Layout.reserve`) and the manager's loop thread makes the
workers match (``nimbus.runtime.pool``): it builds the environment off the loop
(:class:`Builds`), starts workers in it with :meth:`Prepared.command` /
:meth:`Prepared.environ`, and retires the idle workers of environments that gave
up a slot. A build that fails stays failed for that spec on this node
(:attr:`Builds.failed`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from nimbus.environments import Environment, Prepared

__all__ = ["Builds", "Layout"]


class Layout:
    """How many of ``size`` worker slots each environment (tag) holds; thread-safe."""

    def __init__(self, size: int, warm: list[str]) -> None:
        self.size = size
        self.lock = threading.Lock()
        self.slots: dict[str, int] = {}
        self.envs: dict[str, Environment | None] = {"": None}
        for tag in warm[:size]:
            self.slots[tag] = self.slots.get(tag, 0) + 1
        self.changes = 0  # bumped at each change: the loop reconciles

    @property
    def unused(self) -> int:
        return self.size - sum(self.slots.values())

    def reserve(self, tag: str, env: Environment | None, take_from: str | None = None) -> bool:
        """One more slot for ``tag``: an unused one, else one of ``take_from``'s."""
        with self.lock:
            self.envs.setdefault(tag, env)
            return self._move(tag, take_from)

    def _move(self, tag: str, take_from: str | None) -> bool:
        slots = self.slots
        if self.unused <= 0:
            if take_from is None or take_from == tag or slots.get(take_from, 0) <= 0:
                return False
            slots[take_from] -= 1
            if not slots[take_from]:
                del slots[take_from]
        slots[tag] = slots.get(tag, 0) + 1
        self.changes += 1
        return True

    def release(self, tag: str) -> None:
        """``tag`` gives up all its slots (its environment failed)."""
        with self.lock:
            if self.slots.pop(tag, 0):
                self.changes += 1

    def plan(self, tag: str, want: int, idle: Callable[[str], bool]) -> None:
        """Grow ``tag`` towards ``want`` slots from unused ones, then from idle environments.

        An environment with none gets one even from a busy environment (the one
        with most slots), so none starves on a node full of other work.
        """
        with self.lock:
            slots = self.slots
            want = min(want, self.size)
            while slots.get(tag, 0) < want:
                donors = [t for t, n in slots.items() if t != tag and n > 0 and idle(t)]
                if not donors and not slots.get(tag) and self.unused <= 0:
                    donors = [t for t, n in slots.items() if t != tag and n > 1] or [
                        t for t, n in slots.items() if t != tag and n > 0
                    ]
                donor = max(donors, key=lambda t: slots[t]) if donors else None
                if not self._move(tag, donor):
                    return

    def snapshot(self) -> tuple[dict[str, int], int]:
        with self.lock:
            return dict(self.slots), self.unused


class Builds:
    """Environments being made ready on this node, one thread per build.

    ``prepare`` runs off the loop (a build may take seconds); when it ends the
    tag goes to ``done`` and ``wake`` is called. ``prepared`` and ``failed``
    hold the outcomes, ``seconds`` how long each took.
    """

    def __init__(
        self, prepare: Callable[[Environment], Prepared], wake: Callable[[], None]
    ) -> None:
        self._prepare = prepare
        self._wake = wake
        self.prepared: dict[str, Prepared] = {}
        self.failed: dict[str, BaseException] = {}
        self.seconds: dict[str, float] = {}
        self.running: set[str] = set()
        self.done: deque[str] = deque()

    def start(self, tag: str, env: Environment) -> None:
        if tag in self.running or tag in self.prepared or tag in self.failed:
            return
        self.running.add(tag)
        threading.Thread(
            target=self._build, args=(tag, env), name=f"nimbus-build-{env.name}", daemon=True
        ).start()

    def _build(self, tag: str, env: Environment) -> None:
        began = time.monotonic()
        try:
            self.prepared[tag] = self._prepare(env)
        except Exception as exc:  # the builder's own message reaches the tasks
            self.failed[tag] = exc
        self.seconds[tag] = time.monotonic() - began
        self.done.append(tag)
        self._wake()
