"""Tests of the nimbus command, run as real subprocesses (``python -m nimbus``)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import nimbus
from nimbus.cli import COMMANDS, build_parser, main


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
    assert "endpoint" in out.stderr and "tasks" in out.stderr  # the commands, with their help


def test_info_shows_the_effective_storage_dir(tmp_path: Path) -> None:
    runtime = tmp_path / "rt"
    out = nimbus_cmd("info", tmp_path=tmp_path, NIMBUS_RUNTIME_DIR=str(runtime))
    assert out.returncode == 0, out.stderr
    [line] = [line for line in out.stdout.splitlines() if "storage_dir" in line]
    assert f"{runtime}/files" in line and "none" not in line
    [line] = [line for line in out.stdout.splitlines() if "database_url" in line]
    assert f"sqlite:///{runtime}/service/registry.sqlite3" in line
    report = json.loads(
        nimbus_cmd("info", "--json", tmp_path=tmp_path, NIMBUS_RUNTIME_DIR=str(runtime)).stdout
    )
    assert report["settings"]["storage_dir"]["value"] is None  # the setting: unset
    assert report["settings"]["storage_dir"]["effective"] == f"{runtime}/files"
    chosen = nimbus_cmd("info", tmp_path=tmp_path, NIMBUS_STORAGE_DIR=str(tmp_path / "shared"))
    assert f"{tmp_path}/shared" in chosen.stdout


# one line naming the argument and what is accepted, exit status 2, nothing sent anywhere
BAD_ARGUMENTS = [
    (["tasks", "list", "--limit", "-5"], "argument --limit", "from 1 to 10000"),
    (["tasks", "list", "--limit", "lots"], "argument --limit", "from 1 to 10000"),
    (["endpoint", "start", "bad name!"], "argument NAME", "letters, digits"),
    (["endpoint", "configure", ""], "argument NAME", "letters, digits"),
    (["endpoint", "configure", "lab", "--workers", "0"], "argument --workers", ">= 1"),
    (["service", "token", "create", ""], "argument NAME", "letters, digits"),
    (["service", "token", "create", "a b*"], "argument NAME", "letters, digits"),
    (["service", "start", "--port", "70000"], "argument --port", "0 to 65535"),
    (
        ["login", "--service", "http://127.0.0.1:8420/v1", "--token", "t"],
        "argument --service",
        "http://127.0.0.1:8420 ",
    ),
    (["login", "--service", "127.0.0.1:8420", "--token", "t"], "argument --service", "http(s)://"),
    (["login", "--service", "http://[::1", "--token", "t"], "argument --service", "http(s)://"),
    (["tasks", "show", "../../etc"], "argument TASK_ID", "a UUID"),
    (
        ["endpoint", "configure", "lab", "--exports", "/nonexistent"],
        "argument --exports",
        "/nonexistent does not exist on this machine",
    ),
    (  # (it said "does not exist on this machine")
        ["endpoint", "configure", "lab", "--exports", "relative/dir"],
        "argument --exports",
        "relative/dir must be absolute",
    ),
    (
        ["endpoint", "configure", "lab", "--exports", "/etc/hostname"],
        "argument --exports",
        "/etc/hostname is not a directory",
    ),
    (["service", "start", "--url-file", "/proc/nope/x"], "--url-file", "cannot write there"),
    (["environments", "build", "x", "--timeout", "-1"], "argument --timeout", "seconds > 0"),
    (["environments", "remove", "x", "--timeout", "0"], "argument --timeout", "seconds > 0"),
    # stranger 6 #10: these named Settings.walltime / Settings.max_blocks, the top-level help
    (["endpoint", "configure", "lab", "--walltime", "99"], "argument --walltime", "HH:MM:SS"),
    (["endpoint", "configure", "lab", "--max-blocks", "-1"], "argument --max-blocks", ">= 1"),
    (["endpoint", "configure", "lab", "--parallelism", "2"], "argument --parallelism", "<= 1"),
    (
        ["endpoint", "start", "new", "--workers", "1"],
        "unrecognized",
        "`nimbus endpoint start --help`",
    ),
]


@pytest.mark.parametrize(("args", "argument", "accepted"), BAD_ARGUMENTS, ids=repr)
def test_bad_argument_is_one_line_exit_2(
    tmp_path: Path, args: list[str], argument: str, accepted: str
) -> None:
    out = nimbus_cmd(*args, tmp_path=tmp_path, NIMBUS_RUNTIME_DIR=str(tmp_path / "rt"))
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("nimbus " + args[0])
    assert argument in lines[0] and accepted in lines[0]
    assert repr(args[-1]) in lines[0] or args[-1] in lines[0]  # what was given
    assert "Traceback" not in out.stderr and "{" not in out.stderr
    assert "Settings." not in out.stderr and "configuration error" not in out.stderr
    assert out.stdout == ""
    assert not (tmp_path / "rt" / "service").exists()  # no registry was made


def test_help_shows_defaults_and_options(tmp_path: Path) -> None:
    start = nimbus_cmd("service", "start", "--help", tmp_path=tmp_path).stdout
    assert "default 127.0.0.1" in start and "default 8420" in start and "--url-file" in start
    assert "SIGTERM" in start
    configure = nimbus_cmd("endpoint", "configure", "--help", tmp_path=tmp_path).stdout
    assert "--workers" in configure and "--prefetch" in configure
    assert "NIMBUS_WORKERS" in configure and "NIMBUS_PREFETCH" in configure
    endpoint_start = nimbus_cmd("endpoint", "start", "--help", tmp_path=tmp_path).stdout
    assert "--foreground" in endpoint_start and "agent.log" in endpoint_start
    listing = " ".join(nimbus_cmd("tasks", "list", "--help", tmp_path=tmp_path).stdout.split())
    assert "--limit N" in listing and "default 50" in listing


def test_endpoint_list_has_a_header_row(tmp_path: Path) -> None:
    out = nimbus_cmd("endpoint", "list", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["NAME", "AGENT", "SERVICE", "ENDPOINT", "ID"]


def test_registry_has_the_subcommands() -> None:
    assert {"demo", "version", "info"} <= set(COMMANDS)


def test_main_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert nimbus.__version__ in capsys.readouterr().out


def _subcommands(parser: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """Every subcommand's parser in the tree under ``parser``, with its words."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield " ".join((*path, name)), sub
                yield from _subcommands(sub, (*path, name))


