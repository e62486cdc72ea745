"""``nimbus endpoint configure | start | stop | status | list``.

A ``setup``/``run`` pair registered in ``nimbus.cli.COMMANDS``; the daemon itself is
``nimbus.endpoint.daemon``, started here as ``python -m nimbus.endpoint.daemon NAME``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from nimbus.config import Settings
from nimbus.endpoint.config import EndpointConfig, endpoint_dir, endpoint_names
from nimbus.errors import ConfigError

__all__ = ["run", "setup"]


def setup(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    configure = sub.add_parser(
        "configure", help="register an endpoint with the service and write its config"
    )
    _name_argument(configure)
    configure.add_argument(
        "--workers",
        type=_positive,
        metavar="N",
        help="warm workers (default: the workers setting, NIMBUS_WORKERS: one per core)",
    )
    configure.add_argument(
        "--prefetch",
        type=_positive,
        metavar="N",
        help="tasks in flight per worker (default: the prefetch setting, NIMBUS_PREFETCH: 8)",
    )
    start = sub.add_parser("start", help="start the endpoint's agent (configures it if new)")
    _name_argument(start)
    start.add_argument(
        "--foreground",
        action="store_true",
        help="run the agent in this process, logging to stderr, until Ctrl-C or SIGTERM "
        "(default: in the background, logging to ~/.config/nimbus/endpoints/NAME/agent.log)",
    )
    stop = sub.add_parser("stop", help="stop the endpoint's agent")
    _name_argument(stop)
    status = sub.add_parser("status", help="is the agent running, and what the service sees")
    _name_argument(status)
    sub.add_parser("list", help="endpoints configured on this machine")


def _name_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "name",
        metavar="NAME",
        type=_endpoint_name,
        help="the endpoint's name: 1-200 letters, digits, '_', '.', '@' or '-'",
    )


def _endpoint_name(text: str) -> str:
    try:
        endpoint_dir(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        print(f"{'NAME':<20} {'AGENT':<22} {'SERVICE':<28} ENDPOINT ID")
        for name in endpoint_names():
            config = EndpointConfig.load(name)
            pid = config.running_pid()
            state = f"running (pid {pid})" if pid else "stopped"
            print(f"{name:<20} {state:<22} {config.service_url:<28} {config.endpoint_id}")
        return 0
    if args.action == "configure":
        config = configure(args.name, args.workers, args.prefetch)
        print(f"endpoint {config.name} ({config.endpoint_id}) configured in {config.dir}")
        return 0
    if args.action == "start":
        try:
            config = EndpointConfig.load(args.name)
        except ConfigError:
            config = configure(args.name, None, None)
        if args.foreground:
            from nimbus.endpoint.daemon import main

            return main([config.name])
        return start(config)
    config = EndpointConfig.load(args.name)
    if args.action == "stop":
        return stop(config)
    pid = config.running_pid()
    print(f"agent:   {f'running (pid {pid})' if pid else 'stopped'}")
    from nimbus.client import Client

    with Client(config.service_url) as client:
        info = client.get_endpoint(config.endpoint_id)
    print(
        f"service: {'online' if info['online'] else 'offline'}, {info['workers']} workers, "
        f"{info['queued']} queued, Python {info['python'] or '?'}"
    )
    return 0


def configure(name: str, workers: int | None, prefetch: int | None) -> EndpointConfig:
    from nimbus.client import Client

    settings = Settings.load()
    with Client(settings=settings) as client:
        registered = client.register_endpoint(name)
        url = client.service_url
    config = EndpointConfig(
        name=name,
        service_url=url,
        endpoint_id=registered["endpoint_id"],
        token=registered["token"],
        workers=workers or settings.workers,
        prefetch=prefetch or settings.prefetch,
    )
    config.save()
    return config


def start(config: EndpointConfig) -> int:
    pid = config.running_pid()
    if pid:
        print(f"endpoint {config.name} already runs (pid {pid})")
        return 0
    config.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(config.log_file, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nimbus.endpoint.daemon", config.name],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    config.pid_file.write_text(f"{proc.pid}\n")
    time.sleep(0.5)
    if proc.poll() is not None:
        print(f"endpoint {config.name} exited at start; see {config.log_file}", file=sys.stderr)
        return 1
    print(f"endpoint {config.name} started (pid {proc.pid}, log {config.log_file})")
    return 0


def stop(config: EndpointConfig) -> int:
    pid = config.running_pid()
    if not pid:
        print(f"endpoint {config.name} is not running")
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except OSError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
    config.pid_file.unlink(missing_ok=True)
    print(f"endpoint {config.name} stopped")
    return 0
