"""Where every extra CPU second goes when training keeps every core busy (torch's default threads), in CPU seconds,
which a busy machine does not distort the way it distorts wall time.

- **The trainer process** (tiny GRPO through the TRL mixin, a fresh process per configuration: ``report_to="none"``,
  parquet alone, five trackers + parquet, ``rllog.prepare`` at the top of the script): the whole script's CPU, split
  into the training thread (and, inside it, rllog's start-up, the integration's callbacks and the hot path
  ``Run.log``/``log_table``/``request_flush``, each its own time), torch's native threads, the journal writer and
  rllog's other threads.
- **The delivery agent** of the five-tracker run, from a CPU ledger inside it (``benchmarks/agent_probe.py``): per
  sink, importing the tracker (the standby), building and opening the sink, writing metrics and tables, flushing,
  closing, and the follower's own work (the rest of its thread: reading the journal, batching, cursors); the
  trackers' own threads and processes (wandb's service); the flush watcher, the priority governor and the
  system-metrics sampler; the interpreter's start-up and the CPU used before the agent reached ``SCHED_IDLE``.
- **The floor**: each tracker alone in a fresh process, called through its own API with the records of that run (one
  call per metrics record, as transformers' callbacks make; the completions table to wandb and trackio, where TRL
  logs it): import, start, writes, finish. What rllog's agent spends above the floor is its machinery.

    .venv/bin/python benchmarks/attribution.py [--quick] [--steps N] [--threads one|default]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import harness
from harness import FIVE, SIX, fmt, md_table, progress, run_case

SCRIPT = Path(__file__).resolve()
PROBE_DIR = harness.BENCH / "probe"  # its sitecustomize installs agent_probe in delivery agents
PROBE_ENV = "RLLOG_BENCH_AGENT_PROBE"
STEPS = 120  # long enough that the per-step costs outweigh one-off ones in the table; --quick: QUICK_STEPS
QUICK_STEPS = 20
MODES = {"none": [], "parquet": ["parquet"], "five": SIX}
MODE_LABELS = {"none": 'report_to="none"', "parquet": "parquet alone", "five": "five trackers + parquet"}
# What a user's script imports for each tracker's own API (TensorBoard through torch, as transformers does).
DIRECT_IMPORTS = {
    "wandb": "wandb",
    "tensorboard": "torch.utils.tensorboard",
    "mlflow": "mlflow",
    "trackio": "trackio",
    "comet_ml": "comet_ml",
}
TABLE_TRACKERS = ("wandb", "trackio")  # where TRL's GRPO logs its completions table itself
PROBE_THREAD = "bench-agent-probe"


def process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def thread_cpu_by_name() -> dict[str, float]:
    """This process's live threads' CPU seconds, by Python thread name (native threads: ``native: <comm>``)."""
    import agent_probe

    names = {t.native_id: t.name for t in threading.enumerate()}
    main = threading.main_thread().native_id
    out: dict[str, float] = {}
    for tid_text in os.listdir("/proc/self/task"):
        tid = int(tid_text)
        cpu = agent_probe.stat_cpu(f"/proc/self/task/{tid}/stat") or 0.0
        name = "training thread" if tid == main else names.get(tid) or f"native: {agent_probe.process_name(tid)}"
        out[name] = out.get(name, 0.0) + cpu
    return out


class OwnTime:
    """The training thread's CPU time in rllog's functions, each function's own (its callees' wrapped time taken out),
    by category."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._stack: list[list[float]] = []  # [started thread CPU, wrapped callees' time]
        self._main = threading.main_thread()

    def wrap(self, owner: Any, method: str, category: str) -> None:
        original = getattr(owner, method)

        def wrapper(*args, **kwargs):
            if threading.current_thread() is not self._main:
                return original(*args, **kwargs)
            frame = [time.thread_time(), 0.0]
            self._stack.append(frame)
            try:
                return original(*args, **kwargs)
            finally:
                self._stack.pop()
                elapsed = time.thread_time() - frame[0]
                self.seconds[category] = self.seconds.get(category, 0.0) + elapsed - frame[1]
                self.calls[category] = self.calls.get(category, 0) + 1
                if self._stack:
                    self._stack[-1][1] += elapsed

        setattr(owner, method, wrapper)

    def install(self) -> OwnTime:
        from rllog.integrations.transformers import RLLogCallback
        from rllog.integrations.trl import RLLogMixin
        from rllog.run import Run

        self.wrap(RLLogCallback, "start", "rllog start-up (run, agent)")
        for event in ("on_train_begin", "on_step_begin", "on_step_end", "on_train_end", "on_log"):
            self.wrap(RLLogCallback, event, "integration (callbacks)")
        self.wrap(RLLogMixin, "_rllog_completions", "integration (callbacks)")
        for method in ("log", "log_table", "request_flush"):
            self.wrap(Run, method, "hot path (Run.log, log_table, request_flush)")
        return self


