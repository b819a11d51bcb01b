"""TensorBoardSink against the real ``tensorboard`` package: written with its event-file writer, read
back with its own ``EventAccumulator`` (and its own Markdown renderer for the tables)."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from functools import partial

import numpy as np
import pyarrow as pa
import pytest
from readers.tensorboard import logdir_for, read_back
from sinks import backend_run_info

from rllog import registry
from rllog.records import MetricsRecord, TableRecord
from rllog_backends.tensorboard import OUT_OF_ORDER, TensorBoardSink, format_cell, parse_markdown_table

pytest.importorskip("tensorboard")

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
T0 = 1_700_000_000.0


def f32(x: float) -> float:
    return float(np.float32(x))


run_info = partial(
    backend_run_info,
    config={
        "learning_rate": 1e-6,
        "per_device_train_batch_size": 4,
        "use_vllm": False,
        "hub_token": "<redacted>",
        "seed": None,
    },
)


def value(step: int, key: str) -> float:
    return 0.1 * step + KEYS.index(key) / 7 + 1e-9 * step


def records(steps, seq0=1, keys=KEYS):
    return [MetricsRecord(seq0 + i, s, T0 + seq0 + i, {k: value(s, k) for k in keys}) for i, s in enumerate(steps)]


def accumulator(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(path, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_metrics_config_status_round_trip(tracker_dirs, tmp_path):
    info = run_info(tmp_path)
    sink = TensorBoardSink()
    sink.open(info)
    sink.write_metrics(records(range(50)))
    sink.flush()
    sink.close("finished")

    assert logdir_for(tracker_dirs, info) == os.path.join(tracker_dirs["TENSORBOARD_LOGGING_DIR"], "grpo-run")
    back = read_back(tracker_dirs, info)
    assert set(back.metrics) == set(KEYS)
    for key in KEYS:  # TensorBoard keeps float32
        assert back.metrics[key] == [(s, f32(value(s, key))) for s in range(50)]
    wall = [e.wall_time for e in accumulator(logdir_for(tracker_dirs, info)).Scalars("reward")]
    assert wall == [T0 + 1 + i for i in range(50)]
    assert back.config == {
        "learning_rate": 1e-6,
        "per_device_train_batch_size": 4.0,
        "use_vllm": False,
        "hub_token": "<redacted>",
        "seed": "None",
    }
    assert back.status == "finished"


def test_backwards_step_goes_to_an_out_of_order_layer_and_nothing_is_hidden(tracker_dirs, tmp_path):
    info = run_info(tmp_path)
    sink = TensorBoardSink()
    sink.open(info)
    sink.write_metrics(records(range(50)))
    sink.write_metrics(records([10], seq0=51, keys=["reward", "loss"]))  # goes back
    sink.write_metrics(records([5], seq0=52, keys=["reward"]))  # further back than the layer
    sink.write_metrics(records([50], seq0=53, keys=["reward", "entropy"]))  # forward again: main run
    sink.close("finished")

    logdir = logdir_for(tracker_dirs, info)
    main, layer1, layer2 = (
        accumulator(p) for p in (logdir, os.path.join(logdir, OUT_OF_ORDER), os.path.join(logdir, OUT_OF_ORDER + "_2"))
    )
    # Every TensorBoard run keeps strictly increasing steps per tag, so TensorBoard's data server
    # (which drops earlier points at steps >= a lower new step) hides nothing.
    assert [e.step for e in main.Scalars("reward")] == list(range(51))
    assert [e.step for e in layer1.Scalars("reward")] == [10]
    assert [e.step for e in layer1.Scalars("loss")] == [10]
    assert [e.step for e in layer2.Scalars("reward")] == [5]
    assert "entropy" not in layer1.Tags()["scalars"]

    back = read_back(tracker_dirs, info)
    assert back.metrics["reward"] == [(s, f32(value(s, "reward"))) for s in [*range(50), 10, 5, 50]]
    assert back.metrics["loss"] == [(s, f32(value(s, "loss"))) for s in [*range(50), 10]]


def test_a_repeated_step_stays_in_the_run(tracker_dirs, tmp_path):
    info = run_info(tmp_path)
    sink = TensorBoardSink()
    sink.open(info)
    sink.write_metrics([MetricsRecord(1, 3, T0, {"epoch": 1.0}), MetricsRecord(2, 3, T0 + 1, {"epoch": 1.0, "eval/loss": 0.5})])
    sink.close("finished")
    assert not os.path.exists(os.path.join(logdir_for(tracker_dirs, info), OUT_OF_ORDER))
    assert read_back(tracker_dirs, info).metrics["epoch"] == [(3, 1.0), (3, 1.0)]


NASTY = [
    "a | b",
    "line1\nline2\r\nline3",
    "<think>x</think> & **bold** _it_ `code` [l](u)",
    "back\\slash \\| pipe",
    "  leading and trailing  ",
    "",
    "ünï©ødé …",
    "trailing newline\n",
]


def test_tables_round_trip_with_new_columns_and_escaping(tracker_dirs, tmp_path):
    info = run_info(tmp_path)
    sink = TensorBoardSink()
    sink.open(info)
    first = pa.table({"prompt": NASTY, "reward": [0.5, None, 1.0, -2.25, 1e-9, math.nan, 3.0, 0.0]})
    second = pa.table({"prompt": ["p"], "completion": ["c"], "reward": [1.0], "ok": [True], "tokens": [[1, 2]]})
    sink.write_table(TableRecord(1, 0, T0, "completions", first))
    sink.write_table(TableRecord(2, 20, T0 + 1, "completions", second))
    sink.close("finished")

    back = read_back(tracker_dirs, info)
    expect = lambda t: [{k: format_cell(v) for k, v in row.items()} for row in t.to_pylist()]  # noqa: E731
    assert back.tables["completions"] == [(0, expect(first)), (20, expect(second))]
    assert back.tables["completions"][1][1] == [
        {"prompt": "p", "completion": "c", "reward": "1.0", "ok": "True", "tokens": "[1, 2]"}
    ]
    assert back.tables["completions"][0][1][1] == {"prompt": "line1\nline2\r\nline3", "reward": ""}

    # What the TensorBoard text dashboard shows: one HTML table, 3 header + 8 rows, tags escaped.
    from tensorboard import plugin_util

    acc = accumulator(logdir_for(tracker_dirs, info))
    markdown = acc.Tensors("completions/text_summary")[0].tensor_proto.string_val[0].decode()
    rendered = plugin_util.markdown_to_safe_html(markdown)
    assert rendered.count("<tr>") == 9 and rendered.count("<td>") == 16
    assert "&lt;think&gt;x&lt;/think&gt;" in rendered and "<br>" in rendered and "<em>" not in rendered


def test_long_cells_are_shortened_with_a_note(tracker_dirs, tmp_path):
    info = run_info(tmp_path)
    sink = TensorBoardSink(max_cell_chars=50)
    sink.open(info)
    sink.write_table(TableRecord(1, 3, T0, "completions", pa.table({"completion": ["x" * 60, "short", "y" * 51]})))
    sink.close("finished")
    rows = read_back(tracker_dirs, info).tables["completions"][0][1]
    assert rows == [{"completion": "x" * 50 + "\u2026"}, {"completion": "short"}, {"completion": "y" * 50 + "\u2026"}]
    markdown = (
        accumulator(logdir_for(tracker_dirs, info)).Tensors("completions/text_summary")[0].tensor_proto.string_val[0].decode()
    )
    assert markdown.endswith("_2 cells shortened to 50 characters (ending in \u2026)._")


def test_table_named_config_does_not_clash_and_late_table_goes_to_layer(tracker_dirs, tmp_path):
    info = run_info(tmp_path)
    sink = TensorBoardSink()
    sink.open(info)
    sink.write_table(TableRecord(1, 5, T0, "config", pa.table({"a": [1]})))
    sink.write_table(TableRecord(2, 5, T0 + 1, "samples", pa.table({"a": [2]})))
    sink.write_table(TableRecord(3, 2, T0 + 2, "samples", pa.table({"a": [3]})))
    sink.close("killed")
    back = read_back(tracker_dirs, info)
    assert back.tables == {"config": [(5, [{"a": "1"}])], "samples": [(5, [{"a": "2"}]), (2, [{"a": "3"}])]}
    assert back.config["learning_rate"] == 1e-6  # the run's config is still the run's config
    assert back.status == "killed"
    layer = accumulator(os.path.join(logdir_for(tracker_dirs, info), OUT_OF_ORDER))
    assert [e.step for e in layer.Tensors("samples/text_summary")] == [2]


def test_failed_status_reaches_hparams_session(tracker_dirs, tmp_path):
    from tensorboard.plugins.hparams import api_pb2, metadata

    info = run_info(tmp_path)
    sink = TensorBoardSink()
    sink.open(info)
    sink.write_metrics(records(range(3)))
    sink.close("failed")
    acc = accumulator(logdir_for(tracker_dirs, info))
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    assert metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG]).status == api_pb2.STATUS_FAILURE
    assert metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG]).group_name == "r0001"
    assert read_back(tracker_dirs, info).status == "failed"


def test_without_hparams_config_is_read_from_markdown(tracker_dirs, tmp_path):
    info = run_info(tmp_path, config={"model": "Qwen|0.5B", "lr": 0.1})
    sink = TensorBoardSink(hparams=False)
    sink.open(info)
    sink.close("finished")
    assert read_back(tracker_dirs, info).config == {"model": "Qwen|0.5B", "lr": "0.1"}


def test_events_are_in_the_file_when_write_returns(tracker_dirs, tmp_path):
    info = run_info(tmp_path)
    sink = TensorBoardSink()
    sink.open(info)
    assert read_back(tracker_dirs, info).config["hub_token"] == "<redacted>"  # the run shows at once
    sink.write_metrics(records(range(5)))
    assert [s for s, _ in read_back(tracker_dirs, info).metrics["reward"]] == [0, 1, 2, 3, 4]
    sink.write_table(TableRecord(6, 4, T0, "completions", pa.table({"a": ["x"]})))
    assert read_back(tracker_dirs, info).tables == {"completions": [(4, [{"a": "x"}])]}
    sink.close("finished")


def test_reopen_appends_a_new_file(tracker_dirs, tmp_path):
    """A reopen continues the run: the contract suite. Here: it adds an event file, never rewrites one."""
    info = run_info(tmp_path)
    for steps, seq0, status in ((range(0, 10), 1, "killed"), (range(10, 20), 11, "finished")):
        sink = TensorBoardSink()
        sink.open(info)
        sink.write_metrics(records(steps, seq0=seq0))
        sink.close(status)
    back = read_back(tracker_dirs, info)
    assert [s for s, _ in back.metrics["loss"]] == list(range(20))
    assert back.status == "finished"
    assert len([f for f in os.listdir(logdir_for(tracker_dirs, info)) if f.startswith("events.out.tfevents")]) == 2


def test_a_step_that_goes_back_across_a_reopen_still_goes_to_a_layer(tracker_dirs, tmp_path):
    info = run_info(tmp_path)
    sink = TensorBoardSink()
    sink.open(info)
    sink.write_metrics(records(range(50)))
    sink.write_metrics(records([20], seq0=51, keys=["reward"]))  # layer 1 now holds reward@20
    sink.close("killed")
    sink = TensorBoardSink()  # e.g. `rllog replay` in another process
    sink.open(info)
    sink.write_metrics(records([10], seq0=52, keys=["reward", "loss"]))
    sink.write_metrics(records([50], seq0=53, keys=["reward"]))
    sink.close("finished")
    logdir = logdir_for(tracker_dirs, info)
    assert [e.step for e in accumulator(logdir).Scalars("reward")] == [*range(50), 50]
    assert [e.step for e in accumulator(os.path.join(logdir, OUT_OF_ORDER)).Scalars("reward")] == [20]
    assert [e.step for e in accumulator(os.path.join(logdir, OUT_OF_ORDER)).Scalars("loss")] == [10]
    assert [e.step for e in accumulator(os.path.join(logdir, OUT_OF_ORDER + "_2")).Scalars("reward")] == [10]
    assert [s for s, _ in read_back(tracker_dirs, info).metrics["reward"]] == [*range(50), 20, 10, 50]


def test_logdir_defaults_and_option(tracker_dirs, tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR")
    info = run_info(tmp_path)
    sink = TensorBoardSink()
    sink.open(info)
    sink.close("finished")
    assert sink.logdir == os.path.join(info.run_dir, "tensorboard")
    assert read_back({}, info).status == "finished"

    explicit = str(tmp_path / "explicit")
    sink = registry.create("tb", {"logdir": explicit, "max_cell_chars": None})
    assert isinstance(sink, TensorBoardSink)
    sink.open(info)
    sink.write_metrics(records([0]))
    sink.close("finished")
    assert read_back({}, info, logdir=explicit).metrics["reward"] == [(0, f32(value(0, "reward")))]


def test_torch_and_tensorflow_are_never_imported(tmp_path):
    """Importing the backend imports no tensorboard: the contract suite. Here: writing imports no torch/TF either."""
    code = (
        "import sys, time\n"
        "import rllog, rllog_backends.tensorboard as tb\n"
        "assert 'tensorboard' not in sys.modules, 'imported at module level'\n"
        "from rllog.records import RunInfo, MetricsRecord\n"
        f"s = tb.TensorBoardSink(logdir={str(tmp_path / 'lazy')!r})\n"
        f"s.open(RunInfo('p', 'n', {str(tmp_path)!r}, 'id', {{'a': 1}}))\n"
        "s.write_metrics([MetricsRecord(1, 0, time.time(), {'x': 1.0})]); s.close('finished')\n"
        "assert 'torch' not in sys.modules and 'tensorflow' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_write_that_fails_half_way_is_cut_back(tracker_dirs, tmp_path, monkeypatch):
    """The repeated call lands once: the contract suite. Here: the file itself never keeps a broken record,
    and an open that failed leaves no empty event file behind."""
    from readers.tensorboard import break_next_write

    from rllog.errors import TransientError

    info = run_info(tmp_path)
    logdir = logdir_for(tracker_dirs, info)
    sink = TensorBoardSink()
    break_next_write(monkeypatch, sink)
    with pytest.raises(TransientError, match="disk full"):
        sink.open(info)
    assert os.listdir(logdir) == []
    monkeypatch.undo()
    sink.open(info)  # the delivery layer's retry
    sink.write_metrics(records(range(3)))
    (name,) = os.listdir(logdir)
    size = os.path.getsize(os.path.join(logdir, name))
    break_next_write(monkeypatch, sink)
    with pytest.raises(TransientError, match="disk full"):
        sink.write_metrics(records(range(3, 6), seq0=4))
    assert os.path.getsize(os.path.join(logdir, name)) == size  # cut back to the last complete call
    assert [s for s, _ in read_back(tracker_dirs, info).metrics["reward"]] == [0, 1, 2]
    sink.write_metrics(records(range(3, 6), seq0=4))
    sink.close("finished")
    assert os.listdir(logdir) == [name]
    assert [s for s, _ in read_back(tracker_dirs, info).metrics["reward"]] == list(range(6))


# -- resumed runs -------------------------------------------------------------------------------------
def legacy_and_server_accumulators(path):
    """The run loaded by both of TensorBoard's Python loaders: ``event_accumulator`` (legacy, what most
    scripts use) and ``plugin_event_accumulator`` (TensorBoard's own server with ``--load_fast=false``)."""
    from tensorboard.backend.event_processing import plugin_event_accumulator

    server = plugin_event_accumulator.EventAccumulator(path, size_guidance={"tensors": 0})
    server.Reload()
    return accumulator(path), server


def server_steps(acc, tag):
    return [e.step for e in acc.Tensors(tag)] if tag in acc.Tags()["tensors"] else []


def session_logs(logdir):
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    files = sorted(f for f in os.listdir(logdir) if f.startswith("events.out.tfevents"))
    return [
        (e.step, e.session_log.status, e.session_log.msg)
        for name in files
        for e in LegacyEventFileLoader(os.path.join(logdir, name)).Load()
        if e.HasField("session_log")
    ]


def test_a_later_attempt_restarting_earlier_supersedes_with_tensorboards_restart_marker(tracker_dirs, tmp_path):
    """Attempt 1 logs steps 0-99 (and a late eval at 10) and is killed; attempt 2 resumes from the step-50
    checkpoint. Both of TensorBoard's loaders show steps 0-49 of attempt 1 and 50 on of attempt 2, no stale
    point and no stale table; a step going back within attempt 2 still goes to a layer; a reopen in the
    middle of attempt 2 (a restarted agent) does not restart it again."""
    from tensorboard.compat.proto import event_pb2

    info = run_info(tmp_path)
    sink = TensorBoardSink()
    sink.open(info)
    sink.write_metrics(records(range(100), keys=["reward", "loss"]))
    sink.write_metrics(records([10], seq0=101, keys=["entropy"]))  # an evaluation, below the restart step
    sink.write_metrics(records([5], seq0=102, keys=["reward"]))  # a late point within attempt 1: a layer
    sink.write_table(TableRecord(103, 99, T0 + 103, "samples", pa.table({"text": ["attempt 1"]})))
    sink.close("killed")

    resumed = dataclasses.replace(info, attempt_starts=(1, 104))
    sink = TensorBoardSink()
    sink.open(resumed)
    sink.write_metrics([MetricsRecord(104, 99, T0 + 104, {"system/cpu_percent": 50.0})])  # sampled before the trainer logs
    sink.write_metrics(records(range(50, 150), seq0=105, keys=["reward", "loss"]))
    sink.write_metrics(records([60], seq0=205, keys=["reward"]))  # back within attempt 2: a layer, no restart
    sink.write_table(TableRecord(206, 149, T0 + 206, "samples", pa.table({"text": ["attempt 2"]})))
    sink.close("killed")
    sink = TensorBoardSink()  # the agent restarted in the middle of attempt 2
    sink.open(resumed)
    sink.write_metrics(records([120, 150], seq0=207, keys=["reward"]))
    sink.close("finished")

    logdir = logdir_for(tracker_dirs, info)
    legacy, server = legacy_and_server_accumulators(logdir)
    expected = [*range(50), *range(50, 151)]
    assert [e.step for e in legacy.Scalars("reward")] == expected
    assert server_steps(server, "reward") == expected
    assert [e.value for e in legacy.Scalars("reward")][49:51] == [f32(value(49, "reward")), f32(value(50, "reward"))]
    assert server_steps(server, "loss") == list(range(150))
    assert server_steps(server, "samples/text_summary") == [149]  # attempt 1's table at 99 is gone
    assert server_steps(server, "entropy") == [10]  # below the restart step: kept
    assert server_steps(server, "system/cpu_percent") == []  # at 99, after the restart step: gone too
    layer_legacy, layer_server = legacy_and_server_accumulators(os.path.join(logdir, OUT_OF_ORDER))
    assert [e.step for e in layer_legacy.Scalars("reward")] == [5, 60, 120]
    assert server_steps(layer_server, "reward") == [5, 60, 120]
    starts = [(step, msg) for step, status, msg in session_logs(logdir) if status == event_pb2.SessionLog.START]
    assert starts == [(50, "rllog: session start"), (50, "rllog attempt 2 restarts at step 50")]

    back = read_back(tracker_dirs, info)  # the contract suite's reader: TensorBoard's server loader
    assert [s for s, _ in back.metrics["reward"]] == [*range(50), 5, *range(50, 150), 60, 120, 150]
    assert back.tables["samples"] == [(149, [{"text": "attempt 2"}])]


def test_an_attempt_that_goes_on_from_where_the_last_stopped_supersedes_nothing(tracker_dirs, tmp_path):
    from tensorboard.compat.proto import event_pb2

    info = run_info(tmp_path)
    sink = TensorBoardSink()
    sink.open(info)
    sink.write_metrics(records(range(10), keys=["reward"]))
    sink.close("killed")
    sink = TensorBoardSink()
    sink.open(dataclasses.replace(info, attempt_starts=(1, 11)))
    sink.write_metrics(records(range(10, 20), seq0=11, keys=["reward"]))
    sink.write_metrics(records([4], seq0=21, keys=["reward"]))  # back within attempt 2: a layer
    sink.close("finished")

    logdir = logdir_for(tracker_dirs, info)
    assert [e.step for e in accumulator(logdir).Scalars("reward")] == list(range(20))
    assert [e.step for e in accumulator(os.path.join(logdir, OUT_OF_ORDER)).Scalars("reward")] == [4]
    assert session_logs(logdir) == [(10, event_pb2.SessionLog.STATUS_UNSPECIFIED, "rllog attempt 2 continues at step 10")]


def test_a_restart_from_step_zero_keeps_the_config_and_the_hparams(tracker_dirs, tmp_path):
    info = run_info(tmp_path)
    sink = TensorBoardSink()
    sink.open(info)
    sink.write_metrics(records(range(5), keys=["reward"]))
    sink.close("killed")
    sink = TensorBoardSink()
    sink.open(dataclasses.replace(info, attempt_starts=(1, 6)))
    sink.write_metrics(records(range(3), seq0=6, keys=["reward"]))
    sink.close("finished")

    back = read_back(tracker_dirs, info)
    assert back.metrics["reward"] == [(s, f32(value(s, "reward"))) for s in range(3)]
    assert back.config["learning_rate"] == 1e-6 and back.config["use_vllm"] is False
    _, server = legacy_and_server_accumulators(logdir_for(tracker_dirs, info))
    shown = parse_markdown_table(server.Tensors("config/text_summary")[-1].tensor_proto.string_val[0].decode())
    assert [row["key"] for row in shown] == list(info.config)


def test_config_after_open_is_a_text_at_its_step_and_fills_an_empty_hparams(tracker_dirs, tmp_path):
    from tensorboard.plugins.hparams import metadata as hp_metadata

    from rllog.records import ConfigRecord

    info = run_info(tmp_path, config={})  # accelerate / Lightning: the config arrives after the start
    sink = TensorBoardSink()
    sink.open(info)
    sink.write_config(ConfigRecord(1, 0, T0 + 1, {"learning_rate": 1e-6, "beta": 0.04}))
    sink.write_metrics(records(range(3), seq0=2, keys=["reward"]))
    sink.write_config(ConfigRecord(5, 2, T0 + 5, {"learning_rate": 5e-7}))
    sink.close("finished")

    logdir = logdir_for(tracker_dirs, info)
    _, server = legacy_and_server_accumulators(logdir)
    texts = [(e.step, parse_markdown_table(e.tensor_proto.string_val[0].decode())) for e in server.Tensors("config/text_summary")]
    assert texts[-1] == (
        2,
        [{"key": "learning_rate", "value": "5e-07", "set at step": "2"}, {"key": "beta", "value": "0.04", "set at step": "0"}],
    )
    content = server.PluginTagToContent(hp_metadata.PLUGIN_NAME)[hp_metadata.SESSION_START_INFO_TAG]
    hparams = hp_metadata.parse_session_start_info_plugin_data(content).hparams
    assert {k: v.number_value for k, v in hparams.items()} == {"learning_rate": 1e-6, "beta": 0.04}  # the first config
    assert read_back(tracker_dirs, info).config == {"learning_rate": "5e-07", "beta": "0.04"}

    sink = TensorBoardSink()  # a reopen (replay) learns the config from the files: no second config text
    sink.open(dataclasses.replace(info, config={"learning_rate": 5e-7, "beta": 0.04}))
    sink.close("finished")
    _, server = legacy_and_server_accumulators(logdir)
    assert len(server.Tensors("config/text_summary")) == len(texts)


def test_tensorboard_logging_dir_is_remembered_for_a_replay_without_it(tracker_dirs, tmp_path, monkeypatch):
    info = run_info(tmp_path)
    sink = TensorBoardSink()
    sink.open(info)
    sink.write_metrics(records(range(3), keys=["reward"]))
    sink.close("killed")
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR")  # `rllog replay` from another shell
    sink = TensorBoardSink()
    sink.open(info)
    sink.write_metrics(records(range(3, 5), seq0=4, keys=["reward"]))
    sink.close("finished")
    assert sink.logdir == os.path.join(tracker_dirs["TENSORBOARD_LOGGING_DIR"], "grpo-run")
    assert [s for s, _ in read_back(tracker_dirs, info, logdir=sink.logdir).metrics["reward"]] == list(range(5))
    assert not os.path.exists(os.path.join(info.run_dir, "tensorboard"))


def test_a_new_event_file_sorts_after_the_others(tmp_path):
    from rllog_backends.tensorboard import _new_event_file_name

    later = "events.out.tfevents.4000000000.host.1.000000"  # a clock ahead of ours, or a higher pid
    (tmp_path / later).write_bytes(b"")
    name = _new_event_file_name(str(tmp_path))
    assert name > later and name.startswith("events.out.tfevents.4000000000.")
