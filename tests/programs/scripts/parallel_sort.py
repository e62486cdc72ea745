"""Parallel sort: slices sent to worker processes over Pipes, sorted there, merged.

Plain stdlib code: one Process and one Pipe per slice; the parent sends each
slice, every child sorts its slice and sends it back, and the parent merges
the sorted runs with heapq.merge.
"""

import hashlib
import heapq
import multiprocessing
import random

N = 200_000
PROCESSES = 4


def sort_slice(conn):
    chunk = conn.recv()
    chunk.sort()
    conn.send(chunk)
    conn.close()


def main():
    rng = random.Random(2024)
    data = [rng.randrange(-(10**9), 10**9) for _ in range(N)]

    step = (N + PROCESSES - 1) // PROCESSES
    pipes, workers = [], []
    for i in range(PROCESSES):
        parent_end, child_end = multiprocessing.Pipe()
        worker = multiprocessing.Process(target=sort_slice, args=(child_end,))
        worker.start()
        child_end.close()
        parent_end.send(data[i * step : (i + 1) * step])
        pipes.append(parent_end)
        workers.append(worker)

    runs = [conn.recv() for conn in pipes]
    for worker in workers:
        worker.join()
    merged = list(heapq.merge(*runs))

    digest = hashlib.sha256(repr(merged).encode()).hexdigest()
    print("sorted:", merged == sorted(data))
    print("length:", len(merged), "first:", merged[:3], "last:", merged[-3:])
    print("exit codes:", [worker.exitcode for worker in workers])
    print("sha256:", digest)


if __name__ == "__main__":
    main()
