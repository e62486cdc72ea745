"""The nimbus service end to end: service + endpoint agent + client, on loopback, in one run.

Starts a real service (uvicorn, SQLite, embedded Redis) and a real endpoint
agent in subprocesses, then measures from this process:

    roundtrip    no-op submit -> result through service and endpoint, median
    throughput   no-op tasks through Executor(endpoint=...), tasks/s end to end
    mp_pool      nimbus.multiprocessing with NIMBUS_ENDPOINT: Pool(4) create + map of
                 64 no-ops on the endpoint, median, against the same on the local runtime
    large        a 100 MB argument echoed back (both through the data store), median
    offline      tasks submitted while the endpoint is offline, then it starts:
                 all complete? service peak memory
    heartbeats   lightweight simulated agents heartbeating: service CPU, latency

    python bench/service.py              # full sizes
    python bench/service.py --quick      # smoke run
    python bench/service.py --only roundtrip --json out.json
    python bench/service.py --baseline htex  # roundtrip and throughput beside Parsl HTEX
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

sys.path.append(str(_HERE))  # after the stdlib: for _report, never for multiprocessing
import _htex  # noqa: E402
from _report import grid  # noqa: E402

CLI = "import sys; from nimbus.cli import main; sys.exit(main())"


def noop(*args: object) -> None:
    """Do nothing."""


def echo(blob: bytes) -> bytes:
    return blob


@dataclass(frozen=True)
class Sizes:
    roundtrip_calls: int = 1_000
    throughput_tasks: int = 20_000
    large_bytes: int = 100 << 20
    large_calls: int = 5
    offline_tasks: int = 100_000
    agents: int = 100
    heartbeat_seconds: float = 10.0


QUICK = Sizes(
    roundtrip_calls=100,
    throughput_tasks=2_000,
    large_bytes=10 << 20,
    large_calls=2,
    offline_tasks=2_000,
    agents=10,
    heartbeat_seconds=2.0,
)


@dataclass
class Row:
    name: str
    what: str
    value: str
    target: str
    status: str
    detail: dict[str, Any]


class Stack:
    """The service and one endpoint agent, in subprocesses, in a private directory."""

    def __init__(self, workers: int) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="nimbus-bench-"))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("NIMBUS_")}
        self.env.update(
            NIMBUS_RUNTIME_DIR=str(self.root / "rt"),
            XDG_CONFIG_HOME=str(self.root / "cfg"),
            NIMBUS_WORKERS=str(workers),
            NIMBUS_HEARTBEAT="1.0",
        )
        os.environ.update({k: self.env[k] for k in ("XDG_CONFIG_HOME", "NIMBUS_RUNTIME_DIR")})
        self.workers = workers
        self.service: subprocess.Popen[bytes] | None = None
        self.agent: subprocess.Popen[bytes] | None = None

    def start_service(self) -> None:
        url_file = self.root / "url"
        cmd = [sys.executable, "-c", CLI, "service", "start", "--port", "0"]
        with open(self.root / "service.log", "ab") as log:
            self.service = subprocess.Popen(
                [*cmd, "--url-file", str(url_file)], env=self.env, stdout=log, stderr=log
            )
        deadline = time.monotonic() + 60
        while not url_file.exists():
            if self.service.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((self.root / "service.log").read_text()[-2000:])
            time.sleep(0.05)
        self.url = url_file.read_text().strip()
        from nimbus.config import Settings
        from nimbus.service.registry import Registry

        self.settings = Settings.load(self.env)
        registry = Registry(self.settings.registry_url)
        self.token = registry.create_user_token("bench")
        registry.close()
        self.settings = self.settings.replace(service_url=self.url, token=self.token)

    def configure_endpoint(self, name: str) -> None:
        from nimbus.client import Client
        from nimbus.endpoint.config import EndpointConfig

        with Client(settings=self.settings) as client:
            registered = client.register_endpoint(name)
        EndpointConfig(
            name, self.url, registered["endpoint_id"], registered["token"], self.workers
        ).save()

    def start_agent(self, name: str, prefix: list[str] | None = None) -> None:
        """The agent of endpoint ``name``; ``prefix``: what runs it (ip netns exec NS)."""
        with open(self.root / "agent.log", "ab") as log:
            self.agent = subprocess.Popen(
                [*(prefix or []), sys.executable, "-m", "nimbus.endpoint.daemon", name],
                env=self.env,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        from nimbus.client import Client

        with Client(settings=self.settings) as client:
            deadline = time.monotonic() + 60
            while not client.get_endpoint(name)["online"]:
                if time.monotonic() > deadline:
                    raise RuntimeError((self.root / "agent.log").read_text()[-2000:])
                time.sleep(0.05)

    def stop_agent(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)
            self.agent.wait(30)

    def close(self) -> None:
        self.stop_agent()
        if self.service is not None and self.service.poll() is None:
            self.service.send_signal(signal.SIGTERM)
            try:
                self.service.wait(30)
            except subprocess.TimeoutExpired:
                log = (self.root / "service.log").read_text()[-3000:]
                print(
                    f"the service did not stop within 30 s; killed. Its log:\n{log}",
                    file=sys.stderr,
                )
                self.service.kill()
                self.service.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def proc_status(pid: int, field: str) -> int:
    """A ``/proc/<pid>/status`` size field, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- workloads


