"""pandarallel with a row function of the main script that uses a module imported at its top."""

import math
import sys

import pandas as pd
from pandarallel import pandarallel


def row_func(row):
    return math.sqrt(row["a"]) + len(row["name"])


if __name__ == "__main__":
    pandarallel.initialize(
        nb_workers=2, progress_bar=False, use_memory_fs=sys.argv[1] == "memory_fs", verbose=0
    )
    df = pd.DataFrame({"a": range(300), "name": [f"row{i}" for i in range(300)]})
    got = df.parallel_apply(row_func, axis=1)
    print(round(got.sum(), 6), got.equals(df.apply(row_func, axis=1)))
    print(df.a.parallel_map(lambda a: a % 7).sum())
