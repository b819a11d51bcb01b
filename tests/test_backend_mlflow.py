"""MlflowSink against real MLflow: a sqlite store in the test's tmp dir, and a real ``mlflow server`` on
loopback. Everything is read back through ``MlflowClient`` from MLflow's own storage.

Fault injection (HTTP 429 / 503 / a dead server) goes through a small loopback proxy in front of the
real server, so the real MLflow REST client sees real responses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import time
from functools import partial
from pathlib import Path

import pyarrow as pa
import pytest
from fault_proxy import FaultProxy
from mlflow_server import mlflow_server  # noqa: F401  (fixture)
from readers.mlflow import find_run, prepare, read_back
from sinks import backend_run_info, wait_until

from rllog.errors import RateLimited, TransientError
from rllog.records import MetricsRecord, RunInfo, TableRecord
from rllog_backends.mlflow import MAX_PARAM_VALUE_LENGTH, MlflowSink, mlflow_key

T0 = 1_700_000_000.0
GRPO_KEYS = ["reward", "reward_std", "rewards/accuracy/mean", "completions/mean_length", "clip_ratio/low_mean", "kl", "entropy"]


@pytest.fixture(autouse=True)
def _mlflow_db(tracker_dirs, monkeypatch):
    """A migrated copy of the database where conftest's MLFLOW_TRACKING_URI points (migrating takes seconds)."""
    prepare(monkeypatch, tracker_dirs)
    return tracker_dirs["MLFLOW_TRACKING_URI"]


@pytest.fixture
def client(tracker_dirs):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracker_dirs["MLFLOW_TRACKING_URI"])


make_info = partial(backend_run_info, name="grpo-tiny", run_id="rllog-run-0001", config={"lr": 1e-5})


def rec(seq: int, step: int, values: dict, t: float | None = None) -> MetricsRecord:
    return MetricsRecord(seq=seq, step=step, time=T0 + seq if t is None else t, values=values)


def table(seq: int, step: int, name: str, columns: dict) -> TableRecord:
    return TableRecord(seq=seq, step=step, time=T0 + seq, name=name, table=pa.table(columns))


def assert_valid_for_mlflow(name: str) -> None:
    """MLflow's own validators accept ``name`` as a metric and a param key."""
    from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, _validate_length_limit, _validate_metric_name, _validate_param_name

    _validate_metric_name(name)
    _validate_param_name(name)
    _validate_length_limit("key", MAX_ENTITY_KEY_LENGTH, name)


# -- name mapping ---------------------------------------------------------------------------------

LONG = "x/" + "y" * 298  # 300 characters


@pytest.mark.parametrize(
    "key, expected",
    [
        ("eval/acc@1", "eval/acc_1"),
        ("loss(mean)", "loss_mean_"),
        ("rewards/a,b", "rewards/a_b"),
        ("a//b", "a/b"),
        ("rewards/accuracy/", "rewards/accuracy"),
        ("/leading", "leading"),
        ("a/./b", "a/b"),
        ("a/../b", "a/__/b"),
        ("..hidden", "_..hidden"),
        ("tab\there", "tab_here"),
        ("ok/key: with space-and.dots", "ok/key: with space-and.dots"),
        ("clip_ratio/low_mean", "clip_ratio/low_mean"),
        (LONG, LONG[:241] + "_" + hashlib.sha1(LONG.encode()).hexdigest()[:8]),
    ],
)
def test_mlflow_key(key, expected):
    name = mlflow_key(key)
    assert name == expected
    assert len(name) <= 250
    assert_valid_for_mlflow(name)
    assert mlflow_key(name) == name  # idempotent: a mapped name is already valid


