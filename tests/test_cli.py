"""The ``rllog`` command as a new user meets it: listing runs, the latest-run default, one-line errors, plots."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import rllog
from rllog import cli
from rllog.cli import main

STEPS = 12


@pytest.fixture
def runs_root(tmp_path, monkeypatch):
    """Two finished TensorBoard runs under ``RLLOG_DIR``: ``first`` (steps 0-11), then ``second`` (steps 0-5)."""
    root = tmp_path / "rllog_runs"
    monkeypatch.setenv("RLLOG_DIR", str(root))
    monkeypatch.setattr(cli.console, "width", 200)
    for name, steps in (("first", STEPS), ("second", STEPS // 2)):
        run = rllog.init(report_to="tensorboard", run_dir=root / name, name=name, delivery="thread", health=False)
        for step in range(steps):
            run.log({"reward": step / steps, "train/learning_rate": 1e-3 * (steps - step), "kl": 0.01}, step=step)
        assert run.finish().ok
    return root


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"rllog {rllog.__version__}\n"


def test_runs_lists_every_run_and_show_takes_the_latest_or_a_parent_folder(runs_root, capsys):
    assert main(["runs"]) == 0
    rows = [line.split("│")[1:-1] for line in capsys.readouterr().out.splitlines() if line.count("│") == 7]
    assert [[c.strip() for c in row[:5]] for row in rows] == [
        ["first", "first", "finished", str(STEPS - 1), "tensorboard"],
        ["second", "second", "finished", str(STEPS // 2 - 1), "tensorboard"],
    ]
    for args in (["show"], ["show", str(runs_root)]):
        assert main(args) == 0
        captured = capsys.readouterr()
        assert captured.out.startswith("rllog / second  run_id=")
        assert f"holds 2 runs; using the latest, second (`rllog runs {runs_root}` lists them)" in captured.err
    assert main(["show", str(runs_root / "first")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rllog / first") and "steps: 0..11 (12 distinct)" in out
    assert "sink tensorboard: delivered (12 delivered, 0 pending)\n  data: logdir=" in out
    logdir = Path(out.split("data: logdir=")[1].split("\n")[0])
    assert logdir.name == "first" and any(logdir.glob("events.out.tfevents.*"))  # where TensorBoard wrote the run
    metric_rows = [line.split("│")[1].strip() for line in out.splitlines() if line.count("│") == 7]
    assert metric_rows == ["reward", "kl", "train/learning_rate"]  # the catalog's crucial metrics first, then by name


def test_errors_are_one_line_saying_what_to_do(runs_root, tmp_path, capsys, monkeypatch):
    assert main(["replay", str(runs_root / "first"), "--to", "tensorbord"]) == 2
    assert "unknown backend 'tensorbord'; did you mean 'tensorboard'?" in _one_error_line(capsys)
    assert main(["show", str(tmp_path / "nowhere")]) == 2
    assert "does not exist; `rllog runs DIR` lists the runs" in _one_error_line(capsys)
    (tmp_path / "empty").mkdir()
    assert main(["show", str(tmp_path / "empty")]) == 2
    assert _one_error_line(capsys) == f"error: {tmp_path / 'empty'} holds no rllog run"
    assert main(["replay", str(tmp_path / "empty"), "--to", "parquet"]) == 2
    assert "holds no rllog run" in _one_error_line(capsys)
    assert main(["plot", "--smooth", "1.5"]) == 2
    assert "give a weight in [0, 1)" in _one_error_line(capsys)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: its import raises ModuleNotFoundError
    assert main(["plot"]) == 2
    assert _one_error_line(capsys) == 'error: `rllog plot` needs matplotlib: pip install "rllog[plot]"'


def test_show_and_replay_during_a_live_run_say_it_is_live(tmp_path, capsys):
    run = rllog.init(report_to="parquet", run_dir=tmp_path / "r", health=False, delivery="thread")
    try:
        run.log({"reward": 1.0}, step=0)
        run.flush(timeout=60)
        assert main(["show", str(tmp_path / "r")]) == 0
        out = capsys.readouterr().out
        assert "status=running" in out and "the run is live: its delivery agent is delivering" in out
        assert "not delivered before the deadline" not in out
        assert main(["replay", str(tmp_path / "r"), "--to", "parquet"]) == cli.EXIT_BUSY
        assert "the run is live: its delivery agent delivers it; replay once the run has ended" in _one_error_line(capsys)
    finally:
        run.finish()


def test_plot_overlays_runs_with_names_dates_labels_smoothing_and_the_learning_rate(runs_root, tmp_path, monkeypatch):
    import matplotlib.figure

    from rllog.plot import smoothed

    assert smoothed([0.0, 2.0, float("nan"), 2.0], 0.5) == pytest.approx([0.0, 4 / 3, float("nan"), 12 / 7], nan_ok=True)
    drawn = {}

    def keep(fig, path, **kwargs):
        drawn["title"] = fig._suptitle.get_text()
        drawn["panels"] = [(ax.get_title(), ax.get_ylabel(), len(ax.get_lines())) for ax in fig.axes if ax.get_title()]
        drawn["legend"] = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        open(path, "wb").close()

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    out = tmp_path / "both.png"
    assert main(["plot", str(runs_root / "first"), str(runs_root / "second"), "--smooth", "0.6", "-o", str(out)]) == 0
    assert out.exists()
    assert drawn["title"].startswith("rllog / first (20") and " vs rllog / second (20" in drawn["title"]
    assert drawn["title"].endswith("(smoothing 0.6)")
    # each run: the raw series (faint) and the smoothed one
    assert drawn["panels"] == [
        ("reward", "reward", 4),
        ("kl", "kl", 5),
        ("train/learning_rate", "learning_rate", 4),
    ]  # as the integrations name it
    labels = drawn["title"].split("  (smoothing")[0].split(" vs ")
    assert drawn["legend"][:2] == labels  # each run named in the legend, as in the title


def test_piped_show_never_breaks_a_long_path(tmp_path, capsys):
    """Piped output is 120 columns wide; a run directory longer than that used to be cut across two lines, which
    cannot be pasted into a shell (tables still fit the width)."""
    run_dir = tmp_path / ("deep-" * 30) / "r"
    with rllog.init(report_to="parquet", run_dir=run_dir, health=False, quiet=True) as run:
        run.log({"reward": 1.0}, step=0)
    assert main(["show", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"data: {run_dir}/parquet\n" in out
