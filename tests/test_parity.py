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

import readers.comet_ml
import readers.mlflow
import readers.tensorboard
import readers.trackio
import readers.wandb
from readers import ReadBack
from tiny_grpo import build_tiny_model

from rllog.integrations.transformers import rename
from rllog.run import load_run_info

pytestmark = pytest.mark.slow

TRACKERS = ["tensorboard", "mlflow", "trackio", "wandb", "comet_ml"]
STEPS = 3
PROJECT = "huggingface"  # TrainingArguments.project's default: trackio's project, the wandb project without WANDB_PROJECT
TIMINGS = ("runtime", "per_second", "step_time", "profiling/")  # differ from run to run

TRAIN = r"""
import json, sys
import comet_ml.experiment  # transformers' Comet callback would probe the cloud metadata address (no setting stops it)
comet_ml.experiment.get_env_cloud_details = lambda *a, **k: None
from tiny_grpo import make_grpo_trainer

model_dir, out, mode, trackers = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
# docs/trl.md's example class name, "Trainer": TRL's profiling names must stay TRL's (GRPOTrainer.*)
trainer = make_grpo_trainer(model_dir, out, steps=STEPS, report_to=trackers, mixin=mode == "rllog", eval_prompts=1,
                            eval_strategy="steps", eval_steps=STEPS, log_unique_prompts=True, rllog_options={"health": False},
                            trainer_class_name="Trainer")
trainer.train()
result = {"num_parameters": trainer.model.num_parameters()}
if mode == "rllog":
    report = trainer.rllog_run.finish(timeout=180)
    result.update(run_dir=str(trainer.rllog_run.run_dir), ok=report.ok, report=str(report))
else:
    import wandb
    wandb.finish()  # transformers' WandbCallback leaves the run open
print(json.dumps(result), flush=True)
""".replace("STEPS", str(STEPS))


def storage(root: Path) -> dict[str, str]:
    """Tracker storage under ``root`` (the layout of conftest's ``tracker_dirs``), for one process."""
    dirs = {
        name: root / sub
        for name, sub in (
            ("WANDB_DIR", "wandb_dir"),
            ("WANDB_CACHE_DIR", "wandb_cache"),
            ("WANDB_DATA_DIR", "wandb_data"),
            ("WANDB_CONFIG_DIR", "wandb_config"),
            ("TRACKIO_DIR", "trackio"),
            ("RLLOG_DIR", "rllog_runs"),
            ("MLFLOW_ARTIFACT_ROOT", "mlartifacts"),
            ("COMET_OFFLINE_DIRECTORY", "comet"),
        )
    }
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
        env |= {k: v for k, v in env_dirs.items() if k != "tmp"} | {
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([tests_dir, env.get("PYTHONPATH", "")]),
        }
        command = [sys.executable, str(script), model, str(root / mode / "out"), mode, ",".join(TRACKERS)]
        runs[mode] = (
            env_dirs,
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root / mode),
        )
    results = {}
    for mode, (env_dirs, proc) in runs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{mode}: {stderr[-4000:]}"
        result = json.loads(stdout.strip().splitlines()[-1]) | {"stderr": stderr}
        results[mode] = (env_dirs, result, root / mode / "out")
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
            for item in msg.config.update if kind == "run" else msg.update:
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
    if len(a) != len(b):
        return False
    return all((math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, rel=1e-6, abs=1e-9) for x, y in zip(a, b, strict=True))


def rllog_info(both_ways):
    env, result, out = both_ways["rllog"]
    assert result["ok"], result["report"]
    return env, load_run_info(result["run_dir"])[0], out


def assert_same_series(native: dict, ours: dict, by_step: bool = True) -> None:
    """Every deterministic native series is in ``ours`` with the same values (and steps, if ``by_step``)."""
    compared = deterministic(native)
    assert compared, "nothing to compare"
    for key, series in compared.items():
        assert same_values(values(series), values(ours[key])), (key, series, ours[key])
        if by_step:
            assert [s for s, _ in series] == [s for s, _ in ours[key]], key


