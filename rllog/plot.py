"""``rllog plot``: a grid of a run's metrics over steps (matplotlib, headless)."""

from __future__ import annotations

import math
import os
from pathlib import Path

# What a GRPO/PPO user looks at first, in this order; the ones present are plotted.
CRUCIAL = [
    "reward", "reward_std", "kl", "entropy", "completions/mean_length", "completions/clipped_ratio",
    "loss", "frac_reward_zero_std", "clip_ratio/region_mean", "grad_norm",
    "objective/rlhf_reward", "objective/kl", "objective/entropy", "val/ratio", "loss/value_avg", "policy/approxkl_avg",
]


def plot_run(run_dir: str | os.PathLike, output: str | os.PathLike | None = None, metrics: list[str] | None = None) -> Path:
    """Write a PNG with one panel per metric; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rllog.summary import summarise

    s = summarise(run_dir)
    names = metrics or [m for m in CRUCIAL if m in s.series] or sorted(s.series)[:9]
    names = [n for n in names if n in s.series]
    if not names:
        raise ValueError(f"no metrics to plot in {run_dir}")
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        points = sorted(s.series[name])
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 60 else None, linewidth=1.2)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    out = Path(output) if output else Path(run_dir) / "metrics.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
