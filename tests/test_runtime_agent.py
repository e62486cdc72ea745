"""The runtime's agent (``nimbus.runtime.agent``): what it holds of the node's data."""

from __future__ import annotations

from pathlib import Path

import pytest

from nimbus.data import default_root
from nimbus.runtime import agent as agent_module
from nimbus.runtime.agent import Agent


@pytest.fixture
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    monkeypatch.setenv("NIMBUS_RUNTIME_DIR", str(rt))
    # the data is held this long after the agent starts: never before its stop here,
    # however loaded the machine
    monkeypatch.setattr(agent_module, "DATA_AFTER", 600.0)
    return rt


def test_an_agent_stopped_before_it_held_the_data_makes_no_sweeper_to_close(
    runtime_dir: Path,
) -> None:
    """Review 7 #12: a runtime stopped within DATA_AFTER built its data Sweeper (its
    thread, a sweep of the node, its data server) at exit, only to close it."""
    agent = Agent(on_results=lambda tasks: None)
    agent.shutdown()
    assert not agent._data_thread.is_alive()
    assert agent._data is None
    assert not default_root().exists()


def test_what_the_tasks_of_an_agent_stopped_at_once_left_is_removed(runtime_dir: Path) -> None:
    agent = Agent(on_results=lambda tasks: None)
    root = default_root()
    (root / "obj").mkdir(mode=0o700, parents=True)  # as a task's kept result makes it
    (root / "obj" / "x").write_bytes(b"x")
    root.chmod(0o700)
    agent.shutdown()
    assert not root.exists()
    assert agent._data is not None and agent._data.server is None  # (nothing served at exit)
