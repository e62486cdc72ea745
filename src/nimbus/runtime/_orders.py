"""A manager carries out environment orders on its node (``nimbus environments build|remove
NAME --endpoint``): mixed into :class:`~nimbus.runtime.manager.Manager`.

::

    order(ref, "build", env) ----\\
    order(ref, "remove", name) ---+--> _ordered (any thread) --> the loop (_do_orders):
    a build thread's outcome ----/
      build: waits its turn (at most BUILDS_AT_ONCE ordered builds at a time here)
             --thread--> environments.prepare(env, retry=True) --> its outcome to the loop
      built: the loop registers it: Builds.prepared[tag] (its first task starts a worker
             at once), a failure of it forgotten; else the builder's message
      remove: busy (tasks of it queued or running here)? refused; an ordered build of it
             waiting is dropped, one under way is overruled (its outcome is not kept) and
             the removal waits for it to end; then its slots released (idle workers
             retired), its builds forgotten --thread--> cache removed
    orders[ref] = {state, message, seconds}  (building -> built | failed;
                                              removing -> removed | failed)

Only the loop changes the layout and the builds: a build thread hands its outcome over
(``_ordered``, then ``_wake()``), as task-triggered builds do with ``Builds.done``.
``orders`` keeps the last :data:`KEPT` orders; a remote manager's heartbeats carry it
to the agent, and the endpoint daemon's beats to the service.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from nimbus import environments
from nimbus.environments import Environment
from nimbus.runtime.layout import Builds, Layout
from nimbus.runtime.pool import Worker
from nimbus.runtime.task import Task, environment_tag

__all__ = ["BUILDS_AT_ONCE", "DONE", "KEPT", "ORDERS", "NodeOrders", "named"]

ORDERS = "orders"  # what a manager that carries out orders says in its JOIN's "can"
KEPT = 32  # orders whose outcome a manager remembers
BUILDS_AT_ONCE = 2  # ordered builds a manager runs at a time; the others wait their turn
DONE = frozenset({"built", "removed", "failed"})
_SAYING = threading.Lock()  # orders' outcomes change on several threads


def named(tag: str, name: str) -> bool:
    """Whether worker type ``tag`` (``name@key``) is the environment ``name`` (or key)."""
    env_name, _, key = tag.partition("@")
    return bool(tag) and name in (env_name, key)


class NodeOrders:
    """Orders to build or remove an environment on this node (the manager's loop calls
    :meth:`_do_orders` when ``_ordered`` holds some)."""

    name: str
    layout: Layout
    _builds: Builds
    _pending: dict[str, deque[Task]]
    _workers: list[Worker]
    _env_failures: dict[str, int]
    orders: dict[str, dict[str, Any]]
    _ordered: deque[tuple[Any, ...]]  # (kind, ref, ...): orders and build outcomes
    _order_waiting: deque[tuple[str, str, Environment]]  # the loop's: builds not started
    _order_building: dict[str, str]  # the loop's: ref -> tag of the ordered builds under way
    _overruled: set[str]  # the loop's: builds a removal came after (their outcome is dropped)
    # the loop's: removals waiting for the builds they overruled (ref, name, those builds)
    _removals_waiting: list[tuple[str, str, set[str]]]

    def _init_orders(self) -> None:
        self.orders = {}  # environment orders: ref -> outcome
        self._ordered = deque()
        self._order_waiting = deque()
        self._order_building = {}
        self._overruled = set()
        self._removals_waiting = []

    def _wake(self) -> None:
        raise NotImplementedError  # the manager's

    def order(
        self, ref: str, action: str, name: str, environment: Environment | None = None
    ) -> None:
        """Build ``environment`` here, or remove the environment ``name``; the outcome
        goes in ``orders[ref]`` (thread-safe)."""
        self._said(ref, "building" if action == "build" else "removing")
        if action == "build":
            assert environment is not None
            self._ordered.append(("build", ref, environment))
        else:
            self._ordered.append(("remove", ref, name))
        self._wake()

    def _said(self, ref: str, state: str, message: str = "", seconds: float = 0.0) -> None:
        said = {"state": state, "message": message[:2000], "seconds": round(seconds, 3)}
        with _SAYING:  # order() on any thread, the loop: one change at a time
            orders = self.orders
            orders.pop(ref, None)  # re-inserted: the dict's order is the last change
            orders[ref] = said
            while len(orders) > KEPT:
                del orders[next(iter(orders))]

    def _do_orders(self) -> None:
        """On the loop: the orders asked for and the ordered builds' outcomes."""
        while self._ordered:
            kind, ref, *rest = self._ordered.popleft()
            if kind == "build":
                env = rest[0]
                self._order_waiting.append((ref, environment_tag(env), env))
            elif kind == "remove":
                self._remove(ref, rest[0])
            else:
                self._built_ordered(ref, *rest)
        waiting = self._order_waiting
        while waiting and len(self._order_building) < BUILDS_AT_ONCE:
            ref, tag, env = waiting.popleft()
            self._order_building[ref] = tag
            threading.Thread(
                target=self._build_ordered,
                args=(ref, tag, env),
                name=f"nimbus-order-{env.name}",
                daemon=True,
            ).start()
        for place, (ref, _, _) in enumerate(waiting):
            if self.orders.get(ref, {}).get("message") == "":
                self._said(
                    ref,
                    "building",
                    f"waiting its turn on {self.name}: {BUILDS_AT_ONCE + place} ordered "
                    f"builds ahead (at most {BUILDS_AT_ONCE} at a time)",
                )

    def _build_ordered(self, ref: str, tag: str, env: Environment) -> None:
        """On its own thread: the build; its outcome goes to the loop."""
        began = time.monotonic()
        outcome: Any
        try:
            outcome = environments.prepare(env, retry=True)
        except Exception as exc:  # the builder's own message, for the user who asked
            outcome = exc
        self._ordered.append(("built", ref, tag, env, outcome, time.monotonic() - began))
        self._wake()

    def _built_ordered(
        self, ref: str, tag: str, env: Environment, outcome: Any, seconds: float
    ) -> None:
        """On the loop: an ordered build ended; kept unless a removal came after it began."""
        self._order_building.pop(ref, None)
        if ref in self._overruled:
            self._overruled.discard(ref)
            self._said(
                ref,
                "failed",
                f"environment {env.name!r} was removed on {self.name} while it was being "
                f"built, so this build is not kept: build it again if you need it",
                seconds,
            )
        elif isinstance(outcome, Exception):
            self._said(ref, "failed", str(outcome), seconds)
        else:
            self.layout.envs.setdefault(tag, env)
            self._builds.prepared[tag] = outcome  # its first task starts a worker at once
            self._builds.failed.pop(tag, None)  # a failure of an earlier build is forgotten
            self._env_failures.pop(tag, None)
            built = outcome.build_seconds
            self._said(ref, "built", "" if built else "already built", built)
        waiting, self._removals_waiting = self._removals_waiting, []
        for removal, name, builds in waiting:  # those whose builds all ended go on now
            if builds & self._order_building.keys():
                self._removals_waiting.append((removal, name, builds))
            else:  # builds ordered after it are not overruled: the later order wins
                self._remove(removal, name, overrule=False)

    def _remove(self, ref: str, name: str, *, overrule: bool = True) -> None:
        """On the loop: remove ``name`` here, unless tasks of it are here; ordered builds
        of it waiting are dropped, those under way overruled (with ``overrule``)."""
        builds = self._builds
        tags = {t for t in (*self.layout.envs, *builds.prepared, *builds.failed) if named(t, name)}
        queued = sum(len(self._pending.get(t, ())) for t in tags)
        running = sum(len(w.inflight) for w in self._workers if w.env in tags)
        if queued or running or tags & builds.running:
            self._said(
                ref,
                "failed",
                f"environment {name!r} is busy on {self.name}: {running} tasks of it "
                f"running, {queued} queued{', a build under way' if tags & builds.running else ''}"
                f"; remove it when they are done (or cancel them)",
            )
            return
        for waiting in [w for w in self._order_waiting if overrule and named(w[1], name)]:
            self._order_waiting.remove(waiting)
            self._said(
                waiting[0], "failed", f"environment {name!r} was removed before it was built"
            )
        under_way = {r for r, t in self._order_building.items() if overrule and named(t, name)}
        if under_way:  # the removal wins: it goes on when they end, their outcome dropped
            self._overruled |= under_way
            self._removals_waiting.append((ref, name, under_way))
            return
        for tag in tags:
            self.layout.release(tag)  # its idle workers are retired
            builds.prepared.pop(tag, None)
            builds.failed.pop(tag, None)
        threading.Thread(
            target=self._remove_ordered,
            args=(ref, name),
            name="nimbus-order-remove",
            daemon=True,
        ).start()

    def _remove_ordered(self, ref: str, name: str) -> None:
        began = time.monotonic()
        try:
            store = environments.cache()
            found = [e for e in store.entries() if name in e.names or e.key == name]
            busy = [e.key for e in found if store.busy(e.key)]
            if not busy:
                store.forget(name)  # a build other names share stays for them
        except OSError as exc:
            self._said(ref, "failed", f"cannot remove {name!r} here: {exc}")
            return
        if busy:
            self._said(ref, "failed", f"environment {name!r} is being built here; remove it after")
            return
        said = f"{len(found)} build(s)" if found else "not on this node"
        self._said(ref, "removed", said, time.monotonic() - began)