def bench_roundtrip(stack: Stack, sizes: Sizes) -> Row:
    from nimbus import Executor

    with Executor(endpoint="bench", settings=stack.settings) as ex:
        for _ in range(20):
            ex.submit(noop).result()
        times = []
        for _ in range(sizes.roundtrip_calls):
            start = time.perf_counter()
            ex.submit(noop).result()
            times.append(time.perf_counter() - start)
    median = statistics.median(times) * 1000
    p90 = statistics.quantiles(times, n=10)[-1] * 1000
    return Row(
        "roundtrip",
        f"no-op submit -> result, median of {sizes.roundtrip_calls}",
        f"{median:.2f} ms (p90 {p90:.2f})",
        "report (--baseline htex: <= 1.2x HTEX)",
        "-",
        {"median_ms": median, "p90_ms": p90},
    )


def bench_throughput(stack: Stack, sizes: Sizes) -> Row:
    from nimbus import Executor

    n = sizes.throughput_tasks
    with Executor(endpoint="bench", settings=stack.settings) as ex:
        ex.submit(noop).result()
        start = time.perf_counter()
        futures = [ex.submit(noop, i) for i in range(n)]
        for future in futures:
            future.result()
        elapsed = time.perf_counter() - start
    rate = n / elapsed
    return Row(
        "throughput",
        f"{n} no-op tasks through Executor(endpoint=...)",
        f"{rate:,.0f} tasks/s",
        "report (--baseline htex: >= 5x HTEX)",
        "-",
        {"tasks_per_second": rate, "seconds": elapsed},
    )


# a user's program: Pool(4) create + map of 64 no-ops, timed ``runs`` times (JSON on stdout)
POOL_PROGRAM = """
import json, sys, time
import nimbus.multiprocessing as mp

def noop(x):
    return x

if __name__ == "__main__":
    times = []
    for _ in range(int(sys.argv[1])):
        start = time.perf_counter()
        with mp.Pool(4) as pool:
            pool.map(noop, range(64))
        times.append(time.perf_counter() - start)
    print(json.dumps(times))
"""


