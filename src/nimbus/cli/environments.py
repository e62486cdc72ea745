"""``nimbus environments list|build NAME|remove NAME``: this node's environments.

``build`` makes an environment ready ahead of time (the spec from its options:
``-r REQUIREMENT`` repeated, ``--wheelhouse DIR``, ``--image IMAGE``,
``--sandbox``) and retries a spec whose earlier build failed; ``list`` shows
what is built (or failed) here, with size and last use; ``remove`` deletes
every entry of a name (or a key). ``list --endpoint NAME`` shows instead what
the nodes of an endpoint hold, as its daemon last reported through the service:
one row per node and environment, its own node's and those of its remote managers
(blocks, ``nimbus manager``): warm workers (and free ones), the build state there
(``warm``, ``built``, ``building``, ``failed``), size and last use.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

from nimbus.cli._usage import UsageError
from nimbus.errors import ConfigError

if TYPE_CHECKING:
    from nimbus.environments import Entry, Environment

__all__ = ["run", "setup"]


def setup(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = sub.add_parser(
        "list",
        help="environments built or failed on this node",
        description="List the environments built (or failed) on this node, with size and last "
        "use; --endpoint NAME: what the nodes of that endpoint hold.",
    )
    listing.add_argument("--json", action="store_true", help="print machine-readable JSON")
    listing.add_argument(
        "--endpoint", help="an endpoint's nodes (through the service), not this node"
    )
    build = sub.add_parser(
        "build",
        help="build an environment on this node now",
        description="Build an environment on this node now (or retry one whose build failed), "
        "so its first task does not wait for it.",
    )
    build.add_argument("name", help="the environment's name")
    build.add_argument(
        "-r",
        "--requirement",
        action="append",
        default=[],
        dest="requirements",
        help="a pip requirement (repeat for more)",
    )
    build.add_argument("--wheelhouse", help="install from this directory of wheels, not an index")
    build.add_argument("--image", help="a container image on this node (podman)")
    build.add_argument("--sandbox", action="store_true", help="run workers under bubblewrap")
    remove = sub.add_parser(
        "remove",
        help="remove an environment from this node",
        description="Remove every build of an environment (by name, or one by its key) from "
        "this node.",
    )
    remove.add_argument("name", help="a name (or key) shown by `nimbus environments list`")


def run(args: argparse.Namespace) -> int:
    from nimbus import environments

    if args.action == "list":
        if args.endpoint:
            return _list_endpoint(args.endpoint, args.json)
        return _list(environments.cache().entries(), args.json)
    if args.action == "build":
        env = environments.Environment(
            args.name,
            requirements=tuple(args.requirements),
            wheelhouse=args.wheelhouse,
            image=args.image,
            sandbox=args.sandbox,
        )
        if env.plain:
            raise UsageError(
                "nimbus environments build",
                f"environment {args.name!r} has nothing to build: give -r REQUIREMENT, "
                f"--image IMAGE or --sandbox",
            )
        prepared = environments.prepare(env, retry=True)
        how = f"in {prepared.build_seconds:.1f} s" if prepared.build_seconds else "(already)"
        print(f"{env.name}: built {how}, key {env.key}")
        return 0
    store = environments.cache()
    found = [e for e in store.entries() if args.name in e.names or args.name == e.key]
    if not found:
        known = sorted({n for e in store.entries() for n in e.names})
        raise ConfigError(
            f"no environment named {args.name!r} on this node"
            + (f"; there are: {', '.join(known)}" if known else "")
        )
    for entry in found:
        store.remove(entry.key)
        print(f"removed {', '.join(entry.names) or entry.key} ({entry.key})")
    return 0


def _list(entries: list[Entry], as_json: bool) -> int:
    rows = [
        {
            "key": e.key,
            "names": list(e.names),
            "state": e.state,
            "size": e.size,
            "last_use": e.last_use,
            "build_seconds": round(e.build_seconds, 3),
            "spec": e.spec.to_dict() if e.spec else None,
            "message": e.message,
        }
        for e in entries
    ]
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no environments on this node")
        return 0
    print(f"{'NAME':<16} {'KEY':<16} {'STATE':<7} {'SIZE':>9} {'LAST USE':<19} WHAT")
    for e in entries:
        what = _describe(e.spec) if e.spec else "?"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.last_use))
        print(
            f"{','.join(e.names)[:16]:<16} {e.key:<16} {e.state:<7} {_size(e.size):>9} "
            f"{when:<19} {what}"
        )
        if e.message:
            print(f"{'':<16} {cause(e.message)}")
    return 0


def _list_endpoint(name: str, as_json: bool) -> int:
    """What the nodes of endpoint ``name`` hold, as its daemon last reported it."""
    from nimbus.client import Client
    from nimbus.errors import NotFound

    with Client() as client:
        try:
            info = client.get_endpoint(name)
        except NotFound:
            raise NotFound(
                f"no endpoint {name!r} that you can use: `nimbus endpoints list` shows those "
                "you can (OWNER/NAME picks one of another user's)",
                404,
            ) from None
    rows = list(info.get("environments") or [])
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    label = info.get("name", name)
    if not info.get("online"):
        print(f"endpoint {label!r} is offline; as last reported:")
    if not rows:
        print(f"no environments reported by endpoint {label!r} yet")
        return 0
    print(
        f"{'NODE':<20} {'NAME':<16} {'KEY':<16} {'STATE':<8} {'WORKERS':>12} {'SIZE':>9} LAST USE"
    )
    for r in rows:
        last = r.get("last_use")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last)) if last else ""
        workers = f"{r.get('workers', 0)} ({r.get('free', 0)} free)" if r.get("workers") else ""
        size = _size(int(r["size"])) if r.get("size") else ""
        print(
            f"{str(r.get('node', '?'))[:20]:<20} {str(r.get('name', '?'))[:16]:<16} "
            f"{str(r.get('key', ''))[:16]:<16} {r.get('state', '?')!s:<8} {workers:>12} "
            f"{size:>9} {when}"
        )
        if r.get("message"):
            print(f"{'':<20} {cause(str(r['message']))}")
    return 0


_DECORATION = " \t\u00d7\u2570\u2500\u25b6\u2502\u2503"  # the marks of uv's error tree


def cause(message: str, width: int = 300) -> str:
    """A failed build's message in one line: what failed and the builder's cause (uv's
    ``cause:`` line, else its first ``error`` line, else its first line), not the
    header alone ("uv failed (exit 1) installing X:")."""
    lines = [line.strip(_DECORATION) for line in message.splitlines()]
    head, said = lines[0].rstrip(":"), [line for line in lines[1:] if line]
    if not said:
        return head[:width]
    why = next((line for line in said if line.lower().startswith("cause:")), None) or next(
        (line for line in said if "error" in line.lower()), said[0]
    )
    if why.lower().startswith(("cause:", "error:")):
        why = why.split(":", 1)[1].strip()
    return f"{head}: {why}"[:width]


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "K", "M"):
        if size < 1024:
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{size:.1f}G"


def _describe(spec: Environment) -> str:
    parts = []
    if spec.requirements:
        parts.append(" ".join(spec.requirements))
    if spec.image:
        parts.append(f"image {spec.image}")
    if spec.sandbox:
        parts.append("sandbox")
    return "; ".join(parts)
