"""Tests of the nimbus command, run as real subprocesses (``python -m nimbus``)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

import nimbus
from nimbus.cli import COMMANDS, main


def nimbus_cmd(*args: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NIMBUS_")}
    clean |= {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "config"), **env}
    return subprocess.run(
        [sys.executable, "-m", "nimbus", *args],
        capture_output=True,
        text=True,
        env=clean,
        timeout=60,
        check=False,
    )


def test_version(tmp_path: Path) -> None:
    out = nimbus_cmd("version", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"nimbus {nimbus.__version__}" in out.stdout
    assert f"Python {platform.python_version()}" in out.stdout


def test_info(tmp_path: Path) -> None:
    out = nimbus_cmd("info", tmp_path=tmp_path, NIMBUS_WORKERS="3")
    assert out.returncode == 0, out.stderr
    assert "workers: 3" in out.stdout
    assert "NIMBUS_WORKERS" in out.stdout
    assert "(env NIMBUS_WORKERS)" in out.stdout
    assert "redis:   embedded" in out.stdout
    assert "redis-server" in out.stdout


def test_info_json(tmp_path: Path) -> None:
    out = nimbus_cmd("info", "--json", tmp_path=tmp_path, NIMBUS_PREFETCH="2")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["settings"]["prefetch"] == {
        "value": 2,
        "env": "NIMBUS_PREFETCH",
        "source": "env NIMBUS_PREFETCH",
    }
    assert report["redis"]["kind"] == "embedded"
    binary = Path(report["redis"]["binary"])
    assert binary.name == "redis-server"
    assert os.access(binary, os.X_OK)


def test_info_external_redis(tmp_path: Path) -> None:
    out = nimbus_cmd("info", tmp_path=tmp_path, NIMBUS_REDIS_URL="redis://db.example:6379/1")
    assert out.returncode == 0, out.stderr
    assert "redis:   external, redis://db.example:6379/1" in out.stdout


@pytest.mark.parametrize("value", ["0", "lots"])
def test_bad_workers_exits_2_without_traceback(tmp_path: Path, value: str) -> None:
    out = nimbus_cmd("info", tmp_path=tmp_path, NIMBUS_WORKERS=value)
    assert out.returncode == 2
    assert "NIMBUS_WORKERS" in out.stderr
    assert repr(value) in out.stderr
    assert "an integer >= 1" in out.stderr
    assert "Traceback" not in out.stderr
    assert out.stdout == ""


def test_bad_config_file_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("prefetch = 0\n")
    out = nimbus_cmd("info", tmp_path=tmp_path, NIMBUS_CONFIG=str(config))
    assert out.returncode == 2
    assert "'prefetch'" in out.stderr
    assert "Traceback" not in out.stderr


def test_no_command_is_a_usage_error(tmp_path: Path) -> None:
    out = nimbus_cmd(tmp_path=tmp_path)
    assert out.returncode == 2
    assert "usage: nimbus" in out.stderr


def test_registry_has_the_subcommands() -> None:
    assert {"demo", "version", "info"} <= set(COMMANDS)


def test_main_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert nimbus.__version__ in capsys.readouterr().out
