"""Coercers: a value from the environment (a str), a TOML file or Python, to its type.

Each coercer returns the typed value or raises :class:`Bad` with what is
accepted; ``Settings`` turns that into a ``ConfigError`` naming the variable or
key and the value. The bounds every entry shares (``MAX_TIMEOUT``, the inline
payload range) and :func:`check_timeout` live here too.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from nimbus._lazy import lazy
from nimbus.errors import ConfigError

TYPE_CHECKING = False
if TYPE_CHECKING:
    import json
    import ssl
else:  # imported when a CA file is checked (ssl is most of what importing nimbus.config cost)
    ssl = lazy("ssl", globals())
    json = lazy("json", globals())  # when an environment's JSON spec is checked

__all__ = [
    "INLINE_MAX",
    "INLINE_MIN",
    "MAX_TIMEOUT",
    "Bad",
    "check_timeout",
    "flag",
    "host_port",
    "int_at_least",
    "is_db_url",
    "is_environment_spec",
    "is_http_url",
    "is_redis_url",
    "log_level",
    "optional_path",
    "optional_pem_file",
    "optional_seconds",
    "optional_str",
    "optional_text",
    "path",
    "seconds",
    "size",
    "size_between",
    "split_host_port",
]

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = (
    r"(?i)^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$"  # compiled on first use (re caches it)
)
_NONE_WORDS = ("", "none", "null")
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")
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


class Bad(Exception):
    """Raised by a coercer; its message says what is accepted."""


def int_at_least(low: int) -> Callable[[object], int]:
    accepted = f"an integer >= {low}"

    def coerce(value: object) -> int:
        if isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError:
                raise Bad(accepted) from None
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise Bad(accepted)
        return value

    return coerce


def flag(value: object) -> bool:
    """On or off: a bool, or 1/0, true/false, yes/no, on/off."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
    raise Bad("1 or 0 (also true/false, yes/no, on/off)")


def seconds(value: object) -> float:
    accepted = "a number of seconds > 0"
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise Bad(accepted) from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Bad(accepted)
    if not math.isfinite(value) or value <= 0:
        raise Bad(accepted)
    return float(value)


def optional_seconds(value: object) -> float | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_WORDS):
        return None
    accepted = f"a number of seconds > 0 and <= {MAX_TIMEOUT}, or 'none' for no timeout"
    try:
        result = seconds(value)
    except Bad:
        raise Bad(accepted) from None
    if result > MAX_TIMEOUT:
        raise Bad(accepted)
    return result


def size(value: object) -> int:
    accepted = "a number of bytes >= 1, optionally with a suffix K, M, G or T (e.g. 512M, 2G)"
    if isinstance(value, str):
        match = re.match(_SIZE_RE, value)
        if not match:
            raise Bad(accepted)
        value = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Bad(accepted)
    return value


def size_between(low: int, high: int) -> Callable[[object], int]:
    def coerce(value: object) -> int:
        result = size(value)
        if not low <= result <= high:
            raise Bad(f"a number of bytes from {low >> 10}K to {high >> 20}M (e.g. 256K, 1M)")
        return result

    return coerce


def optional_str(accepted: str, check: Callable[[str], bool]) -> Callable[[object], str | None]:
    def coerce(value: object) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str):
            raise Bad(accepted)
        value = value.strip()
        if value.lower() in _NONE_WORDS:
            return None
        if not check(value):
            raise Bad(accepted)
        return value

    return coerce


optional_text = optional_str("a string, or 'none'", lambda _: True)


def is_environment_spec(value: str) -> bool:
    """A name of 1-64 characters, or a JSON object with a name (``Environment.to_dict()``)."""
    if value.startswith("{"):
        try:
            spec = json.loads(value)
        except ValueError:
            return False
        return isinstance(spec, dict) and isinstance(spec.get("name"), str)
    return 0 < len(value) <= 64 and value.isprintable() and " " not in value


def is_redis_url(url: str) -> bool:
    parts = urlsplit(url)
    if parts.scheme in ("redis", "rediss"):
        return bool(parts.hostname)
    return parts.scheme == "unix" and bool(parts.path)


def is_http_url(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def is_user_names(text: str) -> bool:
    """Whether ``text`` is user names (as the service accepts them) separated by commas."""
    names = [name.strip() for name in text.split(",")]
    return all(re.fullmatch(r"[A-Za-z0-9_.@-]{1,200}", name) for name in names)


def is_db_url(url: str) -> bool:
    scheme = urlsplit(url).scheme
    return scheme.split("+")[0] in ("sqlite", "postgresql", "postgres")


def host_port(value: object) -> str:
    accepted = "HOST:PORT, e.g. 127.0.0.1:0 (port 0: any free port) or [::1]:6390"
    if not isinstance(value, str):
        raise Bad(accepted)
    try:
        split_host_port(value.strip())
    except ValueError:
        raise Bad(accepted) from None
    return value.strip()


def split_host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535 or not host:
        raise ValueError(text)
    return host.removeprefix("[").removesuffix("]"), int(port)


def path(value: object) -> Path:
    if isinstance(value, str) and value.strip():
        value = Path(value.strip())
    if not isinstance(value, Path):
        raise Bad("a directory path")
    return value.expanduser().absolute()


def optional_path(value: object) -> Path | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_WORDS):
        return None
    return path(value)


