"""TrackioSink against the real ``trackio`` package, offline: written through trackio's own storage
layer, read back from its project SQLite database (with plain SQLite and with trackio's own readers)."""

from __future__ import annotations

import datetime as dt
import json
import math
import sqlite3
from functools import partial

import pyarrow as pa
import pytest
from readers.trackio import db_path, pin_trackio_dir, read_back
from sinks import backend_run_info

from rllog import registry
from rllog.errors import TransientError
from rllog.records import AlertRecord, MetricsRecord, TableRecord
from rllog.rundir import tracker_location
from rllog_backends.trackio import TrackioSink

pytest.importorskip("trackio")

KEYS = [
    "reward",
    "reward_std",
    "rewards/accuracy/mean",
    "rewards/accuracy/std",
    "completions/mean_length",
    "completions/clipped_ratio",
    "clip_ratio/low_mean",
    "clip_ratio/high_max",
    "entropy",
    "loss",
    "num_tokens",
]
T0 = 1_700_000_000.25
CONFIG = {
    "learning_rate": 1e-6,
    "per_device_train_batch_size": 4,
    "use_vllm": False,
    "hub_token": "<redacted>",
    "seed": None,
    "_n_gpu": 1,
    "model/name": "Qwen|0.5B",
}


@pytest.fixture(autouse=True)
def trackio_dir(tracker_dirs, monkeypatch):
    pin_trackio_dir(monkeypatch, tracker_dirs["TRACKIO_DIR"])
    monkeypatch.delenv("TRACKIO_STORAGE_MODE", raising=False)


run_info = partial(backend_run_info, config=CONFIG)


def value(step: int, key: str) -> float:
    return 0.1 * step + KEYS.index(key) / 7 + 1e-9 * step


def records(steps, seq0=1, keys=KEYS):
    return [MetricsRecord(seq0 + i, s, T0 + seq0 + i, {k: value(s, k) for k in keys}) for i, s in enumerate(steps)]


def sql(env, query, *args):
    conn = sqlite3.connect(db_path(env, "grpo-math"))
    try:
        return conn.execute(query, args).fetchall()
    finally:
        conn.close()


def test_metrics_backwards_step_config_status_round_trip(tracker_dirs, tmp_path):
    from trackio.sqlite_storage import SQLiteStorage

    info = run_info(tmp_path)
    sink = TrackioSink()
    sink.open(info)
    steps = [*range(50), 10]  # the last record goes back
    sink.write_metrics(records(steps))
    sink.flush()
    sink.close("finished")

    back = read_back(tracker_dirs, info)
    assert set(back.metrics) == set(KEYS)
    for key in KEYS:  # exact: trackio stores float64 JSON
        assert back.metrics[key] == [(s, value(s, key)) for s in steps]
    assert back.config == {**{k: v for k, v in CONFIG.items() if k != "_n_gpu"}, "config/_n_gpu": 1}
    assert back.status == "finished"

    # Row timestamps are the records' times, not the time trackio wrote them.
    stamps = [r[0] for r in sql(tracker_dirs, "SELECT timestamp FROM metrics WHERE run_id = 'r0001' ORDER BY id")]
    assert stamps[:2] == [
        dt.datetime.fromtimestamp(T0 + 1, dt.timezone.utc).isoformat(),
        dt.datetime.fromtimestamp(T0 + 2, dt.timezone.utc).isoformat(),
    ]

    # trackio's own readers (what its dashboard uses) see the same run.
    assert [r["id"] for r in SQLiteStorage.get_run_records("grpo-math")] == ["r0001"]
    logs = SQLiteStorage.get_logs("grpo-math", run_id="r0001")
    assert [(row["step"], row["reward"]) for row in logs] == [(s, value(s, "reward")) for s in steps]
    assert SQLiteStorage.get_run_config("grpo-math", run_id="r0001")["hub_token"] == "<redacted>"
    assert [(a["title"], a["level"], a["step"]) for a in SQLiteStorage.get_alerts("grpo-math", run_id="r0001")] == [
        ("run finished", "info", 49)
    ]
    # what finish and `rllog show` print: the project and the SQLite file holding it (read above)
    db = SQLiteStorage.get_project_db_path("grpo-math")
    assert db.is_file() and tracker_location(info.run_dir, "trackio") == f"db={db} project=grpo-math"


