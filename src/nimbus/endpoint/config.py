"""Per-endpoint configuration: ``~/.config/nimbus/endpoints/<name>/``.

Each endpoint has a directory holding ``endpoint.toml`` (service URL, endpoint
id, the agent's token, workers, prefetch, and where its nodes come from: the
provider settings), and, while its agent runs, ``agent.pid``, ``agent.log``
and ``blocks.json`` (its provider's blocks, for ``nimbus endpoint status``). The directory is private (mode 0o700): the
token in it is the endpoint's credential.
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from nimbus.config import NAME, NAME_RULE, config_dir
from nimbus.errors import ConfigError

__all__ = ["EndpointConfig", "endpoint_dir", "endpoint_names"]


def endpoint_dir(name: str) -> Path:
    if not NAME.match(name):
        raise ConfigError(f"endpoint name {name!r} must be {NAME_RULE}")
    return config_dir() / "endpoints" / name


def endpoint_names() -> list[str]:
    root = config_dir() / "endpoints"
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "endpoint.toml").is_file())


@dataclass(frozen=True)
class EndpointConfig:
    name: str
    service_url: str
    endpoint_id: str
    token: str
    workers: int
    prefetch: int = 8
    # -- where the endpoint's nodes come from (issue 17): the provider settings' names
    provider: str = "local"
    partition: str = ""
    account: str = ""
    qos: str = ""
    nodes_per_block: int = 1
    workers_per_node: int = 0  # 0: the node's cores
    min_blocks: int = 0
    max_blocks: int = 4
    init_blocks: int = 0
    parallelism: float = 1.0
    walltime: str = "00:30:00"
    max_idle: float = 120.0
    worker_init: str = ""
    scheduler_options: str = ""
    exclusive: bool = False
    agent_listen: str = "0.0.0.0:0"
    # -- each worker's limits (issue 19, nimbus.network); 0: none
    worker_cpus: float = 0.0
    worker_memory: int = 0
    worker_bandwidth: int = 0  # bits/s
    net_accounting: str = ""  # socket, cgroup, netns or auto; "": the agent's own setting
    # -- directories whose files tasks may read and write (nimbus.File), ':' between
    exports: str = ""

    PROVIDER_KEYS = (
        "provider", "partition", "account", "qos", "nodes_per_block", "workers_per_node",
        "min_blocks", "max_blocks", "init_blocks", "parallelism", "walltime", "max_idle",
        "worker_init", "scheduler_options", "exclusive", "agent_listen",
    )  # fmt: skip

    def provider_settings(self) -> dict[str, object]:
        """This endpoint's provider settings, as ``Settings.replace`` takes them."""
        out = {key: getattr(self, key) for key in self.PROVIDER_KEYS}
        for key in ("partition", "account", "qos", "workers_per_node"):
            out[key] = out[key] or None
        return out

    def worker_environment(self) -> dict[str, str]:
        """The limits and net_accounting as the agent's environment (its managers read
        them as settings)."""
        out: dict[str, str] = {}
        if self.worker_cpus:
            out["NIMBUS_WORKER_CPUS"] = str(self.worker_cpus)
        if self.worker_memory:
            out["NIMBUS_WORKER_MEMORY"] = str(self.worker_memory)
        if self.worker_bandwidth:
            out["NIMBUS_WORKER_BANDWIDTH"] = f"{self.worker_bandwidth}bit"
        if self.net_accounting:
            out["NIMBUS_NET_ACCOUNTING"] = self.net_accounting
        return out

    def export_dirs(self) -> list[Path]:
        """The directories this endpoint exports to ``nimbus.File`` (none: nothing)."""
        return [Path(d).expanduser() for d in self.exports.split(os.pathsep) if d.strip()]

    @property
    def blocks_file(self) -> Path:
        return self.dir / "blocks.json"

    @property
    def dir(self) -> Path:
        return endpoint_dir(self.name)

    @property
    def pid_file(self) -> Path:
        return self.dir / "agent.pid"

    @property
    def log_file(self) -> Path:
        return self.dir / "agent.log"

    def save(self) -> Path:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        path = self.dir / "endpoint.toml"
        lines = []
        for key, value in asdict(self).items():
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, int | float):
                text = str(value)
            else:  # a JSON string is a TOML basic string: quotes, newlines escaped
                text = json.dumps(str(value))
            lines.append(f"{key} = {text}")
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write("\n".join(lines) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, name: str) -> EndpointConfig:
        path = endpoint_dir(name) / "endpoint.toml"
        if not path.is_file():
            raise ConfigError(
                f"endpoint {name!r} is not configured here ({path} missing); run "
                f"`nimbus endpoint configure {name}` first"
            )
        try:
            data = tomllib.loads(path.read_text())
            return cls(**data)
        except (tomllib.TOMLDecodeError, TypeError) as exc:
            raise ConfigError(
                f"{path} is not a valid endpoint file ({exc}); configure it again"
            ) from None

    def running_pid(self) -> int | None:
        """The pid of this endpoint's agent if it runs."""
        try:
            pid = int(self.pid_file.read_text().strip())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        return pid
