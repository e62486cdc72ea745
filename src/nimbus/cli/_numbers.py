"""One argparse type for every bounded number the commands take.

``number(int, 0, 65535, "a port")`` parses an argument, checks it lies in the
closed range (``high=None``: no upper bound; ``above=True``: strictly above
``low``) and otherwise raises :class:`argparse.ArgumentTypeError` with one line
naming what was given and what is accepted.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

__all__ = ["number"]

N = TypeVar("N", int, float)


def number(
    kind: Callable[[str], N],
    low: N,
    high: N | None = None,
    what: str = "",
    *,
    above: bool = False,
) -> Callable[[str], N]:
    """An argparse ``type=`` for a ``kind`` (int or float) from ``low`` to ``high``."""
    noun = "an integer" if kind is int else "a number"
    if high is not None:
        bounds = f"from {low:g} to {high:g}"
    else:
        bounds = f"> {low:g}" if above else f">= {low:g}"
    accepted = f"{what or noun} {bounds}"

    def parse(text: str) -> N:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}") from None
        ok = (
            not (isinstance(value, float) and not math.isfinite(value))
            and (value > low if above else value >= low)
            and (high is None or value <= high)
        )
        if not ok:
            raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}")
        return value

    parse.__name__ = getattr(kind, "__name__", "number")  # argparse names it in errors
    return parse
