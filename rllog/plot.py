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
from collections.abc import Iterable, Sequence
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


RUN_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")
EXTRA_PANELS = ("learning_rate",)  # not crucial to a run's health, but what a reader checks first when a curve bends
DEFAULT_PANELS_MAX = 9  # a run whose metrics the catalog does not know: its first metrics by name, a 3 x 3 grid
MARKER_POINTS_MAX = 60  # a series with fewer points gets a marker per point


def smoothed(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average with ``weight`` in [0, 1), debiased so that the first
    points are not pulled towards zero; NaN and inf are passed through and left out of the average."""
    out, average, total = [], 0.0, 0.0
    for value in values:
        if not math.isfinite(value):
            out.append(value)
            continue
        average = weight * average + (1 - weight) * value
        total = weight * total + (1 - weight)
        out.append(average / total)
    return out


def plot_run(
    run_dir: str | os.PathLike,
    output: str | os.PathLike | None = None,
    metrics: list[str] | None = None,
    alerts: Iterable[Any] | None = None,
    smooth: float = 0.0,
) -> Path:
    """Write a PNG with one panel per metric; returns its path.

    Args:
        run_dir: the run directory.
        output: PNG path (default ``RUN_DIR/metrics.png``).
        metrics: the metrics to plot (default: the crucial ones present, the learning rate, and those with alerts).
        alerts: alerts to mark (``AlertRecord`` s or dicts with step, rule, metric, value, level);
            default: :func:`load_alerts`.
        smooth: exponential smoothing weight in [0, 1) (:func:`smoothed`); the raw series stays, faint.
    """
    return plot_runs([run_dir], output, metrics, alerts, smooth)


def _run_label(run_dir: str | os.PathLike) -> str:
    """The run's name and start time, from run.json: what a plot's title and legend call it."""
    import datetime

    from rllog.rundir import RunFile

    try:
        run = RunFile.read(run_dir)
    except (OSError, ValueError, TypeError, KeyError):
        return Path(run_dir).name
    started = datetime.datetime.fromtimestamp(run.started).strftime("%Y-%m-%d %H:%M") if run.started else ""
    return f"{run.project} / {run.name}" + (f" ({started})" if started else "")


def plot_runs(
    run_dirs: Sequence[str | os.PathLike],
    output: str | os.PathLike | None = None,
    metrics: list[str] | None = None,
    alerts: Iterable[Any] | None = None,
    smooth: float = 0.0,
) -> Path:
    """:func:`plot_run` for one run or several overlaid (one colour per run, named in the legend); the default
    panels are those of the first run, and the PNG is written to the first run's directory by default."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rllog.catalog import crucial_keys, format_range, lookup

    summaries = [summarise(r) for r in run_dirs]
    s = summaries[0]
    labels = [_run_label(r) for r in run_dirs]
    several = len(run_dirs) > 1
    # alerts are marked for a single run only: on an overlay they would not say which run raised them
    marks = [] if several else [_alert_dict(a) for a in alerts] if alerts is not None else load_alerts(run_dirs[0], s)
    present = set().union(*(x.series for x in summaries))
    if metrics:
        names = [n for n in metrics if n in present]
    else:
        names = crucial_keys(s.series) or sorted(s.series)[:DEFAULT_PANELS_MAX]
        # by its last part: the integrations log ``train/learning_rate``
        names += [n for n in sorted(s.series) if n.rsplit("/", 1)[-1] in EXTRA_PANELS and n not in names]
        names += sorted({a["metric"] for a in marks if a.get("metric") in s.series} - set(names))
    if not names:
        raise NothingToPlot(f"no metrics to plot in {', '.join(map(str, run_dirs))}")
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.0 * rows + 0.5), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):  # more axes than names: the grid is filled row by row
        finite: list[float] = []
        for i, summary in enumerate(summaries):
            points = sorted(summary.series.get(name, []))
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            colour = RUN_COLOURS[i % len(RUN_COLOURS)]
            label = labels[i] if several else None
            marker = "." if len(points) < MARKER_POINTS_MAX else None
            if smooth:
                ax.plot(xs, ys, linewidth=0.8, color=colour, alpha=0.25, zorder=3)
                ax.plot(xs, smoothed(ys, smooth), linewidth=1.4, color=colour, zorder=3, label=label)
            else:
                ax.plot(xs, ys, marker=marker, linewidth=1.2, color=colour, zorder=3, label=label)
            finite += [y for y in ys if math.isfinite(y)]
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
        finite += extra
        if finite:
            lo, hi = min(finite), max(finite)
            pad = 0.05 * ((hi - lo) or abs(hi) or 1.0)
            ax.set_ylim(lo - pad, hi + pad)
        title = name + (f"  ({len(on_panel)} alert{'s' if len(on_panel) != 1 else ''})" if on_panel else "")
        ax.set_title(title, fontsize=10, color=LEVEL_COLOUR["error"] if on_panel else "black")
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel(name.rsplit("/", 1)[-1], fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if several or (info is not None and (info.healthy is not None or _rule_thresholds(name))):
            ax.legend(fontsize=6, loc="best")
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    heading = " vs ".join(labels) + (f"  (smoothing {smooth:g})" if smooth else "")
    if marks:
        heading += f"\n{len(marks)} health alert{'s' if len(marks) != 1 else ''} (vertical lines; see `rllog show`)"
    fig.suptitle(heading, fontsize=9, color=LEVEL_COLOUR["error"] if marks else "black")
    fig.tight_layout()
    out = Path(output) if output else Path(run_dirs[0]) / "metrics.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
