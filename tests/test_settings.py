"""rllog.settings: every RLLOG_* environment variable parsed in one place; a bad value is a clear error at the call
that first uses it (init, prepare), never at import and never a silent default; a good one takes effect."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from sinks import wait_until

import rllog
from rllog import agent, settings
from rllog.errors import InvalidSetting
from rllog.run import system_interval

ROOT = Path(__file__).resolve().parents[1]

BAD_VALUES = [
    ("RLLOG_AGENT_LAG_MAX", "abc", "a number of seconds above 0"),  # made `import rllog.agent` raise ValueError
    ("RLLOG_AGENT_LAG_MAX", "-1", "a number of seconds above 0"),
    ("RLLOG_AGENT_FREE_CPUS", "-1", "a number of CPUs from 0 to 1024"),
    ("RLLOG_AGENT_FREE_CPUS", "nan", "a number of CPUs from 0 to 1024"),
    ("RLLOG_AGENT_NICE", "abc", "an integer from -20 to 19"),  # was silently 10
    ("RLLOG_AGENT_NICE", "40", "an integer from -20 to 19"),
    ("RLLOG_SYSTEM_METRICS", "abc", "0/off/false/no"),  # sampled every 5 s silently
    ("RLLOG_SYSTEM_METRICS", "-2", "0/off/false/no"),
    ("RLLOG_SYSTEM_METRICS", "nan", "0/off/false/no"),
    ("RLLOG_AGENT_CPUS", "x,y", "auto, all, or CPU numbers"),  # was a warning in the agent's log, then ignored
    ("RLLOG_AGENT_CPUS", "-1", "auto, all, or CPU numbers"),
    ("RLLOG_AGENT_PRIORITY", "low", "idle or nice"),  # was taken as "not idle" silently
]


@pytest.mark.parametrize("name, value, accepts", BAD_VALUES, ids=[f"{n}={v}" for n, v, _ in BAD_VALUES])
def test_a_bad_value_is_an_invalid_setting_at_init_and_prepare_naming_the_variable(tmp_path, monkeypatch, name, value, accepts):
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidSetting, match=re.escape(f"{name}={value!r} is not valid: it takes {accepts}")):
        rllog.init(report_to="parquet", run_dir=tmp_path / "r", health=False)
    assert not (tmp_path / "r").exists()  # refused before the run directory is claimed
    with pytest.raises(InvalidSetting, match=re.escape(f"{name}={value!r}")):
        rllog.prepare(["parquet"])
    assert agent.waiting_standby() is None


def test_importing_rllog_reads_no_setting():
    """Bad values everywhere: importing rllog (and its agent) still works; the error comes at the call that uses one."""
    first_bad = {name: value for name, value, _ in reversed(BAD_VALUES)}  # "abc" for RLLOG_AGENT_LAG_MAX, ...
    env = os.environ | first_bad | {"PYTHONPATH": str(ROOT)}
    code = "import rllog, rllog.agent, rllog.delivery, rllog_backends.console; print('imported')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "imported", done.stderr[-2000:]


def test_defaults_when_unset_or_blank(monkeypatch):
    expected = {
        "RLLOG_DIR": Path("rllog_runs"),
        "RLLOG_SYSTEM_METRICS": True,
        "RLLOG_QUIET": False,
        "RLLOG_AGENT_PRIORITY": "idle",
        "RLLOG_AGENT_CPUS": "auto",
        "RLLOG_AGENT_LAG_MAX": 30.0,
        "RLLOG_AGENT_FREE_CPUS": 1.0,
        "RLLOG_AGENT_NICE": 10,
        "RLLOG_CONSOLE_FD": None,
    }
    assert {s.name for s in settings.ENV_SETTINGS} == set(expected)
    for setting in settings.ENV_SETTINGS:
        monkeypatch.delenv(setting.name, raising=False)
        assert setting.get() == expected[setting.name], setting.name
        monkeypatch.setenv(setting.name, "  ")  # blank is unset (RLLOG_DIR="" was the working directory)
        assert setting.get() == expected[setting.name], setting.name
    assert system_interval(None) == settings.SYSTEM_METRICS_INTERVAL == 5.0


@pytest.mark.parametrize("value, interval", [("2", 2.0), ("1e1", 10.0), ("off", None), ("on", 5.0)])
def test_system_metrics_interval_from_the_environment_reaches_the_agent(tmp_path, monkeypatch, value, interval):
    """``1e1`` was not a number to the old parser: it silently sampled every 5 s. The command is the one the agent
    was started with (``Popen.args``): ``/proc/PID/cmdline`` read right after the start once came back without it
    in a loaded CI run, while the agent's log showed it sampling."""
    monkeypatch.setenv("RLLOG_SYSTEM_METRICS", value)
    agent.discard_standby()
    with rllog.init(report_to="parquet", run_dir=tmp_path / "r", health=False) as run:
        assert run._agent.system_interval == interval
        command = list(run._agent.proc.args)
        assert "rllog.agent" in command and str(tmp_path / "r") in command
        if interval is None:
            assert "--system-interval" not in command
        else:
            assert command[command.index("--system-interval") + 1] == str(interval)


