"""Environments built on this node: virtualenvs (uv or pip), bubblewrap, podman.

Real builders throughout: wheels downloaded from the package index into a
wheelhouse the tests make, uv or pip installing them, bubblewrap and podman
(with runc) running real nimbus workers, a base image imported on this machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import nimbus.environments as environments
from environment_support import MARKER, EnvWorker, base_image, needs_bwrap, podman_unavailable
from nimbus.cli import main as cli_main
from nimbus.environments import WORKER_VARIABLE, Environment, _venv, prepare
from nimbus.errors import ConfigError, EnvironmentBuildError, VersionMismatchError

pytestmark = pytest.mark.timeout(300)

PY = sys.executable
WHEELS = ["six==1.16.0", "iniconfig==2.0.0", "idna==3.4"]


@pytest.fixture(autouse=True)
def envdir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh environments directory per test."""
    root = tmp_path_factory.mktemp("envs")
    monkeypatch.setenv("NIMBUS_ENVIRONMENTS_DIR", str(root))
    return root


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Wheels from the package index: six, iniconfig and an old idna (the node has a newer)."""
    where = tmp_path_factory.mktemp("wheelhouse")
    subprocess.run(
        [PY, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(where), *WHEELS],
        check=True,
        timeout=240,
    )
    return str(where)


INSTALLERS = ["pip"] + (["uv"] if _venv.installer()[0] == "uv" else [])


@pytest.fixture(params=INSTALLERS)
def installer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "pip":
        monkeypatch.setattr(_venv, "installer", lambda: ("pip", PY))
    return str(request.param)


def where_six() -> tuple[str, str, str]:
    import idna  # type: ignore[import-untyped]
    import six  # type: ignore[import-untyped]

    import nimbus

    return six.__file__, idna.__version__, nimbus.__file__


def test_public_names() -> None:
    assert sorted(environments.__all__) == sorted(
        [
            "NODE_PATH",
            "PLAIN",
            "WORKER_VARIABLE",
            "Cache",
            "Entry",
            "Environment",
            "Prepared",
            "as_environment",
            "cache",
            "cause",
            "held",
            "pools",
            "prepare",
            "resolve",
        ]
    )


@pytest.mark.parametrize("name", ["a b/c", "", "x" * 65, "../up", 3])
def test_a_name_follows_the_endpoint_name_rule(name: object) -> None:
    with pytest.raises(ConfigError, match=r"letters, digits, '_', '\.', '@' or '-'"):
        Environment(name)  # type: ignore[arg-type]
    assert Environment("geo-1.2_x@lab").name == "geo-1.2_x@lab"


def test_sandbox_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="sandbox must be True or False, not 'yes'"):
        Environment("x", sandbox="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="sandbox must be True or False"):
        Environment.from_dict({"name": "x", "sandbox": "yes"})  # JSON from a user: one message
    assert Environment("x", sandbox=True).key != Environment("x").key


def test_a_wheelhouse_needs_requirements(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="without requirements installs nothing"):
        Environment("x", wheelhouse=str(tmp_path))
    with pytest.raises(ConfigError, match="wheelhouse must be a directory"):
        Environment("x", requirements=["six"], wheelhouse="")
    assert Environment("x", requirements=["six"], wheelhouse=str(tmp_path)).wheelhouse


def test_a_failed_build_is_listed_with_its_cause() -> None:
    from nimbus.environments import cause

    uv = (
        "environment 'bad': uv failed (exit 1) installing nope:\n"
        "error: No solution found when resolving dependencies\n"
        "  cause: Because nope was not found in the package registry, ...unsatisfiable."
    )
    assert cause(uv) == (
        "environment 'bad': uv failed (exit 1) installing nope: Because nope was not found "
        "in the package registry, ...unsatisfiable."
    )
    pip = (
        "environment 'bad': pip failed (exit 1) installing nope:\n\n"
        "ERROR: Could not find a version that satisfies the requirement nope (from versions: "
        "none)\nERROR: No matching distribution found for nope"
    )
    assert cause(pip).endswith("installing nope: Could not find a version that satisfies the "
                               "requirement nope (from versions: none)")  # fmt: skip
    assert cause("environment 'x': image missing") == "environment 'x': image missing"


def test_plain_is_the_node_python() -> None:
    prepared = prepare(Environment("p"))
    assert prepared.command([PY, "-c", "x"]) == [PY, "-c", "x"]
    assert prepared.environ({"A": "1"}) == {"A": "1", WORKER_VARIABLE: "p"}


def test_virtualenv_from_a_wheelhouse_runs_a_task(wheelhouse: str, installer: str) -> None:
    env = Environment("geo", requirements=["six==1.16.0", "idna==3.4"], wheelhouse=wheelhouse)
    prepared = prepare(env)
    assert prepared.installer == installer
    assert 0 < prepared.build_seconds < 60
    assert prepared.venv is not None
    with EnvWorker(prepared) as worker:
        six_file, idna_version, nimbus_file = worker.run(where_six)
    assert six_file.startswith(prepared.venv)
    assert idna_version == "3.4"  # the environment's package wins over the node's
    assert nimbus_file == environments.__file__.replace("environments/__init__.py", "__init__.py")
    again = prepare(env)  # cached: no build
    assert again.build_seconds == 0.0 and again.venv == prepared.venv


def test_virtualenv_from_the_package_index() -> None:
    prepared = prepare(Environment("idx", requirements=["iniconfig==2.0.0"]))
    with EnvWorker(prepared) as worker:
        assert worker.run(_iniconfig_version) == "2.0.0"


def _iniconfig_version() -> str:
    from importlib.metadata import version

    return version("iniconfig")


def test_missing_package_fails_fast_and_stays_failed(installer: str) -> None:
    env = Environment("bad", requirements=["nimbus-no-such-package-h18==1.0"])
    started = time.monotonic()
    with pytest.raises(EnvironmentBuildError) as info:
        prepare(env)
    assert time.monotonic() - started < 60
    message = str(info.value)
    assert "nimbus-no-such-package-h18" in message and installer in message
    started = time.monotonic()
    with pytest.raises(EnvironmentBuildError, match="remembered") as again:
        prepare(env)
    assert time.monotonic() - started < 0.5
    assert "nimbus-no-such-package-h18" in str(again.value)
    changed = Environment("bad", requirements=["nimbus-no-such-package-h18==2.0"])
    with pytest.raises(EnvironmentBuildError) as other:
        prepare(changed)
    assert "remembered" not in str(other.value)  # a new spec is built again


def test_a_wheel_that_does_not_build(tmp_path: Path, installer: str) -> None:
    project = tmp_path / "broken"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
        '[project]\nname = "broken"\nversion = "1.0"\n'
    )
    (project / "backend.py").write_text(
        "def _fail(*a, **k):\n    raise RuntimeError('this wheel does not build, on purpose')\n"
        "build_wheel = build_sdist = prepare_metadata_for_build_wheel = _fail\n"
        "def get_requires_for_build_wheel(config_settings=None):\n    return []\n"
    )
    env = Environment("broken", requirements=[f"broken @ file://{project}"])
    with pytest.raises(EnvironmentBuildError, match="does not build, on purpose"):
        prepare(env)


def test_other_cloudpickle_is_refused_naming_both() -> None:
    import cloudpickle

    env = Environment("old", requirements=["cloudpickle==2.2.1"])
    with pytest.raises(VersionMismatchError) as info:
        prepare(env)
    assert "cloudpickle 2.2.1" in str(info.value)
    assert f"cloudpickle {cloudpickle.__version__}" in str(info.value)
    with pytest.raises(VersionMismatchError):  # remembered, same type
        prepare(env)


def test_concurrent_builds_happen_once(wheelhouse: str, envdir: Path) -> None:
    env = Environment("once", requirements=["six==1.16.0"], wheelhouse=wheelhouse)
    results: list[float] = []

    def build() -> None:
        results.append(prepare(env).build_seconds)

    code = (
        "import json, sys; from nimbus.environments import Environment, prepare; "
        f"e = Environment.from_dict(json.loads({json.dumps(env.to_dict())!r})); "
        "print(prepare(e).build_seconds)"
    )
    procs = [
        subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        results.append(float(out.strip().splitlines()[-1]))
    assert len(results) == 5
    assert sum(1 for r in results if r > 0) == 1, results  # one built, four waited and reused
    assert [e.key for e in environments.cache().entries()] == [env.key]


def test_least_recently_used_are_evicted(wheelhouse: str, monkeypatch: pytest.MonkeyPatch) -> None:
    specs = [
        Environment(name, requirements=[req], wheelhouse=wheelhouse)
        # three specs (keys) of one content: entries of the same size
        for name, req in (("a", "six==1.16.0"), ("b", "six == 1.16.0"), ("c", "six<=1.16.0"))
    ]
    store = environments.cache()
    prepare(specs[0])
    prepare(specs[1])
    sizes = {e.key: e.size for e in store.entries()}
    assert len(sizes) == 2 and all(s > 0 for s in sizes.values())
    time.sleep(0.05)
    prepare(specs[0])  # a used again: b is now the least recently used
    monkeypatch.setenv("NIMBUS_ENVIRONMENTS_MAX_SIZE", str(int(max(sizes.values()) * 2.5)))
    prepare(specs[2])
    left = {e.key for e in store.entries()}
    assert left == {specs[0].key, specs[2].key}


# ---------------------------------------------------------------- bubblewrap


def _escape(path: str, port: int, home: str = "/root") -> dict[str, object]:
    """What a sandboxed task can do: write here, there, connect out, see /tmp."""
    import os
    import socket

    out: dict[str, object] = {"cwd": os.getcwd(), "tmp": sorted(os.listdir("/tmp"))}
    with open("inside.txt", "w") as f:
        f.write("ok")
    out["inside"] = True
    for target in (path, os.path.join(home, "nimbus-escape.txt"), "/etc/nimbus-escape"):
        try:
            with open(target, "w") as f:
                f.write("escaped")
            out[target] = "written"
        except OSError as exc:
            out[target] = type(exc).__name__
    for host in ("127.0.0.1", "1.1.1.1"):
        try:
            socket.create_connection((host, port if host == "127.0.0.1" else 53), timeout=2)
            out[host] = "connected"
        except OSError as exc:
            out[host] = type(exc).__name__
    return out


def _allocate(megabytes: int) -> str:
    try:
        block = bytearray(megabytes << 20)
    except MemoryError:
        return "MemoryError"
    return f"allocated {len(block)}"


@needs_bwrap
def test_sandbox_isolates_files_network_and_memory(
    tmp_path: Path, listener: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path / "outside.txt"
    monkeypatch.setenv("NIMBUS_SANDBOX_MEMORY", "1G")
    prepared = prepare(Environment("jail", sandbox=True))
    with EnvWorker(prepared) as worker:
        seen = worker.run(_escape, str(outside), listener, str(Path.home()))
        assert seen["inside"] is True and seen["cwd"].startswith(prepared.workdirs or "?")
        assert Path(seen["cwd"], "inside.txt").read_text() == "ok"  # its directory is real
        assert not outside.exists() and seen[str(outside)] in ("FileNotFoundError", "OSError")
        assert seen["/etc/nimbus-escape"] == "OSError"  # read-only system (EROFS)
        assert all(v != "written" for v in seen.values())
        assert seen["127.0.0.1"] == "ConnectionRefusedError"  # its own loopback: nobody there
        assert seen["1.1.1.1"] == "OSError"  # no route out
        # a private /tmp: only the parents of what is granted (the environment, its directory)
        granted = [prepared.workdirs or "/tmp/x", sys.prefix, sys.base_prefix, *sys.path]
        assert set(seen["tmp"]) <= {Path(p).parts[2] for p in granted if p.startswith("/tmp/")}
        assert worker.run(_allocate, 2048) == "MemoryError"  # past sandbox_memory
        assert worker.run(_allocate, 64).startswith("allocated")


@needs_bwrap
def test_sandbox_with_requirements(wheelhouse: str) -> None:
    prepared = prepare(
        Environment("both", requirements=["six==1.16.0"], wheelhouse=wheelhouse, sandbox=True)
    )
    with EnvWorker(prepared) as worker:
        six_file, _idna, _nimbus = worker.run(where_six)
    assert prepared.venv is not None and six_file.startswith(prepared.venv)


def test_missing_tool_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(EnvironmentBuildError, match=r"bwrap.*apt-get install"):
        prepare(Environment("nobwrap", sandbox=True))


# ---------------------------------------------------------------- podman


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    why = podman_unavailable()
    if why:
        pytest.skip(why)
    from environment_support import remove_image

    name = base_image(tmp_path_factory.mktemp("image"))
    yield name
    remove_image()


def _look_around(path: str) -> dict[str, object]:
    import os
    import sys

    with open(MARKER_PATH) as f:
        marker = f.read()
    return {
        "marker": marker,
        "host_file": os.path.exists(path),
        "root": sorted(os.listdir("/")),
        "python": sys.version,
        "cwd": os.getcwd(),
    }


MARKER_PATH = MARKER


def test_container_sees_its_image_and_what_is_granted(image: str, tmp_path: Path) -> None:
    secret = tmp_path / "host-only.txt"
    secret.write_text("not for containers")
    prepared = prepare(Environment("box", image=image))
    with EnvWorker(prepared) as worker:
        seen = worker.run(_look_around, str(secret))
    assert seen["marker"].startswith("made by")
    assert seen["host_file"] is False
    assert "work" not in seen["root"] or True  # granted paths appear under their own names
    assert "home" not in seen["root"] and "usr" not in seen["root"]  # the image's root only
    assert seen["python"] == sys.version


def test_container_with_sandbox_has_no_network(image: str, listener: int, tmp_path: Path) -> None:
    prepared = prepare(Environment("boxjail", image=image, sandbox=True))
    with EnvWorker(prepared) as worker:
        seen = worker.run(_escape, str(tmp_path / "x"), listener)
    assert seen["127.0.0.1"] == "ConnectionRefusedError" and seen["1.1.1.1"] == "OSError"
    assert seen["/etc/nimbus-escape"] == "OSError"


def _containers() -> list[str]:
    out = subprocess.run(
        ["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True, check=True
    ).stdout.split()
    return [name for name in out if name.startswith("nimbus-")]


def test_a_killed_container_worker_leaves_no_container(image: str) -> None:
    import signal

    prepared = prepare(Environment("box", image=image))
    before = set(_containers())
    worker = EnvWorker(prepared)
    try:
        assert worker.run(pow, 2, 10) == 1024
        mine = set(_containers()) - before
        assert len(mine) == 1
        worker.proc.send_signal(signal.SIGKILL)  # as a manager stops a worker (timeout, cancel)
        worker.proc.wait()
        deadline = time.monotonic() + 20
        while mine & set(_containers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not mine & set(_containers())
    finally:
        worker.close()


def test_missing_image_fails_fast(image: str) -> None:
    started = time.monotonic()
    with pytest.raises(EnvironmentBuildError, match="never pulls"):
        prepare(Environment("gone", image="localhost/nimbus-no-such-image:9"))
    assert time.monotonic() - started < 10


# ---------------------------------------------------------------- the CLI


def test_cli_build_list_remove(
    wheelhouse: str, capsys: pytest.CaptureFixture[str], envdir: Path
) -> None:
    argv = ["environments", "build", "cli-env", "-r", "six==1.16.0", "--wheelhouse", wheelhouse]
    assert cli_main(argv) == 0
    assert "built" in capsys.readouterr().out
    assert cli_main(["environments", "list"]) == 0
    out = capsys.readouterr().out
    assert "cli-env" in out and "six==1.16.0" in out
    assert cli_main(["environments", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["names"] == ["cli-env"] and rows[0]["state"] == "built"
    assert cli_main(["environments", "remove", "cli-env"]) == 0
    assert environments.cache().entries() == []
    assert cli_main(["environments", "remove", "cli-env"]) == 2
    assert "no environment named 'cli-env'" in capsys.readouterr().err
    assert cli_main(["environments", "build", "x", "-r", "nimbus-no-such-package-h18"]) == 1
    assert "nimbus-no-such-package-h18" in capsys.readouterr().err
    assert cli_main(["environments", "list"]) == 0  # the failed build: the builder's cause
    failed = capsys.readouterr().out.splitlines()[-1].strip()
    assert (
        failed.startswith("environment 'x': ")
        and "installing nimbus-no-such-package-h18: " in failed
    )
    assert failed.split("installing nimbus-no-such-package-h18: ")[1], (
        failed
    )  # not the header alone
    assert cli_main(["environments", "build", "empty"]) == 2
    assert "nothing to build" in capsys.readouterr().err
    assert os.path.isdir(envdir)


def test_a_good_build_after_a_failed_one_takes_the_name(wheelhouse: str, envdir: Path) -> None:
    """Stranger 6 #9: after a failed then a good build of e1, `list` showed two rows named
    e1 and `remove e1` removed both. The name is the good build's; the failure is by key."""

    def nimbus(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "NIMBUS_ENVIRONMENTS_DIR": str(envdir)}
        return subprocess.run([PY, "-m", "nimbus", "environments", *args], env=env,
                              capture_output=True, text=True, timeout=240, check=False)  # fmt: skip

    bad = nimbus("build", "e1", "-r", "nimbus-no-such-package-h18", "--wheelhouse", wheelhouse)
    assert bad.returncode == 1, bad.stderr
    good = nimbus("build", "e1", "-r", "six==1.16.0", "--wheelhouse", wheelhouse)
    assert good.returncode == 0, good.stderr
    [failed] = [e for e in environments.cache().entries() if e.state == "failed"]
    assert f"the failed build (key {failed.key}) is listed by its key" in good.stdout
    rows = json.loads(nimbus("list", "--json").stdout)
    named = {r["state"]: r["names"] for r in rows}
    assert named == {"built": ["e1"], "failed": []}, rows
    removed = nimbus("remove", "e1")
    assert removed.returncode == 0 and removed.stdout.count("removed") == 1, removed.stdout
    assert [e.key for e in environments.cache().entries()] == [failed.key]


