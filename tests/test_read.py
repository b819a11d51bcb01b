"""``rllog.read_metrics`` / ``read_table`` / ``read_alerts`` read every run, whichever trackers it was delivered to."""

from __future__ import annotations

import pytest

import rllog
from rllog import read

STEPS = 8


def _log_steps(run, steps, attempt: float) -> None:
    for step in steps:
        run.log({"loss": float(step), "attempt": attempt}, step=step)


def _rows(table) -> list[tuple[int, str, float]]:
    return [(r["step"], r["key"], r["value"]) for r in table.to_pylist()]


def test_a_run_without_parquet_reads_every_metric_table_and_alert_from_its_journal(tmp_path):
    run = rllog.init(report_to="tensorboard", run_dir=tmp_path / "r", delivery="thread")
    _log_steps(run, range(STEPS), 1.0)
    run.log({"kl": -0.5}, step=STEPS)  # below kl_negative's threshold: one alert
    run.log_table("completions", {"prompt": ["1+1=", "2+2="], "completion": ["2", "4"]}, step=3)
    run.log_table("completions", {"prompt": ["3+3="], "completion": ["6"], "reward": [1.0]}, step=6)
    assert run.finish().ok

    assert read.parquet_store(tmp_path / "r") is None
    metrics = rllog.read_metrics(tmp_path / "r")
    expected = [(s, k, v) for s in range(STEPS) for k, v in (("loss", float(s)), ("attempt", 1.0))]
    assert _rows(metrics) == [*expected, (STEPS, "kl", -0.5)]
    assert metrics.schema.names == ["step", "key", "value", "time", "seq"]
    table = rllog.read_table(tmp_path / "r", "completions")
    assert table.column_names == ["_step", "_seq", "prompt", "completion", "reward"]
    assert table.select(["_step", "prompt", "reward"]).to_pylist() == [
        {"_step": 3, "prompt": "1+1=", "reward": None},
        {"_step": 3, "prompt": "2+2=", "reward": None},
        {"_step": 6, "prompt": "3+3=", "reward": 1.0},
    ]
    alerts = rllog.read_alerts(tmp_path / "r").to_pylist()
    assert [(a["step"], a["rule"], a["metric"], a["value"]) for a in alerts] == [(STEPS, "kl_negative", "kl", -0.5)]
    with pytest.raises(KeyError, match="it has: 'completions'"):
        rllog.read_table(tmp_path / "r", "complete")


def test_a_resumed_run_reads_the_same_from_its_journal_and_from_parquet(tmp_path, monkeypatch):
    """Attempt 1 logs steps 0-7 to TensorBoard; attempt 2 restarts at step 4 and adds parquet (which is delivered
    the whole journal). The latest attempt's view is the same from parquet and from the journal."""
    run_dir = tmp_path / "r"
    run = rllog.init(report_to="tensorboard", run_dir=run_dir, delivery="thread", health=False)
    _log_steps(run, range(STEPS), 1.0)
    run.log_table("t", {"x": [1]}, step=6)
    assert run.finish().ok
    latest_attempt_one = _rows(rllog.read_metrics(run_dir))

    run = rllog.init(report_to="tensorboard,parquet", run_dir=run_dir, resume="must", delivery="thread", health=False)
    _log_steps(run, range(4, STEPS + 2), 2.0)
    run.log_table("t", {"x": [2]}, step=9)
    assert run.finish().ok

    expected = [(s, k, v) for s in range(4) for k, v in (("loss", float(s)), ("attempt", 1.0))]
    expected += [(s, k, v) for s in range(4, STEPS + 2) for k, v in (("loss", float(s)), ("attempt", 2.0))]
    assert latest_attempt_one[: 2 * STEPS] == [(s, k, v) for s in range(STEPS) for k, v in (("loss", float(s)), ("attempt", 1.0))]
    assert read.parquet_store(run_dir) == run_dir / "parquet"
    from_parquet = (rllog.read_metrics(run_dir), rllog.read_metrics(run_dir, "all"), rllog.read_table(run_dir, "t"))
    monkeypatch.setattr(read, "parquet_store", lambda run_dir: None)
    from_journal = (rllog.read_metrics(run_dir), rllog.read_metrics(run_dir, "all"), rllog.read_table(run_dir, "t"))
    for table in (from_parquet[0], from_journal[0]):
        assert _rows(table) == expected
    assert from_parquet[1].equals(from_journal[1]) and from_journal[1].num_rows == 2 * STEPS + 2 * (STEPS - 2)
    assert (
        from_parquet[2].to_pylist() == from_journal[2].to_pylist() == [{"_step": 9, "_seq": 2 * STEPS, "x": 2}]
    )  # attempt 1: 9 records, attempt 2: 7


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"holds no rllog run .* `rllog runs"):
        rllog.read_metrics(tmp_path)
    run = rllog.init(report_to="none", run_dir=tmp_path / "r", delivery="thread")
    run.finish()
    with pytest.raises(rllog.RllogError, match="attempts='last'"):
        rllog.read_metrics(tmp_path / "r", attempts="last")


def test_a_run_that_logged_nothing_reads_as_finished(tmp_path):
    """Its journal holds only the end marker: ``rllog runs`` showed it as ``stopped``."""
    from rllog.read import journal_end, run_status

    rllog.init(report_to="tensorboard", run_dir=tmp_path / "empty", quiet=True).finish()
    assert journal_end(tmp_path / "empty") == "finished"
    assert run_status(tmp_path / "empty") == "finished"
    assert rllog.read_metrics(tmp_path / "empty").num_rows == 0