def _pool_times(stack: Stack, runs: int, endpoint: str | None) -> list[float]:
    env = stack.env | {"NIMBUS_SERVICE_URL": stack.url, "NIMBUS_TOKEN": stack.token}
    if endpoint:
        env["NIMBUS_ENDPOINT"] = endpoint
    script = stack.root / "pool_program.py"
    script.write_text(POOL_PROGRAM)
    done = subprocess.run(
        [sys.executable, str(script), str(runs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"the Pool program failed:\n{done.stderr[-3000:]}")
    times: list[float] = json.loads(done.stdout.splitlines()[-1])
    return times


def bench_mp_pool(stack: Stack, sizes: Sizes) -> Row:
    runs = max(3, sizes.roundtrip_calls // 100)
    remote = _pool_times(stack, runs, "bench")
    local = _pool_times(stack, runs, None)
    # the first run of each program also opens its store (and, remote, its connection)
    r, loc = statistics.median(remote[1:]) * 1000, statistics.median(local[1:]) * 1000
    return Row(
        "mp_pool",
        f"Pool(4) + map of 64 no-ops on the endpoint (NIMBUS_ENDPOINT), median of {runs - 1}",
        f"{r:.0f} ms (first {remote[0] * 1000:.0f}); local runtime {loc:.0f} ms: {r / loc:.1f}x",
        "report",
        "-",
        {"remote_ms": [t * 1000 for t in remote], "local_ms": [t * 1000 for t in local]},
    )


def bench_large(stack: Stack, sizes: Sizes) -> Row:
    from nimbus import Executor

    n = sizes.large_bytes
    blob = os.urandom(1 << 20) * (n >> 20)
    times = []
    with Executor(endpoint="bench", settings=stack.settings) as ex:
        for _ in range(sizes.large_calls):
            start = time.perf_counter()
            assert ex.submit(echo, blob).result(600) == blob
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    rate = 2 * n / median / 2**20  # up and back
    return Row(
        "large",
        f"{n >> 20} MB argument echoed back, median of {sizes.large_calls}",
        f"{median * 1000:.0f} ms ({rate:.0f} MB/s up and back)",
        "report",
        "-",
        {"median_seconds": median, "mb_per_second": rate, "bytes": n},
    )


def bench_offline(stack: Stack, sizes: Sizes) -> Row:
    from nimbus import Executor

    n = sizes.offline_tasks
    stack.stop_agent()
    assert stack.service is not None
    with Executor(endpoint="bench", settings=stack.settings) as ex:
        start = time.perf_counter()
        futures = [ex.submit(noop, i) for i in range(n)]
        submitted = time.perf_counter() - start
        time.sleep(1.0)  # all queued on the service, nothing runs
        started = time.perf_counter()
        stack.start_agent("bench")
        done = sum(1 for f in futures if f.result(600) is None and f.record.state.value)
        drained = time.perf_counter() - started
    peak = proc_status(stack.service.pid, "VmHWM")
    return Row(
        "offline",
        f"{n} tasks queued while the endpoint is offline, then it starts",
        f"{done}/{n} complete, drained in {drained:.1f} s",
        "all complete; service peak RSS",
        ("PASS" if done == n else "MISS") + f" (peak {peak / 2**20:.0f} MB)",
        {
            "completed": done,
            "submit_seconds": submitted,
            "drain_seconds": drained,
            "service_peak_rss": peak,
        },
    )


async def _simulated_agents(stack: Stack, tokens: list[str], seconds: float) -> list[float]:
    from websockets.asyncio.client import connect

    from nimbus.protocol import PYTHON, SERIALIZER, WS_AGENT, pack, unpack
    from nimbus.protocol.wsclient import ws_url

    url = ws_url(stack.url, WS_AGENT)
    latencies: list[float] = []

    async def agent(token: str) -> None:
        async with connect(
            url,
            additional_headers={"Authorization": f"Bearer {token}"},
            compression=None,
            ping_interval=None,
        ) as ws:
            hello = {"op": "hello", "python": PYTHON, "serializer": SERIALIZER}
            await ws.send(pack(hello | {"workers": 1, "window": 1, "held": []}))
            end = time.monotonic() + seconds
            await asyncio.sleep(hash(token) % 1000 / 1000)  # spread the beats
            first = True
            while time.monotonic() < end:
                sent = time.monotonic()
                await ws.send(pack({"op": "beat", "t": sent}))
                while unpack(await ws.recv()).get("op") != "beat":
                    pass
                if not first:  # the first beats meet 100 connections being set up
                    latencies.append(time.monotonic() - sent)
                first = False
                await asyncio.sleep(1.0)

    await asyncio.gather(*(agent(token) for token in tokens))
    return latencies


def bench_heartbeats(stack: Stack, sizes: Sizes) -> Row:
    from nimbus.client import Client

    assert stack.service is not None
    with Client(settings=stack.settings) as client:
        tokens = [client.register_endpoint(f"sim-{i}")["token"] for i in range(sizes.agents)]
    cpu0, wall0 = cpu_seconds(stack.service.pid), time.monotonic()
    latencies = asyncio.run(_simulated_agents(stack, tokens, sizes.heartbeat_seconds))
    cpu = (cpu_seconds(stack.service.pid) - cpu0) / (time.monotonic() - wall0) * 100
    median = statistics.median(latencies) * 1000
    p99 = (
        max(latencies) * 1000
        if len(latencies) < 100
        else statistics.quantiles(latencies, n=100)[-1] * 1000
    )
    return Row(
        "heartbeats",
        f"{sizes.agents} simulated agents, a beat per second each",
        f"service CPU {cpu:.1f}%, beat latency median {median:.2f} ms (p99 {p99:.2f})",
        "report",
        "-",
        {"service_cpu_percent": cpu, "median_ms": median, "p99_ms": p99, "beats": len(latencies)},
    )


WORKLOADS = {
    "roundtrip": bench_roundtrip,
    "throughput": bench_throughput,
    "mp_pool": bench_mp_pool,
    "large": bench_large,
    "offline": bench_offline,
    "heartbeats": bench_heartbeats,
}


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    print(
        f"nimbus service + endpoint ({args.workers} workers) + client on loopback"
        f"{', quick sizes' if args.quick else ''}"
    )
    print(f"Python {platform.python_version()} on {platform.system()}, {os.cpu_count()} CPUs\n")
    header = ("workload", "what", "nimbus", "target", "result")
    if rows:  # none when --baseline took every selected workload
        print(grid(header, [(r.name, r.what, r.value, r.target, r.status) for r in rows]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--only", action="append", choices=list(WORKLOADS))
    parser.add_argument("--json", help="also write the figures here")
    _htex.add_arguments(parser)
    args = parser.parse_args()
    sizes = QUICK if args.quick else Sizes()
    names = args.only or list(WORKLOADS)
    baseline = _htex.Baseline.from_args(parser, args, names)
    stack = Stack(args.workers)
    rows: list[Row] = []
    compared: list[_htex.Comparison] = []
    try:
        stack.start_service()
        stack.configure_endpoint("bench")
        stack.start_agent("bench")
        if baseline:  # these workloads run beside HTEX instead of alone
            nimbus = {
                "roundtrip": lambda: bench_roundtrip(stack, sizes).detail["median_ms"] / 1000,
                "throughput": lambda: bench_throughput(stack, sizes).detail["tasks_per_second"],
            }
            compared = baseline.run(sizes.roundtrip_calls, sizes.throughput_tasks, nimbus)
            names = [name for name in names if name not in baseline.names]
        for name in names:
            print(f"running {name} ...", file=sys.stderr, flush=True)
            rows.append(WORKLOADS[name](stack, sizes))
    finally:
        stack.close()
    print_table(rows, args)
    if baseline:
        print("\n" + baseline.table(compared))
    if args.json:
        figures = [r.__dict__ for r in rows] + [c.to_json() for c in compared]
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 1 if any(c.error for c in compared) else 0


if __name__ == "__main__":
    sys.exit(main())
