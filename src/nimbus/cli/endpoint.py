"""``nimbus endpoint configure | start | stop | status | list``.

A ``setup``/``run`` pair registered in ``nimbus.cli.COMMANDS``; the daemon itself is
``nimbus.endpoint.daemon``, started here as ``python -m nimbus.endpoint.daemon NAME``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

from nimbus.config import Settings
from nimbus.endpoint.config import EndpointConfig, endpoint_dir, endpoint_names
from nimbus.errors import ConfigError

__all__ = ["run", "setup"]

START_WAIT = 60.0  # seconds `endpoint start` waits at most for its agent to come up or die


def setup(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    configure = sub.add_parser(
        "configure",
        help="register an endpoint with the service and write its config",
        description="Register an endpoint with the service (if new) and write its config "
        "in ~/.config/nimbus/endpoints/NAME/: workers, where its nodes come from, "
        "what its tasks may use.",
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
    _provider_arguments(configure)
    _limit_arguments(configure)
    configure.add_argument(
        "--net-accounting",
        choices=("socket", "cgroup", "netns", "auto"),
        help="what counts a task's network bytes: socket (Python sockets), cgroup (eBPF on a "
        "cgroup per worker, root: every byte, the cheapest), netns (a network namespace per "
        "worker, root: every byte, and what a task's options(bandwidth=) needs), auto "
        "(cgroup where allowed, else socket); default: NIMBUS_NET_ACCOUNTING "
        "in the agent's environment, else auto",
    )
    start = sub.add_parser(
        "start",
        help="start the endpoint's agent (configures it if new)",
        description="Start the endpoint's agent, which takes tasks from the service and runs "
        "them on warm workers; an endpoint not configured yet is configured first.",
    )
    _name_argument(start)
    start.add_argument(
        "--foreground",
        action="store_true",
        help="run the agent in this process, logging to stderr, until Ctrl-C or SIGTERM "
        "(default: in the background, logging to ~/.config/nimbus/endpoints/NAME/agent.log)",
    )
    stop = sub.add_parser(
        "stop",
        help="stop the endpoint's agent",
        description="Stop the endpoint's agent and its workers; its config stays.",
    )
    _name_argument(stop)
    status = sub.add_parser(
        "status",
        help="is the agent running, and what the service sees",
        description="Say whether the endpoint's agent runs here and what the service sees of it.",
    )
    _name_argument(status)
    sub.add_parser(
        "list",
        help="endpoints configured on this machine",
        description="List the endpoints configured on this machine (`nimbus endpoints list`: "
        "those the service lets you use).",
    )


# -- where the endpoint's nodes come from (issue 17): one option per provider setting
_PROVIDER_OPTIONS: dict[str, tuple[type, str]] = {
    "provider": (str, "where nodes come from: local (this machine) or slurm (blocks as jobs)"),
    "partition": (str, "Slurm partition of blocks"),
    "account": (str, "Slurm account charged"),
    "qos": (str, "Slurm quality of service"),
    "nodes_per_block": (int, "nodes in one block (a manager on each)"),
    "workers_per_node": (int, "workers of each node's manager, one per core if unset"),
    "min_blocks": (int, "blocks kept even when idle"),
    "max_blocks": (int, "most blocks at once"),
    "init_blocks": (int, "blocks asked for when the agent starts"),
    "parallelism": (float, "blocks per pending work, 0-1 (1: a worker per task)"),
    "walltime": (str, "walltime of a block, [D-]HH:MM:SS"),
    "max_idle": (float, "seconds a block may idle before it is drained and cancelled"),
    "worker_init": (str, "shell lines a block runs before its managers"),
    "scheduler_options": (str, "extra #SBATCH options, one a line"),
    "agent_listen": (str, "HOST:PORT where the agent accepts the blocks' managers"),
}


def _provider_arguments(parser: argparse.ArgumentParser) -> None:
    for key, (_, text) in _PROVIDER_OPTIONS.items():
        flag = "--" + key.replace("_", "-")
        parser.add_argument(
            flag,
            type=_provider if key == "provider" else _limit(key, flag),  # checked as settings
            dest=key,
            help=f"{text} (default: NIMBUS_{key.upper()})",
        )
    parser.add_argument("--exclusive", action="store_true", default=None, help="whole nodes")
    parser.add_argument(
        "--exports",
        dest="data_exports",
        type=_exports,
        metavar="DIR[:DIR...]",
        help="directories tasks' nimbus.File may read and write here (NIMBUS_DATA_EXPORTS)",
    )


def _provider(text: str) -> str:
    """--provider: a provider nimbus knows (``nimbus.providers.PROVIDERS``), checked now."""
    from nimbus.providers import PROVIDERS

    if text not in PROVIDERS:
        raise argparse.ArgumentTypeError(
            f"unknown provider {text!r}; known providers: {', '.join(sorted(PROVIDERS))}"
        )
    return text


def _exports(text: str) -> str:
    """--exports: directories of this machine (the endpoint's), each existing now (a
    relative one, under the current directory: kept absolute, ``_kept``)."""
    for item in text.split(os.pathsep):
        path = os.path.expanduser(item.strip())
        if path and not os.path.isabs(path) and not os.path.isdir(path):
            raise argparse.ArgumentTypeError(
                f"{item.strip()} must be absolute: as a relative path it names "
                f"{os.path.abspath(path)}, which is not a directory on this machine, where "
                f"the endpoint runs; give the absolute path of a directory that exists"
            )
        if path and not os.path.isdir(path):
            what = "is not a directory" if os.path.exists(path) else "does not exist"
            raise argparse.ArgumentTypeError(
                f"{item.strip()} {what} on this machine, where the endpoint runs; create it "
                f"first, or give directories that exist ({os.pathsep!r} between them)"
            )
    return text


# -- each worker's limits (issue 19): units checked as the settings check them
_LIMIT_OPTIONS = {
    "worker_cpus": "CPUs each worker may use, e.g. 0.5 (cgroup quota; root)",
    "worker_memory": "memory each worker may use, e.g. 512M (cgroup; over it: MemoryLimitExceeded)",
    "worker_bandwidth": "each way's bandwidth of each worker, with its unit: 200Mbit or 25MB/s",
}


def _limit_arguments(parser: argparse.ArgumentParser) -> None:
    for key, text in _LIMIT_OPTIONS.items():
        flag = "--" + key.replace("_", "-")
        parser.add_argument(flag, type=_limit(key, flag), dest=key, help=text)


def _limit(key: str, flag: str) -> Any:
    def parse(text: str) -> object:
        try:
            return getattr(Settings.load({}).replace(**{key: text}), key)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc).replace(f"Settings.{key}", flag)) from None

    return parse


def _provider_values(args: argparse.Namespace) -> dict[str, object]:
    keys = [*_PROVIDER_OPTIONS, "exclusive", *_LIMIT_OPTIONS, "data_exports"]
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def _kept(settings: Settings) -> dict[str, Any]:
    """The provider settings as an endpoint file keeps them (no None)."""
    kept: dict[str, Any] = {k: getattr(settings, k) for k in EndpointConfig.PROVIDER_KEYS}
    for key in ("partition", "account", "qos"):
        kept[key] = kept[key] or ""
    kept["workers_per_node"] = kept["workers_per_node"] or 0
    for key in _LIMIT_OPTIONS:
        kept[key] = getattr(settings, key) or 0
    dirs = [d for d in settings.data_exports.split(os.pathsep) if d.strip()]
    kept["exports"] = os.pathsep.join(os.path.abspath(os.path.expanduser(d)) for d in dirs)
    return kept


def _print_blocks(config: EndpointConfig) -> None:
    import json

    if config.provider == "local":
        return
    try:
        stats = json.loads(config.blocks_file.read_text())
    except (OSError, ValueError):
        print(f"blocks:  none known yet (provider {config.provider})")
        return
    print(f"blocks:  provider {config.provider}, {len(stats['blocks'])} block(s)")
    for b in stats["blocks"]:
        left = "?" if b["walltime_left"] is None else f"{b['walltime_left']} s"
        print(
            f"  job {b['id']:<10} {b['state']:<10} {b['nodes']} node(s), {b['managers']} "
            f"manager(s), {b['busy']} task(s) busy, walltime left {left} {b['message']}"
        )
    if stats.get("error"):
        print(f"  provider error: {stats['error']}")


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
        try:
            running = EndpointConfig.load(args.name).running_pid()
        except ConfigError:
            running = None
        config = configure(
            args.name, args.workers, args.prefetch, args.net_accounting, **_provider_values(args)
        )
        print(f"endpoint {config.name} ({config.endpoint_id}) configured in {config.dir}")
        if running is None:
            return 0
        # its new token replaced the running agent's, which stops: started again with it
        print(f"its running agent (pid {running}) stops (the new token replaced its own); "
              "starting it again with the new settings")  # fmt: skip
        stop(config, quiet=True)
        return start(config)
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
    _print_blocks(config)
    from nimbus.client import Client

    with Client(config.service_url) as client:
        info = client.get_endpoint(config.endpoint_id)
    workers = f"{info['workers']} workers"
    if info.get("capacity", 0) > info["workers"]:  # a provider's blocks not (all) running
        workers += f" (up to {info['capacity']})"
    print(
        f"service: {'online' if info['online'] else 'offline'}, {workers}, "
        f"{info['queued']} queued, Python {info['python'] or '?'}"
    )
    return 0


def configure(
    name: str,
    workers: int | None,
    prefetch: int | None,
    net_accounting: str | None = None,
    **provider: object,
) -> EndpointConfig:
    from nimbus.client import Client

    settings = Settings.load().replace(**provider)  # checked as the settings are
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
        net_accounting=net_accounting or "",
        **_kept(settings),
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
        logged = log.tell()  # what this start writes comes after
        proc = subprocess.Popen(
            [sys.executable, "-m", "nimbus.endpoint.daemon", config.name],
            env={**os.environ, **config.worker_environment()},  # its workers' limits
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    # up: the daemon writes its pid file once it is made (its provider, its settings
    # checked); one that cannot start dies first
    with contextlib.suppress(OSError):
        config.pid_file.unlink()
    deadline = time.monotonic() + START_WAIT
    while proc.poll() is None and time.monotonic() < deadline and not _wrote(config, proc.pid):
        time.sleep(0.05)
    if proc.returncode is None:
        config.pid_file.write_text(f"{proc.pid}\n")
    else:
        with contextlib.suppress(OSError):
            config.pid_file.unlink()
        print(
            f"endpoint {config.name}: its agent exited at start (status {proc.returncode}): "
            f"{_cause(config.log_file, logged)}\n(the whole log: {config.log_file})",
            file=sys.stderr,
        )
        return 1
    print(f"endpoint {config.name} started (pid {proc.pid}, log {config.log_file})")
    return 0


def _wrote(config: EndpointConfig, pid: int) -> bool:
    try:
        return config.pid_file.read_text().strip() == str(pid)
    except OSError:
        return False


def _cause(log_file: Any, offset: int) -> str:
    """The cause an agent that died gave, in what it logged from ``offset``: its last line."""
    try:
        with open(log_file, "rb") as log:
            log.seek(offset)
            lines = log.read().decode(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return lines[-1] if lines else "it logged nothing"


def stop(config: EndpointConfig, quiet: bool = False) -> int:
    pid = config.running_pid()
    if not pid:
        if not quiet:
            print(f"endpoint {config.name} is not running")
        return 0
    with contextlib.suppress(ProcessLookupError):  # it may have just stopped by itself
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
    if not quiet:
        print(f"endpoint {config.name} stopped")
    return 0
