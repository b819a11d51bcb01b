"""GRPO on a GPU: what logging costs when the device does the training.

One command, no network (every tracker offline, the model built from a config with random weights, nothing
downloaded)::

    .venv/bin/python benchmarks/gpu.py            # on a CUDA machine: a ~76M-parameter Qwen2, bf16
    .venv/bin/python benchmarks/gpu.py --smoke    # on CPU, the demo's tiny model, a few steps: a check that it runs

In one process, after an untimed warm-up training, round after round in a rotated order:

- ``none``: ``report_to="none"``;
- ``parquet``: the rllog mixin with its parquet default;
- ``five``: the rllog mixin with wandb, tensorboard, mlflow, trackio and comet_ml + parquet (delivery in the agent);
- ``callbacks``: transformers' own ``report_to`` with the same five trackers (their work on the training thread).

It prints, per configuration: the median step time and its ratio to ``none`` in the same round (steps from
:data:`WARMUP_STEPS` on: rllog's trackers are open by then), tensor-to-host conversions per step (each is a device
sync on a GPU) on the training thread and on rllog's threads, and the training thread's time off the CPU per step
(blocked: device syncs, the GIL, locks) and waiting for a CPU (runnable but not running). Unless ``--smoke``, it
writes a dated section of docs/benchmarks.md (``--doc PATH`` writes there instead, in any mode).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness
from harness import FIVE, fmt, fmt_ratio, md_table, median, progress, run_case

SCRIPT = Path(__file__).resolve()
DOC = harness.ROOT / "docs" / "benchmarks.md"
SECTION_BEGIN = "<!-- gpu.py: GRPO on a GPU (begin) -->"
SECTION_END = "<!-- gpu.py: GRPO on a GPU (end) -->"
WARMUP_STEPS = 3  # steps left out of the step times: CUDA kernels compiled, caches filled, rllog's trackers opening
CONFIGS = {
    "none": 'report_to="none"',
    "parquet": "rllog mixin, parquet",
    "five": "rllog mixin, five trackers + parquet",
    "callbacks": "transformers' callbacks, the five trackers",
}
# A model that keeps an H100 busy at these batch sizes: ~76M parameters (12 layers of 768), bf16.
GPU_MODEL = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
}
GPU_TRAINING = {
    "per_device_train_batch_size": 16,
    "num_generations": 8,
    "max_completion_length": 64,
    "use_cpu": False,
    "bf16": True,
}
# Measured on an H100 (docs/benchmarks.md, section 9): ~1.2 s a step, ~140 s a round of 20 steps, ~8 minutes for 3
# rounds with start-up: one call of a 10-minute device slot.
GPU_STEPS, GPU_ROUNDS = 20, 3
# The smoke run: CPU, the demo's tiny model, cheap trackers only (tensorboard's import is ~0.3 s; trackio for the
# callbacks' clean-up, which differs by transformers version), so that the suite runs every code path in seconds.
SMOKE_TRACKERS = ["tensorboard", "trackio"]
SMOKE_STEPS, SMOKE_ROUNDS = WARMUP_STEPS + 2, 1


def build_model(directory: Path, smoke: bool) -> tuple[str, int]:
    """A Qwen2 with random weights and the demo's tokenizer, saved to ``directory``; (path, parameter count)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rllog import demo

    path = demo.build_tiny_model(str(directory))  # the tokenizer, and the tiny model (kept for --smoke)
    if not smoke:
        tiny = Qwen2Config.from_pretrained(path)
        config = Qwen2Config(
            vocab_size=tiny.vocab_size,
            max_position_embeddings=tiny.max_position_embeddings,
            pad_token_id=tiny.pad_token_id,
            eos_token_id=tiny.eos_token_id,
            bos_token_id=None,
            tie_word_embeddings=True,
            **GPU_MODEL,
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    return path, sum(p.numel() for p in model.parameters())


class ThreadClock:
    """The training thread's CPU time, time waiting for a CPU, and context switches (``/proc/self/task/TID``)."""

    def __init__(self) -> None:
        self.tid = threading.main_thread().native_id

    def sample(self) -> dict[str, float]:
        base = f"/proc/self/task/{self.tid}"
        try:
            cpu_ns, wait_ns, _ = (int(x) for x in open(f"{base}/schedstat").read().split())
            status = open(f"{base}/status").read()
        except (OSError, ValueError):
            return {}

        def count(field: str) -> float:
            return float(status.split(f"{field}:")[1].split()[0])

        return {
            "wall": time.perf_counter(),
            "cpu": cpu_ns / 1e9,
            "waited": wait_ns / 1e9,
            "voluntary": count("voluntary_ctxt_switches"),
            "preempted": count("nonvoluntary_ctxt_switches"),
        }


def make_trainer(config: str, model_dir: str, workdir: Path, steps: int, smoke: bool, trackers: list[str]):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rllog import demo
    from rllog.integrations.trl import RLLogMixin

    report_to = {"none": "none", "parquet": ["parquet"], "five": ["parquet", *trackers], "callbacks": list(trackers)}[config]
    overrides = {} if smoke else GPU_TRAINING
    settings = demo.grpo_settings(str(workdir / "out"), steps, report_to, run_name=f"gpu-{config}", **overrides)
    common = {
        "model": model_dir,
        "reward_funcs": [demo.reward_has_digit, demo.reward_short],
        "args": GRPOConfig(**settings),
        "train_dataset": Dataset.from_dict({"prompt": demo.PROMPTS}),
    }
    if config in ("parquet", "five"):

        class Trainer(RLLogMixin, GRPOTrainer):
            pass

        options = {"project": "bench-gpu", "name": config, "run_dir": str(workdir / "run")}
        return Trainer(**common, rllog_options=options)
    return GRPOTrainer(**common)


def train_once(config: str, model_dir: str, workdir: Path, steps: int, smoke: bool, trackers: list[str], counter) -> dict:
    from transformers import TrainerCallback

    if config == "callbacks" and "comet_ml" in trackers:
        import comet_ml  # noqa: F401  (transformers' CometCallback imports it; its cloud probe must be off first)

        harness.block_comet_probe()
    clock = ThreadClock()
    begins: list[float] = []
    counts: dict = {}
    marks: dict = {}

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            begins.append(time.perf_counter())
            if len(begins) == WARMUP_STEPS + 1:
                marks["begin"] = clock.sample()
                counter.start(counts)

        def on_train_end(self, args, state, control, **kwargs):
            marks["end"] = clock.sample()
            counter.stop()

    trainer = make_trainer(config, model_dir, workdir, steps, smoke, trackers)
    trainer.add_callback(Steps())
    if config in ("parquet", "five"):  # trackers open before training, as transformers' callbacks open theirs
        run = trainer.rllog_callback.start(trainer.args, trainer.model, trainer.state)
        run.log({"bench/warmup": 0.0}, step=0)
        harness.wait_delivered(run.run_dir, run.sink_names, 1, timeout=300)
    started = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - started
    timed = len(begins) - WARMUP_STEPS  # steps inside [begin, end]
    b, e = marks.get("begin", {}), marks.get("end", {})
    d = {k: e[k] - b[k] for k in e if k in b}
    steps_ms = [(y - x) * 1e3 for x, y in zip(begins[WARMUP_STEPS:], begins[WARMUP_STEPS + 1 :], strict=False)]
    result = {
        "config": config,
        "train_s": train_s,
        "step_median_ms": median(steps_ms),
        "timed_steps": timed,
        "syncs_per_step": {who: sum(per.values()) / max(1, timed) for who, per in counts.items()},
        "blocked_ms_per_step": (d["wall"] - d["cpu"] - d["waited"]) * 1e3 / max(1, timed) if d else None,
        "waited_ms_per_step": d["waited"] * 1e3 / max(1, timed) if d else None,
        "blocks_per_step": d["voluntary"] / max(1, timed) if d else None,
        "preempted_per_step": d["preempted"] / max(1, timed) if d else None,
    }
    if config in ("parquet", "five"):
        result["delivered"] = trainer.rllog_run.finish(timeout=300).ok
    elif config == "callbacks":
        import wandb

        wandb.finish() if "wandb" in trackers else None
        if "trackio" in trackers:
            import trackio

            try:  # transformers' TrackioCallback finishes its run at train end in recent versions
                trackio.finish()
            except RuntimeError:
                pass
    return result


def case_series(params: dict, workdir: Path) -> dict:
    import end_to_end
    import torch

    smoke = params["smoke"]
    if params.get("threads") == "one":
        torch.set_num_threads(1)
    if not smoke and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: run with --smoke on a machine without one")
    model_dir, parameters = build_model(workdir / "model", smoke)
    counter = end_to_end.SyncCounter()
    trackers = params["trackers"]
    if not smoke:  # CUDA's and the kernels' first-use costs, outside every configuration's figures
        progress("gpu: warm-up training")
        train_once("none", model_dir, workdir / "warmup", WARMUP_STEPS + 1, smoke, trackers, counter)
    runs = []
    keys = list(CONFIGS)
    for round_ in harness.rounds_within(params["rounds"], params.get("budget")):
        order = keys[round_ % len(keys) :] + keys[: round_ % len(keys)]
        for config in order:
            progress(f"gpu: round {round_}, {CONFIGS[config]}")
            result = train_once(config, model_dir, workdir / f"r{round_}-{config}", params["steps"], smoke, trackers, counter)
            runs.append({"round": round_, **result})
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not smoke else "CPU"
    rounds_done = len({r["round"] for r in runs})
    return {"runs": runs, "parameters": parameters, "device": device, "torch": torch.__version__, "rounds": rounds_done}


CASES = {"series": case_series}


def summary(results: dict) -> list[dict]:
    runs = [r for r in results.get("runs", []) if "error" not in r]
    out = []
    for config, label in CONFIGS.items():
        mine = [r for r in runs if r["config"] == config]
        if not mine:
            continue
        ratios = []
        for r in mine:
            base = next((x for x in runs if x["config"] == "none" and x["round"] == r["round"]), None)
            if base and base["step_median_ms"]:
                ratios.append(r["step_median_ms"] / base["step_median_ms"])
        whos = sorted({who for r in mine for who in r["syncs_per_step"]})
        out.append(
            {
                "label": label,
                "step_ms": median([r["step_median_ms"] for r in mine]),
                "ratio": median(ratios),
                "ratios": ratios,
                "syncs": {who: median([r["syncs_per_step"].get(who, 0.0) for r in mine]) for who in whos},
                "blocked_ms": median([r["blocked_ms_per_step"] for r in mine]),
                "waited_ms": median([r["waited_ms_per_step"] for r in mine]),
                "blocks": median([r["blocks_per_step"] for r in mine]),
                "preempted": median([r["preempted_per_step"] for r in mine]),
                "train_s": median([r["train_s"] for r in mine]),
                "delivered": all(r.get("delivered", True) for r in mine),
            }
        )
    return out


def render(results: dict) -> str:
    rows = [
        [
            s["label"],
            s["step_ms"],
            fmt_ratio(s["ratio"]),
            ", ".join(f"{x:.3f}" for x in s["ratios"]),
            fmt(s["syncs"].get("main thread", 0.0), 2),
            fmt(s["syncs"].get("rllog threads", 0.0), 2),
            s["blocked_ms"],
            s["waited_ms"],
            s["blocks"],
            s["preempted"],
            s["train_s"],
            "yes" if s["delivered"] else "**no**",
        ]
        for s in summary(results)
    ]
    head = (
        f"{results.get('when', '')}, {results.get('device', '?')}, torch {results.get('torch', '?')}, commit "
        f"{results.get('commit', '?')}: GRPO on a Qwen2 of {results.get('parameters', 0):,} parameters (random "
        f"weights), {results.get('steps')} steps x {results.get('rounds')} round(s), trackers: "
        f"{', '.join(results.get('trackers', []))}; step times from step {WARMUP_STEPS + 1} on, ratios to `none` in the "
        "same round. Conversions: tensor-to-host calls (`.item()`, `.tolist()`, ...; each a device sync on a GPU). "
        "Blocked: the training thread off the CPU (device syncs, the GIL, locks); waiting: runnable, not running."
    )
    table = md_table(
        [
            "configuration",
            "median step ms",
            "step / none",
            "per round",
            "conversions per step, training thread",
            "conversions per step, rllog threads",
            "training thread blocked ms per step",
            "waiting for a CPU ms per step",
            "blocks per step",
            "preemptions per step",
            "train() s",
            "delivered",
        ],
        rows,
    )
    return f"{head}\n\n{table}"


def main() -> int:
    if "--worker" in sys.argv:
        harness.worker_main(CASES)
        return 0
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, the tiny model, a few steps (seconds): a check only")
    parser.add_argument("--steps", type=int, default=None, help=f"steps per training (default {GPU_STEPS})")
    parser.add_argument("--rounds", type=int, default=None, help=f"rounds (default {GPU_ROUNDS})")
    parser.add_argument("--doc", help="write the dated section into this file (default: docs/benchmarks.md, not with --smoke)")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument(
        "--budget", type=float, help="seconds for the series: no round is started that the last one says would not fit"
    )
    args = parser.parse_args()
    steps = args.steps or (SMOKE_STEPS if args.smoke else GPU_STEPS)
    rounds = args.rounds or (SMOKE_ROUNDS if args.smoke else GPU_ROUNDS)
    trackers = SMOKE_TRACKERS if args.smoke else FIVE
    params = {"smoke": args.smoke, "steps": steps, "rounds": rounds, "trackers": trackers, "budget": args.budget}
    with tempfile.TemporaryDirectory(prefix="rllog-bench-gpu-") as tmp:
        # On a GPU, torch keeps its default threads, as in a user's script. The CPU smoke run pins it to one: torch's
        # threads wait for each other spinning, which on a loaded CPU made a 5-step check take minutes.
        threads = "one" if args.smoke else "default"
        results = run_case(SCRIPT, "series", params | {"threads": threads}, Path(tmp), threads=threads, timeout=3600)
    if "error" in results:
        print(f"gpu.py failed: {results['error']} (log: {results.get('log')})", file=sys.stderr)
        return 1
    results |= params | {
        "rounds": results.get("rounds", rounds),  # fewer than asked where --budget ran out
        "when": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "commit": harness.git_commit(),
    }
    text = render(results)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))
    doc = Path(args.doc) if args.doc else (None if args.smoke else DOC)
    if doc is not None:
        import end_to_end

        section = f"## 9. GRPO on a GPU (`benchmarks/gpu.py`)\n\n{text}"
        old = doc.read_text() if doc.exists() else ""
        doc.write_text(end_to_end.replace_doc_part(old, SECTION_BEGIN, SECTION_END, section))
    return 0


if __name__ == "__main__":
    sys.exit(main())
