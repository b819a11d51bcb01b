"""Resume: a trainer killed and restarted from a checkpoint continues the same run in every tracker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import readers.mlflow
import readers.wandb
from readers import read_back
from sinks import wait_until

import rllog
from rllog.delivery import CursorStore
from rllog.errors import InvalidArgument, RunDirError
from rllog.run import load_run_info

ATTEMPT_ONE = r"""
import sys, time, rllog
run = rllog.init(report_to=sys.argv[2], run_dir=sys.argv[1], flush_interval=0.05, health=False, config={"lr": 0.1})
for step in range(100):
    run.log({"loss": float(step), "attempt": 1.0}, step=step)
run.log_table("samples", {"text": ["first"]}, step=99)
run.flush(timeout=60)
print(run.run_id, flush=True)
time.sleep(600)  # alive until the test kills it
"""


@pytest.mark.slow
def test_the_dead_attempts_agent_leaves_the_resumed_attempts_records_to_the_new_agent(tmp_path, tracker_dirs):
    """The first attempt's agent, stopped when its trainer is killed, wakes up after the resumed run has written
    to the same journal: it must not deliver those records as its own (TensorBoard would then show the first
    attempt's superseded points), only close its sinks; the resumed run's agent delivers them."""
    run_dir = tmp_path / "r"
    proc = subprocess.Popen(
        [sys.executable, "-c", ATTEMPT_ONE, str(run_dir), "parquet,tensorboard"], stdout=subprocess.PIPE, text=True
    )
    proc.stdout.readline()
    old_agent = CursorStore(run_dir, "tensorboard").load().pid
    os.kill(old_agent, signal.SIGSTOP)  # a real pause: the agent misses its trainer's death until SIGCONT
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run = rllog.init(report_to="parquet,tensorboard", run_dir=run_dir, resume="allow", flush_interval=0.05, health=False)
    for step in range(50, 150):
        run.log({"loss": float(step) + 0.5, "attempt": 2.0}, step=step)
    run._writer.wake()
    assert wait_until(lambda: run._writer.written_seq == run._seq, timeout=30)  # in the journal before the old agent wakes
    os.kill(old_agent, signal.SIGCONT)
    report = run.finish(timeout=120)
    assert report.ok, str(report)
    info = load_run_info(run_dir)[0]
    assert read_back("tensorboard", tracker_dirs, info).metrics["loss"] == [(s, float(s)) for s in range(50)] + [
        (s, s + 0.5) for s in range(50, 150)
    ]
    losses = [(r["step"], r["value"]) for r in rllog.read_metrics(run_dir).to_pylist() if r["key"] == "loss"]
    assert losses == [(s, float(s)) for s in range(50)] + [(s, s + 0.5) for s in range(50, 150)]


@pytest.mark.slow
def test_attempt_killed_then_resumed_from_an_earlier_step_is_one_run_everywhere(tmp_path, tracker_dirs):
    run_dir, trackers = tmp_path / "r", "parquet,mlflow,wandb,tensorboard"
    proc = subprocess.Popen([sys.executable, "-c", ATTEMPT_ONE, str(run_dir), trackers], stdout=subprocess.PIPE, text=True)
    run_id = proc.stdout.readline().strip()
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    run = rllog.init(report_to=trackers, run_dir=run_dir, resume="allow", flush_interval=0.05, health=False)
    assert run.resumed and run.run_id == run_id and run.attempt == 2
    assert run.step == 99  # a log() without a step would go on at 100
    for step in range(50, 150):  # restarted from the checkpoint at step 50
        run.log({"loss": float(step) + 0.5, "attempt": 2.0}, step=step)
    run.log_table("samples", {"text": ["second"]}, step=149)
    report = run.finish(timeout=120)
    assert report.ok, str(report)

    latest = rllog.read_metrics(run_dir).to_pylist()
    losses = [(r["step"], r["value"]) for r in latest if r["key"] == "loss"]
    assert losses == [(s, float(s)) for s in range(50)] + [(s, s + 0.5) for s in range(50, 150)]
    assert len([r for r in rllog.read_metrics(run_dir, attempts="all").to_pylist() if r["key"] == "loss"]) == 200
    assert rllog.read_table(run_dir, "samples").column("text").to_pylist() == ["second"]  # step 99 of attempt 1 was superseded
    attempts = json.loads((run_dir / "run.json").read_text())["attempts"]
    assert [a["attempt"] for a in attempts] == [1, 2] and attempts[1]["first_seq"] == 102

    info = load_run_info(run_dir)[0]
    assert len(readers.mlflow.run_ids(tracker_dirs, info)) == 1 and read_back("mlflow", tracker_dirs, info).status == "finished"
    assert readers.wandb.run_ids(tracker_dirs, info) == {run_id}
    mlflow_loss = read_back("mlflow", tracker_dirs, info).metrics["loss"]
    assert sorted(set(mlflow_loss)) == sorted({(s, float(s)) for s in range(100)} | {(s, s + 0.5) for s in range(50, 150)})
    # TensorBoard shows no superseded point (its purge at the restart step)
    assert read_back("tensorboard", tracker_dirs, info).metrics["loss"] == [(s, float(s)) for s in range(50)] + [
        (s, s + 0.5) for s in range(50, 150)
    ]


def test_resume_modes(tmp_path):
    run_dir = tmp_path / "r"
    with pytest.raises(RunDirError, match="no run to resume"):
        rllog.init(report_to="none", run_dir=run_dir, resume="must")
    first = rllog.init(report_to="none", run_dir=run_dir, config={"lr": 0.1})
    first.log({"x": 1.0}, step=3)
    with pytest.raises(RunDirError, match="a run of this process has it open"):  # the first attempt is still alive
        rllog.init(report_to="none", run_dir=run_dir, resume="allow", reinit="create_new")
    first.finish()
    with pytest.raises(RunDirError, match="already holds run"):
        rllog.init(report_to="none", run_dir=run_dir)  # resume defaults to "never"
    second = rllog.init(report_to="parquet", run_dir=run_dir, resume="must", config={"batch": 8})
    assert second.run_id == first.run_id and second.info.config == {"lr": 0.1, "batch": 8}
    second.log({"x": 2.0})
    assert second.step == 4 and second.finish().ok
    assert rllog.read_metrics(run_dir).to_pylist()[0]["step"] == 3  # replayed to a sink added on resume, both attempts
    assert [r["value"] for r in rllog.read_metrics(run_dir).to_pylist()] == [1.0, 2.0]
    with pytest.raises(InvalidArgument, match="resume"):
        rllog.init(report_to="none", run_dir=tmp_path / "x", resume="yes")


def test_run_id_finds_the_run_under_the_runs_root(tmp_path, tracker_dirs):
    first = rllog.init(report_to="none", run_id="job-42", name="grpo")
    first.log({"x": 1.0})
    first.finish()
    assert first.run_dir.name.endswith("-grpo-job-42")
    again = rllog.init(report_to="none", run_id="job-42")  # a run id given means: continue it if it exists
    assert again.run_dir == first.run_dir and again.attempt == 2
    again.finish()


def test_update_config_and_flush_barrier(tmp_path):
    run = rllog.init(report_to="parquet", run_dir=tmp_path / "r", config={"lr": 0.1}, flush_interval=30.0)  # no timed flush soon
    for step in range(5):
        run.log({"loss": float(step)}, step=step)
    run.update_config({"batch": 8, "hub_token": "hf_abcdefghijklmnopqrstuvwxyz0123456789"})
    flushed = run.flush(timeout=60)
    assert flushed.ok and flushed["parquet"].delivered == 6 and flushed["parquet"].state == "delivered"
    assert rllog.read_metrics(tmp_path / "r").column("value").to_pylist() == [0.0, 1.0, 2.0, 3.0, 4.0]  # before finish
    from rllog_backends.parquet import read_meta

    assert read_meta(tmp_path / "r")["config"] == {"lr": 0.1, "batch": 8, "hub_token": "***REDACTED***"}
    assert run.finish().ok


def test_show_and_summary_take_config_records_and_the_latest_attempt(tmp_path, capsys):
    from rllog.cli import main as cli_main
    from rllog.summary import summarise

    run_dir = tmp_path / "r"
    for first, last in ((0, 20), (10, 30)):  # the second attempt restarts at step 10
        run = rllog.init(report_to="parquet", run_dir=run_dir, resume="allow", health=False)
        for step in range(first, last):
            run.log({"reward": step + (0.5 if first else 0.0)}, step=step)
        run.update_config({"phase": first})
        assert run.finish().ok
    summary = summarise(run_dir)
    assert summary.series["reward"] == [(s, float(s)) for s in range(10)] + [(s, s + 0.5) for s in range(10, 30)]
    assert summary.records == 42  # 40 metrics records and 2 config records
    assert cli_main(["show", str(run_dir)]) == 0
    assert "reward" in capsys.readouterr().out


def test_a_run_reopened_to_continue_hides_nothing_of_the_earlier_attempt(tmp_path, tracker_dirs):
    """``resume="continue"`` (a later ``evaluate()`` after ``finish()``, a Lightning ``test()`` after ``fit()``): the
    attempt carries on where the run stopped. As a restart, its first record (``eval/loss`` at the last training
    step) hid that step's ``loss`` from ``read_metrics``, ``rllog show`` and TensorBoard (which purges from a
    restart marker)."""
    from rllog.summary import summarise

    run_dir = tmp_path / "r"
    with rllog.init(report_to="parquet,tensorboard", run_dir=run_dir, health=False) as run:
        for step in range(3):
            run.log({"loss": float(step)}, step=step)
    with rllog.init(report_to="parquet,tensorboard", run_dir=run_dir, resume="continue", health=False) as run:
        run.log({"eval/loss": 0.5}, step=2)
    info = load_run_info(run_dir)[0]
    rows = rllog.read_metrics(run_dir).to_pylist()
    assert sorted((r["key"], r["step"], r["value"]) for r in rows) == [
        ("eval/loss", 2, 0.5),
        ("loss", 0, 0.0),
        ("loss", 1, 1.0),
        ("loss", 2, 2.0),
    ]
    assert summarise(run_dir).series["loss"] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    tb = read_back("tensorboard", tracker_dirs, info).metrics
    assert tb["loss"] == [(0, 0.0), (1, 1.0), (2, 2.0)] and tb["eval/loss"] == [(2, 0.5)]


def test_summary_parquet_and_tensorboard_keep_the_same_records_of_a_resumed_run(tmp_path, tracker_dirs):
    """One rule (``rllog.records.Supersession``) for what a later attempt supersedes, in ``rllog show``, the Parquet
    reader and TensorBoard's storage, record for record. The agent's ``system/...`` samples are journaled at the
    trainer's current step, which at the start of a resumed attempt is still the previous attempt's last step:
    attempt 2 (from the step-5 checkpoint) supersedes its own stale sample at step 9, and attempt 3 (resumed from
    the latest checkpoint, first step 15) supersedes nothing, although its stale sample sits at step 14."""
    from readers.tensorboard import stored

    from rllog.summary import summarise

    run_dir = tmp_path / "r"
    attempts = [(None, range(10)), (9, range(5, 15)), (14, range(15, 18))]  # (stale system step, trainer steps)
    for n, (system_step, steps) in enumerate(attempts, start=1):
        run = rllog.init(
            report_to="parquet,tensorboard",
            run_dir=run_dir,
            resume="allow",
            delivery="thread",
            health=False,
            system_metrics=False,
        )
        if system_step is not None:
            assert run.step == system_step
            run._log_system({"values": {"system/cpu_percent": float(n)}, "time": 0.0})  # the supervision thread's call
        for step in steps:
            run.log({"loss": step + n / 4}, step=step)
        assert run.finish(timeout=60).ok
    expected = {
        "loss": [(s, s + 0.25) for s in range(5)] + [(s, s + 0.5) for s in range(5, 15)] + [(s, s + 0.75) for s in range(15, 18)],
        "system/cpu_percent": [(14, 3.0)],
    }
    parquet: dict[str, list] = {}
    for row in rllog.read_metrics(run_dir).to_pylist():
        parquet.setdefault(row["key"], []).append((row["step"], row["value"]))
    tb = read_back("tensorboard", tracker_dirs, load_run_info(run_dir)[0]).metrics
    assert summarise(run_dir).series == expected
    assert parquet == expected
    assert tb == {key: [(step, stored(value)) for step, value in points] for key, points in expected.items()}
