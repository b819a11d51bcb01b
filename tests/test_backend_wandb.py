"""The wandb backend against the real wandb library (offline), read back from wandb's own run files.

Every run here is a real ``wandb.init`` in offline mode (``WANDB_MODE=offline`` from conftest) writing
``<WANDB_DIR>/wandb/offline-run-*/run-<id>.wandb``; ``readers.wandb`` parses that file. Fakes appear
only for fault injection (exceptions carrying HTTP 429/5xx).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
from functools import partial

import pyarrow as pa
import pytest

pytest.importorskip("wandb")

from readers import wandb as reader
from sinks import backend_run_info

from rllog.errors import RateLimited, TransientError
from rllog.records import MetricsRecord, RunInfo, TableRecord
from rllog.sink import Batch
from rllog_backends.wandb import WandbSink, exit_written, map_error, wandb_run_id

GRPO_KEYS = [
    "loss",
    "grad_norm",
    "learning_rate",
    "num_tokens",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "entropy",
    "kl",
    "step_time",
    "epoch",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
    "rewards/accuracy/mean",
    "rewards/accuracy/std",
    "rewards/format/mean",
    "rewards/format/std",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "val/ratio",
    "val/entropy",
    "objective/kl",
]


info = partial(backend_run_info, project="grpo-test", name="tiny", run_id="abcd1234")


def metrics(seq, step, values):
    return MetricsRecord(seq=seq, step=step, time=1_700_000_000.0 + seq, values=values)


def table(seq, step, name, columns):
    return TableRecord(seq=seq, step=step, time=1_700_000_000.0 + seq, name=name, table=pa.table(columns))


def delivered_by_the_agent(run_info: RunInfo) -> RunInfo:
    """``run_info`` of a run whose trainer is another process (``run.json``'s pid: this test's parent), as the delivery
    agent meets it: the sink may then set process-wide state (the process is rllog's)."""
    import os

    from rllog.rundir import RunFile

    os.makedirs(run_info.run_dir, exist_ok=True)
    RunFile(run_info.project, run_info.name, run_info.run_id, pid=os.getppid()).write(run_info.run_dir)
    return run_info


def raw(env, run_info):
    """Every (kind, message) of the run's .wandb files, oldest session first."""
    return [
        rec for path in reader.run_files(env["WANDB_DIR"], wandb_run_id(run_info.run_id)) for rec in reader.iter_records(path)
    ]


def history_items(records):
    """History rows as {key: value_json} (wandb's own keys included)."""
    return [{"/".join(reader._key(i)): i.value_json for i in msg.item} for kind, msg in records if kind == "history"]


def test_grpo_metrics_arrive_exactly_at_their_steps_even_going_back(tracker_dirs, tmp_path):
    run_info = info(tmp_path)
    sink = WandbSink()
    sink.open(run_info)
    expected: dict[str, list] = {k: [] for k in GRPO_KEYS}
    batch, seq = [], 0
    for step in range(50):
        seq += 1
        values = {k: (step + 1) * 0.1 + j / 7 for j, k in enumerate(GRPO_KEYS)}
        batch.append(metrics(seq, step, values))
        for k, v in values.items():
            expected[k].append((step, v))
        if len(batch) == 16:
            sink.write_metrics(batch)
            batch = []
    sink.write_metrics(batch)
    # the step goes back: wandb would drop this row if we passed step=10 after step=49
    sink.write_metrics([metrics(51, 10, {"reward": -1.25, "kl": 0.5})])
    expected["reward"].append((10, -1.25))
    expected["kl"].append((10, 0.5))
    # one record wider than a 32 KiB block: exercises chunked (FIRST/MIDDLE/LAST) records in the log
    wide = {f"wide/metric_{i:04d}": i / 3 for i in range(3000)}
    sink.write_metrics([metrics(52, 50, wide)])
    sink.flush()
    sink.close("finished")

    back = reader.read_back(tracker_dirs, run_info)
    for key in GRPO_KEYS:
        assert back.metrics[key] == expected[key], key
    assert all(back.metrics[k] == [(50, v)] for k, v in wide.items())
    assert set(back.metrics) == set(GRPO_KEYS) | set(wide)
    assert back.status == "finished"

    records = raw(tracker_dirs, run_info)
    rows = history_items(records)
    assert len(rows) == 52  # one wandb row per record, none dropped
    assert [int(r["_step"]) for r in rows] == list(range(52))  # wandb's own step only ever grows
    assert [int(r["rllog/step"]) for r in rows] == [*range(50), 10, 50]
    step_metric = [(m.glob_name, m.step_metric) for kind, m in records if kind == "metric" and m.glob_name]
    assert step_metric == [("*", "rllog/step")]
    path = reader.run_files(tracker_dirs["WANDB_DIR"], wandb_run_id(run_info.run_id))[0]
    assert path.stat().st_size > 3 * 32 * 1024
    # close() waited for the exit record; a copy cut before it is recognised as unfinished
    data = path.read_bytes()
    assert exit_written(path)
    cut = tmp_path / "cut.wandb"
    for size in (len(data) - 3, len(data) - 40, 7, 40_000):
        cut.write_bytes(data[:size])
        assert not exit_written(cut), size


def test_records_of_one_step_share_a_row_unless_a_key_repeats(tracker_dirs, tmp_path):
    """TRL logs each profiling timing as its own record: consecutive records of a step become one history row
    (one ``run.log``), and a key seen twice in a step (TRL times ``_get_per_token_logps`` twice) starts a new
    row, so every value is kept, in order."""
    run_info = info(tmp_path)
    sink = WandbSink()
    sink.open(run_info)
    t = "profiling/Time taken: Trainer."
    sink.write_metrics(
        [
            metrics(1, 7, {t + "generate": 0.5}),
            metrics(2, 7, {t + "logps": 0.25}),
            metrics(3, 7, {}),
            metrics(4, 7, {t + "logps": 0.125}),  # repeats: a new row
            metrics(5, 7, {"train/loss": 1.5, "train/reward": 0.75}),
            metrics(6, 8, {t + "generate": 0.0625}),  # another step: a new row
        ]
    )
    sink.close("finished")

    back = reader.read_back(tracker_dirs, run_info)
    assert back.metrics == {
        t + "generate": [(7, 0.5), (8, 0.0625)],
        t + "logps": [(7, 0.25), (7, 0.125)],
        "train/loss": [(7, 1.5)],
        "train/reward": [(7, 0.75)],
    }
    rows = history_items(raw(tracker_dirs, run_info))
    assert [sorted(k for k in r if not k.startswith("_")) for r in rows] == [
        ["profiling/Time taken: Trainer.generate", "profiling/Time taken: Trainer.logps", "rllog/step"],
        ["profiling/Time taken: Trainer.logps", "rllog/step", "train/loss", "train/reward"],
        ["profiling/Time taken: Trainer.generate", "rllog/step"],
    ]


def test_nan_inf_tokens_reserved_keys_and_empty_records(tracker_dirs, tmp_path):
    """NaN/inf read back: the contract suite. Here: how wandb writes them, and its own keys."""
    run_info = info(tmp_path)
    sink = WandbSink()
    sink.open(run_info)
    sink.write_metrics(
        [
            metrics(1, 3, {"loss": float("nan"), "grad_norm": float("inf"), "kl": float("-inf"), "reward": 1e308}),
            metrics(2, 4, {}),  # nothing to log: no row
            metrics(3, 5, {"_step": 7.0, "_runtime": 8.0, "_timestamp": 9.0, "_wandb": 10.0, "rllog/step": 11.0, "_mine": 12.0}),
        ]
    )
    sink.close("finished")

    back = reader.read_back(tracker_dirs, run_info)
    assert back.metrics["reward"] == [(3, 1e308)]
    # wandb's own keys (and the step key) are renamed, never overwritten
    assert back.metrics["rllog/_step"] == [(5, 7.0)]
    assert back.metrics["rllog/_runtime"] == [(5, 8.0)]
    assert back.metrics["rllog/_timestamp"] == [(5, 9.0)]
    assert back.metrics["rllog/_wandb"] == [(5, 10.0)]
    assert back.metrics["rllog/rllog/step"] == [(5, 11.0)]
    assert back.metrics["_mine"] == [(5, 12.0)]
    rows = history_items(raw(tracker_dirs, run_info))
    assert len(rows) == 2
    assert (rows[0]["loss"], rows[0]["grad_norm"], rows[0]["kl"]) == ("NaN", "Infinity", "-Infinity")
    assert [r["rllog/step"] for r in rows] == ["3", "5"]
    assert float(rows[1]["_timestamp"]) > 1e9 and rows[1]["_step"] == "1"  # wandb's own values intact


def test_tables_with_odd_cells(tracker_dirs, tmp_path):
    """Tables at their steps with a later column: the contract suite. Here: cells wandb needs converted."""
    run_info = info(tmp_path)
    sink = WandbSink()
    sink.open(run_info)
    sink.write_metrics([metrics(1, 0, {"reward": 0.5})])
    sink.write_table(table(2, 0, "completions", {"prompt": ["2+2=", "3+3="], "completion": ["4", "six"], "reward": [1.0, 0.0]}))
    sink.write_table(
        table(
            3,
            20,
            "completions",
            {
                "prompt": ["1+1="],
                "completion": ["2"],
                "reward": [float("nan")],
                "advantage": [None],
                "tokens": [[1, 2, 3]],
                "raw": [b"caf\xc3\xa9"],
            },
        )
    )
    sink.write_table(table(4, 20, "eval/samples", {"x": pa.array([], pa.string())}))
    sink.close("finished")

    back = reader.read_back(tracker_dirs, run_info)
    assert back.tables["completions"][0] == (
        0,
        [
            {"prompt": "2+2=", "completion": "4", "reward": 1.0},
            {"prompt": "3+3=", "completion": "six", "reward": 0.0},
        ],
    )
    step, rows = back.tables["completions"][1]
    assert step == 20 and len(rows) == 1
    assert rows[0] == {"prompt": "1+1=", "completion": "2", "reward": None, "advantage": None, "tokens": [1, 2, 3], "raw": "café"}
    assert back.tables["eval/samples"] == [(20, [])]
    assert back.metrics == {"reward": [(0, 0.5)]}  # tables are not metrics


def test_tables_are_built_as_wandb_builds_them_without_its_per_row_check():
    """The sink sets a mixed-type table's rows directly (wandb's per-row type check changes nothing there):
    the table and its column types must be exactly what ``wandb.Table(..., data=rows, allow_mixed_types=True)``
    makes, with the odd cells a completions table has."""
    import wandb

    from rllog_backends.wandb import _mixed_table

    columns = ["step", "prompt", "completion", "reward", "tokens", "meta"]
    rows = [[str(i), f"{i}+{i}=", "x" * i, i / 4, [i, i + 1], {"k": i}] for i in range(16)]
    rows.append([None, "", None, float("nan"), [], None])
    ours = _mixed_table(wandb, columns, [list(r) for r in rows])
    theirs = wandb.Table(columns=columns, data=[list(r) for r in rows], allow_mixed_types=True)
    assert json.dumps(ours._to_table_json()) == json.dumps(theirs._to_table_json())
    assert ours._column_types.to_json() == theirs._column_types.to_json()
    assert ours.data == theirs.data and len(ours.data) == 17


def test_tables_cost_no_disk_sync_and_land_whole(tracker_dirs, tmp_path, monkeypatch):
    """wandb fsyncs the temporary copy of each table it then copies to its staging area (one disk flush per table,
    what slowed training beside the agent); the sink turns that sync off, and the tables still land exactly."""
    import os

    run_info = delivered_by_the_agent(info(tmp_path))
    sink = WandbSink()
    sink.open(run_info)
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    for step in range(1, 6):
        sink.write_table(table(step, step, "completions", {"prompt": [f"{step}+1="], "reward": [step / 4]}))
    sink.flush()
    assert synced == []
    monkeypatch.undo()
    sink.close("finished")

    back = reader.read_back(tracker_dirs, run_info)
    assert back.tables["completions"] == [(s, [{"prompt": f"{s}+1=", "reward": s / 4}]) for s in range(1, 6)]


def test_table_over_wandb_row_limit_is_split_not_truncated(tracker_dirs, tmp_path):
    run_info = info(tmp_path)
    sink = WandbSink()
    sink.open(run_info)
    n = 10_001  # wandb.Table keeps 10,000 rows of a logged table and cuts the rest silently
    sink.write_table(table(1, 7, "completions", {"i": list(range(n)), "text": [f"row {i}" for i in range(n)]}))
    small = WandbSink(max_table_rows=3)
    sink.close("finished")
    small.open(run_info)  # resumes the same wandb run
    small.write_table(table(2, 8, "tiny", {"i": list(range(7))}))
    small.close("finished")

    back = reader.read_back(tracker_dirs, run_info)
    assert "completions" not in back.tables
    ((s0, part0),) = back.tables["completions/part_0"]
    ((s1, part1),) = back.tables["completions/part_1"]
    assert (s0, s1, len(part0), len(part1)) == (7, 7, 10_000, 1)
    assert part0 + part1 == [{"i": i, "text": f"row {i}"} for i in range(n)]
    assert [back.tables[f"tiny/part_{i}"] for i in range(3)] == [
        [(8, [{"i": 0}, {"i": 1}, {"i": 2}])],
        [(8, [{"i": 3}, {"i": 4}, {"i": 5}])],
        [(8, [{"i": 6}])],
    ]
    rows = history_items(raw(tracker_dirs, run_info))
    assert sum(1 for r in rows if "completions/part_0/_type" in r) == 1  # all parts in one row


def test_config_tags_and_exit_codes(tracker_dirs, tmp_path):
    """Status read back: the contract suite. Here: the exit code each status becomes, tags, a None and a long config value."""
    config = {
        "learning_rate": 1e-6,
        "per_device_train_batch_size": 4,
        "model/name": "tiny-qwen",
        "hub_token": "***",
        "use_vllm": False,
        "seed": None,
        "note": "x" * 5000,
    }
    for run_id, status in (("st-finished", "finished"), ("st-failed", "failed"), ("st-killed", "killed")):
        run_info = info(tmp_path, run_id=run_id, config=config, tags=("grpo", "t" * 100, ""))
        sink = WandbSink()
        sink.open(run_info)
        sink.write_metrics([metrics(1, 0, {"reward": 1.0})])
        sink.close(status)
        assert reader.read_back(tracker_dirs, run_info).config == config
        records = raw(tracker_dirs, run_info)
        exits = [m.exit_code for kind, m in records if kind == "exit"]
        assert exits == [{"finished": 0, "failed": 1, "killed": 255}[status]]
        run = next(m for kind, m in records if kind == "run")
        assert (run.run_id, run.project, run.display_name) == (run_id, "grpo-test", "tiny")
        assert list(run.tags) == ["grpo", "t" * 64]  # wandb rejects tags over 64 chars: cut; empty dropped


def test_replay_resumes_the_same_wandb_run_from_another_thread(tracker_dirs, tmp_path):
    run_info = info(tmp_path, run_id="resume01", config={"lr": 0.1})
    first = WandbSink()
    first.open(run_info)
    first.write_metrics([metrics(i, i - 1, {"reward": float(i)}) for i in range(1, 4)])
    first.close("killed")  # e.g. the trainer died; the rest is delivered later by `rllog replay`

    errors = []

    def replay():
        try:
            sink = WandbSink()
            sink.open(run_info)
            sink.write_metrics([metrics(i, i - 1, {"reward": float(i)}) for i in range(4, 6)])
            sink.write_table(table(6, 4, "completions", {"c": ["ok"]}))
            sink.close("finished")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=replay)
    thread.start()
    thread.join(120)
    assert not errors, errors

    files = reader.run_files(tracker_dirs["WANDB_DIR"], "resume01")
    assert len(files) == 2  # offline wandb writes each session to its own folder, same run id
    back = reader.read_back(tracker_dirs, run_info)
    assert back.metrics["reward"] == [(i - 1, float(i)) for i in range(1, 6)]
    assert back.config == {"lr": 0.1}
    assert {m.resume for path in files for kind, m in reader.iter_records(path) if kind == "run"} == {True}


