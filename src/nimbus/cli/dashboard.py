"""``nimbus dashboard``: the dashboard of this machine's own nimbus, in the browser.

::

    $ nimbus dashboard
    nimbus dashboard: log in as you with this token (valid while this dashboard runs,
    revoked when it stops):
        <token>
    nimbus dashboard listening on http://127.0.0.1:8421

It runs the service of this runtime directory (``NIMBUS_RUNTIME_DIR``: the
SQLite registry and the embedded Redis, kept on disk so the history survives a
restart) on loopback only, with you (the login name) as its dashboard's admin:
the endpoints started here (``nimbus endpoint start``) and the tasks sent
through it, from an ``Executor(endpoint=...)`` or ``nimbus run --endpoint``
with ``NIMBUS_SERVICE_URL`` set to the URL it prints, are on its pages, live.
A local ``Executor()`` of this runtime directory (a program's, or ``nimbus run``'s)
writes its finished tasks to the same history (``nimbus.local_history``):
they are on the tasks and task pages too, once finished.

The token is printed, never put in the URL (the browser's history and the
server logs would keep it): paste it into the login form. It is a registry
token (an admin's: every service on this registry accepts it) made for this run
only: revoked when the dashboard stops, whether it served or failed to start
(a port in use is found before any token is made). Ctrl-C or SIGTERM stop it
cleanly (the embedded Redis and its socket go, the data stays); a run killed
outright (SIGKILL) leaves its token: ``nimbus service token revoke ID``.

When ``nimbus service start`` already runs on this runtime directory, its
dashboard is the one: ``nimbus dashboard`` says where it is and exits (status 0),
starting no second service on the same registry. It finds out from the service's
``service.json`` alone (``nimbus.service.running``), before importing the server: at
once. A ``--url-file`` it could not write is refused (one line, status 2) before
anything starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import signal
import sys
from pathlib import Path
from types import FrameType

from nimbus.cli._numbers import number
from nimbus.cli._usage import writable_file
from nimbus.config import NAME, NAME_RULE, Settings

__all__ = ["run", "setup"]

DEFAULT_PORT = 8421  # beside the service's default 8420


def setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--port", type=number(int, 0, 65535, "a port"), default=DEFAULT_PORT,
        help=f"port on 127.0.0.1 (default {DEFAULT_PORT}; 0: any free port)",
    )  # fmt: skip
    parser.add_argument(
        "--url-file", type=Path, metavar="FILE",
        help="write the dashboard's URL to FILE once it accepts connections (for scripts)",
    )  # fmt: skip
    parser.add_argument(
        "--user", default=None, metavar="NAME",
        help="whom to log in as, the dashboard's admin (default: your login name)",
    )  # fmt: skip


def _which_token(service_url: str, user: str | None) -> str:
    """The token to log in to the dashboard of the service at ``service_url`` with: the
    one ``nimbus login`` saved for it if any, else one ``service token create`` makes."""
    from nimbus.config import saved_credentials  # (the client's, without its imports)

    make = f"`nimbus service token create {user or 'USER'}`"
    if str(saved_credentials().get("service_url", "")) == service_url.rstrip("/"):
        return f"the token you gave `nimbus login`, or a new one: {make}"
    return f"a token: {make}"


def run(args: argparse.Namespace) -> int:
    from nimbus.service.running import running_service  # light: before the server's imports

    settings = Settings.load()
    settings.configure_logging()
    user = args.user or getpass.getuser()
    if not NAME.fullmatch(user):  # check_user_name's rule, without the registry's import
        print(f"nimbus dashboard: --user: {user!r} is not a user name: 1-200 {NAME_RULE}",
              file=sys.stderr)  # fmt: skip
        return 2
    running = running_service(settings)
    if running is not None:
        print(
            f"nimbus dashboard: a service runs at {running} on this runtime directory "
            f"({settings.runtime_dir}): its dashboard is at {running}/ (log in with "
            f"{_which_token(str(running), args.user)})",
            flush=True,
        )
        return 0
    if args.url_file is not None:
        writable_file("nimbus dashboard", "--url-file", args.url_file)
    from nimbus.cli.service import port_in_use, serve_on
    from nimbus.service.registry import Registry, hash_token
    from nimbus.service.server import serve

    admins = {name.strip() for name in (settings.service_admins or "").split(",") if name}
    settings = dataclasses.replace(settings, service_admins=",".join(sorted(admins | {user})))
    if port_in_use("127.0.0.1", args.port):  # before a token is made
        return serve_on("dashboard", "127.0.0.1", args.port, lambda: None)
    persist = not settings.redis_url  # your own Redis keeps its data as you configured it
    previous = signal.signal(signal.SIGTERM, _terminated)  # till serve() takes it: revoke
    stops = {signal.SIGTERM, signal.SIGINT}
    unmasked = signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # the token made whole
    registry = Registry(settings.registry_url)
    code = 0
    try:
        token = registry.create_user_token(user)
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, unmasked)  # one held arrives here
            print(
                f"nimbus dashboard: log in as {user} with this token (valid while this "
                f"dashboard runs, revoked when it stops):\n    {token}",
                flush=True,
            )
            url_file = args.url_file
            code = serve_on(
                "dashboard",
                "127.0.0.1",
                args.port,
                lambda: serve(
                    settings, "127.0.0.1", args.port, url_file, persist=persist, name="dashboard"
                ),
            )
        except _Terminated:
            pass  # SIGTERM before the server was up
        finally:
            signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # the revocation made whole
            registry.revoke(hash_token(token))  # the full digest: this one token
    finally:
        registry.close()
        signal.signal(signal.SIGTERM, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, unmasked)  # one held meanwhile: now
    return code


class _Terminated(Exception):
    """SIGTERM arrived before :func:`serve` took it over."""


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise _Terminated
