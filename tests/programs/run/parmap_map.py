"""parmap: map with extra arguments, on a multiprocessing Pool it creates itself."""

import parmap


def add(x, y, z=0):
    return x + y + z


if __name__ == "__main__":
    print("parmap", parmap.map(add, range(20), 5, z=1, pm_processes=2, pm_pbar=False))
    print("starmap", parmap.starmap(add, [(1, 2), (3, 4)], 10, pm_processes=2, pm_pbar=False))
