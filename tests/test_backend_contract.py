"""The contract every backend keeps, run over every backend with a reader in ``tests/readers/``.

Each test drives a real sink (``registry.create``) the way the delivery layer does (open, write, flush,
close; a call that raised a retry error is repeated with the same records) and reads the result back
from the tracker's own storage through the backend's reader. Where a tracker stores something its own
way (float32 scalars, infinity as the largest double, text table cells), the reader says how
(``readers/__init__.py``); the differences are documented per tracker in docs/backends.md.

Adding a reader adds a backend to every test here. ``console`` has no reader: it is a display (values
to 4 significant digits, tables as row counts, no config), tested in tests/test_console.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pyarrow as pa
import pytest
from readers import BACKENDS, hook, read_back
from sinks import backend_run_info, fill, tmpfs

import rllog
from rllog import registry
from rllog.errors import TransientError
from rllog.records import AlertRecord, ConfigRecord, MetricsRecord, RunInfo, TableRecord
from rllog.sink import Batch

T0 = 1_700_000_000.0
CONFIG = {"learning_rate": 1e-6, "per_device_train_batch_size": 4, "use_vllm": False, "model/name": "tiny-qwen", "beta": 0.04}


@pytest.fixture(params=BACKENDS)
def backend(request, tracker_dirs, monkeypatch):
    hook(request.param, "prepare")(monkeypatch, tracker_dirs)
    return request.param


make_info = partial(backend_run_info, project="contract", run_id="contract-0001", config=CONFIG)


def open_sink(backend: str, info: RunInfo):
    sink = registry.create(backend, dict(hook(backend, "OPTIONS")))
    sink.open(info)
    return sink


def metrics(seq: int, step: int, values: dict) -> MetricsRecord:
    return MetricsRecord(seq, step, T0 + seq, values)


def table(seq: int, step: int, name: str, columns: dict) -> TableRecord:
    return TableRecord(seq, step, T0 + seq, name, pa.table(columns))


def deliver(call, attempts: int = 5, on_retry=None) -> list[TransientError]:
    """Call ``call`` as the delivery layer does: repeat it after a retry error. Returns the retry errors."""
    errors: list[TransientError] = []
    for _ in range(attempts):
        try:
            call()
            return errors
        except TransientError as exc:
            errors.append(exc)
            if on_retry is not None:
                on_retry()
    raise AssertionError(f"still failing after {attempts} attempts: {errors[-1]}")


def same(a, b) -> bool:
    """Equality where NaN equals NaN, for values, (step, value) pairs and rows."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def expected_series(backend: str, points) -> list[tuple[int, float]]:
    stored = hook(backend, "stored")
    return [(step, stored(value)) for step, value in points]


def expected_rows(backend: str, columns: dict) -> list[dict]:
    cell = hook(backend, "cell")
    return [{k: cell(v) for k, v in row.items()} for row in pa.table(columns).to_pylist()]


# -- end to end -------------------------------------------------------------------------------------
KEYS = [
    "loss",
    "grad_norm",
    "learning_rate",
    "num_tokens",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "kl",
    "entropy",
    "rewards/accuracy/mean",
    "rewards/accuracy/std",
    "rewards/format/mean",
    "rewards/format/std",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_mean",
    "clip_ratio/high_max",
    "clip_ratio/region_mean",
    "step_time",
    "epoch",
    "train/global_step_copy",
    "eval/reward",
    "objective/kl",
]
RUN_CONFIG = {"learning_rate": 1e-6, "beta": 0.04, "hub_token": "hf_very_secret", "model": {"name": "tiny-qwen", "layers": 2}}
TABLE_0 = {
    "prompt": ["What is 1+1?", "Name a colour"],
    "completion": ["2", "blue"],
    "rewards/accuracy": [1.0, 0.5],
    "advantage": [0.75, -0.25],
}
TABLE_20 = {"prompt": ["What is 2+2?"], "completion": ["4"], "rewards/accuracy": [1.0], "advantage": [0.5], "n_chars": [1]}


