"""End to end: the tiny local GRPO run (TRL, CPU, one torch thread) for the same number of steps with

(a) ``report_to="none"``,
(b) transformers' ``report_to`` with wandb, tensorboard, mlflow, trackio and comet_ml,
(c) the rllog mixin with the same five plus parquet (delivery in the agent process, the default),
(d) the same as (c) with ``delivery="thread"`` (the GIL cost of delivering inside the training process).

Target: (c) <= 1.05x (a). All the trainings run one after the other in one process (this comparison's
process), so that they share the machine's conditions: (a), (c) and (c) with Parquet alone interleaved
over three rounds (the target uses the median of the per-round ratios), then (c) started cold, (d), and
(b) last (it loads the trackers into the process). The timed window ("steady") runs from the start of
step 3 to the end of training: tracker set-up (transformers' callbacks run ``wandb.init`` etc. in
``on_train_begin``) and the first steps' warm-up are outside it; every step's logging from step 3 on is
inside it. ``train()`` as a whole is reported too.

Then a user's script, start to end, one fresh process per training, both ways torch can run (issue 34): (i) pinned to
one thread with a core to spare (the GPU-like case, where the agent finds idle cycles) and (ii) torch's default
threads on every core (a CPU script as written, where it does not).

    .venv/bin/python benchmarks/end_to_end.py [--quick]
    .venv/bin/python benchmarks/end_to_end.py --fresh-only [--rounds N] [--write-doc]   # only (i) and (ii)
    .venv/bin/python benchmarks/end_to_end.py --paired SECONDS [--steps N] [--threads one|default] [--json F]

``--paired`` settles issue 34's ``train()`` targets with many rounds in few processes (trainings next to each other
share the machine's speed, which here moves 20% between runs a few seconds apart), each target by the 95% interval
of its per-round ratios: met or missed only when the interval lies on one side of it.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import harness
from harness import FIVE, SIX, fmt_ratio, md_table, median, progress, ratio, run_case, verdict

SCRIPT = Path(__file__).resolve()
TARGET = 1.05
CONFIGS = {
    "a": ('(a) report_to="none"', {"mode": "none"}),
    "b": ("(b) transformers report_to=five trackers", {"mode": "transformers"}),
    "c": ('(c) rllog mixin, five + parquet, delivery="process"', {"mode": "rllog", "delivery": "process"}),
    "c0": (
        "(c, cold) as (c), training starts while the agent is still opening its trackers",
        {"mode": "rllog", "delivery": "process", "warm": False},
    ),
    "cp": (
        "(c, parquet only) the rllog mixin with its embedded default alone",
        {"mode": "rllog", "delivery": "process", "sinks": ["parquet"]},
    ),
    "d": ('(d) rllog mixin, five + parquet, delivery="thread"', {"mode": "rllog", "delivery": "thread"}),
}
CONVERSIONS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


class SyncCounter:
    """Counts every tensor -> host conversion (``.item()``, ``.tolist()``, ``.cpu()``...), per thread kind,
    into the dict given to :meth:`start`, until :meth:`stop`."""

    def __init__(self):
        import torch

        self.counts: dict[str, dict[str, int]] | None = None
        for name in CONVERSIONS:
            original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._spy(name, original))

    def start(self, counts: dict) -> None:
        self.counts = counts

    def stop(self) -> None:
        self.counts = None

    @property
    def active(self) -> bool:
        return self.counts is not None

    def _spy(self, name, original):
        def spy(tensor, *args, **kwargs):
            counts = self.counts
            if counts is not None:
                thread = threading.current_thread()
                who = (
                    "main thread"
                    if thread is threading.main_thread()
                    else ("rllog threads" if thread.name.startswith("rllog") else "other threads")
                )
                per = counts.setdefault(who, {})
                per[name] = per.get(name, 0) + 1
            return original(tensor, *args, **kwargs)

        return spy


class CpuClock:
    """CPU seconds over the timed window: the training thread, the rest of this process, the delivery agent."""

    def __init__(self, agent_pid: Callable[[], int | None]):
        self._agent_pid = agent_pid  # asked at start: a cold run's agent starts with train()
        self.agent_pid: int | None = None
        self.begin: dict | None = None
        self.end: dict | None = None

    @staticmethod
    def _ticks(path: str, children: bool = False) -> float:
        try:
            fields = open(path).read().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        ticks = int(fields[11]) + int(fields[12]) + ((int(fields[13]) + int(fields[14])) if children else 0)
        return ticks / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _scheduled(tid: int) -> dict:
        """The thread's seconds waiting for a CPU while runnable, and times it was preempted (Linux schedstat)."""
        try:
            waited = int(open(f"/proc/self/task/{tid}/schedstat").read().split()[1]) / 1e9
            status = open(f"/proc/self/task/{tid}/status").read()
            preempted = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
            sched = open(f"/proc/self/task/{tid}/sched").read()
            migrated = int(sched.split("se.nr_migrations")[1].split(":")[1].split()[0])
        except (OSError, IndexError, ValueError):
            return {}
        return {"waited": waited, "preempted": preempted, "migrated": migrated}

    def _sample(self) -> dict:
        main = threading.main_thread().native_id
        sample = {"process": self._ticks("/proc/self/stat"), "main": self._ticks(f"/proc/self/task/{main}/stat")}
        sample.update(self._scheduled(main))
        if self.agent_pid is not None:
            sample["agent"] = self._ticks(f"/proc/{self.agent_pid}/stat", children=True)
        return sample

    def start(self) -> None:
        self.agent_pid = self._agent_pid()
        self.begin = self._sample()

    def stop(self) -> None:
        self.end = self._sample()

    def window(self) -> dict:
        if not self.begin or not self.end:
            return {}
        d = {k: self.end[k] - self.begin[k] for k in self.end}
        out = {"cpu_main_s": d["main"], "cpu_other_threads_s": d["process"] - d["main"]}
        if "waited" in d:
            out["main_waited_s"], out["main_preempted"] = d["waited"], d["preempted"]
            out["main_migrated"] = d.get("migrated")
        if "agent" in d:
            out["cpu_agent_s"] = d["agent"]
        return out


def grpo_trainer(model_dir: str, output_dir: str, steps: int, mode: str, delivery: str, workdir: Path, sinks: list[str] = SIX):
    """The demo's tiny GRPO set-up: with the rllog mixin (``rllog.demo.make_grpo_trainer``) or a plain
    GRPOTrainer with the very same settings."""
    from rllog import demo

    if mode == "rllog":
        options = {"project": "bench-e2e", "name": f"rllog-{delivery}", "run_dir": str(workdir / "run"), "delivery": delivery}
        return demo.make_grpo_trainer(model_dir, output_dir, steps, report_to=list(sinks), rllog_options=options)
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    settings = demo.grpo_settings(output_dir, steps, list(FIVE) if mode == "transformers" else "none", run_name="bench-e2e")
    return GRPOTrainer(
        model=model_dir,
        reward_funcs=[demo.reward_has_digit, demo.reward_short],
        args=GRPOConfig(**settings),
        train_dataset=Dataset.from_dict({"prompt": demo.PROMPTS}),
    )