def case_train(params: dict, workdir: Path) -> dict:
    """One tiny GRPO training of ``params["mode"]`` in this fresh process, as a user's script runs it."""
    started_cpu, started_wall = process_cpu(), time.perf_counter()
    sinks = MODES[params["mode"]]
    checkpoints = {}
    if sinks:
        import rllog

        rllog.prepare(sinks)
        checkpoints["rllog.prepare"] = process_cpu()
    import end_to_end
    import torch
    import trl  # noqa: F401

    from rllog import demo

    checkpoints["imports (torch, TRL)"] = process_cpu()
    if params["threads"] == "one":
        torch.set_num_threads(1)
    own = OwnTime().install()
    model_dir = demo.build_tiny_model(str(workdir / "model"))
    checkpoints["the model"] = process_cpu()
    trainer = end_to_end.grpo_trainer(
        model_dir, str(workdir / "out"), params["steps"], "rllog" if sinks else "none", "process", workdir, sinks or SIX
    )
    checkpoints["the trainer"] = process_cpu()
    before_train_cpu = process_cpu()
    threads_before = thread_cpu_by_name()
    t = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t
    threads_after = thread_cpu_by_name()
    train_cpu = process_cpu() - before_train_cpu
    finish_cpu, finish_s, run_dir, ok = 0.0, 0.0, None, True
    if sinks:
        c, t = process_cpu(), time.perf_counter()
        report = trainer.rllog_run.finish(timeout=600)
        finish_cpu, finish_s = process_cpu() - c, time.perf_counter() - t
        run_dir, ok = str(trainer.rllog_run.run_dir), report.ok
    threads = {k: v - threads_before.get(k, 0.0) for k, v in threads_after.items()}
    ended = train_cpu - sum(threads.values())  # threads that ended inside train()
    return {
        "mode": params["mode"],
        "threads_mode": params["threads"],
        "steps": params["steps"],
        "script_cpu_s": process_cpu() - started_cpu,
        "before_train_cpu_s": before_train_cpu - started_cpu,
        "before_train_parts_cpu_s": {
            name: cpu - previous
            for (name, cpu), previous in zip(checkpoints.items(), [started_cpu, *checkpoints.values()], strict=False)
        },
        "train_cpu_s": train_cpu,
        "train_threads_cpu_s": threads | ({"threads that ended": ended} if ended > 0.005 else {}),
        "training_thread_rllog_s": own.seconds,
        "training_thread_rllog_calls": own.calls,
        "finish_cpu_s": finish_cpu,
        "train_s": train_s,
        "finish_s": finish_s,
        "script_s": time.perf_counter() - started_wall,
        "run_dir": run_dir,
        "delivered": ok,
    }


def _journal_records(run_dir: str) -> list:
    from rllog.journal import End, JournalReader

    reader = JournalReader(run_dir)
    records: list = []
    try:
        while True:
            batch = reader.read(1000, final=True)
            if not batch:
                break
            records += [r for r in batch if not isinstance(r, End)]
    finally:
        reader.close()
    return records


