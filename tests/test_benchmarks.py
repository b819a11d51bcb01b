"""The benchmarks' own checks: the GPU benchmark's CPU smoke run goes through every configuration and writes its
section, so that the command a CUDA machine runs cannot rot unseen."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import end_to_end  # noqa: E402
import gpu  # noqa: E402
import gpu_bundle  # noqa: E402
import harness  # noqa: E402


def test_gpu_benchmark_smoke_trains_every_configuration_and_writes_its_section(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nbefore\n\n{gpu.SECTION_BEGIN}\nan older measurement\n{gpu.SECTION_END}\n\nafter\n")
    raw = tmp_path / "results.json"
    # Two rounds asked, but a budget the first round overruns: the second is not started (a device call's time limit
    # would otherwise kill the series and lose the rounds already done).
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--doc", str(doc), "--json", str(raw)]
    command += ["--rounds", "2", "--budget", "0.5"]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads(raw.read_text())
    runs = results["runs"]
    assert [r["config"] for r in runs] == list(gpu.CONFIGS)  # one round, every configuration once
    assert results["rounds"] == 1
    for r in runs:
        assert r["timed_steps"] == gpu.SMOKE_STEPS - gpu.WARMUP_STEPS, r
        assert r["step_median_ms"] > 0 and r["blocked_ms_per_step"] is not None, r
        assert r["syncs_per_step"].get("main thread", 0) > 0, r  # TRL converts its metrics on the training thread
        assert r.get("delivered", True) is True, r
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nbefore\n") and text.rstrip().endswith("after")
    assert "an older measurement" not in text and text.count(gpu.SECTION_BEGIN) == 1
    section = text.split(gpu.SECTION_BEGIN)[1].split(gpu.SECTION_END)[0]
    assert "GRPO on a GPU" in section and "CPU" in section and "x 1 round(s)" in section
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


def test_the_gpu_bundle_follows_extras_and_leaves_out_torch_and_what_the_machine_has():
    """comet_ml needs ``everett[ini]``, whose ``configobj`` comes only through the extra: a bundle without it made
    comet_ml's sink fail on the GPU machine."""
    needed = gpu_bundle.closure(gpu_bundle.ROOTS, "3.12", present={"transformers", "pyarrow"})
    assert {"trl", "datasets", "wandb", "mlflow", "trackio", "comet-ml", "everett", "configobj"} <= set(needed)
    assert "torch" not in needed and "transformers" not in needed and "pyarrow" not in needed
    import importlib.metadata

    assert needed["configobj"] == importlib.metadata.version("configobj")  # the suite's own pinned version


def test_waiting_for_delivery_stops_at_a_sink_that_failed_for_good(tmp_path):
    (tmp_path / "delivery").mkdir()
    (tmp_path / "delivery" / "parquet.json").write_text(json.dumps({"seq": 3, "state": "running"}))
    (tmp_path / "delivery" / "comet_ml.json").write_text(json.dumps({"seq": 0, "state": "failed", "error": "no configobj"}))
    with pytest.raises(RuntimeError, match=r"comet_ml.*no configobj"):
        harness.wait_delivered(tmp_path, ["parquet", "comet_ml"], 3, timeout=60)
    assert harness.wait_delivered(tmp_path, ["parquet"], 3, timeout=60) < 5