def train_once(params: dict, model_dir: str, workdir: Path, counter: SyncCounter | None = None) -> dict:
    """One GRPO training of configuration ``params`` (mode, delivery, sinks, warm, steps) in this process."""
    import gc

    from transformers import TrainerCallback

    mode, steps, delivery = params["mode"], params["steps"], params.get("delivery", "process")
    if mode == "transformers":
        import comet_ml  # noqa: F401  (transformers' CometCallback imports it; the probe must be off first)

        harness.block_comet_probe()
    marks: dict = {}
    step_begins: list[float] = []
    counts: dict = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            marks["train_begin"] = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            step_begins.append(time.perf_counter())
            if len(step_begins) == 3:
                marks["cpu"].start()
                if counter is not None:
                    counter.start(counts)

        def on_step_end(self, args, state, control, **kwargs):
            marks["step_end"] = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            marks["train_end"] = time.perf_counter()
            marks["cpu"].stop()
            if counter is not None:
                counter.stop()

    trainer = grpo_trainer(model_dir, str(workdir), steps, mode, delivery, workdir, params.get("sinks", SIX))
    trainer.add_callback(Clock())
    agent_ready_s = None
    if mode == "rllog" and params.get("warm", True):
        # As with transformers' callbacks, whose trackers are set up in on_train_begin (outside the timed
        # window): wait until rllog's trackers are imported and open (a first record delivered to each).
        run = trainer.rllog_callback.start(trainer.args, trainer.model, trainer.state)  # what train() would do first
        run.log({"bench/warmup": 0.0}, step=0)
        agent_ready_s = harness.wait_delivered(run.run_dir, run.sink_names, 1, timeout=300, settle=harness.SETTLE_S)

    trainer_ref = weakref.ref(trainer)

    def agent_pid() -> int | None:
        agent = getattr(getattr(trainer_ref(), "rllog_run", None), "_agent", None)
        return agent.pid if agent is not None else None

    marks["cpu"] = CpuClock(agent_pid)
    gc.collect()
    collections_before = [g["collections"] for g in gc.get_stats()]
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    gc_collections = [g["collections"] - b for g, b in zip(gc.get_stats(), collections_before, strict=True)]
    result = {
        "train_s": train_s,
        "steady_s": marks["train_end"] - step_begins[2],
        "steady_steps": len(step_begins) - 2,
        "setup_s": step_begins[0] - marks["train_begin"],
        "tail_s": t0 + train_s - marks["step_end"],
        "agent_ready_s": agent_ready_s,
        "gc_collections": gc_collections,  # per generation, during train(): the trainer's garbage collector's work
    }
    result.update(marks["cpu"].window())
    # The work done, to check that configurations trained alike (same seed, same completions): tokens seen, and the
    # completions' lengths step by step.
    history = trainer.state.log_history
    result["num_tokens"] = max((h.get("num_tokens", 0) for h in history), default=0)
    result["completion_lengths"] = [h["completions/mean_length"] for h in history if "completions/mean_length" in h]
    diffs = [b - a for a, b in itertools.pairwise(step_begins)]
    result["step_median_ms"] = median(diffs) * 1e3 if diffs else None
    result["step_ms"] = [round(d * 1e3, 2) for d in diffs]  # step by step: whether a cost grows over the run
    t = time.perf_counter()
    if mode == "rllog":
        report = trainer.rllog_run.finish(timeout=600)
        result.update(delivered=report.ok, report=str(report), run_dir=str(trainer.rllog_run.run_dir))
    elif mode == "transformers":
        import trackio
        import wandb

        wandb.finish()
        try:
            trackio.finish()
        except Exception:
            pass
    result["finish_s"] = time.perf_counter() - t
    if counter is not None:
        result["syncs"] = counts
        result["synced_steps"] = len(step_begins) - 2
    del trainer
    gc.collect()
    return result


def _setup(params: dict, workdir: Path):
    import torch

    from rllog import demo

    if params.get("threads", "one") == "one":
        torch.set_num_threads(1)
    counter = SyncCounter() if params.get("count_syncs") else None
    return demo.build_tiny_model(str(workdir / "model")), counter


def case_grpo(params: dict, workdir: Path) -> dict:
    """One configuration, alone in this process; with ``params["prepare"]`` the script starts with
    ``rllog.prepare`` as docs/trl.md recommends (the trackers import while torch, TRL and the model load)."""
    if params.get("prepare"):
        import rllog

        rllog.prepare(params.get("sinks", SIX))
    model_dir, counter = _setup(params, workdir)
    return train_once(params, model_dir, workdir / "out", counter)


def case_series(params: dict, workdir: Path) -> dict:
    """Every configuration of ``params["order"]`` one after the other in this one process (the same machine
    conditions for all, interleaved in time), after an untimed warm-up training."""
    model_dir, counter = _setup(params, workdir)
    train_once({"mode": "none", "steps": 6}, model_dir, workdir / "warmup")
    runs = []
    for i, (key, round_) in enumerate(params["order"]):
        label, config = CONFIGS[key]
        print(f"[{time.strftime('%H:%M:%S')}] {label}", flush=True)
        result = train_once(config | {"steps": params["steps"]}, model_dir, workdir / f"run{i}-{key}", counter)
        runs.append({"key": key, "round": round_, **result})
    return {"runs": runs}


def case_whole(params: dict, workdir: Path) -> dict:
    """Whole ``train()`` wall time, start-up included: (a) ``report_to="none"`` against (c, cold) the mixin with the
    five trackers + parquet, started together with training, at each length of ``params["lengths"]``, interleaved
    over ``params["rounds"]`` rounds in this one process (after an untimed warm-up training)."""
    model_dir, _ = _setup(params, workdir)
    train_once({"mode": "none", "steps": 6}, model_dir, workdir / "warmup")
    runs = []
    for steps in params["lengths"]:
        for round_ in range(params["rounds"]):
            for key in ("a", "c0") if round_ % 2 == 0 else ("c0", "a"):
                label, config = CONFIGS[key]
                print(f"[{time.strftime('%H:%M:%S')}] {steps} steps, round {round_}: {label}", flush=True)
                result = train_once(config | {"steps": steps}, model_dir, workdir / f"whole-{steps}-{round_}-{key}")
                runs.append({"key": key, "round": round_, "steps": steps, **result})
    return {"runs": runs}


def whole_ratios(whole: dict, key: str = "c0", measure: str = "train_s") -> dict[int, list[float]]:
    """Per length: ``key``'s ``measure`` / (a)'s, round by round."""
    out: dict[int, list[float]] = {}
    for run in whole.get("runs", []):
        if run["key"] != key or "error" in run:
            continue
        base = next(
            (
                x
                for x in whole["runs"]
                if x["key"] == "a" and x["steps"] == run["steps"] and x["round"] == run["round"] and "error" not in x
            ),
            None,
        )
        if base:
            out.setdefault(run["steps"], []).append(run[measure] / base[measure])
    return out


FRESH_ROUNDS = 7  # a fresh 60-step training takes ~2 s; single rounds swing +-5%, so a median needs several
FRESH = {
    "a": {"mode": "none"},
    "c0p": {"mode": "rllog", "delivery": "process", "warm": False, "prepare": True},
    "cpp": {"mode": "rllog", "delivery": "process", "warm": False, "prepare": True, "sinks": ["parquet"]},
}
FRESH_LABELS = {
    "a": 'report_to="none"',
    "c0p": "five trackers + parquet, `rllog.prepare` at the top",
    "cpp": "parquet alone, `rllog.prepare` at the top",
}
THREADS_LABELS = {
    "one": "(i) torch on one thread, a spare core (the GPU-like case)",
    "default": "(ii) torch's default threads on every core (a CPU script as written)",
}
# Issue 34's targets, per torch threading: configuration -> {steps (None: any) -> highest train() / (a) train()}.
FRESH_TARGETS = {
    "one": {"c0p": {None: 1.03}, "cpp": {None: 1.03}},
    "default": {"c0p": {60: 1.15, 240: 1.10}, "cpp": {None: 1.03}},
}


def round_order(keys: tuple[str, ...], round_: int) -> tuple[str, ...]:
    """The order of ``keys`` in round ``round_``: rotated by one each round and reversed every other round, so that
    each configuration runs in each position and after each other one as the rounds go."""
    shift = round_ % len(keys)
    order = keys[shift:] + keys[:shift]
    return order if round_ % 2 == 0 else tuple(reversed(order))


def fresh_processes(
    lengths: list[int],
    rounds: int,
    tmp: Path,
    threads_modes: tuple[str, ...] = ("one",),
    keys: tuple[str, ...] = ("a", "c0p"),
    budget: float | None = None,
) -> dict:
    """A user's script, start to end: each training in a fresh process that imports torch and TRL, builds the model
    and the trainer, trains and finishes; ``keys`` (``FRESH``: (a) ``report_to="none"``, the mixin with five trackers
    + parquet, the mixin with parquet alone) interleaved over ``rounds``, the order rotated each round, for each torch
    threading of ``threads_modes`` (``"one"``: pinned to one thread; ``"default"``: torch's defaults, every core).
    ``budget`` (seconds, for a lent machine's time limit): no round is started that the last one says would not fit;
    with it, give one threading and one length, as the rounds of the others would not be reached."""
    runs = []
    started = time.perf_counter()
    for threads in threads_modes:
        for steps in lengths:
            for round_ in harness.rounds_within(rounds, budget, since=started):
                for key in round_order(keys, round_):
                    progress(f"end to end, fresh process, threads={threads}: {key}, {steps} steps, round {round_}")
                    params = FRESH[key] | {"steps": steps, "threads": threads}
                    result = run_case(SCRIPT, "grpo", params, tmp, timeout=900, threads=threads)
                    runs.append({"key": key, "round": round_, "steps": steps, "threads": threads, **result})
    return {"runs": runs}


