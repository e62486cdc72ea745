"""Warming-aware routing: which manager gets the tasks of which environment.

::

    queues {env: waiting tasks} + views {manager: slots per env, unused, window, held per env}
        |
        1. warm:   a manager with free room in workers of the task's environment
        2. unused: a manager with an unused slot starts a worker of it
        3. switch: an idle worker of another environment changes (cold), for the
                   environment furthest below its share of the work
        v
    moves [(manager, env, n, take_from)]: reserve a slot (take_from, or None for an
    unused one) when ``claim``, then send n tasks

An environment's *share* is the node slots in proportion to its work (tasks
waiting plus tasks held by managers), at least one slot for any environment
with work: an environment with no worker anywhere takes a slot even from busy
ones, so none starves. An environment that has workers switches another's
only when its waiting tasks would wait on its warm workers longer than a
worker takes to start (by the managers' averages; a short wait on warm workers
beats a cold start). ``plan`` is a pure function of the views; the agent
applies its moves (``nimbus.runtime.agent``). ``mode="random"`` is the
baseline of funcX's experiment: each task goes to a random free worker slot,
which switches environment when it is not the task's; ``mode="fixed"`` only
uses the workers the managers already have (an oracle that laid them out).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MODES", "Move", "View", "plan"]

MODES = ("warm", "random", "fixed")
HYSTERESIS = 0.5  # slots of deficit and surplus before a worker changes environment
BACKLOG = 2  # rounds of its workers' windows an environment must have waiting to take one


@dataclass
class View:
    """What the agent knows of one manager: slots per environment, unused slots,
    tasks per worker (``window``) and tasks of each environment it holds."""

    manager: Any
    slots: dict[str, int]
    unused: int
    window: int
    held: dict[str, int] = field(default_factory=dict)
    run_seconds: float | None = None  # a task's run, on average (None: not known yet)
    start_seconds: float | None = None  # a worker's start (a cold start), on average

    def room(self, tag: str) -> int:
        return self.slots.get(tag, 0) * self.window - self.held.get(tag, 0)

    def idle(self, tag: str) -> bool:
        """One worker of ``tag`` here holds nothing (by the agent's count)."""
        n = self.slots.get(tag, 0)
        return n > 0 and self.held.get(tag, 0) <= (n - 1) * self.window


@dataclass
class Move:
    manager: Any
    env: str
    tasks: int
    claim: bool = False  # reserve a slot for ``env`` first
    take_from: str | None = None  # ... from this environment (None: an unused one)


def _give(view: View, tag: str, n: int, waiting: dict[str, int], moves: list[Move]) -> None:
    view.held[tag] = view.held.get(tag, 0) + n
    waiting[tag] -= n
    if moves and moves[-1].manager is view.manager and moves[-1].env == tag:
        moves[-1].tasks += n
    else:
        moves.append(Move(view.manager, tag, n))


def _claim(view: View, tag: str, take_from: str | None, moves: list[Move]) -> None:
    if take_from is None:
        view.unused -= 1
    else:
        view.slots[take_from] -= 1
    view.slots[tag] = view.slots.get(tag, 0) + 1
    moves.append(Move(view.manager, tag, 0, claim=True, take_from=take_from))


def plan(
    waiting: dict[str, int], views: list[View], mode: str = "warm", rng: random.Random | None = None
) -> list[Move]:
    """The moves that place ``waiting`` tasks (count per environment) on ``views``."""
    waiting = {tag: n for tag, n in waiting.items() if n > 0}
    moves: list[Move] = []
    if not waiting or not views:
        return moves
    if mode == "random":
        return _random(waiting, views, rng or random.Random(), moves)
    for tag in list(waiting):  # 1. warm workers of the task's environment
        while waiting[tag] > 0:
            best = max(views, key=lambda v: v.room(tag))
            room = best.room(tag)
            if room <= 0:
                break
            _give(best, tag, min(room, waiting[tag]), waiting, moves)
    if mode == "fixed":
        return moves
    total = sum(v.unused + sum(v.slots.values()) for v in views)
    while any(n > 0 for n in waiting.values()):
        work = dict(waiting)
        held: dict[str, int] = {}
        for v in views:
            for tag, n in v.held.items():
                work[tag] = work.get(tag, 0) + n
            for tag, n in v.slots.items():
                held[tag] = held.get(tag, 0) + n
        all_work = sum(work.values()) or 1
        share = {tag: max(1.0, total * n / all_work) if n else 0.0 for tag, n in work.items()}
        tag = max(
            (t for t, n in waiting.items() if n > 0),
            key=lambda t: share[t] - held.get(t, 0),
        )
        backlog = _backlog(waiting[tag], held.get(tag, 0), views)
        view, donor = _slot_for(tag, views, share, held, backlog)
        if view is None:
            break
        _claim(view, tag, donor, moves)
        _give(view, tag, min(view.room(tag), waiting[tag]), waiting, moves)
    return moves


def _backlog(waiting: int, workers: int, views: list[View]) -> bool:
    """Do ``waiting`` tasks on ``workers`` warm workers wait longer than a cold start takes?

    By the managers' averages of a task's run and a worker's start when they
    know them; else more than ``BACKLOG`` rounds of the workers' windows.
    """
    runs = [v.run_seconds for v in views if v.run_seconds is not None]
    starts = [v.start_seconds for v in views if v.start_seconds is not None]
    if runs and starts and workers:
        wait = waiting * (sum(runs) / len(runs)) / workers
        return wait > sum(starts) / len(starts)
    return waiting > BACKLOG * workers * max(v.window for v in views)


def _slot_for(
    tag: str, views: list[View], share: dict[str, float], held: dict[str, int], backlog: bool
) -> tuple[View | None, str | None]:
    """2. an unused slot, else 3. an idle worker of an environment above its share
    (when ``tag`` has a backlog: a cold start costs more than a short wait)."""
    unused = [v for v in views if v.unused > 0]
    if unused:
        return max(unused, key=lambda v: v.unused), None
    deficit = share.get(tag, 0.0) - held.get(tag, 0)
    starving = held.get(tag, 0) == 0
    if (deficit < HYSTERESIS or not backlog) and not starving:
        return None, None
    best: tuple[float, View, str] | None = None
    for v in views:
        for other, n in v.slots.items():
            if other == tag or n <= 0:
                continue
            surplus = held.get(other, 0) - share.get(other, 0.0)
            spare = surplus >= HYSTERESIS or (starving and held.get(other, 0) > 1)
            if v.idle(other) and spare and (best is None or surplus > best[0]):
                best = (surplus, v, other)
    if best is None and starving:  # nothing idle: the busiest environment gives a worker
        for v in views:
            for other, n in v.slots.items():
                surplus = held.get(other, 0) - share.get(other, 0.0)
                busy = other != tag and n > 0 and held.get(other, 0) > 1
                if busy and (best is None or surplus > best[0]):
                    best = (surplus, v, other)
    if best is None:
        return None, None
    return best[1], best[2]


def _random(
    waiting: dict[str, int], views: list[View], rng: random.Random, moves: list[Move]
) -> list[Move]:
    """Each task to a random free worker slot, switched to its environment if need be."""
    order = [tag for tag, n in waiting.items() for _ in range(n)]
    rng.shuffle(order)
    for tag in order:
        free: list[tuple[View, str | None]] = []
        for v in views:
            free.extend((v, None) for _ in range(v.unused))
            for other, n in v.slots.items():
                spare = n - -(-v.held.get(other, 0) // v.window)
                free.extend((v, other) for _ in range(max(0, spare)))
        if not free:
            break
        view, slot = rng.choice(free)
        if slot != tag:
            _claim(view, tag, slot, moves)
        _give(view, tag, 1, waiting, moves)
    return moves