def case_direct(params: dict, workdir: Path) -> dict:
    """One tracker alone, called through its own API with the records of a run's journal: the floor."""
    import agent_probe
    import hot_path
    import torch  # noqa: F401  (a training script has it already; TensorBoard's writer comes from it)

    from rllog.records import MetricsRecord, TableRecord

    name = params["tracker"]
    records = _journal_records(params["run_dir"])
    children = agent_probe.ChildSampler(os.getpid())
    phases: dict[str, float] = {}

    def measured(phase: str, work) -> Any:
        children.sample()
        before = process_cpu() + children.total()
        result = work()
        children.sample()
        phases[phase] = process_cpu() + children.total() - before
        return result

    if name == "comet_ml":
        measured("import", lambda: (importlib.import_module("comet_ml"), harness.block_comet_probe()))
    else:
        measured("import", lambda: importlib.import_module(DIRECT_IMPORTS[name]))
    tracker = hot_path.make_direct(name)
    measured("start", lambda: tracker.open("bench-attribution"))

    def write_all() -> int:
        calls = 0
        for record in records:
            if isinstance(record, MetricsRecord):
                tracker.log(dict(record.values), step=record.step)
                calls += 1
            elif isinstance(record, TableRecord) and name in TABLE_TRACKERS:
                frame = record.table.to_pandas()
                if name == "wandb":
                    import wandb

                    tracker.run.log({record.name: wandb.Table(dataframe=frame)}, step=record.step)
                else:
                    import trackio

                    trackio.log({record.name: trackio.Table(dataframe=frame)}, step=record.step)
                calls += 1
        return calls

    calls = measured("writes", write_all)
    measured("finish", tracker.close)
    return {
        "tracker": name,
        "phases_cpu_s": phases,
        "calls": calls,
        "steps": len({r.step for r in records}),
        "children": list(children.seen.values()),
    }


def case_startup(params: dict, workdir: Path) -> dict:
    """When does the agent ``rllog.prepare`` starts reach ``SCHED_IDLE``, and how much CPU has it used by then? Its
    main thread's policy and CPU time, read from ``/proc`` every :data:`STARTUP_SAMPLE_S` from this process."""
    import agent_probe

    import rllog
    from rllog import agent

    rllog.prepare(params.get("sinks", SIX))
    standby = agent.waiting_standby()
    if standby is None:
        raise RuntimeError("rllog.prepare started no standby agent")
    pid = standby.proc.pid
    samples = []
    deadline = time.monotonic() + params.get("seconds", 20.0)
    while time.monotonic() < deadline and standby.proc.poll() is None:
        cpu = agent_probe.stat_cpu(f"/proc/{pid}/stat")
        policy = _policy(pid)
        if cpu is None or policy is None:
            break
        samples.append((time.monotonic(), cpu, policy))
        moved = [s for s in samples if s[1] != cpu]
        if policy == IDLE_POLICY and moved and samples[-1][0] - max(s[0] for s in moved) > STARTUP_SETTLED_S:
            break  # imports done (its CPU stopped moving), at idle priority
        time.sleep(STARTUP_SAMPLE_S)
    first_idle = next((s for s in samples if s[2] == IDLE_POLICY), None)
    t0 = samples[0][0] if samples else 0.0
    agent.discard_standby()
    return {
        "samples": len(samples),
        "first_sample_cpu_s": samples[0][1] if samples else None,
        "cpu_before_idle_s": first_idle[1] if first_idle else None,
        "idle_after_s": first_idle[0] - t0 if first_idle else None,
        "policies": sorted({s[2] for s in samples}),
        "cpu_total_s": samples[-1][1] if samples else None,
    }


STARTUP_SAMPLE_S = 0.002  # policy and CPU of the starting agent read this often (a clock tick is 10 ms)
STARTUP_SETTLED_S = 1.0  # a standby whose CPU time has not moved for this long has done its imports
IDLE_POLICY = 5  # SCHED_IDLE, as /proc/PID/sched prints it


