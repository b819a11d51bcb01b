import json, os
from pathlib import Path
from readers.mlflow import prepare
from rllog.records import MetricsRecord, RunInfo
from rllog_backends.mlflow import MlflowSink

def test_dbg(tracker_dirs, monkeypatch):
    prepare(monkeypatch, tracker_dirs)
    from mlflow import MlflowClient
    client = MlflowClient(tracking_uri=tracker_dirs["MLFLOW_TRACKING_URI"])
    e = client.create_experiment("azureml-job")
    pr = client.create_run(e, run_name="job-42").info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", pr)
    info = RunInfo("grpo", "n", str(Path(tracker_dirs["tmp"]) / "run"), "rid1", {"lr": 1})
    s = MlflowSink(); s.open(info); s.write_metrics([MetricsRecord(1, 0, 1.7e9, {"reward": 0.1})]); s.close("killed")
    print(open(Path(info.run_dir) / "trackers" / "mlflow.json").read())
    monkeypatch.delenv("MLFLOW_RUN_ID")
    s = MlflowSink(); s.open(info); print("second run", s.run_id, pr); s.write_metrics([MetricsRecord(2, 1, 1.7e9+1, {"reward": 0.2})]); s.close("finished")
    print([(m.step, m.value, m.timestamp) for m in client.get_metric_history(pr, "reward")])