def test_tensorboard_keeps_every_chart_and_value_where_transformers_writes_it(both_ways):
    native = native_tensorboard(both_ways["native"][2])
    env, info, out = rllog_info(both_ways)
    (logdir,) = (out / "runs").iterdir()  # <output_dir>/runs/<Mon DD_HH-MM-SS>_<host>, as transformers' callback
    ours = readers.tensorboard.read_back(env, info, logdir=str(logdir))
    assert set(native.metrics) <= set(ours.metrics), set(native.metrics) - set(ours.metrics)
    assert {"train/reward", "eval/reward", "train/train_runtime"} <= set(native.metrics)
    assert_same_series(native.metrics, ours.metrics)
    assert any(k.startswith("profiling/") for k in ours.metrics)  # more than transformers gives TensorBoard:
    assert [s for s, _ in ours.tables["completions"]] == [1, 2, 3]  # timings and the completions
    assert ours.status == "finished"


def test_mlflow_gets_the_names_every_other_tracker_gets(both_ways):
    native = native_mlflow(both_ways["native"][0])
    env, info, _ = rllog_info(both_ways)
    ours = readers.mlflow.read_back(env, info)
    # transformers' MLflow callback logs "loss", "eval_loss"; rllog gives MLflow what the others get (documented)
    expected = {key if key.startswith("profiling/") else rename(key): series for key, series in native.metrics.items()}
    assert {"train/loss", "eval/loss", "profiling/Time taken: GRPOTrainer.reward_has_digit"} <= set(expected)
    assert set(expected) <= set(ours.metrics), set(expected) - set(ours.metrics)
    assert_same_series(expected, ours.metrics)
    assert ours.config["report_to"] == native.config["report_to"] == str(TRACKERS)  # MLflow params are text
    assert ours.config["model/num_parameters"] == str(both_ways["native"][1]["num_parameters"])  # transformers gives MLflow none
    assert [s for s, _ in ours.tables["completions"]] == [1, 2, 3]


def test_wandb_keeps_every_chart_value_config_and_completions_row(both_ways):
    native_env, native_result, _ = both_ways["native"]
    rows, native_config = wandb_rows(native_env)
    env, info, _ = rllog_info(both_ways)
    ours = readers.wandb.read_back(env, info)
    charts = {k for row in rows for k, v in row.items() if isinstance(v, (int, float)) and not k.startswith("_")} - {
        "train/global_step"
    }
    assert {"train/reward", "eval/loss", "profiling/Time taken: GRPOTrainer._prepare_inputs"} <= charts
    assert charts <= set(ours.metrics), charts - set(ours.metrics)  # profiling rows included: TRL logs them to wandb itself
    stepped = ReadBack()
    readers.wandb.read_file(wandb_run_file(native_env), stepped)  # the rows on transformers' train/global_step axis
    assert_same_series(stepped.metrics, ours.metrics)
    assert ours.config["model/num_parameters"] == native_config["model/num_parameters"] == native_result["num_parameters"]
    # TRL's wandb tables: one per log call, train and eval under one name, and again with the final summary
    native_tables = [row["completions"] for row in rows if "completions" in row]
    ours_tables = [t for _, t in ours.tables["completions"]] + [t for _, t in ours.tables["eval/completions"]]
    assert [s for s, _ in ours.tables["completions"]] == [1, 2, 3] and [s for s, _ in ours.tables["eval/completions"]] == [3]
    assert all(len(t) == 1 for t in ours_tables)  # log_unique_prompts: one row per prompt
    assert (
        ours_tables == native_tables[: len(ours_tables)] and native_tables[-1] == native_tables[-2]
    )  # same rows, "step" column included


