"""ClearMLSink against the real ``clearml`` package, offline: what is particular to ClearML (the contract suite covers the
rest). Read back from ClearML's offline session files (``metrics.jsonl``, ``task.json``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from readers.clearml import read_back, sessions

import rllog
from rllog import registry
from rllog.records import ConfigRecord, MetricsRecord, RunInfo, TableRecord
from rllog.rundir import tracker_location
from rllog_backends.clearml import MAX_DOUBLE, key_of, title_series

pytest.importorskip("clearml")


def test_title_and_series_round_trip():
    for key in ("loss", "rewards/accuracy/mean", "eval/reward", "x/x", "a/", "/a", "a//b"):
        assert key_of(*title_series(key)) == key
    assert title_series("rewards/accuracy/mean") == ("rewards/accuracy", "mean")
    assert title_series("x/x") == ("x/x", "x/x")  # would otherwise read back as "x"


def test_one_offline_session_stores_clearmls_own_way(tracker_dirs, tmp_path, monkeypatch, capfd):
    """Stdout, the user's git repository, values, names, late config, status and a second session, in one go."""
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    monkeypatch.chdir(repo)  # ClearML's repository detection would read it (and ask its update server for news)
    stdout, stderr = sys.stdout, sys.stderr
    run_info = RunInfo("grpo", "grpo-run", str(tmp_path / "run"), "cm-0001", {"lr": 1e-6, "use_vllm": False})
    sink = registry.create("clearml", {})
    sink.open(run_info)
    assert (sys.stdout, sys.stderr) == (stdout, stderr), "ClearML captured stdout/stderr"
    sink.write_metrics(
        [MetricsRecord(1, 3, 0.0, {"loss": math.nan, "kl": math.inf, "neg": -math.inf, "rewards/accuracy/mean": 0.5})]
    )
    sink.write_metrics([MetricsRecord(2, 1, 0.0, {"rewards/accuracy/mean": 0.25})])  # a step going back
    sink.write_table(TableRecord(3, 3, 0.0, "eval/samples", pa.table({"text": ["a", None], "score": [math.nan, 2.0]})))
    sink.write_config(ConfigRecord(4, 3, 0.0, {"model/name": "tiny-qwen"}))
    sink.flush()
    [(task, events)] = sessions(tracker_dirs["CLEARML_CACHE_DIR"], run_info.run_id)
    # what finish and `rllog show` print: the task id and the offline session folder holding these events
    where = dict(field.split("=", 1) for field in tracker_location(run_info.run_dir, "clearml").split(" "))
    assert where["task_id"] == task["id"] and (Path(where["dir"]) / "task.json").is_file()
    raw = {(e["metric"], e["variant"], e["iter"]): e["value"] for e in events if e["type"] == "training_stats_scalar"}
    assert math.isnan(raw["loss", "loss", 3])  # kept as NaN (ClearML's default would store 0.0)
    assert (raw["kl", "kl", 3], raw["neg", "neg", 3]) == (MAX_DOUBLE, -MAX_DOUBLE)  # ClearML's default: 0.0 for both
    assert (raw["rewards/accuracy", "mean", 3], raw["rewards/accuracy", "mean", 1]) == (0.5, 0.25)
    sink.close("failed")

    assert "diff" not in json.dumps(task.get("script", {})) and not task.get("script", {}).get("repository")
    assert (
        not (repo / ".clearml").exists()
        and subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True).stdout == ""
    )
    out, err = capfd.readouterr()
    assert "ClearML" in out and err == ""  # its own start/close lines: in the agent's log with the default delivery

    again = registry.create("clearml", {})  # a second session of the same run (rllog replay, a resumed trainer)
    again.open(run_info)
    again.write_metrics([MetricsRecord(5, 4, 0.0, {"rewards/accuracy/mean": 0.75})])
    again.close("finished")
    found = sessions(tracker_dirs["CLEARML_CACHE_DIR"], run_info.run_id)
    assert len(found) == 2 and len({t["id"] for t, _ in found}) == 2  # offline, ClearML cannot continue a task

    back = read_back(tracker_dirs, run_info)
    assert back.metrics["rewards/accuracy/mean"] == [(3, 0.5), (1, 0.25), (4, 0.75)]
    assert back.tables["eval/samples"] == [
        (3, [{"text": "a", "score": None}, {"text": None, "score": 2.0}])
    ]  # NaN: an empty cell (rllog_backends/_cells.py)
    assert back.config == {"lr": "1e-06", "use_vllm": "False", "model/name": "tiny-qwen"}
    assert [t["tags"] for t, _ in found] == [
        ["rllog.run_id=cm-0001", "rllog.status=failed"],
        ["rllog.run_id=cm-0001", "rllog.status=finished"],
    ]
    assert back.status == "finished"


def test_through_the_agent_the_trainers_terminal_stays_clean(tracker_dirs, tmp_path, capfd, monkeypatch):
    # The trainer has a ClearML task of its own: Task.init set this for its children, which then get a stub task.
    monkeypatch.setenv("CLEARML_PROC_MASTER_ID", f"{os.getpid()}:offline-the-trainers-task")
    with rllog.init(report_to="clearml", project="agent", run_dir=tmp_path / "run", health=False) as run:
        run.log({"reward": 0.5}, step=0)
    assert run.finish().ok
    out, err = capfd.readouterr()
    assert "clearml" not in (out + err).lower()
    assert "ClearML Task: created new task" in (tmp_path / "run" / "agent.log").read_text()
    back = read_back(tracker_dirs, run.info)
    assert back.metrics == {"reward": [(0, 0.5)]} and back.status == "finished"
