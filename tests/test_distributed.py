"""Multi-process runs with torchrun (gloo, CPU): reduction across ranks, files from rank 0 only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

import rllog
from rllog.distributed import reduction

WORKER = r"""
import json, math, os, sys
import torch, torch.distributed as dist
import rllog
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
run = rllog.init(report_to="parquet", run_dir=os.path.join(sys.argv[1], "run"), project="dist", config={"world": world})
for step in range(3):
    values = {
        "loss": rank + step + 0.5,                       # mean
        "clip_ratio/low_min": float(rank * 10 + step),   # min
        "clip_ratio/high_max": float(rank * 10 + step),  # max
        "num_tokens": float(100 * (rank + 1)),           # sum (counter)
        "completions/min_length": float(5 + rank),       # min
        "reward": float("nan") if rank == 0 else float(rank),  # NaN ignored
        "tensor_metric": torch.tensor(float(rank)),      # tensors reduce too
    }
    if rank == 1:
        values["only_on_rank1"] = 42.0 + step            # missing elsewhere: ignored, not zero
    if rank % 2 == 0:
        values["even_ranks"] = {"x": float(rank)}        # nested, on some ranks
    run.log(values, step=step)
run.log({"loss": float(rank)}, step=3)  # keys known from earlier steps, logged by no rank now: not reported
late = {"loss": 1.0}
if rank == world - 1:
    late["late/only_last_rank"] = 7.0  # a key no rank logged before, on one rank only
run.log(late, step=4)
run.log_table("completions", {"rank": [rank, rank], "text": [f"r{rank}a", f"r{rank}b"]}, step=2)
report = run.finish()
# one file per rank: lines printed by several ranks to torchrun's shared stdout can interleave
with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "type": type(run).__name__, "report": {k: v.state for k, v in report.items()}}, f)
dist.destroy_process_group()
"""


def reference(world: int, step: int) -> dict[str, float]:
    ranks = range(world)
    rewards = [float(r) for r in ranks if r != 0]
    ref = {
        "loss": sum(r + step + 0.5 for r in ranks) / world,
        "clip_ratio/low_min": float(min(r * 10 + step for r in ranks)),
        "clip_ratio/high_max": float(max(r * 10 + step for r in ranks)),
        "num_tokens": float(sum(100 * (r + 1) for r in ranks)),
        "completions/min_length": 5.0,
        "reward": sum(rewards) / len(rewards),
        "tensor_metric": sum(ranks) / world,
        "only_on_rank1": 42.0 + step,
        "even_ranks/x": sum(float(r) for r in ranks if r % 2 == 0) / len([r for r in ranks if r % 2 == 0]),
    }
    return ref


@pytest.mark.parametrize("world", [3])  # more than two ranks, an odd count: a mean over ranks is not a pair's
def test_torchrun_reduces_across_ranks_and_only_rank0_writes(tmp_path, world):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out_dir, results_dir = tmp_path / "out", tmp_path / "results"
    out_dir.mkdir()
    results_dir.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLLOG_DIR": str(tmp_path / "default_runs")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(world),
            str(script),
            str(out_dir),
            str(results_dir),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = sorted((json.loads(p.read_text()) for p in results_dir.glob("rank*.json")), key=lambda r: r["rank"])
    assert [r["type"] for r in results] == ["Run"] + ["NullRun"] * (world - 1)
    assert results[0]["report"] == {"parquet": "delivered"}
    run_dir = out_dir / "run"
    got = {}
    for row in rllog.read_metrics(run_dir).to_pylist():
        got.setdefault(row["step"], {})[row["key"]] = row["value"]
    assert sorted(got) == [0, 1, 2, 3, 4]
    assert got[3] == {"loss": pytest.approx(sum(range(world)) / world)}
    assert got[4] == {"loss": 1.0, "late/only_last_rank": 7.0}
    for step in range(3):
        expected = reference(world, step)
        assert set(got[step]) == set(expected)
        for key, value in expected.items():
            assert got[step][key] == pytest.approx(value), (step, key)
    rows = rllog.read_table(run_dir, "completions").to_pylist()
    assert [(r["rank"], r["text"]) for r in rows] == [(r, f"r{r}{s}") for r in range(world) for s in "ab"]
    # only rank 0 created files: one run dir, nothing in the default location
    assert [p.name for p in out_dir.iterdir()] == ["run"]
    assert not (tmp_path / "default_runs").exists()


def test_reduction_by_name():
    assert reduction("clip_ratio/low_min") == "min" and reduction("completions/min_length") == "min"
    assert reduction("clip_ratio/high_max") == "max" and reduction("max_terminated_length") == "max"
    assert reduction("num_tokens") == "sum" and reduction("train/sample_count") == "sum" and reduction("total_flos") == "sum"
    assert reduction("reward") == "mean" and reduction("rewards/acc/mean") == "mean" and reduction("kl") == "mean"


def test_a_single_process_run_is_not_reduced(tmp_path):
    run = rllog.init(run_dir=tmp_path / "r")
    assert type(run).__name__ == "Run" and not run._distributed
    run.log({"num_tokens": 5.0, "low_min": 3.0})
    run.finish()
    assert sorted(rllog.read_metrics(tmp_path / "r").column("value").to_pylist()) == [3.0, 5.0]
