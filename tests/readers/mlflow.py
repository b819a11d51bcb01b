"""Read an rllog run back from MLflow's own storage, through ``MlflowClient`` on the same tracking URI.

The run is found by the tag ``rllog.run_id`` in the experiment named ``run_info.project``. Metrics come
from ``get_metric_history`` (MLflow's stored order: timestamp, then step), tables from the run's
``tables/<name>/step_<step>-seq_<seq>.json`` artifacts (in log order, by seq), config from the run's
params (strings, as MLflow stores them), status from the run's status.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from readers import ReadBack

_TABLE_FILE = re.compile(r"^step_(\d+)-seq_(\d+)\.json$")
_STATUS = {"FINISHED": "finished", "FAILED": "failed", "KILLED": "killed"}


def find_run(client, run_info, experiment_name: str | None = None):
    """The MLflow run the sink wrote for ``run_info`` (None if there is none)."""
    experiment = client.get_experiment_by_name(experiment_name or run_info.project)
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
            rows = [dict(zip(doc["columns"], row)) for row in doc["data"]]
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
    metrics = {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)] for key in sorted(run.data.metrics)}
    return ReadBack(
        metrics=metrics,
        tables=read_tables(client, run_id),
        config=dict(run.data.params),
        status=_STATUS.get(run.info.status),
    )