def test_mlflow_key_always_valid_and_long_keys_stay_distinct():
    rng = random.Random(0)
    alphabet = "ab/._- :@(),[]{}#%é\t"
    for _ in range(2000):
        assert_valid_for_mlflow(mlflow_key("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))))
    a, b = "m/" + "z" * 300 + "a", "m/" + "z" * 300 + "b"
    assert mlflow_key(a) != mlflow_key(b) and len(mlflow_key(a)) == len(mlflow_key(b)) == 250


# -- metrics ---------------------------------------------------------------------------------------


def test_sanitised_keys_and_collisions(tracker_dirs, client, caplog):
    info = make_info(tracker_dirs["tmp"])
    sink = MlflowSink()
    sink.open(info)
    with caplog.at_level(logging.WARNING, logger="rllog_backends.mlflow"):
        sink.write_metrics(
            [rec(1, 0, {"eval/acc@1": 0.5, "loss(mean)": 1.5, "a,b": 2.5, "x//y": 3.5, "z/": 4.5, LONG: 5.5, "acc@k": 6.5})]
        )
        sink.write_metrics([rec(2, 1, {"acc(k": 7.5, "acc@k": 8.5}), rec(3, 2, {"acc(k": 9.5})])
    sink.close("finished")

    suffix = "acc_k_" + hashlib.sha1(b"acc(k").hexdigest()[:8]
    got = read_back(tracker_dirs, info).metrics
    assert got == {
        "eval/acc_1": [(0, 0.5)],
        "loss_mean_": [(0, 1.5)],
        "a_b": [(0, 2.5)],
        "x/y": [(0, 3.5)],
        "z": [(0, 4.5)],
        mlflow_key(LONG): [(0, 5.5)],
        "acc_k": [(0, 6.5), (1, 8.5)],  # "acc@k" came first and keeps the plain name
        suffix: [(1, 7.5), (2, 9.5)],  # the later "acc(k" is kept apart
    }
    warnings = [r for r in caplog.records if "both map to" in r.getMessage()]
    assert len(warnings) == 1 and "acc(k" in warnings[0].getMessage()

    # Resumed in a fresh sink (another process, e.g. `rllog replay`), "acc(k" arrives first this
    # time: the rename recorded in the run's tags keeps it on the same series.
    sink = MlflowSink()
    sink.open(info)
    sink.write_metrics([rec(4, 3, {"acc(k": 10.5}), rec(5, 3, {"acc@k": 11.5})])
    sink.close("finished")
    got = read_back(tracker_dirs, info).metrics
    assert got[suffix][-1] == (3, 10.5) and got["acc_k"][-1] == (3, 11.5)


def test_2500_metrics_in_one_record_are_batched_and_all_arrive(tracker_dirs, client):
    info = make_info(tracker_dirs["tmp"])
    sink = MlflowSink()
    sink.open(info)
    calls = []
    real_log_batch = sink._client.log_batch
    sink._client.log_batch = lambda run_id, **kw: (calls.append(len(kw.get("metrics", ()))), real_log_batch(run_id, **kw))[1]
    values = {f"m/{i:04d}": i + 0.25 for i in range(2500)}
    sink.write_metrics([rec(1, 7, values), rec(2, 8, {"m/0000": -1.0})])
    sink.close("finished")
    assert calls == [1000, 1000, 501]
    run = find_run(client, info)
    assert run.data.metrics == {**values, "m/0000": -1.0}  # latest value per key
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "m/0000")] == [(7, 0.25), (8, -1.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "m/2499")] == [(7, 2499.25)]


def test_timestamps_precision_and_order_with_a_backwards_step(tracker_dirs, client):
    """NaN/inf and a backwards step read back: the contract suite. Here: MLflow's timestamps, order and precision."""
    info = make_info(tracker_dirs["tmp"])
    sink = MlflowSink()
    sink.open(info)
    records = [rec(i + 1, i, {"reward": i / 10, "loss": 1.0 - i / 10}) for i in range(6)]
    records.append(rec(7, 2, {"reward": 99.0, "loss": 98.0}))  # step goes back from 5 to 2
    records.append(rec(8, 6, {"reward": float("nan"), "loss": float("inf")}))
    records.append(rec(9, 7, {"reward": 0.123456789012345678, "loss": float("-inf")}))
    sink.write_metrics(records[:4])
    sink.write_metrics(records[4:])
    sink.flush()
    sink.close("finished")
    got = read_back(tracker_dirs, info).metrics
    assert [(s, v) for s, v in got["reward"][:7]] == [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4), (5, 0.5), (2, 99.0)]
    assert got["reward"][7][0] == 6 and math.isnan(got["reward"][7][1])  # NaN is stored as NaN
    assert got["reward"][8] == (7, 0.123456789012345678)  # full double precision
    assert got["loss"][7] == (6, 1.7976931348623157e308)  # +inf is stored as the largest double
    assert got["loss"][8] == (7, -1.7976931348623157e308)
    history = client.get_metric_history(find_run(client, info).info.run_id, "reward")
    assert [m.timestamp for m in history] == [int((T0 + s) * 1000) for s in range(1, 10)]


