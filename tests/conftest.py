"""Shared pytest configuration for the nimbus tests (fixtures are added as needed)."""

from __future__ import annotations