def value(step: int, i: int) -> float:
    return step * 1.25 + i / 8 - 3.0


def test_a_run_through_rllog_init_arrives_exactly(backend, tracker_dirs, tmp_path):
    """The same GRPO-shaped run through ``rllog.init`` (journal, agent, delivery), compared value by value."""
    options = {backend: hook(backend, "OPTIONS")} if hook(backend, "OPTIONS") else None
    run = rllog.init(
        report_to=backend,
        project="behaviour",
        name="grpo-run",
        config=RUN_CONFIG,
        run_dir=tmp_path / "run",
        flush_interval=0.2,
        health=False,
        backend_options=options,
    )
    for step in range(50):
        run.log({k: value(step, i) for i, k in enumerate(KEYS)}, step=step)
        if step == 0:
            run.log_table("completions", TABLE_0, step=0)
        if step == 20:
            run.log_table("completions", TABLE_20, step=20)
    run.log({"reward": 99.5}, step=10)  # a step that goes backwards: resumed run / late eval
    report = run.finish(timeout=120)
    assert report.ok, str(report)
    assert report[backend].delivered == 53

    got = read_back(backend, tracker_dirs, run.info)
    for i, key in enumerate(KEYS):  # every key, every step, the exact value (the backward step included)
        expected = [(s, value(s, i)) for s in range(50)] + ([(10, 99.5)] if key == "reward" else [])
        assert sorted(got.metrics[key]) == sorted(expected_series(backend, expected)), key
    assert set(KEYS) <= set(got.metrics)
    [(step0, rows0), (step20, rows20)] = got.tables["completions"]  # both tables, at their steps, with their own columns
    assert (step0, step20) == (0, 20)
    assert [{k: row.get(k) for k in TABLE_0} for row in rows0] == expected_rows(backend, TABLE_0)
    assert [{k: row.get(k) for k in TABLE_20} for row in rows20] == expected_rows(backend, TABLE_20)
    assert got.config["hub_token"] == "***REDACTED***"  # flattened with "/", the secret redacted before the tracker
    assert "hf_very_secret" not in repr(got.config)
    assert math.isclose(float(got.config["learning_rate"]), 1e-6)
    assert str(got.config["model/name"]) == "tiny-qwen"
    assert got.status == "finished"


# -- the sink contract ------------------------------------------------------------------------------
def test_a_second_open_resumes_the_same_tracker_run(backend, tracker_dirs):
    info = make_info(tracker_dirs)
    first = open_sink(backend, info)
    first.write_metrics([metrics(s + 1, s, {"reward": s / 4}) for s in range(3)])
    first.flush()
    first.close("killed")  # the trainer died; `rllog replay` delivers the rest later, from another process
    again = open_sink(backend, info)
    again.write_metrics([metrics(s + 1, s, {"reward": s / 4}) for s in range(3, 5)])
    again.write_table(table(6, 4, "completions", {"completion": ["ok"]}))
    again.flush()
    again.close("finished")

    back = read_back(backend, tracker_dirs, info)
    assert back.metrics["reward"] == expected_series(backend, [(s, s / 4) for s in range(5)])
    assert back.tables["completions"] == [(4, expected_rows(backend, {"completion": ["ok"]}))]
    assert back.status == "finished"  # the later session's status wins
    run_ids = hook(backend, "run_ids")
    if run_ids is not None:
        assert len(run_ids(tracker_dirs, info)) == 1, "a second tracker run was created"


