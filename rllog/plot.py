"""``rllog plot``: a grid of a run's metrics over steps (matplotlib, headless).

Each panel shows one metric; where :mod:`rllog.catalog` gives the metric a healthy range the band is
shaded green, the thresholds of the health rules that watch it are dashed lines, and the run's alerts
on it are vertical lines (orange: warning, red: error) with a marker at the alerting value. By
default the panels are the catalog's crucial metrics the run logged (plus any metric that raised an
alert), in catalog order.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rllog.errors import NothingToPlot
from rllog.summary import RunSummary, summarise

LEVEL_COLOUR = {"error": "#d62728", "warning": "#ff7f0e"}


def _alert_dict(a: Any) -> dict:
    if isinstance(a, dict):
        return a
    return {k: getattr(a, k, None) for k in ("step", "rule", "metric", "value", "message", "level")}


def load_alerts(run_dir: str | os.PathLike, summary: RunSummary | None = None) -> list[dict]:
    """The run's alerts, from its journal: the one record every run has, whichever backends it delivers to.

    Args:
        run_dir: the run directory.
        summary: the run's :class:`rllog.summary.RunSummary` when the caller already has it (saves reading the journal twice).
    """
    if summary is None:
        summary = summarise(run_dir)
    return [_alert_dict(a) for a in summary.alerts]


def _rule_thresholds(key: str) -> list[tuple[str, float]]:
    from rllog.health import default_rules

    return [(r.name, float(r.params["threshold"])) for r in default_rules() if "threshold" in r.params and r.watches(key)]


def plot_run(
    run_dir: str | os.PathLike,
    output: str | os.PathLike | None = None,
    metrics: list[str] | None = None,
    alerts: Iterable[Any] | None = None,
) -> Path:
    """Write a PNG with one panel per metric; returns its path.

    Args:
        run_dir: the run directory.
        output: PNG path (default ``RUN_DIR/metrics.png``).
        metrics: the metrics to plot (default: the crucial ones present, and those with alerts).
        alerts: alerts to mark (``AlertRecord`` s or dicts with step, rule, metric, value, level);
            default: :func:`load_alerts`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rllog.catalog import crucial_keys, format_range, lookup

    s = summarise(run_dir)
    marks = [_alert_dict(a) for a in alerts] if alerts is not None else load_alerts(run_dir, s)
    if metrics:
        names = [n for n in metrics if n in s.series]
    else:
        names = crucial_keys(s.series) or sorted(s.series)[:9]
        names += sorted({a["metric"] for a in marks if a.get("metric") in s.series} - set(names))
    if not names:
        raise NothingToPlot(f"no metrics to plot in {run_dir}")
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.0 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):  # more axes than names: the grid is filled row by row
        points = sorted(s.series[name])
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        ax.plot(xs, ys, marker="." if len(points) < 60 else None, linewidth=1.2, color="#1f77b4", zorder=3)
        y0, y1 = ax.get_ylim()
        info = lookup(name)
        extra: list[float] = []
        if info is not None and info.healthy is not None:
            low, high = info.healthy
            extra += [v for v in (low, high) if math.isfinite(v)]
            span = (y1 - y0) or 1.0
            lo = low if math.isfinite(low) else min(y0, *extra) - 10 * span
            hi = high if math.isfinite(high) else max(y1, *extra) + 10 * span
            ax.axhspan(lo, hi, color="#2ca02c", alpha=0.12, zorder=0, label=f"healthy ({format_range(info.healthy)})")
        for rule, value in _rule_thresholds(name):
            ax.axhline(value, color="#ff7f0e", linestyle="--", linewidth=0.9, alpha=0.8, zorder=1, label=f"{rule} threshold")
            extra.append(value)
        on_panel = [a for a in marks if a.get("metric") == name]
        for a in on_panel:
            colour = LEVEL_COLOUR.get(a.get("level") or "warning", LEVEL_COLOUR["warning"])
            ax.axvline(a["step"], color=colour, linewidth=1.0, alpha=0.7, zorder=2)
            mark = a.get("value")
            if mark is not None and math.isfinite(mark):
                ax.plot([a["step"]], [mark], marker="x", markersize=8, color=colour, zorder=4)
                extra.append(mark)
        finite = [y for y in ys if math.isfinite(y)] + extra
        if finite:
            lo, hi = min(finite), max(finite)
            pad = 0.05 * ((hi - lo) or abs(hi) or 1.0)
            ax.set_ylim(lo - pad, hi + pad)
        title = name + (f"  ({len(on_panel)} alert{'s' if len(on_panel) != 1 else ''})" if on_panel else "")
        ax.set_title(title, fontsize=10, color=LEVEL_COLOUR["error"] if on_panel else "black")
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if info is not None and (info.healthy is not None or _rule_thresholds(name)):
            ax.legend(fontsize=6, loc="best")
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    if marks:
        fig.suptitle(
            f"{len(marks)} health alert{'s' if len(marks) != 1 else ''} (vertical lines; see `rllog show`)",
            fontsize=9,
            color=LEVEL_COLOUR["error"],
        )
    fig.tight_layout()
    out = Path(output) if output else Path(run_dir) / "metrics.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
