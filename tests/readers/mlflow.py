"""Read an rllog run back from MLflow's own storage, through ``MlflowClient`` on the same tracking URI.

The run is found by the tag ``rllog.run_id`` in the sink's experiment (:func:`rllog_backends.mlflow.experiment_name`). Metrics come
from ``get_metric_history`` (MLflow's stored order: timestamp, then step), tables from the run's
``tables/<name>/step_<step>-seq_<seq>.json`` artifacts (in log order, by seq), config from the run's
params (strings, as MLflow stores them; a param whose value changed later is kept as it was, its
current value is in the tag ``rllog.config.<param>``, which wins here), status from the run's status.
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

from readers import ReadBack
from rllog_backends import mlflow as mlflow_sink
from rllog_backends._conventions import Remembered
from rllog_backends.mlflow import CONFIG_TAG_PREFIX

_TABLE_FILE = re.compile(r"^step_(\d+)-seq_(\d+)\.json$")
_STATUS = {"FINISHED": "finished", "FAILED": "failed", "KILLED": "killed"}


def find_run(client, run_info, experiment_name: str | None = None):
    """The MLflow run the sink wrote for ``run_info`` (None if there is none): the one it remembered in the
    run directory, else the run tagged with the rllog run id in the experiment."""
    remembered = Remembered(run_info.run_dir, "mlflow", run_info.run_id)
    if remembered.get("run_id") and remembered.get("tracking_uri") == client.tracking_uri and experiment_name is None:
        return client.get_run(remembered.get("run_id"))
    experiment = client.get_experiment_by_name(experiment_name or mlflow_sink.experiment_name(run_info))
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`rllog.run_id` = '{run_info.run_id}'")
    assert len(runs) <= 1, f"{len(runs)} MLflow runs carry rllog.run_id={run_info.run_id}"
    return runs[0] if runs else None


def read_tables(client, run_id: str) -> dict[str, list[tuple[int, list[dict]]]]:
    """Every table the sink logged: name (as stored) -> [(step, rows)], in log order."""
    if not any(f.path == "tables" for f in client.list_artifacts(run_id)):
        return {}
    found: dict[str, list[tuple[int, int, list[dict]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(client.download_artifacts(run_id, "tables", tmp))
        for path in root.rglob("*.json"):
            match = _TABLE_FILE.match(path.name)
            if not match:
                continue
            doc = json.loads(path.read_text())
            rows = [dict(zip(doc["columns"], row, strict=True)) for row in doc["data"]]
            name = path.parent.relative_to(root).as_posix()
            found.setdefault(name, []).append((int(match.group(2)), int(match.group(1)), rows))
    return {name: [(step, rows) for _, step, rows in sorted(items, key=lambda t: t[0])] for name, items in found.items()}


def read_back(env: dict, run_info, experiment_name: str | None = None) -> ReadBack:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=env.get("MLFLOW_TRACKING_URI") or os.environ.get("MLFLOW_TRACKING_URI"))
    run = find_run(client, run_info, experiment_name)
    if run is None:
        return ReadBack()
    run_id = run.info.run_id
    changed = {k[len(CONFIG_TAG_PREFIX) :]: v for k, v in run.data.tags.items() if k.startswith(CONFIG_TAG_PREFIX)}
    metrics = {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)] for key in sorted(run.data.metrics)}
    return ReadBack(
        metrics=metrics,
        tables=read_tables(client, run_id),
        config=dict(run.data.params) | changed,
        status=_STATUS.get(run.info.status),
    )


# -- the contract suite's hooks (see readers/__init__.py) -------------------------------------------
MAX_DOUBLE = 1.7976931348623157e308


@functools.cache
def migrated_db() -> Path:
    """An MLflow sqlite database with its schema migrated, made once per test process (migrating takes seconds)."""
    from mlflow import MlflowClient

    path = Path(tempfile.mkdtemp(prefix="rllog-mlflow-template-")) / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    atexit.register(shutil.rmtree, path.parent, ignore_errors=True)
    return path


def prepare(monkeypatch, env) -> None:
    """A migrated copy of the database where ``env["MLFLOW_TRACKING_URI"]`` points."""
    shutil.copy(migrated_db(), env["MLFLOW_TRACKING_URI"][len("sqlite:///") :])


def stored(value: float) -> float:
    """SQL has no infinity: MLflow stores ±inf as the largest double."""
    return math.copysign(MAX_DOUBLE, value) if math.isinf(value) else value


TABLE_CELLS = "nested"  # lists and dicts in table cells: kept nested


def cell(value):
    """Table cells follow rllog_backends/_cells.py: NaN and ±inf are ``null``."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def config_value(value) -> str:
    return str(value)  # MLflow params are strings


def run_ids(env: dict, run_info) -> set[str]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name(mlflow_sink.experiment_name(run_info))
    return {r.info.run_id for r in client.search_runs([experiment.experiment_id])} if experiment else set()


def break_next_write(monkeypatch, sink) -> None:
    """The next ``log_batch`` commits, then fails as a locked database does (the acknowledgement is lost)."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

    real, fired = sink._client.log_batch, []

    def log_batch(*args, **kwargs):
        real(*args, **kwargs)
        if not fired:
            fired.append(True)
            raise MlflowException("(sqlite3.OperationalError) database is locked", error_code=TEMPORARILY_UNAVAILABLE)

    monkeypatch.setattr(sink._client, "log_batch", log_batch)
