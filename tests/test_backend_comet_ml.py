"""The comet_ml backend against the real comet_ml library, offline, read back from its own archives.

Each test drives ``CometSink`` directly (open -> write -> flush -> close) and reads the offline zip
in ``COMET_OFFLINE_DIRECTORY`` with ``tests/readers/comet_ml.py``. Ending an offline experiment
takes about 1 s (Comet's streamer thread wakes up once a second), so tests keep to one experiment each.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pyarrow as pa
import pytest

pytest.importorskip("comet_ml")
import requests
from readers import read_back
from sinks import backend_run_info

from rllog import registry
from rllog.errors import RateLimited, TransientError
from rllog.records import MetricsRecord, RunInfo, TableRecord
from rllog.rundir import tracker_location
from rllog_backends.comet import (
    CometSink,
    comet_name,
    experiment_key,
    map_error,
)

ROOT = Path(__file__).resolve().parents[1]
GRPO_KEYS = ["reward", "reward_std", "rewards/accuracy/mean", "completions/mean_length", "clip_ratio/low_mean", "kl", "loss"]


def make_run_info(env, name="grpo-run", run_id="0badcafe", config=None, tags=("rl", "grpo")):
    run_dir = Path(env["tmp"]) / "rllog_runs" / name
    run_dir.mkdir(parents=True, exist_ok=True)
    config = (
        {
            "learning_rate": 1e-6,
            "model/name": "tiny-qwen",
            "beta": 0.0,
            "report_to": "comet_ml",
            "hub_token": "***",
            "seed": None,
            "bf16": True,
        }
        if config is None
        else config
    )
    return backend_run_info(env, name=name, run_id=run_id, config=config, tags=tags, run_dir=run_dir)


def value_of(step: int, i: int) -> float:
    return round(step * 0.1 + i * 0.001, 6)


def zips(env) -> list[Path]:
    return sorted(Path(env["COMET_OFFLINE_DIRECTORY"]).glob("*.zip"))


def assert_uploadable(archive: Path) -> None:
    """Validate an offline archive with the JSON schemas ``comet upload`` checks it against (no network)."""
    from comet_ml import schemas

    validators = {  # message type -> validator of its payload, as in comet_ml.offline.OfflineSender
        "metric_msg": schemas.get_metric_msg_validator(),
        "parameter_msg": schemas.get_parameter_msg_validator(),
        "log_other": schemas.get_log_other_msg_validator(),
        "file_upload": schemas.get_upload_msg_validator(),
    }
    with zipfile.ZipFile(archive) as z:
        schemas.get_experiment_file_validator().validate(json.loads(z.read("experiment.json")))
        for line in z.read("messages.json").decode().splitlines():
            message = json.loads(line)
            validators[message["type"]].validate(message["payload"])
            if message["type"] == "file_upload":
                assert message["payload"]["file_path"] in z.namelist()


def same(a, b) -> bool:
    """Equality where NaN equals NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


