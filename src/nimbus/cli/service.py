"""``nimbus service``, ``nimbus login``, ``nimbus endpoints`` and ``nimbus tasks``.

Each is a ``setup``/``run`` pair registered in ``nimbus.cli.COMMANDS``. They use the
service's registry and server, and the SDK's ``Client``; nothing imports this module
but ``nimbus.cli``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nimbus.cli._numbers import number
from nimbus.cli._usage import writable_file
from nimbus.config import Settings
from nimbus.records import TaskState

if TYPE_CHECKING:
    from nimbus.service.registry import Registry

MAX_LIMIT = 10_000  # the service's largest page of tasks

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
    start = sub.add_parser(
        "start",
        help="run the service (REST API, registry, queues) until SIGTERM or Ctrl-C",
        description="Run the service in the foreground until SIGTERM or Ctrl-C, which stop it "
        "cleanly (the embedded Redis and its files in the runtime directory go too).",
    )
    start.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)"
    )
    start.add_argument(
        "--port", type=_port, default=8420, help="port (default 8420; 0: any free port)"
    )
    start.add_argument(
        "--url-file",
        type=Path,
        metavar="FILE",
        help="write the service's URL to FILE once it accepts connections (for scripts)",
    )
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
    token = sub.add_parser(
        "token",
        help="manage user tokens (admin, on the service's machine)",
        description="Manage the tokens in the registry of the service that runs with this "
        "NIMBUS_RUNTIME_DIR (or NIMBUS_DATABASE_URL); each command says on stderr which "
        "registry it used and whether a service runs on it.",
    )
    token_sub = token.add_subparsers(dest="token_action", metavar="ACTION", required=True)
    create = token_sub.add_parser(
        "create",
        help="create a user (if new) and print a new token",
        description="Create a user (if new) and print a new token for them.",
    )
    create.add_argument(
        "name",
        metavar="NAME",
        type=_user_name,
        help="the user's name: 1-200 letters, digits, '_', '.', '@' or '-'",
    )
    listing = token_sub.add_parser(
        "list",
        help="every token: ID, user, endpoint, created",
        description="List every token: its ID, user, endpoint and when it was created.",
    )
    listing.add_argument("--json", action="store_true", help="print JSON")
    revoke = token_sub.add_parser(
        "revoke",
        help="revoke a user's tokens (NAME) or one token (ID); takes effect at once",
        description="Revoke a user's tokens (NAME) or one token (ID), at once.",
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
        if args.url_file is not None:
            writable_file("nimbus service start", "--url-file", args.url_file)
        return serve_on(
            "service start",
            args.host,
            args.port,
            lambda: serve(
                settings, args.host, args.port, args.url_file, persist=args.persist, tls=tls
            ),
        )
    from nimbus.service.registry import Registry

    print(f"nimbus: {_which_registry(settings)}", file=sys.stderr)
    registry = Registry(settings.registry_url)
    try:
        return _token(registry, args)
    finally:
        registry.close()


def _which_registry(settings: Settings) -> str:
    """The registry the token commands use, and the service that runs on it, if any."""
    from sqlalchemy.engine import make_url

    from nimbus.service.server import running_service

    registry = make_url(settings.registry_url).render_as_string(hide_password=True)
    url = running_service(settings)
    if url is not None:
        return f"registry {registry}, of the service running at {url}"
    return (
        f"registry {registry}; no service runs with runtime directory {settings.runtime_dir} "
        "now (another service's tokens are in its own: set NIMBUS_RUNTIME_DIR as it has it)"
    )


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
        return 2  # a bad argument, as argparse exits for one
    if not revoked:
        print(f"user {args.target} has no tokens")
    for t in revoked:
        what = f"endpoint {t.endpoint} of {t.user}" if t.endpoint else f"user {t.user}"
        print(f"revoked token {t.id} ({what})")
    return 0


# ---------------------------------------------------------------- argument types
# Each raises ArgumentTypeError with one line: what was given and what is accepted.


def _user_name(text: str) -> str:
    from nimbus.service.registry import check_user_name

    try:
        return check_user_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_port = number(int, 0, 65535, "a port")


def port_in_use(host: str, port: int) -> bool:
    """Whether ``host:port`` is taken: a bind test, as the server would bind it."""
    import errno
    import socket

    if port == 0:
        return False
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def serve_on(command: str, host: str, port: int, serve: Any) -> int:
    """Run ``serve()`` on ``host:port``; a port in use is a usage error (exit 2, one line),
    found before anything starts, or from the server's failure to bind (a race)."""
    said = (
        f"nimbus {command}: port {port} is in use (a service already runs there?): "
        "choose another with --port"
    )
    if port_in_use(host, port):
        print(said, file=sys.stderr)
        return 2
    try:
        serve()
    except SystemExit as exc:  # uvicorn exits 1 when it cannot bind
        if exc.code not in (0, None) and port_in_use(host, port):
            print(said, file=sys.stderr)
            return 2
        raise
    return 0


_limit = number(int, 1, MAX_LIMIT)


