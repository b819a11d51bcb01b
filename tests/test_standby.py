"""The standby agent (``rllog.prepare``): started before its run, it imports the trackers and opens nothing;
the next run with the same backends takes it, with the environment the trainer has by then."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import rllog
from rllog import agent


@pytest.fixture(autouse=True)
def no_standby_left():
    agent.discard_standby()
    yield
    agent.discard_standby()


def _waiting_for_its_run(pid: int, timeout: float = 120.0) -> None:
    """Block until the standby has prepared its backends and sits reading its stdin for the run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "pipe" in Path(f"/proc/{pid}/wchan").read_text():
            return
        time.sleep(0.05)
    raise AssertionError("the standby never got to waiting for its run")


def _exited(proc, timeout: float = 120.0) -> bool:  # a standby imports at idle priority: slow on a busy machine
    try:
        proc.wait(timeout=timeout)
        return True
    except Exception:
        return False


def test_a_prepared_agent_opens_nothing_then_delivers_the_next_run_with_the_environment_of_then(tracker_dirs, monkeypatch):
    from mlflow import MlflowClient
    from readers import read_back

    sinks = ["parquet", "tensorboard", "mlflow"]
    assert rllog.prepare(sinks) is True
    standby = agent.waiting_standby()
    assert standby is not None
    _waiting_for_its_run(standby.proc.pid)
    # Prepared: MLflow's store is created (its tables), but no experiment run, no TensorBoard file, no rllog run.
    client = MlflowClient(tracking_uri=tracker_dirs["MLFLOW_TRACKING_URI"])
    assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []
    assert list(Path(tracker_dirs["TENSORBOARD_LOGGING_DIR"]).iterdir()) == []
    assert list(Path(tracker_dirs["RLLOG_DIR"]).iterdir()) == []
    assert rllog.prepare(sinks) is True and agent.waiting_standby() is standby  # asked again: the same one

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "set-after-prepare")  # after the standby started
    run = rllog.init(sinks, project="rllog", name="prepared")
    assert run._agent.pid == standby.proc.pid and agent.waiting_standby() is None
    for step in range(5):
        run.log({"loss": step / 4}, step=step)  # exact in float32 (TensorBoard)
    report = run.finish()
    assert report.ok, str(report)
    for sink in ("parquet", "tensorboard"):
        got = read_back(sink, tracker_dirs, run.info)
        assert got.metrics["loss"] == [(s, s / 4) for s in range(5)], sink
        assert got.status in ("finished", None)
    experiment = client.get_experiment_by_name("set-after-prepare")
    assert experiment is not None
    (mlflow_run,) = client.search_runs([experiment.experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(mlflow_run.info.run_id, "loss")] == [
        (s, s / 4) for s in range(5)
    ]
    # What the standby printed before it had a run (MLflow creating its tables) is in the run's agent.log.
    assert "Creating initial MLflow database tables" in (Path(run.run_dir) / "agent.log").read_text()
    assert not standby.log_path.exists()


def test_a_standby_makes_mlflows_default_store_ready_without_a_run(tracker_dirs, monkeypatch, tmp_path):
    """With no ``MLFLOW_TRACKING_URI``, MLflow's default store (``mlflow.db`` in the working directory) is the one
    prepared: created and checked by the standby (seconds), so the run's ``open`` does not do it while training."""
    import sqlite3

    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.chdir(tmp_path)
    assert rllog.prepare(["mlflow"]) is True
    standby = agent.waiting_standby()
    _waiting_for_its_run(standby.proc.pid)
    with sqlite3.connect(tmp_path / "mlflow.db") as db:  # the tables are there, no run yet
        assert db.execute("select count(*) from runs").fetchone() == (0,)
    run = rllog.init(["mlflow"], project="default-store")
    assert run._agent.pid == standby.proc.pid
    run.log({"loss": 0.5}, step=3)
    assert run.finish().ok
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("default-store").experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(mlflow_run.info.run_id, "loss")] == [(3, 0.5)]


def test_a_standby_for_other_backends_or_a_dead_one_is_replaced(tracker_dirs):
    from readers import read_back

    assert rllog.prepare(["parquet"]) is True
    other = agent.waiting_standby()
    run = rllog.init(["parquet", "tensorboard"])  # not what it was prepared for
    assert _exited(other.proc) and run._agent.pid != other.proc.pid
    run.log({"x": 1.0}, step=0)
    assert run.finish().ok
    assert read_back("tensorboard", tracker_dirs, run.info).metrics["x"] == [(0, 1.0)]

    assert rllog.prepare(["parquet"]) is True
    dead = agent.waiting_standby()
    os.kill(dead.proc.pid, signal.SIGKILL)
    assert _exited(dead.proc)
    run = rllog.init(["parquet"])
    assert run._agent.pid != dead.proc.pid
    run.log({"x": 2.0}, step=0)
    assert run.finish().ok
    assert rllog.read_metrics(run.run_dir).column("value").to_pylist() == [2.0]

    assert rllog.prepare(["tensorboard", "parquet"]) is True  # the same backends, in another order: taken
    same = agent.waiting_standby()
    run = rllog.init(["parquet", "tensorboard"])
    assert run._agent.pid == same.proc.pid and agent.waiting_standby() is None
    run.log({"x": 3.0}, step=0)
    assert run.finish().ok
    assert read_back("tensorboard", tracker_dirs, run.info).metrics["x"] == [(0, 3.0)]


def test_nothing_is_prepared_while_a_run_agent_is_alive_or_for_nothing_to_deliver():
    run = rllog.init(["parquet"])
    assert rllog.prepare(["parquet"]) is False and agent.waiting_standby() is None  # one agent at a time
    assert run.finish().ok
    assert rllog.prepare("none") is False and rllog.prepare(["parquet"], delivery="thread") is False
    assert agent.waiting_standby() is None
    assert rllog.prepare(["parquet"]) is True
    standby = agent.waiting_standby()
    agent.release_standby(standby)  # its one owner went without training
    assert agent.waiting_standby() is None and _exited(standby.proc)


def test_a_prepared_agent_samples_the_trainer_once_its_run_starts():
    assert rllog.prepare(["parquet"], system_metrics=0.2) is True
    standby = agent.waiting_standby()
    _waiting_for_its_run(standby.proc.pid)
    run = rllog.init(["parquet"], system_metrics=0.2)
    assert run._agent.pid == standby.proc.pid
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        run.log({"x": 1.0})
        time.sleep(0.2)
        if run.flush().ok and "system/memory_rss_mb" in set(rllog.read_metrics(run.run_dir).column("key").to_pylist()):
            break
    rss = [
        v
        for k, v in zip(*(rllog.read_metrics(run.run_dir).column(c).to_pylist() for c in ("key", "value")), strict=True)
        if k == "system/memory_rss_mb"
    ]
    assert run.finish().ok
    import psutil

    mine = psutil.Process().memory_info().rss / 2**20
    assert rss and all(0.5 * mine < v < 2 * mine for v in rss), (rss, mine)  # the trainer's memory, not the agent's
