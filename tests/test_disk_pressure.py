"""A run whose journal shares a small, nearly full disk with what is derived from it (the Parquet store, the
cursor files): nothing logged is lost, and once space returns every record reaches every tracker.

The disk is a real tmpfs, filled with real files and freed; TensorBoard and the trackers' own files are elsewhere, as
they are when only the run directory is on the small disk.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from readers import read_back
from sinks import tmpfs

import rllog
from rllog.run import load_run_info

SCENARIO_DISK = "size=3m"
SCENARIO_FREE_AT_START = 150 * 1024  # what the disk has free when the run starts
SCENARIO_FREED = 2800 * 1024  # freed at half the run
SCENARIO_STEPS = 3000
SCENARIO_METRICS = 20


def filler(disk: Path, name: str, size: int | None = None, free: int = 0) -> Path:
    """A file on ``disk`` of ``size`` bytes, or one that leaves ``free`` bytes free (rounded to the disk's blocks)."""
    if size is None:
        st = os.statvfs(disk)
        size = max(0, st.f_bavail * st.f_frsize - free)
    path = disk / name
    with open(path, "wb", buffering=0) as f:
        f.write(b"\0" * size)
    return path


def run_disk_pressure(disk: Path, tensorboard_dir: Path, timeout: float = 120) -> dict:
    """The run of ``SCENARIO_STEPS`` x ``SCENARIO_METRICS`` to parquet and TensorBoard on ``disk`` (a fresh tmpfs of
    ``SCENARIO_DISK``): ``SCENARIO_FREED`` is freed at half the run. Returns what each tracker holds."""
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(tensorboard_dir)
    released = filler(disk, "released", size=SCENARIO_FREED)
    filler(disk, "kept", free=SCENARIO_FREE_AT_START)
    run_dir = disk / "r"
    run = rllog.init(report_to="parquet,tensorboard", run_dir=run_dir, flush_interval=0.05, health=False)
    keys = [f"m{i:02d}/value" for i in range(SCENARIO_METRICS)]
    for step in range(SCENARIO_STEPS):
        if step == SCENARIO_STEPS // 2:
            released.unlink()
        run.log({key: step + i / 100 for i, key in enumerate(keys)}, step=step)
    report = run.finish(timeout=timeout)
    table = rllog.read_metrics(run_dir)
    env = {"TENSORBOARD_LOGGING_DIR": str(tensorboard_dir)}
    tensorboard = read_back("tensorboard", env, load_run_info(run_dir)[0]).metrics
    return {
        "report": report,
        "lost": report.unwritten,
        "parquet_rows": table.num_rows,
        "parquet_distinct": len(set(zip(table.column("seq").to_pylist(), table.column("key").to_pylist(), strict=True))),
        "parquet_steps": len(set(table.column("step").to_pylist())),
        "tensorboard_points": sum(len({s for s, _ in points}) for points in tensorboard.values()),
        "tensorboard_steps": {key: {s for s, _ in points} for key, points in tensorboard.items()},
    }


@pytest.mark.slow
def test_a_disk_freed_mid_run_gets_every_record_to_parquet_and_tensorboard(tmp_path):
    """The issue's scenario: 150 KB free at the start, 2.8 MB freed at half the run."""
    with tmpfs(tmp_path / "disk", SCENARIO_DISK) as disk:
        got = run_disk_pressure(disk, tmp_path / "tensorboard")
    report = got["report"]
    assert got["lost"] == 0, str(report)
    assert got["parquet_rows"] == got["parquet_distinct"] == SCENARIO_STEPS * SCENARIO_METRICS, str(report)
    assert got["tensorboard_points"] == SCENARIO_STEPS * SCENARIO_METRICS, str(report)
    assert all(steps == set(range(SCENARIO_STEPS)) for steps in got["tensorboard_steps"].values())
    assert report.ok, str(report)
