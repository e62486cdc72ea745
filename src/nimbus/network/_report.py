"""A netbench's results: ``netbench.csv``, ``netbench.json``, PNG charts, ``netbench.html``.

The CSV has one row per task of each run; the JSON has the summary per
direction and concurrency (aggregate, per-task mean / min / max, the share a
fair link would give, and the recommendation: the concurrency per host past
which each task gets less than ``share`` of the link) and, from ``--endpoint
--sizes``, the worker-size sweep (``_sizes``: ``netbench-sizes.csv``, a chart of
seconds per object and cost per million tasks against size) and its grid of
size x concurrency (``_grid``: ``netbench-grid.csv`` with a row per task, a chart
of per-task and aggregate rates against concurrency with a line per size, and
per size the concurrency past which each task gets less than ``share``). Charts need
matplotlib (``pip install nimbus[netbench]``); without it the CSV, JSON and an
HTML page without pictures are still written, and the page says why.
"""

from __future__ import annotations

import csv
import html
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nimbus.network._bench import Point

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["summarize", "write"]

PAYLOAD = 1448 / 1514  # TCP payload per byte on an Ethernet link of MTU 1500 (timestamps)


def summarize(points: list[Point], cap: int, share: float = 0.25) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for direction in sorted({p.direction for p in points}):
        for n in sorted({p.concurrency for p in points if p.direction == direction}):
            run = [p for p in points if p.direction == direction and p.concurrency == n]
            rates = [p.mbit for p in run]
            total = sum(rates)
            fair = cap * PAYLOAD / 1e6 / n
            rows.append(
                {
                    "direction": direction,
                    "concurrency": n,
                    "aggregate_mbit": round(total, 1),
                    "per_task_mean_mbit": round(total / n, 1),
                    "per_task_min_mbit": round(min(rates), 1),
                    "per_task_max_mbit": round(max(rates), 1),
                    "fair_share_mbit": round(fair, 1),
                    "worst_vs_fair": round(min(rates) / fair - 1, 4),
                    "aggregate_vs_payload_cap": round(total / (cap * PAYLOAD / 1e6) - 1, 4),
                    "link_vs_client_bytes": round(
                        sum(p.link_bytes for p in run) / max(1, sum(p.bytes for p in run)) - 1, 6
                    ),
                }
            )
    limit: dict[str, int] = {}
    for row in rows:
        if row["per_task_mean_mbit"] >= share * cap / 1e6:
            limit[row["direction"]] = max(limit.get(row["direction"], 0), row["concurrency"])
    return {
        "cap_mbit": cap / 1e6,
        "payload_cap_mbit": round(cap * PAYLOAD / 1e6, 1),
        "runs": rows,
        "recommendation": {
            "share": share,
            "most_tasks_per_host_each_getting_share": limit,
        },
    }