def test_same_millisecond_records_keep_their_order_and_are_not_merged(tracker_dirs):
    info = make_info(tracker_dirs["tmp"])
    sink = MlflowSink()
    sink.open(info)
    # All logged within one millisecond; the last one repeats step 1 with the same value.
    records = [
        rec(i + 1, step, {"reward": value}, t=T0) for i, (step, value) in enumerate([(0, 0.0), (1, 0.5), (2, 1.0), (1, 0.5)])
    ]
    sink.write_metrics(records[:2])
    sink.write_metrics(records[2:])
    sink.close("finished")
    assert read_back(tracker_dirs, info).metrics == {"reward": [(0, 0.0), (1, 0.5), (2, 1.0), (1, 0.5)]}


def test_records_re_sent_after_a_killed_agent_keep_their_timestamps(tracker_dirs):
    """An agent killed after a flush but before its cursor moved: a new sink re-sends the records after the last
    acknowledged one. Records of one millisecond get increasing timestamps; the re-sent ones get the same again."""
    info = make_info(tracker_dirs["tmp"])
    first = MlflowSink()
    first.open(info)
    first.write_metrics([rec(1, 1, {"reward": 0.25}, t=T0), rec(2, 2, {"reward": 0.5}, t=T0)])
    first.flush()  # acknowledged: the cursor moves to seq 2
    first.write_metrics([rec(3, 3, {"reward": 0.75}, t=T0), rec(4, 4, {"reward": 1.0}, t=T0)])
    first.flush()  # stored, then the agent is killed before the cursor moves
    again = MlflowSink()
    again.open(info)  # the same MLflow run (rllog.run_id tag)
    again.write_metrics([rec(3, 3, {"reward": 0.75}, t=T0), rec(4, 4, {"reward": 1.0}, t=T0)])
    again.close("finished")
    # Each value once (re-sent ones were recognised as identical points), at its step. In timestamp order the
    # records after the flush come first: their timestamps start afresh at the millisecond they were logged in.
    assert sorted(read_back(tracker_dirs, info).metrics["reward"]) == [(1, 0.25), (2, 0.5), (3, 0.75), (4, 1.0)]


# -- tables ----------------------------------------------------------------------------------------


def test_tables_at_two_steps_with_a_new_column(tracker_dirs, client):
    info = make_info(tracker_dirs["tmp"])
    sink = MlflowSink()
    sink.open(info)
    first = {"prompt": ["2+2?", "3*3?"], "completion": ["4", "9 <think>"], "reward": [1.0, 0.123456789012345678]}
    second = {"prompt": ["1+1?"], "completion": ["2"], "reward": [float("nan")], "advantage": [-0.5]}
    sink.write_table(table(1, 0, "completions", first))
    sink.write_table(table(2, 20, "completions", second))
    sink.write_table(table(3, 0, "completions", {"prompt": ["again"], "completion": ["same step"], "reward": [0.0]}))  # step back
    sink.write_table(table(4, 5, "eval/samples@1", {"text": ["x"]}))
    sink.close("finished")

    got = read_back(tracker_dirs, info).tables
    assert got == {
        "completions": [
            (
                0,
                [
                    {"prompt": "2+2?", "completion": "4", "reward": 1.0},
                    {"prompt": "3*3?", "completion": "9 <think>", "reward": 0.123456789012345678},
                ],
            ),
            (20, [{"prompt": "1+1?", "completion": "2", "reward": None, "advantage": -0.5}]),  # NaN cell -> null
            (0, [{"prompt": "again", "completion": "same step", "reward": 0.0}]),
        ],
        "eval/samples_1": [(5, [{"text": "x"}])],
    }
    run = find_run(client, info)
    # The run's table list (what the UI and MlflowClient.load_table use) names the newest file per table.
    df = client.load_table(run.info.experiment_id, "tables/completions/step_000000-seq_000003.json", run_ids=[run.info.run_id])
    assert df.to_dict("records") == [{"prompt": "again", "completion": "same step", "reward": 0.0}]
    assert json.loads(run.data.tags["mlflow.loggedArtifacts"]) == [
        {"path": "tables/completions/step_000000-seq_000003.json", "type": "table"},
        {"path": "tables/eval/samples_1/step_000005-seq_000004.json", "type": "table"},
    ]


