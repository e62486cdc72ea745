"""``nimbus service``, ``nimbus login``, ``nimbus endpoints`` and ``nimbus tasks``.

Each is a ``setup``/``run`` pair registered in ``nimbus.cli.COMMANDS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nimbus.config import Settings
from nimbus.records import TaskState

if TYPE_CHECKING:
    from nimbus.service.registry import Registry

__all__ = [
    "endpoints_run",
    "endpoints_setup",
    "login_run",
    "login_setup",
    "service_run",
    "service_setup",
    "tasks_run",
    "tasks_setup",
]


# ---------------------------------------------------------------- nimbus service


def service_setup(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    start = sub.add_parser("start", help="run the service (REST API, registry, queues)")
    start.add_argument("--host", default="127.0.0.1", help="address to listen on")
    start.add_argument("--port", type=int, default=8420, help="port (0: any free port)")
    start.add_argument("--url-file", type=Path, help="write the URL here once listening")
    start.add_argument(
        "--persist",
        action="store_true",
        help="keep the embedded Redis (queues, results) on disk in <runtime_dir>/service/redis",
    )
    start.add_argument(
        "--tls-cert", type=Path, metavar="FILE", help="serve HTTPS: the PEM certificate chain"
    )
    start.add_argument(
        "--tls-key", type=Path, metavar="FILE", help="serve HTTPS: the PEM private key"
    )
    token = sub.add_parser("token", help="manage user tokens (admin, on the service's machine)")
    token_sub = token.add_subparsers(dest="token_action", metavar="ACTION", required=True)
    create = token_sub.add_parser("create", help="create a user (if new) and print a new token")
    create.add_argument("name", help="the user's name")
    listing = token_sub.add_parser("list", help="every token: ID, user, endpoint, created")
    listing.add_argument("--json", action="store_true", help="print JSON")
    revoke = token_sub.add_parser(
        "revoke", help="revoke a user's tokens (NAME) or one token (ID); takes effect at once"
    )
    revoke.add_argument("target", metavar="NAME|ID", help="a user's name or a token's ID")


def service_run(args: argparse.Namespace) -> int:
    settings = Settings.load()
    settings.configure_logging()
    if args.action == "start":
        from nimbus.service.server import serve

        if (args.tls_cert is None) != (args.tls_key is None):
            print(
                "nimbus service start: --tls-cert and --tls-key go together "
                "(the certificate chain and its private key)",
                file=sys.stderr,
            )
            return 2
        tls = None if args.tls_cert is None else (args.tls_cert, args.tls_key)
        serve(settings, args.host, args.port, args.url_file, persist=args.persist, tls=tls)
        return 0
    from nimbus.service.registry import Registry

    registry = Registry(settings.registry_url)
    try:
        return _token(registry, args)
    finally:
        registry.close()


def _token(registry: Registry, args: argparse.Namespace) -> int:
    if args.token_action == "create":
        print(registry.create_user_token(args.name))
        return 0
    if args.token_action == "list":
        tokens = registry.tokens()
        if args.json:
            print(json.dumps([dataclasses.asdict(t) for t in tokens], indent=2))
            return 0
        print(f"{'ID':<12}  {'USER':<20} {'ENDPOINT':<20} CREATED")
        for t in tokens:
            created = time.strftime("%Y-%m-%d %H:%M", time.localtime(t.created))
            print(f"{t.id:<12}  {t.user:<20} {t.endpoint or '-':<20} {created}")
        return 0
    try:
        revoked = registry.revoke(args.target)
    except LookupError as exc:
        print(
            f"nimbus service token revoke: {exc.args[0]}; see `nimbus service token list`",
            file=sys.stderr,
        )
        return 1
    if not revoked:
        print(f"user {args.target} has no tokens")
    for t in revoked:
        what = f"endpoint {t.endpoint} of {t.user}" if t.endpoint else f"user {t.user}"
        print(f"revoked token {t.id} ({what})")
    return 0


# ---------------------------------------------------------------- nimbus login


def login_setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--service", required=True, help="the service URL, http(s)://host:port")
    parser.add_argument("--token", required=True, help="your token")


def login_run(args: argparse.Namespace) -> int:
    from nimbus.client import Client, save_credentials

    with Client(args.service, args.token) as client:
        me = client.whoami()
    path = save_credentials(args.service, args.token)
    print(f"logged in to {args.service} as {me['name']} (saved in {path})")
    return 0


# ---------------------------------------------------------------- nimbus endpoints


def endpoints_setup(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = sub.add_parser("list", help="endpoints you can use, with their status")
    listing.add_argument("--json", action="store_true", help="print JSON")


def endpoints_run(args: argparse.Namespace) -> int:
    from nimbus.client import Client

    with Client() as client:
        rows = client.endpoints()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'NAME':<20} {'OWNER':<12} {'STATUS':<8} {'WORKERS':>7} {'QUEUED':>7}  LAST HEARTBEAT")
    for row in rows:
        beat = _ago(row["last_heartbeat"]) if row["last_heartbeat"] else "never"
        status = "online" if row["online"] else "offline"
        print(
            f"{row['name']:<20} {row['owner']:<12} {status:<8} {row['workers']:>7} "
            f"{row['queued']:>7}  {beat}"
        )
    return 0


# ---------------------------------------------------------------- nimbus tasks


def tasks_setup(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = sub.add_parser("list", help="your recent tasks")
    listing.add_argument("--status", choices=[s.value for s in TaskState] + ["waiting"])
    listing.add_argument("--limit", type=int, default=50)
    listing.add_argument("--json", action="store_true", help="print JSON")
    show = sub.add_parser("show", help="one task's full record")
    show.add_argument("task_id")


def tasks_run(args: argparse.Namespace) -> int:
    from nimbus.client import Client

    with Client() as client:
        if args.action == "show":
            print(json.dumps(client.get_task(args.task_id), indent=2))
            return 0
        status = TaskState.WAITING.value if args.status == "waiting" else args.status
        rows = client.list_tasks(status, limit=args.limit)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'TASK':<36} {'STATE':<20} {'SUBMITTED':>10} {'RUN (s)':>8}")
    for row in rows:
        record: dict[str, Any] = row["record"] or {}
        run = record.get("ended", 0) - record.get("started", 0) if record.get("ended") else 0.0
        print(f"{row['task_id']:<36} {row['state']:<20} {_ago(row['submitted']):>10} {run:>8.3f}")
    return 0


def _ago(t: float) -> str:
    seconds = max(0.0, time.time() - t)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))
