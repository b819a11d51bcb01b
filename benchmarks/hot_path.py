"""Hot path: the time the training thread spends in one ``log`` call of 30 GRPO-shaped metrics.

rllog with 0, 1, 3 and 6 sinks against the same metrics sent with each tracker's own API, through
accelerate's ``Accelerator.log`` and through a transformers ``Trainer.log()`` with ``report_to``.
Target: rllog <= 25 us median with 6 sinks, flat in the number of sinks.

Each configuration runs in its own process. Trackers are opened (and rllog's delivery agent has
delivered a first record, so its trackers are open too) before the timed calls; between two calls the loop does
2 ms of matrix products (a training step's compute: the core stays busy, the GIL is released as
kernels release it, and background threads and processes run as they would during training). Only the
``log`` call itself is timed (``perf_counter_ns``).

    .venv/bin/python benchmarks/hot_path.py [--quick]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import harness
from harness import FIVE, SIX, fmt_ratio, grpo_metrics, md_table, progress, ratio, run_case, summarize_ns, verdict

SCRIPT = Path(__file__).resolve()
TARGET_US = 25.0
GAP_MS = 2.0  # step work between two log calls


# --- direct tracker APIs, as a user would call them ------------------------------------------------------


class DirectWandb:
    name = "wandb"

    def open(self, project: str) -> None:
        import wandb

        self.run = wandb.init(project=project, mode="offline", dir=os.environ["WANDB_DIR"], config={"lr": 1e-3})

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class DirectTensorBoard:
    name = "tensorboard"

    def open(self, project: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(os.environ["TENSORBOARD_LOGGING_DIR"], project))

    def log(self, metrics: dict, step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class DirectMlflow:
    name = "mlflow"

    def __init__(self, uri: str | None = None):
        self.uri = uri

    def open(self, project: str) -> None:
        import mlflow

        if self.uri:
            mlflow.set_tracking_uri(self.uri)
        mlflow.set_experiment(project)
        self.run = mlflow.start_run()
        mlflow.log_params({"lr": 1e-3})

    def log(self, metrics: dict, step: int) -> None:
        import mlflow

        mlflow.log_metrics(metrics, step=step)

    def close(self) -> None:
        import mlflow

        mlflow.end_run()


class DirectTrackio:
    name = "trackio"

    def open(self, project: str) -> None:
        import trackio

        self.run = trackio.init(project=project, config={"lr": 1e-3}, auto_log_cpu=False, auto_log_gpu=False)

    def log(self, metrics: dict, step: int) -> None:
        import trackio

        trackio.log(metrics, step=step)

    def close(self) -> None:
        import trackio

        trackio.finish()


class DirectComet:
    name = "comet_ml"

    def open(self, project: str) -> None:
        import comet_ml

        harness.block_comet_probe()
        self.experiment = comet_ml.start(project_name=project, online=False)
        self.experiment.log_parameters({"lr": 1e-3})

    def log(self, metrics: dict, step: int) -> None:
        self.experiment.log_metrics(metrics, step=step)

    def close(self) -> None:
        self.experiment.end()


DIRECT = {
    "wandb": DirectWandb,
    "tensorboard": DirectTensorBoard,
    "mlflow": DirectMlflow,
    "trackio": DirectTrackio,
    "comet_ml": DirectComet,
}


def make_direct(name: str, mlflow_uri: str | None = None):
    return DirectMlflow(mlflow_uri) if name == "mlflow" else DIRECT[name]()


# --- the timed loop --------------------------------------------------------------------------------------


def timed_loop(
    call, batches: list, first_step: int, gap_ms: float, max_seconds: float | None = None, min_calls: int | None = None
) -> list[int]:
    """Time ``call(batch, step)`` for each batch, with ``gap_ms`` of untimed step work (:class:`harness.StepWork`)
    between calls. Stops early after ``max_seconds`` once ``min_calls`` are done (a 40 ms tracker call needs
    no 1000 samples)."""
    work = harness.StepWork(gap_ms)
    min_calls = 100 if min_calls is None else min_calls
    samples = []
    clock = time.perf_counter_ns
    deadline = time.monotonic() + max_seconds if max_seconds else None
    for i, batch in enumerate(batches):
        t0 = clock()
        call(batch, first_step + i)
        samples.append(clock() - t0)
        work()
        if deadline is not None and i + 1 >= min_calls and time.monotonic() > deadline:
            break
    return samples


class PartTimer:
    """Per-part timings inside one call (each tracker inside accelerate's or the Trainer's loop)."""

    def __init__(self):
        self.samples: dict[str, list[int]] = {}

    def wrap(self, name: str, fn):
        samples = self.samples.setdefault(name, [])
        clock = time.perf_counter_ns

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                samples.append(clock() - t0)

        return timed

    def reset(self) -> None:
        for samples in self.samples.values():
            samples.clear()

    def summary(self) -> dict:
        return {name: summarize_ns(s) for name, s in self.samples.items() if s}


def _batches(params: dict, start: int, count: int) -> list[dict]:
    n = params.get("n_metrics", 30)
    return [grpo_metrics(start + i, n) for i in range(count)]


def _gc_off() -> None:
    """The same for every configuration: collect, and freeze what exists, so a GC pass inside the timed calls
    only scans objects made since (the set-up's garbage would otherwise land in a random call)."""
    import gc

    gc.collect()
    gc.freeze()


# --- cases (each runs in its own process) ------------------------------------------------------------------


def _loop_params(params: dict) -> tuple[int, int, float, float | None]:
    return params.get("warmup", 50), params["calls"], params.get("gap_ms", GAP_MS), params.get("max_seconds")


def case_rllog(params: dict, workdir: Path) -> dict:
    """rllog.init(report_to=sinks) then ``run.log`` timed."""
    samples, info = measure_rllog(params, workdir / "run")
    return summarize_ns(samples) | info


def measure_rllog(params: dict, run_dir: Path) -> tuple[list[int], dict]:
    import rllog

    sinks = params.get("sinks") or []
    warmup, calls, gap, max_seconds = _loop_params(params)
    run = rllog.init(
        report_to=sinks or "none",
        project="bench-hot-path",
        name="rllog",
        delivery=params.get("delivery", "process"),
        config={"lr": 1e-3},
        run_dir=run_dir,
    )
    for step, batch in enumerate(_batches(params, 0, warmup)):
        run.log(batch, step=step)
    wait_for = params.get("wait_for", sinks)  # a sink that is down never gets there
    opened = harness.wait_delivered(run.run_dir, wait_for, warmup, timeout=180, settle=harness.SETTLE_S) if wait_for else 0.0
    batches = _batches(params, warmup, calls)
    _gc_off()
    samples = timed_loop(run.log, batches, warmup, gap, max_seconds, params.get("min_calls"))
    t = time.perf_counter()
    report = run.finish(timeout=params.get("finish_timeout", 600))
    states = {name: {"state": r.state, "delivered": r.delivered, "pending": r.pending} for name, r in report.items()}
    return samples, {
        "finish_s": time.perf_counter() - t,
        "delivered": report.ok,
        "agent_ready_s": opened,
        "report": str(report),
        "sinks": states,
        "records": run._seq,
    }


def case_rllog_series(params: dict, workdir: Path) -> dict:
    """Several rllog configurations one after the other in this one process, over rounds in alternating order
    (each run with its own delivery agent): the differences between them are not machine noise between
    processes. Samples are pooled over the rounds."""
    configs = params["configs"]
    order = []
    for r in range(params.get("rounds", 2)):
        order += configs if r % 2 == 0 else configs[::-1]
    pooled: dict[str, list[int]] = {c["label"]: [] for c in configs}
    info: dict[str, list[dict]] = {c["label"]: [] for c in configs}
    for i, config in enumerate(order):
        samples, extra = measure_rllog(
            config | {k: v for k, v in params.items() if k not in ("configs", "rounds")}, workdir / f"run{i}"
        )
        pooled[config["label"]].extend(samples)
        info[config["label"]].append(extra | {"median_us": summarize_ns(samples)["median_us"]})
    out = {}
    for label, samples in pooled.items():
        runs = info[label]
        out[label] = summarize_ns(samples) | {
            "run_medians_us": [r["median_us"] for r in runs],
            "finish_s": harness.median([r["finish_s"] for r in runs]),
            "delivered": all(r["delivered"] for r in runs),
            "agent_ready_s": harness.median([r["agent_ready_s"] for r in runs]),
        }
    return {"configs": out}


def case_direct(params: dict, workdir: Path) -> dict:
    """The trackers' own APIs, one after the other, per step."""
    trackers = [make_direct(n, params.get("mlflow_uri")) for n in params["trackers"]]
    for tracker in trackers:
        tracker.open("bench-hot-path")
    warmup, calls, gap, max_seconds = _loop_params(params)
    parts = PartTimer()
    logs = [parts.wrap(t.name, t.log) for t in trackers]

    def log(batch, step):
        for tracker_log in logs:
            tracker_log(batch, step)

    for step, batch in enumerate(_batches(params, 0, warmup)):
        log(batch, step)
    batches = _batches(params, warmup, calls)
    parts.reset()
    _gc_off()
    samples = timed_loop(log, batches, warmup, gap, max_seconds, params.get("min_calls"))
    t = time.perf_counter()
    for tracker in trackers:
        tracker.close()
    return summarize_ns(samples) | {"finish_s": time.perf_counter() - t, "parts": parts.summary()}


def case_accelerate(params: dict, workdir: Path) -> dict:
    """``Accelerator(log_with=...)``, ``init_trackers``, then ``accelerator.log`` timed."""
    if "comet_ml" in params["trackers"]:
        harness.block_comet_probe()
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, log_with=params["trackers"], project_dir=str(workdir / "accelerate"))
    accelerator.init_trackers("bench-hot-path", config={"lr": 1e-3}, init_kwargs={
        "wandb": {"mode": "offline", "dir": os.environ["WANDB_DIR"]},
        "trackio": {"auto_log_cpu": False, "auto_log_gpu": False},
        "comet_ml": {"online": False},
    })  # fmt: skip
    parts = PartTimer()
    for tracker in accelerator.trackers:
        tracker.log = parts.wrap(tracker.name, tracker.log)
    warmup, calls, gap, max_seconds = _loop_params(params)

    def log(batch, step):
        accelerator.log(batch, step=step)

    for step, batch in enumerate(_batches(params, 0, warmup)):
        log(batch, step)
    batches = _batches(params, warmup, calls)
    parts.reset()
    _gc_off()
    samples = timed_loop(log, batches, warmup, gap, max_seconds, params.get("min_calls"))
    t = time.perf_counter()
    accelerator.end_training()
    return summarize_ns(samples) | {"finish_s": time.perf_counter() - t, "parts": parts.summary()}


