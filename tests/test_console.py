"""The console backend, captured with Rich's console recording: the live panel in a terminal, plain
lines otherwise, values coloured by health, alerts shown."""

from __future__ import annotations

import io
import os
import re

import pyarrow as pa
import pytest
from rich.console import Console

import rllog
from rllog import registry
from rllog.records import AlertRecord, MetricsRecord, RunInfo, TableRecord
from rllog.sink import MetricSink, sink_problem
from rllog_backends.console import ConsoleSink, fmt_duration, fmt_value

INFO = RunInfo("grpo-math", "run-7", "/tmp/run-7", "abcd1234")
RED, GREEN, YELLOW = "\x1b[1;31m", "\x1b[32m", "\x1b[33m"


def records(steps, seconds_per_step=2.0):
    """GRPO-shaped records; val/ratio leaves its healthy range from step 20 on."""
    out = []
    for i, step in enumerate(steps):
        out.append(
            MetricsRecord(
                i + 1,
                step,
                1000.0 + seconds_per_step * step,
                {
                    "reward": step / 100,
                    "kl": 0.01,
                    "entropy": 1.5,
                    "val/ratio": 1.6 if step >= 20 else 1.0,
                    "my/custom": 7.25,
                },
            )
        )
    return out


ALERT = AlertRecord(
    99, 20, 1040.0, "ratio_far_from_one", "val/ratio", 1.6, "val/ratio is 1.6, more than 0.2 away from 1.0", "warning"
)
ERROR = AlertRecord(100, 21, 1042.0, "non_finite", "loss", float("nan"), "loss is nan", "error")


def live_sink(width=120, **kwargs):
    console = Console(record=True, force_terminal=True, width=width, color_system="standard")
    return ConsoleSink(console=console, refresh_per_second=0, **kwargs), console


def last_panel(text: str) -> str:
    return text[text.rindex("╭") :]


def test_live_panel_with_progress_eta_coloured_metrics_and_alerts():
    sink, console = live_sink(total_steps=100)
    assert sink_problem(sink) is None and sink.capabilities.alerts  # declares alerts and has write_alert
    sink.open(INFO)
    assert sink.is_live
    sink.write_metrics(records(range(0, 41)))
    sink.write_table(TableRecord(50, 40, 1080.0, "completions", pa.table({"prompt": ["a", "b"], "completion": ["c", "d"]})))
    sink.write_alert(ALERT)
    sink.write_alert(ERROR)
    sink.flush()
    panel = last_panel(console.export_text(clear=False))
    assert "rllog: grpo-math/run-7" in panel and "running" in panel
    # progress: step 40 of 100 after 80 s at 0.5 step/s -> 60 steps left = 2:00
    assert "step 40/100" in panel and "40%" in panel and "elapsed 1:20" in panel and "eta 2:00" in panel
    assert "━" in panel  # the bar
    rows = {line.split()[1]: line for line in panel.splitlines() if line.startswith("│  ") and len(line.split()) > 3}
    assert rows["reward"].split()[2] == "0.4"
    assert rows["val/ratio"].split()[2] == "1.6" and "near 1 (0.8 to 1.2)" in rows["val/ratio"]
    assert rows["kl"].split()[2] == "0.01"
    assert "my/custom" not in rows  # not crucial, not asked for
    assert "alerts (2):" in panel
    assert "step 20 WARNING [ratio_far_from_one] val/ratio=1.6: val/ratio is 1.6, more than 0.2 away from 1.0" in panel
    assert "step 21 ERROR [non_finite] loss=nan: loss is nan" in panel
    assert "table completions: logged 1 times, 2 rows" in panel
    styled = console.export_text(styles=True, clear=False)
    styled = styled[styled.rindex("╭") :]
    assert re.search(re.escape(RED) + r" *1\.6\x1b\[0m", styled), "unhealthy val/ratio not red"
    assert re.search(re.escape(GREEN) + r" *0\.01\x1b\[0m", styled), "healthy kl not green"
    assert " 0.4 " in styled and not re.search(r"\x1b\[[0-9;]*m *0\.4\x1b", styled), (
        "a metric without a range should not be coloured"
    )
    assert YELLOW + "step 20 WARNING [ratio_far_from_one]" in styled
    assert RED + "step 21 ERROR [non_finite]" in styled
    sink.close("finished")
    assert not sink.is_live
    final = last_panel(console.export_text())
    assert "finished" in final and "step 40/100" in final


def test_live_panel_colours_change_with_health_and_extra_metrics():
    sink, console = live_sink(metrics=["my/custom"])
    sink.open(INFO)
    sink.write_metrics(records(range(0, 5)))
    early = console.export_text(styles=True, clear=True)
    assert re.search(re.escape(GREEN) + r" *1\x1b\[0m", early[early.rindex("╭") :]), "val/ratio 1.0 should be green"
    sink.write_metrics(records(range(20, 22)))
    panel = last_panel(console.export_text(clear=False))
    assert "my/custom" in panel and "7.25" in panel
    assert "step 21/" not in panel and "━" not in panel  # no total: no bar
    assert "step 21" in panel and "steps/s" in panel and "eta" not in panel
    sink.close("failed")
    assert "failed" in last_panel(console.export_text())