def optional_pem_file(value: object) -> Path | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_WORDS):
        return None
    accepted = "a readable PEM file of CA certificates, or 'none' for the system's CAs"
    file = path(value) if isinstance(value, str | Path) else None
    if file is None or not file.is_file() or not os.access(file, os.R_OK):
        raise Bad(accepted)
    try:
        ssl.create_default_context(cafile=str(file))
    except (ssl.SSLError, OSError, ValueError):
        raise Bad(accepted) from None
    return file


def log_level(value: object) -> str:
    accepted = "one of " + ", ".join(_LOG_LEVELS)
    if not isinstance(value, str) or value.strip().upper() not in _LOG_LEVELS:
        raise Bad(accepted)
    return value.strip().upper()


def text(value: object) -> str:
    if not isinstance(value, str):
        raise Bad("a string")
    return value


def name(value: object) -> str:
    accepted = "a name of letters, digits, - and _ (e.g. local, slurm)"
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", value.strip()):
        raise Bad(accepted)
    return value.strip().lower()


def optional_int(value: object) -> int | None:
    """An integer >= 1, or none."""
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_WORDS):
        return None
    try:
        return int_at_least(1)(value)
    except Bad:
        raise Bad("an integer >= 1, or 'none'") from None


def fraction(value: object) -> float:
    accepted = "a number > 0 and <= 1"
    try:
        number = seconds(value)
    except Bad:
        raise Bad(accepted) from None
    if number > 1:
        raise Bad(accepted)
    return number


def walltime(value: object) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"(\d+-)?\d+:\d{1,2}:\d{1,2}", value.strip()):
        raise Bad("[D-]HH:MM:SS, e.g. 00:30:00")
    return value.strip()


# -- worker limits (issue 19): strict units, a kubernetes bug once read 500M as 500 kbit
_RATE_RE = r"(?i)^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps|b/s|ib/s)?\s*$"  # compiled on first use
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
MIN_RATE = 8_000  # bits/s: below this tc cannot hold a rate
MAX_RATE = 400 * 10**9


def bandwidth(value: object) -> int:
    """A rate in bits per second from ``200Mbit``, ``1Gbit``, ``25MB/s`` or ``2MiB/s``.

    A Python int is bits/s. A string without its unit (``500M``, ``500``) is refused: bytes or bits is the question
    a wrong answer costs a factor of 8 (or 1000) on.
    """
    accepted = "a rate with its unit: bits as 200Mbit / 1Gbit (also Mbps), bytes as 25MB/s / 2MiB/s"
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise Bad(accepted)
    if isinstance(value, int):  # from Python (or a value already checked): bits/s
        value = f"{value}bit"
    text = value.strip()
    match = re.match(_RATE_RE, text)
    if not match or not match.group(3):
        hint = ""
        if match:
            hint = f" ({text!r} has no unit: say {text}bit for bits/s or {text}B/s for bytes/s)"
        raise Bad(accepted + hint)
    number, prefix, unit = float(match.group(1)), match.group(2), match.group(3).lower()
    if unit in ("bit", "bps"):
        rate = number * _DECIMAL[prefix.lower()]
    elif unit == "b/s":
        if text[-3] != "B":  # 25Mb/s: lower-case b is bits, but say it plainly
            raise Bad(accepted + f" ({text!r}: write Mbit for bits or MB/s for bytes)")
        rate = number * _DECIMAL[prefix.lower()] * 8
    else:  # iB/s
        rate = number * _BINARY[prefix.lower()] * 8
    if not MIN_RATE <= rate <= MAX_RATE:
        raise Bad(f"a rate from 8kbit to 400Gbit ({text!r} is {rate:.0f} bit/s)")
    return int(rate)


def optional_bandwidth(value: object) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_WORDS):
        return None
    return bandwidth(value)


def optional_size(value: object) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_WORDS):
        return None
    result = size(value)
    if result < 16 << 20:
        raise Bad("a memory size of at least 16M (e.g. 512M, 2G), or 'none'")
    return result


def optional_cpus(value: object) -> float | None:
    """A share of CPUs > 0 (0.5 is half a core), or none."""
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_WORDS):
        return None
    accepted = "a number of CPUs > 0 and <= 1024 (0.5: half a core), or 'none'"
    try:
        number = seconds(value)
    except Bad:
        raise Bad(accepted) from None
    if number > 1024 or number < 0.01:
        raise Bad(accepted)
    return number


def one_of(*choices: str) -> Callable[[object], str]:
    def coerce(value: object) -> str:
        if isinstance(value, str) and value.strip().lower() in choices:
            return value.strip().lower()
        raise Bad("one of " + ", ".join(choices))

    return coerce


def parse_bandwidth(text: str, what: str = "bandwidth") -> int:
    """``bandwidth`` for callers outside config: a ConfigError naming ``what``."""
    try:
        return bandwidth(text)
    except Bad as exc:
        raise ConfigError(f"{what} {text!r}: expected {exc}") from None


# the names of endpoints and environments (they become directory names)
NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,200}$")
NAME_RULE = "letters, digits, '_', '.', '@' or '-'"