# -- metrics, config, status -----------------------------------------------------------------------
def test_metrics_config_status_round_trip(tracker_dirs):
    env = tracker_dirs
    info = make_run_info(env)
    sink = registry.create("comet", {})  # the alias resolves to this sink, options all default
    assert isinstance(sink, CometSink)
    sink.open(info)
    records = [
        MetricsRecord(seq=s + 1, step=s, time=1000.0 + s, values={k: value_of(s, i) for i, k in enumerate(GRPO_KEYS)})
        for s in range(12)
    ]
    sink.write_metrics(records[:6])
    sink.write_metrics(records[6:])
    # a step that goes back, special floats, and a name longer than Comet's 100 characters
    long_name = "rewards/" + "very_long_reward_function_name_" * 4 + "/mean"
    sink.write_metrics(
        [
            MetricsRecord(
                seq=13,
                step=3,
                time=2000.0,
                values={"reward": -7.5, "kl": math.nan, "loss": math.inf, "entropy": -math.inf, long_name: 0.25},
            )
        ]
    )
    sink.flush()
    sink.close("finished")

    archives = zips(env)
    assert len(archives) == 1 and archives[0].name.startswith(experiment_key(info) + "-")
    assert_uploadable(archives[0])
    back = read_back("comet_ml", env, info)

    expected_reward = [(s, value_of(s, 0)) for s in range(12)] + [(3, -7.5)]
    assert back.metrics["reward"] == expected_reward  # stored order, the backwards step 3 included, at the end
    assert back.metrics["rewards/accuracy/mean"] == [(s, value_of(s, 2)) for s in range(12)]
    assert back.metrics["clip_ratio/low_mean"] == [(s, value_of(s, 4)) for s in range(12)]
    assert math.isnan(back.metrics["kl"][-1][1]) and back.metrics["kl"][-1][0] == 3
    assert back.metrics["loss"][-1] == (3, math.inf)
    assert back.metrics["entropy"] == [(3, -math.inf)]
    short = comet_name(long_name)
    assert len(short) == 100 and short != long_name[:100] and back.metrics[short] == [(3, 0.25)]
    assert "process duration" not in back.metrics and "curr_step" not in back.config

    assert back.config == {
        "learning_rate": 1e-6,
        "model/name": "tiny-qwen",
        "beta": 0.0,
        "report_to": "comet_ml",
        "hub_token": "***",
        "seed": None,
        "bf16": True,
    }
    assert back.status == "finished"
    assert back.tables == {}

    with zipfile.ZipFile(archives[0]) as z:
        meta = json.loads(z.read("experiment.json"))
        raw = [json.loads(line) for line in z.read("messages.json").decode().splitlines()]
    assert meta["project_name"] == "grpo-math" and sorted(meta["tags"]) == ["grpo", "rl"]  # Comet keeps tags as a set
    assert meta["offline_id"] == experiment_key(info)
    others = {m["payload"]["key"]: m["payload"]["value"] for m in raw if m["type"] == "log_other"}
    assert others["Name"] == "grpo-run" and others["rllog_run_id"] == "0badcafe" and others["rllog_status"] == "finished"
    # NaN/inf are stored by Comet as JSON strings
    kl_nan = [m for m in raw if m["type"] == "metric_msg" and m["payload"]["metric"]["metricName"] == "kl"][-1]
    assert kl_nan["payload"]["metric"]["metricValue"] == "NaN"
    # nothing about the delivery process itself (source, argv, stdout, env, git) went into the experiment
    assert {m["type"] for m in raw} == {"log_other", "parameter_msg", "metric_msg"}
    assert not (Path(info.run_dir) / "comet_ml").exists()  # the session marker is gone once the zip exists


def test_records_of_one_step_go_in_one_call_unless_a_key_repeats(tracker_dirs, monkeypatch):
    """TRL logs each profiling timing as its own record (~9 a step): Comet gets one ``log_metrics`` per step, a
    repeated key starting a new call, and every value lands at its step, in order."""
    env = tracker_dirs
    info = make_run_info(env)
    sink = CometSink()
    sink.open(info)
    calls: list[tuple[int, list[str]]] = []
    experiment = sink._require_open()
    real = experiment.log_metrics
    monkeypatch.setattr(
        experiment, "log_metrics", lambda values, step: (calls.append((step, sorted(values))), real(values, step=step))
    )
    t = "profiling/generate"
    sink.write_metrics(
        [
            MetricsRecord(seq=1, step=7, time=1.0, values={t: 0.5}),
            MetricsRecord(seq=2, step=7, time=1.0, values={"profiling/logps": 0.25}),
            MetricsRecord(seq=3, step=7, time=1.0, values={}),
            MetricsRecord(seq=4, step=7, time=1.0, values={"profiling/logps": 0.125}),  # repeats: a new call
            MetricsRecord(seq=5, step=7, time=1.0, values={"loss": 1.5}),
            MetricsRecord(seq=6, step=8, time=1.0, values={t: 0.0625}),  # another step
        ]
    )
    sink.close("finished")
    assert calls == [
        (7, ["profiling/generate", "profiling/logps"]),
        (7, ["loss", "profiling/logps"]),
        (8, ["profiling/generate"]),
    ]
    back = read_back("comet_ml", env, info)
    assert back.metrics == {t: [(7, 0.5), (8, 0.0625)], "profiling/logps": [(7, 0.25), (7, 0.125)], "loss": [(7, 1.5)]}


