"""tqdm.contrib.concurrent.process_map (a ProcessPoolExecutor under the progress bar)."""

from tqdm.contrib.concurrent import process_map


def cube(x):
    return x**3


if __name__ == "__main__":
    print(sum(process_map(cube, range(200), max_workers=2, chunksize=10, disable=True)))