def _charts(summary: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for direction in sorted({r["direction"] for r in summary["runs"]}):
        rows = [r for r in summary["runs"] if r["direction"] == direction]
        n = [r["concurrency"] for r in rows]
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        ax.plot(n, [r["aggregate_mbit"] for r in rows], "o-", label="aggregate")
        ax.plot(n, [r["per_task_mean_mbit"] for r in rows], "s-", label="per task (mean)")
        ax.fill_between(
            n,
            [r["per_task_min_mbit"] for r in rows],
            [r["per_task_max_mbit"] for r in rows],
            alpha=0.25,
            label="per task (min-max)",
        )
        ax.plot(n, [r["fair_share_mbit"] for r in rows], "k:", label="cap / n")
        ax.axhline(summary["cap_mbit"], color="grey", linestyle="--", label="host link cap")
        ax.set_xscale("log", base=2)
        ax.set_xticks(n, [str(x) for x in n])
        ax.set_xlabel("tasks on the host at once")
        ax.set_ylabel("Mbit/s")
        ax.set_title(f"{direction}load bandwidth vs co-location")
        ax.legend()
        ax.grid(alpha=0.3)
        name = f"netbench-{direction}.png"
        fig.savefig(out / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        made.append(name)
    return made


def _size_chart(sizes: dict[str, Any], out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sizes["points"]
    mib = [r["memory"] >> 20 for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for way, mark, color in (("down", "o-", "C0"), ("up", "s-", "C1")):
        left.plot(mib, [r[f"{way}_median_s"] * 1e3 for r in rows], mark, color=color,
                  label=f"{way} (median)")  # fmt: skip
        left.plot(mib, [r[f"{way}_p95_s"] * 1e3 for r in rows], ":", color=color,
                  label=f"{way} (p95)")  # fmt: skip
        right.plot(mib, [r[f"cost_per_million_{way}"] for r in rows], mark, color=color, label=way)
    size_mib = rows[0]["object_size"] >> 20
    left.set_title(f"time per {size_mib} MiB object vs worker size")
    left.set_ylabel("ms")
    right.set_title("cost per million tasks (one object each)")
    right.set_ylabel("USD")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(mib, [str(m) for m in mib])
        ax.set_xlabel("worker memory (MiB; CPU in proportion)")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.savefig(out / "netbench-sizes.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return "netbench-sizes.png"


def _grid_chart(grid: dict[str, Any], out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in grid["cells"] if not c["not_run"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, direction in zip(axes, ("down", "up"), strict=True):
        for i, memory in enumerate(sorted({c["memory"] for c in cells})):
            run = [c for c in cells if (c["memory"], c["direction"]) == (memory, direction)]
            n = [c["concurrency"] for c in run]
            ax.plot(n, [c["per_task_mean_mbit"] for c in run], "o-", color=f"C{i}",
                    label=f"{memory >> 20}M per task")  # fmt: skip
            ax.plot(n, [c["aggregate_mbit"] for c in run], "--", color=f"C{i}",
                    label=f"{memory >> 20}M aggregate")  # fmt: skip
        share = grid["recommendation"]
        ax.axhline(share["share"] * share["cap_mbit"], color="grey", linestyle=":",
                   label=f"{share['share']:g} of the link")  # fmt: skip
        levels = sorted({c["concurrency"] for c in cells})
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(x) for x in levels])
        ax.set_xlabel("tasks on the host at once")
        ax.set_title(f"objects {direction}: bandwidth vs worker size and co-location")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("Mbit/s")
    axes[1].legend(fontsize="small")
    fig.savefig(out / "netbench-grid.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return "netbench-grid.png"


def _table(rows: list[dict[str, Any]]) -> str:
    head = list(rows[0])
    return (
        "<table><tr>"
        + "".join(f"<th>{html.escape(k)}</th>" for k in head)
        + "</tr>"
        + "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(r[k]))}</td>" for k in head) + "</tr>"
            for r in rows
        )
        + "</table>"
    )


def _rows_and_chart(
    rows: list[dict[str, Any]], out: Path, name: str, chart: Callable[[], str] | None
) -> tuple[list[Path], str]:
    """``rows`` written to ``out/<name>.csv`` and, with ``chart`` (and rows to draw),
    its chart drawn: the files made and the page's picture ("" without one)."""
    with open(out / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["memory"])
        w.writeheader()
        w.writerows(rows)
    made = [out / f"{name}.csv"]
    picture = ""
    if chart is not None and rows:
        made.append(out / chart())
        picture = f'<p><img src="{name}.png" alt="{name}.png"></p>'
    return made, picture


def _grid(grid: dict[str, Any], out: Path, charts: bool) -> tuple[list[Path], str]:
    """The size x concurrency grid's CSV (a row per task) and chart; its part of the page."""
    drawn = (lambda: _grid_chart(grid, out)) if charts else None
    made, picture = _rows_and_chart(grid["tasks"], out, "netbench-grid", drawn)
    page = (
        "<h2>Worker size x concurrency</h2><p>At each size, n tasks at once, each on a "
        "worker of its own, move the objects from one instant: the rate of each task and "
        "of all together.</p>"
        + picture
        + _table(grid["cells"])
        + "<h3>Recommendation</h3><pre>"
        + html.escape(json.dumps(grid["recommendation"], indent=2))
        + '</pre><p>Data: <a href="netbench-grid.csv">netbench-grid.csv</a></p>'
    )
    return made, page


def _sizes(sizes: dict[str, Any], out: Path, charts: bool) -> tuple[list[Path], str]:
    """The worker-size sweep's CSV (and chart); its part of the page."""
    rows = sizes["points"]  # (none: no size's lone task started)
    drawn = (lambda: _size_chart(sizes, out)) if charts else None
    made, picture = _rows_and_chart(rows, out, "netbench-sizes", drawn)
    page = (
        f"<h2>Worker size</h2><p>Prices: {html.escape(json.dumps(sizes['prices']))}</p>"
        + picture
        + (_table(rows) if rows else "")
        + "<pre>"
        + html.escape(json.dumps(sizes["recommendation"], indent=2))
        + '</pre><p>Data: <a href="netbench-sizes.csv">netbench-sizes.csv</a></p>'
    )
    if sizes.get("grid"):
        gridded, grid_page = _grid(sizes["grid"], out, charts)
        made, page = made + gridded, page + grid_page
    return made, page


def write(points: list[Point], summary: dict[str, Any], out: Path) -> list[Path]:
    """Write the CSV, JSON, charts and HTML into ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "netbench.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["direction", "concurrency", "task", "bytes", "seconds", "mbit", "link_bytes"])
        for p in points:
            w.writerow(
                [p.direction, p.concurrency, p.task, p.bytes, f"{p.seconds:.4f}",
                 f"{p.mbit:.2f}", p.link_bytes]
            )  # fmt: skip
    (out / "netbench.json").write_text(json.dumps(summary, indent=2) + "\n")
    try:
        charts = _charts(summary, out)
        note = ""
    except ImportError:
        charts, note = (
            [],
            "<p>No charts: matplotlib is not installed (pip install nimbus[netbench]).</p>",
        )
    sized: list[Path] = []
    size_page = ""
    if summary.get("sizes"):
        sized, size_page = _sizes(summary["sizes"], out, charts=not note)
    head = list(summary["runs"][0]) if summary["runs"] else []
    table = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(r[k]))}</td>" for k in head) + "</tr>"
        for r in summary["runs"]
    )
    page = (
        "<!doctype html><meta charset=utf-8><title>nimbus netbench</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 8px;"
        "border-bottom:1px solid #ddd;text-align:right}</style>"
        f"<h1>nimbus netbench</h1><p>Host link cap {summary['cap_mbit']:.0f} Mbit/s "
        f"(TCP payload at most {summary['payload_cap_mbit']} Mbit/s).</p>{note}"
        + "".join(f'<p><img src="{c}" alt="{c}"></p>' for c in charts)
        + "<table><tr>"
        + "".join(f"<th>{html.escape(k)}</th>" for k in head)
        + f"</tr>{table}</table><h2>Recommendation</h2><pre>"
        + html.escape(json.dumps(summary["recommendation"], indent=2))
        + '</pre><p>Data: <a href="netbench.csv">netbench.csv</a>, '
        '<a href="netbench.json">netbench.json</a></p>' + size_page
    )
    (out / "netbench.html").write_text(page)
    written = [out / n for n in ("netbench.csv", "netbench.json", "netbench.html", *charts)]
    return written + sized
