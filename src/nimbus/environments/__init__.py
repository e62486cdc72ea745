"""Environments: the software a worker runs in (see ``_spec``)."""

from __future__ import annotations

from nimbus.environments._spec import PLAIN, Environment

__all__ = ["PLAIN", "Environment"]
