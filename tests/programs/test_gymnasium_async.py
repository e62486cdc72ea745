"""gymnasium's AsyncVectorEnv (a Process and a Pipe per environment) on a nimbus context."""

from __future__ import annotations

import pytest

gym = pytest.importorskip("gymnasium")
np = pytest.importorskip("numpy")

import gymnasium.vector.async_vector_env as async_vector_env  # noqa: E402

import nimbus.multiprocessing as nimbus_mp  # noqa: E402

SEEDS = [11, 22]
STEPS = 40


def _rollout(envs) -> tuple[list, list, list]:
    observations, rewards, ends = [], [], []
    obs, _ = envs.reset(seed=SEEDS)
    observations.append(np.array(obs))
    for step in range(STEPS):
        actions = np.array([step % 2, (step // 3) % 2])
        obs, reward, terminated, truncated, _ = envs.step(actions)
        observations.append(np.array(obs))
        rewards.append(np.array(reward))
        ends.append(np.array(terminated) | np.array(truncated))
    return observations, rewards, ends


@pytest.fixture
def nimbus_context(monkeypatch: pytest.MonkeyPatch) -> None:
    # AsyncVectorEnv calls multiprocessing.get_context(context) in its module
    monkeypatch.setattr(async_vector_env, "multiprocessing", nimbus_mp)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "shared_memory",
    [
        pytest.param(True, id="shared"),  # gymnasium's default: np.frombuffer(Array.get_obj())
        pytest.param(False, id="pipes"),
    ],
)
def test_async_vector_env_equals_sync(nimbus_context: None, shared_memory: bool) -> None:
    env_fns = [lambda: gym.make("CartPole-v1") for _ in SEEDS]
    sync = gym.vector.SyncVectorEnv(env_fns)
    try:
        expected = _rollout(sync)
    finally:
        sync.close()

    envs = gym.vector.AsyncVectorEnv(env_fns, shared_memory=shared_memory, context="spawn")
    try:
        assert all(type(p).__module__.startswith("nimbus") for p in envs.processes)
        got = _rollout(envs)
    finally:
        envs.close()
    assert all(p.exitcode is not None for p in envs.processes)

    for name, want, have in zip(("observations", "rewards", "ends"), expected, got):
        assert len(want) == len(have), name
        for step, (a, b) in enumerate(zip(want, have)):
            np.testing.assert_array_equal(b, a, err_msg=f"{name} at step {step}")
