"""DVCLiveSink against the real ``dvclive`` package: what is particular to DVCLive (the contract suite covers the rest),
inside a real git repository that must stay untouched. Read back from DVCLive's own files (``.tsv``, ``params.yaml``)."""

from __future__ import annotations

import logging
import math
import subprocess
from pathlib import Path

import pyarrow as pa
import pytest
from readers.dvclive import read_back

import rllog
from rllog import registry
from rllog.records import MetricsRecord, RunInfo, TableRecord
from rllog.rundir import tracker_location
from rllog_backends.dvclive import dvclive_key

pytest.importorskip("dvclive")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A real git repository with one commit, the working directory of the test (and of the agent it starts)."""
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q")
    (path / "train.py").write_text("print('train')\n")
    git(path, "add", "train.py")
    git(path, "-c", "user.email=t@example.com", "-c", "user.name=t", "commit", "-q", "-m", "init")
    monkeypatch.chdir(path)
    return path


def test_names_stay_inside_the_directory():
    assert dvclive_key("rewards/accuracy/mean") == "rewards/accuracy/mean"
    for key in ("../escape", "/abs", "a//b", "./x", "train/step", "timestamp", "a\\b", "x" * 300):
        name = dvclive_key(key)
        parts = name.split("/")
        assert ".." not in parts and "" not in parts and "." not in parts and "\\" not in name, (key, name)
        assert parts[-1] not in ("step", "timestamp") and all(len(p) <= 200 for p in parts), (key, name)
    assert dvclive_key("a//b") != dvclive_key("a/b")  # a cleaned name never meets a valid one


def test_a_run_in_a_git_repository_leaves_the_repository_alone(repo, tracker_dirs, capfd):
    head, refs = git(repo, "rev-parse", "HEAD"), git(repo, "for-each-ref")
    with rllog.init(
        report_to="dvclive",
        project="grpo",
        config={"lr": 1e-6, "model": {"name": "tiny"}},
        run_dir=repo / "runs" / "a",
        health=False,
    ) as run:
        for step in range(3):
            run.log({"reward": step / 4, "rewards/accuracy/mean": 0.5 + step}, step=step)
        run.log({"reward": 9.0}, step=1)  # a step going back
        run.log_table("completions", {"prompt": ["1+1"], "completion": ["2"], "reward": [math.nan]}, step=2)
        run.update_config({"beta": 0.04})
    assert run.finish().ok

    assert not (repo / ".dvc").exists() and not (repo / ".dvcignore").exists() and not list(repo.rglob("dvc.yaml"))
    assert git(repo, "status", "--porcelain") == "?? runs/\n"  # only the run's own files, untracked
    assert git(repo, "diff", "--cached", "--name-only") == ""  # nothing staged
    assert (git(repo, "rev-parse", "HEAD"), git(repo, "for-each-ref")) == (head, refs)  # no commit, no experiment ref
    out, err = capfd.readouterr()
    assert "dvc" not in (out + err).lower()

    back = read_back(tracker_dirs, run.info)
    assert back.metrics == {
        "reward": [(0, 0.0), (1, 0.25), (2, 0.5), (1, 9.0)],
        "rewards/accuracy/mean": [(0, 0.5), (1, 1.5), (2, 2.5)],
    }
    assert back.tables == {"completions": [(2, [{"prompt": "1+1", "completion": "2", "reward": None}])]}
    assert back.config == {"lr": 1e-6, "model/name": "tiny", "beta": 0.04} and back.status == "finished"
    assert (repo / "runs" / "a" / "dvclive" / "plots" / "metrics" / "rewards" / "accuracy" / "mean.tsv").read_text().splitlines()[
        0
    ] == "step\tmean"


def test_a_key_and_a_key_below_it(tmp_path, caplog):
    """DVCLive's summary cannot hold "a" = 1 and "a/b" = 2 at once; both .tsv files are complete and the sink says so.
    The DVCLive directory is an option's, outside the run directory: the location finish prints names it."""
    info = RunInfo("grpo", "run", str(tmp_path / "run"), "dv-1")
    sink = registry.create("dvclive", {"dir": str(tmp_path / "live")})
    sink.open(info)
    with caplog.at_level(logging.WARNING, logger="rllog.backends.dvclive"):
        sink.write_metrics([MetricsRecord(1, 0, 0.0, {"a": 1.0, "a/b": 2.0}), MetricsRecord(2, 1, 0.0, {"a/b": 3.0})])
    sink.write_table(TableRecord(3, 1, 0.0, "../up", pa.table({"x": [1]})))
    sink.close("failed")
    assert tracker_location(info.run_dir, "dvclive") == f"dir={tmp_path / 'live'}"
    back = read_back({}, info, tmp_path / "live")
    assert back.metrics == {"a": [(0, 1.0)], "a/b": [(0, 2.0), (1, 3.0)]} and back.status == "failed"
    assert list(back.tables) == [dvclive_key("../up")] and not (tmp_path / "live" / "up").exists()
    assert len([r for r in caplog.records if "summary cannot hold" in r.getMessage()]) == 1
