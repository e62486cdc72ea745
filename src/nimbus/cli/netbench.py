"""``nimbus netbench``: the seed's co-location experiment, offline or on an endpoint.

``--offline`` builds hosts in network namespaces (``nimbus.network``
``Offline``: a server, a host whose link to it is shaped to ``--cap`` and
shared fairly among its workers, as a host's NIC is, and up to 8 workers
behind it); ``--endpoint NAME`` runs the tasks on that endpoint
against a traffic server on this machine (``--server``: the address the
endpoint reaches it at). Either moves data from 1..N tasks at once and writes
``netbench.html`` with PNG charts and the CSV and JSON behind them into ``--out``.
With ``--endpoint``, ``--sizes`` adds the worker-size sweep: ``--objects`` objects of
``--object-size`` down and up at each size, and the cost per million tasks under
``--price-gb-second`` / ``--price-request`` (``nimbus.network._sizes``), on a grid
of size x concurrency: at each size 1 and each ``--concurrency`` tasks at once, each
on a worker of its own (``nimbus.network._grid``).
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import tempfile
from pathlib import Path
from types import FrameType

from nimbus.cli._numbers import number
from nimbus.cli._usage import UsageError
from nimbus.config import parse_bandwidth
from nimbus.errors import ConfigError

__all__ = ["run", "setup"]


PROG = "nimbus netbench"
DEFAULT_OUT = Path("netbench-report")


def _concurrency(text: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",")})  # an empty item is refused
    except ValueError:
        values = []
    if not values or values[0] < 1 or values[-1] > 64:
        raise argparse.ArgumentTypeError(f"expected numbers 1-64 separated by commas, got {text!r}")
    return values


def _server(text: str) -> str:
    """``--server``: an address of this machine (the traffic server binds it), no port."""
    hint = "give one the endpoint's nodes reach (e.g. 127.0.0.1 or this host's IP)"
    host = text.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or "/" in host or (":" in host and host.count(":") == 1):
        raise argparse.ArgumentTypeError(
            f"expected an address of this machine without a port, got {text!r}; {hint}"
        )
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot resolve {text!r} ({exc}); {hint}") from None
    family, _, _, _, address = infos[0]
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind(address)
    except OSError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an address of this machine; {hint}"
        ) from None
    return host


def _rate(text: str) -> int:
    try:
        return parse_bandwidth(text, "--cap")
    except ConfigError as exc:  # (argparse names the argument: once)
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--cap ")) from None


def _sizes(text: str) -> list[int]:
    from nimbus.config import Bad, optional_size

    try:
        values = sorted({optional_size(x) or 0 for x in text.split(",")})
    except Bad:
        values = [0]
    if not values or values[0] < 16 << 20 or len(values) > 16:
        raise argparse.ArgumentTypeError(
            f"expected worker memory sizes with their unit separated by commas (each at least "
            f"16M, at most 16 of them), e.g. 128M,512M,1G,3G; got {text!r}"
        )
    return values


def _object_size(text: str) -> int:
    from nimbus.config import Bad, size

    try:
        value = size(text)
    except Bad:
        value = 0
    if not 1 <= value <= 1 << 30:
        raise argparse.ArgumentTypeError(
            f"expected a size from 1 byte to 1G with its unit (e.g. 10M), got {text!r}"
        )
    return value


def setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--offline",
        action="store_true",
        help="hosts in network namespaces on this machine, with a shaped host link (root)",
    )
    parser.add_argument("--endpoint", help="run the sweep on this endpoint instead")
    parser.add_argument("--server", type=_server, default=None,
                        help="with --endpoint: this machine's address as the endpoint reaches "
                        "it; the traffic server listens there (default 127.0.0.1: an "
                        "endpoint on this machine; refused if the nodes cannot reach it)")  # fmt: skip
    parser.add_argument("--concurrency", type=_concurrency, default=[1, 2, 4, 8],
                        help="tasks on the host at once, e.g. 1,2,4,8 (default)")  # fmt: skip
    parser.add_argument("--direction", choices=("down", "up", "both"), default="both",
                        help="tasks download from the server (down), upload to it (up), "
                        "or one sweep each (both, default)")  # fmt: skip
    parser.add_argument("--seconds", type=number(float, 0.5, 600, "seconds"), default=5.0,
                        help="each run's length (0.5-600, default 5)")  # fmt: skip
    parser.add_argument("--cap", type=_rate, default=None,
                        help="the shared host link's rate, with its unit (default offline: "
                        "1Gbit; endpoint: the best aggregate seen)")  # fmt: skip
    parser.add_argument("--share", type=number(float, 0.0, 1.0, "a fraction of the link",
                                                above=True), default=0.25,
                        help="the recommendation: most tasks per host each getting this "
                        "fraction of the link (above 0, at most 1; default 0.25)")  # fmt: skip
    parser.add_argument("--sizes", type=_sizes, default=None,
                        help="with --endpoint: worker memory sizes to sweep, e.g. 128M,512M,1G,"
                        "3G (CPU in proportion: one CPU at 1769M); at each size 1 and each "
                        "--concurrency tasks at once move --objects objects down, then up")  # fmt: skip
    # the worker-size sweep's own options (None: not given; refused without --sizes)
    parser.add_argument("--objects", type=number(int, 1, 10000, "objects"), default=None,
                        help="with --sizes: objects each way at each size (default 100)")  # fmt: skip
    parser.add_argument("--object-size", type=_object_size, default=None,
                        help="with --sizes: bytes of one object, with its unit (default 10M)")  # fmt: skip
    parser.add_argument("--price-gb-second", type=number(float, 0.0, 1.0, "USD"),
                        default=None,
                        help="with --sizes: price of a GiB of worker memory for a second, USD "
                        "(default 0.0000166667, AWS Lambda x86)")  # fmt: skip
    parser.add_argument("--price-request", type=number(float, 0.0, 1.0, "USD"),
                        default=None,
                        help="with --sizes: price of one task, USD (default 0.0000002)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="directory for netbench.html, the PNGs, CSV and JSON "
                        f"(default ./{DEFAULT_OUT})")  # fmt: skip


def _writable(out: Path) -> None:
    """Refuse an ``--out`` the report could not be written into, before the bench runs."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise UsageError(
            PROG, f"--out {out}: cannot write there ({exc.strerror}); give a directory you can "
            "write to"
        ) from None  # fmt: skip


