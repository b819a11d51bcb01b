"""Tensor metrics: kept on their device, copied to the host once per journal flush (counted, not timed)."""

from __future__ import annotations

import pytest
from sinks import wait_until

torch = pytest.importorskip("torch")

import rllog  # noqa: E402
from rllog import journal  # noqa: E402
from rllog.errors import InvalidValue  # noqa: E402

CONVERSIONS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


@pytest.fixture
def host_copies(monkeypatch):
    """Counts every device->host conversion of a tensor (the calls that force a device sync)."""
    counts = []
    for name in CONVERSIONS:
        original = getattr(torch.Tensor, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            counts.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return counts


def test_one_host_copy_per_flush_not_per_metric(tmp_path, host_copies):
    run = rllog.init(report_to="none", run_dir=tmp_path / "r", flush_interval=30.0)  # one flush: at finish
    for step in range(50):
        run.log({f"m{i}": torch.tensor(float(step * 100 + i)) for i in range(10)} | {"host": 1.0}, step=step)
    assert host_copies == []  # log() itself never syncs
    run.finish()
    assert host_copies == ["tolist"]  # 500 tensor values, one transfer
    values = {}
    for r in journal.read_all(tmp_path / "r"):
        if isinstance(r, rllog.MetricsRecord):
            values.update({(r.step, k): v for k, v in r.values.items()})
    assert len(values) == 550
    assert all(values[(s, f"m{i}")] == float(s * 100 + i) for s in range(50) for i in range(10))


def test_two_flushes_two_copies(tmp_path, host_copies):
    run = rllog.init(report_to="none", run_dir=tmp_path / "r", flush_interval=0.05)
    for step in range(5):
        run.log({"loss": torch.tensor(0.5 + step), "acc": torch.tensor(step, dtype=torch.int64)}, step=step)
    assert wait_until(lambda: journal.last_seq(tmp_path / "r") >= 5, timeout=30)
    assert host_copies == ["tolist"]
    run.log({"loss": torch.tensor(9.0)}, step=5)
    run.finish()
    assert host_copies == ["tolist", "tolist"]


def test_tensor_modified_in_place_after_log_keeps_the_logged_value(tmp_path):
    run = rllog.init(report_to="none", run_dir=tmp_path / "r", flush_interval=30.0)
    total = torch.tensor(1.0)
    run.log({"total": total}, step=0)
    total += 41.0  # like Trainer's tr_loss accumulation
    run.finish()
    [record] = [r for r in journal.read_all(tmp_path / "r") if isinstance(r, rllog.MetricsRecord)]
    assert record.values["total"] == 1.0


def test_mixed_dtypes_and_shapes_are_converted_exactly(tmp_path):
    """Stacking an int64 counter with a bf16 loss must not round the counter to bf16 (torch would promote both)."""
    run = rllog.init(report_to="none", run_dir=tmp_path / "r", flush_interval=30.0)
    run.log(
        {
            "count": torch.tensor(123456789),
            "loss": torch.tensor(0.5, dtype=torch.bfloat16),
            "f32": torch.tensor([0.1], dtype=torch.float32),
            "grad": torch.tensor(2.0, requires_grad=True) * 3,
        },
        step=0,
    )
    run.log({"a": torch.tensor([[7.0]]), "b": torch.tensor(8.0)}, step=1)  # shapes (1, 1) and ()
    run.finish()
    records = [r for r in journal.read_all(tmp_path / "r") if isinstance(r, rllog.MetricsRecord)]
    assert records[0].values == {
        "count": 123456789.0,
        "loss": 0.5,
        "f32": float(torch.tensor(0.1, dtype=torch.float32)),
        "grad": 6.0,
    }
    assert records[1].values == {"a": 7.0, "b": 8.0}


def test_a_meta_tensor_is_refused_at_the_call_and_every_other_record_is_delivered(tmp_path):
    """A meta tensor stacks fine but has no data: once it blocked the journal writer and 990 records were lost."""
    run = rllog.init(report_to="parquet", run_dir=tmp_path / "r", flush_interval=0.05, health=False)
    run.log({"loss": torch.tensor(0.5)}, step=0)
    with pytest.raises(InvalidValue, match=r"'bad'.*'meta' device"):
        run.log({"ok": torch.tensor(1.0), "bad": torch.empty((), device="meta")}, step=1)
    with pytest.raises(InvalidValue, match=r"'bad'.*'meta' device"):
        run.log({"bad": torch.tensor([2.0], device="meta")}, step=1)
    for step in range(2, 200):
        run.log({"loss": torch.tensor(float(step))}, step=step)
    assert run.finish().ok
    metrics = rllog.read_metrics(tmp_path / "r")
    assert metrics.column("key").to_pylist() == ["loss"] * 199  # nothing of the refused calls, nothing after them lost
    assert metrics.column("value").to_pylist() == [0.5] + [float(s) for s in range(2, 200)]


UNREADABLE = {
    "sparse": (lambda: torch.tensor([1.0]).to_sparse(), "layout torch.sparse_coo"),
    "quantized": (lambda: torch.quantize_per_tensor(torch.tensor([1.0]), 0.1, 0, torch.qint8), "quantized"),
}


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.parametrize("kind", UNREADABLE)
def test_tensors_that_cannot_become_one_float_are_refused_at_the_call(tmp_path, kind):
    make, match = UNREADABLE[kind]
    run = rllog.init(report_to="none", run_dir=tmp_path / "r", flush_interval=30.0)
    with pytest.raises(InvalidValue, match=match):
        run.log({"ok": torch.tensor(1.0), "bad": make()}, step=0)
    with pytest.raises(InvalidValue, match=match):
        run.log({"bad": make()}, step=0)
    run.log({"x": torch.tensor(2.0)}, step=1)
    run.finish()
    records = [r for r in journal.read_all(tmp_path / "r") if isinstance(r, rllog.MetricsRecord)]
    assert [(r.step, dict(r.values)) for r in records] == [(1, {"x": 2.0})]
