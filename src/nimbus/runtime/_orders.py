"""A manager carries out environment orders on its node (``nimbus environments build|remove
NAME --endpoint``): mixed into :class:`~nimbus.runtime.manager.Manager`.

::

    order(ref, "build", env)  --thread--> environments.prepare(env, retry=True)
        (any thread)                        ok: Builds.prepared[tag] (its first task starts a
                                            worker at once), a failure of it forgotten
                                            else: the builder's message
    order(ref, "remove", name) --> the loop: busy (tasks of it queued or running here)?
                                     refused; else its slots released (idle workers
                                     retired), its builds forgotten --thread--> cache removed
    orders[ref] = {state, message, seconds}  (building -> built | failed;
                                              removing -> removed | failed)

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
from nimbus.runtime.pool import Builds, Layout, Worker
from nimbus.runtime.task import Task, environment_tag

__all__ = ["DONE", "KEPT", "ORDERS", "NodeOrders", "named"]

ORDERS = "orders"  # what a manager that carries out orders says in its JOIN's "can"
KEPT = 32  # orders whose outcome a manager remembers
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
    _ordered: deque[tuple[str, str]]

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
            threading.Thread(
                target=self._build_ordered,
                args=(ref, environment),
                name=f"nimbus-order-{environment.name}",
                daemon=True,
            ).start()
        else:
            self._ordered.append((ref, name))
            self._wake()

    def _said(self, ref: str, state: str, message: str = "", seconds: float = 0.0) -> None:
        said = {"state": state, "message": message[:2000], "seconds": round(seconds, 3)}
        with _SAYING:  # build threads and the loop: one change at a time
            orders = self.orders
            orders.pop(ref, None)  # re-inserted: the dict's order is the last change
            orders[ref] = said
            while len(orders) > KEPT:
                del orders[next(iter(orders))]

    def _build_ordered(self, ref: str, env: Environment) -> None:
        began = time.monotonic()
        tag = environment_tag(env)
        try:
            prepared = environments.prepare(env, retry=True)
        except Exception as exc:  # the builder's own message, for the user who asked
            self._said(ref, "failed", str(exc), time.monotonic() - began)
            return
        self.layout.envs.setdefault(tag, env)
        self._builds.prepared[tag] = prepared  # the first task of it starts a worker at once
        self._builds.failed.pop(tag, None)  # a failure of an earlier build is forgotten
        self._env_failures.pop(tag, None)
        built = prepared.build_seconds
        self._said(ref, "built", "" if built else "already built", built)
        self._wake()

    def _do_orders(self) -> None:
        """On the loop: removals asked for (refused while tasks of them are here)."""
        while self._ordered:
            ref, name = self._ordered.popleft()
            builds = self._builds
            tags = {
                t for t in (*self.layout.envs, *builds.prepared, *builds.failed) if named(t, name)
            }
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
                continue
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