def test_tables_are_uploaded_together_at_flush_and_a_killed_agents_staged_files_are_not_kept(tracker_dirs, client):
    """Table files wait for ``flush()`` (one ``log_artifacts`` for all: the delivery layer acknowledges a table only
    after it), so a new sink after a killed agent starts without what the dead one staged and gets it again."""
    info = make_info(tracker_dirs["tmp"])
    first = MlflowSink()
    first.open(info)
    for seq in (1, 2, 3):
        first.write_table(table(seq, seq, "completions", {"prompt": [f"p{seq}"], "completion": ["c"], "reward": [seq / 4]}))
    run = find_run(client, info)
    assert client.list_artifacts(run.info.run_id) == []  # held until the flush
    first.flush()
    names = [f.path for f in client.list_artifacts(run.info.run_id, "tables/completions")]
    assert names == [f"tables/completions/step_00000{n}-seq_00000{n}.json" for n in (1, 2, 3)]
    first.write_table(table(4, 4, "completions", {"prompt": ["p4"], "completion": ["c"], "reward": [1.0]}))
    staged = list((Path(info.run_dir) / "trackers" / "mlflow-tables").rglob("*.json"))
    assert [p.name for p in staged] == ["step_000004-seq_000004.json"]  # the agent is killed here: never flushed
    again = MlflowSink()
    again.open(info)  # the same MLflow run; the dead agent's staged file is dropped
    assert not (Path(info.run_dir) / "trackers" / "mlflow-tables").exists()
    again.write_table(table(4, 4, "completions", {"prompt": ["p4 again"], "completion": ["c"], "reward": [1.0]}))
    again.close("finished")
    got = read_back(tracker_dirs, info).tables["completions"]
    assert [(step, rows[0]["prompt"]) for step, rows in got] == [(1, "p1"), (2, "p2"), (3, "p3"), (4, "p4 again")]


def test_artifacts_stay_in_the_tmp_dir(tracker_dirs, client, monkeypatch):
    sink = MlflowSink()
    sink.open(make_info(tracker_dirs["tmp"]))
    sink.write_table(table(1, 0, "completions", {"a": [1]}))
    sink.close("finished")
    root = Path(os.environ["MLFLOW_ARTIFACT_ROOT"])  # set by conftest
    assert client.get_experiment(sink.experiment_id).artifact_location == str(root / "grpo-math")
    assert list((root / "grpo-math").rglob("step_000000-seq_000001.json"))

    # Without MLFLOW_ARTIFACT_ROOT, a sqlite store keeps artifacts next to its database file.
    monkeypatch.delenv("MLFLOW_ARTIFACT_ROOT")
    sink = MlflowSink(experiment_name="other")
    sink.open(make_info(tracker_dirs["tmp"], run_id="rllog-run-0002"))
    sink.close("finished")
    assert client.get_experiment(sink.experiment_id).artifact_location == str(Path(tracker_dirs["tmp"]) / "mlartifacts" / "other")
    assert not Path("mlruns").exists() or not any(Path("mlruns").rglob(sink.run_id))


# -- config, status, resume --------------------------------------------------------------------------