def test_config_limits(tracker_dirs):
    env = tracker_dirs
    long_key = "trainer/" + "k" * 120
    config = {"notes": "x" * 1500, long_key: 3, "exact": "y" * 1000, "ratio": 0.5}
    info = make_run_info(env, config=config, tags=())
    sink = CometSink()
    sink.open(info)
    sink.close("failed")
    back = read_back("comet_ml", env, info)
    assert back.config["notes"] == "x" * 988 + " [truncated]" and len(back.config["notes"]) == 1000
    assert back.config["exact"] == "y" * 1000
    assert back.config[comet_name(long_key)] == 3 and len(comet_name(long_key)) == 100
    assert back.config["ratio"] == 0.5
    assert back.status == "failed"
    assert back.metrics == {}


# -- tables -----------------------------------------------------------------------------------------
def test_tables_round_trip_with_types_and_new_columns(tracker_dirs):
    env = tracker_dirs
    info = make_run_info(env)
    first = pa.table(
        {
            "prompt": ["What is 2+2?", 'quote " comma , newline\nend', "unicode: é ✓ 数学", ""],
            "completion": ["4", "5", "<|im_end|>", "  spaced  "],
            "reward": [1.0, 0.0, math.nan, -0.5],
            "advantage": [0.1234567890123, None, 2.0, -1e-12],
            "tokens": [3, 17, None, 0],
            "correct": [True, False, None, True],
        }
    )
    second = pa.table(
        {
            "prompt": ["a", "b"],
            "completion": ["1", None],  # a string column with a null
            "reward": [0.5, 0.25],
            "rewards/format": [1.0, 0.0],  # a new column
            "ids": [[1, 2, 3], []],  # a list column
        }
    )
    sink = CometSink()
    sink.open(info)
    sink.write_metrics([MetricsRecord(seq=1, step=0, time=0.0, values={"reward": 0.5})])
    sink.write_table(TableRecord(seq=2, step=0, time=0.0, name="completions", table=first))
    sink.write_table(TableRecord(seq=3, step=20, time=0.0, name="completions", table=second))
    sink.write_table(TableRecord(seq=4, step=20, time=0.0, name="eval/samples", table=pa.table({"x": pa.array([], pa.int64())})))
    # Names that a plain character replacement would make one asset name with "eval/samples" at this step.
    sink.write_table(TableRecord(seq=5, step=20, time=0.0, name="eval_samples", table=pa.table({"x": [1]})))
    sink.write_table(TableRecord(seq=6, step=20, time=0.0, name="eval__samples", table=pa.table({"x": [2]})))
    sink.write_table(TableRecord(seq=7, step=20, time=0.0, name="eval samples", table=pa.table({"x": [3]})))
    sink.close("finished")

    assert_uploadable(zips(env)[0])
    back = read_back("comet_ml", env, info)
    assert [step for step, _ in back.tables["completions"]] == [0, 20]
    for (_, rows), table in zip(back.tables["completions"], (first, second), strict=True):
        expected = table.to_pylist()
        assert [list(r) for r in rows] == [list(r) for r in expected]  # same columns, same order
        for got, want in zip(rows, expected, strict=True):
            assert all(same(got[k], want[k]) for k in want), (got, want)
            assert all(type(got[k]) is type(want[k]) for k in want), (got, want)
    assert back.tables["eval/samples"] == [(20, [])]
    assert [back.tables[n] for n in ("eval_samples", "eval__samples", "eval samples")] == [[(20, [{"x": i}])] for i in (1, 2, 3)]

    # what Comet shows: a CSV asset per table and step
    with zipfile.ZipFile(zips(env)[0]) as z:
        uploads = [
            json.loads(line)["payload"] for line in z.read("messages.json").decode().splitlines() if '"file_upload"' in line
        ]
        names = [u["additional_params"]["fileName"] for u in uploads]
        assert names[:5] == [
            "completions_step_000000.csv",
            "completions_step_000020.csv",
            "eval__samples_step_000020.csv",
            "eval_samples_step_000020.csv",
            f"eval__samples-{hashlib.sha1(b'eval__samples').hexdigest()[:8]}_step_000020.csv",
        ]
        assert len(set(names)) == len(names) == 6  # one asset per table name and step
        first_csv = z.read(uploads[0]["file_path"]).decode()
        second_csv = z.read(uploads[1]["file_path"]).decode()
    assert first_csv == (
        "prompt,completion,reward,advantage,tokens,correct\r\n"
        "What is 2+2?,4,1.0,0.1234567890123,3,True\r\n"
        '"quote "" comma , newline\nend",5,0.0,,17,False\r\n'
        "unicode: é ✓ 数学,<|im_end|>,nan,2.0,,\r\n"
        ",  spaced  ,-0.5,-1e-12,0,True\r\n"
    )
    assert second_csv.splitlines()[0] == "prompt,completion,reward,rewards/format,ids"
    assert second_csv.splitlines()[2] == "b,null,0.25,0.0,[]"  # a string column with a null, a list column: JSON
    assert uploads[1]["metadata"] == {
        "rllog_table": "completions",
        "rllog_columns": [
            ["prompt", "str"],
            ["completion", "json"],
            ["reward", "float"],
            ["rewards/format", "float"],
            ["ids", "json"],
        ],
    }


