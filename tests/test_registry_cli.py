"""report_to parsing, entry-point backends, and the rllog command."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from sinks import MemorySink

import rllog
from rllog import registry
from rllog.errors import BackendNotInstalled, InvalidSink, UnknownBackend


def test_report_to_forms():
    assert registry.parse_report_to(None) == ["parquet"]
    assert registry.parse_report_to("none") == []
    assert registry.parse_report_to("parquet, none") == ["parquet"]
    assert registry.parse_report_to(["parquet", "PARQUET"]) == ["parquet"]
    everything = registry.parse_report_to("all")
    assert "parquet" in everything and "console" not in everything
    assert everything == [n for n, b in registry.backends().items() if b.installed and n != "console"]
    sink = MemorySink()
    assert registry.parse_report_to([sink, "parquet"]) == [sink, "parquet"]
    with pytest.raises(InvalidSink):
        registry.parse_report_to([42])


def test_unknown_backend_suggests_a_close_match():
    with pytest.raises(UnknownBackend, match=r"did you mean 'tensorboard'\?.*Available: .*parquet"):
        registry.parse_report_to("tensorbord")
    with pytest.raises(UnknownBackend, match="Available"):
        rllog.init(report_to="neptune")


def test_known_but_missing_backend_names_its_extra(monkeypatch):
    monkeypatch.setitem(
        registry.BUILTIN, "wandb", registry.Backend("wandb", "rllog_backends.parquet:ParquetSink", "no_such_module_xyz", "wandb")
    )
    with pytest.raises(BackendNotInstalled, match=r"pip install 'rllog\[wandb\]'"):
        registry.parse_report_to("wandb")


def make_entry_point_package(root):
    """A real installed distribution (dist-info on sys.path) registering backend 'jsonl'."""
    (root / "rllog_jsonl_sink.py").write_text(
        textwrap.dedent("""
        import json, os
        from rllog.sink import Capabilities

        class JsonlSink:
            capabilities = Capabilities(tables=False)
            def __init__(self, filename="metrics.jsonl"):
                self.filename = filename
            def open(self, run_info):
                self.f = open(os.path.join(run_info.run_dir, self.filename), "a")
            def write_metrics(self, records):
                for r in records:
                    self.f.write(json.dumps({"step": r.step, **r.values}) + "\\n")
            def write_table(self, record):
                pass
            def flush(self):
                self.f.flush()
            def close(self, status):
                self.f.write(json.dumps({"status": status}) + "\\n")
                self.f.close()
    """)
    )
    dist = root / "rllog_jsonl-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rllog-jsonl\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[rllog.backends]\njsonl = rllog_jsonl_sink:JsonlSink\n"
        "claims_alerts = rllog_jsonl_sink:ClaimsAlerts\n"  # declares alerts, has no write_alert
        "unimportable = rllog_jsonl_broken:Sink\n"
    )
    with open(root / "rllog_jsonl_sink.py", "a") as module:
        module.write("\nclass ClaimsAlerts(JsonlSink):\n    capabilities = Capabilities(tables=False, alerts=True)\n")
    (root / "rllog_jsonl_broken.py").write_text("import a_module_that_is_not_installed\n")


def test_entry_point_backend_is_selected_by_name_in_the_agent_process(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    make_entry_point_package(site)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", f"{site}:{__import__('os').environ.get('PYTHONPATH', '')}")
    assert registry.backends()["jsonl"].source == "entry point (rllog-jsonl)"
    run = rllog.init(report_to="parquet,jsonl", run_dir=tmp_path / "r", backend_options={"jsonl": {"filename": "out.jsonl"}})
    run.log({"reward": 0.5}, step=3)
    run.log({"reward": 0.75}, step=4)
    assert run.finish(timeout=60).ok
    lines = (tmp_path / "r" / "out.jsonl").read_text().splitlines()
    assert lines == ['{"step": 3, "reward": 0.5}', '{"step": 4, "reward": 0.75}', '{"status": "finished"}']


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "rllog.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "COLUMNS": "200"},
    )


def test_cli_backends_lists_builtin_and_entry_points(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    make_entry_point_package(site)
    monkeypatch.setenv("PYTHONPATH", f"{site}:{__import__('os').environ.get('PYTHONPATH', '')}")
    out = run_cli("backends").stdout
    for name in ("parquet", "wandb", "mlflow", "tensorboard", "trackio", "comet_ml", "jsonl"):
        assert name in out
    assert "entry point (rllog-jsonl)" in out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") >= 4}
    assert rows["jsonl"].split("│")[3].strip() == "yes"
    assert "no: ClaimsAlerts declares capabilities.alerts but has no write_alert()" in rows["claims_alerts"]
    assert "no: rllog_jsonl_broken:Sink does not import: ModuleNotFoundError" in rows["unimportable"]


def test_an_entry_point_sink_that_breaks_the_protocol_is_refused_at_init(tmp_path, monkeypatch):
    """The agent builds an entry point's sink; without a check in the trainer it failed only at finish."""
    site = tmp_path / "site"
    site.mkdir()
    make_entry_point_package(site)
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(
        InvalidSink,
        match=r"backend 'claims_alerts' \(entry point \(rllog-jsonl\)\): ClaimsAlerts declares capabilities.alerts but has no write_alert\(\)",
    ):
        rllog.init(report_to="parquet,claims_alerts", run_dir=tmp_path / "a")
    with pytest.raises(InvalidSink, match=r"rllog_jsonl_broken:Sink does not import: ModuleNotFoundError"):
        rllog.init(report_to="unimportable", run_dir=tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_cli_show_prints_last_min_max(tmp_path):
    with rllog.init(run_dir=tmp_path / "r") as run:
        for i, v in enumerate([3.0, -1.0, 7.0, 2.5]):
            run.log({"reward": v, "loss": float("nan") if i == 1 else 0.1})
        run.log_table("completions", {"a": [1, 2, 3]})
    out = run_cli("show", str(tmp_path / "r")).stdout
    reward = next(line for line in out.splitlines() if "reward" in line)
    assert [c.strip() for c in reward.strip("│┃ ").split("│")] == ["reward", "2.5", "-1", "7", "4"]
    loss = next(line for line in out.splitlines() if " loss" in line)
    assert "1 NaN/inf" in loss
    assert "steps: 0..3 (4 distinct)" in out
    assert "completions: logged 1 times, 3 rows" in out
    assert "parquet" in out and "delivered" in out


def test_demo_simulated_writes_parquet_and_a_plot(tmp_path):
    proc = run_cli("demo", "--simulate", "--steps", "12", "--run-dir", str(tmp_path / "demo"))
    assert proc.returncode == 0, proc.stderr
    metrics = rllog.read_metrics(tmp_path / "demo")
    assert len(set(metrics.column("key").to_pylist())) >= 27
    assert sorted(set(metrics.column("step").to_pylist())) == list(range(12))
    assert rllog.read_table(tmp_path / "demo", "completions").num_rows == 8
    png = (tmp_path / "demo" / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_entry_points_are_read_once_and_again_for_a_name_not_known(tmp_path, monkeypatch):
    """Reading every package's metadata cost ~20 ms a lookup, and train() resolved each backend twice (0.28 s
    with six, measured), then 20-35 ms on the training thread at the first ``log_table``; built-in names need no
    lookup at all, and a plugin installed after the first lookup is still found by name."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    looks = []
    real = registry.entry_points

    def counting(**kwargs):
        looks.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(registry, "entry_points", counting)
    names = ["parquet", "wandb", "mlflow", "tensorboard", "trackio", "comet_ml"]
    assert registry.parse_report_to(names) == names
    assert [registry.resolve(n).target for n in ("tb", "comet")] == [
        "rllog_backends.tensorboard:TensorBoardSink",
        "rllog_backends.comet:CometSink",
    ]
    assert looks == []  # a built-in name reads no package's metadata (the first log_table resolves them all)
    assert "jsonl" not in registry.backends()
    assert registry.parse_report_to(names) == names
    assert len(looks) == 1
    make_entry_point_package(site)  # installed now, into a folder already on sys.path
    assert "jsonl" not in registry.backends()
    assert registry.resolve("jsonl").source == "entry point (rllog-jsonl)"
    assert len(looks) == 2
    assert registry.backends()["jsonl"].target == "rllog_jsonl_sink:JsonlSink"
    with pytest.raises(UnknownBackend):
        registry.resolve("neptune")
    assert len(looks) == 3


def test_show_says_a_resumed_attempt_is_not_finished_and_plot_of_no_metrics_is_a_clear_error(tmp_path, capsys):
    """After a finished attempt, a resumed one still running (or killed) was shown with the first attempt's end
    status, ``finished``; ``rllog plot`` of a run without metrics ended in a traceback."""
    from rllog.summary import summarise

    run_dir = tmp_path / "r"
    with rllog.init(report_to="parquet", run_dir=run_dir, health=False) as run:
        run.log({"x": 1.0}, step=0)
    assert summarise(run_dir).status == "finished"
    run = rllog.init(run_dir=run_dir, resume="must", health=False)
    run.log({"x": 2.0}, step=1)
    assert run.flush().ok
    assert summarise(run_dir).status is None  # shown as running or killed
    run.finish()
    assert summarise(run_dir).status == "finished"

    empty = tmp_path / "empty"
    with rllog.init(report_to="parquet", run_dir=empty, health=False) as run:
        run.log_table("t", {"a": [1]}, step=0)
    capsys.readouterr()
    from rllog.cli import main as cli_main

    assert cli_main(["plot", str(empty), "-o", str(tmp_path / "p.png")]) == 2
    assert "no metrics to plot" in capsys.readouterr().err