FLOOR_MARGIN = 1.05  # issue 34: the whole script at most the trackers' own unavoidable cost + 5%


def tracker_floor(fresh: dict, tmp: Path) -> dict[str, dict[str, float]]:
    """Per length, the five trackers' own CPU seconds for the records of one (ii) five-tracker run: each tracker alone
    in a fresh process, called through its own API (``attribution.py``'s floor: import, start, writes, finish)."""
    import attribution

    floors: dict[str, dict[str, float]] = {}
    runs = [r for r in fresh.get("runs", []) if r["key"] == "c0p" and r.get("threads") == "default" and r.get("run_dir")]
    for steps in sorted({r["steps"] for r in runs}):
        run_dir = next(r["run_dir"] for r in runs if r["steps"] == steps)
        per_tracker = {}
        for name in FIVE:
            progress(f"end to end: the floor, {name} alone through its own API, the records of a {steps}-step run")
            direct = run_case(attribution.SCRIPT, "direct", {"tracker": name, "run_dir": run_dir}, tmp, threads="default")
            if "error" in direct:
                break
            per_tracker[name] = sum(direct["phases_cpu_s"].values())
        else:
            floors[str(steps)] = per_tracker
    return floors


def floor_ratios(fresh: dict) -> dict[int, list[float]]:
    """Per length, round by round: the (ii) five-tracker script's wall time / ((a)'s + the trackers' floor). With every
    core busy, the trackers' own CPU seconds come out of training whoever spends them; rllog's machinery is the rest."""
    out: dict[int, list[float]] = {}
    runs = [r for r in fresh.get("runs", []) if r.get("threads") == "default" and "error" not in r]
    for steps_key, per_tracker in fresh.get("floor", {}).items():
        steps, floor = int(steps_key), sum(per_tracker.values())
        for round_ in sorted({r["round"] for r in runs if r["steps"] == steps}):
            mine = {r["key"]: r for r in runs if r["steps"] == steps and r["round"] == round_}
            if "a" in mine and "c0p" in mine:
                out.setdefault(steps, []).append(mine["c0p"]["process_wall_s"] / (mine["a"]["process_wall_s"] + floor))
    return out


def fresh_ratios(fresh: dict, threads: str, key: str, measure: str) -> dict[int, list[float]]:
    """Per length: ``key``'s ``measure`` / (a)'s in the same round, for one torch threading."""
    runs = [r for r in fresh.get("runs", []) if r.get("threads", "one") == threads]
    return whole_ratios({"runs": runs}, key, measure)


def render_both_ways(fresh: dict) -> str:
    """The fresh-process comparison for each torch threading: seconds (medians) and ratios to (a) round by round."""
    rows = []
    for threads, threads_label in THREADS_LABELS.items():
        runs = [r for r in fresh.get("runs", []) if r.get("threads", "one") == threads and "error" not in r]
        for steps in sorted({r["steps"] for r in runs}):
            for key in FRESH:
                mine = [r for r in runs if r["key"] == key and r["steps"] == steps]
                if not mine:
                    continue
                train = fresh_ratios(fresh, threads, key, "train_s").get(steps, [])
                whole = fresh_ratios(fresh, threads, key, "process_wall_s").get(steps, [])
                rows.append(
                    [
                        threads_label,
                        steps,
                        FRESH_LABELS[key],
                        median([r["train_s"] for r in mine]),
                        fmt_ratio(median(train)) if train else "",
                        ", ".join(f"{x:.2f}" for x in train),
                        median([r.get("process_wall_s") for r in mine]),
                        fmt_ratio(median(whole)) if whole else "",
                        median([r.get("step_median_ms") for r in mine]),
                        median([r.get("finish_s") for r in mine]),
                        len(mine),
                    ]
                )
    return md_table(
        [
            "torch threads",
            "steps",
            "configuration",
            "train() s",
            "train() / (a)",
            "per round",
            "whole script s",
            "script / (a)",
            "median step ms",
            "finish s",
            "runs",
        ],
        rows,
    )


def train_targets(measured: dict, where: str, labels: dict[str, str]) -> list[dict]:
    """Issue 34's targets for ``train()`` (start-up included) per torch threading, each settled by the 95% interval of
    its per-round ratios (``harness.interval_verdict``) or not settled; ``where`` and ``labels`` name the design."""
    out = []
    for threads, by_key in FRESH_TARGETS.items():
        for key, limits in by_key.items():
            for steps, ratios in sorted(fresh_ratios(measured, threads, key, "train_s").items()):
                limit = limits.get(steps, limits.get(None))
                if limit is None:
                    continue
                met, text = harness.interval_verdict(ratios, limit)
                out.append(
                    {
                        "what": f"{where}, {THREADS_LABELS[threads].split(' (')[0]}: train() with {labels[key]}, "
                        f"{steps} steps / (a) none",
                        "target": f"<= {limit}x",
                        "measured": text,
                        "met": met,
                    }
                )
    return out


def fresh_targets(fresh: dict) -> list[dict]:
    """``train_targets`` of fresh processes, and the whole script against the trackers' floor, settled the same way."""
    out = train_targets(fresh, "fresh process", FRESH_LABELS)
    for steps, ratios in sorted(floor_ratios(fresh).items()):
        floor = sum(fresh["floor"][str(steps)].values())
        met, measured = harness.interval_verdict(ratios, FLOOR_MARGIN)
        out.append(
            {
                "what": f"fresh process, {THREADS_LABELS['default'].split(' (')[0]}: the whole script with "
                f"{FRESH_LABELS['c0p']}, {steps} steps / ((a) none's + the five trackers' own {floor:.1f} CPU s)",
                "target": f"<= {FLOOR_MARGIN}x",
                "measured": measured,
                "met": met,
            }
        )
    return out


PAIRED_KEYS = ("a", "cpp", "c0p")
PAIRED_ROUNDS_PER_PROCESS = 8  # several processes: a process's memory layout is one draw, and its speed can stick to it
PAIRED_STEPS = 60
PAIRED_LABELS = {
    "c0p": "five trackers + parquet, `rllog.prepare` as the trainer is built",
    "cpp": "parquet alone, `rllog.prepare` as the trainer is built",
}


def case_paired(params: dict, workdir: Path) -> dict:
    """Rounds of ``params["keys"]`` (``FRESH``'s configurations) in this one process, both torch threadings in each
    round, after an untimed warm-up of each. Neighbouring trainings share the machine's speed, which moves by more
    than a few percent from one process to the next here. Each rllog training calls ``rllog.prepare`` just before its
    trainer is built (a new agent each time, as in a script whose model loads in a second) and ``finish``es."""
    import torch

    import rllog
    from rllog import demo

    every_core = torch.get_num_threads()
    model_dir = demo.build_tiny_model(str(workdir / "model"))
    keys, steps = tuple(params["keys"]), params["steps"]

    def train(key: str, threads: str, name: str, steps: int) -> dict:
        torch.set_num_threads(1 if threads == "one" else every_core)
        config = FRESH[key] | {"steps": steps}
        if config.get("prepare"):
            rllog.prepare(config.get("sinks", SIX))
        return train_once(config, model_dir, workdir / name)

    for key in keys:  # rllog's own lazy imports happen here, once, as in any process
        train(key, "one", f"warmup-{key}", 6)
    runs = []
    for round_ in range(params["rounds"]):
        for threads in params["threads"] if round_ % 2 == 0 else tuple(reversed(params["threads"])):
            for key in round_order(keys, round_):
                result = train(key, threads, f"r{round_}-{threads}-{key}", steps)
                runs.append({"key": key, "round": round_, "threads": threads, "steps": steps, **result})
    return {"runs": runs, "threads_every_core": every_core}


