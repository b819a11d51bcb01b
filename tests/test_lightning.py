"""``RLLogLogger`` in a real Lightning ``fit`` on CPU: metrics at Lightning's steps, hyperparameters in the run's
config, the end status; read back from parquet."""

from __future__ import annotations

import pytest

L = pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

from rllog.integrations.lightning import RLLogLogger  # noqa: E402
from rllog_backends import parquet  # noqa: E402


class TinyRegression(L.LightningModule):
    def __init__(self, lr: float = 0.05, hidden: int = 4, fail_at: int | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
        self.logged: list[tuple[int, float]] = []

    def training_step(self, batch, batch_idx):
        if self.hparams.fail_at is not None and self.global_step == self.hparams.fail_at:
            raise RuntimeError("boom")
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        self.logged.append((self.global_step, loss.item()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def loader():
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
    return torch.utils.data.DataLoader(data, batch_size=4)


def trainer(logger, steps: int = 4):
    return L.Trainer(
        logger=logger,
        max_steps=steps,
        log_every_n_steps=1,
        accelerator="cpu",
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_a_fit_logs_at_lightnings_steps_with_its_hyperparameters(tmp_path):
    logger = RLLogLogger(report_to="parquet", project="lit", name="tiny", run_dir=tmp_path / "run")
    model = TinyRegression(lr=0.05, hidden=4)
    trainer(logger).fit(model, loader())

    rows = parquet.read_metrics(tmp_path / "run").to_pylist()
    losses = [(r["step"], r["value"]) for r in rows if r["key"] == "train/loss"]
    assert losses == model.logged  # the loss the module computed, exactly
    assert [s for s, _ in losses] == [0, 1, 2, 3]  # Lightning's global_step at each log
    assert {(r["step"], r["value"]) for r in rows if r["key"] == "epoch"} == {(s, 0.0) for s in range(4)}
    meta = parquet.read_meta(tmp_path / "run")
    assert {k: meta["config"][k] for k in ("lr", "hidden")} == {"lr": 0.05, "hidden": 4}  # save_hyperparameters(), after start
    assert meta["status"] == "finished"
    assert logger.version == meta["run_id"]


def test_a_fit_that_raises_finishes_the_run_failed(tmp_path):
    logger = RLLogLogger(report_to="parquet", project="lit", run_dir=tmp_path / "run")
    model = TinyRegression(fail_at=2)
    with pytest.raises(RuntimeError, match="boom"):
        trainer(logger).fit(model, loader())

    assert parquet.read_meta(tmp_path / "run")["status"] == "failed"
    rows = parquet.read_metrics(tmp_path / "run").to_pylist()
    assert [r["step"] for r in rows if r["key"] == "train/loss"] == [0, 1]  # what was logged before the failure is kept


class WithValidation(TinyRegression):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", torch.nn.functional.mse_loss(self.net(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test/loss", torch.nn.functional.mse_loss(self.net(x), y))


def test_a_later_stage_resumes_the_same_run(tmp_path):
    logger = RLLogLogger(report_to="parquet", project="lit", run_dir=tmp_path / "run")
    model = WithValidation()
    fit = trainer(logger, steps=2)
    fit.fit(model, loader())
    run_id = logger.version
    fit.validate(model, loader())  # Lightning finalizes the logger after fit; validate logs again
    fit.test(model, loader())  # at the same step as validate's

    meta = parquet.read_meta(tmp_path / "run")
    assert (meta["run_id"], meta["status"]) == (run_id, "finished")
    keys = {r["key"] for r in parquet.read_metrics(tmp_path / "run").to_pylist()}
    assert {"train/loss", "val/loss", "test/loss"} <= keys
    # validate() and test() continue the run (they log at the same step): the latest view hides nothing
    rows = lambda attempts: sorted(  # noqa: E731
        (r["key"], r["step"], r["value"]) for r in parquet.read_metrics(tmp_path / "run", attempts=attempts).to_pylist()
    )
    assert rows("latest") == rows("all")