def test_a_later_attempt_that_restarts_at_an_earlier_step(backend, tracker_dirs):
    """A job killed after step 9 and resumed from its checkpoint at step 5: one tracker run. TensorBoard
    hides what the killed attempt wrote from step 5 on (its restart marker, read with EventAccumulator);
    the other trackers keep both attempts' points (docs/backends.md, "Resuming from an earlier step")."""
    first_info = make_info(tracker_dirs)
    first = open_sink(backend, first_info)
    first.write_metrics([metrics(s + 1, s, {"reward": s / 4}) for s in range(10)])
    first.write_table(table(11, 9, "completions", {"completion": ["attempt 1"]}))
    first.flush()
    first.close("killed")
    info = dataclasses.replace(first_info, attempt_starts=(1, 12))
    again = open_sink(backend, info)
    # The agent samples the trainer before the trainer logs, at the previous attempt's last step: it
    # does not decide where the attempt restarts.
    again.write_metrics([metrics(12, 9, {"system/cpu_percent": 50.0})])
    again.write_metrics([metrics(s + 8, s, {"reward": s / 4 + 100}) for s in range(5, 15)])
    again.write_table(table(23, 14, "completions", {"completion": ["attempt 2"]}))
    again.flush()
    again.close("finished")

    back = read_back(backend, tracker_dirs, info)
    killed, resumed = [(s, s / 4) for s in range(10)], [(s, s / 4 + 100) for s in range(5, 15)]
    tables = [(9, expected_rows(backend, {"completion": ["attempt 1"]}))] if not hook(backend, "SUPERSEDES") else []
    tables.append((14, expected_rows(backend, {"completion": ["attempt 2"]})))
    if hook(backend, "SUPERSEDES"):
        assert back.metrics["reward"] == expected_series(backend, killed[:5] + resumed)
    else:
        assert back.metrics["reward"] == expected_series(backend, killed + resumed)
    assert back.tables["completions"] == tables
    assert back.status == "finished"
    run_ids = hook(backend, "run_ids")
    if run_ids is not None:
        assert len(run_ids(tracker_dirs, info)) == 1, "a second tracker run was created"


def test_config_given_after_open(backend, tracker_dirs):
    """``Run.update_config`` after the tracker run started (accelerate, Lightning): new keys and a changed value."""
    info = make_info(tracker_dirs)
    sink = open_sink(backend, info)
    if not sink.capabilities.config or not callable(getattr(sink, "write_config", None)):
        sink.close("finished")
        pytest.skip(f"{backend} takes no config after open")
    update = {"learning_rate": 2e-6, "num_generations": 8, "model/num_parameters": 494032768, "report_to": "['wandb']"}
    sink.write_metrics([metrics(1, 0, {"reward": 1.0})])
    deliver(lambda: sink.write_config(ConfigRecord(2, 3, T0 + 2, update)))
    sink.write_metrics([metrics(3, 4, {"reward": 2.0})])
    sink.close("finished")

    back = read_back(backend, tracker_dirs, info)
    config_value, update_value = hook(backend, "config_value"), hook(backend, "config_update_value")
    expected = {k: config_value(v) for k, v in CONFIG.items()} | {k: update_value(CONFIG.get(k), v) for k, v in update.items()}
    assert {k: back.config.get(k) for k in expected} == expected
    assert back.metrics == {"reward": expected_series(backend, [(0, 1.0), (4, 2.0)])}  # no metric made of the config


