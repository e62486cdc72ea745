"""pandarallel with its multiprocessing context set to nimbus's."""

from __future__ import annotations

import os

import pytest

pd = pytest.importorskip("pandas")
pandarallel_core = pytest.importorskip("pandarallel.core")

import nimbus.multiprocessing as nimbus_mp  # noqa: E402


def row_score(row):
    return row["a"] * 3 + row["b"] ** 2 - len(row["name"])


@pytest.fixture
def on_nimbus(monkeypatch: pytest.MonkeyPatch) -> None:
    # pandarallel takes its Pool and Manager from this module attribute,
    # multiprocessing.get_context("fork") at import; give it nimbus's
    monkeypatch.setattr(pandarallel_core, "CONTEXT", nimbus_mp.get_context("fork"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("use_memory_fs", [False, True], ids=["pipe", "memory_fs"])
def test_parallel_apply_equals_apply(on_nimbus: None, use_memory_fs: bool) -> None:
    if use_memory_fs and not pandarallel_core.Path(pandarallel_core.MEMORY_FS_ROOT).exists():
        pytest.skip("no memory file system")
    pandarallel_core.pandarallel.initialize(
        nb_workers=2, progress_bar=False, use_memory_fs=use_memory_fs, verbose=0
    )
    df = pd.DataFrame(
        {
            "a": range(500),
            "b": [i % 7 for i in range(500)],
            "name": [f"row{i}" for i in range(500)],
        }
    )
    expected = df.apply(row_score, axis=1)
    got = df.parallel_apply(row_score, axis=1)
    pd.testing.assert_series_equal(got, expected)
    # and a lambda, which pandarallel ships to the workers with dill
    pd.testing.assert_series_equal(
        df.parallel_apply(lambda r: r["a"] - r["b"], axis=1),
        df.apply(lambda r: r["a"] - r["b"], axis=1),
    )
    # the rows went to nimbus processes (forked by warm workers), not to children of ours
    parents = set(df.parallel_apply(lambda r: os.getppid(), axis=1))
    assert os.getpid() not in parents