def test_every_subcommand_says_what_it_does() -> None:
    commands = dict(_subcommands(build_parser()))
    assert {"environments list", "tasks show", "endpoint start", "endpoints list"} <= set(commands)
    for words, parser in commands.items():
        text = parser.description or ""
        assert text[:1].isupper() and text.endswith("."), f"`nimbus {words}`: {text!r}"
        for action in parser._actions:  # every option and argument has its help
            if not isinstance(action, argparse._SubParsersAction):
                assert action.help, f"`nimbus {words}` {action.option_strings or action.dest}"


def test_help_states_defaults_once() -> None:
    commands = dict(_subcommands(build_parser()))

    def helps(words: str) -> dict[str, str]:
        return {
            a.option_strings[-1]: a.help or "" for a in commands[words]._actions if a.option_strings
        }

    assert "default ./netbench-report" in helps("netbench")["--out"]
    assert "(down)" in helps("netbench")["--direction"]
    assert "default: one per core" in helps("manager")["--workers"]
    assert helps("endpoint configure")["--workers-per-node"].count("default") == 1
    assert "state" in helps("tasks list")["--status"]


def test_run_help_says_what_it_does(tmp_path: Path) -> None:
    done = nimbus_cmd("run", "--help", tmp_path=tmp_path)
    assert done.returncode == 0 and "Run a Python program with nimbus" in done.stdout


@pytest.mark.parametrize("body", [b"<!DOCTYPE HTML>\n<html><body>Not here</body></html>\n", b""])
def test_a_url_that_is_not_a_nimbus_service_is_said_in_one_line(
    tmp_path: Path, body: bytes
) -> None:
    """Stranger 6 #5: another web server's 404 page (or an empty 404) printed as the error."""
    import http.server
    import threading

    class Foreign(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Foreign)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        proc = nimbus_cmd("login", "--service", url, "--token", "nimbus_x", tmp_path=tmp_path)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    err = proc.stderr.strip()
    assert proc.returncode == 1 and "Traceback" not in err, proc.stderr
    assert len(err.splitlines()) == 1, err
    assert url in err and "404" in err and "not a nimbus service" in err, err
