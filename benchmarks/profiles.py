"""Where the time goes, for the targets that are missed (cProfile, each in its own process).

- ``hot_path``: 5,000 ``run.log`` calls of 30 floats (report_to="none": the caller's side is the same
  with any number of sinks), profiled on the calling thread.
- ``delivery``: what delivering the tiny GRPO run's records costs each tracker. A journal of ``steps``
  steps (30 metrics and a 16-row completions table each, as the TRL mixin logs them) is written first;
  then each sink's :class:`rllog.delivery.Follower` delivers it on this thread (the sink already open,
  reading 16 records at a time, about what a live follower finds at each poll), under cProfile; the
  process CPU time (tracker threads included) and the wall time per step are measured.
- ``health``: rllog's health rules over 500 steps of 30 metrics (they run on the journal writer thread).
- ``tables``: rllog's Parquet writer on 1,000-row completions tables.
- ``integration``: the TRL mixin's own work on the training thread during a tiny GRPO run (parquet only).

    .venv/bin/python benchmarks/profiles.py [--quick]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from pathlib import Path

import harness
from harness import SIX, grpo_metrics, md_table, progress, run_case

SCRIPT = Path(__file__).resolve()


def _stats_text(profile: cProfile.Profile, sort: str, limit: int, strip: str | None = None) -> str:
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.strip_dirs() if strip == "dirs" else None
    stats.sort_stats(sort).print_stats(limit)
    text = out.getvalue()
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().startswith("ncalls")), 0)
    header = [line for line in lines[:start] if "function calls" in line]
    body = [
        line.replace(str(harness.ROOT) + "/", "").replace(".venv/lib/python3.11/site-packages/", "")
        for line in lines[start:]
        if line.strip()
    ]
    return "\n".join([h.strip() for h in header] + body)


def case_hot_path(params: dict, workdir: Path) -> dict:
    import rllog

    run = rllog.init(report_to="none", run_dir=workdir / "run")
    batches = [grpo_metrics(step) for step in range(params.get("calls", 5000))]
    profile = cProfile.Profile()
    profile.enable()
    for step, batch in enumerate(batches):
        run.log(batch, step=step)
    profile.disable()
    run.finish()
    return {
        "calls": len(batches),
        "tottime": _stats_text(profile, "tottime", 14),
        "cumtime": _stats_text(profile, "cumulative", 14),
    }


def _journal_like_the_mixin(run_dir: Path, steps: int) -> None:
    """The records the TRL mixin logs for ``steps`` GRPO steps: 30 metrics and a 16-row completions table each."""
    import rllog

    run = rllog.init(report_to="none", run_dir=run_dir, health=False)
    for step in range(1, steps + 1):
        run.log(grpo_metrics(step), step=step)
        run.log_table("completions", {
            "prompt": [f"What is {step} plus {i}?" for i in range(16)],
            "completion": [f"The answer is {step + i}." for i in range(16)],
            "reward_has_digit": [1.0] * 16, "reward_short": [0.05] * 16, "n_chars": [18] * 16, "advantage": [0.1 * i for i in range(16)],
        }, step=step)  # fmt: skip
    run.finish()


def case_delivery(params: dict, workdir: Path) -> dict:
    """Deliver the same journal to each sink in turn, on this thread, under cProfile."""
    import rllog  # noqa: F401
    from rllog import registry
    from rllog.delivery import Follower
    from rllog.records import RunInfo

    harness.block_comet_probe() if "comet_ml" in params["sinks"] else None
    steps = params["steps"]
    run_dir = workdir / "run"
    _journal_like_the_mixin(run_dir, steps)
    out = {}
    for name in params["sinks"]:
        info = RunInfo("bench-delivery", f"profile-{name}", str(run_dir), f"{abs(hash(name)) % 10**12:016d}", {"lr": 1e-3}, ())
        sink = registry.create(name, {})
        t = time.perf_counter()
        sink.open(info)
        open_s = time.perf_counter() - t
        follower = Follower(name, sink, info, follow=False, batch_size=16)
        follower.sink = sink  # already open: only the delivery is measured
        calls = {"write_metrics": 0, "write_table": 0, "flush": 0, "cursor saves": 0}

        def counted(fn, key, calls=calls):
            def wrapper(*args, **kwargs):
                calls[key] += 1
                return fn(*args, **kwargs)

            return wrapper

        for method in ("write_metrics", "write_table", "flush"):
            setattr(sink, method, counted(getattr(sink, method), method))
        follower.cursor.save = counted(follower.cursor.save, "cursor saves")
        profile = cProfile.Profile()
        wall, cpu = time.perf_counter(), time.process_time()
        profile.enable()
        follower.run()
        profile.disable()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        out[name] = {
            "open_s": open_s,
            "wall_ms_per_step": wall * 1e3 / steps,
            "cpu_ms_per_step": cpu * 1e3 / steps,
            "state": follower.state,
            "calls_per_step": {k: v / steps for k, v in calls.items()},
            "tottime": _stats_text(profile, "tottime", 10),
            "cumtime": _stats_text(profile, "cumulative", 22),
        }
    return {"steps": steps, "sinks": out}


def case_tables(params: dict, workdir: Path) -> dict:
    """rllog's Parquet writer on the same tables as ``scaling.case_tables_compare``; only the writing is profiled."""
    import scaling

    from rllog.records import RunInfo, TableRecord
    from rllog.validate import to_arrow_table
    from rllog_backends.parquet import ParquetSink

    tables = [scaling.completions(params["rows"], step) for step in range(params["count"])]
    to_arrow_table("warm-up", tables[0])  # imports outside the profile
    sink = ParquetSink()
    sink.open(RunInfo("bench", "tables", str(workdir), "0" * 16, {}, ()))
    profile = cProfile.Profile()
    profile.enable()
    for step, columns in enumerate(tables):
        sink.write_table(TableRecord(step + 1, step, time.time(), "completions", to_arrow_table("completions", columns)))
        sink.flush()
    sink.close("finished")
    profile.disable()
    return {"cumtime": _stats_text(profile, "cumulative", 18), "tottime": _stats_text(profile, "tottime", 12)}