def test_the_whole_script_target_is_the_none_script_plus_the_trackers_floor_round_by_round():
    """Issue 34's whole-script target for (ii): five trackers' script / ((a)'s script + their own CPU seconds), each
    round against the (a) of the same round; (i) runs and failed runs stay out."""

    def run(key, round_, wall, threads="default", **extra):
        return {"key": key, "round": round_, "steps": 60, "threads": threads, "process_wall_s": wall, "train_s": 1.0, **extra}

    fresh = {
        "runs": [
            run("a", 0, 20.0),
            run("c0p", 0, 31.5),
            run("a", 1, 30.0),
            run("c0p", 1, 40.0),
            run("a", 2, 25.0),
            run("c0p", 2, 35.7),
            run("c0p", 3, 99.0),  # no (a) in round 3
            run("a", 0, 1.0, threads="one"),
            run("c0p", 0, 1.0, threads="one"),
            run("a", 4, 20.0),
            run("c0p", 4, 25.0, error="exit 1"),
        ],
        "floor": {"60": {"wandb": 6.0, "mlflow": 4.0}},
    }
    assert end_to_end.floor_ratios(fresh) == {60: [31.5 / 30.0, 40.0 / 40.0, 35.7 / 35.0]}
    target = [t for t in end_to_end.fresh_targets(fresh) if "whole script" in t["what"]]
    assert len(target) == 1 and "10.0 CPU s" in target[0]["what"]
    assert target[0]["target"] == "<= 1.05x"
    assert target[0]["met"] is None  # 1.05, 1.00 and 1.02: three rounds this close to the target do not settle it
    fresh["runs"][1]["process_wall_s"] = 24.0
    fresh["runs"][3]["process_wall_s"] = 32.0
    fresh["runs"][5]["process_wall_s"] = 28.7  # 0.80, 0.80, 0.82: below 1.05x whatever the spread
    assert end_to_end.fresh_targets(fresh)[-1]["met"] is True
    for i in (1, 3, 5):
        fresh["runs"][i]["process_wall_s"] *= 1.5  # 1.20, 1.20, 1.23
    assert end_to_end.fresh_targets(fresh)[-1]["met"] is False
    assert end_to_end.floor_ratios({"runs": fresh["runs"]}) == {}  # not measured: no target


def test_paired_rounds_give_a_verdict_only_when_the_interval_is_on_one_side_of_the_target():
    """Issue 34's train() targets from paired rounds: the geometric mean of each round's ratio to (a) of the same round
    and threading, with a Student t interval on their logarithms; met or missed only when the interval lies wholly on
    one side."""
    mean, low, high = harness.geometric_mean_interval([1.1, 1 / 1.1] * 6)
    assert mean == pytest.approx(1.0) and 0.9 < low < 1.0 < high < 1.1
    assert harness.geometric_mean_interval([1.1, 1 / 1.1] * 2)[1] < low  # fewer rounds, a wider interval
    assert harness.geometric_mean_interval([1.02] * 10) == pytest.approx((1.02, 1.02, 1.02))

    def rounds(threads, key, ratios):
        runs = []
        for i, r in enumerate(ratios):
            runs += [
                {"key": "a", "round": i, "steps": 60, "threads": threads, "train_s": 10.0},
                {"key": key, "round": i, "steps": 60, "threads": threads, "train_s": 10.0 * r},
            ]
        return runs

    paired = {
        "runs": rounds("one", "cpp", [1.00, 1.01, 1.02, 1.01] * 4)  # all below 1.03x: met
        + rounds("default", "cpp", [1.08, 1.10, 1.09, 1.12] * 3)  # all above 1.03x: missed
        + rounds("one", "c0p", [0.90, 1.20] * 6)  # straddles 1.03x: not settled
        + rounds("default", "c0p", [1.00, 1.30, 1.10])  # three rounds this spread: not settled
    }
    found = {
        ("(ii)" if "(ii)" in t["what"] else "(i)", "parquet alone" in t["what"]): t for t in end_to_end.paired_targets(paired)
    }
    assert found[("(i)", True)]["met"] is True and "(rounds: 16)" in found[("(i)", True)]["measured"]
    assert found[("(ii)", True)]["met"] is False
    assert found[("(i)", False)]["met"] is None
    assert found[("(ii)", False)]["met"] is None and found[("(ii)", False)]["target"] == "<= 1.15x"
    assert "(rounds: 1.00, 1.30, 1.10)" in found[("(ii)", False)]["measured"]
    assert end_to_end.render_paired(paired).count("**not settled**") == 2