def paired_series(
    tmp: Path,
    budget: float,
    steps: int = PAIRED_STEPS,
    threads_modes: tuple[str, ...] = harness.THREAD_MODES,
    save: Path | None = None,
    keys: tuple[str, ...] = PAIRED_KEYS,
) -> dict:
    """``case_paired`` in one process after another, ``PAIRED_ROUNDS_PER_PROCESS`` rounds each, until ``budget``
    seconds would be exceeded; the rounds are numbered across processes. ``save``: rewritten after each process."""
    runs: list[dict] = []
    for process in harness.rounds_within(sys.maxsize, budget):
        progress(f"end to end, paired rounds in one process: process {process}, {len(runs)} trainings so far")
        params = {"keys": keys, "steps": steps, "rounds": PAIRED_ROUNDS_PER_PROCESS, "threads": threads_modes}
        result = run_case(SCRIPT, "paired", params, tmp, timeout=max(budget, 600), threads="default")
        base = process * PAIRED_ROUNDS_PER_PROCESS
        runs += [r | {"round": base + r["round"], "process": process} for r in result.get("runs", [])]
        if save is not None:
            save.write_text(json.dumps({"runs": runs}, indent=1, default=float))
        if "error" in result:
            break
    return {"runs": runs}


def paired_targets(paired: dict) -> list[dict]:
    """``train_targets`` of paired rounds (``case_paired``)."""
    return train_targets(paired, "paired rounds", PAIRED_LABELS)


CASES = {"grpo": case_grpo, "series": case_series, "whole": case_whole, "paired": case_paired}

# The fresh-process comparison is a marked part of docs/benchmarks.md, so that ``--fresh-only --write-doc`` can
# refresh it alone (on a quiet machine) without the rest of the page.
BOTH_WAYS_BEGIN = "<!-- end_to_end: fresh processes, both torch threadings (begin) -->"
BOTH_WAYS_END = "<!-- end_to_end: fresh processes, both torch threadings (end) -->"


def render_floor(fresh: dict) -> list[str]:
    """The trackers' floor per length, as a paragraph (none if it was not measured)."""
    floors = fresh.get("floor", {})
    if not floors:
        return []
    parts = [
        f"{steps} steps: {sum(p.values()):.1f} CPU s (" + ", ".join(f"{n} {v:.1f}" for n, v in p.items()) + ")"
        for steps, p in sorted(floors.items(), key=lambda kv: int(kv[0]))
    ]
    return [
        "**The floor** (issue 34, point 2): the five trackers' own CPU seconds for the records of one (ii) five-tracker "
        "run, each tracker alone in a fresh process through its own API (`attribution.py`'s `direct` case: import, "
        "start, writes, finish; MLflow's store new each time, as in every benchmark process): "
        + "; ".join(parts)
        + ". With every core busy, those seconds come out of training whoever spends them, so the whole script's "
        "floor is (a)'s wall time plus them, and rllog's machinery is what the five-tracker script takes above that.",
        "",
    ]


def render_fresh(fresh: dict) -> str:
    """The fresh-process part: both torch threadings side by side, which one to expect where, and its targets."""
    when = fresh.get("measured", "")
    return "\n".join(
        [
            f"**Fresh processes, both torch threadings**{' (' + when + ')' if when else ''}: a user's script, start to end "
            "(imports, the model, the trainer, `train()`, `finish`), one process per training, the configurations "
            "interleaved round by round. `train()` includes the start-up of delivery; `whole script` is the process's "
            "wall time. Which one to expect: on a GPU, training leaves the CPUs mostly idle, so the agent has a core, "
            "as in (i); a CPU-bound script that lets torch use every core is (ii), where the agent's work (imports, "
            "opening the trackers, each step's writes) takes CPU from training unless it finds idle cycles; "
            "`benchmarks/attribution.py` says where those seconds go.",
            "",
            render_both_ways(fresh),
            "",
            *render_floor(fresh),
            md_table(
                ["target", "wanted", "measured", "result"],
                [[t["what"], t["target"], t["measured"], verdict(t["met"])] for t in fresh_targets(fresh)],
            ),
        ]
    )


def render_paired(paired: dict) -> str:
    """Issue 34's train() targets from paired rounds, with their intervals."""
    rows = [[t["what"], t["target"], t["measured"], verdict(t["met"])] for t in paired_targets(paired)]
    return md_table(["target", "wanted", "measured", "result"], rows)


def replace_doc_part(text: str, begin: str, end: str, part: str) -> str:
    """``text`` with what lies between the markers ``begin`` and ``end`` replaced by ``part`` (appended, with its
    markers, when the text has none)."""
    block = f"{begin}\n{part}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        return head + block + rest.split(end, 1)[1]
    return text.rstrip("\n") + "\n\n" + block + "\n"


def main() -> None:
    """``--fresh-only``: just the fresh-process comparison, both torch threadings (``--write-doc``: into its part of
    docs/benchmarks.md); otherwise the whole section, as ``benchmarks/run.py`` runs it."""
    import argparse
    import datetime
    import tempfile

    if "--worker" in sys.argv:
        harness.worker_main(CASES)
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round of 60 steps (a check that it runs, not a figure)")
    parser.add_argument("--fresh-only", action="store_true", help="only the fresh-process comparison, both torch threadings")
    parser.add_argument("--rounds", type=int, default=None, help=f"rounds per length with --fresh-only (default {FRESH_ROUNDS})")
    parser.add_argument(
        "--threads",
        choices=[*harness.THREAD_MODES, "both"],
        default="both",
        help="with --fresh-only or --paired: which torch threading",
    )
    parser.add_argument("--write-doc", action="store_true", help="with --fresh-only: write it into docs/benchmarks.md")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--budget", type=float, help="with --fresh-only: seconds; no round is started that would not fit")
    parser.add_argument(
        "--paired",
        type=float,
        metavar="SECONDS",
        help="only issue 34's train() targets, from rounds in one process (several processes), for this many seconds",
    )
    parser.add_argument("--steps", type=int, help=f"with --paired: steps per training (default {PAIRED_STEPS})")
    parser.add_argument(
        "--only",
        choices=[k for k in PAIRED_KEYS if k != "a"],
        help="with --paired: rounds of that configuration and none alone, next to each other (three times the rounds "
        "an hour, and each round's ratio spreads about half as much)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rllog-bench-") as tmp:
        if args.paired:
            modes = harness.THREAD_MODES if args.threads == "both" else (args.threads,)
            save = Path(args.json) if args.json else None
            keys = ("a", args.only) if args.only else PAIRED_KEYS
            results = paired_series(Path(tmp), args.paired, args.steps or PAIRED_STEPS, modes, save, keys)
            results["measured"] = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
            text = render_paired(results)
        elif args.fresh_only:
            lengths = [60] if args.quick else [60, 240]
            rounds = args.rounds or (1 if args.quick else FRESH_ROUNDS)
            modes = harness.THREAD_MODES if args.threads == "both" else (args.threads,)
            results = fresh_processes(lengths, rounds, Path(tmp), modes, tuple(FRESH), args.budget)
            results["floor"] = tracker_floor(results, Path(tmp))
            load = "/".join(f"{x:.2f}" for x in os.getloadavg())
            results["measured"] = (
                f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load average {load} at the end"
            )
            text = render_fresh(results)
        else:
            results = run(args.quick, Path(tmp))
            text = render(results)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))
    if args.write_doc and args.fresh_only:
        doc = harness.ROOT / "docs" / "benchmarks.md"
        doc.write_text(replace_doc_part(doc.read_text(), BOTH_WAYS_BEGIN, BOTH_WAYS_END, text))


def plan(quick: bool) -> list[tuple[str, int]]:
    """(configuration, round) in the order they run, all in one process: (a), (c) and (c, parquet only)
    interleaved over rounds; then (c, cold), (d) and, last, transformers' (b) (which, like (d), loads the
    trackers into the process)."""
    rounds = [["a", "c", "cp"], ["cp", "c", "a"], ["a", "c", "cp"]]
    if quick:
        return [(k, 0) for k in rounds[0]] + [("d", 0)]
    order = [(k, r) for r, keys in enumerate(rounds) for k in keys]
    return [*order, ("c0", 0), ("d", 0), ("d", 1), ("b", 0)]