def test_rows_are_held_until_flush_then_committed_in_one_call(tracker_dirs, tmp_path, monkeypatch):
    from trackio.sqlite_storage import SQLiteStorage

    calls = []
    real = SQLiteStorage.bulk_log
    monkeypatch.setattr(SQLiteStorage, "bulk_log", staticmethod(lambda **kw: calls.append(len(kw["metrics_list"])) or real(**kw)))
    info = run_info(tmp_path)
    sink = TrackioSink()
    sink.open(info)
    sink.write_metrics(records(range(3)))
    sink.write_table(TableRecord(9, 2, T0, "completions", pa.table({"prompt": ["p"]})))
    sink.write_metrics(records(range(3, 5), seq0=10))
    assert calls == []  # capabilities.durable_writes is False: the delivery layer acknowledges after flush
    sink.flush()
    assert calls == [6]  # metrics, table and metrics: one transaction
    # No close: another connection already sees the committed rows.
    assert [r[0] for r in sql(tracker_dirs, "SELECT step FROM metrics WHERE run_id = 'r0001' ORDER BY id")] == [0, 1, 2, 2, 3, 4]
    sink.close("finished")
    assert calls == [6]  # nothing left to write


def test_nan_and_inf_as_trackio_stores_them(tracker_dirs, tmp_path):
    """Read back through the reader: the contract suite. Here: the JSON trackio writes, and its own reader."""
    from trackio.sqlite_storage import SQLiteStorage

    info = run_info(tmp_path)
    sink = TrackioSink()
    sink.open(info)
    sink.write_metrics([MetricsRecord(1, 0, T0, {"loss": math.nan, "kl": math.inf, "neg": -math.inf, "big": 1e300})])
    sink.close("finished")
    raw = json.loads(sql(tracker_dirs, "SELECT metrics FROM metrics")[0][0])
    assert raw == {"loss": "NaN", "kl": "Infinity", "neg": "-Infinity", "big": 1e300}
    logs = SQLiteStorage.get_logs("grpo-math", run_id="r0001")
    assert math.isnan(logs[0]["loss"]) and logs[0]["kl"] == math.inf


def test_tables_are_trackio_tables(tracker_dirs, tmp_path):
    """A column that appears later: the contract suite. Here: the stored form, and cells trackio needs converted."""
    info = run_info(tmp_path)
    sink = TrackioSink()
    sink.open(info)
    first = pa.table({"prompt": ["a | b", "<think>x</think>\nline"], "reward": [0.5, None]})
    second = pa.table(
        {
            "prompt": ["p"],
            "completion": ["c"],
            "reward": [1.0],
            "tokens": [[1, 2]],
            "raw": [b"bytes"],
            "when": [dt.datetime(2024, 1, 2, 3, 4, 5)],
        }
    )
    sink.write_table(TableRecord(1, 0, T0, "completions", first))
    sink.write_metrics(records([5], seq0=2))
    sink.write_table(TableRecord(3, 20, T0 + 2, "completions", second))
    sink.close("finished")

    back = read_back(tracker_dirs, info)
    assert back.tables["completions"] == [
        (0, first.to_pylist()),
        (
            20,
            [{"prompt": "p", "completion": "c", "reward": 1.0, "tokens": [1, 2], "raw": "bytes", "when": "2024-01-02T03:04:05"}],
        ),
    ]
    stored = json.loads(sql(tracker_dirs, "SELECT metrics FROM metrics WHERE step = 0")[0][0])
    assert stored == {"completions": {"_type": "trackio.table", "_value": first.to_pylist()}}
    assert "completions" not in back.metrics and back.metrics["reward"] == [(5, value(5, "reward"))]


