"""Monte Carlo estimate of pi with a multiprocessing Pool: plain stdlib code.

Each task draws its points from its own seeded generator, so the estimate
depends only on the seeds, never on which process ran which task.
"""

import multiprocessing
import random

POINTS_PER_TASK = 20_000
TASKS = 16


def inside(seed):
    rng = random.Random(seed)
    hits = 0
    for _ in range(POINTS_PER_TASK):
        x, y = rng.random(), rng.random()
        if x * x + y * y <= 1.0:
            hits += 1
    return hits


def main():
    with multiprocessing.Pool(4) as pool:
        hits = pool.map(inside, range(TASKS))
    total = sum(hits)
    print("hits per task:", hits)
    print("pi ~", 4.0 * total / (POINTS_PER_TASK * TASKS))


if __name__ == "__main__":
    main()
