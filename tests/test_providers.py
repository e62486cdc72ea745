"""Providers against real schedulers: local process groups and a private Slurm cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import nimbus.providers
from nimbus.errors import ProviderError
from nimbus.providers import (
    PROVIDERS,
    BlockState,
    BlockStatus,
    LocalProvider,
    Provider,
    SlurmProvider,
    walltime_seconds,
)
from slurm_support import wait_for


def states(provider: Provider, ids: list[str]) -> dict[str, BlockState]:
    return {b: s.state for b, s in provider.status(ids).items()}


@pytest.fixture
def slurm_env(slurm: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    return slurm


def test_public_names_and_registry() -> None:
    assert set(nimbus.providers.__all__) == {
        "PROVIDERS",
        "BlockState",
        "BlockStatus",
        "Launcher",
        "LocalProvider",
        "Provider",
        "SingleNodeLauncher",
        "SlurmProvider",
        "SrunLauncher",
        "store_for_nodes",
        "walltime_seconds",
    }
    assert {"local": LocalProvider, "slurm": SlurmProvider} == PROVIDERS
    assert BlockState("pending") is BlockState.PENDING and not BlockState.PENDING.terminal
    assert walltime_seconds("1-00:02:03") == 86400 + 123
    with pytest.raises(ProviderError, match="NIMBUS_WALLTIME"):
        walltime_seconds("30 minutes")


def test_local_provider_runs_cancels_and_reports(tmp_path: Path) -> None:
    provider = LocalProvider(worker_init=f"echo init >> {tmp_path}/init")
    done = provider.submit(f'echo "$NIMBUS_NODE $X" >> {tmp_path}/ran', 3, env={"X": "y"})
    slow = provider.submit("sleep 60", 2)
    try:
        wait_for(lambda: states(provider, [done])[done] is BlockState.COMPLETED)
        assert sorted((tmp_path / "ran").read_text().split("\n"))[1:] == [
            f"{done}/{i} y" for i in range(3)
        ]
        wait_for(lambda: (tmp_path / "init").read_text().count("init") == 5)
        assert states(provider, [slow]) == {slow: BlockState.RUNNING}
    finally:
        provider.cancel([slow])
    assert states(provider, [slow, "local-99"]) == {
        slow: BlockState.CANCELLED,
        "local-99": BlockState.UNKNOWN,
    }


def test_slurm_block_runs_the_command_once_on_each_node(slurm_env: Any, tmp_path: Path) -> None:
    provider = SlurmProvider(
        partition=slurm_env.partition,
        walltime="00:05:00",
        worker_init=f"echo init-$SLURM_JOB_ID >> {tmp_path}/init",
        script_dir=tmp_path / "scripts",
    )
    job = provider.submit(
        f"sh -c 'echo $SLURMD_NODENAME $SECRET > {tmp_path}/$SLURMD_NODENAME'",
        2,
        env={"SECRET": "a b'c"},
    )
    assert job.isdigit()
    wait_for(lambda: states(provider, [job])[job] is BlockState.COMPLETED, what="the block to end")
    ran = sorted(p.read_text().strip() for p in tmp_path.glob("n*"))
    assert len(ran) == 2 and all(line.endswith(" a b'c") for line in ran)
    assert len({line.split()[0] for line in ran}) == 2  # two different nodes
    assert (tmp_path / "init").read_text().count(f"init-{job}") == 1  # the script ran once
    # the script held the block's secret: gone once sbatch took it; the output stays
    assert not list((tmp_path / "scripts").glob("block-*.sh"))
    assert (tmp_path / "scripts" / f"block-{job}.out").exists()
    assert (tmp_path / "scripts").stat().st_mode & 0o777 == 0o700
    assert "export SECRET='a b'\"'\"'c'" in provider.script("x", 1, {"SECRET": "a b'c"})


def test_slurm_script_has_every_block_setting(tmp_path: Path) -> None:
    provider = SlurmProvider(
        partition="debug",
        account="proj1",
        qos="short",
        walltime="01:30:00",
        exclusive=True,
        scheduler_options="--mem=4G\n#SBATCH --constraint=haswell",
        worker_init="module load python",
        script_dir=tmp_path,
    )
    script = provider.script("nimbus-manager", 3, {"NIMBUS_AGENT_ADDRESS": "login1:5000"})
    lines = script.splitlines()
    for line in (
        "#SBATCH --nodes=3",
        "#SBATCH --time=01:30:00",
        "#SBATCH --partition=debug",
        "#SBATCH --account=proj1",
        "#SBATCH --qos=short",
        "#SBATCH --exclusive",
        "#SBATCH --mem=4G",
        "#SBATCH --constraint=haswell",
        "export NIMBUS_AGENT_ADDRESS=login1:5000",
        "module load python",
    ):
        assert line in lines, (line, script)
    assert lines.index("module load python") < len(lines) - 1  # worker_init, then the launcher
    assert lines[-1].startswith("srun --nodes=3 --ntasks=3 --ntasks-per-node=1")
    assert lines[-1].endswith(" nimbus-manager")
    # every #SBATCH line comes before the first command, or Slurm ignores it
    first_command = next(i for i, line in enumerate(lines[1:], 1) if not line.startswith("#"))
    assert all(not line.startswith("#SBATCH") for line in lines[first_command:])
    assert SlurmProvider(script_dir=tmp_path).script("cmd", 1).splitlines()[-1] == "cmd"


def test_slurm_status_is_one_call_for_many_blocks_and_cancel_ends_them(
    slurm_env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shim = tmp_path / "bin"
    shim.mkdir()
    log = tmp_path / "calls"
    for tool in ("squeue", "scancel", "sbatch"):
        real = __import__("shutil").which(tool)
        (shim / tool).write_text(f'#!/bin/sh\necho {tool} >> {log}\nexec {real} "$@"\n')
        (shim / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}:{__import__('os').environ['PATH']}")
    provider = SlurmProvider(walltime="00:05:00", script_dir=tmp_path / "scripts")
    jobs = [provider.submit("sleep 120", 1) for _ in range(3)]
    wait_for(lambda: set(states(provider, jobs).values()) == {BlockState.RUNNING})
    before = log.read_text().split().count("squeue")
    status = provider.status(jobs)
    assert log.read_text().split().count("squeue") == before + 1  # one call for 3 blocks
    assert all(s.nodes.startswith("n") for s in status.values())
    provider.cancel(jobs)
    assert log.read_text().split().count("scancel") == 1
    wait_for(lambda: set(states(provider, jobs).values()) == {BlockState.CANCELLED})
    assert provider.status([]) == {}


def test_sbatch_refusal_quotes_the_scheduler(slurm_env: Any, tmp_path: Path) -> None:
    provider = SlurmProvider(partition="nope", script_dir=tmp_path)
    with pytest.raises(ProviderError, match="invalid partition specified: nope"):
        provider.submit("true", 1)
    too_many = SlurmProvider(script_dir=tmp_path)
    with pytest.raises(ProviderError, match=r"Slurm refused the block: .*node"):
        too_many.submit("true", 9)


def test_missing_sbatch_names_the_provider_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ProviderError, match="NIMBUS_PROVIDER"):
        SlurmProvider()


def test_block_status_is_a_record() -> None:
    assert BlockStatus(BlockState.RUNNING).message == ""


def test_cancelling_a_block_that_already_ended_is_quiet(slurm_env: Any, tmp_path: Path) -> None:
    provider = SlurmProvider(walltime="00:05:00", script_dir=tmp_path)
    job = provider.submit("true", 1)
    wait_for(lambda: states(provider, [job])[job] is BlockState.COMPLETED)
    provider.cancel([job])  # no error: it is gone, as asked
    with pytest.raises(ProviderError, match="scancel failed"):
        provider.cancel(["not-a-job"])