def run(quick: bool, tmp: Path) -> dict:
    steps = 20 if quick else 80
    order = plan(quick)
    progress(f"end to end: {len(order)} tiny GRPO trainings of {steps} steps in one process: " + " ".join(k for k, _ in order))
    # Conversions are counted in every run (a counter per .item()/.tolist() call: far below 0.1% of a step).
    result = run_case(SCRIPT, "series", {"steps": steps, "order": order, "count_syncs": True}, tmp, timeout=1800)
    runs = result.get("runs", [])
    if "error" in result:
        runs = [{"key": k, "round": r, "error": result["error"]} for k, r in order]
    lengths, rounds = ([60], 1) if quick else ([60, 240], 3)
    progress(f"end to end, whole train() with start-up: (a) and (c, cold) at {lengths} steps, {rounds} round(s)")
    whole = run_case(SCRIPT, "whole", {"lengths": lengths, "rounds": rounds}, tmp, timeout=3600)
    # Fresh processes are what users run, and this machine's run-to-run noise (+-15%) needs more rounds there.
    fresh = fresh_processes(lengths, rounds if quick else FRESH_ROUNDS, tmp, harness.THREAD_MODES, tuple(FRESH))
    fresh["floor"] = tracker_floor(fresh, tmp)
    return {"steps": steps, "rounds": 1 + max(r for _, r in order), "runs": runs, "order": order, "whole": whole, "fresh": fresh}


def summary(results: dict) -> dict[str, dict]:
    out = {}
    for key in CONFIGS:
        ok = [r for r in results["runs"] if r["key"] == key and "error" not in r]
        if not ok:
            continue
        out[key] = {
            "steady_s": median([r["steady_s"] for r in ok]),
            "train_s": median([r["train_s"] for r in ok]),
            "step_ms": median([r["step_median_ms"] for r in ok]),
            "finish_s": median([r.get("finish_s") for r in ok]),
            "agent_ready_s": median([r.get("agent_ready_s") for r in ok]),
            "cpu_main_s": median([r.get("cpu_main_s") for r in ok]),
            "cpu_other_threads_s": median([r.get("cpu_other_threads_s") for r in ok]),
            "cpu_agent_s": median([r.get("cpu_agent_s") for r in ok]),
            "runs": len(ok),
            "all_steady": [r["steady_s"] for r in ok],
            "delivered": all(r.get("delivered", True) for r in ok),
        }
    return out


def round_ratios(results: dict, key: str, base: str = "a") -> list[float]:
    """``key``'s steady time over ``base``'s, round by round (runs next to each other in time)."""
    out = []
    for r in sorted({run["round"] for run in results["runs"]}):
        mine = next((x for x in results["runs"] if x["key"] == key and x["round"] == r and "error" not in x), None)
        theirs = next((x for x in results["runs"] if x["key"] == base and x["round"] == r and "error" not in x), None)
        if mine and theirs:
            out.append(mine["steady_s"] / theirs["steady_s"])
    return out


def targets(results: dict) -> list[dict]:
    per_round = round_ratios(results, "c")
    met, text = harness.interval_verdict(per_round, TARGET) if per_round else (None, "-")
    out = [
        {
            "what": "end to end: (c) rllog mixin / (a) report_to=none, steady training time (per-round ratios)",
            "target": f"<= {TARGET}x",
            "measured": text,
            "met": met,
        }
    ]
    whole = [
        ("whole", "c0", "train_s", "whole train() incl. start-up, in one process, trainer built just before: (c, cold)"),
        ("fresh", "c0p", "train_s", "whole train() incl. start-up, fresh process with rllog.prepare at the top: (c0p)"),
        ("fresh", "c0p", "process_wall_s", "the whole script (imports, model, train(), finish), fresh process: (c0p)"),
    ]
    for part, key, measure, what in whole:
        measured = results.get(part, {})
        if part == "fresh":  # these targets are the pinned case's; fresh_targets covers both
            measured = {"runs": [r for r in measured.get("runs", []) if r.get("threads", "one") == "one"]}
        for steps, ratios in sorted(whole_ratios(measured, key, measure).items()):
            met, text = harness.interval_verdict(ratios, TARGET)
            out.append(
                {
                    "what": f"end to end, {what}, {steps} steps, five trackers + parquet / (a) none",
                    "target": f"<= {TARGET}x",
                    "measured": text,
                    "met": met,
                }
            )
    return out + fresh_targets(results.get("fresh", {}))


