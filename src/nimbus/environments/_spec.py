"""What an environment is: a named, hashed description of a worker's software.

An :class:`Environment` says what a worker runs in: extra Python packages (a
virtualenv built on the node), a container image, a bubblewrap sandbox, or a
composition of these. Two specs with the same content have the same
:attr:`Environment.key`, whatever their names, so a node builds each once and
caches it by that key. The spec is a plain frozen value: it pickles, and
:meth:`Environment.to_dict` / :meth:`Environment.from_dict` carry it in JSON.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from nimbus.config import NAME, NAME_RULE
from nimbus.errors import ConfigError

__all__ = ["PLAIN", "Environment", "as_environment"]


# a requirement's project name, its extras, and what may follow them (PEP 508): a version
# specifier, a marker, a direct reference ("@ URL") or a parenthesised specifier
_NAMED = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?\s*(?:\[[^\]]*\])?\s*(.*)", re.S)


def _check_requirement(name: str, req: str) -> None:
    """Refuse a requirement that starts with a project name followed by something no
    installer accepts (``'not a req ==='``), before any build; paths and URLs pass."""
    named = _NAMED.fullmatch(req)
    if named is None or "://" in req:
        return  # a path, a URL, an option: the installer judges it
    rest = named[1]
    if rest and rest[0] not in "<>=!~;@(":
        raise ConfigError(
            f"environment {name!r}: {req!r} is not a requirement: a project name, then "
            f"optionally [extras], a version such as '==1.0' or '>=2', '; marker' or "
            f"'@ URL' (e.g. 'numpy==2.1.0')"
        )


@dataclass(frozen=True)
class Environment:
    """A worker's software: ``Environment("geo", requirements=["shapely"])``.

    ``requirements`` are pip requirement strings installed into a virtualenv
    made with the node's Python; ``wheelhouse`` is a directory of wheels to
    install from instead of the package index; ``image`` is a container image
    (podman) the worker runs in; ``sandbox`` runs the worker under bubblewrap
    (no network, read-only system, private ``/tmp``). An environment with none
    of these is the node's own Python: a name only, still a worker type.
    """

    name: str
    requirements: tuple[str, ...] = field(default=())
    wheelhouse: str | None = None
    image: str | None = None
    sandbox: bool = False

    def __post_init__(self) -> None:
        # the rule of endpoint names, at most 64 characters
        if not isinstance(self.name, str) or not NAME.match(self.name) or len(self.name) > 64:
            raise ConfigError(
                f"environment name {self.name!r}: use 1-64 characters, {NAME_RULE} "
                f"(as endpoint names), e.g. 'geo-1.2'"
            )
        if not isinstance(self.sandbox, bool):
            raise TypeError(
                f"environment {self.name!r}: sandbox must be True or False, not {self.sandbox!r}"
            )
        reqs = self.requirements
        if isinstance(reqs, str):
            reqs = (reqs,)
        reqs = tuple(reqs)
        bad = [r for r in reqs if not isinstance(r, str) or not r.strip()]
        if bad:
            raise ConfigError(
                f"environment {self.name!r}: requirements must be non-empty strings such as "
                f"'numpy==2.1.0', got {bad[0]!r}"
            )
        object.__setattr__(self, "requirements", tuple(r.strip() for r in reqs))
        for req in self.requirements:
            _check_requirement(self.name, req)
        if self.image is not None and (not isinstance(self.image, str) or not self.image):
            raise ConfigError(
                f"environment {self.name!r}: image must be a name such as 'localhost/x:1'"
            )
        if self.wheelhouse is not None:
            if not isinstance(self.wheelhouse, str) or not self.wheelhouse:
                raise ConfigError(
                    f"environment {self.name!r}: wheelhouse must be a directory of wheels "
                    f"(a path as a string), got {self.wheelhouse!r}"
                )
            if not self.requirements:
                raise ConfigError(
                    f"environment {self.name!r}: wheelhouse={self.wheelhouse!r} without "
                    f"requirements installs nothing; name the packages to install from it, "
                    f"e.g. requirements=['six']"
                )

    @property
    def plain(self) -> bool:
        """True when workers of this environment are the node's own Python."""
        return not (self.requirements or self.image or self.sandbox)

    @property
    def key(self) -> str:
        """The hash of the content (not the name): the cache key on a node."""
        content = {k: v for k, v in self.to_dict().items() if k != "name"}
        blob = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "requirements": list(self.requirements),
            "wheelhouse": self.wheelhouse,
            "image": self.image,
            "sandbox": self.sandbox,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Environment:
        try:
            return cls(
                data["name"],
                requirements=tuple(data.get("requirements") or ()),
                wheelhouse=data.get("wheelhouse"),
                image=data.get("image"),
                sandbox=data.get("sandbox", False),
            )
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"not an environment description: {data!r} ({exc})") from None


PLAIN = Environment("plain")
"""Workers with the node's own Python and nothing more: today's workers."""


def as_environment(value: object) -> Environment | None:
    """``value`` if it is None or an :class:`Environment`: what a call's ``environment=``
    takes (client and executor alike); ConfigError naming what to pass otherwise."""
    if value is None or isinstance(value, Environment):
        return value
    raise ConfigError(
        f"environment must be a nimbus.Environment such as Environment('geo', "
        f"requirements=['shapely']), not {type(value).__name__} {value!r:.80}"
    )
