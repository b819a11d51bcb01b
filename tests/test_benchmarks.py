"""The benchmarks' own checks: the GPU benchmark's CPU smoke run goes through every configuration and writes its
section, so that the command a CUDA machine runs cannot rot unseen."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu  # noqa: E402


def test_gpu_benchmark_smoke_trains_every_configuration_and_writes_its_section(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nbefore\n\n{gpu.SECTION_BEGIN}\nan older measurement\n{gpu.SECTION_END}\n\nafter\n")
    raw = tmp_path / "results.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--doc", str(doc), "--json", str(raw)]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads(raw.read_text())
    runs = results["runs"]
    assert [r["config"] for r in runs] == list(gpu.CONFIGS)  # one round, every configuration once
    for r in runs:
        assert r["timed_steps"] == gpu.SMOKE_STEPS - gpu.WARMUP_STEPS, r
        assert r["step_median_ms"] > 0 and r["blocked_ms_per_step"] is not None, r
        assert r["syncs_per_step"].get("main thread", 0) > 0, r  # TRL converts its metrics on the training thread
        assert r.get("delivered", True) is True, r
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nbefore\n") and text.rstrip().endswith("after")
    assert "an older measurement" not in text and text.count(gpu.SECTION_BEGIN) == 1
    section = text.split(gpu.SECTION_BEGIN)[1].split(gpu.SECTION_END)[0]
    assert "GRPO on a GPU" in section and "CPU" in section
    for label in gpu.CONFIGS.values():
        assert label in section


def test_a_regenerated_page_keeps_the_parts_other_commands_wrote():
    """``benchmarks/run.py`` rewrites docs/benchmarks.md whole; the GPU section (written on another machine) and the
    hand-written notes must survive it."""
    import run

    begin, end = run.KEPT_PARTS[1]
    old = f"# Benchmarks\n\nold tables\n\n{gpu.SECTION_BEGIN}\nGPU figures\n{gpu.SECTION_END}\n\n{begin}\nnotes\n{end}\n"
    page = run.keep_parts("# Benchmarks\n\nnew tables\n", old)
    assert "new tables" in page and "old tables" not in page
    assert page.count("GPU figures") == 1 and page.count("notes") == 1 and page.count(gpu.SECTION_BEGIN) == 1
    assert run.keep_parts(page, page) == page  # nothing is added twice