def case_health(params: dict, workdir: Path) -> dict:
    """rllog's health rules (``health.HealthMonitor``, run on the journal writer thread for every metrics
    record) over ``steps`` steps of 30 metrics."""
    from rllog.health import HealthMonitor

    monitor = HealthMonitor()
    batches = [grpo_metrics(step) for step in range(params["steps"])]
    t = time.perf_counter()
    for step, batch in enumerate(batches):
        list(monitor.observe(step, batch))
    plain = time.perf_counter() - t
    monitor = HealthMonitor()
    profile = cProfile.Profile()
    profile.enable()
    for step, batch in enumerate(batches):
        list(monitor.observe(step, batch))
    profile.disable()
    return {"steps": len(batches), "ms_per_step": plain * 1e3 / len(batches), "tottime": _stats_text(profile, "tottime", 12)}


# The mixin's entry points on the training thread (they do not call one another).
INTEGRATION_ENTRY_POINTS = ("_rllog_completions", "log_table", "on_log", "on_step_begin", "on_step_end")


def case_integration(params: dict, workdir: Path) -> dict:
    import torch

    from rllog.demo import build_tiny_model, make_grpo_trainer

    torch.set_num_threads(1)
    steps = params.get("steps", 40)
    trainer = make_grpo_trainer(
        build_tiny_model(str(workdir / "model")),
        str(workdir / "out"),
        steps,
        report_to=["parquet"],
        rllog_options={"run_dir": str(workdir / "run")},
    )
    profile = cProfile.Profile()
    start = time.process_time()
    profile.enable()
    trainer.train()
    profile.disable()
    train_cpu = time.process_time() - start
    trainer.rllog_run.finish()
    stats = pstats.Stats(profile)
    own = sum(
        entry[3]
        for (filename, _, name), entry in stats.stats.items()
        if "/rllog/" in filename and name in INTEGRATION_ENTRY_POINTS
    )
    return {"steps": steps, "rllog_ms_per_step": own * 1e3 / steps, "train_cpu_ms_per_step": train_cpu * 1e3 / steps}