def test_retried_and_replayed_batches_are_not_duplicated(tracker_dirs, tmp_path):
    info = run_info(tmp_path)
    sink = TrackioSink()
    sink.open(info)
    batch = records(range(5))
    sink.write_metrics(batch)
    sink.write_metrics(batch)  # the same batch again (a retry after a lost acknowledgement)
    sink.close("killed")
    sink = TrackioSink()  # a replay opens the same run and delivers from an older cursor
    sink.open(info)
    sink.write_metrics(records(range(3, 8), seq0=4))
    sink.close("finished")

    back = read_back(tracker_dirs, info)
    assert [s for s, _ in back.metrics["reward"]] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert back.status == "finished"
    assert sql(tracker_dirs, "SELECT COUNT(DISTINCT run_id), COUNT(*) FROM configs") == [(1, 1)]


def test_reopen_resumes_the_same_run_and_keeps_its_creation_time(tracker_dirs, tmp_path):
    info = run_info(tmp_path)
    created = []
    for steps, seq0 in ((range(0, 5), 1), (range(5, 10), 6)):
        sink = TrackioSink()
        sink.open(info)
        sink.write_metrics(records(steps, seq0=seq0))
        sink.close("finished")
        created.append(json.loads(sql(tracker_dirs, "SELECT config FROM configs")[0][0])["_Created"])
    assert created[0] == created[1]
    assert [s for s, _ in read_back(tracker_dirs, info).metrics["loss"]] == list(range(10))
    assert sql(tracker_dirs, "SELECT DISTINCT run_id, run_name FROM metrics") == [("r0001", "grpo-run")]


def test_two_runs_with_the_same_name_stay_apart(tracker_dirs, tmp_path):
    for run_id, v in (("aaaa", 1.0), ("bbbb", 2.0)):
        sink = TrackioSink()
        sink.open(run_info(tmp_path, run_id=run_id))
        sink.write_metrics([MetricsRecord(1, 0, T0, {"reward": v})])
        sink.close("finished")
    assert read_back(tracker_dirs, run_info(tmp_path, run_id="aaaa")).metrics == {"reward": [(0, 1.0)]}
    assert read_back(tracker_dirs, run_info(tmp_path, run_id="bbbb")).metrics == {"reward": [(0, 2.0)]}


def test_reserved_names_are_prefixed_like_trackio_log(tracker_dirs, tmp_path):
    info = run_info(tmp_path)
    sink = TrackioSink()
    sink.open(info)
    sink.write_metrics([MetricsRecord(1, 7, T0, {"step": 7.0, "time": 1.5, "__x": 2.0, "ok": 3.0})])
    sink.close("finished")
    assert read_back(tracker_dirs, info).metrics == {
        "__step": [(7, 7.0)],
        "__time": [(7, 1.5)],
        "____x": [(7, 2.0)],
        "ok": [(7, 3.0)],
    }


def test_busy_database_is_transient_and_other_errors_propagate(tracker_dirs, tmp_path, monkeypatch):
    from trackio.sqlite_storage import SQLiteStorage

    info = run_info(tmp_path)
    sink = TrackioSink()
    sink.open(info)
    real = SQLiteStorage.bulk_log
    failures = [
        sqlite3.OperationalError("database is locked"),
        OSError("Could not acquire database lock after 10 seconds"),
        sqlite3.OperationalError("no such column: metrics"),
    ]

    def flaky(*args, **kwargs):  # fault injection; the real write runs once the faults are used up
        if failures:
            raise failures.pop(0)
        return real(*args, **kwargs)

    monkeypatch.setattr(SQLiteStorage, "bulk_log", staticmethod(flaky))
    sink.write_metrics(records(range(2)))  # held: the storage call is made by flush
    with pytest.raises(TransientError):
        sink.flush()
    with pytest.raises(TransientError):
        sink.flush()
    with pytest.raises(sqlite3.OperationalError):
        sink.flush()
    sink.flush()  # the retry delivers
    sink.close("finished")
    back = read_back(tracker_dirs, info)
    assert back.metrics["reward"] == [(0, value(0, "reward")), (1, value(1, "reward"))]
    assert back.config["hub_token"] == "<redacted>"  # the config went with the first successful write


