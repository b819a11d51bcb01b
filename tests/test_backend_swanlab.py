"""SwanLabSink against the real ``swanlab`` package, offline: what is particular to SwanLab (the contract suite covers
the rest). Read back from SwanLab's own run file with SwanLab's ``DataStoreReader``."""

from __future__ import annotations

import logging
import os
import sys
from functools import partial
from pathlib import Path

import pyarrow as pa
import pytest
from readers.swanlab import read_back, records, sessions
from sinks import backend_run_info

import rllog
from rllog import registry
from rllog.records import ConfigRecord, MetricsRecord, TableRecord
from rllog.rundir import tracker_location
from rllog_backends.swanlab import STEP_KEY, swanlab_key

pytest.importorskip("swanlab")


info = partial(backend_run_info, project="grpo math", run_id="sw-0001", config={"lr": 1e-6})


def test_names_map_onto_swanlabs_rules():
    assert swanlab_key("rewards/accuracy/mean") == "rewards/accuracy/mean"
    assert swanlab_key("loss(mean) @1") == "loss(mean) @1"  # SwanLab takes any character but control characters
    changed = [swanlab_key(k) for k in ("eval/acc/", "/eval/acc", "a\nb", "__swanlab__.cpu", "x" * 600)]
    assert changed[0].startswith("eval/acc_") and changed[1].startswith("eval/acc_") and changed[0] != changed[1]
    assert changed[2].startswith("a_b_") and changed[3].startswith("_swanlab__.cpu_") and len(changed[4]) == 512
    assert swanlab_key(STEP_KEY) == "rllog/rllog/step"


def test_one_session_stays_off_the_terminal_and_stores_swanlabs_own_way(tracker_dirs, tmp_path, capfd, caplog):
    """Terminal, names, steps, a late config and flush, in one SwanLab session (its init takes ~1 s)."""
    stdout, stderr = sys.stdout, sys.stderr
    sink = registry.create("swanlab", {})
    run_info = info(tmp_path)
    sink.open(run_info)
    assert (sys.stdout, sys.stderr) == (stdout, stderr), "SwanLab's terminal proxy replaced stdout/stderr"
    print("the trainer's own line")
    with caplog.at_level(logging.WARNING, logger="rllog.backends.swanlab"):
        sink.write_metrics([MetricsRecord(1, 5, 0.0, {"reward": 0.5, "eval/acc/": 0.25, "rllog/step": 7.0})])
        sink.write_metrics(
            [MetricsRecord(2, 5, 0.0, {"reward": 0.75})]
        )  # same key, same step, right after: SwanLab keeps the first
        sink.write_metrics([MetricsRecord(3, 4, 0.0, {"reward": 1.0})])  # a step going back is kept
    sink.write_table(TableRecord(4, 5, 0.0, "completions", pa.table({"completion": ["ok"], "tokens": [[1, 2]]})))
    sink.write_config(ConfigRecord(5, 5, 0.0, {"model/name": "tiny-qwen", "beta": 0.04}))
    sink.flush()

    [(folder, recs)] = sessions(tracker_dirs["SWANLAB_LOG_DIR"], run_info.run_id)
    # what finish and `rllog show` print: the log dir holding the session's folder
    assert tracker_location(run_info.run_dir, "swanlab") == f"logdir={os.path.abspath(tracker_dirs['SWANLAB_LOG_DIR'])}"
    assert Path(folder).resolve().is_relative_to(Path(tracker_dirs["SWANLAB_LOG_DIR"]).resolve())
    assert {r.scalar.key for r in recs if r.HasField("scalar")} >= {"reward", "rllog/rllog/step", STEP_KEY}, (
        "flush left rows behind"
    )
    assert [r.scalar.step for r in recs if r.HasField("scalar") and r.scalar.key == STEP_KEY] == [
        1,
        2,
        3,
        4,
    ]  # SwanLab's step: seq
    sink.close("killed")

    out, err = capfd.readouterr()
    assert out == "the trainer's own line\n" and err == ""  # nothing from SwanLab on the terminal
    assert not any(r.HasField("log") for r in records(next(folder.glob("run-*.swanlab"))))  # no terminal lines captured
    assert [r.getMessage() for r in caplog.records if r.name == "rllog.backends.swanlab"] == [
        "rllog: swanlab keeps the first of two consecutive values of 'reward' at step 5"
    ]

    back = read_back(tracker_dirs, run_info)
    assert back.metrics["reward"] == [(5, 0.5), (4, 1.0)]
    assert back.metrics[swanlab_key("eval/acc/")] == [(5, 0.25)] and back.metrics["rllog/rllog/step"] == [(5, 7.0)]
    assert back.tables["completions"] == [(5, [{"completion": "ok", "tokens": "[1, 2]"}])]  # a list cell as JSON text
    assert back.config == {"lr": 1e-6, "model/name": "tiny-qwen", "beta": 0.04}  # config given after start
    assert back.status == "killed"
    project = next(r.start.project for r in recs if r.HasField("start"))
    assert project == "grpo-math"  # SwanLab's project rule: letters, digits, _ - + .


def test_through_the_agent_the_trainers_terminal_stays_clean(tracker_dirs, tmp_path, capfd):
    with rllog.init(report_to="swanlab", project="agent", run_dir=tmp_path / "run", health=False) as run:
        run.log({"reward": 0.5}, step=0)
        run.update_config({"late": 1})
    assert run.finish().ok
    out, err = capfd.readouterr()
    assert "swanlab" not in (out + err).lower()
    back = read_back(tracker_dirs, run.info)
    assert back.metrics == {"reward": [(0, 0.5)]} and back.config["late"] == 1 and back.status == "finished"