# What was measured while choosing how to cut the start-up and per-step cost (2026-11-24, tiny GRPO, five trackers +
# parquet; each figure from interleaved runs on this machine). Kept as text: these were one-off experiments.
LEVERS = """Levers measured for the whole `train()` (tiny GRPO, five trackers + parquet):

- **Where the agent's CPU goes.** Importing and opening the six trackers: ~9 s (MLflow 1.7 s import + 2.4 s creating a
  new SQLite store, Comet 1.4 s, wandb 0.6 s import + 1.3 s `wandb.init`, trackio 0.3 s, TensorBoard 0.3 s): moved
  before `train()` by `rllog.prepare`. Then, per step (the records of a real run replayed at 55 ms a step into the
  agent with all six, metrics + the completions table, each thread's CPU read from `/proc/<pid>/task`): MLflow's
  follower 6-14 ms (`log_batch`: ~0.15 ms a metric, ~40 metrics a step, in MLflow's SQLAlchemy store), wandb's 6-8
  (each table is a wandb artifact, as with TRL's own callback), Comet's 2.7 plus 2-8 in Comet's own offline-writer
  thread, TensorBoard's 2.9, trackio's 1.8, parquet's 1.3: 25-33 ms of the agent's CPU per ~55 ms step, on the other
  core, before the two levers below that cut it to 17-22 ms.
- **Why that slows training at idle priority.** `SCHED_IDLE` keeps the agent from taking the trainer's CPU time, but
  (1) its threads (14 with five trackers, handing the GIL to each other ~25,000 times a second) woke on the trainer's
  CPU and ran there between the trainer's slices: 290-720 preemptions of the training thread and 0.09-0.18 s waiting
  for its CPU in a 60-step run (`/proc/thread-self/schedstat`); and (2) work beside it shares the machine: an
  idle-priority process serialising a few MB of JSON in a loop raised the training thread's CPU time for the same 58
  steps from 2.63-3.00 s to 3.01-3.53 s (a pure interpreter loop: 2.50-3.05 s), and disk syncs cost the most (an
  idle-priority SQLite-commit loop doubled it; 100 commits/s: +6%; 20/s: nothing measurable).
- **Off the trainer's CPU** (taken, `RLLOG_AGENT_CPUS=auto`): the agent and the processes it starts run on the
  trainer's other CPUs, checked every second: 110-290 preemptions and 0.02-0.04 s waiting in the same rounds.
- **Fewer disk syncs** (taken): MLflow and trackio hold rows until `flush()` (13 and 17 commits in a 60-step run
  instead of 342 and 133; MLflow's table list now rides in the same `log_batch`: one request per flush to a tracking server); sinks
  are flushed every `flush_interval` or when `Run.flush` asks, not each time the agent catches up; a cursor file is
  rewritten only when it changed; wandb's `fsync` of each table's temporary copy (one per step, protecting nothing)
  is off.
- **Fewer tracker calls** (taken): consecutive records of one step go to wandb as one history row and to Comet as one
  `log_metrics` (TRL logs ~9 records a step).
- **Reading the journal every 0.5 s** (taken; it was 50 ms): a caught-up follower of a live run waits half
  `flush_interval` (at most 0.5 s) before it reads again, so each tracker call takes half a second of steps, and a
  flush request wakes it at once (so the wait at the end of `train()` is not longer): 20-22 ms of the agent's CPU
  per replayed step against 25-31 ms (0.25 s: 22; 1 s: 18.5).
- **No garbage collection while the trackers open** (taken): opening them made ~700,000 long-lived objects, and the
  growing heap set off 7 full collections of up to 0.45 s (1.8 s of the agent's CPU) as training started; the agent
  pauses the collector until every sink is open, then `gc.freeze()`s those objects (a full collection after: 3 ms).
- **Flushing more often** (measured, not taken): with `flush_interval=0.25` the wait at the end of `train()` was
  0.11-0.15 s instead of 0.15-0.31 s, but the agent's CPU rose ~10% and the steps slowed: 0.94-1.33x against
  0.98-1.17x in the same rounds. **Holding records** for up to `flush_interval` (fewer, larger calls), measured
  before a flush request could wake the followers: the wait at the end then covered up to a second of records
  (60 steps: 4.1-4.4 s -> 5.3-5.4 s); with the wake, half a second of holding is what was taken (above).
- **Writing the journal every 50 ms** (taken; it was every `flush_interval / 2`, 0.5 s): the agent works through each
  step as it comes, and the wait at the end of `train()` covers one step's delivery and one flush per tracker.
- **Asking for a flush as the last steps start** (taken, `Run.request_flush` from the HF integration): the trackers
  flush what came before each step while it runs; the wait at the end of `train()` then covers the last step's
  records (at the last step alone: 0.12-0.18 s in 4 of 5 rounds at 60 steps, against 0.15-0.31 s; once the agent
  read every 0.5 s that left half a second of steps, 0.2-0.4 s, so every step of the last second now asks: 0.08-0.19 s).
  Those requests are honoured at most every 0.2 s (taken, at 993f13a; the trainer's `Run.flush` at once): flushed
  at every step, MLflow's `log_batch` (20 ms of CPU for one step, 7 ms a step in batches of 25), trackio's and
  Comet's flushes saturated the agent's core in that second, and traces showed wandb and MLflow 10-25 steps behind
  at the final flush (0.21-0.33 s in 3 of 4 traced 240-step runs, two
  with the agent's GIL switch interval at 0.5 ms). After: 0.08-0.26 s at 60 steps (median 0.12 s, 14
  runs) and 0.10-0.15 s at 240 (4 runs); the whole `train()` in those fresh-process rounds, 60 steps: 0.81-1.39x
  (median 1.07x, 6 rounds), 240 steps: 0.81-1.16x (median 1.12x, 4 rounds), on a machine whose steps ran 35-59 ms.
  This benchmark run again at bdc54bc (not rendered here): fresh processes 1.15x at 60 steps (0.96-1.39) and 1.02x
  at 240 (0.87-1.43); in one process the steady ratio read 1.44x, but parquet alone read 1.31x and transformers'
  own callbacks 5.07x (4.00x above) while (a) stayed at 2.9 s: work beside training cost more in that hour on
  every configuration, and a series of (a), (c), (c, parquet only) run next at 2286466 and at bdc54bc showed
  no difference between the two (c/a 0.93 and 1.28 before, 1.04 and 1.21 after).
- **Starting the agent early** (`rllog.prepare`, taken): imports (and MLflow's store) move to while the script
  loads torch, TRL and the model. A standby is now taken by a run with the same backends in any order.
- **Looking up the backends once** (taken): `on_train_begin` read every installed package's metadata for rllog's entry
  points twelve times (each backend resolved twice), 0.28 s of the training thread with six backends (cProfile):
  about 9% of a 60-step run, before the first step. Read once per `sys.path` now: 0.02-0.04 s.
- **The trackers' processes at idle priority too** (taken): wandb's service (`wandb-core`) was started before the
  priority governor's first pass and ran at normal priority all run; the governor now switches the processes the
  agent started as well. The flush watcher looks every 10 ms (was 50 ms of the wait at the end of `train()`).
- **Less work per step** (taken, at 2fe6917): MLflow's table files go up in one `log_artifacts` per flush (a `log_text`
  per table cost ~2.5 ms of the agent's CPU; ~0.2 ms now); the health rules see only the keys they watch (~60% of
  the journal writer's time was every rule asked about every key); a completions table's integer extremes in Python
  (12 us against ~140); `Run.flush` verifies only the journal written since the previous flush (~45 ms per 1,000
  steps otherwise, at every `evaluate()` and `train()` end of a long run).
- **Temporary files in memory** (`TMPDIR=/dev/shm`, measured before wandb's sync was turned off, not taken): Comet
  keeps a whole offline run's messages in its temporary directory, which would then be memory.
- **What is left**: the trackers' own work per step (~20 ms of the agent's CPU, MLflow's store and wandb's table artifacts first) beside
  training on a 2-core VM: on this tiny model a step takes 39-60 ms, so the agent keeps the other core about half
  as busy as training keeps its own. Trainings in separate processes put the whole `train()` at 1.10-1.19x, but they
  swing more between runs than the target's band (the same benchmark 25 minutes apart, the same rllog but for a 1 ms
  change: 240 steps 1.02x, then 1.18x; a 60-step round anywhere from 0.83x to 1.44x); the wait at the end of
  `train()` is 0.06-0.12 s. Measured inside one
  training (`benchmarks/interference.py`: the agent paused and resumed every 0.6 s, the training thread's CPU per
  step in each phase, so the machine's swings between runs cancel out), the agent's work beside training cost the
  training thread 1.01x and 1.09x in two runs with all six, at most 1.14x with one tracker (wandb): an upper
  bound, as resumed the agent does twice the usual work. (Ad-hoc versions of that measurement run from a folder of
  scratch scripts had shown 1.4-1.7x; run from `benchmarks/`, the same code shows the figures above: those were an
  artefact and are not used.)
  With steps of seconds (a real model) the same per-step work is a few percent of a core. Delivery lag while training: about
  1.6 s at most (the journal's 50 ms, up to 0.5 s until the follower reads, then a flush within `flush_interval`) when the agent has a core; when training keeps every core busy it is at most ~30 s behind
  (`RLLOG_AGENT_LAG_MAX`: the agent then returns to normal priority, nice 10, until caught up), and every tracker is
  asked to flush at once as `train()`/`evaluate()` end (they do not wait: see "The end of `train()` without its
  wait" below) and is caught up at `finish`.
- **Counted, not timed** (2026-11-24, `benchmarks/instructions.py`: the fresh-process tiny GRPO under valgrind's
  callgrind at 10 and 30 steps; the difference is the per-step cost without start-up): the training thread executes
  the same number of instructions per step with the mixin and six sinks as with `report_to="none"` to within 1%
  (0.997x and 1.009x in two measurements; ~108M instructions a step), and all the training process's threads 1.02x
  and 1.034x (the journal writer; an upper bound: under callgrind a step takes ~50x longer and timed threads wake
  ~50x more often per step). So the training process does ~1-3% more work; the rest of the ratios above is the
  agent's work beside training on this 2-core VM, the wait at the end of `train()`, and the machine's swings.
- **The wait at the end of `train()`, traced** (timestamps of every read, delivery and flush in the agent, 6 runs):
  the first follower read the last step's records 8-21 ms after `Run.flush` began, then the six sinks' work for that
  step (MLflow's `log_batch` and trackio's commit end last), which the GIL serialises in the agent, took until
  70-110 ms. Waking the agent with a byte on its stdin (tried, reverted: docs/decisions.md) moved the first read to
  4 ms, but the wait over 6 interleaved runs each way stayed within noise (medians 0.098 s before, 0.107 s after).
  What is left there is the trackers' own per-transaction work.
- **The trainer's helper threads off the training thread's CPU** (measured, not taken): the journal writer and the
  agent watcher pinned to the other CPU, parquet only, 5 fresh 60-step rounds: 1.04x against 1.04x unpinned.
- **Parquet alone**: (c, parquet only) puts 0.1 s of CPU in the agent in the whole steady window, yet read 1.09x in
  the series above (1.04x over 5 fresh 60-step rounds); with so little beside training, that part of every ratio
  here is the trainer-side ~1-3% plus this machine's run-to-run noise.
- **The agent stopped while training** (measured, 2026-11-24 evening, 5 interleaved fresh 60-step rounds: the agent
  process `SIGSTOP`ped from step 3 to the last step by a hook outside the repository, then resumed): the median step
  took 0.84-1.05x (median 0.99x) the time of (a)'s in the same round, against 0.87-1.44x (median 1.11x) with the
  agent running. With the journal written and every rllog call made, the trainer alone costs about nothing per step;
  the per-step cost is the trackers' work running beside training. It is not CPU time taken from training: in a
  `perf` scheduler trace of a whole run the agent's threads ran 0.03 s on the training thread's CPU, and the training
  thread was preempted mostly by the kernel's RCU thread (121 of 180 times, microseconds each). Not reproduced the
  next day (parquet only, 5 rounds, the agent stopped the same way: step 1.08x); the trainer's side was not free,
  see the next item.
- **Tables encoded on the training thread** (taken, at 5276b72; measured 2026-11-24 late evening with interleaved
  fresh-process rounds, trackers and run directory on tmpfs): with parquet alone, `train()` read 1.06x and the median
  step 1.06x of (a) (6 rounds of 60 steps), and the training thread's CPU time in a 240-step `train()` was 0.3-0.55 s
  higher than (a)'s, although rllog's own calls on it took ~0.45 ms a step (timed per call). Switching rllog's pieces
  off one at a time put the cost on the completions table, and `/proc/thread-self/status` on blocking: the training
  thread blocked ~1,050 times (voluntary context switches) in `train()` against ~10 in (a) and ~180 without tables.
  pyarrow's IPC writer, encoding each table on the journal's writer thread, released the GIL several times per
  table, and every torch op of the training thread releases it too: each such release was a hand-over. Encoded on
  the thread that logs the table (`JournalWriter.append`, ~0.1 ms): ~350 blocks, and parquet alone 1.0x (6.09 and
  6.13 s against 6.27 and 6.07 s over 240 steps). The same rounds with the five trackers + parquet: 60 steps 1.06x
  (1.02-1.21, 6 rounds), 240 steps 1.04x (1.01-1.10).
- **What the rest is, by where the files go** (the same rounds, 60 steps, five trackers + parquet, 5-6 rounds each):
  everything on tmpfs 1.06x; the run directory (journal, cursors, parquet) on the disk 1.08x; the trackers' files on
  the disk 1.11x; both on the disk, as in this benchmark, 1.14x. This VM's disk interrupts are all taken by one of its
  two CPUs, and the trackers' SQLite stores sync at every commit: `strace` counted 208 `fsync`/`fdatasync` calls in a
  240-step `train()` (MLflow ~100 in its rollback journal mode, trackio ~108). Flushing the sinks every 5 s instead of
  every second: 1.12x (measured, not taken: within the noise, and the parquet store must be readable within about
  two flush intervals).
- **Small files swapped in, not renamed over** (taken, at 4f3017e, `rllog.files.replace_file`): ext4 writes a file
  renamed over another to disk at once (`auto_da_alloc`), so each cursor save and flush request (~80 in a 60-step
  run) was a disk write, and its interrupt and I/O-completion worker ran on the CPU that takes the disk's interrupts,
  where the training thread often runs (a `perf` trace of one 60-step `train()`: ~950 block-request completions
  landed on the training thread). Swapped in (`renameat2(RENAME_EXCHANGE)`), 200 replacements made 0 such writes
  instead of 200. 8 interleaved fresh 60-step rounds, every file on the disk: `train()` 1.09x (0.99-1.17) against
  1.145x (1.12-1.25) the same hour before; median step 1.04x against 1.10x. The trackers' own triggers of the same
  write (wandb's staging copy of each table, 2 a step; Comet's offline message files, 1 a step) avoided as well by a
  patch loaded in every process (measured, not taken: 1.10x over 8 rounds, no change; it would mean patching the
  trackers' internals). What the disk still gets while training is the SQLite stores' syncs (MLflow, trackio).
- **wandb's tables without the per-row type check** (taken, at 6d78352): with `allow_mixed_types=True` every column
  is typed "any or none", so `wandb.Table`'s check of each row's cells decided nothing; the sink sets the rows
  directly (the same table file and column types): ~0.03 ms per 16-row completions table instead of ~0.6. Per-thread
  CPU of the agent in the middle of a 500-step run (4 s, before this change): wandb's follower 3.8 ms a step,
  MLflow's 2.7, Comet's 2.0 (its sink and its offline writer), TensorBoard's 0.7, trackio's 0.6, parquet's 0.3,
  the flush watcher 0.1: ~10.5 ms of the agent's CPU per ~26 ms step, and wandb-core 0.7.
- **The end of `train()` by sink** (cursor save times of the six sinks after the barrier began, 3 traced 60-step
  runs at 4f3017e): parquet 4-15 ms, TensorBoard 10-14, Comet 33-50, wandb 43-54, trackio 51-57, MLflow 57-62 (the
  barrier 59-66 ms): MLflow's and trackio's transactions of up to 0.2 s of rows, with their SQLite syncs, end last.
  Asking for the last step's flush at once (measured, not taken): MLflow's flush of the ~12 steps since its
  previous one (24-29 ms of CPU, 55-61 ms of wall time beside the other sinks) then started as the last step did
  and still ran when the barrier began; MLflow's flush of the last step alone took 10 ms of CPU after it. The
  barrier over 6 interleaved runs each way: median 57 ms (42-68) against 60.5 ms (53-72): within the noise.
  Asking at once ~0.1 s before the end instead (taken, `END_FLUSH_AT_ONCE_SECONDS`, once per `train()`): 44 ms
  (41.6-50.2) against 58 ms (46.2-61.9), lower in each of 8 interleaved pairs; `train()` itself 1.815 s against
  1.81 s (medians), the 14 ms lost in the rounds' swings. This benchmark at 6b1b5e6 (rendered here) against
  6d78352 an hour before: the wait at the end of a fresh 60-step `train()` 0.047 s against 0.064 (medians), but
  `train()` 1.13x at 60 steps and 1.09x at 240 against 1.09x and 1.06x: (a)'s steps ran 20.7 ms that hour
  against 23.1 (a machine ~10% faster for training), (c)'s 23.1 against 24.0, and the agent's work per step does
  not shrink with the step.
- **The training thread pinned to either CPU** (measured, not taken: a library does not pin its user's threads):
  5 rounds each, the agent on the other CPU: 1.08x with the training thread on the CPU that takes the disk's
  interrupts, 1.075x on the other; the per-round swings are larger than that difference.
- **The end of `train()`** (taken, at 5eefbb4): `Run.flush` waits for the journal write on a condition the writer
  notifies instead of a 5 ms poll, and reads the cursors every 2 ms instead of 5 (~5 ms of polling on average;
  every 20 ms after its first 0.5 s, at e7d801e, so a slow tracker does not keep it reading); traced, the end of a 60-step `train()` then spent ~4 ms in TRL's last `log`, ~12 ms until the agent read the last
  step (the agent looks every 10 ms), ~25 ms in the six sinks' work for that step, serialised by the GIL.
- **MLflow's default store prepared** (taken, at 82c55d1): without `MLFLOW_TRACKING_URI` the standby did not prepare
  MLflow's default store (`mlflow.db` in the working directory), and MLflow's first `open` checked it while training
  ran: 0.63 s of the agent's CPU and 1.7 s before MLflow's run existed (18 ms prepared). This benchmark sets the
  variable, so its figures do not show it.
- **Ending Comet's offline experiment** (taken, at 534021a): `finish` took 1.12 s after every run, 1.0 s of it waiting
  for Comet's writer thread, which noticed only once a second that `end()` had stopped it. The sink lowers that wait
  to 20 ms before it ends the experiment: `finish` 0.12 s. The whole script (imports, model, `train()`, `finish`)
  then read 1.02x at 60 steps and 1.05x at 240 (1.02x and 1.08x before, at a8f53c8). The same benchmark run again
  right after (not rendered here): fresh `train()` 1.19x at 60 steps (0.98-1.41) and 1.08x at 240 (0.95-1.20), the
  whole script 1.05x and 1.01x; the 14 fresh rounds of both runs together: `train()` 1.17x at 60 steps, 1.08x at 240.
  A separate series of 9 interleaved fresh 60-step rounds that hour read 0.99x (0.77-1.17): the machine's swings
  between rounds are larger than the gap to the target.
- **What slows training beside the agent on this VM** (measured 2026-11-25: fresh 60-step `report_to="none"`
  trainings, a load process on the other CPU, busy ~45% of the time, 3-5 interleaved rounds each): an interpreter
  loop, JSON encoding, 2 MB allocations, random reads over 256 MB, ~90 `fsync`s a second and file churn (540
  renames over an old file and 180 creations and deletions a second) each left the median step within +-2%; page
  faults (7,800 a second at 1% of a CPU) and wake-ups between two processes (~1,200 context switches a second at 2%)
  put it at 1.03x. This VM runs nested (Firecracker, `nested_pvm=1` on its kernel command line), where every kernel
  entry costs the host more: what the agent costs training here follows its wake-ups and page faults more than its
  CPU time. With the five trackers the agent makes ~830 voluntary context switches and ~1,500 page faults a second,
  and wandb-core ~600 and ~650 more; two thirds of the switches are wandb's (each `run.log` is a round trip from
  the sink through wandb's asyncio thread to wandb-core). The agent stopped (`SIGSTOP`) from step 3 to the end:
  median step 1.02x, against 1.06x running (4 rounds). Parquet plus one tracker (4 rounds): parquet alone 1.05x,
  with wandb 1.13x, MLflow 1.08x, Comet 1.08x, trackio and TensorBoard 1.08x.
- **Measured, not taken** (the same day): wandb's metrics and table of a step held and logged as one history row (one
  `run.log` a step instead of two): step 1.064x against 1.045x over 5 rounds, no gain, and a held row that wandb
  refused would be blamed on the next record (one bad record must never stop a sink); the agent's sink calls
  serialised by one lock (850 context switches a second against 832: the switches are not GIL hand-overs); glibc's
  allocator tuned for the agent (one arena, high trim and mmap thresholds) or `PYTHONMALLOC=malloc`: 1,220-1,520
  page faults a second against 1,640 (most are wandb's and the trackers' own allocations), no other change; the
  agent's GIL switch interval at 50 ms: 1.085x against 1.080x (5 rounds).
- **The flush request written in place** (taken, at 5f3b2aa, `rllog.delivery.request_flush`): one checksummed line
  written over the previous one instead of a file created, swapped in and deleted per request, in the directory
  where the six followers save their cursors: `Run.request_flush` took 0.11 ms of the training thread's CPU a call
  instead of 0.28 (each step of the last second asks). This benchmark at 5f3b2aa (rendered here): fresh `train()`
  1.09x at 60 steps (1.07-1.10, 7 rounds) and 1.06x at 240 (1.02-1.13); the wait at the end of `train()` 0.053 s,
  about 3% of a 60-step `train()`; the median step 1.05x and 1.04x.
- **The end of `train()` without its wait** (taken, 2026-11-25; docs/decisions.md "The end of train() does not
  wait"): `train()` asks every tracker to flush at once and returns; `wait_for_trackers()`, `push_to_hub()` and
  `finish` wait. 7 interleaved fresh 60-step rounds: `train()` 1.110x with the wait, 1.055x without (and 1.041x in a
  second series); the end of `train()` 0.01 s against 0.04-0.06 s. The requests of the last second's steps went
  with it. **wandb's service started in the standby agent** (taken, `wandb.setup()` while the trainer is built):
  1.040x against 1.048x (7 rounds), the first steps no longer share the machine with wandb-core's start-up.
- **Reading the journal every 2 s and the flush request every 50 ms** (measured, not taken, without the wait at the
  end): 1.041x against 1.041x (7 rounds): fewer, larger bursts of the agent change nothing here.
- **Where the rest is, by tracker** (measured 2026-11-25, no wait at the end, 5 interleaved fresh 240-step rounds):
  `train()` with the five trackers + parquet 1.041x, parquet alone 1.042x, the five without wandb 1.035x, parquet +
  wandb 1.052x: the trackers' work no longer shows above the rounds' spread. The training thread blocks ~200 times
  in a 240-step `train()` (2 with `report_to="none"`), mostly when the journal writer (every 50 ms) and the agent
  watcher (every 0.2 s) take the GIL. **Writing the journal every 0.25 s and watching the agent every 0.5 s**
  (measured, not taken): ~80 blocks, `train()` 1.042x against 1.034x (5 rounds each): no gain, and a killed
  trainer would lose up to 0.25 s of records instead of 50 ms."""


