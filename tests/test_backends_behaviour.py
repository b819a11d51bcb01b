"""One behaviour test over every backend: the same GRPO-shaped run through rllog.init, read back from each
tracker's own storage (parquet files, wandb's .wandb file, TensorBoard events, MLflow's sqlite, trackio's
SQLite, Comet's offline zip) and compared value by value."""

from __future__ import annotations

import math
import struct

import pytest

import rllog
from readers import read_back

BACKENDS = ["parquet", "wandb", "trackio", "tensorboard", "mlflow", "comet_ml"]
KEYS = [
    "loss", "grad_norm", "learning_rate", "num_tokens", "reward", "reward_std", "frac_reward_zero_std", "kl", "entropy",
    "rewards/accuracy/mean", "rewards/accuracy/std", "rewards/format/mean", "rewards/format/std",
    "completions/mean_length", "completions/min_length", "completions/max_length", "completions/clipped_ratio",
    "completions/mean_terminated_length", "completions/min_terminated_length", "completions/max_terminated_length",
    "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max", "clip_ratio/region_mean",
    "step_time", "epoch", "train/global_step_copy", "eval/reward", "objective/kl",
]
CONFIG = {"learning_rate": 1e-6, "beta": 0.04, "hub_token": "hf_very_secret", "model": {"name": "tiny-qwen", "layers": 2}}
TABLE_0 = {"prompt": ["What is 1+1?", "Name a colour"], "completion": ["2", "blue"], "rewards/accuracy": [1.0, 0.5], "advantage": [0.75, -0.25]}
TABLE_20 = {"prompt": ["What is 2+2?"], "completion": ["4"], "rewards/accuracy": [1.0], "advantage": [0.5], "n_chars": [1]}


def value(step: int, i: int) -> float:
    return step * 1.25 + i / 8 - 3.0


def as_stored(backend: str, v: float) -> float:
    """TensorBoard stores scalars as float32 (docs/backends/tensorboard.md); the others keep float64."""
    return struct.unpack("f", struct.pack("f", v))[0] if backend == "tensorboard" else v


def cell(backend: str, v):
    if backend == "tensorboard":
        from rllog_backends.tensorboard import format_cell

        return format_cell(v)
    return v


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_stores_exactly_what_was_logged(backend, tracker_dirs, tmp_path):
    run = rllog.init(report_to=backend, project="behaviour", name="grpo-run", config=CONFIG, run_dir=tmp_path / "run", flush_interval=0.2, health=False)
    for step in range(50):
        run.log({k: value(step, i) for i, k in enumerate(KEYS)}, step=step)
        if step == 0:
            run.log_table("completions", TABLE_0, step=0)
        if step == 20:
            run.log_table("completions", TABLE_20, step=20)
    run.log({"reward": 99.5}, step=10)  # a step that goes backwards: resumed run / late eval
    report = run.finish(timeout=120)
    assert report.ok, str(report)
    assert report[backend].delivered == 53

    got = read_back(backend, tracker_dirs, run.info)

    # metrics: every key, every step, the exact value (the backward step included)
    for i, key in enumerate(KEYS):
        expected = [(s, as_stored(backend, value(s, i))) for s in range(50)]
        if key == "reward":
            expected.append((10, 99.5))
        assert sorted(got.metrics[key]) == sorted(expected), key
    assert set(KEYS) <= set(got.metrics)

    # tables: both, at their steps, with their own columns
    [(step0, rows0), (step20, rows20)] = got.tables["completions"]
    assert (step0, step20) == (0, 20)
    expected0 = [{k: cell(backend, TABLE_0[k][r]) for k in TABLE_0} for r in range(2)]
    expected20 = [{k: cell(backend, TABLE_20[k][0]) for k in TABLE_20}]
    assert [{k: row.get(k) for k in TABLE_0} for row in rows0] == expected0
    assert [{k: row.get(k) for k in TABLE_20} for row in rows20] == expected20

    # config: flattened with "/", the secret redacted before it reached the tracker
    assert got.config["hub_token"] == "***REDACTED***"
    assert "hf_very_secret" not in repr(got.config)
    assert math.isclose(float(got.config["learning_rate"]), 1e-6)
    assert str(got.config["model/name"]) == "tiny-qwen"

    if got.status is not None:
        assert got.status == "finished"
