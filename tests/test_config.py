"""Tests of nimbus.config: defaults, environment, TOML file, precedence, errors."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from nimbus.config import Settings, private_dir
from nimbus.errors import ConfigError


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """An environment with no NIMBUS_* variables and a HOME without a config file."""
    return {"HOME": str(tmp_path / "home")}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ---------------------------------------------------------------- defaults


def test_defaults(env: dict[str, str]) -> None:
    s = Settings.load(env)
    assert s.workers == (os.cpu_count() or 1)
    assert s.prefetch == 8
    assert s.task_timeout is None
    assert s.redis_url is None
    assert s.key_ttl == 600.0
    assert s.runtime_dir == Path(f"/tmp/nimbus-{os.getuid()}")
    assert s.max_payload == 4 * 2**30
    assert s.endpoint is None
    assert s.service_url is None
    assert s.log_level == "WARNING"
    assert all(s.source(name) == "default" for name in s.describe())
    assert s == Settings(runtime_dir=s.runtime_dir)


def test_runtime_dir_follows_xdg_runtime_dir(env: dict[str, str], tmp_path: Path) -> None:
    env["XDG_RUNTIME_DIR"] = str(tmp_path / "run")
    assert Settings.load(env).runtime_dir == tmp_path / "run" / "nimbus"


def test_settings_are_frozen(env: dict[str, str]) -> None:
    s = Settings.load(env)
    with pytest.raises(AttributeError):
        s.workers = 3  # type: ignore[misc]


def test_describe_is_plain(env: dict[str, str]) -> None:
    d = Settings.load(env).describe()
    assert set(d) == {
        "max_queued_tasks",
        "max_queued_bytes",
        "max_batch",
        "workers",
        "prefetch",
        "task_timeout",
        "redis_url",
        "key_ttl",
        "runtime_dir",
        "max_payload",
        "inline_payload",
        "storage_dir",
        "environments_dir",
        "environments_max_size",
        "sandbox_memory",
        "endpoint",
        "environment",
        "service_url",
        "token",
        "database_url",
        "result_ttl",
        "history_days",
        "heartbeat",
        "log_level",
        "store_listen",
        "ca_file",
        "store_maxmemory",
        "body_timeout",
        "max_header_bytes",
        "max_functions",
        "max_endpoints",
        "service_admins",
        "max_message",
        "shared_memory",
        "messaging_direct",
        "messaging_host",
        "messaging_host_id",
        # providers (issue 17)
        "provider",
        "partition",
        "account",
        "qos",
        "nodes_per_block",
        "workers_per_node",
        "min_blocks",
        "max_blocks",
        "init_blocks",
        "parallelism",
        "walltime",
        "max_idle",
        "worker_init",
        "scheduler_options",
        "exclusive",
        "agent_listen",
        "net_accounting",
        "worker_cpus",
        "worker_memory",
        "worker_bandwidth",
        "data_exports",
        "data_host",
        "data_direct",
    }
    assert isinstance(d["runtime_dir"], str)


def test_provider_settings_from_the_environment(env: dict[str, str]) -> None:
    env |= {
        "NIMBUS_PROVIDER": "Slurm",
        "NIMBUS_PARTITION": "debug",
        "NIMBUS_NODES_PER_BLOCK": "2",
        "NIMBUS_MAX_BLOCKS": "4",
        "NIMBUS_PARALLELISM": "0.5",
        "NIMBUS_WALLTIME": "1-00:30:00",
        "NIMBUS_EXCLUSIVE": "yes",
        "NIMBUS_WORKER_INIT": "module load python",
    }
    s = Settings.load(env)
    assert (s.provider, s.partition, s.nodes_per_block, s.max_blocks) == ("slurm", "debug", 2, 4)
    assert (s.parallelism, s.walltime, s.exclusive) == (0.5, "1-00:30:00", True)
    assert s.worker_init == "module load python" and s.qos is None
    for name, bad, accepted in (
        ("NIMBUS_WALLTIME", "30m", "HH:MM:SS"),
        ("NIMBUS_PARALLELISM", "2", "<= 1"),
        ("NIMBUS_MIN_BLOCKS", "-1", ">= 0"),
        ("NIMBUS_EXCLUSIVE", "maybe", "1 or 0"),
    ):
        with pytest.raises(ConfigError, match=f"{name}.*{re.escape(accepted)}"):
            Settings.load({**env, name: bad})


# ---------------------------------------------------------------- environment


def test_environment_values(env: dict[str, str], tmp_path: Path) -> None:
    env |= {
        "NIMBUS_WORKERS": "3",
        "NIMBUS_PREFETCH": " 2 ",
        "NIMBUS_TASK_TIMEOUT": "1.5",
        "NIMBUS_REDIS_URL": "redis://localhost:6379/0",
        "NIMBUS_KEY_TTL": "30",
        "NIMBUS_RUNTIME_DIR": str(tmp_path / "rt"),
        "NIMBUS_MAX_PAYLOAD": "512M",
        "NIMBUS_ENDPOINT": "gpu-cluster",
        "NIMBUS_SERVICE_URL": "https://nimbus.example.org/api",
        "NIMBUS_LOG_LEVEL": "debug",
    }
    s = Settings.load(env)
    assert (s.workers, s.prefetch, s.task_timeout, s.key_ttl) == (3, 2, 1.5, 30.0)
    assert s.redis_url == "redis://localhost:6379/0"
    assert s.runtime_dir == tmp_path / "rt"
    assert s.max_payload == 512 * 2**20
    assert s.endpoint == "gpu-cluster"
    assert s.service_url == "https://nimbus.example.org/api"
    assert s.log_level == "DEBUG"
    assert s.source("workers") == "env NIMBUS_WORKERS"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1", 1), ("4096", 4096), ("2G", 2 << 30), ("2g", 2 << 30), ("1.5K", 1536),
     ("3MiB", 3 << 20), ("1 T", 1 << 40), ("10KB", 10 << 10)],
)  # fmt: skip
def test_max_payload_suffixes(env: dict[str, str], text: str, expected: int) -> None:
    env["NIMBUS_MAX_PAYLOAD"] = text
    assert Settings.load(env).max_payload == expected


@pytest.mark.parametrize("text", ["", "none", "None"])
def test_optional_values_accept_none(env: dict[str, str], text: str) -> None:
    env |= {"NIMBUS_TASK_TIMEOUT": text, "NIMBUS_REDIS_URL": text, "NIMBUS_ENDPOINT": text}
    s = Settings.load(env)
    assert (s.task_timeout, s.redis_url, s.endpoint) == (None, None, None)


@pytest.mark.parametrize(
    "url", ["redis://h", "rediss://user:pw@h:6380/2", "unix:///run/redis.sock", "unix:/r.sock"]
)
def test_redis_urls(env: dict[str, str], url: str) -> None:
    env["NIMBUS_REDIS_URL"] = url
    assert Settings.load(env).redis_url == url


BAD_ENV = [
    ("NIMBUS_WORKERS", "0"),
    ("NIMBUS_WORKERS", "-2"),
    ("NIMBUS_WORKERS", "many"),
    ("NIMBUS_WORKERS", "2.5"),
    ("NIMBUS_PREFETCH", "0"),
    ("NIMBUS_PREFETCH", "x"),
    ("NIMBUS_TASK_TIMEOUT", "0"),
    ("NIMBUS_TASK_TIMEOUT", "-1"),
    ("NIMBUS_TASK_TIMEOUT", "soon"),
    ("NIMBUS_TASK_TIMEOUT", "inf"),
    ("NIMBUS_REDIS_URL", "localhost:6379"),
    ("NIMBUS_REDIS_URL", "http://localhost"),
    ("NIMBUS_REDIS_URL", "redis://"),
    ("NIMBUS_KEY_TTL", "0"),
    ("NIMBUS_KEY_TTL", "nan"),
    ("NIMBUS_KEY_TTL", "ten"),
    ("NIMBUS_RUNTIME_DIR", ""),
    ("NIMBUS_MAX_PAYLOAD", "0"),
    ("NIMBUS_MAX_PAYLOAD", "12X"),
    ("NIMBUS_MAX_PAYLOAD", "-5M"),
    ("NIMBUS_ENVIRONMENTS_MAX_SIZE", "0"),
    ("NIMBUS_SANDBOX_MEMORY", "lots"),
    ("NIMBUS_INLINE_PAYLOAD", "1K"),  # below 64K
    ("NIMBUS_INLINE_PAYLOAD", "9M"),  # above 8M: a WebSocket message carries it
    ("NIMBUS_SERVICE_URL", "nimbus.example.org"),
    ("NIMBUS_SERVICE_URL", "ftp://example.org"),
    ("NIMBUS_LOG_LEVEL", "LOUD"),
    ("NIMBUS_STORE_LISTEN", "no-port"),
    ("NIMBUS_STORE_LISTEN", ":6390"),
    ("NIMBUS_STORE_LISTEN", "127.0.0.1:99999"),
    ("NIMBUS_STORE_MAXMEMORY", "0"),
    ("NIMBUS_STORE_MAXMEMORY", "lots"),
    ("NIMBUS_BODY_TIMEOUT", "0"),
    ("NIMBUS_BODY_TIMEOUT", "-1"),
    ("NIMBUS_MAX_HEADER_BYTES", "100"),
    ("NIMBUS_MAX_HEADER_BYTES", "2G"),
    ("NIMBUS_MAX_FUNCTIONS", "0"),
    ("NIMBUS_MAX_ENDPOINTS", "many"),
    ("NIMBUS_MAX_MESSAGE", "1M"),
    ("NIMBUS_MAX_MESSAGE", "2G"),
    ("NIMBUS_DATABASE_URL", "mysql://db/nimbus"),
    ("NIMBUS_RESULT_TTL", "0"),
    ("NIMBUS_HISTORY_DAYS", "-1"),
    ("NIMBUS_HISTORY_DAYS", "a month"),
    ("NIMBUS_HEARTBEAT", "soon"),
    ("NIMBUS_CA_FILE", "/nonexistent/ca.pem"),
    ("NIMBUS_CA_FILE", "/etc/hostname"),  # not PEM
    ("NIMBUS_TASK_TIMEOUT", "2592001"),
    ("NIMBUS_TASK_TIMEOUT", "inf"),
    ("NIMBUS_MAX_QUEUED_TASKS", "0"),
    ("NIMBUS_MAX_QUEUED_BYTES", "lots"),
    ("NIMBUS_MAX_BATCH", "-5"),
    ("NIMBUS_SHARED_MEMORY", "maybe"),
    ("NIMBUS_MESSAGING_DIRECT", "2"),
    ("NIMBUS_DATA_DIRECT", "maybe"),
    # providers (issue 17)
    ("NIMBUS_PROVIDER", "slurm cluster"),
    ("NIMBUS_NODES_PER_BLOCK", "0"),
    ("NIMBUS_WORKERS_PER_NODE", "0"),
    ("NIMBUS_MIN_BLOCKS", "-1"),
    ("NIMBUS_MAX_BLOCKS", "0"),
    ("NIMBUS_INIT_BLOCKS", "some"),
    ("NIMBUS_PARALLELISM", "1.5"),
    ("NIMBUS_WALLTIME", "30m"),
    ("NIMBUS_MAX_IDLE", "0"),
    ("NIMBUS_EXCLUSIVE", "maybe"),
    ("NIMBUS_AGENT_LISTEN", "no-port"),
    ("NIMBUS_NET_ACCOUNTING", "ebpf"),
    ("NIMBUS_WORKER_CPUS", "0"),
    ("NIMBUS_WORKER_MEMORY", "1M"),
    ("NIMBUS_WORKER_BANDWIDTH", "500M"),
    ("NIMBUS_SERVICE_ADMINS", "root,<b>"),
    # environments (issue 18)
    ("NIMBUS_ENVIRONMENT", '{"requirements": ["x"]}'),
    ("NIMBUS_ENVIRONMENT", "{not json"),
    ("NIMBUS_ENVIRONMENT", "x" * 65),
]


@pytest.mark.parametrize(("var", "value"), BAD_ENV)
def test_bad_environment_value(env: dict[str, str], var: str, value: str) -> None:
    env[var] = value
    with pytest.raises(ConfigError) as info:
        Settings.load(env)
    message = str(info.value)
    assert var in message
    assert repr(value) in message
    assert "expected" in message


def test_store_listen_splits_host_and_port(env: dict[str, str]) -> None:
    assert Settings.load(env).store_address == ("127.0.0.1", 0)
    env["NIMBUS_STORE_LISTEN"] = "[::1]:6390"
    assert Settings.load(env).store_address == ("::1", 6390)


def test_every_variable_has_a_bad_value() -> None:
    tested = {var for var, _ in BAD_ENV}
    known = {Settings.env_var(name) for name in Settings.load({"HOME": "/nonexistent"}).describe()}
    # any name is a valid endpoint, any path a storage directory, any string a token,
    # a partition, an account, a qos, shell lines or scheduler options
    assert known - tested == {
        "NIMBUS_ENDPOINT",
        "NIMBUS_STORAGE_DIR",
        "NIMBUS_ENVIRONMENTS_DIR",
        "NIMBUS_TOKEN",
        "NIMBUS_MESSAGING_HOST",  # any address: binding to it tells
        "NIMBUS_MESSAGING_HOST_ID",  # any name
        "NIMBUS_PARTITION",
        "NIMBUS_ACCOUNT",
        "NIMBUS_QOS",
        "NIMBUS_WORKER_INIT",
        "NIMBUS_SCHEDULER_OPTIONS",
        "NIMBUS_DATA_EXPORTS",  # any directories (a file outside them is refused)
        "NIMBUS_DATA_HOST",  # any address, as NIMBUS_MESSAGING_HOST
    }


def test_inline_payload_range(env: dict[str, str]) -> None:
    assert Settings.load(env).inline_payload == 1 << 20
    env["NIMBUS_INLINE_PAYLOAD"] = "256K"
    assert Settings.load(env).inline_payload == 256 << 10
    env["NIMBUS_INLINE_PAYLOAD"] = "16M"
    with pytest.raises(ConfigError, match="from 64K to 8M"):
        Settings.load(env)


def test_config_error_is_a_value_error(env: dict[str, str]) -> None:
    env["NIMBUS_WORKERS"] = "0"
    with pytest.raises(ValueError, match="an integer >= 1"):
        Settings.load(env)


# ---------------------------------------------------------------- TOML file


def test_toml_file_top_level(env: dict[str, str], tmp_path: Path) -> None:
    f = write(tmp_path / "c.toml", 'workers = 5\nmax_payload = "1G"\ntask_timeout = 7\n')
    s = Settings.load(env, file=f)
    assert (s.workers, s.max_payload, s.task_timeout) == (5, 1 << 30, 7.0)
    assert s.source("workers") == f"file {f}"
    assert s.source("prefetch") == "default"


def test_toml_file_nimbus_table(env: dict[str, str], tmp_path: Path) -> None:
    f = write(tmp_path / "c.toml", '[nimbus]\nprefetch = 3\nlog_level = "info"\nkey_ttl = 1.5\n')
    s = Settings.load(env, file=f)
    assert (s.prefetch, s.log_level, s.key_ttl) == (3, "INFO", 1.5)


def test_nimbus_config_variable_names_the_file(env: dict[str, str], tmp_path: Path) -> None:
    env["NIMBUS_CONFIG"] = str(write(tmp_path / "x.toml", "workers = 6\n"))
    assert Settings.load(env).workers == 6


def test_missing_nimbus_config_file(env: dict[str, str], tmp_path: Path) -> None:
    env["NIMBUS_CONFIG"] = str(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="NIMBUS_CONFIG"):
        Settings.load(env)


def test_default_file_in_home(env: dict[str, str]) -> None:
    write(Path(env["HOME"]) / ".config" / "nimbus" / "config.toml", "workers = 9\n")
    assert Settings.load(env).workers == 9


def test_default_file_in_xdg_config_home(env: dict[str, str], tmp_path: Path) -> None:
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    write(tmp_path / "xdg" / "nimbus" / "config.toml", "prefetch = 4\n")
    assert Settings.load(env).prefetch == 4


def test_precedence_defaults_file_environment(env: dict[str, str], tmp_path: Path) -> None:
    f = write(tmp_path / "c.toml", "workers = 5\nprefetch = 3\n")
    env["NIMBUS_WORKERS"] = "7"
    s = Settings.load(env, file=f)
    assert (s.workers, s.prefetch, s.key_ttl) == (7, 3, 600.0)
    assert s.source("workers") == "env NIMBUS_WORKERS"
    assert s.source("prefetch") == f"file {f}"
    assert s.source("key_ttl") == "default"


@pytest.mark.parametrize(
    ("text", "key", "needle"),
    [
        ("workers = 0\n", "workers", "an integer >= 1"),
        ('workers = "4x"\n', "workers", "an integer >= 1"),
        ("workers = true\n", "workers", "an integer >= 1"),
        ("workers = 2.0\n", "workers", "an integer >= 1"),
        ('key_ttl = "long"\n', "key_ttl", "seconds > 0"),
        ("task_timeout = -3\n", "task_timeout", "seconds > 0"),
        ("redis_url = 5\n", "redis_url", "redis://"),
        ("max_payload = 1.5\n", "max_payload", "suffix"),
        ("runtime_dir = 3\n", "runtime_dir", "directory path"),
        ("endpoint = []\n", "endpoint", "endpoint name"),
        ('log_level = "chatty"\n', "log_level", "WARNING"),
    ],
)
def test_bad_file_value(
    env: dict[str, str], tmp_path: Path, text: str, key: str, needle: str
) -> None:
    f = write(tmp_path / "c.toml", text)
    with pytest.raises(ConfigError) as info:
        Settings.load(env, file=f)
    message = str(info.value)
    assert str(f) in message
    assert repr(key) in message
    assert needle in message


def test_unknown_file_key(env: dict[str, str], tmp_path: Path) -> None:
    f = write(tmp_path / "c.toml", "[nimbus]\nzzz = 4\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) zzz; known keys: workers"):
        Settings.load(env, file=f)


def test_unknown_file_key_says_what_was_meant(env: dict[str, str], tmp_path: Path) -> None:
    f = write(tmp_path / "c.toml", "[nimbus]\nworker = 4\n")
    with pytest.raises(ConfigError) as info:
        Settings.load(env, file=f)
    assert str(info.value) == (
        f"config file {f}: unknown key(s) worker (did you mean 'workers'?)"
    )  # no list of every key when each one has its guess


def test_a_misspelled_nimbus_variable_is_warned_of_once(env: dict[str, str]) -> None:
    from nimbus.config import _loading

    _loading._warned.discard("NIMBUS_WORKRES")
    with pytest.warns(UserWarning, match="NIMBUS_WORKRES .* did you mean NIMBUS_WORKERS"):
        Settings.load({**env, "NIMBUS_WORKRES": "3"})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second load says nothing
        Settings.load({**env, "NIMBUS_WORKRES": "3"})
        Settings.load({**env, "NIMBUS_MESSAGING_TOKEN": "x", "NIMBUS_ZZZ_MINE": "1"})


def test_unknown_table(env: dict[str, str], tmp_path: Path) -> None:
    f = write(tmp_path / "c.toml", "[service]\nport = 1\n")
    with pytest.raises(ConfigError, match="service"):
        Settings.load(env, file=f)


def test_key_set_twice(env: dict[str, str], tmp_path: Path) -> None:
    f = write(tmp_path / "c.toml", "workers = 1\n[nimbus]\nworkers = 2\n")
    with pytest.raises(ConfigError, match="set twice"):
        Settings.load(env, file=f)


def test_invalid_toml(env: dict[str, str], tmp_path: Path) -> None:
    f = write(tmp_path / "c.toml", "workers = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        Settings.load(env, file=f)


# ---------------------------------------------------------------- replace


def test_replace_validates_and_converts(env: dict[str, str], tmp_path: Path) -> None:
    s = Settings.load(env)
    t = s.replace(workers=2, runtime_dir=str(tmp_path), max_payload="1M")
    assert (t.workers, t.runtime_dir, t.max_payload) == (2, tmp_path, 1 << 20)
    assert t.source("workers") == "argument"
    assert t.source("prefetch") == "default"
    assert s.workers != 2 or s.workers == t.workers  # s unchanged
    with pytest.raises(ConfigError, match=r"Settings\.workers=0"):
        s.replace(workers=0)
    with pytest.raises(ConfigError, match="unknown setting"):
        s.replace(wrokers=2)


def test_direct_construction_is_validated() -> None:
    with pytest.raises(ConfigError, match="prefetch"):
        Settings(prefetch=0)


# ---------------------------------------------------------------- runtime dir


def test_ensure_runtime_dir_creates_private_dir(tmp_path: Path) -> None:
    path = Settings(runtime_dir=tmp_path / "a" / "nimbus").ensure_runtime_dir()
    assert path == tmp_path / "a" / "nimbus"
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


def test_ensure_runtime_dir_fixes_open_permissions(tmp_path: Path) -> None:
    path = tmp_path / "open"
    path.mkdir(mode=0o777)
    path.chmod(0o755)
    Settings(runtime_dir=path).ensure_runtime_dir()
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


def test_ensure_runtime_dir_refuses_a_file(tmp_path: Path) -> None:
    write(tmp_path / "f", "")
    with pytest.raises(ConfigError, match="not a directory"):
        Settings(runtime_dir=tmp_path / "f").ensure_runtime_dir()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to chown a directory to another user")
def test_ensure_runtime_dir_refuses_another_users_dir(tmp_path: Path) -> None:
    path = tmp_path / "theirs"
    path.mkdir(mode=0o700)
    os.chown(path, 4321, 4321)
    with pytest.raises(ConfigError, match="owned by uid 4321"):
        Settings(runtime_dir=path).ensure_runtime_dir()
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


@pytest.mark.skipif(os.getuid() == 0, reason="root can create directories anywhere")
def test_ensure_runtime_dir_unwritable_parent(tmp_path: Path) -> None:
    parent = tmp_path / "ro"
    parent.mkdir(mode=0o500)
    try:
        with pytest.raises(ConfigError, match="cannot be created"):
            Settings(runtime_dir=parent / "nimbus").ensure_runtime_dir()
    finally:
        parent.chmod(0o700)


def test_private_dir_makes_checks_and_names_the_fix(tmp_path: Path) -> None:
    path = private_dir(tmp_path / "a" / "b", "thing directory", "do X")
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert private_dir(path, "thing directory", "do X") == path  # already there: fine
    path.chmod(0o750)
    with pytest.raises(ConfigError, match=r"thing directory .* mode 0700; do X"):
        private_dir(path, "thing directory", "do X")
    write(tmp_path / "f", "")
    with pytest.raises(ConfigError, match=r"cannot be created .*; do Y"):
        private_dir(tmp_path / "f", "thing directory", "do Y")
    if os.getuid() == 0:
        os.chown(path, 4321, 4321)
        path.chmod(0o700)
        with pytest.raises(ConfigError, match="must belong to you"):
            private_dir(path, "thing directory", "do X")


# ---------------------------------------------------------------- one declaration


def test_readme_table_lists_every_setting_once() -> None:
    """The README's configuration table: one row per setting, with its variable."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    table = readme.split("## Configuration", 1)[1].split("\n\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| `")]
    listed = [(name.strip().strip("`"), env.strip().strip("`")) for name, env in rows]
    fields = Settings.load({"HOME": "/nonexistent"}).describe()
    assert len(set(listed)) == len(listed)
    assert sorted(listed) == sorted((name, Settings.env_var(name)) for name in fields)


