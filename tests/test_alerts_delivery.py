"""Health alerts travel like records: journaled in order, delivered to sinks that take alerts, in parquet."""

from __future__ import annotations

import logging

from sinks import MemorySink

import rllog
from rllog.health import AlertDraft
from rllog.sink import Capabilities


class ThresholdMonitor:
    """Fault injection stand-in for rllog.health's HealthMonitor: fires when x > 5."""

    def observe(self, step, values):
        x = values.get("x")
        return [AlertDraft(step, "x_high", "x", x, f"x is {x}")] if x is not None and x > 5 else []


class AlertMemorySink(MemorySink):
    capabilities = Capabilities(tables=True, alerts=True)

    def __init__(self, name=None):
        super().__init__(name)
        self.alerts = []

    def write_alert(self, record):
        self.alerts.append(record)


def test_alerts_are_journaled_delivered_and_written_to_parquet(tmp_path, caplog):
    takes, ignores = AlertMemorySink("takes"), MemorySink("ignores")
    with caplog.at_level(logging.WARNING, logger="rllog"):
        run = rllog.init(
            report_to=[takes, ignores, "parquet"], run_dir=tmp_path / "r", flush_interval=0.05, health=ThresholdMonitor()
        )
        for step, x in enumerate([1.0, 7.0, 2.0, 9.0]):
            run.log({"x": x}, step=step)
        report = run.finish()
    assert report.ok and report["takes"].delivered == 6  # 4 metrics + 2 alerts, every record acknowledged
    assert [(a.step, a.rule, a.metric, a.value, a.message) for a in takes.alerts] == [
        (1, "x_high", "x", 7.0, "x is 7.0"),
        (3, "x_high", "x", 9.0, "x is 9.0"),
    ]
    assert all(a.seq > 0 for a in takes.alerts) and len({a.seq for a in takes.alerts}) == 2
    assert len(ignores.metrics) == 4
    alerts = rllog.read_alerts(tmp_path / "r").to_pylist()
    assert [(a["step"], a["rule"], a["value"], a["level"]) for a in alerts] == [
        (1, "x_high", 7.0, "warning"),
        (3, "x_high", 9.0, "warning"),
    ]
    assert "rllog alert [x_high] step 1: x is 7.0" in caplog.text


def test_health_false_raises_no_alert(tmp_path):
    run = rllog.init(run_dir=tmp_path / "r", health=False)
    run.log({"loss": float("nan")})
    run.finish()
    assert rllog.read_alerts(tmp_path / "r").num_rows == 0


def test_health_alerts_reach_parquet_wandb_and_trackio(tmp_path, tracker_dirs):
    from readers import read_back

    run = rllog.init(report_to="parquet,wandb,trackio,mlflow", run_dir=tmp_path / "r", flush_interval=0.05)  # default rules
    for step in range(5):
        run.log({"loss": float("nan") if step == 3 else 0.5, "reward": 0.1 * step}, step=step)
    assert run.finish(timeout=120).ok
    [alert] = rllog.read_alerts(tmp_path / "r").to_pylist()
    assert (alert["step"], alert["rule"], alert["metric"], alert["level"]) == (3, "non_finite", "loss", "error")
    wandb_alerts = read_back("wandb", tracker_dirs, run.info).alerts
    assert [(a["title"], a["level"]) for a in wandb_alerts] == [("non_finite: loss", "ERROR")]
    assert wandb_alerts[0]["text"].startswith("step 3: ")
    trackio_alerts = read_back("trackio", tracker_dirs, run.info).alerts
    assert [(a["title"], a["level"], a["step"]) for a in trackio_alerts] == [("non_finite: loss", "error", 3)]
    assert read_back("mlflow", tracker_dirs, run.info).alerts == []  # MLflow has no alerts: acknowledged, not sent