def test_without_wandb_dir_files_go_to_the_run_dir(tracker_dirs, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_DIR")
    run_info = info(tmp_path, run_id="no/dir:id")  # not a valid wandb id as it is
    sink = WandbSink()
    sink.open(run_info)
    assert sink.run.id == wandb_run_id("no/dir:id") != "no/dir:id"
    sink.write_metrics([metrics(1, 2, {"reward": 0.25})])
    sink.close("finished")
    back = reader.read_back({"WANDB_DIR": run_info.run_dir}, run_info)
    assert back.metrics == {"reward": [(2, 0.25)]}
    assert not list((tmp_path / "wandb_dir").rglob("*.wandb"))


def test_a_rate_limited_open_and_a_call_repeated_after_success(tracker_dirs, tmp_path, monkeypatch):
    """A call failing half-way and repeated: the contract suite. Here: open after a 429, and the retry of a call whose
    1st row was logged (the delivery layer hands it only what wandb had not taken: rllog.sink.took)."""
    import wandb
    from wandb.errors import CommError

    run_info = info(tmp_path)
    sink = WandbSink()
    real_init = wandb.init
    monkeypatch.setattr(wandb, "init", lambda *a, **k: (_ for _ in ()).throw(CommError("HTTP 429: Too Many Requests")))
    with pytest.raises(RateLimited):
        sink.open(run_info)
    assert sink.run is None
    monkeypatch.setattr(wandb, "init", real_init)
    sink.open(run_info)  # the delivery layer's retry

    run = sink.run
    real_log, calls = run.log, []

    def fail_second(row, *a, **k):  # the 1st row goes through, the 2nd gets a 503
        calls.append(row)
        if len(calls) == 2:
            raise CommError("HTTP 503: Service Unavailable")
        return real_log(row, *a, **k)

    monkeypatch.setattr(run, "log", fail_second)
    batch = Batch(metrics(i, i, {"reward": float(i)}) for i in range(1, 4))
    with pytest.raises(TransientError) as failure:
        sink.write_metrics(batch)
    assert not isinstance(failure.value, RateLimited)
    assert [r.seq for r in batch.drop_taken()] == [1]  # wandb took row 1
    sink.write_metrics(batch)  # the call again, as the delivery layer retries it: row 1 not again
    assert [c["rllog/step"] for c in calls] == [1, 2, 2, 3]
    sink.write_table(table(4, 3, "completions", {"prompt": ["p"], "completion": ["c"]}))
    sink.close("finished")
    back = reader.read_back(tracker_dirs, run_info)
    assert back.metrics["reward"] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert back.tables["completions"] == [(3, [{"prompt": "p", "completion": "c"}])]


class _WatchedArgv(list):
    """The trainer's ``sys.argv``, noting each read wandb makes of it (wandb records ``sys.argv[1:]``)."""

    read_by_wandb = 0

    def __getitem__(self, index):
        if sys._getframe(1).f_globals.get("__name__", "").startswith("wandb"):
            self.read_by_wandb += 1
        return super().__getitem__(index)


@pytest.fixture
def a_parents_wandb_service(tracker_dirs):
    """``WANDB_SERVICE`` naming a real wandb service another process started (``wandb beta core start``): what a
    trainer inherits from a launcher that used wandb; wandb lets a child share its parent's service this way."""
    import os
    import re
    import subprocess

    wandb_cli = os.path.join(os.path.dirname(sys.executable), "wandb")
    env = {k: v for k, v in {**os.environ, **tracker_dirs}.items() if k != "WANDB_SERVICE"}  # not this process's own
    started = subprocess.run(
        [wandb_cli, "beta", "core", "start", "--idle-timeout", "120s"], env=env, capture_output=True, text=True, timeout=60
    )
    token = re.search(r"\b3-\d+-(?:unix|tcp)-\S+", started.stdout + started.stderr)
    assert token, started.stdout + started.stderr
    yield token.group(0)
    subprocess.run(
        [wandb_cli, "beta", "core", "stop"], env={**env, "WANDB_SERVICE": token.group(0)}, capture_output=True, timeout=60
    )


def test_through_rllog_init_with_thread_delivery(tracker_dirs, tmp_path, monkeypatch, a_parents_wandb_service):
    """In the trainer (``delivery="thread"``) the sink changes nothing process-wide: ``sys.argv`` stays the
    trainer's own object (wandb reads the arguments from it), ``os.environ`` keeps the inherited ``WANDB_SERVICE``
    and every other variable, and wandb's artifact ``fsync_open`` stays wandb's; the data reads back from the run file."""
    import os

    from wandb.sdk.artifacts import artifact

    import rllog

    monkeypatch.setenv("WANDB_SERVICE", a_parents_wandb_service)
    argv = _WatchedArgv(sys.argv)
    monkeypatch.setattr(sys, "argv", argv)
    environ_before, fsync_open_before = dict(os.environ), artifact.fsync_open
    run = rllog.init(
        report_to="wandb",
        project="e2e",
        config={"lr": 0.5, "api_key": "sk-secret"},
        run_dir=tmp_path / "rllog",
        delivery="thread",
        flush_interval=0.05,
        health=False,
        backend_options={"wandb": {"settings": {"x_stats_sampling_interval": 30}}},
    )
    for step in range(5):
        run.log({"reward": step / 4, "completions/mean_length": 10.0 + step}, step=step)
    run.log({"reward": -1.0}, step=1)
    run.log_table("completions", {"prompt": ["p"], "completion": ["c"]}, step=4)
    finished = run.finish(timeout=120)
    assert finished.ok
    back = reader.read_back(tracker_dirs, run.info)
    assert back.metrics["reward"] == [(s, s / 4) for s in range(5)] + [(1, -1.0)]
    assert back.metrics["completions/mean_length"] == [(s, 10.0 + s) for s in range(5)]
    assert back.tables == {"completions": [(4, [{"prompt": "p", "completion": "c"}])]}
    assert back.config["lr"] == 0.5 and back.config["api_key"] != "sk-secret"
    assert back.status == "finished"
    assert sys.argv is argv and argv.read_by_wandb > 0
    assert dict(os.environ) == environ_before
    assert artifact.fsync_open is fsync_open_before
    (run_file,) = reader.run_files(tracker_dirs["WANDB_DIR"], reader.run_id_of(run.info))
    where = finished["wandb"].location  # what finish prints: the run file's folder and the command that uploads it
    assert f"dir={run_file.parent} " in where and f"sync=wandb sync {run_file.parent}" in where


# -- no wandb run needed below ---------------------------------------------------------------------


def _http_error(status, headers=None):
    import requests

    response = requests.Response()
    response.status_code = status
    response.headers.update(headers or {})
    return requests.HTTPError(f"{status} error", response=response)


def test_error_mapping():
    import requests
    from wandb.apis.normalize import normalize_exceptions
    from wandb.errors import AuthenticationError, CommError, UsageError

    @normalize_exceptions  # wandb's own wrapper: requests.HTTPError -> CommError("HTTP 429 ...", exc)
    def api_call():
        raise _http_error(429, {"Retry-After": "7"})

    with pytest.raises(CommError) as caught:
        api_call()
    mapped = map_error(caught.value)
    assert isinstance(mapped, RateLimited) and mapped.retry_after == 7.0

    date = "Wed, 21 Oct 2099 07:28:00 GMT"
    assert map_error(_http_error(429, {"Retry-After": date})).retry_after > 1e9
    assert map_error(CommError("HTTP 429: slow down")).retry_after is None
    assert isinstance(map_error(CommError("HTTP 429: slow down")), RateLimited)
    for exc in (
        _http_error(503),
        _http_error(500),
        CommError("HTTP 502 (Bad Gateway)"),
        CommError("returned error 504: timeout"),
        CommError("Run initialization has timed out after 90.0 sec."),
        ConnectionResetError("reset"),
        TimeoutError(),
        requests.ConnectionError("refused"),
        CommError("x", exc=_http_error(500)),
    ):
        mapped = map_error(exc)
        assert isinstance(mapped, TransientError) and not isinstance(mapped, RateLimited), exc
    for exc in (
        AuthenticationError("bad key"),
        UsageError("bad arg"),
        CommError("HTTP 404: project not found"),
        _http_error(403),
        ValueError("bug"),
        KeyError("k"),
    ):
        assert map_error(exc) is exc


def test_run_id_rules():
    import wandb

    assert wandb_run_id("abcd1234") == "abcd1234"
    odd = ["a/b", "a:b", "a b", "x" * 100, "#?%;,'", "ünï"]
    ids = [wandb_run_id(r) for r in odd]
    assert len(set(ids)) == len(ids) and all(len(i) <= 64 for i in ids)
    assert ids == [wandb_run_id(r) for r in odd]  # stable: a replay finds the same run
    assert wandb_run_id("a/b") != wandb_run_id("a-b")
    for run_id in ids:
        assert wandb.Settings(run_id=run_id).run_id == run_id  # wandb's own validation accepts it


def test_registry_builds_it_from_json_options():
    """The import stays lazy: the contract suite."""
    from rllog.registry import create

    settings = {"x_stats_sampling_interval": 30}
    options = json.loads(json.dumps({"entity": "team", "settings": settings, "max_table_rows": 500, "step_key": "train/step"}))
    sink = create("wandb", options)
    assert isinstance(sink, WandbSink)
    assert (sink.entity, sink.settings, sink.max_table_rows, sink.step_key) == ("team", settings, 500, "train/step")
    assert sink.capabilities.tables and sink.capabilities.config and sink.capabilities.alerts
    with pytest.raises(RuntimeError):
        sink.write_metrics([metrics(1, 0, {"a": 1.0})])


# -- wandb's own conventions, and what the run says about the trainer ---------------------------------
WANDB_VARIABLES = {
    "WANDB_PROJECT": "env-project",
    "WANDB_NAME": "env-name",
    "WANDB_RUN_ID": "envrun0001",
    "WANDB_ENTITY": "env-team",
    "WANDB_TAGS": "from-env,cluster-a",
}


def run_record(env, wandb_id):
    """The ``run`` record of every session of wandb run ``wandb_id``, oldest first."""
    return [m for path in reader.run_files(env["WANDB_DIR"], wandb_id) for kind, m in reader.iter_records(path) if kind == "run"]


def test_wandb_variables_apply_when_the_code_gives_no_value(tracker_dirs, tmp_path, monkeypatch):
    """``rllog.init`` with its default project and name: wandb's variables decide, as with transformers'
    WandbCallback; a replay from a shell without them continues the same wandb run."""
    for name, val in WANDB_VARIABLES.items():
        monkeypatch.setenv(name, val)
    run_info = RunInfo("rllog", "run-0123abcd", str(tmp_path / "run"), "0123abcd")  # rllog.init's defaults
    sink = WandbSink()
    sink.open(run_info)
    sink.write_metrics([metrics(1, 0, {"reward": 0.5})])
    sink.close("killed")
    for name in WANDB_VARIABLES:
        monkeypatch.delenv(name)
    sink = WandbSink()  # `rllog replay` from another shell: the run directory remembers the wandb run
    sink.open(run_info)
    sink.write_metrics([metrics(2, 1, {"reward": 0.75})])
    sink.close("finished")

    sessions = run_record(tracker_dirs, "envrun0001")
    assert [(r.project, r.display_name, r.entity, list(r.tags)) for r in sessions] == [
        ("env-project", "env-name", "env-team", ["from-env", "cluster-a"])
    ] * 2
    assert reader.run_ids(tracker_dirs, run_info) == {"envrun0001"}
    assert reader.read_back(tracker_dirs, run_info).metrics["reward"] == [(0, 0.5), (1, 0.75)]


def test_explicit_values_win_over_wandb_variables(tracker_dirs, tmp_path, monkeypatch):
    for name, val in WANDB_VARIABLES.items():
        monkeypatch.setenv(name, val)
    monkeypatch.setenv("WANDB_RESUME", "must")
    run_info = RunInfo("grpo-math", "tiny", str(tmp_path / "run"), "0123abcd", tags=("rllog-tag",))
    sink = WandbSink(id="optionrun01", entity="option-team")
    sink.open(run_info)
    assert sink.run.settings.resume == "must"  # WANDB_RESUME (offline wandb cannot tell must from allow)
    sink.close("finished")
    [run] = run_record(tracker_dirs, "optionrun01")
    assert (run.project, run.display_name, run.entity, list(run.tags)) == ("grpo-math", "tiny", "option-team", ["rllog-tag"])

    sink = WandbSink(project="option-project", name="option-name", resume="allow")
    sink.open(dataclasses.replace(run_info, run_id="4567cdef", tags=()))
    assert sink.run.settings.resume == "allow"
    sink.close("finished")
    [run] = run_record(tracker_dirs, "envrun0001")  # no id option: WANDB_RUN_ID
    assert (run.project, run.display_name, run.entity, list(run.tags)) == (
        "option-project",
        "option-name",
        "env-team",
        ["from-env", "cluster-a"],
    )


def test_the_run_describes_the_trainer_not_the_delivery_process(tracker_dirs, tmp_path):
    """wandb's metadata names the trainer's program and arguments, and wandb samples no system metrics
    (it would sample the delivery process; rllog sends the trainer's own ``system/...``)."""
    run_info = delivered_by_the_agent(
        info(tmp_path, program="train_grpo.py", args=("--learning_rate", "1e-6", "--report_to", "wandb"))
    )
    sink = WandbSink()
    sink.open(run_info)
    sink.write_metrics([metrics(1, 0, {"reward": 0.5, "system/memory_rss_mb": 584.0})])
    sink.close("finished")

    records = raw(tracker_dirs, run_info)
    [environment] = [m for kind, m in records if kind == "environment" and m.program]
    assert (environment.program, list(environment.args)) == ("train_grpo.py", ["--learning_rate", "1e-6", "--report_to", "wandb"])
    assert [kind for kind, _ in records if kind == "stats"] == []
    assert reader.read_back(tracker_dirs, run_info).metrics["system/memory_rss_mb"] == [(0, 584.0)]
    assert sys.argv[0] != "train_grpo.py"  # the process that opened the run had another command line

    control = WandbSink(settings={"x_disable_stats": False})  # wandb's sampler on: a stats record appears
    control.open(info(tmp_path, run_id="control01"))
    control.close("finished")
    assert [kind for kind, _ in raw(tracker_dirs, info(tmp_path, run_id="control01")) if kind == "stats"]


def _wandb_cores(pid: int) -> set[int]:
    import psutil

    cores = set()
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "wandb-core" in " ".join(child.cmdline()):
                cores.add(child.pid)
        except psutil.Error:  # exited meanwhile (the early service, torn down)
            pass
    return cores


@pytest.mark.parametrize("late_notes", [None, "set after the trainer was built"])
def test_the_standby_agent_starts_wandbs_service_and_a_variable_set_later_still_reaches_the_run(
    tracker_dirs, tmp_path, monkeypatch, late_notes
):
    """The standby agent (started while a trainer is built) starts wandb's service; the run's ``wandb.init`` uses
    it. wandb reads its variables once, at that setup: one the trainer sets later (here ``WANDB_NOTES``; as well
    ``WANDB_MODE``, an API key) would be ignored, so the sink then sets wandb up afresh, with a new service."""
    from sinks import wait_until

    import rllog
    from rllog import agent

    agent.discard_standby()
    assert rllog.prepare(["wandb"])
    standby = agent.waiting_standby()
    assert wait_until(lambda: _wandb_cores(standby.proc.pid), timeout=60)
    (early,) = _wandb_cores(standby.proc.pid)
    if late_notes:
        monkeypatch.setenv("WANDB_NOTES", late_notes)
    run = rllog.init(report_to=["wandb"], run_dir=tmp_path / "run", health=False)
    assert run._agent.pid == standby.proc.pid
    run.log({"x": 1.0}, step=1)
    assert run.flush(timeout=60).ok
    cores = _wandb_cores(run._agent.pid)
    assert cores == ({early} if late_notes is None else cores - {early}) and cores
    assert run.finish().ok
    (path,) = reader.run_files(tracker_dirs["WANDB_DIR"], reader.run_id_of(run.info))
    (notes,) = [msg.notes for kind, msg in reader.iter_records(path) if kind == "run"][:1]
    assert notes == (late_notes or "")
    assert reader.read_back(tracker_dirs, run.info).metrics["x"] == [(1, 1.0)]
