"""``Settings``: every nimbus setting, each declared once.

A setting is one line of :class:`Settings`: its name, type, default, how a
value is checked and a one-line meaning, e.g.::

    prefetch: int = setting(8, c.int_at_least(1), "tasks in flight per worker")

Its environment variable is ``NIMBUS_`` + the name in capitals; its TOML key is
the name. :data:`FIELDS` (name -> :class:`Spec`) is derived from the class, and
``load``, ``replace``, ``describe``, ``nimbus info`` and the README's table
(pinned by tests/test_config.py) all follow it. A new setting is a new line.

How a field declares a setting is ``_fields``'s (:func:`setting`, :class:`Spec`);
where the values come from, and reading them once a process, is ``_loading``'s.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nimbus._lazy import lazy
from nimbus.config import _coerce as c
from nimbus.config import _loading, _places
from nimbus.config._fields import Spec, coerce, setting, specs
from nimbus.config._loading import CONFIG_ENV
from nimbus.errors import ConfigError

TYPE_CHECKING = False
if TYPE_CHECKING:
    import logging
    import ssl
else:  # each imported on first use: a program that reads a setting or two (`nimbus run`
    # of a script) needs none of them, and they were most of what this module cost
    logging = lazy("logging", globals())
    ssl = lazy("ssl", globals())

__all__ = ["CONFIG_ENV", "FIELDS", "Settings", "Spec"]


def _cpu_count() -> int:
    return os.cpu_count() or 1


@dataclass(frozen=True)
class Settings:
    """Every nimbus setting. Build with :meth:`load`; derive with :meth:`replace`."""

    workers: int = setting(
        None, c.int_at_least(1), "worker processes of the local runtime", factory=_cpu_count
    )
    prefetch: int = setting(8, c.int_at_least(1), "tasks in flight per worker")
    task_timeout: float | None = setting(
        None, c.optional_seconds, "seconds a task may run (none: no limit)"
    )
    redis_url: str | None = setting(
        None,
        c.optional_str("a redis://, rediss:// or unix:// URL, or 'none'", c.is_redis_url),
        "state store URL (none: embedded Redis on a private Unix socket)",
    )
    key_ttl: float = setting(600.0, c.seconds, "expiry backstop of shared-state keys, seconds")
    runtime_dir: Path = setting(
        None, c.path, "private directory for local sockets", factory=_places.default_runtime_dir
    )
    max_payload: int = setting(4 << 30, c.size, "largest payload accepted, bytes")
    inline_payload: int = setting(
        1 << 20,
        c.size_between(c.INLINE_MIN, c.INLINE_MAX),
        "payloads and results above this travel through the service's data store, bytes",
    )
    storage_dir: Path | None = setting(
        None,
        c.optional_path,
        "directory behind nimbus.multiprocessing.files (none: <runtime_dir>/files)",
    )
    endpoint: str | None = setting(
        None,
        c.optional_str("an endpoint name, or 'none'", bool),
        "default endpoint (none: the local runtime)",
    )
    environment: str | None = setting(
        None,
        c.optional_str("an environment name, its JSON spec, or 'none'", c.is_environment_spec),
        "environment of tasks: a name built with `nimbus environments build`, or "
        "nimbus.Environment's to_dict() as JSON (none: the workers' own Python)",
    )
    service_url: str | None = setting(
        None,
        c.optional_str("an http:// or https:// URL, or 'none'", c.is_http_url),
        "URL of the nimbus service",
    )
    token: str | None = setting(
        None,
        c.optional_str("a token given by `nimbus service token create`, or 'none'", bool),
        "bearer token for the service (none: the one saved by `nimbus login`)",
    )
    database_url: str | None = setting(
        None,
        c.optional_str(
            "an SQLAlchemy URL (sqlite:///..., postgresql://...), or 'none'", c.is_db_url
        ),
        "registry database of the service (none: SQLite in <runtime_dir>/service)",
    )
    result_ttl: float = setting(
        7 * 86400.0, c.seconds, "seconds the service keeps a finished task's result"
    )
    history_days: int = setting(
        30,
        c.int_at_least(0),
        "days the service keeps finished tasks in its SQL history (0: forever)",
    )
    heartbeat: float = setting(
        2.0, c.seconds, "seconds between endpoint heartbeats (lost after 3 missed)"
    )
    max_queued_tasks: int = setting(
        1_000_000,
        c.int_at_least(1),
        "on the service: tasks a user may have queued or running at once",
    )
    max_queued_bytes: int = setting(
        4 << 30,
        c.size,
        "on the service: inline payload bytes a user may have queued or running at once",
    )
    max_batch: int = setting(
        100_000, c.int_at_least(1), "on the service: tasks in one submit request"
    )
    log_level: str = setting("WARNING", c.log_level, "logging level of nimbus loggers")
    store_listen: str = setting(
        "127.0.0.1:0",
        c.host_port,
        "where the service's state-store Redis for endpoint programs listens, HOST:PORT",
    )
    ca_file: Path | None = setting(
        None,
        c.optional_pem_file,
        "CA certificates (PEM) that verify the service's TLS certificate, for HTTPS, WSS and "
        "its stores' rediss:// (none: the system's CAs)",
    )
    store_maxmemory: int = setting(
        1 << 30,
        c.size,
        "most bytes the service's state-store Redis holds, all users together (then writes fail)",
    )
    body_timeout: float = setting(
        30.0,
        c.seconds,
        "seconds the service waits for the next part of a request body before answering 408",
    )
    max_header_bytes: int = setting(
        64 << 10,
        c.size_between(1 << 10, 1 << 20),
        "largest request head (request line and headers) the service reads; larger: 431",
    )
    max_functions: int = setting(
        10_000,
        c.int_at_least(1),
        "on the service: functions a user may have registered at once (more: 429)",
    )
    max_endpoints: int = setting(
        1000,
        c.int_at_least(1),
        "on the service: endpoints a user may have registered at once (more: 429)",
    )
    service_admins: str | None = setting(
        None,
        c.optional_str("user names separated by commas, or 'none'", c.is_user_names),
        "on the service: users whose dashboard shows every endpoint and task (none: nobody)",
    )
    max_message: int = setting(
        32 << 20,
        c.size_between(16 << 20, 1 << 30),
        "on the service: largest WebSocket message it accepts from a client or agent, bytes "
        "(larger: the connection is closed with 1009)",
    )
    shared_memory: bool = setting(
        True,
        c.flag,
        "Values and Arrays of a program on this host in shared memory (0: in the state store)",
    )
    messaging_direct: bool = setting(
        True,
        c.flag,
        "messages between instances straight over sockets (0: all through the state store)",
    )
    messaging_host: str | None = setting(
        None,
        c.optional_str("an address of this host to listen on, or 'none'", bool),
        "address instances also listen on over TCP, for peers on other hosts (none: Unix only)",
    )
    messaging_host_id: str | None = setting(
        None,
        c.optional_str("a name for this host, or 'none'", bool),
        "this host's name in the messaging directory (none: host name and boot id)",
    )
    # -- environments: the software workers run in (nimbus.environments)
    environments_dir: Path | None = setting(
        None,
        c.optional_path,
        "where this node builds and caches environments (none: $XDG_CACHE_HOME/nimbus/"
        "environments, else ~/.cache/nimbus/environments)",
    )
    environments_max_size: int = setting(
        10 << 30,
        c.size,
        "most bytes of built environments kept on this node; the least recently used go first",
    )
    sandbox_memory: int = setting(
        4 << 30,
        c.size,
        "address space a sandboxed worker (bubblewrap or container) may map, bytes",
    )
    # -- providers: where an endpoint's (or the local runtime's) nodes come from
    provider: str = setting("local", c.name, "where nodes come from: local (this machine) or slurm")
    partition: str | None = setting(None, c.optional_text, "Slurm partition of blocks")
    account: str | None = setting(None, c.optional_text, "Slurm account charged for blocks")
    qos: str | None = setting(None, c.optional_text, "Slurm quality of service of blocks")
    nodes_per_block: int = setting(1, c.int_at_least(1), "nodes in one block")
    workers_per_node: int | None = setting(
        None, c.optional_int, "workers of a block's manager (none: its cores)"
    )
    min_blocks: int = setting(0, c.int_at_least(0), "blocks kept even when idle")
    max_blocks: int = setting(4, c.int_at_least(1), "most blocks at once")
    init_blocks: int = setting(0, c.int_at_least(0), "blocks asked for at start")
    parallelism: float = setting(
        1.0, c.fraction, "blocks per pending work: 1 = a worker per task, less"
    )
    walltime: str = setting("00:30:00", c.walltime, "walltime of a block, [D-]HH:MM:SS")
    max_idle: float = setting(
        120.0, c.seconds, "seconds a block may idle before it is drained, cancelled"
    )
    worker_init: str = setting("", c.text, "shell lines a block runs first")
    scheduler_options: str = setting("", c.text, "extra #SBATCH lines (one option a line)")
    exclusive: bool = setting(False, c.flag, "blocks ask for whole nodes")
    agent_listen: str = setting(
        "0.0.0.0:0", c.host_port, "HOST:PORT where the agent accepts block managers"
    )

    # -- per-worker network accounting and limits (issue 19; nimbus.network)
    net_accounting: str = setting(
        "auto",
        c.one_of("socket", "cgroup", "netns", "auto"),
        "what counts a task's network bytes: auto (the default: cgroup where this machine "
        "allows it, else socket), socket (Python sockets only), cgroup (eBPF on a "
        "cgroup per worker: every byte; root), netns (a namespace per worker: every byte, "
        "and a task's own bandwidth limits; root)",
    )
    worker_cpus: float | None = setting(
        None, c.optional_cpus, "CPUs a worker may use (cgroup quota; 0.5 = half a core)"
    )
    worker_memory: int | None = setting(
        None, c.optional_size, "memory a worker may use, bytes (cgroup limit; e.g. 512M)"
    )
    worker_bandwidth: int | None = setting(
        None,
        c.optional_bandwidth,
        "each way's bandwidth of a worker's link, bits/s (200Mbit or 25MB/s; implies netns)",
    )

    # -- files tasks may read and write (issue 21; nimbus.File)
    data_exports: str = setting(
        "",
        c.text,
        "directories an endpoint's files may be staged from and to (nimbus.File), "
        "separated by ':'; kept as `exports` in the endpoint's config",
    )
    data_host: str = setting(
        "127.0.0.1",
        c.text,
        "the address a node takes files and objects on, sent straight from another "
        "endpoint's node (nimbus.File, Refs); one the other endpoints reach",
    )
    data_direct: bool = setting(
        True,
        c.flag,
        "large objects put and read by the client straight to and from an endpoint's node, "
        "in clear (0: through the service, over its TLS where it has one)",
    )

    def __post_init__(self) -> None:
        for name, spec in FIELDS.items():
            value = getattr(self, name)
            object.__setattr__(self, name, coerce(spec, value, f"Settings.{name}"))

    # ------------------------------------------------------------ building

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, file: Path | None = None) -> Settings:
        """Defaults < TOML file < environment. ``env`` defaults to ``os.environ``.

        Without arguments, read once per process for as long as what they are made of
        stays the same (the ``NIMBUS_*`` variables, the few that say where the file is,
        the file's bytes): a process's many callers share one object (it is frozen),
        and a fork's children inherit it.
        """
        if env is None and file is None:
            return _loading.once(lambda: cls._load(os.environ, None))
        return cls._load(os.environ if env is None else env, file)

    @classmethod
    def _load(cls, env: Mapping[str, str], file: Path | None) -> Settings:
        values, sources = _loading.read(env, file, FIELDS)
        settings = cls(**values)  # type: ignore[arg-type]
        object.__setattr__(settings, "_sources", sources)
        return settings

    @classmethod
    def lookup(cls, name: str) -> Any:
        """One setting as :meth:`load` gives it, without reading them all: its variable in
        ``os.environ`` now if set, else the file's value or the default (read once).

        For the few settings read on hot paths, or changed by a process for its children.
        """
        spec = FIELDS[name]
        raw = os.environ.get(spec.env)
        if raw is not None:
            return coerce(spec, raw, spec.env)
        base = _base.get(name, _base)
        if base is _base:
            base_env = {
                k: v
                for k, v in os.environ.items()
                if k == CONFIG_ENV or not k.startswith("NIMBUS_")
            }
            loaded = cls.load(base_env)
            _base.update((n, getattr(loaded, n)) for n in FIELDS)
            base = _base[name]
        return base

    def replace(self, **changes: object) -> Settings:
        """A copy with ``changes`` applied and validated."""
        unknown = sorted(set(changes) - set(FIELDS))
        if unknown:
            raise ConfigError(
                f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(FIELDS)}"
            )
        new = dataclasses.replace(self, **changes)  # type: ignore[arg-type]
        sources = dict(self._source_map())
        sources.update(dict.fromkeys(changes, "argument"))
        object.__setattr__(new, "_sources", sources)
        return new

    # ------------------------------------------------------------ using

    @property
    def files_dir(self) -> Path:
        """Where ``nimbus.multiprocessing.files`` keeps shared files by default."""
        return self.storage_dir if self.storage_dir is not None else self.runtime_dir / "files"

    @property
    def environments_path(self) -> Path:
        """Where this node's environments are built: ``environments_dir`` or the user's cache."""
        if self.environments_dir is not None:
            return self.environments_dir
        xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
        base = Path(xdg) if xdg else Path.home() / ".cache"
        return base / "nimbus" / "environments"

    @property
    def service_dir(self) -> Path:
        """The service's own files: SQLite registry, data store, persistent Redis."""
        return self.runtime_dir / "service"

    @property
    def registry_url(self) -> str:
        """The service's registry database: ``database_url`` or SQLite in the runtime dir."""
        if self.database_url is not None:
            return self.database_url
        return f"sqlite:///{self.service_dir / 'registry.sqlite3'}"

    @property
    def store_address(self) -> tuple[str, int]:
        """``store_listen`` as (host, port); port 0 means any free port."""
        return c.split_host_port(self.store_listen)

    def ssl_context(self) -> ssl.SSLContext:
        """How this process verifies the service over TLS (HTTPS and WSS): the CAs of
        ``ca_file`` if set, else the system's; the host name is checked."""
        return ssl.create_default_context(
            cafile=None if self.ca_file is None else str(self.ca_file)
        )

    def ensure_runtime_dir(self) -> Path:
        """Create ``runtime_dir`` (mode 0o700) and check only this user can use it."""
        return _places.ensure_runtime_dir(self.runtime_dir)

    def configure_logging(self) -> None:
        """Set the level of the ``nimbus`` logger from ``log_level``."""
        logging.getLogger("nimbus").setLevel(self.log_level)

    def source(self, name: str) -> str:
        """Where a value came from: ``default``, ``file <path>``, ``env <VAR>`` or ``argument``."""
        if name not in FIELDS:
            raise KeyError(name)
        return self._source_map().get(name, "argument")

    def describe(self) -> dict[str, object]:
        """Every setting as plain JSON-able values, for ``nimbus info``."""
        return {
            name: str(value) if isinstance(value, Path) else value
            for name in FIELDS
            for value in (getattr(self, name),)
        }

    @staticmethod
    def env_var(name: str) -> str:
        """The environment variable of a setting."""
        return FIELDS[name].env

    @staticmethod
    def help(name: str) -> str:
        """A one-line meaning of a setting."""
        return FIELDS[name].help

    def _source_map(self) -> Mapping[str, str]:
        sources: Mapping[str, str] | None = self.__dict__.get("_sources")
        if sources is None:  # built directly, not by load()
            sources = {
                name: "default" if getattr(self, name) == _field_default(name) else "argument"
                for name in FIELDS
            }
        return sources


FIELDS: dict[str, Spec] = specs(Settings)
_base: dict[str, Any] = {}  # Settings.lookup's file values and defaults, read once


def _field_default(name: str) -> object:
    spec = Settings.__dataclass_fields__[name]
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return spec.default