def test_config_params_batched_truncated_and_redacted(tracker_dirs, client):
    config = {f"trainer/p{i:03d}": i for i in range(150)}  # two log_batch calls of params
    config.update({
        "model/name": "Qwen2-tiny",
        "hub_token": "<redacted>",
        "optim/betas(0)": 0.9,
        "long/value": "v" * 10_000,
        "flag": True,
        "nothing": None,
    })  # fmt: skip
    info = make_info(tracker_dirs["tmp"], config=config, tags=("baseline", "cpu run"))
    sink = MlflowSink()
    sink.open(info)
    sink.close("finished")
    got = read_back(tracker_dirs, info).config
    expected = {f"trainer/p{i:03d}": str(i) for i in range(150)}
    expected.update({
        "model/name": "Qwen2-tiny",
        "hub_token": "<redacted>",
        "optim/betas_0_": "0.9",
        "long/value": "v" * MAX_PARAM_VALUE_LENGTH,
        "flag": "True",
        "nothing": "None",
    })  # fmt: skip
    assert got == expected
    tags = find_run(client, info).data.tags
    assert tags["rllog.run_id"] == "rllog-run-0001" and tags["mlflow.runName"] == "grpo-tiny"
    assert tags["baseline"] == "" and tags["cpu run"] == ""


def test_run_status_while_open_closed_and_reopened(tracker_dirs, client):
    """Status and resume read back: the contract suite. Here: MLflow's own states, RUNNING again on a reopen."""
    info = make_info(tracker_dirs["tmp"], config={"lr": 0.001, "seed": 1})
    sink = MlflowSink()
    sink.open(info)
    sink.write_metrics([rec(1, 0, {"reward": 0.1}), rec(2, 1, {"reward": 0.2})])
    assert find_run(client, info).info.status == "RUNNING"
    sink.close("killed")  # the trainer died
    assert find_run(client, info).info.status == "KILLED"

    sink = MlflowSink()  # `rllog replay` later, in another process
    sink.open(info)
    assert find_run(client, info).info.status == "RUNNING"
    sink.write_metrics([rec(3, 2, {"reward": 0.3})])
    sink.close("failed")
    assert find_run(client, info).info.status == "FAILED"
    assert read_back(tracker_dirs, info).config == {"lr": "0.001", "seed": "1"}


# -- errors -----------------------------------------------------------------------------------------


def test_local_store_errors_map():
    from mlflow.exceptions import MlflowException, RestException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, TEMPORARILY_UNAVAILABLE

    from rllog_backends.mlflow import _mapped_errors

    def raised(exc):
        try:
            with _mapped_errors():
                raise exc
        except Exception as out:
            return out

    assert isinstance(raised(MlflowException("database is locked", error_code=TEMPORARILY_UNAVAILABLE)), TransientError)
    assert isinstance(raised(RestException({"error_code": "RESOURCE_EXHAUSTED", "message": "quota"})), RateLimited)
    bad = MlflowException("bad key", error_code=INVALID_PARAMETER_VALUE)
    assert raised(bad) is bad  # not retryable: propagates unchanged


