"""``nimbus netbench --offline``: the seed's co-location experiment on this machine.

Builds hosts in network namespaces (``nimbus.network`` ``Offline``: a server,
a host whose link to it is shaped to ``--cap``, and up to 8 workers behind
it), moves data from 1..N workers at once, and writes ``netbench.html`` with
PNG charts and the CSV and JSON behind them into ``--out``.
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
    parser.add_argument("--concurrency", type=_concurrency, default=[1, 2, 4, 8],
                        help="tasks on the host at once, e.g. 1,2,4,8 (default)")  # fmt: skip
    parser.add_argument("--direction", choices=("down", "up", "both"), default="both")
    parser.add_argument("--seconds", type=float, default=5.0, help="each run's length (5)")
    parser.add_argument("--cap", type=_rate, default=1_000_000_000,
                        help="the shared host link's rate, with its unit (1Gbit)")  # fmt: skip
    parser.add_argument("--share", type=float, default=0.25,
                        help="the recommendation: most tasks per host each getting this share "
                        "of the link (0.25)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("netbench-report"),
                        help="directory for netbench.html, the PNGs, CSV and JSON")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if not args.offline:
        raise ConfigError(
            "nimbus netbench: only --offline is built so far (namespaces on this machine); "
            "add --offline"
        )
    if not 0.5 <= args.seconds <= 600:
        raise ConfigError(f"--seconds {args.seconds}: expected 0.5 to 600")
    from nimbus.network import netbench

    directions = ["down", "up"] if args.direction == "both" else [args.direction]
    written = netbench(
        args.concurrency, directions, args.seconds, args.cap, args.out, share=args.share,
        progress=print,
    )  # fmt: skip
    for path in written:
        print(path)
    return 0