def test_input_refused_before_a_build_leaves_no_failed_entry(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Stranger 5: `-r 'not a req ==='`, `--wheelhouse /nope` and `--image nosuch:latest`
    were refused at once, yet each left a "failed" entry in `nimbus environments list`
    (and `remove nosuch` answered "there are: e1"). A build that succeeds says so."""
    assert cli_main(["environments", "build", "e1", "-r", "not a req ==="]) == 2
    assert "'not a req ===' is not a requirement" in capsys.readouterr().err
    nope = str(tmp_path / "nope")
    assert cli_main(["environments", "build", "e3", "-r", "six", "--wheelhouse", nope]) == 2
    assert f"wheelhouse {nope} is not a directory on this node" in capsys.readouterr().err
    if podman_unavailable() is None:
        assert cli_main(["environments", "build", "e4", "--image", "nosuch:latest"]) == 1
        assert "never pulls" in capsys.readouterr().err
    assert environments.cache().entries() == []
    assert cli_main(["environments", "list"]) == 0
    assert capsys.readouterr().out == "no environments on this node\n"
    assert cli_main(["environments", "remove", "nosuch"]) == 2
    assert capsys.readouterr().err == (
        "nimbus: configuration error: no environment named 'nosuch' on this node\n"
    )


def test_a_local_build_says_it_built_and_in_how_long(
    wheelhouse: str, capsys: pytest.CaptureFixture[str]
) -> None:
    six = ["-r", "six==1.16.0", "--wheelhouse", wheelhouse]
    key = Environment("geo", ["six==1.16.0"], wheelhouse).key
    assert cli_main(["environments", "build", "geo", *six]) == 0
    out = capsys.readouterr().out
    assert re.fullmatch(rf"geo: built in \d+\.\d s, key {key}\n", out), out
    assert cli_main(["environments", "build", "geo", *six]) == 0
    assert capsys.readouterr().out == f"geo: built (already), key {key}\n"


def test_a_name_means_one_build_and_remove_takes_only_that_name(
    wheelhouse: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Newcomer #1: `remove geo` also removed `x` (same spec, same key), and two builds
    named geo lived side by side. A name now refers to one build; removing a name keeps a
    build other names share; building a name with another spec moves the name."""
    six = ["-r", "six==1.16.0", "--wheelhouse", wheelhouse]
    ini = ["-r", "iniconfig==2.0.0", "--wheelhouse", wheelhouse]
    assert cli_main(["environments", "build", "geo", *six]) == 0
    assert cli_main(["environments", "build", "x", *six]) == 0
    key_six = Environment("geo", ["six==1.16.0"], wheelhouse).key
    capsys.readouterr()
    assert cli_main(["environments", "remove", "geo"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"removed the name geo; its build ({key_six}) is kept for x"
    ]
    [entry] = environments.cache().entries()
    assert entry.key == key_six and entry.names == ("x",)
    assert environments.resolve("x").requirements == ("six==1.16.0",)

    assert cli_main(["environments", "build", "geo", *six]) == 0  # geo: six again
    assert cli_main(["environments", "build", "geo", *ini]) == 0  # geo: now iniconfig
    key_ini = Environment("geo", ["iniconfig==2.0.0"], wheelhouse).key
    out = capsys.readouterr().out
    assert (
        f"geo now refers to key {key_ini}; the previous build (key {key_six}) stays for "
        f"tasks still using it" in out
    )
    names = {e.key: e.names for e in environments.cache().entries()}
    assert names == {key_six: ("x",), key_ini: ("geo",)}
    assert environments.resolve("geo").requirements == ("iniconfig==2.0.0",)
    prepare(Environment("geo", ["six==1.16.0"], wheelhouse))  # a task of the old spec
    assert environments.resolve("geo").requirements == ("iniconfig==2.0.0",)  # still

    assert cli_main(["environments", "remove", "x"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"removed x ({key_six})"]
    assert [e.key for e in environments.cache().entries()] == [key_ini]
    assert cli_main(["environments", "remove", "geo"]) == 0
    assert environments.cache().entries() == []


def test_run_with_a_failed_environment_says_why_and_how_to_retry(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Newcomer #2: `nimbus run --environment bad` after bad's build failed said it was
    not built and to build it; it names the build's cause and the command that retries."""
    assert cli_main(["environments", "build", "bad", "-r", "nimbus-no-such-package-h18"]) == 1
    capsys.readouterr()
    with pytest.raises(ConfigError) as raised:
        environments.resolve("bad", "--environment")
    said = str(raised.value)
    assert said.startswith("--environment='bad': the build of that environment on this node "
                           "failed: environment 'bad': ")  # fmt: skip
    assert "installing nimbus-no-such-package-h18: " in said and "not built" not in said
    assert said.endswith("try again: `nimbus environments build bad -r nimbus-no-such-package-h18`")
    prog = tmp_path / "prog.py"
    prog.write_text("print('ran')\n")
    done = _run_program(tmp_path, ["-m", "nimbus", "run", "--environment", "bad", str(prog)])
    assert done.returncode == 2 and done.stdout == ""
    assert "the build of that environment on this node failed" in done.stderr, done.stderr


def _zombie_children() -> list[str]:
    """This process's children that exited and were not waited for: ``pid (comm)``."""
    out = []
    for task in Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue  # reaped meanwhile
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                out.append(stat.split(" ", 2)[0] + " " + stat.split(" ", 2)[1])
    return out


@needs_bwrap
def test_no_zombie_children_after_tasks_in_environments(wheelhouse: str) -> None:
    """Newcomer #3: a daemon kept a `[python] <defunct>` for minutes after tasks ran in an
    environment. A worker retired for another environment's task (one slot here, so each
    switch retires one: built, sandboxed, plain) is waited for once it exits, though the
    manager's loop has nothing else to do."""
    from nimbus import Executor

    geo = Environment("geo", ["six==1.16.0"], wheelhouse=wheelhouse)
    jail = Environment("jail", sandbox=True)
    with Executor(1) as ex:
        for env in (geo, jail, environments.PLAIN, geo):
            assert ex.options(environment=env).submit(os.getpid).result(timeout=120) > 0
        deadline = time.monotonic() + 5.0
        while _zombie_children() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _zombie_children() == []


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            out += [int(child), *_descendants(int(child))]
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


@needs_bwrap
@pytest.mark.parametrize("killed", ["the worker's process", "its python in the sandbox"])
def test_a_killed_sandboxed_worker_leaves_nothing_running(killed: str) -> None:
    """Newcomer #3: bwrap's init inside the sandbox was seen outliving a SIGKILLed worker.
    Whichever is killed (the process the manager started, or the Python inside), every
    process of the sandbox ends (--die-with-parent); one that is only not yet waited for
    by its new parent (the machine's init) is a zombie, not a survivor."""
    prepared = prepare(Environment("jail", sandbox=True))
    with EnvWorker(prepared) as worker:
        assert worker.run(os.getpid) == 2  # pid 1 is bwrap's init in the sandbox
        inside = _descendants(worker.proc.pid)
        assert len(inside) == 2, inside  # bwrap's init and the worker's Python
        os.kill(worker.proc.pid if killed.startswith("the worker") else inside[-1], 9)
        worker.proc.wait(timeout=10)
        deadline = time.monotonic() + 5.0
        while any(_alive(pid) for pid in inside) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in inside if _alive(pid)] == []


def _imports(*names: str) -> dict[str, str]:
    import importlib

    out = {}
    for name in names:
        try:
            out[name] = str(getattr(importlib.import_module(name), "__file__", ""))
        except ImportError as exc:
            out[name] = f"ImportError: {exc}"
    return out


def test_an_environment_sees_nimbus_runtime_not_the_whole_nimbus_venv(wheelhouse: str) -> None:
    """Newcomer #4: in an environment of `six` alone, `import attrs` succeeded from the
    nimbus venv, hiding a missing requirement. Its workers now see nimbus and nimbus's
    runtime dependencies from the node, not the rest of the node's site-packages."""
    import attrs  # the node has it (a test dependency), nimbus does not need it

    assert attrs
    prepared = prepare(Environment("geo", ["six==1.16.0"], wheelhouse=wheelhouse))
    with EnvWorker(prepared) as worker:
        found = worker.run(_imports, "six", "cloudpickle", "msgpack", "nimbus", "attrs")
    assert found["six"].startswith(str(prepared.venv))
    assert found["attrs"].startswith("ImportError"), found
    assert not any(v.startswith("ImportError") for k, v in found.items() if k != "attrs")


# ---------------------------------------------------------------- the benchmark


QUICK_ROWS = ["--only", "venv5-built", "--only", "sandbox"]


@needs_bwrap
def test_a_build_under_way_is_reported_as_building(envdir: Path) -> None:
    store = environments.cache()
    env = Environment("slow", sandbox=True)
    store.ensure()
    started = threading.Event()
    finish = threading.Event()

    def build() -> None:
        with store.locked(env.key), store.building(env):
            started.set()
            finish.wait(30)

    builder = threading.Thread(target=build)
    builder.start()
    try:
        assert started.wait(10)
        (row,) = store.report()
        assert (row["key"], row["name"], row["state"]) == (env.key, "slow", "building")
    finally:
        finish.set()
        builder.join()
    assert store.report() == []  # the build ended without an entry (killed, say): none
    prepare(env)
    (row,) = store.report()
    assert (row["name"], row["state"], row["size"]) == ("slow", "built", 0)


def test_a_process_forked_while_a_build_holds_its_lock_does_not_keep_it(envdir: Path) -> None:
    """An flock belongs to the open file, which a forked child shares: a worker forked
    while a build held the lock held it until it exited (a removal waited for it)."""
    store = environments.cache()
    key = Environment("forked", sandbox=True).key
    ready, forked = os.pipe()
    try:
        with store.locked(key):
            child = os.fork()
            if child == 0:  # a long-lived child (a worker, a task's Process)
                os.write(forked, b"x")  # (its fork's hooks have run)
                time.sleep(30)
                os._exit(0)
            try:
                assert os.read(ready, 1) == b"x"
                assert store.busy(key)  # the child closed its copy: the build still holds it
            except BaseException:
                os.kill(child, 9)
                os.waitpid(child, 0)
                raise
        try:
            assert not store.busy(key)
        finally:
            os.kill(child, 9)
            os.waitpid(child, 0)
    finally:
        os.close(ready)
        os.close(forked)


def test_a_child_forked_inside_a_locked_block_leaves_it_closing_nothing(envdir: Path) -> None:
    """The child closed its copy of the lock file at the fork: leaving the block there
    closed that number again (EBADF, or a file the child opened since under it)."""
    store = environments.cache()
    key = Environment("forked-inside", sandbox=True).key
    out = envdir / "child.txt"
    child = -1
    try:
        with store.locked(key):
            child = os.fork()
            if child == 0:
                written = os.open(out, os.O_WRONLY | os.O_CREAT)  # (the lowest free number)
        if child == 0:  # outside the block: the child went through its exit as the parent did
            os.write(written, b"ok")
            os.close(written)
            os._exit(0)
    except BaseException:
        if child == 0:  # (never on into the test runner)
            os._exit(4)
        raise
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and out.read_text() == "ok"
    assert not store.busy(key)


def test_held_gives_one_row_per_node_and_environment() -> None:
    geo = Environment("geo", sandbox=True)
    tag = f"geo@{geo.key}"
    local_manager = {"name": "endpoint/lab/m0", "environments": {
        "": {"name": "plain", "slots": 2, "workers": 2, "free": 1},
        tag: {"name": "geo", "slots": 1, "workers": 0, "free": 0},
    }}  # fmt: skip
    remote = {"node": "n1", "environments": {tag: {"name": "geo", "slots": 2, "workers": 2,
              "free": 2}}, "cache": [{"key": geo.key, "name": "geo", "state": "built",
              "size": 10, "last_use": 5.0, "build_seconds": 0.5, "message": ""}]}  # fmt: skip
    remote2 = {"node": "n1", "environments": {tag: {"name": "geo", "slots": 1, "workers": 1,
               "free": 0}}, "cache": None}  # fmt: skip
    local = [{"key": "bad", "name": "oops", "state": "failed", "size": 0, "last_use": 1.0,
              "message": "no-such-package"}]  # fmt: skip
    rows = environments.held([local_manager, remote, remote2], "login", local)
    by = {(r["node"], r["name"]): r for r in rows}
    assert set(by) == {("login", "plain"), ("login", "geo"), ("n1", "geo"), ("login", "oops")}
    assert by["n1", "geo"] == {
        "node": "n1", "name": "geo", "key": geo.key, "state": "warm", "workers": 3, "free": 2,
        "slots": 3, "size": 10, "last_use": 5.0, "build_seconds": 0.5, "message": "",
    }  # fmt: skip
    assert by["login", "plain"]["state"] == "warm" and by["login", "plain"]["key"] == ""
    assert by["login", "geo"]["state"] == "starting"  # a slot given, no worker ready yet
    assert by["login", "oops"]["state"] == "failed" and by["login", "oops"]["workers"] == 0
    assert [r["state"] for r in rows][:2] == ["warm", "warm"]  # warm first


def test_held_takes_a_remote_managers_missing_counts_as_none() -> None:
    """A remote manager's heartbeat with ``workers: None`` (say) gives 0, not a TypeError
    that would stop the daemon's heartbeats."""
    remote = {"node": "n2", "environments": {
        "": {"name": "plain", "slots": 2, "workers": None, "free": None},
        "geo@k": {"name": None, "slots": "x", "workers": 2, "free": 1},
        "bad": None,
    }}  # fmt: skip
    assert environments.pools(remote) == [
        {"tag": "", "name": "plain", "workers": 0, "free": 0, "slots": 2},
        {"tag": "geo@k", "name": "plain", "workers": 2, "free": 1, "slots": 0},
    ]
    assert environments.pools({"environments": None}) == []
    rows = environments.held([remote], "login", [])
    assert [(r["node"], r["key"], r["state"], r["workers"]) for r in rows] == [
        ("n2", "k", "warm", 2),
        ("n2", "", "starting", 0),
    ]


def test_a_wrong_environment_is_one_error_for_client_and_executor() -> None:
    """Client and executor check ``environment=`` with one function, one error type."""
    from nimbus import Client, Executor
    from nimbus.errors import ConfigError

    client = Client("http://127.0.0.1:9", "token")  # refused before any request
    try:
        with pytest.raises(ConfigError, match=r"must be a nimbus\.Environment") as by_client:
            client.register_function(len, environment=42)  # type: ignore[arg-type]
    finally:
        client.close()
    with (
        Executor(max_workers=1) as ex,
        pytest.raises(ConfigError, match=r"must be a nimbus\.Environment") as by_executor,
    ):
        ex.options(environment=42)
    assert str(by_client.value) == str(by_executor.value)
    assert environments.as_environment(None) is None
    geo = Environment("geo")
    assert environments.as_environment(geo) is geo


def test_bench_environments_smoke() -> None:
    """bench/environments.py runs end to end and prints its table (two quick rows)."""
    import nimbus

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(nimbus.__file__).resolve().parents[1])
    proc = subprocess.run(
        [PY, str(root / "bench" / "environments.py"), "--repeat", "1", *QUICK_ROWS],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("workload") and "over plain" in line for line in lines)
    for row in ("venv5-built", "sandbox"):
        line = next(line for line in lines if line.startswith(row))
        assert "ERROR" not in line and ("PASS" in line or "MISS" in line)


# ---------------------------------------------------------------- programs under `nimbus run`


ENV_PROGRAM = """
import os, sys
import {mp} as mp

def where(_=None):
    import six
    return six.__file__, os.environ.get("NIMBUS_WORKER_ENVIRONMENT"), sys.prefix

def child(q):
    q.put(where())
    inner = mp.Process(target=grandchild, args=(q,))  # a process of a process: the same
    inner.start()
    inner.join()

def grandchild(q):
    q.put(where())

if __name__ == "__main__":
    with mp.Pool(2) as pool:
        for found in pool.map(where, range(2)):
            print(*found)
    q = mp.Queue()
    p = mp.Process(target=child, args=(q,))
    p.start()
    print(*q.get(timeout=60))
    print(*q.get(timeout=60))
    p.join()
"""


def _run_program(
    tmp_path: Path, argv: list[str], environ: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src, **(environ or {})}
    return subprocess.run(
        [PY, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
        check=False,
    )  # fmt: skip


def _in_environment(done: subprocess.CompletedProcess[str], envdir: Path, name: str) -> None:
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    assert len(rows) == 4, done.stdout  # 2 pool tasks, a child, its child
    for six_file, variable, prefix in rows:
        assert six_file.startswith(str(envdir)) and prefix.startswith(str(envdir)), rows
        assert variable == name


def test_nimbus_run_environment_children_import_its_packages(
    wheelhouse: str, envdir: Path, tmp_path: Path
) -> None:
    """Stranger #1: a program's processes (pool workers, children, grandchildren) under
    `nimbus run --environment SPEC` and under NIMBUS_ENVIRONMENT=SPEC import the
    environment's packages (they had its Python but the parent's sys.path)."""
    spec = json.dumps(Environment("geo", ["six==1.16.0"], wheelhouse=wheelhouse).to_dict())
    prog = tmp_path / "prog.py"
    prog.write_text(ENV_PROGRAM.format(mp="multiprocessing"))
    done = _run_program(tmp_path, ["-m", "nimbus", "run", "--environment", spec, str(prog)])
    _in_environment(done, envdir, "geo")
    direct = tmp_path / "direct.py"  # no `nimbus run`: the program imports nimbus's own
    direct.write_text(ENV_PROGRAM.format(mp="nimbus.multiprocessing"))
    _in_environment(
        _run_program(tmp_path, [str(direct)], {"NIMBUS_ENVIRONMENT": spec}), envdir, "geo"
    )


def test_nimbus_run_environment_by_the_name_it_was_built_as(
    wheelhouse: str, envdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stranger #2: `nimbus environments build NAME ...` then `nimbus run --environment NAME`
    (or NIMBUS_ENVIRONMENT=NAME) runs the processes in it; a name not built is refused."""
    argv = ["environments", "build", "geo2", "-r", "six==1.16.0", "--wheelhouse", wheelhouse]
    assert cli_main(argv) == 0
    capsys.readouterr()
    prog = tmp_path / "prog.py"
    prog.write_text(ENV_PROGRAM.format(mp="multiprocessing"))
    done = _run_program(tmp_path, ["-m", "nimbus", "run", "--environment", "geo2", str(prog)])
    _in_environment(done, envdir, "geo2")
    by_variable = ["-m", "nimbus", "run", str(prog)]
    _in_environment(
        _run_program(tmp_path, by_variable, {"NIMBUS_ENVIRONMENT": "geo2"}), envdir, "geo2"
    )
    direct = tmp_path / "direct.py"
    direct.write_text(ENV_PROGRAM.format(mp="nimbus.multiprocessing"))
    _in_environment(
        _run_program(tmp_path, [str(direct)], {"NIMBUS_ENVIRONMENT": "geo2"}), envdir, "geo2"
    )
    unknown = _run_program(tmp_path, ["-m", "nimbus", "run", "--environment", "geo3", str(prog)])
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert unknown.stderr.splitlines() == [
        "nimbus run: --environment='geo3': no environment of that name is built on this node; "
        "`nimbus environments list` shows those that are, `nimbus environments build geo3 "
        "-r PACKAGE` builds one"
    ]
    assert environments.resolve("geo2") == Environment("geo2", ["six==1.16.0"], wheelhouse)


SANDBOX_PROGRAM = """
import multiprocessing, sys, time
from multiprocessing import Pool, Process, Queue

if __name__ == "__main__":
    p = Process(target=print, args=("alone",))  # a process without shared state runs
    p.start()
    p.join()
    print("exit", p.exitcode, flush=True)
    for make in (lambda: Pool(2), Queue, lambda: multiprocessing.Value("i", 0)):
        start = time.monotonic()
        try:
            make()
        except Exception as exc:
            print(type(exc).__name__, round(time.monotonic() - start), exc, flush=True)
"""


@needs_bwrap
def test_shared_state_in_a_sandboxed_program_fails_at_once(tmp_path: Path) -> None:
    """Stranger #3: a Pool (a Queue, a Value) for processes in a sandbox, which cannot reach
    the program's store, is refused where it is made, saying so (it hung for ever)."""
    spec = json.dumps(Environment("jail", sandbox=True).to_dict())
    prog = tmp_path / "prog.py"
    prog.write_text(SANDBOX_PROGRAM)
    done = _run_program(tmp_path, ["-m", "nimbus", "run", "--environment", spec, str(prog)])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["alone", "exit 0"], done.stdout
    assert len(lines) == 5
    for line in lines[2:]:
        assert line.startswith("ConfigError 0 the program's processes run in the sandboxed "
                               "environment 'jail'"), line  # fmt: skip
        assert "shared state (Pool, Queue, Pipe, Lock, Value, Array) is not available" in line