def test_real_server_roundtrip_and_fault_mapping(mlflow_server, tracker_dirs, monkeypatch):  # noqa: F811
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)  # restored after the test
    proxy = FaultProxy(mlflow_server)
    try:
        info = make_info(tracker_dirs["tmp"], config={"lr": 1e-5, "api_key": "<redacted>"})
        sink = MlflowSink(tracking_uri=proxy.uri)
        sink.open(info)
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"  # rllog owns the retries

        values = {k: i + 0.5 for i, k in enumerate(GRPO_KEYS)}
        sink.write_metrics([rec(1, 0, values), rec(2, 1, {"reward": float("nan"), "kl": float("inf")})])
        sink.write_table(table(3, 1, "completions", {"prompt": ["p"], "completion": ["c"], "reward": [0.5]}))
        sink.write_metrics([rec(4, 0, {"reward": 7.0})])  # step goes back over REST too
        before = len(proxy.paths)
        sink.flush()
        # the table's file (log_artifacts asks where the run's artifacts go; this server's store is a folder the
        # client writes), then the metrics and the table list in one request
        assert [p.rsplit("/", 2)[-2:] for p in proxy.paths[before:]] == [["runs", "get"], ["runs", "log-batch"]]
        sink.close("failed")

        env = dict(tracker_dirs, MLFLOW_TRACKING_URI=mlflow_server)
        back = read_back(env, info)
        assert back.status == "failed"
        assert back.config == {"lr": "1e-05", "api_key": "<redacted>"}
        assert back.tables == {"completions": [(1, [{"prompt": "p", "completion": "c", "reward": 0.5}])]}
        assert back.metrics["reward"][0] == (0, 0.5) and back.metrics["reward"][2] == (0, 7.0)
        assert back.metrics["reward"][1][0] == 1 and math.isnan(back.metrics["reward"][1][1])
        assert back.metrics["kl"] == [(0, values["kl"]), (1, 1.7976931348623157e308)]
        assert set(back.metrics) == set(GRPO_KEYS)

        # Faults, in a second run: 429 -> RateLimited at once (MLflow's own retry loop would sleep
        # for minutes with its default of 7 retries).
        sink = MlflowSink(tracking_uri=proxy.uri)
        sink.open(make_info(tracker_dirs["tmp"], run_id="faults"))
        big = {f"m/{i:04d}": i + 0.5 for i in range(1500)}
        proxy.faults = [429]
        started = time.monotonic()
        sink.write_metrics([rec(1, 2, big)])  # held until flush
        with pytest.raises(RateLimited):
            sink.flush()
        assert time.monotonic() - started < 5
        # 503 after the first 1000 metrics went through: TransientError; the repeated flush (the
        # delivery layer's retry) sends only the missing 500.
        sent = proxy.log_batches
        proxy.faults = [None, 503]
        with pytest.raises(TransientError) as err:
            sink.flush()
        assert not isinstance(err.value, RateLimited)
        sink.flush()
        assert proxy.log_batches - sent == 2  # the 1000, then the 500 the 503 refused
        from mlflow import MlflowClient

        assert MlflowClient(mlflow_server).get_run(sink.run_id).data.metrics == big

        # A server that is gone: TransientError (connection refused), not a crash.
        proxy.close()
        sink.write_metrics([rec(6, 3, {"reward": 1.0})])
        with pytest.raises(TransientError):
            sink.flush()
        # Two keys that map to one MLflow name: the rename is a run tag, sent at once; the server gone then is
        # transient too (it escaped as MLflow's own exception, taken as permanent: the record dead-lettered).
        with pytest.raises(TransientError):
            sink.write_metrics([rec(7, 4, {"a@b": 1.0, "a(b": 2.0})])
    finally:
        proxy.server.server_close()


# -- MLflow's own conventions ----------------------------------------------------------------------
def test_mlflow_run_id_logs_into_the_run_a_platform_created(tracker_dirs, client, monkeypatch):
    """AzureML/Databricks create the MLflow run and set MLFLOW_RUN_ID: the data goes into that run (not a
    new one), and a later ``rllog replay`` without the variable continues it."""
    experiment = client.create_experiment("azureml-job")
    platform_run = client.create_run(experiment, run_name="job-42").info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", platform_run)
    monkeypatch.setenv("MLFLOW_TAGS", json.dumps({"release.candidate": "RC1", "team": "rl"}))
    info = make_info(tracker_dirs["tmp"], config={"lr": 1e-5})
    sink = MlflowSink()
    sink.open(info)
    sink.write_metrics([rec(1, 0, {"reward": 0.1})])
    sink.close("killed")
    monkeypatch.delenv("MLFLOW_RUN_ID")
    monkeypatch.delenv("MLFLOW_TAGS")
    sink = MlflowSink()  # `rllog replay` from another shell
    sink.open(info)
    sink.write_metrics([rec(2, 1, {"reward": 0.2})])
    sink.close("finished")

    run = client.get_run(platform_run)
    assert [(m.step, m.value) for m in client.get_metric_history(platform_run, "reward")] == [(0, 0.1), (1, 0.2)]
    assert run.data.params == {"lr": "1e-05"} and run.info.status == "FINISHED"
    assert (run.data.tags["release.candidate"], run.data.tags["team"], run.data.tags["rllog.run_id"]) == (
        "RC1",
        "rl",
        info.run_id,
    )
    assert [r.info.run_id for e in client.search_experiments() for r in client.search_runs([e.experiment_id])] == [platform_run]
    assert read_back(tracker_dirs, info).metrics["reward"] == [(0, 0.1), (1, 0.2)]


