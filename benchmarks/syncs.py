"""Device syncs per logged step with tensor metrics, counted (not timed): every ``Tensor.item``,
``tolist``, ``cpu``, ``numpy``, ``__float__``, ``__int__``, ``__bool__`` call, which on an accelerator
each wait for the device.

- A loop with 30 one-element tensor metrics per step (what a trainer holds before logging): the trainer
  way (``.item()`` per metric, then log floats) against ``run.log(tensors)`` (rllog keeps them on the
  device and copies every pending tensor to the host in one transfer per journal flush).
- The tiny GRPO run with ``report_to="none"``, transformers' trackers and the rllog mixin: conversions per
  step on the training thread and on rllog's threads (TRL converts its metrics itself; what rllog adds is
  the difference). ``benchmarks/run.py`` counts them in the end-to-end runs; alone, this module runs (a) and (c).

    .venv/bin/python benchmarks/syncs.py [--quick]
"""

from __future__ import annotations

import time
from pathlib import Path

import end_to_end
import harness
from harness import md_table, progress, run_case, summarize_ns

SCRIPT = Path(__file__).resolve()


def case_loop(params: dict, workdir: Path) -> dict:
    import torch

    import rllog

    torch.set_num_threads(1)
    steps, n, way = params["steps"], params.get("n_metrics", 30), params["way"]
    counter = end_to_end.SyncCounter()
    run = rllog.init(report_to="parquet", project="bench-syncs", run_dir=workdir / "run", health=False)
    keys = harness.metric_keys(n)
    batches = [{k: torch.tensor(v) for k, v in harness.grpo_metrics(step, n).items()} for step in range(steps)]
    samples = []
    clock = time.perf_counter_ns
    work = harness.StepWork(10.0)  # a step's compute: the journal flushes every 0.5 s meanwhile
    counts: dict = {}
    counter.start(counts)
    for step, tensors in enumerate(batches):
        t = clock()
        if way == "item":
            run.log({k: v.item() for k, v in tensors.items()}, step=step)
        else:
            run.log(tensors, step=step)
        samples.append(clock() - t)
        work()
    report = run.finish(timeout=120)
    counter.stop()
    values = {(r["step"], r["key"]): r["value"] for r in rllog.read_metrics(run.run_dir).to_pylist()}
    correct = all(values.get((step, k)) == float(batches[step][k]) for step in range(steps) for k in keys)
    return {"steps": steps, "syncs": counts, "call": summarize_ns(samples), "delivered": report.ok, "values_exact": correct}


CASES = {"loop": case_loop, "grpo": end_to_end.case_grpo}


def run(quick: bool, tmp: Path, end_to_end_runs: list[dict] | None = None) -> dict:
    """``end_to_end_runs``: the end-to-end results, whose GRPO runs counted their conversions (no extra runs then)."""
    steps = 100 if quick else 300
    results: dict = {"loop": [], "grpo": []}
    for way in ["item", "tensors"]:
        progress(f"syncs: loop, {way}")
        results["loop"].append({"way": way, **run_case(SCRIPT, "loop", {"way": way, "steps": steps}, tmp)})
    if end_to_end_runs:
        for key, (label, _) in end_to_end.CONFIGS.items():
            counted = next((r for r in end_to_end_runs if r["key"] == key and "syncs" in r), None)
            if counted:
                results["grpo"].append({"key": key, "label": label, **counted})
        return results
    grpo_steps = 12 if quick else 20
    for key in ["a", "c"]:
        label, params = end_to_end.CONFIGS[key]
        progress(f"syncs: GRPO {label}, {grpo_steps} steps")
        results["grpo"].append(
            {"key": key, "label": label, **run_case(SCRIPT, "grpo", params | {"steps": grpo_steps, "count_syncs": True}, tmp)}
        )
    return results


def _total(counts: dict, who: str | None = None) -> int:
    return sum(sum(per.values()) for k, per in counts.items() if who is None or k == who)


def render(results: dict) -> str:
    rows = []
    for r in results["loop"]:
        if "error" in r:
            rows.append([r["way"], "failed", "", "", "", ""])
            continue
        label = "`.item()` per metric, then `run.log(floats)`" if r["way"] == "item" else "`run.log(tensors)`"
        detail = (
            ", ".join(f"{who}: " + ", ".join(f"{n} x{c}" for n, c in per.items()) for who, per in r["syncs"].items()) or "none"
        )
        rows.append(
            [label, _total(r["syncs"]) / r["steps"], detail, r["call"]["median_us"], "yes" if r["values_exact"] else "**no**"]
        )
    out = [
        f"**A loop logging 30 one-element tensors per step** ({results['loop'][0].get('steps', '?')} steps, 10 ms apart, CPU tensors):",
        "",
        md_table(["way", "conversions per step", "which", "log call median us (incl. .item())", "values exact"], rows),
    ]
    rows = []
    for r in results["grpo"]:
        if "error" in r:
            rows.append([r["label"], "failed", "", "", ""])
            continue
        steps = r["synced_steps"]
        detail = "; ".join(
            f"{who}: " + ", ".join(f"{n} x{c}" for n, c in sorted(per.items())) for who, per in sorted(r["syncs"].items())
        )
        rows.append(
            [
                r["label"],
                _total(r["syncs"], "main thread") / steps,
                _total(r["syncs"], "rllog threads") / steps,
                _total(r["syncs"], "other threads") / steps,
                detail,
            ]
        )
    out += [
        "",
        f"**Tiny GRPO run** (conversions per step from step 3 to the end of training, {results['grpo'][0].get('synced_steps', '?')} steps):",
        "",
        md_table(["configuration", "training thread", "rllog threads", "other threads", "which (whole window)"], rows),
    ]
    return "\n".join(out)


if __name__ == "__main__":
    harness.module_main(run, render, CASES, __doc__)