def test_alerts(tracker_dirs, tmp_path):
    from trackio.sqlite_storage import SQLiteStorage

    info = run_info(tmp_path)
    sink = registry.create("trackio", {"group": "sweep-1"})
    assert isinstance(sink, TrackioSink) and sink.capabilities.alerts
    sink.open(info)
    sink.write_metrics(records(range(4)))
    collapse = AlertRecord(5, 2, 1.0, "entropy_collapse", "entropy", 0.05, "entropy fell below 0.1", "error")
    ratio = AlertRecord(6, 3, 2.0, "ratio_far_from_one", "val/ratio", 1.6, "val/ratio is 1.6", "warning")
    sink.write_alert(collapse)
    sink.write_alert(ratio)
    sink.write_alert(ratio)  # a redelivered alert is stored once (its id comes from its seq)
    sink.close("failed")
    alerts = sql(tracker_dirs, "SELECT title, text, level, step FROM alerts WHERE run_id = 'r0001' ORDER BY id")
    assert alerts == [
        ("entropy_collapse: entropy", "entropy fell below 0.1", "error", 2),
        ("ratio_far_from_one: val/ratio", "val/ratio is 1.6", "warn", 3),
        ("run failed", "rllog closed this run with status 'failed'.", "error", 3),
    ]
    assert read_back(tracker_dirs, info).status == "failed"
    assert len(SQLiteStorage.get_alerts("grpo-math", run_id="r0001")) == 3
    assert json.loads(sql(tracker_dirs, "SELECT config FROM configs")[0][0])["_Group"] == "sweep-1"


def test_jsonl_mode_writes_fragments_that_trackio_imports(tracker_dirs, tmp_path, monkeypatch):
    from trackio import fragments

    monkeypatch.setenv("TRACKIO_STORAGE_MODE", "jsonl")  # what trackio picks on a network filesystem
    info = run_info(tmp_path)
    sink = TrackioSink()
    sink.open(info)
    sink.write_metrics(records([0, 1, 2, 1]))
    sink.write_table(TableRecord(5, 2, T0 + 5, "completions", pa.table({"a": [1]})))
    sink.close("finished")
    assert not db_path(tracker_dirs, "grpo-math").exists() or sql(tracker_dirs, "SELECT COUNT(*) FROM metrics") == [(0,)]
    pending = read_back(tracker_dirs, info)  # read from the fragments
    assert pending.metrics["loss"] == [(s, value(s, "loss")) for s in [0, 1, 2, 1]] and pending.status == "finished"

    assert fragments.import_inbox_dir() == 6  # what trackio's dashboard does
    imported = read_back(tracker_dirs, info)
    assert imported == pending
    assert imported.tables == {"completions": [(2, [{"a": 1}])]} and imported.config["learning_rate"] == 1e-6


def test_config_after_open_is_stored_at_flush_and_trackios_monitors_stay_off(tracker_dirs, tmp_path):
    """``Run.update_config``: merged into the run's config row at the next flush (trackio stores config
    with a metrics row: an empty one, written once however often the call is repeated). trackio's CPU/GPU
    monitors never start (they would measure the delivery process)."""
    from rllog.records import ConfigRecord

    info = run_info(tmp_path, config={"learning_rate": 1e-6, "_n_gpu": 1})
    sink = TrackioSink()
    sink.open(info)
    assert (sink._run._cpu_monitor, sink._run._gpu_monitor) == (None, None)
    sink.write_metrics(records([0], keys=["reward"]))
    update = ConfigRecord(2, 0, T0 + 2, {"learning_rate": 5e-7, "num_generations": 8, "_name_or_path": "tiny"})
    sink.write_config(update)
    sink.write_config(update)  # the delivery layer's retry
    sink.flush()
    [(config,)] = sql(tracker_dirs, "SELECT config FROM configs WHERE run_id = ?", "r0001")
    stored = {k: v for k, v in json.loads(config).items() if not k.startswith("_")}
    assert stored == {"learning_rate": 5e-7, "config/_n_gpu": 1, "num_generations": 8, "config/_name_or_path": "tiny"}
    rows = sql(tracker_dirs, "SELECT step, metrics FROM metrics WHERE run_id = ? ORDER BY id", "r0001")
    assert [(step, json.loads(metrics)) for step, metrics in rows[1:]] == [(0, {})]
    sink.close("finished")
    assert sql(tracker_dirs, "SELECT count(*) FROM system_metrics") == [(0,)]