def test_mlflow_experiment_name_applies_unless_the_project_is_given(tracker_dirs, client, monkeypatch):
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    default = RunInfo("rllog", "run-aaaa", str(Path(tracker_dirs["tmp"]) / "a"), "aaaa")  # rllog.init's defaults
    given = RunInfo("grpo-math", "tiny", str(Path(tracker_dirs["tmp"]) / "b"), "bbbb")
    option = RunInfo("grpo-math", "tiny", str(Path(tracker_dirs["tmp"]) / "c"), "cccc")
    trainer = RunInfo("huggingface", "tiny", str(Path(tracker_dirs["tmp"]) / "d"), "dddd")  # TrainingArguments.project's default
    sinks = [
        (default, MlflowSink()),
        (given, MlflowSink()),
        (option, MlflowSink(experiment_name="from-option")),
        (trainer, MlflowSink()),
    ]
    for info, sink in sinks:
        sink.open(info)
        sink.close("finished")
    experiments = {e.name: e.experiment_id for e in client.search_experiments()}
    runs = {e: sorted(r.data.tags["rllog.run_id"] for r in client.search_runs([i])) for e, i in experiments.items()}
    assert {e: r for e, r in runs.items() if r} == {"from-env": ["aaaa", "dddd"], "grpo-math": ["bbbb"], "from-option": ["cccc"]}


def test_a_changed_config_value_keeps_the_param_and_tags_the_new_value(tracker_dirs, client):
    """MLflow refuses to change a param: the first value stays, the current one is the tag rllog.config.<param>."""
    from rllog.records import ConfigRecord

    info = make_info(tracker_dirs["tmp"], config={"learning_rate": 1e-5, "beta": 0.04})
    sink = MlflowSink()
    sink.open(info)
    sink.write_config(ConfigRecord(1, 10, T0, {"learning_rate": 5e-6, "num_generations": 8}))
    sink.write_config(ConfigRecord(2, 20, T0, {"learning_rate": 1e-5}))  # back to the first value: the tag follows
    sink.write_config(ConfigRecord(3, 30, T0, {"beta": 0.04}))  # unchanged: nothing to record
    sink.close("finished")
    run = find_run(client, info)
    assert run.data.params == {"learning_rate": "1e-05", "beta": "0.04", "num_generations": "8"}
    assert {k: v for k, v in run.data.tags.items() if k.startswith("rllog.config.")} == {"rllog.config.learning_rate": "1e-05"}

    sink = MlflowSink()  # a resumed run whose init config changed a value
    sink.open(dataclasses.replace(info, config={"learning_rate": 1e-5, "beta": 0.02}))
    sink.close("finished")
    tags = find_run(client, info).data.tags
    assert (tags["rllog.config.beta"], tags["rllog.config.learning_rate"]) == ("0.02", "1e-05")


def test_mlflows_system_metrics_monitor_stays_off(tracker_dirs, client, monkeypatch):
    """With MLflow's monitor switched on for the process, the sink's run still gets none of its samples
    (they would describe the delivery process); rllog's own ``system/...`` metrics arrive as metrics."""
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "true")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.1")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING", "1")
    info = make_info(tracker_dirs["tmp"])
    sink = MlflowSink()
    sink.open(info)
    sink.write_metrics([rec(1, 0, {"system/memory_rss_mb": 584.0})])
    # A control run of this process, with the monitor as the environment sets it, gets samples while the sink's
    # run is open: the monitor was on and sampling, and the sink's run got none of it.
    import mlflow

    with mlflow.start_run(experiment_id=find_run(client, info).info.experiment_id) as control:
        sampled = lambda: any(key.startswith("system/") for key in client.get_run(control.info.run_id).data.metrics)  # noqa: E731
        assert wait_until(sampled, timeout=30)
    sink.close("finished")
    assert set(find_run(client, info).data.metrics) == {"system/memory_rss_mb"}