def test_runs_dir_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RLLOG_DIR", str(tmp_path / "runs"))
    with rllog.init(report_to="parquet", name="n", health=False, delivery="thread") as run:
        assert run.run_dir.parent == (tmp_path / "runs").resolve() and run.run_dir.name.endswith(f"-n-{run.run_id}")
    with rllog.init(report_to="parquet", run_id=run.run_id, resume="must", health=False, delivery="thread") as again:
        assert again.run_dir == run.run_dir  # found by its id under RLLOG_DIR


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux-only")
def test_agent_nice_and_cpus_from_the_environment_take_effect_in_the_agent(tmp_path, monkeypatch):
    monkeypatch.setenv("RLLOG_AGENT_NICE", "5")
    monkeypatch.setenv("RLLOG_AGENT_CPUS", "0")
    agent.discard_standby()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    with rllog.init(report_to="parquet", run_dir=tmp_path / "r", health=False) as run:
        pid = run._agent.pid
        assert wait_until(lambda: os.getpriority(os.PRIO_PROCESS, pid) == min(19, base + 5), timeout=30)
        assert wait_until(lambda: os.sched_getaffinity(pid) == {0}, timeout=30)


def test_lag_max_and_priority_are_read_when_the_governor_starts(monkeypatch):
    monkeypatch.setenv("RLLOG_AGENT_LAG_MAX", "1.5")
    assert agent.PriorityGovernor([], settings.AGENT_PRIORITY.get()).lag_max == 1.5
    monkeypatch.setenv("RLLOG_AGENT_PRIORITY", "NICE")
    assert settings.AGENT_PRIORITY.get() == "nice"
    assert not agent.PriorityGovernor([], settings.AGENT_PRIORITY.get())._idle_mode


def test_every_rllog_variable_in_the_code_is_a_setting_documented_in_both_places():
    names = {s.name for s in settings.ENV_SETTINGS}
    used = set()
    for path in [*ROOT.joinpath("rllog").rglob("*.py"), *ROOT.joinpath("rllog_backends").rglob("*.py")]:
        if path.name == "settings.py":  # names the test suite's own variables, as not rllog's
            continue
        used |= set(re.findall(r"RLLOG_[A-Z][A-Z_]*[A-Z]", path.read_text()))
    assert used <= names, f"read but not in rllog.settings: {sorted(used - names)}"
    table = ROOT.joinpath("docs", "settings.md").read_text()
    docstring = settings.__doc__ or ""
    for setting in settings.ENV_SETTINGS:
        row = next((line for line in table.splitlines() if line.startswith(f"| `{setting.name}` |")), "")
        assert row, f"{setting.name} has no row in docs/settings.md"
        assert f"``{setting.name}``" in docstring, f"{setting.name} is not in rllog.settings' docstring"
        if setting.default:
            assert f"`{setting.default}`" in row, (setting.name, setting.default)
    assert "docs/settings.md" in ROOT.joinpath("README.md").read_text()