def _interrupted(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (or Ctrl-C) in the main thread: stop once, so the namespaces are removed;
    a second signal while they are being removed is ignored."""
    del frame
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run(args: argparse.Namespace) -> int:
    if bool(args.offline) == bool(args.endpoint):
        raise UsageError(
            PROG, "say where: --offline (namespaces on this machine) or --endpoint NAME "
            "(one of your endpoints), one of them"
        )  # fmt: skip
    if args.server is not None and not args.endpoint:
        raise UsageError(
            PROG, f"--server {args.server} is where an endpoint's tasks reach this machine: "
            "give it with --endpoint NAME (--offline has its own server)"
        )  # fmt: skip
    if args.sizes and not args.endpoint:
        raise UsageError(
            PROG, "--sizes sweeps an endpoint's worker sizes: give it with --endpoint NAME"
        )
    sized = ("objects", "object_size", "price_gb_second", "price_request")
    given = [f"--{name.replace('_', '-')}" for name in sized if getattr(args, name) is not None]
    if given and not args.sizes:
        raise UsageError(
            PROG, f"{' and '.join(given)} {'go' if len(given) > 1 else 'goes'} with the "
            "worker-size sweep: give --endpoint NAME --sizes SIZES too (without it nothing "
            "moves objects)"
        )  # fmt: skip
    _writable(args.out)
    directions = ["down", "up"] if args.direction == "both" else [args.direction]
    if args.endpoint:
        from nimbus.executor import Executor
        from nimbus.network import netbench_endpoint

        with Executor(endpoint=args.endpoint) as ex:
            written = netbench_endpoint(
                ex, args.server or "127.0.0.1", args.concurrency, directions, args.seconds,
                args.out, cap=args.cap, share=args.share, sizes=args.sizes,
                objects=args.objects or 100, object_size=args.object_size or 10 << 20,
                price_gb_second=args.price_gb_second, price_request=args.price_request,
                progress=print,
            )  # fmt: skip
    else:
        from nimbus.network import netbench

        before = signal.signal(signal.SIGTERM, _interrupted), signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, _interrupted)
        try:
            written = netbench(
                args.concurrency, directions, args.seconds, args.cap or 1_000_000_000,
                args.out, share=args.share, progress=print,
            )  # fmt: skip
        except KeyboardInterrupt as exc:
            kept = "; ".join(getattr(exc, "__notes__", ())) or "no run had finished"
            print(f"{PROG}: interrupted ({exc or 'SIGINT'}); its namespaces are removed; "
                  f"{kept}", file=sys.stderr)  # fmt: skip
            return 130
        finally:
            signal.signal(signal.SIGTERM, before[0])
            signal.signal(signal.SIGINT, before[1])
    for path in written:
        print(path)
    return 0