# -- resuming the same experiment, recovering a killed session --------------------------------------
def test_reopen_adds_an_archive_of_the_same_experiment(tracker_dirs):
    """A reopen continues the experiment: the contract suite. Here: one archive per session, one key per run."""
    env = tracker_dirs
    info = make_run_info(env)
    sink = CometSink()
    sink.open(info)
    sink.write_metrics([MetricsRecord(seq=s + 1, step=s, time=0.0, values={"reward": float(s)}) for s in range(3)])
    sink.close("killed")
    again = CometSink()  # e.g. `rllog replay` later, in another process
    again.open(info)
    again.write_metrics([MetricsRecord(seq=s + 1, step=s, time=0.0, values={"reward": float(s)}) for s in range(3, 5)])
    again.close("finished")

    archives = zips(env)
    assert len(archives) == 2 and all(a.name.startswith(experiment_key(info) + "-") for a in archives)
    # what finish and `rllog show` print: each session's archive (what `comet upload` takes), oldest first
    where = dict(field.split("=", 1) for field in tracker_location(info.run_dir, "comet_ml").split(" "))
    assert sorted(where["offline_archives"].split(",")) == [str(a) for a in archives]
    other = make_run_info(env, name="other-run", run_id="12345678")
    assert experiment_key(other) != experiment_key(info)
    assert read_back("comet_ml", env, other).metrics == {}


def _run_child(code: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=timeout
    )


CHILD_PRELUDE = """
    import json, math, os, signal, sys
    sys.path.insert(0, {tests!r})
    from rllog.records import MetricsRecord, RunInfo
    import rllog_backends.comet as comet
    info = RunInfo(**json.loads({info!r}))
"""


def _prelude(info: RunInfo) -> str:
    data = {
        "project": info.project,
        "name": info.name,
        "run_dir": info.run_dir,
        "run_id": info.run_id,
        "config": dict(info.config),
        "tags": list(info.tags),
    }
    return CHILD_PRELUDE.format(tests=str(ROOT / "tests"), info=json.dumps(data))


