"""``rllog demo``: a run written to the embedded default (parquet), then ``show`` and ``plot``.

By default it is a real tiny GRPO training with TRL (a tiny local Qwen2 model built on the spot, on the
CPU, no hub); ``--simulate`` writes GRPO-shaped metrics without TRL.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import rllog


def simulate(run: "rllog.Run", steps: int, seed: int = 0) -> None:
    """~30 GRPO-shaped metrics a step and a completions table every 10 steps."""
    rng = random.Random(seed)
    entropy = 2.2
    for step in range(steps):
        progress = step / max(1, steps - 1)
        reward = 0.15 + 0.6 * progress + rng.gauss(0, 0.04)
        entropy *= 0.985
        length = 60 + 40 * math.sin(progress * 3) + rng.gauss(0, 3)
        metrics = {
            "loss": rng.gauss(0.0, 0.02), "grad_norm": abs(rng.gauss(0.8, 0.2)), "learning_rate": 1e-6 * (1 - progress),
            "num_tokens": float((step + 1) * 4096), "reward": reward, "reward_std": abs(rng.gauss(0.3, 0.05)),
            "rewards/accuracy/mean": reward, "rewards/accuracy/std": abs(rng.gauss(0.3, 0.05)),
            "rewards/format/mean": min(1.0, 0.5 + progress), "rewards/format/std": 0.1,
            "frac_reward_zero_std": max(0.0, 0.3 - 0.25 * progress), "kl": 0.002 + 0.03 * progress, "entropy": entropy,
            "completions/mean_length": length, "completions/min_length": length - 30, "completions/max_length": length + 60,
            "completions/clipped_ratio": 0.05 + 0.05 * progress, "completions/mean_terminated_length": length - 5,
            "completions/min_terminated_length": length - 35, "completions/max_terminated_length": length + 40,
            "clip_ratio/low_mean": 0.01, "clip_ratio/high_mean": 0.02, "clip_ratio/region_mean": 0.03,
            "clip_ratio/low_min": 0.0, "clip_ratio/high_max": 0.05, "step_time": 0.5 + rng.random() * 0.1,
            "epoch": progress,
        }
        run.log(metrics, step=step)
        if step % 10 == 0:
            n = 4
            run.log_table("completions", {
                "prompt": [f"What is {step}+{i}?" for i in range(n)],
                "completion": [f"{step + i}" if rng.random() < reward else "I am not sure" for i in range(n)],
                "rewards/accuracy": [rng.random() for _ in range(n)],
                "advantage": [rng.gauss(0, 1) for _ in range(n)],
            }, step=step)


def run_demo(args: SimpleNamespace) -> int:
    from rllog import cli

    if args.simulate:
        run = rllog.init(report_to=args.report_to, project="rllog-demo", name="simulated-grpo", run_dir=args.run_dir, config={"steps": args.steps, "simulated": True})
        simulate(run, args.steps)
        report = run.finish()
    else:
        from rllog.integrations.tiny_grpo import train_tiny_grpo

        run_dir, report = train_tiny_grpo(steps=args.steps, report_to=args.report_to or "parquet", run_dir=args.run_dir)
        run = SimpleNamespace(run_dir=run_dir)
    cli.console.print(f"\n[bold]delivery:[/bold]\n{report}\n")
    cli.cmd_show(SimpleNamespace(run_dir=str(run.run_dir)))
    cli.cmd_plot(SimpleNamespace(run_dir=str(run.run_dir), output=None, metrics=None))
    return 0 if report.ok else 1
