"""Parsl's HighThroughputExecutor beside nimbus: ``python bench/service.py --baseline htex``.

HTEX is the engine under Globus Compute (GlobusComputeEngine is a thin shim
over it). Parsl is not a dependency of nimbus: it lives in a venv of its own,
``bench/.venv-parsl`` (made on first use, ``pip install parsl`` from PyPI), and
HTEX runs in a subprocess of that venv's python, which runs this file as a
script. The subprocess drives HTEX directly, as GlobusComputeEngine does and as
``shared/anchors/bench_htex.py`` does (LocalProvider, one block on 127.0.0.1,
the nimbus endpoint's worker count, Parsl's defaults: CurveZMQ on, no prefetch,
10 ms poll), keeps it warm for the whole comparison, and measures on request:
one JSON line in on its stdin, one out on its stdout. So bench/service.py can
alternate HTEX, nimbus, HTEX, nimbus, ... within a workload, and load drift on
this shared machine hits both sides.

Both sides measure the same way: ``roundtrip`` is the median of sequential
no-op submit -> result after 20 warm-up calls; ``throughput`` submits one no-op
and waits for it, then submits N no-ops back to back and waits for all, tasks/s.

Only the stdlib at the top: the venv's python imports this file too.
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/multiprocessing.py sits beside this file: keep this directory off sys.path,
# or parsl's ``import multiprocessing`` (in the driver) would import it
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import selectors  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Mapping, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import IO, Any  # noqa: E402

sys.path.append(str(_HERE))  # after the stdlib
from _report import Figures, Judge, grid  # noqa: E402

PARSL = "parsl==2026.10.26"  # pinned, so figures of different days compare
VENV = _HERE / ".venv-parsl"
REPLY_TIMEOUT = 900.0  # seconds for HTEX to start or to finish one measurement
# Verdicts are ratios against HTEX measured in the same run (bench/_report.py):
# the round trip was "nimbus <= 3 ms" beside HTEX's 2.5 ms (README, a quiet run),
# and the throughput ">= 5,000/s and >= 5x", of which the ratio stays.
ROUNDTRIP_OVER_HTEX = 1.2  # at most this many times HTEX's round trip
THROUGHPUT_OVER_HTEX = 5.0  # "far above HTEX" (~700/s here): at least this many times


def noop(*args: object) -> None:
    """Do nothing (pickled by value from the driver's __main__ to HTEX's workers)."""


# ------------------------------------------------------------------ the nimbus side


@dataclass
class Comparison(Figures):
    """One workload, HTEX (the baseline) and nimbus, repeats alternating."""

    name: str
    title: str
    unit: str
    higher_is_better: bool
    target: str
    judge: Judge | None
    baseline: list[float] = field(default_factory=list)  # HTEX's
    nimbus: list[float] = field(default_factory=list)
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "what": self.title,
            "unit": self.unit,
            "htex": self.baseline,
            "nimbus": self.nimbus,
            "htex_median": self.baseline_median,
            "nimbus_median": self.nimbus_median,
            "ratio": self.ratio,
            "target": self.target,
            "status": self.status,
            "error": self.error,
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("side by side with Parsl HTEX (opt-in)")
    group.add_argument(
        "--baseline",
        choices=["htex"],
        help="measure roundtrip and throughput on Parsl's HighThroughputExecutor too, "
        f"alternating with nimbus (parsl in {VENV.name}, made on first use from PyPI)",
    )
    group.add_argument(
        "--repeat", type=int, default=3, help="repeats per side with --baseline (default 3)"
    )
    group.add_argument(
        "--parsl-venv", type=Path, default=VENV, help=f"the venv with parsl (default {VENV})"
    )


@dataclass
class Baseline:
    """What ``--baseline htex`` compares, and the python that runs HTEX."""

    python: Path
    names: list[str]
    workers: int
    repeat: int
    parsl: str = ""  # its version, once HTEX has started

    @classmethod
    def from_args(
        cls, parser: argparse.ArgumentParser, args: argparse.Namespace, names: Sequence[str]
    ) -> Baseline | None:
        """None without --baseline; exits with a clear message on bad options or no parsl."""
        if args.baseline is None:
            return None
        compared = [n for n in names if n in ("roundtrip", "throughput")]
        if not compared:
            parser.error(
                "--baseline htex compares the roundtrip and throughput workloads; "
                "add --only roundtrip and/or --only throughput, or drop --baseline"
            )
        if args.repeat < 1:
            parser.error(f"--repeat must be 1 or more, not {args.repeat}")
        return cls(ensure_venv(args.parsl_venv), compared, args.workers, args.repeat)

    def run(
        self, roundtrip_calls: int, throughput_tasks: int, nimbus: Mapping[str, Callable[[], float]]
    ) -> list[Comparison]:
        """Each compared workload, repeats alternating HTEX, nimbus, HTEX, nimbus, ..."""
        rows = {
            "roundtrip": Comparison(
                "roundtrip",
                f"no-op submit -> result, median of {roundtrip_calls:,}",
                "ms",
                False,
                f"<= {ROUNDTRIP_OVER_HTEX}x",
                lambda r: r <= ROUNDTRIP_OVER_HTEX,
            ),
            "throughput": Comparison(
                "throughput",
                f"{throughput_tasks:,} no-ops submitted, then all results",
                "tasks/s",
                True,
                f">= {THROUGHPUT_OVER_HTEX:.0f}x",
                lambda r: r >= THROUGHPUT_OVER_HTEX,
            ),
        }
        sizes = {"roundtrip": roundtrip_calls, "throughput": throughput_tasks}
        print("starting Parsl HTEX ...", file=sys.stderr, flush=True)
        try:
            with Htex(self.python, self.workers) as htex:
                self.parsl = htex.parsl
                for name in self.names:
                    row = rows[name]
                    for i in range(self.repeat):
                        say = f"  {name} {i + 1}/{self.repeat}:"
                        print(say, "HTEX", file=sys.stderr, flush=True)
                        row.baseline.append(htex.measure(name, sizes[name]))
                        print(say, "nimbus", file=sys.stderr, flush=True)
                        row.nimbus.append(nimbus[name]())
        except Exception as exc:  # the rows show ERROR, the error is printed under them
            for name in self.names:
                if len(rows[name].nimbus) < self.repeat:
                    rows[name].error = f"{type(exc).__name__}: {exc}"
        return [rows[name] for name in self.names]

    def table(self, rows: Sequence[Comparison]) -> str:
        head = (
            f"side by side with Parsl {self.parsl or '?'} HighThroughputExecutor ({self.workers} "
            "workers, LocalProvider on 127.0.0.1, as GlobusComputeEngine drives it), "
            f"median of {self.repeat} repeats alternating HTEX, nimbus; ratio = nimbus / HTEX"
        )
        header = ("workload", "what", "HTEX", "nimbus", "ratio", "target", "result")
        lines = [(r.name, r.what, *r.figure_cells()) for r in rows]
        errors = "".join(f"\n\n{r.name}: {r.error}" for r in rows if r.error)
        return head + "\n\n" + grid(header, lines) + errors


def ensure_venv(venv: Path) -> Path:
    """The python of ``venv``, with parsl importable: made and installed if need be."""
    python = venv / "bin" / "python"
    if _parsl_version(python):
        return python
    how = (
        f"The HTEX baseline needs {PARSL} from PyPI in its own venv. Make sure pip reaches "
        "PyPI (or set PIP_INDEX_URL to a mirror) and run again, or make the venv by hand: "
        f"`python3 -m venv {venv} && {python} -m pip install '{PARSL}'` "
        "(or pass --parsl-venv DIR of a venv with parsl); or run without --baseline."
    )
    print(f"making {venv} with {PARSL} (once) ...", file=sys.stderr, flush=True)
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", PARSL],
    ]
    for cmd in steps:
        if python.exists() and cmd[1:3] == ["-m", "venv"]:
            continue  # a venv without parsl: install into it
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=900)
        if done.returncode:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
            print(
                f"error: `{' '.join(cmd)}` failed (exit {done.returncode}):\n{tail}\n\n{how}",
                file=sys.stderr,
            )
            raise SystemExit(2)
    if not _parsl_version(python):
        print(
            f"error: parsl does not import in {venv} after installing it.\n{how}", file=sys.stderr
        )
        raise SystemExit(2)
    return python


def _parsl_version(python: Path) -> str:
    if not python.exists():
        return ""
    probe = [str(python), "-c", "import parsl; print(parsl.__version__)"]
    done = subprocess.run(probe, capture_output=True, text=True, check=False, timeout=120)
    return done.stdout.strip() if done.returncode == 0 else ""


class Htex:
    """This file run as the HTEX driver by the parsl venv's python; ask it for measurements."""

    def __init__(self, python: Path, workers: int) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="nimbus-bench-htex-"))
        self.log = self.root / "driver.log"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [str(python), str(Path(__file__).resolve()), "--workers", str(workers)],
                cwd=self.root,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,  # its own process group: HTEX's children included
            )
        self.parsl = ""

    def __enter__(self) -> Htex:
        try:
            self.parsl = self._reply()["parsl"]
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def measure(self, name: str, n: int) -> float:
        """Seconds of one round trip (median) or tasks/s, by the same method as nimbus's."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": name, "n": n}) + "\n")
        self.proc.stdin.flush()
        figure: float = self._reply()["figure"]
        return figure

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            ready = sel.select(REPLY_TIMEOUT)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            why = "exited" if ready else f"gave no answer within {REPLY_TIMEOUT:.0f} s"
            log = self.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the HTEX driver {why}; the end of its log:\n{log}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # end of input: it shuts HTEX down and exits
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.root, ignore_errors=True)


# ------------------------------------------------------------------ the HTEX side (parsl venv)


def _roundtrip(submit: Callable[..., Any], calls: int) -> float:
    for _ in range(20):
        submit(noop).result(timeout=60)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        submit(noop).result(timeout=60)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _throughput(submit: Callable[..., Any], tasks: int) -> float:
    submit(noop).result(timeout=60)
    start = time.perf_counter()
    futures = [submit(noop, i) for i in range(tasks)]
    for future in futures:
        future.result(timeout=600)
    return tasks / (time.perf_counter() - start)


def _connected_workers(htex: Any) -> int:
    try:
        return sum(m["worker_count"] for m in htex.connected_managers())
    except Exception:  # the interchange not answering yet
        return 0


def _drive(workers: int, out: IO[str]) -> None:
    """Start HTEX, say so, then answer measurement requests until stdin ends."""
    import parsl
    from parsl.executors import HighThroughputExecutor
    from parsl.providers import LocalProvider

    htex = HighThroughputExecutor(
        label="bench_htex",
        address="127.0.0.1",
        max_workers_per_node=workers,
        cores_per_worker=1,
        provider=LocalProvider(init_blocks=1, min_blocks=1, max_blocks=1, nodes_per_block=1),
        heartbeat_period=30,
        heartbeat_threshold=120,
    )
    htex.run_dir = os.getcwd()
    htex.provider.script_dir = os.path.join(htex.run_dir, "submit_scripts")
    os.makedirs(htex.provider.script_dir, exist_ok=True)
    htex.start()
    try:
        htex.scale_out_facade(1)

        def submit(fn: Callable[..., Any], *args: Any) -> Any:
            return htex.submit(fn, {}, *args)

        deadline = time.monotonic() + 120
        while _connected_workers(htex) < workers:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {_connected_workers(htex)} of {workers} HTEX workers")
            time.sleep(0.05)
        for future in [submit(noop) for _ in range(workers * 10)]:  # every worker warm
            future.result(timeout=60)
        measures = {"roundtrip": _roundtrip, "throughput": _throughput}
        out.write(json.dumps({"parsl": parsl.__version__}) + "\n")
        out.flush()
        for line in sys.stdin:
            request = json.loads(line)
            out.write(json.dumps({"figure": measures[request["op"]](submit, request["n"])}) + "\n")
            out.flush()
    finally:
        try:
            htex.scale_in_facade(1)
        finally:
            htex.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the HTEX driver of bench/_htex.py")
    parser.add_argument("--workers", type=int, required=True)
    # HTEX starts interchange.py and (through a shell) process_worker_pool.py from the venv
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])
    # replies go to the real stdout; whatever parsl or its children print goes to stderr
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    _drive(parser.parse_args().workers, replies)