def test_killed_session_is_recovered_on_next_open(tracker_dirs):
    """The delivery process is SIGKILLed after a flush: the next open archives what Comet had written."""
    env = tracker_dirs
    info = make_run_info(env)
    child = _run_child(
        _prelude(info)
        + """
    sink = comet.CometSink()
    sink.open(info)
    sink.write_metrics([MetricsRecord(seq=s + 1, step=s, time=0.0, values={"reward": s / 4}) for s in range(4)])
    sink.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    """,
        dict(os.environ),
    )
    assert child.returncode == -9, child.stderr
    (empty,) = zips(env)  # Comet created its archive at start and fills it only at end
    assert zipfile.ZipFile(empty).namelist() == []
    markers = list((Path(info.run_dir) / "comet_ml").glob("pending-*.json"))
    assert len(markers) == 1
    tmpdir = Path(json.loads(markers[0].read_text())["tmpdir"])
    assert (tmpdir / "messages.json").is_file()

    sink = CometSink()
    sink.open(info)
    sink.write_metrics([MetricsRecord(seq=5, step=4, time=0.0, values={"reward": 1.0})])
    sink.close("finished")

    back = read_back("comet_ml", env, info)
    assert back.metrics["reward"] == [(0, 0.0), (1, 0.25), (2, 0.5), (3, 0.75), (4, 1.0)]
    assert back.config["learning_rate"] == 1e-6
    assert back.status == "finished"
    assert empty in zips(env) and len(zips(env)) == 2  # the killed session's archive, now filled
    for archive in zips(env):
        assert_uploadable(archive)
    assert not tmpdir.exists() and not markers[0].exists()


