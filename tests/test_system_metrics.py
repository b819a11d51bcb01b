"""System metrics: the trainer's, sampled by the agent, delivered like any metric."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import rllog
from rllog.system_metrics import SystemSampler

TRAINER = r"""
import sys, time, rllog
from rllog.journal.reader import JournalReader

def samples_journaled():
    reader = JournalReader(sys.argv[1])
    try:
        found = 0
        while batch := reader.read(10_000):
            found += sum("system/memory_rss_mb" in getattr(r, "values", {}) for r in batch)
        return found
    finally:
        reader.close()

ballast = bytearray(400 * 2**20)  # 400 MiB that the trainer holds and the agent does not
for i in range(0, len(ballast), 4096):
    ballast[i] = 1
run = rllog.init(report_to="parquet", run_dir=sys.argv[1], system_metrics=0.2, health=False)
# A trainer's pace, 0.1 s a step, for at least 2 s and until three samples are in the journal: the agent's start-up
# (its first sample) takes longer on a machine the rest of the suite keeps busy.
for step in range(600):
    run.log({"loss": 1.0 / (step + 1)}, step=step)
    time.sleep(0.1)
    if step >= 19 and samples_journaled() >= 3:
        break
print(run.finish().ok, step, flush=True)
"""


def test_system_metrics_describe_the_trainer_not_the_agent(tmp_path):
    run_dir = tmp_path / "r"
    out = subprocess.run([sys.executable, "-c", TRAINER, str(run_dir)], capture_output=True, text=True, timeout=120)
    ok, last_step = out.stdout.split()
    assert ok == "True", out.stderr
    rows = rllog.read_metrics(run_dir).to_pylist()
    rss = [r["value"] for r in rows if r["key"] == "system/memory_rss_mb"]
    assert len(rss) >= 3 and min(rss) > 400  # the agent itself holds ~100 MB: these are the trainer's
    assert {r["key"] for r in rows} >= {"loss", "system/cpu_percent", "system/memory_rss_mb", "system/threads"}
    steps = [r["step"] for r in rows if r["key"] == "system/threads"]
    assert steps == sorted(steps) and max(steps) <= int(last_step)  # at the trainer's step when sampled


def test_system_metrics_off(tmp_path):
    run = rllog.init(report_to="parquet", run_dir=tmp_path / "r", system_metrics=False)
    assert run._agent.system_interval is None
    run.log({"x": 1.0})
    assert run.finish().ok


class FakeNvml:
    """NVML's API for two GPUs (no GPU exists on this machine: the real library raises NVMLError_LibraryNotFound)."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self):
        self.inited = False

    def nvmlInit(self):
        self.inited = True

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=50 + h, memory=10)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=(h + 1) * 2**30, total=8 * 2**30, free=0)

    def nvmlDeviceGetPowerUsage(self, h):
        return 150_000 + h  # milliwatts

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        if h == 1:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 61


def test_gpu_readings_through_nvml_api():
    import os

    sample = SystemSampler(os.getpid(), nvml=FakeNvml()).sample()
    assert sample["system/gpu.0.utilization"] == 50.0 and sample["system/gpu.1.utilization"] == 51.0
    assert sample["system/gpu.1.memory_used_mb"] == 2048.0 and sample["system/gpu.1.memory_percent"] == 25.0
    assert sample["system/gpu.0.power_watts"] == 150.0 and sample["system/gpu.0.temperature_c"] == 61.0
    assert "system/gpu.1.temperature_c" not in sample  # a reading the GPU does not support is left out


def test_real_nvml_without_a_gpu_gives_cpu_metrics_only():
    import os

    sample = SystemSampler(os.getpid()).sample()
    assert sample["system/memory_rss_mb"] > 10 and not any(k.startswith("system/gpu") for k in sample)
