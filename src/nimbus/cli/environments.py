"""``nimbus environments list|build NAME|remove NAME``: this node's environments, or
(``--endpoint NAME``) those of every node of an endpoint.

``build`` makes an environment ready ahead of time (the spec from its options:
``-r REQUIREMENT`` repeated, ``--wheelhouse DIR``, ``--image IMAGE``,
``--sandbox``) and retries a spec whose earlier build failed; ``list`` shows
what is built (or failed) here, with size and last use; ``remove NAME`` makes the
name refer to nothing here (a build that other names share stays for them; one no
name refers to any more is deleted), ``remove KEY`` deletes that build. A name
refers to one build: building it with another spec moves the name (and says so). ``list --endpoint NAME`` shows instead what
the nodes of an endpoint hold, as its daemon last reported through the service:
one row per node and environment, its own node's and those of its remote managers
(blocks, ``nimbus manager``): warm workers (and free ones), the build state there
(``warm``, ``built``, ``building``, ``failed``), size and last use.

``build NAME --endpoint X`` builds the environment on every node of endpoint X now
(its local manager's node and its blocks' nodes), with no task needed, and
``remove NAME --endpoint X`` removes it there (refused, with nothing removed, while
tasks of it are not done). The spec travels from here: the options given, else the
spec of the environment of that name built on this machine. Both wait until every
node has said how it went (``--timeout``; ``--no-wait`` returns at once) and print a
line per node; exit status 0 when every node built (removed) it, 1 when one failed
(the builder's cause is printed) or did not say in time, 2 when nothing was done
(unknown endpoint or environment, endpoint offline or too old, busy).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import TYPE_CHECKING, Any

from nimbus.cli._numbers import number
from nimbus.cli._usage import UsageError
from nimbus.errors import ConfigError, ServiceError, ServiceUnavailable

if TYPE_CHECKING:
    from nimbus.environments import Entry, Environment

__all__ = ["run", "setup"]

WAIT_SECONDS = 900.0  # how long `build|remove --endpoint` waits for every node by default
POLL = 0.3  # seconds between two looks at how the nodes do


EPILOG = (
    "With --endpoint: a line per node as it ends; exit status 0 when every node did it, "
    "1 when one failed (the builder's cause is printed) or did not say in time, 2 when "
    "nothing was done (unknown endpoint or environment, endpoint offline or too old, "
    "tasks of the environment not done)."
)


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
        help="build an environment on this node (or every node of an endpoint) now",
        description="Build an environment on this node now (or retry one whose build failed), "
        "so its first task does not wait for it. With --endpoint NAME: on every node of that "
        "endpoint (its own and its blocks'), with the spec given here or, if none is given, "
        "the spec of the environment of that name built on this machine.",
        epilog=EPILOG,
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
        help="remove an environment from this node (or every node of an endpoint)",
        description="Remove an environment's name from this node, and its build unless "
        "another name shares it (same spec); a key removes that build. With --endpoint NAME: from every node of that endpoint; refused, with "
        "nothing removed, while tasks of it are queued or running there.",
        epilog=EPILOG,
    )
    remove.add_argument("name", help="a name (or key) shown by `nimbus environments list`")
    for action in (build, remove):
        action.add_argument(
            "--endpoint", help="on every node of this endpoint (through the service), not here"
        )
        action.add_argument(
            "--no-wait",
            action="store_true",
            help="with --endpoint: return once the nodes are asked, without waiting for them",
        )
        action.add_argument(
            "--timeout",
            type=number(float, 0.0, None, "seconds", above=True),
            default=WAIT_SECONDS,
            metavar="SECONDS",
            help=f"with --endpoint: wait at most this long for every node (default {WAIT_SECONDS:.0f})",
        )


def run(args: argparse.Namespace) -> int:
    from nimbus import environments

    if args.action == "list":
        if args.endpoint:
            return _list_endpoint(args.endpoint, args.json)
        return _list(environments.cache().entries(), args.json)
    if args.endpoint:
        return _order(args)
    if args.no_wait or args.timeout != WAIT_SECONDS:
        raise UsageError(
            f"nimbus environments {args.action}", "--no-wait and --timeout go with --endpoint NAME"
        )
    if args.action == "build":
        if args.wheelhouse and not os.path.isdir(os.path.expanduser(args.wheelhouse)):
            raise UsageError(  # a bad argument (exit status 2); an endpoint's is its nodes'
                "nimbus environments build",
                f"--wheelhouse {args.wheelhouse} is not a directory on this node: give a "
                "directory of wheels (`pip download -d DIR PACKAGE` makes one)",
            )
        env = _spec(args)
        if env.plain:
            raise UsageError(
                "nimbus environments build",
                f"environment {args.name!r} has nothing to build: give -r REQUIREMENT, "
                f"--image IMAGE or --sandbox",
            )
        store = environments.cache()
        before = store.named(env.name)
        failed = [  # its earlier failed builds: shown by key once this one is built
            e.key
            for e in store.entries()
            if e.state == "failed" and env.name in e.names and e.key != env.key
        ]
        prepared = environments.prepare(env, retry=True)
        how = f"in {prepared.build_seconds:.1f} s" if prepared.build_seconds else "(already)"
        print(f"{env.name}: built {how}, key {env.key}")
        store.claim(env.key, env.name)  # an existing build of the spec: the name moves too
        for key in failed:
            print(
                f"{env.name} now refers to key {env.key}; the failed build (key {key}) is "
                f"listed by its key: `nimbus environments remove {key}` forgets it"
            )
        if before is not None and before != env.key:
            print(
                f"{env.name} now refers to key {env.key}; the previous build (key {before}) "
                f"stays for tasks still using it: `nimbus environments remove {before}` "
                f"removes it, else it is evicted when unused"
            )
        return 0
    store = environments.cache()
    gone = store.forget(args.name)
    if not gone:
        known = sorted({n for e in store.entries() for n in e.names})
        raise ConfigError(
            f"no environment named {args.name!r} on this node"
            + (f"; there are: {', '.join(known)}" if known else "")
        )
    for key, what in gone:
        if what == "removed":
            print(f"removed {args.name} ({key})")
        else:  # a build of the same spec under other names
            print(f"removed the name {args.name}; its build ({key}) is {what}")
    return 0


def _spec(args: argparse.Namespace) -> Environment:
    from nimbus.environments import Environment

    return Environment(
        args.name,
        requirements=tuple(args.requirements),
        wheelhouse=args.wheelhouse,
        image=args.image,
        sandbox=args.sandbox,
    )


def _built_here(name: str, prog: str) -> Environment:
    """The spec of the environment ``name`` built on this machine (its newest use)."""
    import dataclasses

    from nimbus import environments

    built = [e for e in environments.cache().entries() if e.state == "built" and e.spec]
    mine = [e for e in built if name in e.names]
    if not mine:
        raise UsageError(
            prog,
            f"environment {name!r} is not built on this machine, so its spec is not known "
            f"here: give it (-r REQUIREMENT, --wheelhouse DIR, --image IMAGE, --sandbox), or "
            f"build it here first (`nimbus environments build {name} -r PACKAGE`)",
        )
    spec = max(mine, key=lambda e: e.last_use).spec
    assert spec is not None
    return dataclasses.replace(spec, name=name)


def _order(args: argparse.Namespace) -> int:
    """``build|remove NAME --endpoint X``: on every node of X; a line per node."""
    import sys

    from nimbus.client import Client

    prog = f"nimbus environments {args.action}"
    env = None
    if args.action == "build":
        env = _spec(args)
        if env.plain:  # no spec given: the one built here travels
            env = _built_here(args.name, prog)
    with Client() as client:
        try:
            placed = client.order_environment(args.endpoint, args.action, args.name, env)
        except ServiceError as exc:
            if isinstance(exc, ServiceUnavailable) or (exc.status or 0) >= 500:
                raise
            print(f"{prog}: {exc}", file=sys.stderr)  # refused: nothing was done
            return 2
        nodes = [row["node"] for row in placed["nodes"]]
        what = f"{args.name} (key {env.key})" if env is not None else args.name
        doing = "building" if args.action == "build" else "removing"
        print(
            f"{doing} {what} on {len(nodes)} node{'s' * (len(nodes) != 1)} of endpoint "
            f"{args.endpoint}: {', '.join(nodes)}"
        )
        if args.no_wait:
            print(
                f"not waiting: `nimbus environments list --endpoint {args.endpoint}` shows "
                f"each node's {'build state' if env is not None else 'environments'}"
            )
            return 0
        return _follow(client, placed, args.endpoint, args.timeout)


def _follow(client: Any, placed: dict[str, Any], endpoint: str, timeout: float) -> int:
    """Print each node's outcome as it comes; 0 if all went well, 1 otherwise."""
    deadline = time.monotonic() + timeout
    said: set[str] = set()
    order = placed
    while True:
        for row in order["nodes"]:
            if row["state"] in ("built", "removed", "failed") and row["node"] not in said:
                said.add(row["node"])
                print(f"{row['node']}: {_outcome(row)}", flush=True)
        left = deadline - time.monotonic()
        if order["done"] or left <= 0:
            break
        time.sleep(min(POLL, left))  # then a last look: the placement's rows say only "asked"
        order = client.environment_order(placed["endpoint_id"], placed["order_id"])
    late = [row for row in order["nodes"] if row["node"] not in said]
    for row in late:  # its row says "building" till it answers, built already or not
        print(
            f"{row['node']}: no answer yet after {timeout:g} s: `nimbus environments "
            f"list --endpoint {endpoint}` shows when it ends"
        )
    failed = [row for row in order["nodes"] if row["state"] == "failed"]
    return 1 if failed or late else 0


def _outcome(row: dict[str, Any]) -> str:
    from nimbus import environments

    seconds, message = float(row.get("seconds") or 0.0), str(row.get("message") or "")
    if row["state"] == "failed":
        return f"failed: {environments.cause(message)}"
    if row["state"] == "built":
        return f"built in {seconds:.1f} s" if message != "already built" else "built (already)"
    return "removed" if not message or "build" in message else f"removed ({message})"


def _list(entries: list[Entry], as_json: bool) -> int:
    from nimbus import environments

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
            print(f"{'':<16} {environments.cause(e.message)}")
    return 0


def _list_endpoint(name: str, as_json: bool) -> int:
    """What the nodes of endpoint ``name`` hold, as its daemon last reported it."""
    from nimbus import environments
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
            print(f"{'':<20} {environments.cause(str(r['message']))}")
    return 0


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
