"""nimbus.network's counting cgroups (``_cgcount``, ``_bpf``): workers counted by eBPF on a
cgroup v2 directory of their own, with no namespace and no veth (root).

Real workers (an Executor) run real traffic: curl and child processes against an HTTP
server on the node's 127.0.0.1, TCP and UDP to peers on the node's loopback and in a
network namespace of the test's own behind a veth (not loopback). After each test
nothing of nimbus's is left: no cgroup, no slot file, no namespace.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nimbus import Executor
from nimbus.errors import ConfigError, WorkerLost
from nimbus.network import DEVICE, Limits, WorkerNetworks
from nimbus.network._objects import object_server
from test_network import (  # the helpers of the namespace tests, on the same server
    ROOT,
    _child,
    _curl,
    _store_round_trip,
    _store_round_trip_with_drops,
    accounting,
    needs_root,
    tcp_store,  # noqa: F401  (the fixture)
)


@pytest.fixture
def http() -> Iterator[int]:
    """An HTTP server on the node's 127.0.0.1: GET /N sends N bytes, PUT swallows."""
    with object_server() as port:
        yield port


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Workers counted by their cgroups; afterwards, nothing of them is left."""
    with accounting(monkeypatch, "cgroup", "cgroups, eBPF, a test namespace") as patched:
        yield patched


def _exact(measured: int, payload: int) -> bool:
    """Within 1 % or 4 KiB of the payload (HTTP's headers are in it, a few hundred bytes).
    No allowance for retransmits: a cgroup's bytes are payload once (``_bpf``)."""
    return abs(measured - payload) <= max(payload * 0.01, 4096)


def _where() -> tuple[bool, str, int]:
    """(in a namespace of its own?, its cgroup v2 path, its pid)."""
    with open("/proc/self/net/dev") as f:
        inside = f" {DEVICE}:" in f.read().replace("\n", " ")
    with open("/proc/self/cgroup") as f:
        v2 = next(line[3:].strip() for line in f if line.startswith("0::"))
    return inside, v2, os.getpid()


def _curl_and_child(port: int, get_curl: int, get_child: int, put: int) -> tuple[str, int]:
    return _curl(port, get_curl, put), _child(port, get_child)


@needs_root
def test_every_byte_of_curl_and_children_counted_by_the_workers_cgroup(
    counted: pytest.MonkeyPatch, http: int
) -> None:
    """4 tasks at once on 4 workers: each one's curl (a C program) and child process
    counted, nothing of the others', with no namespace on their way."""
    sizes = [(3_000_000, 1_000_000, 500_000), (1_000_000, 2_000_000, 2_000_000)] * 2
    with Executor(4) as ex:
        where = {ex.submit(_where).result(timeout=60) for _ in range(4)}
        futures = [ex.submit(_curl_and_child, http, *size) for size in sizes]
        for fut, (get_curl, get_child, put) in zip(futures, sizes, strict=True):
            assert fut.result(timeout=60) == (str(get_curl), get_child)
            r = fut.record
            assert r.net_source == "cgroup", r
            assert _exact(r.net_bytes_in, get_curl + get_child), (r.net_bytes_in, r.tcp)
            assert _exact(r.net_bytes_out, put), (r.net_bytes_out, r.tcp)
            assert r.tcp is not None and {"retransmits", "duplicates_in"} <= set(r.tcp)
            # (3 of its own at most; other processes' counted tasks on the host count too:
            # every Executor run as root counts its workers, auto being the default)
            assert r.colocated is not None and 0 <= r.colocated["min"] <= r.colocated["max"]
    assert not any(inside for inside, _, _ in where)  # the node's own network
    assert all(Path(v2).name.startswith("nimbus-") for _, v2, _ in where), where


_ECHO = r"""
import os, socket, struct, sys, threading
host = sys.argv[1]
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); udp.bind((host, 0))
tcp = socket.create_server((host, 0))
print(udp.getsockname()[1], tcp.getsockname()[1], flush=True)
def echo():
    while True:
        data, peer = udp.recvfrom(65536)
        udp.sendto(data, peer)
def serve(conn):
    with conn:
        back = struct.unpack("!Q", conn.recv(8, socket.MSG_WAITALL))[0]
        while conn.recv(1 << 16):
            pass
        conn.sendall(b"b" * back)
threading.Thread(target=echo, daemon=True).start()
while True:
    threading.Thread(target=serve, args=(tcp.accept()[0],), daemon=True).start()
"""


class _Peer:
    """The echo server above, on ``host`` (in namespace ``ns`` if given): UDP datagrams
    echoed, TCP: ``back`` (its first 8 bytes) sent after the rest is read."""

    def __init__(self, host: str, ns: str | None = None) -> None:
        prefix = ["ip", "netns", "exec", ns] if ns else []
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-c", _ECHO, host], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        udp, tcp = self.proc.stdout.readline().split()
        self.host, self.udp, self.tcp = host, int(udp), int(tcp)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def peers() -> Iterator[dict[str, _Peer]]:
    """One peer on the node's 127.0.0.1, one in a namespace of the test's own behind a veth
    (10.216.0.2: traffic that leaves the node's loopback)."""
    ns, host = f"nmbtest{os.getpid()}", f"nmbt{os.getpid() % 100000}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    made: list[_Peer] = []
    try:
        subprocess.run(
            ["ip", "-batch", "-"], check=True, text=True,
            input=f"link add {host} type veth peer name eth0 netns {ns}\n"
            f"addr add 10.216.0.1/30 dev {host}\nlink set {host} up\n",
        )  # fmt: skip
        subprocess.run(
            ["ip", "-n", ns, "-batch", "-"], check=True, text=True,
            input="addr add 10.216.0.2/30 dev eth0\nlink set eth0 up\nlink set lo up\n",
        )  # fmt: skip
        made.append(_Peer("127.0.0.1"))
        made.append(_Peer("10.216.0.2", ns))
        yield {"loopback": made[0], "veth": made[1]}
    finally:
        for peer in made:
            peer.close()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", host], capture_output=True)


def _udp_echo(host: str, port: int, count: int, size: int) -> int:
    """``count`` datagrams of ``size`` bytes out, each one's echo waited for: bytes back."""
    back = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(5)
        for _ in range(count):
            sock.sendto(b"d" * size, (host, port))
            back += len(sock.recv(65536))
    return back


def _tcp_both_ways(host: str, port: int, out: int, back: int) -> int:
    """``out`` bytes (and 8 saying ``back``) sent, ``back`` received: bytes received."""
    got = 0
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(struct.pack("!Q", back) + b"o" * out)
        sock.shutdown(socket.SHUT_WR)
        while data := sock.recv(1 << 16):
            got += len(data)
    return got


def _in_a_child(fn: Any, *args: Any) -> int:
    """``fn(*args)`` in a child process (not the worker's sockets): its result."""
    code = f"import test_network_cgcount as t; print(t.{fn.__name__}{args!r})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@needs_root
def test_tcp_and_udp_counted_on_loopback_and_off_it(
    counted: pytest.MonkeyPatch, peers: dict[str, _Peer]
) -> None:
    """UDP (payload: 8 header bytes off, not TCP's) and TCP both ways, from the worker and
    from its child, to a peer on the node's loopback and to one behind a veth."""
    with Executor(1) as ex:
        for where, peer in peers.items():
            for how in ("worker", "child"):
                run = (lambda f, *a: ex.submit(_in_a_child, f, *a)) if how == "child" else ex.submit
                udp = run(_udp_echo, peer.host, peer.udp, 300, 1000)
                assert udp.result(timeout=60) == 300_000
                r = udp.record
                assert r.net_source == "cgroup", r
                assert (r.net_bytes_in, r.net_bytes_out) == (300_000, 300_000), (where, how, r)
                tcp = run(_tcp_both_ways, peer.host, peer.tcp, 3_000_000, 1_500_000)
                assert tcp.result(timeout=60) == 1_500_000
                r = tcp.record
                assert r.net_bytes_in == 1_500_000, (where, how, r.net_bytes_in, r.tcp)
                assert r.net_bytes_out == 3_000_008, (where, how, r.net_bytes_out, r.tcp)


@needs_root
def test_state_store_traffic_reported_apart_in_a_cgroup(
    counted: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("tcp_store")  # (test_network's)
    counted.setenv("NIMBUS_REDIS_URL", url)
    with Executor(1) as ex:
        assert ex.submit(_store_round_trip, url, 10).result(timeout=60) == 10
        fut = ex.submit(_store_round_trip, url, 2_000_000)
        assert fut.result(timeout=60) == 2_000_000
    r = fut.record
    assert r.net_source == "cgroup"
    assert _exact(r.net_nimbus_out, 2_000_000) and _exact(r.net_nimbus_in, 2_000_000), r
    assert r.net_bytes_in < 8_000 and r.net_bytes_out < 8_000, r


@needs_root
def test_what_the_state_stores_connection_sent_again_is_no_ones_in_a_cgroup(
    counted: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """As a namespace's (test_network): a cgroup's counts take the copies off themselves,
    and nimbus's payload is once there too."""
    url = request.getfixturevalue("tcp_store")
    counted.setenv("NIMBUS_REDIS_URL", url)
    r = _store_round_trip_with_drops(url)
    assert r.net_source == "cgroup" and r.tcp is not None
    assert r.tcp["retransmits"] > 0, r.tcp
    assert _exact(r.net_nimbus_out, 2_000_000) and _exact(r.net_nimbus_in, 2_000_000), r
    assert r.net_bytes_in < 8_000 and r.net_bytes_out < 8_000, r


def _orphan() -> tuple[str, int]:
    """Leave a child running (the worker's cgroup holds it); the cgroup's path, the pid."""
    child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    return _where()[1], child.pid


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] in "ZX"
    except FileNotFoundError:
        return True


@needs_root
def _nested(die: bool) -> str:
    """Start an Executor of the task's own (its workers' cgroups inside this worker's);
    with ``die``, this worker dies while it runs."""
    inner = Executor(1)
    where = inner.submit(_where).result(timeout=60)[1]
    if die:
        os._exit(3)
    inner.shutdown()
    return where


def test_a_dead_workers_cgroup_goes_with_its_tasks_own_workers_cgroups(
    counted: pytest.MonkeyPatch,
) -> None:
    """A task starts an Executor of its own and its worker dies: the worker's cgroup is
    removed with the task's workers' cgroups inside it, and the next worker starts (it
    could not: its slot's directory was left, "cannot make the worker's cgroup (File
    exists)", and the manager failed every task). The fixture looks that none is left."""
    with Executor(1) as ex:
        inner = ex.submit(_nested, False).result(timeout=90)
        assert Path(inner).parent.name.startswith("nimbus-"), inner  # inside the worker's
        with pytest.raises(WorkerLost):
            ex.submit(_nested, True).result(timeout=90)
        assert ex.submit(_where).result(timeout=60)[0] is False  # a new worker serves


def test_a_workers_cgroup_goes_with_it_and_takes_its_orphans(counted: pytest.MonkeyPatch) -> None:
    """A worker that dies: its cgroup removed, what it left running killed; a new worker
    gets a cgroup of its own; at the end none is left (the fixture looks)."""
    from nimbus.network._cgcount import hierarchy

    mine = hierarchy()  # the manager's (this process's): its workers' are inside
    assert mine is not None
    with Executor(1) as ex:
        first, orphan = ex.submit(_orphan).result(timeout=60)
        path = mine / Path(first).name
        assert path.is_dir() and str(orphan) in (path / "cgroup.procs").read_text()
        made = path.stat().st_ino
        with pytest.raises(WorkerLost):
            ex.submit(_die).result(timeout=60)

        def same() -> bool:  # (the next worker may take the same slot: a new directory)
            try:
                return path.stat().st_ino == made
            except FileNotFoundError:
                return False

        deadline = time.monotonic() + 10
        while same() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not same(), f"{path} left after its worker died"
        assert _gone(orphan)
        second = mine / Path(ex.submit(_where).result(timeout=60)[1]).name
        assert second.is_dir() and second.name.startswith("nimbus-")
    assert not second.exists()


def _cell_now_and_later(seconds: float) -> tuple[int, int, int]:
    """In a counted worker: (its cell on the host's co-location board as the task starts,
    the same ``seconds`` later, its slot)."""
    from nimbus.network._cgcount import named_group
    from nimbus.network._colocation import PATH

    group = named_group()
    assert group is not None
    slot = group[1]
    with open(PATH, "rb") as f:
        now = f.read(slot + 1)[slot]
    time.sleep(seconds)
    with open(PATH, "rb") as f:
        later = f.read(slot + 1)[slot]
    return now, later, slot


@needs_root
def test_a_task_is_on_the_colocation_board_once_it_runs_long_and_off_it_after(
    counted: pytest.MonkeyPatch,
) -> None:
    """A task's cell is marked by the worker's flusher once the task runs past 2 ms (a
    short one's round trip writes no shared page), and cleared when it ends."""
    from nimbus.network._colocation import PATH

    with Executor(1) as ex:
        for _ in range(20):  # short tasks back to back: none left marked
            ex.submit(_where).result(timeout=60)
        _, later, slot = ex.submit(_cell_now_and_later, 0.5).result(timeout=60)
        assert later == 1, "a task running 0.5 s is not on the board"
        with open(PATH, "rb") as f:
            assert f.read(slot + 1)[slot] == 0, "a task that ended is still on the board"
        for _ in range(20):
            _, later, slot = ex.submit(_cell_now_and_later, 0).result(timeout=60)
            with open(PATH, "rb") as f:
                assert f.read(slot + 1)[slot] == 0


@needs_root
def test_a_cgroup_left_behind_by_a_freed_slot_is_taken_over(counted: pytest.MonkeyPatch) -> None:
    """A manager killed while its worker was stuck frees the slot but may leave the
    directory (its removal gave up): the next worker of that slot takes it over, and
    its Executor does not fail on "File exists"."""
    from nimbus.network._cgcount import CountedGroup, hierarchy
    from nimbus.network._slots import claim

    parent = hierarchy()
    assert parent is not None
    slot = claim()
    assert not slot.stale
    left = parent / f"nimbus-{slot.number}"
    left.mkdir()
    try:
        group = CountedGroup.create(slot)
        assert group.directory == left and left.is_dir()
    except BaseException:
        left.rmdir()
        slot.free()
        raise
    group.close()
    assert not left.exists()


def test_a_cgroup_with_no_v2_hierarchy_is_refused_in_one_line_and_auto_falls_back() -> None:
    """No cgroup2 mount (one of its own in a mount namespace, unmounted, as under ``ip
    netns exec``): cgroup refused, naming what to change; auto counts sockets (not a
    namespace: its workers would reach nothing beyond the node,
    test_auto_without_cgroup2_reaches_beyond_the_node)."""
    if not ROOT:
        pytest.skip("needs root (a mount namespace)")
    code = (
        "from nimbus.errors import ConfigError\n"
        "from nimbus.network import WorkerNetworks\n"
        "try:\n"
        "    WorkerNetworks('cgroup')\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
        "auto = WorkerNetworks('auto')\n"
        "print(auto.counted, auto.netns)\n"
    )
    unmount = "for m in $(awk '$3 == \"cgroup2\" {print $2}' /proc/mounts); do umount $m; done"
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         f'{unmount} && exec {sys.executable} -c "$0"', code],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    refused, auto = done.stdout.splitlines()
    assert refused.startswith("net_accounting=cgroup: no cgroup v2 hierarchy is mounted"), refused
    assert "set net_accounting=netns" in refused, refused
    assert auto == "False False", auto


@needs_root
def test_auto_counts_by_cgroup_and_takes_a_namespace_for_a_bandwidth_limit(
    counted: pytest.MonkeyPatch,
) -> None:
    auto = WorkerNetworks("auto")
    assert auto.counted and not auto.netns
    limited = WorkerNetworks("cgroup", Limits(bandwidth=100_000_000))
    assert limited.netns and not limited.counted  # tc shapes a link: a namespace has one
    argv = auto.command("w", [sys.executable, "-c", "pass"])
    assert "nsenter" not in argv[2] and "cgroup.procs" in argv[2], argv
    subprocess.run(argv, check=True)
    auto.close()
    limited.close()


def _bandwidth() -> None:
    return None


@needs_root
def test_a_tasks_own_bandwidth_limit_needs_a_namespace(counted: pytest.MonkeyPatch) -> None:
    with Executor(1) as ex:
        with pytest.raises(ConfigError, match=r"no network namespace of its own.*cgroup.*netns"):
            ex.options(bandwidth="40Mbit").submit(_bandwidth).result(timeout=60)
        assert ex.submit(_where).result(timeout=60)[0] is False  # the worker serves on


def _hog(size: int) -> int:
    return len(bytearray(size))


@needs_root
def test_a_tasks_own_memory_limit_in_a_counted_worker(counted: pytest.MonkeyPatch) -> None:
    """options(memory=) makes the worker a (v1 here) cgroup named as its counting one; its
    manager removes both (the fixture looks)."""
    from nimbus.errors import MemoryLimitExceeded

    with Executor(1) as ex:
        with pytest.raises(MemoryLimitExceeded, match=r"96 MiB.*options\(memory="):
            ex.options(memory="96M").submit(_hog, 300 << 20).result(timeout=60)
        fut = ex.submit(_hog, 150 << 20)
        assert fut.result(timeout=60) == 150 << 20
        assert fut.record.net_source == "cgroup"


def _nested_meter() -> tuple[bool, str]:
    """What a process the task starts (a manager of its own, say) finds: in the worker's
    cgroup, but not counted by it."""
    code = "from nimbus.network import TaskNet; print(TaskNet.here())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return "NIMBUS_NET_COUNTED" in os.environ, done.stdout.strip()


@needs_root
def test_a_tasks_own_processes_are_not_counted_workers(counted: pytest.MonkeyPatch) -> None:
    with Executor(1) as ex:
        fut = ex.submit(_nested_meter)
        assert fut.result(timeout=60) == (False, "None")
        assert fut.record.net_source == "cgroup"


def test_cgroup_is_a_net_accounting_setting_and_endpoint_option() -> None:
    from nimbus.config import Settings
    from nimbus.endpoint.config import EndpointConfig

    assert Settings.load({"NIMBUS_NET_ACCOUNTING": "cgroup"}).net_accounting == "cgroup"
    config = EndpointConfig("hpc", "http://x", "id", "t", 2, net_accounting="cgroup")
    assert Settings.load(config.worker_environment()).net_accounting == "cgroup"