# -- no network, no auto-logging, in a fresh delivery-like process ----------------------------------
def test_offline_sink_blocks_the_cloud_probe_and_auto_logging(tracker_dirs):
    """In a fresh process (where no test patch applies) the sink alone keeps Comet off the network.

    Control: the same process with the sink's countermeasure removed and comet_ml imported without
    COMET_DISABLE_AUTO_LOGGING does connect to 169.254.169.254 and does install Comet's import hooks.
    """
    env = tracker_dirs
    tmp = Path(env["tmp"])
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("COMET_DISABLE_AUTO_LOGGING", "COMET_ERROR_TRACKING_ENABLE", "COMET_AUTO_LOG_ENV_HOST")
    }
    report = """
    sink.write_metrics([MetricsRecord(seq=1, step=0, time=0.0, values={"reward": 0.5})])
    sink.close("finished")
    finders = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "CometModuleFinder"]
    print(json.dumps({"finders": finders}))
    """
    control_info = make_run_info(env, name="control", run_id="c0000001")
    control = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                _prelude(control_info)
                + """
    import comet_ml                              # imported first: the sink does not set its env
    comet._block_cloud_probe = lambda c: None    # the countermeasure removed
    sink = comet.CometSink(log_env_details=True)
    sink.open(info)
    """
                + report
            ),
        ],
        env=base | {"RLLOG_NETGUARD_LOG": str(tmp / "control.netlog")},
        cwd=str(ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sink_info = make_run_info(env, name="guarded", run_id="90000001")
    guarded = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                _prelude(sink_info)
                + """
    assert "comet_ml" not in sys.modules         # importing the backend does not import the tracker
    sink = comet.CometSink(log_env_details=True) # environment details on: the probe would run
    sink.open(info)
    assert os.environ["COMET_DISABLE_AUTO_LOGGING"] == "1"
    """
                + report
            ),
        ],
        env=base | {"RLLOG_NETGUARD_LOG": str(tmp / "guarded.netlog")},
        cwd=str(ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    c_out, c_err = control.communicate(timeout=120)
    g_out, g_err = guarded.communicate(timeout=120)
    assert control.returncode == 0, c_err
    assert guarded.returncode == 0, g_err

    control_net = (tmp / "control.netlog").read_text() if (tmp / "control.netlog").exists() else ""
    assert "169.254.169.254" in control_net  # the guard does see Comet's probe
    assert json.loads(c_out.splitlines()[-1])["finders"] == ["CometModuleFinder"]

    assert not (tmp / "guarded.netlog").exists(), (tmp / "guarded.netlog").read_text()
    assert json.loads(g_out.splitlines()[-1])["finders"] == []
    back = read_back("comet_ml", env, sink_info)
    assert back.metrics == {"reward": [(0, 0.5)]}  # Comet's own "process duration" (logged outside pytest) left out
    assert back.status == "finished"


# -- error mapping ----------------------------------------------------------------------------------
def _response(status: int, headers: dict | None = None) -> requests.Response:
    response = requests.Response()
    response.status_code = status
    response.url = "https://www.comet.com/api/rest/v2/write/experiment/metric"
    response.headers.update(headers or {})
    response._content = b'{"msg": "test"}'
    return response


def _comet_exceptions():
    from comet_ml.exceptions import CometRestApiException, FileUploadThrottledException

    return CometRestApiException, FileUploadThrottledException


@pytest.mark.parametrize(
    "make, expected, retry_after",
    [
        (lambda E, F: E("POST", _response(429, {"Retry-After": "7"})), RateLimited, 7.0),
        (lambda E, F: E("POST", _response(429, {"Retry-After-Custom": "2.5"})), RateLimited, 2.5),
        (lambda E, F: F(_response(429)), RateLimited, None),
        (lambda E, F: requests.HTTPError("too many", response=_response(429, {"Retry-After": "3"})), RateLimited, 3.0),
        (lambda E, F: E("POST", _response(503)), TransientError, None),
        (lambda E, F: E("GET", _response(500)), TransientError, None),
        (lambda E, F: requests.ConnectionError("connection reset"), TransientError, None),
        (lambda E, F: requests.Timeout("read timed out"), TransientError, None),
        (lambda E, F: ConnectionResetError("reset"), TransientError, None),
        (lambda E, F: E("POST", _response(400)), None, None),
        (lambda E, F: E("POST", _response(404)), None, None),
        (lambda E, F: ValueError("bad value"), None, None),
    ],
)
def test_map_error(make, expected, retry_after):
    exc = make(*_comet_exceptions())
    mapped = map_error(exc)
    if expected is None:
        assert mapped is None
        return
    assert type(mapped) is expected
    if expected is RateLimited:
        assert mapped.retry_after == retry_after
    else:
        assert not isinstance(mapped, RateLimited)


def test_errors_raised_by_comet_are_mapped_and_the_retry_lands_once(tracker_dirs, monkeypatch):
    env = tracker_dirs
    CometRestApiException, _ = _comet_exceptions()
    import comet_ml

    info = make_run_info(env)
    real_start = comet_ml.start
    monkeypatch.setattr(comet_ml, "start", lambda *a, **k: (_ for _ in ()).throw(requests.ConnectionError("no route")))
    sink = CometSink()
    with pytest.raises(TransientError):
        sink.open(info)
    monkeypatch.setattr(comet_ml, "start", real_start)
    sink.open(info)  # the delivery layer repeats the call

    experiment = sink._experiment
    real_log = experiment.log_metrics
    failures = [
        CometRestApiException("POST", _response(429, {"Retry-After": "4"})),
        CometRestApiException("POST", _response(502)),
    ]

    def flaky(*args, **kwargs):
        if failures:
            raise failures.pop(0)
        return real_log(*args, **kwargs)

    monkeypatch.setattr(experiment, "log_metrics", flaky)
    batch = [MetricsRecord(seq=1, step=0, time=0.0, values={"reward": 0.5})]
    with pytest.raises(RateLimited) as limited:
        sink.write_metrics(batch)
    assert limited.value.retry_after == 4.0
    with pytest.raises(TransientError):
        sink.write_metrics(batch)
    sink.write_metrics(batch)

    monkeypatch.setattr(experiment, "log_asset_data", lambda *a, **k: (_ for _ in ()).throw(ValueError("not retryable")))
    with pytest.raises(ValueError):  # anything else propagates unchanged
        sink.write_table(TableRecord(seq=2, step=0, time=0.0, name="t", table=pa.table({"a": [1]})))
    sink.close("finished")

    back = read_back("comet_ml", env, info)
    assert back.metrics == {"reward": [(0, 0.5)]}
    assert back.tables == {}


# -- Comet's own conventions, and what Comet records about the process -------------------------------
COMET_VARIABLES = {"COMET_PROJECT_NAME": "env-project", "COMET_WORKSPACE": "env-team", "COMET_EXPERIMENT_KEY": "e" * 32}


def experiment_files(env) -> list[dict]:
    found = []
    for path in zips(env):
        with zipfile.ZipFile(path) as z:
            found.append(json.loads(z.read("experiment.json")))
    return sorted(found, key=lambda e: e["start_time"])


def test_comet_variables_apply_when_the_code_gives_no_value(tracker_dirs, monkeypatch):
    """``rllog.init`` with its default project: Comet's variables decide (project, workspace, experiment key);
    a replay from a shell without them continues the same experiment."""
    env = tracker_dirs
    for name, val in COMET_VARIABLES.items():
        monkeypatch.setenv(name, val)
    info = RunInfo("rllog", "run-0badcafe", str(Path(env["tmp"]) / "run"), "0badcafe")  # rllog.init's defaults
    sink = CometSink()
    sink.open(info)
    sink.write_metrics([MetricsRecord(seq=1, step=0, time=0.0, values={"reward": 0.5})])
    sink.close("killed")
    for name in COMET_VARIABLES:
        monkeypatch.delenv(name)
    sink = CometSink()  # `rllog replay` from another shell
    sink.open(info)
    sink.write_metrics([MetricsRecord(seq=2, step=1, time=0.0, values={"reward": 0.75})])
    sink.close("finished")

    sessions = [(e["offline_id"], e["project_name"], e["workspace"]) for e in experiment_files(env)]
    assert sessions == [("e" * 32, "env-project", "env-team")] * 2
    assert read_back("comet_ml", env, info).metrics["reward"] == [(0, 0.5), (1, 0.75)]


def test_explicit_values_win_over_comet_variables(tracker_dirs, monkeypatch):
    env = tracker_dirs
    for name, val in COMET_VARIABLES.items():
        monkeypatch.setenv(name, val)
    info = make_run_info(env)  # project "grpo-math" given to rllog.init
    sink = CometSink(workspace="option-team", experiment_key="k" * 40)
    sink.open(info)
    sink.close("finished")
    [session] = experiment_files(env)
    assert (session["offline_id"], session["project_name"], session["workspace"]) == ("k" * 40, "grpo-math", "option-team")


def test_comet_records_nothing_of_the_delivery_process(tracker_dirs):
    """No system metrics, no installed or OS packages: they would describe rllog's delivery process (rllog
    sends the trainer's own ``system/...`` metrics). Control: with ``log_env_details`` Comet records them."""
    env = tracker_dirs

    def recorded(sink, run_id):
        info = make_run_info(env, name=run_id, run_id=run_id)
        sink.open(info)
        sink.write_metrics([MetricsRecord(seq=1, step=0, time=0.0, values={"system/memory_rss_mb": 584.0})])
        sink.close("finished")
        [archive] = [p for p in zips(env) if run_id in zipfile.ZipFile(p).read("messages.json").decode()]
        with zipfile.ZipFile(archive) as z:
            messages = [json.loads(line) for line in z.read("messages.json").decode().splitlines()]
        metrics = {m["payload"]["metric"]["metricName"] for m in messages if m["type"] == "metric_msg"}
        return {m["type"] for m in messages}, {name for name in metrics if name.startswith("sys.")}, metrics

    kinds, comet_system, metrics = recorded(CometSink(), "default0")
    assert not comet_system and not kinds & {"installed_packages", "os_packages"}
    assert "system/memory_rss_mb" in metrics
    kinds, comet_system, _ = recorded(CometSink(log_env_details=True), "control0")
    assert comet_system and kinds & {"installed_packages", "os_packages"}