def _policy(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/sched") as f:
            for line in f:
                if line.startswith("policy"):
                    return int(line.split(":")[1])
    except (OSError, ValueError):
        return None
    return None


CASES = {"train": case_train, "direct": case_direct, "startup": case_startup}


def run(quick: bool, tmp: Path, steps: int | None = None, threads: str = "default") -> dict:
    steps = steps or (QUICK_STEPS if quick else STEPS)
    paths = [str(PROBE_DIR), str(harness.ROOT), str(harness.BENCH)]
    results: dict[str, Any] = {"steps": steps, "threads": threads, "train": {}, "direct": {}}
    for mode in MODES:
        progress(f"attribution: tiny GRPO, {MODE_LABELS[mode]}, {steps} steps, torch threads {threads}")
        probe = Path(tempfile.mkdtemp(prefix="probe-", dir=tmp))
        env = {"PYTHONPATH": os.pathsep.join(paths), PROBE_ENV: str(probe)}
        result = run_case(
            SCRIPT, "train", {"mode": mode, "steps": steps, "threads": threads}, tmp, threads=threads, env_extra=env
        )
        if "error" not in result:  # the ledger of the agent this run started (its folder is the worker's)
            result["agent"] = [json.loads(p.read_text()) for p in sorted(probe.glob("agent-*.json"))]
        results["train"][mode] = result
    run_dir = results["train"]["five"].get("run_dir")
    for name in FIVE:
        if not run_dir:
            break
        progress(f"attribution: {name} alone through its own API (the floor)")
        results["direct"][name] = run_case(SCRIPT, "direct", {"tracker": name, "run_dir": run_dir}, tmp, threads=threads)
    progress("attribution: the agent's start-up, policy and CPU")
    results["startup"] = run_case(SCRIPT, "startup", {"sinks": SIX}, tmp, threads=threads)
    return results


# --- the tables ------------------------------------------------------------------------------------------

SINK_PHASES = [
    ("import (standby)", "import (standby)"),
    ("import + build", "import + build (run)"),
    ("open", "open"),
    ("write_metrics", "write metrics"),
    ("write_table", "write tables"),
    ("flush", "flush"),
    ("close", "close"),
]
ON_FOLLOWER_THREAD = ("import + build", "open", "write_metrics", "write_table", "write_alert", "write_config", "flush", "close")
RLLOG_AGENT_THREADS = {
    "rllog-flush-watcher": "flush watcher",
    "rllog-priority": "priority governor",
    "rllog-system-metrics": "system metrics sampler",
    "MainThread": "main thread (rllog's imports, the serve loop; the standby's tracker imports are in the sinks' rows)",
}


def agent_attribution(agent: dict, steps: int) -> tuple[list[list], list[list], float]:
    """Rows per sink (CPU s by phase) and rows for the rest of the agent, and the agent's total CPU s."""
    sink_rows = []
    for sink, calls in agent.get("calls", {}).items():
        seconds = {phase: calls.get(phase, [0.0, 0])[0] for phase, _ in SINK_PHASES}
        on_thread = sum(calls.get(p, [0.0, 0])[0] for p in ON_FOLLOWER_THREAD)
        machinery = max(0.0, agent.get("follower_cpu_s", {}).get(sink, 0.0) - on_thread)
        per_step_ms = (seconds["write_metrics"] + seconds["write_table"] + seconds["flush"]) * 1e3 / steps
        total = sum(seconds.values()) + machinery
        sink_rows.append([sink, *(seconds[p] for p, _ in SINK_PHASES), machinery, total, per_step_ms])
    followers = {f"rllog-follower-{s}" for s in agent.get("calls", {})}
    other: dict[str, float] = {}
    standby_imports = sum(calls.get("import (standby)", [0.0, 0])[0] for calls in agent.get("calls", {}).values())
    for thread in agent.get("threads", []):
        name = thread["name"]
        if name in followers or name == PROBE_THREAD:
            continue
        label = RLLOG_AGENT_THREADS.get(name, "trackers' own threads")
        cpu = thread["cpu_s"] - (standby_imports if name == "MainThread" else 0.0)  # the imports are the sinks' rows
        other[label] = other.get(label, 0.0) + cpu
    for child in agent.get("children", []):
        label = f"trackers' processes ({child['name']})"
        other[label] = other.get(label, 0.0) + child["cpu_s"]
    total = agent.get("process_cpu_s", 0.0) + sum(c["cpu_s"] for c in agent.get("children", []))
    probe = sum(t["cpu_s"] for t in agent.get("threads", []) if t["name"] == PROBE_THREAD)
    alive = agent.get("wall_s") or float("nan")
    rows = [[label, seconds, seconds * 1e3 / alive] for label, seconds in sorted(other.items(), key=lambda kv: -kv[1])]
    rows.append(["interpreter start-up (before any of rllog)", agent.get("started_cpu_s", 0.0), ""])
    if agent.get("idle_at_cpu_s") is not None:
        rows.append(
            [
                "(CPU used before SCHED_IDLE: the probe's own imports come first here; see the start-up below)",
                agent["idle_at_cpu_s"],
                "",
            ]
        )
    rows.append(["(the probe's own sampling, left out of the total)", probe, probe * 1e3 / alive])
    return sink_rows, rows, total - probe


def _share(own: float, beside: float, training_thread: float) -> str:
    """``train()`` as a multiple of the same training without rllog's CPU in the trainer: ``own`` seconds on the
    training thread (``beside`` more on rllog's threads, counted as if they held the training thread up). A ratio
    within one run, so the machine's speed, which moves the wall clock 20-50% here, cancels out."""
    if training_thread <= own:
        return ""
    return f"{(training_thread + beside) / (training_thread - own):.3f}x"


def render(results: dict) -> str:
    steps = results["steps"]
    train = results.get("train", {})
    out = [
        f"Tiny GRPO, {steps} steps, torch threads: {results['threads']}, each configuration a fresh process "
        "(`rllog.prepare` at the top for rllog's). CPU seconds.",
        "",
        "**The trainer process**:",
        "",
    ]
    base = train.get("none", {})
    rows = []
    categories: list[str] = []
    for result in train.values():
        for name in result.get("training_thread_rllog_s", {}):
            categories += [name] if name not in categories else []
    thread_groups = ["training thread", "rllog-journal", "native threads (torch)", "other rllog threads", "other threads"]
    for mode, result in train.items():
        if "error" in result:
            rows.append([MODE_LABELS[mode], "error", *[""] * (11 + len(categories))])
            continue
        groups = dict.fromkeys(thread_groups, 0.0)
        for name, cpu in result["train_threads_cpu_s"].items():
            key = (
                name
                if name in ("training thread", "rllog-journal")
                else "native threads (torch)"
                if name.startswith("native")
                else "other rllog threads"
                if name.startswith("rllog")
                else "other threads"
            )
            groups[key] += cpu
        own = sum(result["training_thread_rllog_s"].values())
        rllog_threads = groups["rllog-journal"] + groups["other rllog threads"]
        rows.append(
            [
                MODE_LABELS[mode],
                result["script_cpu_s"],
                result["script_cpu_s"] - base.get("script_cpu_s", float("nan")) if mode != "none" else "",
                result["before_train_cpu_s"],
                ", ".join(f"{k} {v:.1f}" for k, v in result.get("before_train_parts_cpu_s", {}).items()),
                result["train_cpu_s"],
                *(groups[g] for g in thread_groups),
                *(result["training_thread_rllog_s"].get(c, 0.0) * 1e3 for c in categories),
                _share(own, 0.0, groups["training thread"]),
                _share(own, rllog_threads, groups["training thread"]),
                result["finish_cpu_s"],
                result["train_s"],
                result["script_s"],
            ]
        )
    out.append(
        md_table(
            [
                "configuration",
                "whole script",
                "above none",
                "before train()",
                "of which",
                "train()",
                *(f"train(): {g}" for g in thread_groups),
                *(f"of the training thread, ms: {c}" for c in categories),
                "train() from the trainer's side: x of the same training without rllog's part",
                "the same, rllog's threads counted as if on the training thread",
                "finish",
                "train() wall s",
                "script wall s",
            ],
            rows,
        )
    )
    agents = train.get("five", {}).get("agent", [])
    agent_total = 0.0
    if agents:
        for agent in agents:
            sink_rows, other_rows, total = agent_attribution(agent, steps)
            agent_total += total
            out += [
                "",
                f"**The delivery agent** (five trackers + parquet; pid {agent['pid']}, {agent['wall_s']:.1f} s alive): "
                f"{total:.2f} CPU s in all (its process and the processes it started). Per sink, on its follower "
                "thread (`import (standby)` on the main thread, before the run):",
                "",
                md_table(
                    [
                        "sink",
                        *(label for _, label in SINK_PHASES),
                        "follower's own work",
                        "total",
                        "CPU ms per step (writes, flushes)",
                    ],
                    [*sink_rows, ["**all sinks**", *(sum(r[i] for r in sink_rows) for i in range(1, len(sink_rows[0])))]]
                    if sink_rows
                    else [],
                ),
                "",
                "The rest of the agent (work that follows the time the agent is alive rather than the steps, per second too):",
                "",
                md_table(["where", "CPU s", "CPU ms per s alive"], other_rows),
            ]
    direct = results.get("direct", {})
    if direct:
        rows = []
        agent_by_sink = {r[0]: r for a in agents for r in agent_attribution(a, steps)[0]}
        for name, d in direct.items():
            if "error" in d:
                rows.append([name, "error", "", "", "", "", "", ""])
                continue
            p = d["phases_cpu_s"]
            floor = sum(p.values())
            mine = agent_by_sink.get(name)
            rows.append(
                [
                    name,
                    p.get("import"),
                    p.get("start"),
                    p.get("writes"),
                    p.get("finish"),
                    floor,
                    mine[-2] if mine else None,
                    (mine[-2] - floor) if mine else None,
                ]
            )
        out += [
            "",
            "**The floor**: each tracker alone in a fresh process through its own API, the same records (metrics one call "
            "per record; the completions table to wandb and trackio only, where TRL logs it); CPU s of the process and "
            "the processes it started. `rllog's sink thread` is the agent's total for that sink above (its own "
            "threads and processes are in the agent's rest):",
            "",
            md_table(["tracker", "import", "start", "writes", "finish", "floor", "rllog's sink thread", "difference"], rows),
        ]
        floors = sum(sum(d["phases_cpu_s"].values()) for d in direct.values() if "error" not in d)
        if agents:
            out += [
                "",
                f"The five trackers' floor: {fmt(floors, 2)} CPU s; the agent: {fmt(agent_total, 2)} CPU s (parquet and "
                "rllog's machinery included).",
            ]
    s = results.get("startup", {})
    if s and "error" not in s:
        out += [
            "",
            f"**The agent's start-up** (`rllog.prepare` with the six, policy read from `/proc/PID/sched` every "
            f"{STARTUP_SAMPLE_S * 1e3:.0f} ms): first seen at {fmt(s['first_sample_cpu_s'], 2)} CPU s; at `SCHED_IDLE` "
            f"after {fmt(s['idle_after_s'], 2)} s, having used {fmt(s['cpu_before_idle_s'], 2)} CPU s at normal "
            f"priority; {fmt(s['cpu_total_s'], 2)} CPU s when its imports were done (policies seen: {s['policies']}).",
        ]
    return "\n".join(out)


def main() -> None:
    if "--worker" in sys.argv:
        harness.worker_main(CASES)
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps (a check that it runs)")
    parser.add_argument("--steps", type=int, default=None, help=f"steps per training (default {STEPS})")
    parser.add_argument("--threads", choices=harness.THREAD_MODES, default="default", help="torch's threading")
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rllog-bench-") as tmp:
        results = run(args.quick, Path(tmp), args.steps, args.threads)
    print(render(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
    main()
