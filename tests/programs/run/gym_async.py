"""gymnasium's AsyncVectorEnv: a Process and a Pipe per environment, shared-memory observations."""

import sys

import gymnasium as gym
import numpy as np

if __name__ == "__main__":
    envs = gym.vector.AsyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(2)])
    obs, _ = envs.reset(seed=[1, 2])
    total = np.array(obs).sum()
    for step in range(20):
        obs, reward, terminated, truncated, _ = envs.step(np.array([step % 2, 1 - step % 2]))
        total += np.array(obs).sum() + reward.sum()
    envs.close()
    print("gym", round(float(total), 6))
    print("process class", type(envs.processes[0]).__module__, file=sys.stderr)
