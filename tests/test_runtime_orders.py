"""``nimbus.runtime._orders``: a manager's ordered builds and removals of environments."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from environment_support import wheel
from nimbus import Environment


def test_ordered_builds_wait_their_turn_and_a_removal_during_a_build_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manager runs at most BUILDS_AT_ONCE ordered builds (the others wait, saying so);
    a build's outcome is applied by the manager's loop, and a removal ordered while it
    runs wins: the build is not registered when it ends."""
    from nimbus.runtime._orders import BUILDS_AT_ONCE, DONE
    from nimbus.runtime.manager import Manager
    from nimbus.runtime.task import environment_tag

    monkeypatch.setenv("NIMBUS_ENVIRONMENTS_DIR", str(tmp_path / "envs"))
    wheels = tmp_path / "wheels"
    envs = []
    for i in range(BUILDS_AT_ONCE + 1):
        wheel(wheels, version=f"1.{i}")
        envs.append(
            Environment(f"turn{i}", requirements=[f"orderpkg==1.{i}"], wheelhouse=str(wheels))
        )
    manager = Manager(1, on_results=lambda tasks: None, name="m1")
    manager.start()
    try:
        for i, env in enumerate(envs):
            manager.order(f"b{i}", "build", env.name, env)
        last = f"b{BUILDS_AT_ONCE}"
        deadline = time.monotonic() + 10
        while "waiting its turn" not in manager.orders[last]["message"]:
            assert time.monotonic() < deadline, manager.orders
            time.sleep(0.01)
        assert manager.orders["b0"] == {"state": "building", "message": "", "seconds": 0.0}
        manager.order("r0", "remove", "turn0")  # while it builds
        deadline = time.monotonic() + 180
        while any(said["state"] not in DONE for said in list(manager.orders.values())):
            assert time.monotonic() < deadline, manager.orders
            time.sleep(0.05)
        said = manager.orders
        assert said["b0"]["state"] == "failed", said
        assert "was removed on m1 while it was being built" in said["b0"]["message"]
        assert said["r0"]["state"] == "removed", said
        assert all(said[f"b{i}"]["state"] == "built" for i in range(1, len(envs))), said
        gone = environment_tag(envs[0])
        assert gone not in manager.layout.envs and gone not in manager._builds.prepared
        assert all(environment_tag(env) in manager._builds.prepared for env in envs[1:])
    finally:
        manager.shutdown(kill=True)
