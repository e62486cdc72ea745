"""Smoke runs of the benchmarks in bench/: each runs end to end and prints its table."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _start(
    script: str, *args: str, timeout: float = 110, clean: bool = False, **env_extra: str
) -> subprocess.CompletedProcess[str]:
    """Run bench/<script> with this test's nimbus (and ``env_extra`` in its environment)."""
    import nimbus

    env = {k: v for k, v in os.environ.items() if not (clean and k.startswith("NIMBUS_"))}
    package_parent = str(Path(nimbus.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / script), *args],
        cwd=ROOT,
        env=env | env_extra,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its process group: stopped whole if it hangs
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = _stop_hung(proc)
        pytest.fail(
            f"bench/{script} {' '.join(args)} ran over {timeout} s and was stopped; what "
            f"it printed (with its processes' stacks, asked for by SIGUSR1):\n"
            f"--- stdout\n{out}\n--- stderr\n{err}",
            pytrace=False,
        )
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _stop_hung(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """A bench run over its time: its Python processes asked for their stacks (SIGUSR1:
    the benches and nimbus's workers register faulthandler for it), then all of its
    processes killed; what it printed."""
    import psutil

    def tree() -> list[psutil.Process]:
        try:
            top = psutil.Process(proc.pid)
            return [top, *top.children(recursive=True)]
        except psutil.Error:
            return []

    hung = tree()
    for p in hung:
        try:
            if p.name().startswith("python"):
                p.send_signal(signal.SIGUSR1)
        except psutil.Error:
            pass
    try:
        proc.communicate(timeout=5)  # their stacks come in meanwhile (not lost on retry)
    except subprocess.TimeoutExpired:
        pass
    for p in {*hung, *tree()}:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        return proc.communicate(timeout=20)
    except subprocess.TimeoutExpired as exc:  # a process it left holds the pipes
        proc.kill()
        return (exc.stdout or b"").decode(errors="replace"), (exc.stderr or b"").decode(
            errors="replace"
        )


def _run(script: str, *args: str, timeout: float = 110, clean: bool = False) -> list[str]:
    """Run bench/<script> with this test's nimbus; its stdout lines (it must exit 0)."""
    proc = _start(script, *args, timeout=timeout, clean=clean)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.splitlines()


def _header(lines: list[str], *columns: str) -> None:
    header = next((line for line in lines if line.startswith("workload")), None)
    assert header is not None, lines
    for column in columns:
        assert column in header


def _row(lines: list[str], name: str) -> str:
    row = next((line for line in lines if line.startswith(name)), None)
    assert row is not None, lines
    return row


def _report_module() -> Any:
    """bench/_report.py, imported by path (bench/ holds a multiprocessing.py)."""
    spec = importlib.util.spec_from_file_location("_bench_report", ROOT / "bench" / "_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_verdicts_are_ratios_and_report_rows_have_none() -> None:
    report = _report_module()

    @dataclasses.dataclass
    class Row(report.Figures):  # type: ignore[name-defined, misc]
        title: str = "lock"
        unit: str = "us"
        higher_is_better: bool = False
        target: str = "<= 2x"
        judge: Any = None
        baseline: list[float] = dataclasses.field(default_factory=list)
        nimbus: list[float] = dataclasses.field(default_factory=list)
        error: str = ""

    fast_but_100x = Row(judge=lambda r: r <= 2.0, baseline=[0.5e-6], nimbus=[50e-6])
    assert fast_but_100x.ratio == pytest.approx(100) and fast_but_100x.status == "MISS"
    assert Row(judge=lambda r: r <= 2.0, baseline=[1.0], nimbus=[1.5]).status == "PASS"
    assert Row(judge=None, target="report", baseline=[1.0], nimbus=[0.1]).status == "-"
    assert Row(judge=lambda r: True, nimbus=[1.0]).status == "-"  # no baseline: no verdict
    order: list[str] = []
    got = report.alternate(
        3, {"a": lambda: order.append("a") or 1.0, "b": lambda: order.append("b") or 2.0}
    )
    assert order == ["a", "b"] * 3 and got == {"a": [1.0] * 3, "b": [2.0] * 3}


def _no_report_verdicts(lines: list[str]) -> None:
    """A row whose target is "report" says no PASS or MISS."""
    for line in lines:
        if " report" in line and not line.startswith("workload"):
            assert not line.rstrip().endswith(("PASS", "MISS")), line


@pytest.mark.timeout(120)
def test_bench_executor_quick_roundtrip() -> None:
    lines = _run("executor.py", "--quick", "--repeat", "1", "--only", "roundtrip")
    _header(lines, "PPE", "nimbus", "ratio", "target", "result")
    assert _row(lines, "roundtrip").rstrip().endswith(("PASS", "MISS"))


@pytest.mark.timeout(120)
def test_bench_messaging_quick() -> None:
    lines = _run("messaging.py", "--quick", "--repeat", "1")
    _header(lines, "reference", "nimbus", "ratio", "target", "result")
    for name in ("rtt 64B", "rtt 1MB", "oneway"):
        assert _row(lines, name).rstrip().endswith(("PASS", "MISS"))
    for name in ("allreduce", "directory"):
        assert _row(lines, name).rstrip().endswith(" -")
    _no_report_verdicts(lines)


@pytest.mark.timeout(180)
def test_bench_multiprocessing_quick(tmp_path: Path) -> None:
    out = tmp_path / "mp.json"
    args = ("--quick", "--repeat", "1", "--only", "lock", "--only", "queue", "--json", str(out))
    lines = _run("multiprocessing.py", *args, timeout=170)
    _header(lines, "stdlib", "nimbus", "ratio", "target", "result")
    rows = {row["name"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"cold start", "lock", "queue"}
    for name in ("lock", "queue"):
        assert rows[name]["status"] in ("PASS", "MISS"), rows[name]
        assert rows[name]["ratio"] > 0
        assert rows[name]["target"].split()[-1].endswith("x"), rows[name]  # a ratio
    assert rows["cold start"]["status"] == "-"


@pytest.mark.timeout(120)
def test_bench_service_quick(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    lines = _run("service.py", "--quick", "--workers", "2", "--json", str(out), clean=True)
    _header(lines, "what", "nimbus", "target", "result")
    for name in ("roundtrip", "throughput", "mp_pool", "heartbeats"):
        assert _row(lines, name).rstrip().endswith(" -")  # no baseline here: no verdict
    _no_report_verdicts(lines)
    assert "2000/2000 complete" in _row(lines, "offline")
    assert out.exists()


def test_bench_service_baseline_needs_a_compared_workload() -> None:
    proc = _start("service.py", "--quick", "--baseline", "htex", "--only", "offline")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--baseline htex compares the roundtrip and throughput workloads" in proc.stderr
    assert "--only roundtrip" in proc.stderr


@pytest.mark.timeout(300)
def test_bench_service_baseline_without_pypi_says_what_to_do(tmp_path: Path) -> None:
    """No parsl venv and no package index: a clear error before anything starts, not a trace."""
    venv = tmp_path / "venv-parsl"
    args = ("--quick", "--baseline", "htex", "--only", "roundtrip", "--parsl-venv", str(venv))
    proc = _start(
        "service.py",
        *args,
        timeout=280,
        PIP_INDEX_URL="http://127.0.0.1:9/simple",  # nothing listens on the discard port
        PIP_CONFIG_FILE=os.devnull,
        PIP_RETRIES="0",
        PIP_TIMEOUT="2",
        PIP_NO_CACHE_DIR="1",
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "pip install" in proc.stderr and "parsl==" in proc.stderr
    assert "reaches PyPI" in proc.stderr and "run without --baseline" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (venv / "bin" / "python").exists()  # the venv is kept: a later run only installs
    assert not proc.stdout  # no table: nothing was measured


@pytest.mark.timeout(120)
def test_bench_run_quick(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    lines = _run("run.py", "--repeat", "1", "--json", str(out))
    assert lines[0].startswith("program")
    assert _row(lines, "no-op script").split()[2].endswith("ms")
    rows = json.loads(out.read_text())["rows"]
    assert [row["program"] for row in rows] == ["no-op script", "script importing multiprocessing"]
    assert all(row["nimbus_run_s"] > 0 and row["python_s"] > 0 for row in rows)


@pytest.mark.timeout(180)
def test_bench_dataflow_quick_local(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    lines = _run(
        "dataflow.py", "--quick", "--no-ray", "--no-service", "--json", str(out), timeout=170
    )
    _header(lines, "workload", "nimbus", "ratio", "target")
    assert "10 MB out and back" in _row(lines, "10 MB out and back")
    assert (
        _row(lines, "campaign 40 x 1 MB, local runtime: through references").rstrip().endswith(" -")
    )  # informational on one machine: no verdict
    sort = _row(lines, "MapReduce sort, 16 MB in, 4 workers")
    assert "direct" in sort
    if os.geteuid() == 0:  # on 4 nodes with shaped links, the shared directory over them
        assert "4 nodes, links 1000 Mbit/s; shared dir: a file server" in sort
        figures = json.loads(out.read_text())["mapreduce_sort"]
        for way in ("direct", "store", "shared"):  # each way crossed the nodes' links
            assert figures[way]["node_links_bytes"] >= 2 * figures[way]["shuffled_bytes"], way
        assert figures["shared"]["server_link_bytes"] >= 2 * figures["shared"]["shuffled_bytes"]
        assert figures["direct"]["server_link_bytes"] < figures["direct"]["shuffled_bytes"] / 4
        with open("/proc/mounts") as f:
            assert "nimbus-mr-" not in f.read()  # every node's mount gone with the run
    assert out.exists()


def _sharedfs_module() -> Any:
    spec = importlib.util.spec_from_file_location("_sharedfs", ROOT / "bench" / "_sharedfs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("_sharedfs", module)  # (its dataclass looks itself up there)
    spec.loader.exec_module(module)
    return module


def test_the_shared_directory_is_served_over_the_nodes_links_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """bench/_sharedfs.py: a file one node writes under its mount is on the file server
    and read by another node through the network (both links carry it), and the cluster
    stops whole: mounts gone, the server's processes ended, the namespaces removed."""
    import psutil

    fs = _sharedfs_module()
    why = fs.missing()
    if why:
        pytest.skip(f"no shared file system here: {why}")
    data = os.urandom(8 << 20)
    with fs.Cluster(2, 200_000_000, 400_000_000, tmp_path) as cluster:
        first, second = cluster.nodes
        before = cluster.counted()
        with open(first.mount / ".part", "wb") as f:
            f.write(data)
            os.fsync(f.fileno())
        (first.mount / ".part").rename(first.mount / "shard")
        assert (cluster.export / "shard").read_bytes() == data  # on the server's disk
        assert (second.mount / "shard").read_bytes() == data
        nodes, server = (after - b for after, b in zip(cluster.counted(), before, strict=True))
        assert nodes >= 2 * len(data) and server >= 2 * len(data)
        pids = [proc.pid for _, proc in cluster.mounts] + [cluster.server.pid]
        namespaces = [link.ns for link in cluster.links]
        mounts = [str(node.mount) for node in cluster.nodes]
    with open("/proc/mounts") as f:
        mounted = f.read()
    assert not [m for m in mounts if m in mounted]
    assert not [pid for pid in pids if psutil.pid_exists(pid)]
    left = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    assert not set(namespaces) & set(left)


def test_bench_dataflow_ends_a_wait_over_its_limit_naming_it_with_the_stacks() -> None:
    """A hang in the bench is an error at once, saying which step and where each thread
    waits (a wait of 0.05 s is over for the campaign's first chain)."""
    args = ("--quick", "--no-ray", "--no-service", "--only", "campaign", "--wait", "0.05")
    proc = _start("dataflow.py", *args, timeout=110)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "] campaign: a local Executor(2) starts" in proc.stderr  # the progress lines
    assert "HUNG: campaign: chain 0 through references: no answer within 0.05 s" in proc.stderr
    assert "most recent call first" in proc.stderr and "in campaign" in proc.stderr


def test_a_hung_bench_through_the_service_leaves_nothing_running() -> None:
    """Review 7: ``hung()`` ended the run with ``os._exit`` and left the service, its
    store and the agents (in their own sessions) running for ever: they are killed."""
    import psutil

    def theirs() -> set[int]:
        found = set()
        for proc in psutil.process_iter(["cmdline"]):
            line = " ".join(proc.info["cmdline"] or ())
            if "nimbus-bench-" in line or "nimbus.endpoint.daemon dataflow" in line:
                found.add(proc.pid)
        return found

    before = theirs()
    args = ("--quick", "--no-ray", "--only", "deps", "--wait", "0.05")
    proc = _start("dataflow.py", *args, timeout=150)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "HUNG: deps" in proc.stderr, proc.stderr
    deadline = time.monotonic() + 10
    while theirs() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    left = theirs() - before
    assert not left, f"left running: {[psutil.Process(p).cmdline() for p in left]}"


def test_a_bench_over_its_time_is_stopped_whole_and_shows_what_it_printed(
    tmp_path: Path,
) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(
        "import faulthandler, signal, subprocess, sys, time\n"
        "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
        "print('a row', flush=True)\n"
        "print('a progress line', file=sys.stderr, flush=True)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(child.pid, flush=True)\n"
        "def waits_for_ever():\n"
        "    time.sleep(600)\n"
        "waits_for_ever()\n"
    )
    with pytest.raises(pytest.fail.Exception) as failed:
        _start(str(script), timeout=3)  # (an absolute path: not one of bench/)
    said = str(failed.value)
    assert "ran over 3 s and was stopped" in said
    assert "a row" in said and "a progress line" in said
    assert "in waits_for_ever" in said  # its stack, asked for by SIGUSR1
    child = int(said.split("--- stdout\n", 1)[1].splitlines()[1])
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the bench's child was left running"


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
