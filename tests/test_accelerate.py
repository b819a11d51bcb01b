"""``RLLogTracker`` in a real accelerate training loop (CPU): metrics, config, tables and the end, read back from
parquet and from DVCLive's files."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState, PartialState  # noqa: E402
from readers import read_back  # noqa: E402

from rllog_backends import parquet  # noqa: E402

CONFIG = {"learning_rate": 0.05, "batch_size": 4, "optim": {"beta1": 0.9}, "use_vllm": False}


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps process-wide state singletons; each test builds its own Accelerator."""
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def train(accelerator: Accelerator, steps: int = 4) -> list[float]:
    """A tiny regression loop; returns the loss logged at each step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=CONFIG["learning_rate"])
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    losses = []
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        accelerator.log({"train/loss": losses[-1], "lr": CONFIG["learning_rate"], "note": "text is no metric"}, step=step)
    return losses


def test_an_accelerate_loop_reaches_every_tracker(tmp_path, tracker_dirs, caplog):
    from rllog.integrations.accelerate import RLLogTracker

    tracker = RLLogTracker(report_to="parquet,dvclive", project="accel", name="loop", run_dir=tmp_path / "run")
    accelerator = Accelerator(cpu=True, log_with=tracker)
    accelerator.init_trackers("accel", config=CONFIG)
    with caplog.at_level(logging.WARNING, logger="rllog.integrations"):
        losses = train(accelerator)
    accelerator.get_tracker("rllog").log_table(
        "completions", columns=["prompt", "reward"], data=[["1+1", 1.0], ["2+2", 0.5]], step=3
    )
    run = accelerator.get_tracker("rllog", unwrap=True)
    accelerator.end_training()

    assert run.finished and run.finish().ok
    assert [r.getMessage() for r in caplog.records if "note" in r.getMessage()] == [
        "rllog: 'note' is not a number (str); not logged as a metric"
    ]  # once, not per step
    rows = parquet.read_metrics(run.run_dir).to_pylist()
    assert [(r["step"], r["value"]) for r in rows if r["key"] == "train/loss"] == list(enumerate(losses))
    assert {r["key"] for r in rows} == {"train/loss", "lr"}
    meta = parquet.read_meta(run.run_dir)
    assert {k: meta["config"][k] for k in ("learning_rate", "batch_size", "optim/beta1", "use_vllm")} == {
        "learning_rate": 0.05, "batch_size": 4, "optim/beta1": 0.9, "use_vllm": False,
    }  # fmt: skip
    assert meta["status"] == "finished"
    assert parquet.read_table(run.run_dir, "completions").drop_columns(["_seq"]).to_pylist() == [
        {"_step": 3, "prompt": "1+1", "reward": 1.0},
        {"_step": 3, "prompt": "2+2", "reward": 0.5},
    ]

    dvc = read_back("dvclive", tracker_dirs, run.info)  # the same data in a second tracker's own files
    assert dvc.metrics["train/loss"] == list(enumerate(losses))
    assert dvc.config["optim/beta1"] == 0.9 and dvc.config["batch_size"] == 4
    assert dvc.tables["completions"] == [(3, [{"prompt": "1+1", "reward": 1.0}, {"prompt": "2+2", "reward": 0.5}])]
    assert dvc.status == "finished"


def test_selected_by_name(tmp_path):
    import rllog.integrations.accelerate  # noqa: F401  (registers "rllog")

    accelerator = Accelerator(cpu=True, log_with="rllog")
    accelerator.init_trackers(
        "by-name", config={"seed": 7}, init_kwargs={"rllog": {"report_to": "parquet", "run_dir": tmp_path / "run"}}
    )
    losses = train(accelerator, steps=2)
    run = accelerator.get_tracker("rllog", unwrap=True)
    accelerator.end_training()

    meta = parquet.read_meta(tmp_path / "run")
    assert (meta["project"], meta["config"]["seed"], meta["status"]) == ("by-name", 7, "finished")
    rows = parquet.read_metrics(run.run_dir).to_pylist()
    assert [(r["step"], r["value"]) for r in rows if r["key"] == "train/loss"] == list(enumerate(losses))


def test_init_trackers_after_end_training_starts_a_new_run(tmp_path, monkeypatch):
    from rllog.integrations.accelerate import RLLogTracker

    """accelerate's own trackers start a fresh run at each ``init_trackers``; rllog's kept its finished run, and the
    next ``log`` raised ``RunFinished``."""
    monkeypatch.setenv("RLLOG_DIR", str(tmp_path / "runs"))
    tracker = RLLogTracker(report_to="parquet", project="accel")
    accelerator = Accelerator(cpu=True, log_with=tracker)
    accelerator.init_trackers("accel", config={"lr": 1})
    accelerator.log({"loss": 1.0}, step=0)
    accelerator.end_training()
    first = tracker.run
    accelerator.init_trackers("accel", config={"lr": 2})
    accelerator.log({"loss": 2.0}, step=0)
    accelerator.end_training()
    assert tracker.run is not first and first.finished
    assert [r["value"] for r in parquet.read_metrics(first.run_dir).to_pylist()] == [1.0]
    # accelerate lists a tracker instance again at each init_trackers (its own named trackers too), so the second
    # training's log reaches this tracker twice: the same row, twice
    assert {r["value"] for r in parquet.read_metrics(tracker.run.run_dir).to_pylist()} == {2.0}
    assert parquet.read_meta(tracker.run.run_dir)["config"]["lr"] == 2