CASES = {
    "hot_path": case_hot_path,
    "delivery": case_delivery,
    "tables": case_tables,
    "health": case_health,
    "integration": case_integration,
}


def run(quick: bool, tmp: Path, which: list[str] | None = None) -> dict:
    which = which or ["hot_path", "delivery", "tables", "health", "integration"]
    results = {}
    if "hot_path" in which:
        progress("profiles: hot path")
        results["hot_path"] = run_case(SCRIPT, "hot_path", {}, tmp)
    if "delivery" in which:
        progress("profiles: delivery per sink")
        results["delivery"] = run_case(SCRIPT, "delivery", {"sinks": SIX, "steps": 40 if quick else 80}, tmp)
    if "health" in which:
        progress("profiles: health rules")
        results["health"] = run_case(SCRIPT, "health", {"steps": 500}, tmp)
    if "integration" in which:
        progress("profiles: the TRL mixin on the training thread")
        results["integration"] = run_case(SCRIPT, "integration", {"steps": 20 if quick else 40}, tmp)
    if "tables" in which:
        progress("profiles: parquet tables")
        results["tables"] = run_case(SCRIPT, "tables", {"rows": 1000, "count": 10}, tmp)
    return results


def delivery_table(results: dict) -> str:
    d = results.get("delivery", {})
    rows = [
        [
            name,
            s["cpu_ms_per_step"],
            s["wall_ms_per_step"],
            s["open_s"],
            ", ".join(f"{k} {v:.2f}" for k, v in s.get("calls_per_step", {}).items()),
            s["state"],
        ]
        for name, s in d.get("sinks", {}).items()
    ]
    if not rows:
        return ""
    rows.append(["**all six**", sum(r[1] for r in rows), sum(r[2] for r in rows), sum(r[3] for r in rows), "", ""])
    return md_table(
        ["sink", "CPU ms per step (process, tracker threads included)", "wall ms per step", "open s", "calls per step", "state"],
        rows,
    )


def render(results: dict) -> str:
    out = []
    if "hot_path" in results and "tottime" in results["hot_path"]:
        out += [
            f"**Hot path**, {results['hot_path']['calls']:,} `run.log` calls of 30 floats (cProfile, by own time):",
            "",
            "```",
            results["hot_path"]["tottime"],
            "```",
        ]
    if "delivery" in results and "sinks" in results["delivery"]:
        out += [
            "",
            f"**Delivery** of {results['delivery']['steps']} tiny-GRPO steps (30 metrics + a 16-row table each), per sink:",
            "",
            delivery_table(results),
        ]
        for name, s in results["delivery"]["sinks"].items():
            out += [
                "",
                f"`{name}` (cProfile on the delivering thread, open excluded, close included; by cumulative time):",
                "",
                "```",
                s["cumtime"],
                "```",
            ]
    if "health" in results and "tottime" in results["health"]:
        h = results["health"]
        out += [
            "",
            f"**Health rules** on the journal writer thread, {h['steps']} steps of 30 metrics: {h['ms_per_step']:.2f} ms per step "
            "(cProfile, by own time):",
            "",
            "```",
            h["tottime"],
            "```",
        ]
    if "integration" in results and "rllog_ms_per_step" in results["integration"]:
        i = results["integration"]
        out += [
            "",
            f"**The TRL mixin on the training thread**, tiny GRPO, {i['steps']} steps, parquet only (cProfile): rllog's entry points "
            f"({', '.join(f'`{n}`' for n in INTEGRATION_ENTRY_POINTS)}) take {i['rllog_ms_per_step']:.2f} ms per step, of "
            f"{i['train_cpu_ms_per_step']:.0f} ms of CPU per step for the whole training (under the profiler).",
        ]
    if "tables" in results and "cumtime" in results["tables"]:
        out += [
            "",
            "**Parquet writer**, 10 tables of 1,000 rows (cProfile, by cumulative time):",
            "",
            "```",
            results["tables"]["cumtime"],
            "```",
        ]
    return "\n".join(out)


if __name__ == "__main__":
    harness.module_main(run, render, CASES, __doc__)