def test_trackio_keeps_every_chart_value_config_and_completions_row(both_ways):
    native = trackio_run(both_ways["native"][0])
    env, info, _ = rllog_info(both_ways)
    ours = readers.trackio.read_back(env, info)
    charts = set(native.metrics) - {"train/global_step"}
    assert charts <= set(ours.metrics), charts - set(ours.metrics)
    # transformers logs trackio rows on trackio's own counter (1, 3, 5 here: table rows in between); rllog on the trainer's step
    assert_same_series({k: v for k, v in native.metrics.items() if k in charts}, ours.metrics, by_step=False)
    assert [s for s, _ in ours.metrics["train/reward"]] == [1, 2, 3]
    assert ours.config["model/num_parameters"] == native.config["model/num_parameters"]
    native_rows = [t for _, t in native.tables["completions"]]
    ours_rows = [t for _, t in ours.tables["completions"]] + [t for _, t in ours.tables["eval/completions"]]
    assert ours_rows == native_rows[: len(ours_rows)]


def comet_metrics(env: dict) -> dict[str, list[tuple[int, float]]]:
    """Every metric in the offline archives under ``env`` (Comet's own ``sys.*`` and process duration left out)."""
    import zipfile

    metrics: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(env["COMET_OFFLINE_DIRECTORY"]).glob("*.zip")):
        for message in readers.comet_ml._messages(zipfile.ZipFile(path)):
            if message["type"] != "metric_msg":
                continue
            metric = message["payload"]["metric"]
            name = metric["metricName"]
            if name in readers.comet_ml.COMET_OWN_METRICS or name.startswith("sys."):
                continue
            metrics.setdefault(name, []).append((metric.get("step"), readers.comet_ml._value(metric["metricValue"])))
    return metrics


def test_comet_keeps_every_chart_and_value(both_ways):
    native = comet_metrics(both_ways["native"][0])
    env, info, _ = rllog_info(both_ways)
    ours = readers.comet_ml.read_back(env, info)
    assert {"train/reward", "train/loss"} <= set(native), sorted(native)
    assert set(deterministic(native)) <= set(ours.metrics), set(deterministic(native)) - set(ours.metrics)
    assert_same_series(native, ours.metrics, by_step=False)
    assert [s for s, _ in ours.metrics["train/reward"]] == [1, 2, 3]


def test_config_keeps_the_users_report_to_as_a_list_where_the_tracker_takes_lists(both_ways):
    """Not what the mixin leaves TRL (``[]``), and not its text: wandb and trackio store lists."""
    native_env = both_ways["native"][0]
    env, info, _ = rllog_info(both_ways)
    assert wandb_rows(native_env)[1]["report_to"] == trackio_run(native_env).config["report_to"] == TRACKERS
    assert readers.wandb.read_back(env, info).config["report_to"] == TRACKERS
    assert readers.trackio.read_back(env, info).config["report_to"] == TRACKERS


# -- run metadata: what a runs table, a saved view or a filter reads besides the charts ------------------
def wandb_summary(path: Path) -> dict:
    summary: dict = {}
    for kind, msg in readers.wandb.iter_records(path):
        if kind == "summary":
            for item in msg.update:
                summary["/".join(readers.wandb._key(item))] = json.loads(item.value_json)
    return summary


def test_wandb_run_summary_and_nested_config_are_transformers(both_ways):
    """The runs table's ``train_loss``/``train_runtime`` columns (WandbCallback's run summary) and dict-valued
    arguments kept as one dict value (``accelerator_config``, the model's ``rope_parameters``)."""
    native_env = both_ways["native"][0]
    native_summary, native_config = wandb_summary(wandb_run_file(native_env)), wandb_rows(native_env)[1]
    env, info, _ = rllog_info(both_ways)
    (ours_file,) = readers.wandb.run_files(env["WANDB_DIR"], readers.wandb.wandb_run_id(info.run_id))
    ours_summary, ours = wandb_summary(ours_file), readers.wandb.read_back(env, info)
    single_values = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "total_flos"}
    assert single_values <= set(native_summary) and single_values <= set(ours_summary), set(ours_summary)
    for key in ("train_loss", "total_flos"):  # the deterministic ones
        assert ours_summary[key] == pytest.approx(native_summary[key], rel=1e-6), key
    for key in ("accelerator_config", "rope_parameters", "id2label"):
        assert isinstance(native_config[key], dict) and ours.config[key] == native_config[key], key
    assert ours.config["model/num_parameters"] == native_config["model/num_parameters"]
    assert ours.config["hidden_size"] == native_config["hidden_size"]  # the model's keys at the top, as WandbCallback