def _task_id(text: str) -> str:
    try:
        return str(uuid.UUID(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a task ID: a UUID, as `nimbus tasks list` shows"
        ) from None


def _service_url(text: str) -> str:
    try:
        url = urllib.parse.urlsplit(text)
        host = url.hostname
    except ValueError:  # 'http://[::1': an unclosed IPv6 bracket, a bad port
        host = None
    if host is None or url.scheme not in ("http", "https"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not the service's URL: http(s)://HOST:PORT, as `nimbus service start` "
            "prints it"
        )
    if url.path.strip("/") or url.query or url.fragment:
        base = urllib.parse.urlunsplit((url.scheme, url.netloc, "", "", ""))
        raise argparse.ArgumentTypeError(
            f"{text!r} has a path: give the service's base URL, {base} "
            "(as `nimbus service start` prints it)"
        )
    return text.rstrip("/")


# ---------------------------------------------------------------- nimbus login


def login_setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--service",
        required=True,
        metavar="URL",
        type=_service_url,
        help="the service's URL, http(s)://HOST:PORT (default port 8420), no path",
    )
    parser.add_argument(
        "--token", required=True, help="your token (`nimbus service token create NAME`)"
    )


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
    listing = sub.add_parser(
        "list",
        help="endpoints you can use, with their status",
        description="List the endpoints the service lets you use (yours, shared with you, "
        "public), with their status.",
    )
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
        workers = str(row["workers"])
        if row.get("capacity", 0) > row["workers"]:  # a provider's blocks not (all) running
            workers = f"{workers}/{row['capacity']}"
        print(
            f"{row['name']:<20} {row['owner']:<12} {status:<8} {workers:>7} "
            f"{row['queued']:>7}  {beat}"
        )
    return 0


# ---------------------------------------------------------------- nimbus tasks


DEFAULT_LIMIT = 50


def tasks_setup(parser: argparse.ArgumentParser) -> None:
    task_actions(parser.add_subparsers(dest="action", metavar="ACTION", required=True))


def task_actions(sub: Any) -> None:
    """Add ``list`` and ``show`` to the subparsers ``sub`` of ``nimbus tasks``."""
    listing = sub.add_parser(
        "list",
        help="your recent tasks, newest first",
        description="List your recent tasks on the service, newest first: ID, function, "
        "state, endpoint, times.",
    )
    listing.add_argument(
        "--status",
        choices=[s.value for s in TaskState] + ["waiting"],
        help="only tasks in this state (waiting: any state before running)",
    )
    listing.add_argument(
        "--limit",
        type=_limit,
        default=DEFAULT_LIMIT,
        metavar="N",
        help=f"show the newest N tasks (default {DEFAULT_LIMIT}, at most {MAX_LIMIT}); "
        "a cut list says so on stderr",
    )
    listing.add_argument("--json", action="store_true", help="print JSON")
    show = sub.add_parser(
        "show",
        help="one task's full record",
        description="Print one task's full record: its state, times, endpoint, worker and error.",
    )
    show.add_argument("task_id", metavar="TASK_ID", type=_task_id, help="a task's ID (a UUID)")


def tasks_run(args: argparse.Namespace) -> int:
    from nimbus.client import Client

    with Client() as client:
        if args.action == "show":
            task = client.get_task(args.task_id)
            if task["state"] == TaskState.FAILED.value:
                task["error"] = _error_of(client, args.task_id)
            print(json.dumps(task, indent=2))
            return 0
        status = TaskState.WAITING.value if args.status == "waiting" else args.status
        rows = client.list_tasks(status, limit=min(args.limit + 1, MAX_LIMIT))
        names = {} if args.json else _function_names(client)
        places = {} if args.json else {e["endpoint_id"]: e["name"] for e in client.endpoints()}
    cut = len(rows) > args.limit
    rows = rows[: args.limit]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(
            f"{'TASK':<36} {'FUNCTION':<24} {'STATE':<20} {'ENDPOINT':<16} "
            f"{'SUBMITTED':>10} {'RUN (s)':>9}"
        )
        now = time.time()
        for row in rows:
            function = names.get(row["function_id"]) or row["function_id"][:8]
            place = places.get(row["endpoint_id"]) or (row["endpoint_id"] or "-")[:8]
            print(
                f"{row['task_id']:<36} {function[:24]:<24} {row['state']:<20} {place[:16]:<16} "
                f"{_ago(row['submitted']):>10} {_run_seconds(row, now):>9}"
            )
    if cut:
        sys.stdout.flush()
        print(
            f"nimbus: showing the newest {args.limit} tasks; there are more (--limit N shows more)",
            file=sys.stderr,
        )
    return 0


def _error_of(client: Any, task_id: str) -> dict[str, str]:
    """A failed task's exception (type and message) and traceback, as the dashboard's task
    page shows them: the text inside its result, read without unpickling it."""
    from nimbus.protocol import MSGPACK, traceback_text, unpack

    response = client.request(
        "GET", f"/v1/tasks/{task_id}/result", params={"wait": 0}, headers={"Accept": MSGPACK}
    )
    result = unpack(response.content)["result"]
    text = traceback_text(result) if isinstance(result, bytes) else ""
    last = text.strip().splitlines()[-1] if text.strip() else ""
    kind, _, message = last.partition(": ")
    return {"type": kind, "message": message, "traceback": text}


def _function_names(client: Any) -> dict[str, str]:
    """Function id -> name, for the functions visible to you."""
    functions = client.request("GET", "/v1/functions").json()["functions"]
    return {f["function_id"]: f["name"] for f in functions}


def _run_seconds(row: dict[str, Any], now: float) -> str:
    """A finished task's run time; a running one's so far (``12.0+``); else ``-``."""
    record: dict[str, Any] = row["record"] or {}
    if record.get("ended") and record.get("started"):
        return f"{record['ended'] - record['started']:.3f}"
    if row["state"] == TaskState.RUNNING.value and row.get("started"):  # the worker's start
        return f"{max(0.0, now - row['started']):.1f}+"
    return "-"


def _ago(t: float) -> str:
    seconds = max(0.0, time.time() - t)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))
