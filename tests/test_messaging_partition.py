"""A partition between two "hosts": network namespaces joined by a veth pair.

Two instances of one program run in two namespaces (10.231.0.1 and .2), each
with its own socket directory, so they can reach each other only over TCP;
both reach the state store (a Unix socket: the file system is shared). With
the link down, the sender's connection attempts time out and its messages go
through the store; once the link is back it connects directly. The receiver
checks that it got every message once and in order. Needs root and ``ip``:
skipped without them; as root, a namespace that cannot be made fails the test
with what ``ip`` said.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from nimbus.statestore import Program

pytestmark = pytest.mark.timeout(120)

PEER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from nimbus import statestore
    from nimbus.messaging import Instance
    from nimbus.statestore import Keys
    from nimbus.messaging._directory import socket_dir

    url, program_id, role, ip, rundir = sys.argv[1:6]
    keys = Keys(program_id)
    ep = Instance(
        lambda: statestore.connect(url), keys, b"token", socket_dir(Path(rundir), program_id),
        instance_id=role, tcp_host=ip, host="host-" + role, ttl_ms=60_000,
    )
    print("ready", flush=True)
    if role == "b":
        got = []
        while True:
            obj = ep.recv(source="a", timeout=60)
            if obj == "end":
                break
            if isinstance(obj, int):
                got.append(obj)
        print("received", got == list(range(200)), len(got), flush=True)
        ep.close()
        sys.exit(0)
    while ep.directory.refresh("b") is None:
        time.sleep(0.01)
    for i in range(100):
        ep.send("b", i)
    print("phase1 links_out", ep.statistics()["links_out"], flush=True)
    sys.stdin.readline()  # the link is back
    for i in range(100, 200):
        ep.send("b", i)
        time.sleep(0.01)
    deadline = time.monotonic() + 30
    while ep.statistics()["links_out"] == 0 and time.monotonic() < deadline:
        ep.send("b", "ping")
        time.sleep(0.05)
    print("phase2 links_out", ep.statistics()["links_out"], flush=True)
    ep.send("b", "end")
    ep.close()
    """
)


_made: list[str] = []


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str, str]]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    tag = f"{os.getpid() % 100000}"
    ns_a, ns_b, veth_a, veth_b = f"nbp{tag}a", f"nbp{tag}b", f"nbv{tag}a", f"nbv{tag}b"
    try:
        _ip("netns", "add", ns_a)
        _ip("netns", "add", ns_b)
        _ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        _ip("link", "set", veth_a, "netns", ns_a)
        _ip("link", "set", veth_b, "netns", ns_b)
        for ns, dev, addr in ((ns_a, veth_a, "10.231.0.1"), (ns_b, veth_b, "10.231.0.2")):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
    except subprocess.CalledProcessError as exc:
        subprocess.run(["ip", "link", "del", veth_a], capture_output=True, timeout=30)
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        pytest.fail(
            f"as root, making network namespaces failed: {' '.join(exc.cmd)}: "
            f"{exc.stderr.decode().strip()}"
        )
    try:
        yield ns_a, ns_b, veth_a
    finally:
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        while _made:
            shutil.rmtree(_made.pop(), ignore_errors=True)


def _peer(ns: str, script: Path, program: Program, role: str, ip: str) -> subprocess.Popen[str]:
    rundir = tempfile.mkdtemp(prefix=f"nbp{role}-")  # a socket directory of its own
    _made.append(rundir)
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    argv = ["ip", "netns", "exec", ns, sys.executable, str(script)]
    argv.extend((program.url, program.program_id, role, ip, rundir))
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", line + (proc.stderr.read() if proc.stderr else "")
    return proc


def test_partition_falls_back_to_the_store_then_reconnects(
    namespaces: tuple[str, str, str], program: Program, tmp_path: Path
) -> None:
    ns_a, ns_b, veth_a = namespaces
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    _ip("-n", ns_a, "link", "set", veth_a, "down")  # partitioned from the start
    b = _peer(ns_b, script, program, "b", "10.231.0.2")
    a = _peer(ns_a, script, program, "a", "10.231.0.1")
    try:
        assert a.stdout is not None and a.stdin is not None and b.stdout is not None
        assert a.stdout.readline().split() == ["phase1", "links_out", "0"]  # all via the store
        _ip("-n", ns_a, "link", "set", veth_a, "up")  # the partition heals
        a.stdin.write("go\n")
        a.stdin.flush()
        assert a.stdout.readline().split() == ["phase2", "links_out", "1"]  # direct again
        assert b.stdout.readline().split() == ["received", "True", "200"]
        assert a.wait(30) == 0 and b.wait(30) == 0
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
