"""``nimbus netbench``: the seed's co-location experiment, offline or on an endpoint.

``--offline`` builds hosts in network namespaces (``nimbus.network``
``Offline``: a server, a host whose link to it is shaped to ``--cap``, and up
to 8 workers behind it); ``--endpoint NAME`` runs the tasks on that endpoint
against a traffic server on this machine (``--server``: the address the
endpoint reaches it at). Either moves data from 1..N tasks at once and writes
``netbench.html`` with PNG charts and the CSV and JSON behind them into ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nimbus.config import parse_bandwidth
from nimbus.errors import ConfigError

__all__ = ["run", "setup"]


def _concurrency(text: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1 or values[-1] > 64:
        raise argparse.ArgumentTypeError(f"expected numbers 1-64 separated by commas, got {text!r}")
    return values


def _rate(text: str) -> int:
    try:
        return parse_bandwidth(text, "--cap")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--offline",
        action="store_true",
        help="hosts in network namespaces on this machine, with a shaped host link (root)",
    )
    parser.add_argument("--endpoint", help="run the sweep on this endpoint instead")
    parser.add_argument("--server", default="127.0.0.1",
                        help="with --endpoint: this machine's address as the endpoint reaches "
                        "it; the traffic server listens there (127.0.0.1: an endpoint on "
                        "this machine; refused if the nodes cannot reach it)")  # fmt: skip
    parser.add_argument("--concurrency", type=_concurrency, default=[1, 2, 4, 8],
                        help="tasks on the host at once, e.g. 1,2,4,8 (default)")  # fmt: skip
    parser.add_argument("--direction", choices=("down", "up", "both"), default="both")
    parser.add_argument("--seconds", type=float, default=5.0, help="each run's length (5)")
    parser.add_argument("--cap", type=_rate, default=None,
                        help="the shared host link's rate, with its unit (offline: 1Gbit; "
                        "endpoint: the best aggregate seen)")  # fmt: skip
    parser.add_argument("--share", type=float, default=0.25,
                        help="the recommendation: most tasks per host each getting this share "
                        "of the link (0.25)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("netbench-report"),
                        help="directory for netbench.html, the PNGs, CSV and JSON")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if bool(args.offline) == bool(args.endpoint):
        raise ConfigError(
            "nimbus netbench: say where: --offline (namespaces on this machine) or "
            "--endpoint NAME (one of your endpoints), one of them"
        )
    if not 0.5 <= args.seconds <= 600:
        raise ConfigError(f"--seconds {args.seconds}: expected 0.5 to 600")
    directions = ["down", "up"] if args.direction == "both" else [args.direction]
    if args.endpoint:
        from nimbus.executor import Executor
        from nimbus.network import netbench_endpoint

        with Executor(endpoint=args.endpoint) as ex:
            written = netbench_endpoint(
                ex, args.server, args.concurrency, directions, args.seconds, args.out,
                cap=args.cap, share=args.share, progress=print,
            )  # fmt: skip
    else:
        from nimbus.network import netbench

        written = netbench(
            args.concurrency, directions, args.seconds, args.cap or 1_000_000_000, args.out,
            share=args.share, progress=print,
        )  # fmt: skip
    for path in written:
        print(path)
    return 0
