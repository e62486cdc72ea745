"""What the benchmarks here share: a row's figures, their format, the table, a time limit.

Each benchmark measures nimbus and a baseline (the stdlib, ProcessPoolExecutor, a
raw socket ...) in one run, their repeats alternating (baseline, nimbus, baseline,
nimbus, ...: :func:`alternate`) so that load drift hits both sides alike; a
:class:`Figures` holds both sides' repeats and says PASS or MISS by the row's
judge of the ratio nimbus / baseline, and nothing else: a verdict is never on an
absolute figure, which passes or fails with the machine's load and says nothing
of nimbus against what it replaces. A row without a judge ("report") shows "-".
"""

from __future__ import annotations

import signal
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Judge = Callable[[float], bool]  # the ratio nimbus / baseline (same run) -> pass


def alternate(repeat: int, sides: Mapping[str, Callable[[], float]]) -> dict[str, list[float]]:
    """``repeat`` figures of each side, measured in turn: A, B, A, B, ... (with more
    sides, A, B, C, A, B, C, ...), so that load drift hits every side alike."""
    out: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeat):
        for name, measure in sides.items():
            out[name].append(measure())
    return out


class Figures:
    """Repeats of one workload on both sides, and the verdict (a mixin for a row dataclass).

    The row declares ``title``, ``unit`` (see :func:`fmt`), ``higher_is_better``,
    ``target`` (words), ``judge`` of the ratio (None: reported, not judged), ``baseline`` and
    ``nimbus`` (lists of figures) and ``error``.
    """

    title: str
    unit: str
    higher_is_better: bool
    target: str
    judge: Judge | None
    baseline: list[float]
    nimbus: list[float]
    error: str

    @property
    def baseline_median(self) -> float | None:
        return statistics.median(self.baseline) if self.baseline else None

    @property
    def nimbus_median(self) -> float | None:
        return statistics.median(self.nimbus) if self.nimbus else None

    @property
    def ratio(self) -> float | None:
        base, nim = self.baseline_median, self.nimbus_median
        return nim / base if base and nim is not None else None

    @property
    def status(self) -> str:
        if self.error:
            return "ERROR"
        ratio = self.ratio
        if self.judge is None or ratio is None:
            return "-"
        return "PASS" if self.judge(ratio) else "MISS"

    @property
    def what(self) -> str:
        return f"{self.title} ({'higher' if self.higher_is_better else 'lower'} better)"

    def figure_cells(self) -> tuple[str, str, str, str, str]:
        """The table cells baseline, nimbus, ratio, target, result."""
        ratio = f"{self.ratio:.2f}x" if self.ratio is not None else "-"
        return (
            fmt(self.baseline_median, self.unit),
            fmt(self.nimbus_median, self.unit),
            ratio,
            self.target,
            self.status,
        )


def fmt(value: float | None, unit: str) -> str:
    """A figure in seconds (``s``, ``ms``, ``us``) or a rate (``.../s``), for the table."""
    if value is None:
        return "-"
    if unit == "us":
        return f"{value * 1e6:,.1f} us"
    if unit == "ms":  # two decimals below 10 ms: 3.0 ms hides whether it met "<= 3 ms"
        return f"{value * 1e3:,.{2 if value < 0.01 else 1}f} ms"
    if unit.endswith("/s"):
        return f"{value:,.0f}/s"
    return f"{value:.3f} s"


def grid(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, a rule under the header."""
    table = [tuple(header), *(tuple(line) for line in lines)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    out = []
    for i, row in enumerate(table):
        out.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


class WorkloadTimeout(Exception):
    pass


def _on_alarm(signum: int, frame: object) -> None:
    raise WorkloadTimeout("time limit reached (hang?)")


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """fn() in this (main) thread, interrupted by WorkloadTimeout after ``seconds``."""
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