def make_trainer(workdir: Path, report_to, callbacks=()):
    """A minimal transformers Trainer on a tiny random Qwen2 (no data needed: only ``log`` is called).

    ``on_train_begin`` has run (trackers are set up there, as in training), so the Trainer's progress bar
    exists and its ``on_log`` prints the logs, as it does during training.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=300,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
    )
    args = TrainingArguments(
        output_dir=str(workdir / "out"),
        report_to=report_to,
        use_cpu=True,
        logging_steps=1,
        run_name="bench-trainer",
        save_strategy="no",
    )
    trainer = Trainer(model=model, args=args, callbacks=list(callbacks))
    trainer.state.epoch = 0.0
    trainer.state.max_steps = 10**6
    trainer.control = trainer.callback_handler.on_train_begin(trainer.args, trainer.state, trainer.control)
    return trainer


TRACKER_CALLBACKS = {
    "WandbCallback": "wandb",
    "TensorBoardCallback": "tensorboard",
    "MLflowCallback": "mlflow",
    "TrackioCallback": "trackio",
    "CometCallback": "comet_ml",
    "RLLogCallback": "rllog",
    "ProgressCallback": "progress bar",
}


def case_trainer(params: dict, workdir: Path) -> dict:
    """``Trainer.log(logs)`` with ``report_to`` naming the trackers (or rllog's callback), timed."""
    trackers = params.get("trackers") or []
    if "comet_ml" in trackers:
        import comet_ml  # noqa: F401

        harness.block_comet_probe()
    callbacks = []
    sinks = params.get("rllog_sinks")
    if sinks is not None:
        from rllog.integrations.transformers import RLLogCallback

        callbacks.append(RLLogCallback(report_to=sinks, project="bench-hot-path", run_dir=workdir / "run"))
    trainer = make_trainer(workdir, trackers or "none", callbacks)
    parts = PartTimer()
    for cb in trainer.callback_handler.callbacks:
        name = TRACKER_CALLBACKS.get(type(cb).__name__)
        if name:
            cb.on_log = parts.wrap(name, cb.on_log)
    warmup, calls, gap, max_seconds = _loop_params(params)

    def log(batch, step):
        trainer.state.global_step = step
        trainer.log(batch)

    for step, batch in enumerate(_batches(params, 1, warmup)):
        log(batch, step + 1)
    if sinks:
        harness.wait_delivered(callbacks[0].run.run_dir, sinks, warmup, timeout=180, settle=harness.SETTLE_S)
    batches = _batches(params, warmup + 1, calls)
    parts.reset()
    _gc_off()
    samples = timed_loop(log, batches, warmup + 1, gap, max_seconds, params.get("min_calls"))
    t = time.perf_counter()
    trainer.control = trainer.callback_handler.on_train_end(trainer.args, trainer.state, trainer.control)
    if sinks is not None:
        callbacks[0].run.finish(timeout=600)
    if "wandb" in trackers:
        import wandb

        wandb.finish()
    return summarize_ns(samples) | {"finish_s": time.perf_counter() - t, "parts": parts.summary()}


CASES = {
    "rllog": case_rllog,
    "rllog_series": case_rllog_series,
    "direct": case_direct,
    "accelerate": case_accelerate,
    "trainer": case_trainer,
}


# --- the comparison -------------------------------------------------------------------------------------


def start_mlflow_server(tmp: Path):
    sys.path.insert(0, str(harness.ROOT / "tests"))
    from mlflow_server import _stop
    from mlflow_server import start_mlflow_server as start

    proc, uri = start(tmp / "mlflow_server")
    return proc, uri, _stop


def configurations(quick: bool, mlflow_uri: str | None) -> list[tuple[str, str, str, dict]]:
    """(group, label, case, params) in the order they run. The rllog rows with process delivery run together
    in one process (case ``series``), interleaved over rounds."""
    out = [
        ("rllog", 'rllog, 0 sinks (report_to="none")', "series", {"sinks": []}),
        ("rllog", "rllog, 1 sink (parquet)", "series", {"sinks": ["parquet"]}),
        ("rllog", "rllog, 3 sinks (parquet, wandb, tensorboard)", "series", {"sinks": ["parquet", "wandb", "tensorboard"]}),
        ("rllog", "rllog, 6 sinks (" + ", ".join(SIX) + ")", "series", {"sinks": SIX}),
        ("rllog", "rllog, 0 sinks, back to back (no step work between calls)", "series", {"sinks": [], "gap_ms": 0.0}),
    ]
    if not quick:  # in its own process: thread delivery loads the trackers into it
        out.append(("rllog", 'rllog, 6 sinks, delivery="thread"', "rllog", {"sinks": SIX, "delivery": "thread"}))
    for name in [] if quick else FIVE:  # quick: each tracker's share is still timed inside the five (below)
        out.append(("direct", f"{name}, own API", "direct", {"trackers": [name]}))
        if name == "mlflow" and mlflow_uri:
            out.append(("direct", "mlflow, own API, local server", "direct", {"trackers": ["mlflow"], "mlflow_uri": mlflow_uri}))
    out.append(("direct", "all five, own APIs one after the other", "direct", {"trackers": FIVE}))
    if not quick:
        out.append(("accelerate", "Accelerator.log, log_with=all five", "accelerate", {"trackers": FIVE}))
        out.append(("trainer", 'Trainer.log, report_to="none"', "trainer", {"trackers": []}))
        out.append(("trainer", "Trainer.log, report_to=all five", "trainer", {"trackers": FIVE}))
        out.append(("trainer", "Trainer.log + RLLogCallback (6 sinks)", "trainer", {"trackers": [], "rllog_sinks": SIX}))
    return out


def merge_runs(rows: list[dict]) -> list[dict]:
    """One row per label: a configuration run twice gets the median of its runs' statistics."""
    merged: dict[str, dict] = {}
    for row in rows:
        if row["label"] not in merged:
            merged[row["label"]] = dict(row, runs=[row])
        else:
            merged[row["label"]]["runs"].append(row)
    out = []
    for row in merged.values():
        ok = [r for r in row.pop("runs") if "error" not in r]
        if len(ok) > 1:
            for key in ("median_us", "p99_us", "mean_us", "finish_s"):
                row[key] = harness.median([r.get(key) for r in ok])
            row["n"] = sum(r["n"] for r in ok)
            row["run_medians_us"] = [r["median_us"] for r in ok]
        elif ok:
            row = dict(ok[0])
        out.append(row)
    return out


def run(quick: bool, tmp: Path) -> dict:
    calls, max_seconds = (300, 4.0) if quick else (1000, 12.0)
    rounds = 1 if quick else 2
    configs = configurations(quick, mlflow_uri=None if quick else "server")
    rows = []
    series = [(group, label, params) for group, label, case, params in configs if case == "series"]
    progress(f"hot path: rllog with 0, 1, 3, 6 sinks and back to back, {rounds} round(s) in one process")
    result = run_case(
        SCRIPT,
        "rllog_series",
        {"configs": [p | {"label": label} for _, label, p in series], "rounds": rounds, "calls": calls, "max_seconds": None},
        tmp,
        timeout=1800,
    )
    for group, label, params in series:
        row = result.get("configs", {}).get(label, {"error": result.get("error", "missing")})
        rows.append({"group": group, "label": label, "case": "series", "params": params, **row})
    for group, label, case, params in configs:
        if case == "series":
            continue
        progress(f"hot path: {label}")
        params = params | {"calls": calls, "max_seconds": None if group == "rllog" else max_seconds}
        if params.get("mlflow_uri") == "server":
            # A real local mlflow server, up only for this configuration (idle, it still takes CPU from the others).
            try:
                server, uri, stop = start_mlflow_server(tmp)
            except Exception as exc:
                progress(f"hot path: no mlflow server ({exc})")
                continue
            try:
                result = run_case(SCRIPT, case, params | {"mlflow_uri": uri}, tmp)
            finally:
                stop(server)
        else:
            result = run_case(SCRIPT, case, params, tmp)
        rows.append({"group": group, "label": label, "case": case, "params": params, **result})
    return {"calls": calls, "max_seconds": max_seconds, "gap_ms": GAP_MS, "rounds": rounds, "rows": merge_runs(rows)}


def find(results: dict, label_start: str) -> dict | None:
    return next((r for r in results["rows"] if r["label"].startswith(label_start) and "error" not in r), None)


def targets(results: dict) -> list[dict]:
    six = find(results, "rllog, 6 sinks (")
    rllog_rows = [
        r
        for r in results["rows"]
        if r["group"] == "rllog" and not ({"delivery", "gap_ms"} & set(r["params"])) and "error" not in r
    ]
    medians = [r["median_us"] for r in rllog_rows]
    flat = (max(medians) / min(medians)) if medians else float("nan")
    out = [
        {
            "what": "hot path: rllog `log` median, 6 sinks",
            "target": f"<= {TARGET_US:.0f} us",
            "measured": f"{six['median_us']:.1f} us (p99 {six['p99_us']:.0f} us)" if six else "failed",
            "met": (six["median_us"] <= TARGET_US) if six else False,
            "by": f"{six['median_us'] / TARGET_US:.1f}x the target" if six and six["median_us"] > TARGET_US else "",
        },
        {
            "what": "hot path: flat in the number of sinks (0/1/3/6)",
            "target": "max/min median <= 1.25x",
            "measured": f"{flat:.2f}x (" + " / ".join(f"{m:.1f}" for m in medians) + " us)",
            "met": flat <= 1.25,
            "by": "",
        },
    ]
    return out


def render(results: dict) -> str:
    rows = results["rows"]
    six = find(results, "rllog, 6 sinks (")
    base = six["median_us"] if six else None
    table = []
    for r in rows:
        if "error" in r:
            table.append([r["label"], "failed", "", "", "", "", ""])
            continue
        vs = ratio(r["median_us"], base) if r["group"] != "rllog" else None
        label = r["label"] + (
            " (runs: " + " / ".join(f"{m:.1f}" for m in r["run_medians_us"]) + ")"
            if len(r.get("run_medians_us") or []) > 1
            else ""
        )
        table.append([label, r["median_us"], r["p99_us"], r["mean_us"], r["n"], fmt_ratio(vs) if vs else "", r.get("finish_s")])
    out = [
        f"30 GRPO-shaped float metrics per call; up to {results['calls']} timed calls per configuration after 50 untimed ones "
        f"(trackers' own loops stop after {results['max_seconds']:.0f} s, at least 100 calls); {results['gap_ms']:.0f} ms of step work "
        "(matrix products) between calls. rllog with process delivery: the 0/1/3/6-sink and back-to-back runs one after the "
        f"other in one process, {results.get('rounds', 1)} round(s) in alternating order, samples pooled (each run's median in brackets); "
        "every other configuration in its own process. rllog's timed calls start once its delivery agent has delivered a "
        "first record (trackers imported and open), as the other configurations start after their trackers' `init`.",
        "",
        md_table(["configuration", "median us", "p99 us", "mean us", "calls", "median / rllog 6 sinks", "finish/close s"], table),
    ]
    breakdown = []
    sources = [
        ("direct", "all five, own APIs"),
        ("accelerate", "Accelerator.log, log_with=all five"),
        ("trainer", "Trainer.log, report_to=all five"),
    ]
    for name in [*FIVE, "progress bar", "rllog"]:
        own = find(results, f"{name}, own API")
        cells = [name, own["median_us"] if own else None]
        for _, label in sources:
            row = find(results, label)
            part = (row or {}).get("parts", {}).get(name)
            cells.append(part["median_us"] if part else None)
        rl = find(results, "Trainer.log + RLLogCallback")
        part = (rl or {}).get("parts", {}).get(name)
        cells.append(part["median_us"] if part else None)
        if any(c is not None for c in cells[1:]):
            breakdown.append(cells)
    out += [
        "",
        "Where the time goes, per tracker (median us of that tracker's own call inside the loop):",
        "",
        md_table(
            [
                "tracker",
                "own API, alone",
                "in the five, own APIs",
                "in Accelerator.log",
                "in Trainer.log (its callback's on_log)",
                "in Trainer.log + RLLogCallback",
            ],
            breakdown,
        ),
    ]
    out += [
        "",
        md_table(
            ["target", "wanted", "measured", "result"],
            [
                [t["what"], t["target"], t["measured"] + (f"; {t['by']}" if t["by"] else ""), verdict(t["met"])]
                for t in targets(results)
            ],
        ),
    ]
    return "\n".join(out)


if __name__ == "__main__":
    harness.module_main(run, render, CASES, __doc__)