def test_every_variable_is_its_name_in_capitals() -> None:
    for name in Settings.load({"HOME": "/nonexistent"}).describe():
        assert Settings.env_var(name) == "NIMBUS_" + name.upper()
        assert Settings.help(name)


@pytest.mark.parametrize("word", ["0", "false", "No", " off "])
def test_on_off_settings_read_words(env: dict[str, str], word: str) -> None:
    assert Settings.load(env).shared_memory is True
    env["NIMBUS_SHARED_MEMORY"] = word
    assert Settings.load(env).shared_memory is False


def test_lookup_reads_the_environment_now(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("NIMBUS_MESSAGING_DIRECT", raising=False)
    assert Settings.lookup("messaging_direct") is True
    monkeypatch.setenv("NIMBUS_MESSAGING_DIRECT", "0")
    assert Settings.lookup("messaging_direct") is False
    monkeypatch.setenv("NIMBUS_MESSAGING_DIRECT", "sometimes")
    with pytest.raises(ConfigError, match="NIMBUS_MESSAGING_DIRECT='sometimes'"):
        Settings.lookup("messaging_direct")
    monkeypatch.delenv("NIMBUS_MESSAGING_DIRECT")
    assert Settings.lookup("messaging_direct") is True


def test_no_module_reads_a_nimbus_variable_but_config() -> None:
    """Every NIMBUS_* variable is a setting, read through Settings. The variables that
    are not settings are hand-overs to a process nimbus starts: the messaging token, and
    a Slurm block's agent address, secret and block id (``nimbus.runtime.node``), and the
    node's import path a virtualenv's worker appends (``nimbus.environments._venv``);
    writing a setting's variable for a child (``nimbus run --endpoint``) is no read."""
    import re

    src = Path(__file__).parent.parent / "src" / "nimbus"
    handed = "MESSAGING_TOKEN|AGENT_ADDRESS|AGENT_SECRET|BLOCK_ID|NODE_PATH"
    reads = re.compile(
        rf"(?:environ\.get|getenv|environ\[)\(?\s*[\"']NIMBUS_(?!(?:{handed})[\"'])\w+[\"']\]?+(?!\s*=[^=])"
    )
    readers = [
        str(path.relative_to(src))
        for path in src.rglob("*.py")
        if path.parent.name != "config" and reads.search(path.read_text())
    ]
    assert readers == []


def test_the_namespace_imports_each_name_from_its_module_on_first_use() -> None:
    import subprocess
    import sys

    import nimbus.config

    assert set(nimbus.config.__all__) <= set(dir(nimbus.config))
    for name in nimbus.config.__all__:
        assert getattr(nimbus.config, name) is not None
    with pytest.raises(AttributeError, match="no_such_name"):
        nimbus.config.no_such_name  # noqa: B018
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "def new(*names): return [n for n in names if n in set(sys.modules) - before]\n"
        "import os\n"
        "from nimbus.config import default_config_path\n"
        "default_config_path(os.environ)\n"
        "print(sorted(new('nimbus.config', 'nimbus.config._places', 'nimbus.config._settings')),"
        " new('pathlib', 'nimbus.errors'))\n"
        "from nimbus.config import Settings\n"
        "Settings.load({})\n"
        "print(new('ssl', 'tomllib', 'logging'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == ["['nimbus.config', 'nimbus.config._places'] []", "[]"]


# ---------------------------------------------------------------- read once per process


def test_settings_load_reads_once_until_what_it_is_made_of_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process's callers of ``Settings.load()`` share one object, made again when a
    NIMBUS_* variable, the config file's place or its bytes change (same size too)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.delenv("NIMBUS_CONFIG", raising=False)
    monkeypatch.delenv("NIMBUS_PREFETCH", raising=False)
    monkeypatch.delenv("NIMBUS_WORKERS", raising=False)
    first = Settings.load()
    assert Settings.load() is first
    monkeypatch.setenv("NIMBUS_PREFETCH", "3")
    changed = Settings.load()
    assert changed is not first and changed.prefetch == 3
    assert Settings.load() is changed
    file = write(tmp_path / "home" / ".config" / "nimbus" / "config.toml", "workers = 2\n")
    assert Settings.load().workers == 2
    file.write_text("workers = 3\n")  # the same size, maybe the same mtime
    assert Settings.load().workers == 3
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert Settings.load().workers == (os.cpu_count() or 1)
    monkeypatch.setenv("NIMBUS_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match=r"missing\.toml"):
        Settings.load()
