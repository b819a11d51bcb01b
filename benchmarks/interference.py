"""Interference: how much the delivery agent's work slows the training thread, measured inside one training.

Comparing separate trainings (``end_to_end.py``) mixes rllog's effect with this machine's swings between runs
(the same 60 steps of ``report_to="none"`` take 2.5-4.4 s). Here one tiny GRPO training with the rllog mixin
runs while a thread pauses the agent's process (``SIGSTOP``) and resumes it (``SIGCONT``) every
:data:`PERIOD` seconds; each step that ran wholly inside one phase counts for that phase. The result is the
training thread's CPU time per step with the agent paused and with it working, per tracker (the agent alone:
its own threads; the trackers' own processes, e.g. wandb's service, keep running). Resumed, the agent catches
up with what came while it was paused, so the "working" phases hold about twice the usual delivery work: an
upper bound. Steps differ (each generates completions of its own lengths), so a short run scatters: with 80 steps
(``--quick``) the parquet row alone has read 1.11x to 1.24x, with 200 steps 1.02x and 1.07x.

    .venv/bin/python benchmarks/interference.py [--quick]
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import end_to_end
import harness
from harness import SIX, md_table, progress, run_case

SCRIPT = Path(__file__).resolve()
PERIOD = 0.6  # seconds per phase: ~15 steps of the tiny model, long enough for whole steps inside a phase
# Synthetic neighbours for ``report_to="none"``, on the CPU the training thread does not use, paused and resumed
# like the agent: which kind of work on the other core slows training (the agent's is Python, SQLite and small
# writes; a tracker that streams memory would be the other kind).
NEIGHBOURS = {
    "a CPU-bound loop": "x = 0\nwhile True:\n    x = (x * 7 + 1) % 1000003\n",
    "Python work on small dicts (JSON)": (
        "import json\nd = [{f'k{i}': float(i) for i in range(30)} for _ in range(200)]\n"
        "while True:\n    json.loads(json.dumps(d))\n"
    ),
    "memory streaming (128 MB copies)": (
        "import numpy as np\na = np.ones(16 * 2**20 // 2); b = np.empty_like(a)\n"
        "while True:\n    np.copyto(b, a); np.copyto(a, b)\n"
    ),
}


class PhasedClock(end_to_end.CpuClock):
    """``end_to_end.CpuClock`` that also pauses and resumes the agent every :data:`PERIOD` seconds while it runs, and
    sorts the training thread's steps (CPU and wall time) by the agent's phase."""

    steps: list[tuple[float, float]] = []  # (perf_counter, thread_time) at each step's start, and at the end

    def start(self) -> None:
        super().start()
        self.phases: list[tuple[float, bool]] = [(time.perf_counter(), False)]
        self._done = threading.Event()
        if self.agent_pid is not None:
            threading.Thread(target=self._toggle, args=(self.agent_pid,), daemon=True).start()

    def stop(self) -> None:
        self._done.set()
        time.sleep(0.05)  # the toggler's last SIGCONT
        super().stop()

    def _toggle(self, pid: int) -> None:
        paused = False
        try:
            while not self._done.wait(PERIOD):
                paused = not paused
                os.kill(pid, signal.SIGSTOP if paused else signal.SIGCONT)
                self.phases.append((time.perf_counter(), paused))
        finally:
            os.kill(pid, signal.SIGCONT)
            self.phases.append((time.perf_counter(), False))

    def window(self) -> dict:
        out = super().window()
        sums = {"paused": [0, 0.0, 0.0], "working": [0, 0.0, 0.0]}
        for (w0, c0), (w1, c1) in itertools.pairwise(self.steps):
            if any(w0 < t < w1 for t, _ in self.phases):
                continue  # the phase changed during the step
            paused = [p for t, p in self.phases if t <= w0][-1] if self.phases[0][0] <= w0 else False
            entry = sums["paused" if paused else "working"]
            entry[0] += 1
            entry[1] += w1 - w0
            entry[2] += c1 - c0
        out["phases"] = sums
        return out


def case_phased(params: dict, workdir: Path) -> dict:
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            PhasedClock.steps.append((time.perf_counter(), time.thread_time()))

        def on_train_end(self, args, state, control, **kwargs):
            PhasedClock.steps.append((time.perf_counter(), time.thread_time()))

    neighbour = None
    if params.get("neighbour"):  # the training on CPU 0, the load on CPU 1, toggled in place of the agent
        os.sched_setaffinity(0, {0})
        code = f"import os\nos.sched_setaffinity(0, {{1}})\n{NEIGHBOURS[params['neighbour']]}"
        neighbour = subprocess.Popen([sys.executable, "-c", code])
        end_to_end.CpuClock = lambda agent_pid: PhasedClock(lambda: neighbour.pid)  # type: ignore[assignment,misc]
    else:
        end_to_end.CpuClock = PhasedClock
    make = end_to_end.grpo_trainer

    def grpo_trainer(*args, **kwargs):
        trainer = make(*args, **kwargs)
        trainer.add_callback(StepClock())
        return trainer

    end_to_end.grpo_trainer = grpo_trainer
    try:
        return end_to_end.case_grpo(params, workdir)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()


CASES = {"phased": case_phased}


def run(quick: bool, tmp: Path) -> dict:
    steps = 80 if quick else 200
    configs = (
        [["parquet"], ["wandb"]]
        if quick
        else [["parquet"], ["wandb"], ["mlflow"], ["comet_ml"], ["tensorboard"], ["trackio"], list(SIX)]
    )
    rows = []
    for sinks in configs:
        progress(f"interference: {'+'.join(sinks)}, {steps} steps, the agent paused and resumed every {PERIOD} s")
        params = {"mode": "rllog", "delivery": "process", "warm": False, "prepare": True, "sinks": sinks, "steps": steps}
        result = run_case(SCRIPT, "phased", params, tmp, timeout=900)
        rows.append({"sinks": sinks, **result})
    for name in [] if quick else NEIGHBOURS:
        progress(f"interference: report_to='none' beside {name} on the other CPU, {steps} steps")
        params = {"mode": "none", "delivery": "process", "warm": False, "steps": steps, "neighbour": name}
        result = run_case(SCRIPT, "phased", params, tmp, timeout=900)
        rows.append({"sinks": [f"none, beside {name}"], **result})
    return {"steps": steps, "period": PERIOD, "rows": rows}


def render(results: dict) -> str:
    table = []
    for row in results["rows"]:
        if "error" in row:
            table.append(["+".join(row["sinks"]), row["error"], "", "", ""])
            continue
        (n_p, _, cpu_p), (n_w, _, cpu_w) = row["phases"]["paused"], row["phases"]["working"]
        paused, working = cpu_p / max(n_p, 1) * 1e3, cpu_w / max(n_w, 1) * 1e3
        table.append(
            [
                "+".join(row["sinks"]),
                f"{paused:.1f} ({n_p})",
                f"{working:.1f} ({n_w})",
                f"{working / paused:.2f}x",
                f"{row.get('cpu_agent_s', 0):.2f} s",
            ]
        )
    head = [
        "sinks",
        "training thread CPU ms/step, agent (or neighbour) paused (steps)",
        "working (steps)",
        "working / paused",
        "its CPU",
    ]
    return (
        f"Tiny GRPO, {results['steps']} steps, the agent (or the neighbour) paused/resumed every {results['period']} s:\n\n"
        + md_table(head, table)
    )


if __name__ == "__main__":
    harness.module_main(run, render, CASES, __doc__)
