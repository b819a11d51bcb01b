"""How far behind the trackers are when a TRL ``train()`` through the rllog mixin returns (docs/trl.md, "When").

Each round is a fresh process: a tiny GRPO run (logging every 3 steps, eval every 2, as the issue's flow) with five
trackers + parquet, all offline. Right after ``train()`` it counts the ``train/loss`` and ``eval/loss`` points
TensorBoard's files hold, then times ``wait_for_trackers()`` and counts again.

    python benchmarks/train_end_lag.py --steps 12 120 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACKERS = ["wandb", "tensorboard", "mlflow", "trackio", "comet_ml", "parquet"]
LOGGING_STEPS = 3  # the flow: a log every 3 steps, an evaluation every 2
EVAL_STEPS = 2

ROUND = r"""
import json, sys, time
import comet_ml.experiment
comet_ml.experiment.get_env_cloud_details = lambda *a, **k: None  # no cloud-metadata probe offline
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tiny_grpo import make_grpo_trainer

model, out, steps, trackers = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].split(",")
trainer = make_grpo_trainer(model, out, steps=steps, report_to=trackers, eval_prompts=1, eval_strategy="steps",
                            eval_steps=EVAL_STEPS, logging_steps=LOGGING_STEPS, log_completions=False)


def points():
    logdir = trainer.rllog_callback.tensorboard_logdir
    events = EventAccumulator(logdir, size_guidance={"scalars": 0}).Reload()
    tags = events.Tags()["scalars"]
    return {tag: len(events.Scalars(tag)) if tag in tags else 0 for tag in ("train/loss", "eval/loss")}


trainer.train()
before = points()
start = time.perf_counter()
report = trainer.rllog_callback.wait_for_trackers()
waited = time.perf_counter() - start
after = points()
trainer.rllog_run.finish()
print(json.dumps({"steps": steps, "before": before, "after": after, "wait_s": waited, "ok": report.ok}))
""".replace("LOGGING_STEPS", str(LOGGING_STEPS)).replace("EVAL_STEPS", str(EVAL_STEPS))


def offline_env(root: Path) -> dict[str, str]:
    from rllog.offline import OFFLINE_ENV

    dirs = {name: root / name.lower() for name in ("WANDB_DIR", "TRACKIO_DIR", "RLLOG_DIR", "COMET_OFFLINE_DIRECTORY")}
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TENSORBOARD_LOGGING_DIR"} | dict(OFFLINE_ENV)
    env |= {k: str(v) for k, v in dirs.items()}
    env |= {
        "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
        "RLLOG_SYSTEM_METRICS": "0",
    }
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[12, 120])
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from rllog.demo import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(str(Path(tmp) / "model"))
        script = Path(tmp) / "round.py"
        script.write_text(ROUND)
        for steps in options.steps:
            results = []
            for i in range(options.rounds):
                root = Path(tmp) / f"{steps}-{i}"
                command = [sys.executable, str(script), model, str(root / "out"), str(steps), ",".join(TRACKERS)]
                done = subprocess.run(command, capture_output=True, text=True, env=offline_env(root), cwd=tmp, check=False)
                if done.returncode != 0:
                    raise SystemExit(done.stderr[-3000:])
                results.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(json.dumps(results[-1]), flush=True)
            waits = [r["wait_s"] for r in results]
            print(
                f"{steps} steps: wait_for_trackers() median {statistics.median(waits):.2f} s (min {min(waits):.2f}, max {max(waits):.2f})"
            )


if __name__ == "__main__":
    main()
