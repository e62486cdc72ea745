"""concurrent.futures.ProcessPoolExecutor with a function of the main script (it is built on
multiprocessing: under `nimbus run` its processes are nimbus's)."""

import concurrent.futures
import math
import sys


def is_prime(n):
    if n < 2:
        return False
    return all(n % d for d in range(2, math.isqrt(n) + 1))


if __name__ == "__main__":
    numbers = [
        112272535095293,
        112582705942171,
        112272535095293,
        115280095190773,
        1099726899285419,
        17,
    ]
    with concurrent.futures.ProcessPoolExecutor(max_workers=2) as executor:
        print(list(zip(numbers, executor.map(is_prime, numbers))))
        futures = [executor.submit(pow, 2, n) for n in range(5)]
        print([f.result() for f in concurrent.futures.as_completed(futures)].__len__())
        process = next(iter(executor._processes.values()))
        print("process class", type(process).__module__, file=sys.stderr)
