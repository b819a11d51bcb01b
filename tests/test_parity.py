"""Parity with transformers' own tracker callbacks (issue 13): the same seeded tiny GRPO run, trained with
``report_to`` through transformers' callbacks and through the rllog mixin, each tracker read back from its own
storage. Switching must rename no chart and lose no metric, config entry or completions row.

Both runs train in their own process, side by side, each with its own tracker storage.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

import readers.mlflow  # noqa: E402
import readers.tensorboard  # noqa: E402
import readers.trackio  # noqa: E402
import readers.wandb  # noqa: E402
from readers import ReadBack  # noqa: E402
from rllog.integrations.transformers import rename  # noqa: E402
from rllog.run import load_run_info  # noqa: E402
from tiny_grpo import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

TRACKERS = ["tensorboard", "mlflow", "trackio", "wandb"]
STEPS = 3
PROJECT = "huggingface"  # TrainingArguments.project's default: trackio's project, the wandb project without WANDB_PROJECT
TIMINGS = ("runtime", "per_second", "step_time", "profiling/")  # differ from run to run

TRAIN = r'''
import json, sys
from tiny_grpo import make_grpo_trainer

model_dir, out, mode, trackers = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
trainer = make_grpo_trainer(model_dir, out, steps=%(steps)d, report_to=trackers, mixin=mode == "rllog", eval_prompts=1,
                            eval_strategy="steps", eval_steps=%(steps)d, log_unique_prompts=True, rllog_options={"health": False})
trainer.train()
result = {"num_parameters": trainer.model.num_parameters()}
if mode == "rllog":
    report = trainer.rllog_run.finish(timeout=180)
    result.update(run_dir=str(trainer.rllog_run.run_dir), ok=report.ok, report=str(report))
else:
    import wandb
    wandb.finish()  # transformers' WandbCallback leaves the run open
print(json.dumps(result), flush=True)
''' % {"steps": STEPS}


def storage(root: Path) -> dict[str, str]:
    """Tracker storage under ``root`` (the layout of conftest's ``tracker_dirs``), for one process."""
    dirs = {name: root / sub for name, sub in (("WANDB_DIR", "wandb_dir"), ("WANDB_CACHE_DIR", "wandb_cache"), ("WANDB_DATA_DIR", "wandb_data"),
                                                ("WANDB_CONFIG_DIR", "wandb_config"), ("TRACKIO_DIR", "trackio"), ("RLLOG_DIR", "rllog_runs"),
                                                ("MLFLOW_ARTIFACT_ROOT", "mlartifacts"))}
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    shutil.copy(readers.mlflow.migrated_db(), root / "mlflow.db")  # migrating takes seconds
    return {k: str(v) for k, v in dirs.items()} | {"MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", "tmp": str(root)}


@pytest.fixture(scope="module")
def both_ways(tmp_path_factory):
    """Train natively and through rllog, at the same time, each in its own process and storage."""
    root = tmp_path_factory.mktemp("parity")
    model = build_tiny_model(str(root / "model"))
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    script = root / "train.py"
    script.write_text(TRAIN)
    runs = {}
    for mode in ("native", "rllog"):
        env_dirs = storage(root / mode)
        env = {k: v for k, v in os.environ.items() if k != "TENSORBOARD_LOGGING_DIR"}  # both write <output_dir>/runs/...
        env |= {k: v for k, v in env_dirs.items() if k != "tmp"} | {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([tests_dir, env.get("PYTHONPATH", "")])}
        command = [sys.executable, str(script), model, str(root / mode / "out"), mode, ",".join(TRACKERS)]
        runs[mode] = (env_dirs, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root / mode))
    results = {}
    for mode, (env_dirs, proc) in runs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{mode}: {stderr[-4000:]}"
        results[mode] = (env_dirs, json.loads(stdout.strip().splitlines()[-1]), root / mode / "out")
    return results


# -- reading what transformers' callbacks stored (no rllog run id to find it by) -----------------------
def native_tensorboard(out: Path) -> ReadBack:
    (logdir,) = (out / "runs").iterdir()
    return readers.tensorboard.read_back({}, None, logdir=str(logdir))


def native_mlflow(env: dict) -> ReadBack:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    metrics = {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)] for key in run.data.metrics}
    return ReadBack(metrics=metrics, config=dict(run.data.params))


def wandb_run_file(env: dict) -> Path:
    (path,) = (Path(env["WANDB_DIR"]) / "wandb").glob("*run-*/run-*.wandb")
    return path


def wandb_rows(env: dict) -> tuple[list[dict], dict]:
    """Every history row of the one wandb run under ``env`` (tables loaded from their files; rows without a
    step key included, unlike :func:`readers.wandb.read_file`), and its config."""
    path = wandb_run_file(env)
    rows, config = [], {}
    for kind, msg in readers.wandb.iter_records(path):
        if kind in ("run", "config"):
            for item in (msg.config.update if kind == "run" else msg.update):
                config["/".join(readers.wandb._key(item))] = json.loads(item.value_json)
        elif kind == "history":
            row: dict = {}
            for item in msg.item:
                key = readers.wandb._key(item)
                if len(key) == 1:
                    row[key[0]] = json.loads(item.value_json)
                else:  # a media value: its fields under nested keys
                    row.setdefault(key[0], {})["/".join(key[1:])] = json.loads(item.value_json)
            for key, value in list(row.items()):
                if isinstance(value, dict) and value.get("_type") == "table-file":
                    table = json.loads((path.parent / "files" / value["path"]).read_text())
                    row[key] = [dict(zip(table["columns"], r, strict=True)) for r in table["data"]]
            rows.append(row)
    config.pop("_wandb", None)
    return rows, config


def trackio_run(env: dict) -> ReadBack:
    import sqlite3

    with sqlite3.connect(readers.trackio.db_path(env, PROJECT)) as conn:
        (run_id,) = {r[0] for r in conn.execute("SELECT run_id FROM configs")}
    return readers.trackio.read_back(env, type("Info", (), {"run_id": run_id, "project": PROJECT})(), project=PROJECT)


def deterministic(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not any(t in k for t in TIMINGS)}


def values(series: list[tuple[int, float]]) -> list[float]:
    return [float("nan") if v is None else v for _, v in series]


def same_values(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, rel=1e-6, abs=1e-9) for x, y in zip(a, b))