def test_importing_a_backend_imports_no_tracker():
    """Every backend imports its tracker in ``open``, never when its module is imported or its sink built."""
    trackers = {name: registry.resolve(name).requires for name in BACKENDS if registry.resolve(name).requires}
    code = (
        "import json, sys\nfrom rllog import registry\n"
        f"trackers = {trackers!r}\n"
        "for name in trackers:\n    registry.create(name, {})\n"
        "print(json.dumps(sorted(name for name, module in trackers.items() if module in sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert trackers and json.loads(result.stdout.splitlines()[-1]) == []


# One row per case of rllog_backends/_cells.py's policy: NaN/inf, None, bytes (UTF-8 and not), lists and structs.
POLICY_COLUMNS = {
    "number": [math.nan, math.inf, -math.inf, 0.25, None],
    "raw": [b"caf\xc3\xa9", b"\xff", b"", None, b"ok"],
    "tokens": [[1, 2], [], None, [3], [4]],
    "meta": [{"k": 1.5}, {"k": math.nan}, None, {"k": None}, {"k": 2.0}],
}
POLICY_ROWS = {  # what each tracker stores, by how its table takes a list or a dict (the reader's TABLE_CELLS)
    "nested": [
        {"number": None, "raw": "caf\u00e9", "tokens": [1, 2], "meta": {"k": 1.5}},
        {"number": None, "raw": "\\xff", "tokens": [], "meta": {"k": None}},
        {"number": None, "raw": "", "tokens": None, "meta": None},
        {"number": 0.25, "raw": None, "tokens": [3], "meta": {"k": None}},
        {"number": None, "raw": "ok", "tokens": [4], "meta": {"k": 2.0}},
    ],
    "text": [
        {"number": None, "raw": "caf\u00e9", "tokens": "[1, 2]", "meta": '{"k": 1.5}'},
        {"number": None, "raw": "\\xff", "tokens": "[]", "meta": '{"k": null}'},
        {"number": None, "raw": "", "tokens": None, "meta": None},
        {"number": 0.25, "raw": None, "tokens": "[3]", "meta": '{"k": null}'},
        {"number": None, "raw": "ok", "tokens": "[4]", "meta": '{"k": 2.0}'},
    ],
}


def test_cells_of_values_arrow_never_gives_follow_the_same_policy():
    """What a sink may meet outside ``to_pylist``: 0-d numpy and torch values, dates, ``Decimal``, ``memoryview``."""
    import datetime
    import decimal

    import numpy as np

    from rllog_backends._cells import cell

    torch = pytest.importorskip("torch")
    values = [np.float32(0.5), np.float64("nan"), np.int64(7), np.bool_(True), torch.tensor(2.5), torch.tensor(float("inf"))]
    assert [cell(v) for v in values] == [0.5, None, 7, True, 2.5, None]
    assert [type(cell(v)) for v in values[2:4]] == [int, bool]
    when = datetime.datetime(2026, 1, 2, 3, 4, 5)
    assert [cell(when), cell(when.date()), cell(decimal.Decimal("0.1000")), cell(memoryview(b"ab"))] == [
        "2026-01-02T03:04:05",
        "2026-01-02",
        "0.1000",
        "ab",
    ]
    assert cell([np.float64("inf"), {"k": b"\xff"}], nested=False) == '[null, {"k": "\\\\xff"}]'


NON_FINITE = {"loss": math.nan, "kl": math.inf, "neg": -math.inf, "big": 1e300, "tiny": 5e-324}


def test_nan_and_inf(backend, tracker_dirs):
    info = make_info(tracker_dirs)
    sink = open_sink(backend, info)
    sink.write_metrics([metrics(1, 0, NON_FINITE), metrics(2, 1, {"loss": 0.5})])
    cells = {"reward": [math.nan, math.inf, -math.inf, 0.25]}
    sink.write_table(table(3, 1, "completions", cells))
    # A sink that hands its tracker rows of plain values converts every cell the one way of rllog_backends/_cells.py
    # (docs/sink-protocol.md, "Table cells"); the reader's TABLE_CELLS says whether lists and dicts stay nested.
    cell_kind = hook(backend, "TABLE_CELLS")
    if cell_kind is not None:
        sink.write_table(table(4, 1, "cells", POLICY_COLUMNS))
    sink.close("finished")

    back = read_back(backend, tracker_dirs, info)
    for key, v in NON_FINITE.items():
        expected = expected_series(backend, [(0, v)] + ([(1, 0.5)] if key == "loss" else []))
        assert same(back.metrics[key], expected), (key, back.metrics[key], expected)
    assert same(back.tables["completions"], [(1, expected_rows(backend, cells))])
    if cell_kind is not None:
        assert back.tables["cells"] == [(1, POLICY_ROWS[cell_kind])]


def test_a_retried_call_is_not_duplicated(backend, tracker_dirs, monkeypatch):
    break_next_write = hook(backend, "break_next_write")
    if break_next_write is None:
        pytest.skip(f"readers/{backend}.py has no break_next_write")
    info = make_info(tracker_dirs)
    sink = open_sink(backend, info)
    sink.write_metrics([metrics(1, 0, {"reward": 0.0})])
    sink.flush()
    batch = Batch(metrics(s + 1, s, {"reward": s / 4, "kl": s / 100}) for s in range(1, 6))
    break_next_write(monkeypatch, sink)
    # the delivery layer repeats the call with what the sink had not taken (rllog.sink.took)
    errors = deliver(lambda: sink.write_metrics(batch), on_retry=batch.drop_taken) + deliver(sink.flush)
    assert len(errors) == 1, errors  # the fault fired once, as a retry error
    sink.write_metrics([metrics(7, 6, {"reward": 1.5})])
    sink.close("finished")

    back = read_back(backend, tracker_dirs, info)
    assert back.metrics["reward"] == expected_series(backend, [(s, s / 4) for s in range(7)])
    assert back.metrics["kl"] == expected_series(backend, [(s, s / 100) for s in range(1, 6)])


def test_a_table_column_that_appears_at_a_later_step(backend, tracker_dirs):
    info = make_info(tracker_dirs)
    sink = open_sink(backend, info)
    first = {"prompt": ["2+2?", "3*3?"], "completion": ["4", "9"], "reward": [1.0, 0.5]}
    later = {"prompt": ["1+1?"], "completion": ["2"], "reward": [0.25], "advantage": [-0.5], "tokens": [7]}
    sink.write_metrics([metrics(1, 0, {"reward": 0.75})])
    sink.write_table(table(2, 0, "completions", first))
    sink.write_table(table(3, 20, "completions", later))
    sink.write_table(table(4, 20, "eval/samples", {"text": ["x"]}))
    sink.close("finished")

    back = read_back(backend, tracker_dirs, info)
    [(step0, rows0), (step20, rows20)] = back.tables["completions"]
    assert (step0, step20) == (0, 20)
    assert [{k: row.get(k) for k in first} for row in rows0] == expected_rows(backend, first)
    assert rows20 == expected_rows(backend, later)  # the new columns arrive with their values
    assert "advantage" not in rows0[0] or rows0[0]["advantage"] in (None, "")  # not invented for the older rows
    assert [s for s, _ in back.tables["eval/samples"]] == [20]
    assert back.metrics == {"reward": expected_series(backend, [(0, 0.75)])}  # tables are not metrics


def test_alerts(backend, tracker_dirs):
    info = make_info(tracker_dirs)
    sink = open_sink(backend, info)
    if not sink.capabilities.alerts:
        sink.close("finished")
        pytest.skip(f"{backend} takes no alerts (capabilities.alerts is False)")
    sink.write_metrics([metrics(1, 2, {"entropy": 0.05})])
    sink.write_alert(AlertRecord(2, 2, T0 + 2, "entropy_collapse", "entropy", 0.05, "entropy fell below 0.1", "error"))
    sink.write_alert(AlertRecord(3, 3, T0 + 3, "ratio_far_from_one", "val/ratio", 1.6, "val/ratio is 1.6", "warning"))
    sink.close("finished")

    alerts = read_back(backend, tracker_dirs, info).alerts
    level = hook(backend, "alert_level")
    got = [(a["title"], a["text"], a["level"]) for a in alerts]
    assert len(got) == 2, got
    sent = [
        ("entropy_collapse", "entropy", "entropy fell below 0.1", "error"),
        ("ratio_far_from_one", "val/ratio", "val/ratio is 1.6", "warning"),
    ]
    for (title, text, stored_level), (rule, metric, message, lvl) in zip(got, sent, strict=True):
        assert rule in title and metric in title and message in text and stored_level == level(lvl)


def test_steps_going_backwards_are_stored_in_order(backend, tracker_dirs):
    info = make_info(tracker_dirs)
    sink = open_sink(backend, info)
    steps = [*range(10), 3, 10, 3]  # back to 3, forward, back again: a resumed run, a late evaluation
    sink.write_metrics([metrics(i + 1, s, {"reward": s + i / 100}) for i, s in enumerate(steps[:6])])
    sink.write_metrics([metrics(i + 1, s, {"reward": s + i / 100}) for i, s in enumerate(steps[6:], start=6)])
    sink.write_table(table(20, 9, "completions", {"c": ["late"]}))
    sink.write_table(table(21, 2, "completions", {"c": ["earlier step"]}))
    sink.close("finished")

    back = read_back(backend, tracker_dirs, info)
    assert back.metrics["reward"] == expected_series(backend, [(s, s + i / 100) for i, s in enumerate(steps)])
    assert [s for s, _ in back.tables["completions"]] == [9, 2]


@pytest.mark.parametrize("status", ["finished", "failed", "killed"])
def test_close_status(backend, tracker_dirs, status):
    info = make_info(tracker_dirs, run_id=f"status-{status}")
    sink = open_sink(backend, info)
    sink.write_metrics([metrics(1, 0, {"reward": 1.0})])
    sink.close(status)
    sink.close(status)  # a second close is harmless
    assert read_back(backend, tracker_dirs, info).status == status


def test_config(backend, tracker_dirs):
    config = {**CONFIG, "seed": 42, "optim/betas": "(0.9, 0.999)", "long": "x" * 500}
    info = make_info(tracker_dirs, config=config)
    sink = open_sink(backend, info)
    sink.write_metrics([metrics(1, 0, {"reward": 1.0})])
    sink.close("finished")
    back = read_back(backend, tracker_dirs, info)
    config_value = hook(backend, "config_value")
    assert {k: back.config.get(k) for k in config} == {k: config_value(v) for k, v in config.items()}


# -- a real full disk --------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB tmpfs (the trackers' own files need more room than conftest's 4 MiB one), unmounted after."""
    with tmpfs(tmp_path / "disk", "size=16m") as disk:
        yield disk


def on_disk(monkeypatch, disk: Path) -> dict:
    """Every tracker's storage moved onto ``disk``; the ``tracker_dirs``-style dict for it."""
    env = {
        name: str(disk / name.lower())
        for name in ("WANDB_DIR", "TRACKIO_DIR", "COMET_OFFLINE_DIRECTORY", "TENSORBOARD_LOGGING_DIR", "MLFLOW_ARTIFACT_ROOT")
    }
    for name, path in env.items():
        os.makedirs(path)
        monkeypatch.setenv(name, path)
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{disk / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env["MLFLOW_TRACKING_URI"])
    return env | {"tmp": str(disk)}


def test_a_full_disk_is_retried_until_there_is_room(backend, monkeypatch, small_disk):
    reason = hook(backend, "DISK_FULL_SKIP")
    if reason:
        pytest.skip(reason)
    env = on_disk(monkeypatch, small_disk)
    hook(backend, "prepare")(monkeypatch, env)
    info = make_info(env)
    sink = open_sink(backend, info)
    first = [metrics(s + 1, s, {f"m/{k}": s + k / 64 for k in range(64)}) for s in range(5)]
    sink.write_metrics(first)
    sink.flush()
    filler = fill(small_disk)
    later = [metrics(s + 1, s, {f"m/{k}": s + k / 64 for k in range(64)}) for s in range(5, 205)]

    def free() -> None:
        filler.unlink(missing_ok=True)

    errors = deliver(lambda: sink.write_metrics(later), on_retry=free)
    errors += deliver(sink.flush, on_retry=free)
    errors += deliver(lambda: sink.close("finished"), on_retry=free)
    assert errors and not filler.exists(), "nothing failed while the disk was full"
    assert all("disk full" in str(e) for e in errors), errors

    back = read_back(backend, env, info)
    for k in (0, 63):
        assert back.metrics[f"m/{k}"] == expected_series(backend, [(s, s + k / 64) for s in range(205)])
    assert back.status == "finished"