def test_live_redraws_are_rate_limited_but_flush_and_alerts_draw():
    console = Console(record=True, force_terminal=True, width=100)
    sink = ConsoleSink(console=console, refresh_per_second=0.001)  # at most one redraw per 1000 s
    sink.open(INFO)
    console.export_text(clear=True)
    for r in records(range(50)):
        sink.write_metrics([r])
    assert console.export_text(clear=False).count("╭") == 0
    sink.flush()
    assert console.export_text(clear=True).count("╭") == 1
    sink.write_alert(ALERT)
    assert "[ratio_far_from_one]" in console.export_text(clear=True)
    sink.close("finished")


def test_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    console = Console(file=out, record=True, force_terminal=False, width=300)
    sink = ConsoleSink(console=console, total_steps=100, every=10)
    sink.open(INFO)
    assert not sink.is_live
    sink.write_metrics(records(range(0, 25)))
    sink.write_table(TableRecord(30, 20, 1040.0, "completions", pa.table({"prompt": ["a"] * 3})))
    sink.write_table(TableRecord(31, 21, 1042.0, "completions", pa.table({"prompt": ["a"] * 3})))  # not a multiple of every
    sink.write_alert(ALERT)
    sink.write_alert(ERROR)
    sink.close("finished")
    lines = out.getvalue().splitlines()
    assert "\x1b" not in out.getvalue()  # no control codes in a log file
    assert lines == [
        "rllog: run grpo-math/run-7 (abcd1234) in /tmp/run-7",
        "step 0/100 (0%, eta -) reward=0 kl=0.01 entropy=1.5 val/ratio=1 my/custom=7.25",
        "step 10/100 (10%, eta 3:00) reward=0.1 kl=0.01 entropy=1.5 val/ratio=1 my/custom=7.25",
        "step 20/100 (20%, eta 2:40) reward=0.2 kl=0.01 entropy=1.5 val/ratio=1.6! my/custom=7.25",
        "step 20 table completions: 3 rows",
        "WARNING step 20 [ratio_far_from_one] val/ratio=1.6: val/ratio is 1.6, more than 0.2 away from 1.0",
        "ERROR step 21 [non_finite] loss=nan: loss is nan",
        "rllog: run run-7 finished at step 24 (2 alerts)",
    ]
    html = console.export_html(inline_styles=True)
    assert re.search(r'<span style="color: #800000[^"]*font-weight: bold">1\.6!</span>', html), "unhealthy value not red"
    assert re.search(r'<span style="color: #008000[^"]*">0\.01</span>', html), "healthy value not green"
    assert re.search(r'<span style="color: #808000[^"]*">WARNING step 20', html), "warning not yellow"
    assert re.search(r'<span style="color: #800000[^"]*font-weight: bold">ERROR step 21', html), "error not red"


def test_writes_to_the_fd_in_RLLOG_CONSOLE_FD(tmp_path, monkeypatch):
    path = tmp_path / "stdout.txt"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        monkeypatch.setenv("RLLOG_CONSOLE_FD", str(fd))
        sink = registry.create("console", {"every": 2, "total_steps": 4})
        assert isinstance(sink, MetricSink) and isinstance(sink, ConsoleSink)
        sink.open(INFO)
        assert not sink.is_live  # a file is not a terminal
        sink.write_metrics(records(range(4)))
        sink.write_alert(ALERT)
        sink.close("finished")
    finally:
        os.close(fd)
    text = path.read_text()
    assert "step 0/4" in text and "step 2/4 (50%, eta 0:04) reward=0.02" in text and "step 1/" not in text
    assert "WARNING step 20 [ratio_far_from_one]" in text


def test_end_to_end_health_alerts_reach_the_console(tmp_path):
    out = io.StringIO()
    console = Console(file=out, record=True, force_terminal=False, width=300)
    sink = ConsoleSink(console=console, every=5)
    run = rllog.init(report_to=[sink], run_dir=tmp_path / "run", delivery="thread", name="e2e")
    for step in range(30):
        run.log({"entropy": 2.0 if step < 10 else 0.1, "reward": 0.5}, step=step)
    report = run.finish(timeout=60)
    assert report.ok, report
    text = out.getvalue()
    assert "step 10 reward=0.5 entropy=0.1" in text
    assert re.search(r"WARNING step 10 \[entropy_collapse\] entropy=0\.1: entropy collapsed to 0\.1", text)
    assert "rllog: run e2e finished at step 29 (1 alert)" in text


@pytest.mark.parametrize(
    "value,text",
    [
        (0.1234567, "0.1235"),
        (3.0, "3"),
        (float("nan"), "nan"),
        (float("-inf"), "-inf"),
        (1.5e-7, "1.5e-07"),
        (799206.0, "799206"),
    ],
)
def test_value_format(value, text):
    assert fmt_value(value) == text


def test_duration_format():
    assert [fmt_duration(s) for s in (None, 5, 125, 3725)] == ["-", "0:05", "2:05", "1:02:05"]


AGENT_CONSOLE = r"""
import math, sys, rllog
run = rllog.init(report_to="console", run_dir=sys.argv[1], flush_interval=0.05, backend_options={"console": {"every": 1}})
for step in range(3):
    run.log({"reward": 0.25 * step, "loss": math.nan if step == 2 else 0.5}, step=step)
print("trainer says bye", flush=True)
run.finish()
"""


def test_console_in_the_delivery_agent_writes_to_the_trainers_stdout(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", AGENT_CONSOLE, str(tmp_path / "r")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "trainer says bye" in out
    assert "reward=0.5" in out.replace(" ", "") or "reward 0.5" in out  # the agent's lines reached the trainer's stdout
    assert "non_finite" in out and "loss" in out  # the NaN-loss alert, shown by the console
    assert "reward" not in (tmp_path / "r" / "agent.log").read_text()