def native_mlflow_run(env: dict):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    runs = [(e.name, r) for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1, runs
    return runs[0]


def test_mlflow_experiment_and_system_tags_name_the_training_script(both_ways):
    native_experiment, native = native_mlflow_run(both_ways["native"][0])
    ours_experiment, ours = native_mlflow_run(rllog_info(both_ways)[0])
    assert native_experiment == ours_experiment == "Default"
    system = ("mlflow.user", "mlflow.source.name", "mlflow.source.type")
    assert {k: native.data.tags.get(k) for k in system} == {k: ours.data.tags.get(k) for k in system}
    assert ours.data.tags["mlflow.source.name"].endswith("train.py")  # the script, not rllog's agent
    assert ours.data.params["accelerator_config/split_batches"] == "False"  # params cannot nest: flattened


def comet_archive(env: dict, run_id: str | None = None) -> tuple[dict, list[dict], Path]:
    import zipfile

    for path in Path(env["COMET_OFFLINE_DIRECTORY"]).glob("*.zip"):
        archive = zipfile.ZipFile(path)
        messages = list(readers.comet_ml._messages(archive))
        others = {m["payload"].get("key"): m["payload"].get("value") for m in messages if m["type"] == "log_other"}
        if run_id is None or others.get(readers.comet_ml.RUN_ID_KEY) == run_id:
            return json.loads(archive.read("experiment.json")), messages, path
    raise AssertionError(f"no Comet archive of run {run_id}")


def comet_params(messages: list[dict]) -> dict:
    """Every parameter by name (Comet writes a list-valued one under ``params``, any other under ``param``)."""
    params = [m["payload"].get("param") or m["payload"]["params"] for m in messages if m["type"] == "parameter_msg"]
    return {p["paramName"]: p["paramValue"] for p in params}


def test_comet_project_parameters_and_environment_are_what_its_callback_records(both_ways):
    native_meta, native, _ = comet_archive(both_ways["native"][0])
    env, info, _ = rllog_info(both_ways)
    ours_meta, ours, archive = comet_archive(env, info.run_id)
    assert native_meta["project_name"] is None and ours_meta["project_name"] is None  # Comet's own default project
    native_params, ours_params = comet_params(native), comet_params(ours)
    assert {"args|learning_rate", "args|accelerator_config|split_batches", "config|rope_parameters|rope_theta"} <= set(
        native_params
    )
    assert set(native_params) <= set(ours_params), set(native_params) - set(ours_params)  # run_arg_<i> included
    # each process has its own output dir and mode argument; a token is redacted (rllog's mark, transformers' own)
    varying = ("args|output_dir", "run_arg_1", "run_arg_2", "args|hub_token")
    assert {k: str(v) for k, v in native_params.items() if k not in varying} == {
        k: str(ours_params[k]) for k in native_params if k not in varying
    }
    kinds = {m["type"] for m in ours}
    assert {"file_name", "installed_packages", "os_packages", "graph"} <= kinds, kinds
    (source,) = [m for m in ours if m["type"] == "file_upload" and m["payload"]["additional_params"].get("type") == "source_code"]
    assert source["payload"]["additional_params"]["fileName"].endswith("train.py")
    (graph,) = [m["payload"]["graph"] for m in ours if m["type"] == "graph"]
    assert graph == next(m["payload"]["graph"] for m in native if m["type"] == "graph")  # str(model), the trainer's
    # the `comet upload` hint reaches the terminal, as Comet's own callback prints it there
    assert f"comet upload {archive}" in both_ways["rllog"][1]["stderr"], both_ways["rllog"][1]["stderr"][-2000:]