def render_whole(results: dict) -> str:
    """Seconds per run of the start-up-included measurements, by length."""
    rows = []
    for part, label in (("whole", "one process"),):
        for run in results.get(part, {}).get("runs", []):
            if "error" in run:
                rows.append([label, run["key"], run["steps"], run["round"], "error", "", "", "", "", "", ""])
                continue
            rows.append(
                [
                    label,
                    run["key"],
                    run["steps"],
                    run["round"],
                    run["train_s"],
                    run.get("step_median_ms"),
                    run.get("tail_s"),
                    run.get("main_waited_s"),
                    run.get("main_preempted"),
                    run.get("finish_s"),
                    run.get("process_wall_s") if part == "fresh" else "",
                ]
            )
    return md_table(
        [
            "how",
            "configuration",
            "steps",
            "round",
            "train() s",
            "median step ms",
            "last step -> train() returns s",
            "training thread waited for a CPU s",
            "times preempted",
            "finish after train() s",
            "process s",
        ],
        rows,
    )


def render(results: dict) -> str:
    s = summary(results)
    a = s.get("a", {})
    rows, cpu_rows = [], []
    for key, (label, _) in CONFIGS.items():
        if key not in s:
            continue
        x = s[key]
        per_round = round_ratios(results, key) if key not in ("a",) else []
        rows.append(
            [
                label,
                x["steady_s"],
                fmt_ratio(ratio(x["steady_s"], a.get("steady_s"))),
                " / ".join(f"{v:.2f}" for v in per_round) if per_round else "",
                x["step_ms"],
                x["train_s"],
                fmt_ratio(ratio(x["train_s"], a.get("train_s"))),
                x["finish_s"],
                " / ".join(f"{v:.1f}" for v in x["all_steady"]),
                "yes" if x["delivered"] else "**no**",
            ]
        )
        cpu_rows.append([label, x["cpu_main_s"], x["cpu_other_threads_s"], x["cpu_agent_s"], x["agent_ready_s"]])
    thread = ratio(s.get("d", {}).get("steady_s"), s.get("c", {}).get("steady_s"))
    out = [
        f"Tiny GRPO (Qwen2, hidden 32, batch 4, 4 generations, 8 new tokens, beta 0.04, log_completions, logging_steps=1), "
        f"{results['steps']} steps, CPU, one torch thread. All the trainings run one after the other in one process (after an untimed "
        "warm-up training), so they share the machine's conditions: (a), (c) and (c, parquet only) interleaved over "
        f"{results['rounds']} round(s); then (c, cold), (d) and, last, (b) (quick mode: no (b), no (c, cold)). "
        "(c) and (d) start training once rllog's trackers are open (a first record delivered), as (b)'s trackers are opened in "
        "`on_train_begin`, outside the timed window; (c, cold) does not wait.",
        "",
        md_table(
            [
                "configuration",
                "steady s (step 3 -> end), median",
                "vs (a)",
                "vs (a) in the same round",
                "median step ms",
                "train() s",
                "vs (a)",
                "finish after train() s",
                "steady s per run",
                "delivered",
            ],
            rows,
        ),
        "",
        "CPU seconds in the steady window (2 cores; whatever the agent and tracker threads use is taken from the trainer's share "
        "when both cores are busy):",
        "",
        md_table(
            [
                "configuration",
                "training thread",
                "other threads of the trainer process",
                "delivery agent process",
                "agent ready after s",
            ],
            cpu_rows,
        ),
        "",
        f'Delivery in the agent process against `delivery="thread"`: (d) / (c) = {fmt_ratio(thread)} on the steady time '
        f"(design note, measured before the project existed: 2.0-2.4x in a thread, 1.0-1.2x from a second process).",
        "",
        "Start-up included, per run, in one process (after the series above; the trainer is built just before `train()`):",
        "",
        render_whole(results),
        "",
        BOTH_WAYS_BEGIN,
        render_fresh(results.get("fresh", {})),
        BOTH_WAYS_END,
        "",
        LEVERS,
        "",
        md_table(
            ["target", "wanted", "measured", "result"],
            [[t["what"], t["target"], t["measured"], verdict(t["met"])] for t in targets(results)],
        ),
    ]
    return "\n".join(out)


if __name__ == "__main__":
    main()
