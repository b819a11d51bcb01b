"""Run, values, tables, steps, records and the sink protocol, observed through the parquet files."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from sinks import MemorySink

import rllog
from rllog.delivery import RetryPolicy
from rllog.errors import InvalidKey, InvalidStep, InvalidTable, InvalidValue, RunDirError, RunFinished
from rllog.records import MetricsRecord, RunInfo, TableRecord
from rllog.sink import MetricSink


def metrics_by_key(run_dir):
    out = {}
    for row in rllog.read_metrics(run_dir).to_pylist():
        out.setdefault(row["key"], []).append((row["step"], row["value"]))
    return out


def parquet_status(run_dir):
    return json.loads((run_dir / "parquet" / "meta.json").read_text())["status"]


def test_import_rllog_is_light():
    code = "import sys, rllog, rllog.run, rllog.delivery, rllog.registry, rllog_backends.parquet; print(sorted(m for m in ('torch','trl','transformers','wandb','mlflow','trackio','comet_ml','tensorboard','matplotlib','pandas') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_log_values_of_every_accepted_kind_reach_parquet(tmp_path):
    torch = pytest.importorskip("torch")
    run = rllog.init(run_dir=tmp_path / "r", config={"lr": 0.1})
    run.log(
        {
            "py_float": 0.25,
            "py_int": 3,
            "flag": True,
            "np_f32": np.float32(1.5),
            "np_i64": np.int64(7),
            "np_bool": np.bool_(False),
            "np_0d": np.array(2.5),
            "t0d": torch.tensor(0.75),
            "t_bf16": torch.tensor(2.0, dtype=torch.bfloat16),
            "t_int": torch.tensor(5),
            "nested": {"a": 1.0, "b": {"c": 2.0}},
            "nan": math.nan,
            "inf": math.inf,
            "ninf": -math.inf,
        },
        step=4,
    )
    assert run.finish().ok
    got = {k: v for k, [(s, v)] in metrics_by_key(tmp_path / "r").items()}
    assert {k: v for k, v in got.items() if k not in ("nan",)} == {
        "py_float": 0.25,
        "py_int": 3.0,
        "flag": 1.0,
        "np_f32": 1.5,
        "np_i64": 7.0,
        "np_bool": 0.0,
        "np_0d": 2.5,
        "t0d": 0.75,
        "t_bf16": 2.0,
        "t_int": 5.0,
        "nested/a": 1.0,
        "nested/b/c": 2.0,
        "inf": math.inf,
        "ninf": -math.inf,
    }
    assert math.isnan(got["nan"])
    assert {s for [(s, _)] in metrics_by_key(tmp_path / "r").values()} == {4}


@pytest.mark.parametrize(
    "value, type_name", [("0.5", "str"), ([1.0], "list"), (None, "NoneType"), (1 + 2j, "complex"), (object(), "object")]
)
def test_invalid_values_name_the_key_and_the_type(tmp_path, value, type_name):
    with rllog.init(report_to="none", run_dir=tmp_path / "r") as run:
        with pytest.raises(InvalidValue, match=rf"'bad'.*{type_name}"):
            run.log({"ok": 1.0, "bad": value})
        run.log({"ok": 2.0}, step=1)
    assert run.step == 1  # the rejected call consumed no step


def test_multi_element_tensor_is_rejected_with_its_shape(tmp_path):
    torch = pytest.importorskip("torch")
    with rllog.init(report_to="none", run_dir=tmp_path / "r") as run:
        with pytest.raises(InvalidValue, match=r"'t'.*\(2,\)"):
            run.log({"t": torch.tensor([1.0, 2.0])})


@pytest.mark.parametrize("values", [{"": 1.0}, {3: 1.0}, {"a": {"": 1.0}}])
def test_invalid_keys(tmp_path, values):
    with rllog.init(report_to="none", run_dir=tmp_path / "r") as run:
        with pytest.raises(InvalidKey):
            run.log(values)


def test_steps_default_explicit_and_backwards_are_all_delivered(tmp_path):
    run = rllog.init(run_dir=tmp_path / "r")
    run.log({"x": 0.0})  # 0
    run.log({"x": 1.0})  # 1
    run.log({"x": 10.0}, step=10)
    run.log({"x": 11.0})  # 11
    run.log({"x": 5.0}, step=5)  # backwards: kept
    run.log({"x": 6.0})  # 6
    run.log({"x": 7.0}, step=np.int64(7))
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(InvalidStep):
            run.log({"x": 0.0}, step=bad)
    run.finish()
    assert metrics_by_key(tmp_path / "r")["x"] == [(0, 0.0), (1, 1.0), (10, 10.0), (11, 11.0), (5, 5.0), (6, 6.0), (7, 7.0)]


def test_tables_in_every_input_form_and_growing_schema(tmp_path):
    run = rllog.init(run_dir=tmp_path / "r")
    run.log({"reward": 0.5}, step=3)
    run.log_table("completions", {"prompt": ["p1", "p2"], "completion": ["c1", "c2"], "reward": [1.0, 0.0]})  # step 3
    run.log_table("completions", [{"prompt": "p3", "completion": "c3", "reward": 0.5, "advantage": -0.1}], step=4)
    run.log_table("completions", pa.table({"prompt": ["p4"], "completion": ["c4"], "reward": [2.0]}), step=5)
    run.log_table("completions", pd.DataFrame({"prompt": ["p5"], "completion": ["c5"], "reward": [3.0]}), step=6)
    run.log_table("eval/samples", {"text": ["x"]}, step=6)
    assert run.finish().ok
    rows = rllog.read_table(tmp_path / "r", "completions").to_pylist()
    assert [(r["_step"], r["prompt"], r["reward"], r["advantage"]) for r in rows] == [
        (3, "p1", 1.0, None),
        (3, "p2", 0.0, None),
        (4, "p3", 0.5, -0.1),
        (5, "p4", 2.0, None),
        (6, "p5", 3.0, None),
    ]
    assert rllog.read_table(tmp_path / "r", "eval/samples").column("text").to_pylist() == ["x"]
    # pandas and duckdb read the files directly
    df = pd.read_parquet(tmp_path / "r" / "parquet" / "tables" / "completions")
    assert sorted(df["prompt"]) == ["p1", "p2", "p3", "p4", "p5"]
    duckdb = pytest.importorskip("duckdb")
    path = str(tmp_path / "r" / "parquet" / "metrics" / "*.parquet")
    assert duckdb.sql(f"select key, step, value from read_parquet('{path}')").fetchall() == [("reward", 3, 0.5)]


def test_ragged_and_bad_tables_raise_invalid_table(tmp_path):
    with rllog.init(report_to="none", run_dir=tmp_path / "r") as run:
        with pytest.raises(InvalidTable, match=r"prompt=2, reward=3"):
            run.log_table("completions", {"prompt": ["a", "b"], "reward": [1, 2, 3]})
        with pytest.raises(InvalidTable, match="mixes"):
            run.log_table("mixed", {"col": [1, "two"]})
        with pytest.raises(InvalidTable, match="reserved"):
            run.log_table("t", {"_step": [1]})
        with pytest.raises(InvalidTable, match="expected a dict"):
            run.log_table("t", "not a table")
        with pytest.raises(InvalidKey):
            run.log_table("", {"a": [1]})


def test_context_manager_statuses_and_log_after_finish(tmp_path):
    with rllog.init(run_dir=tmp_path / "ok") as run:
        run.log({"x": 1.0})
    assert parquet_status(tmp_path / "ok") == "finished"
    with pytest.raises(RunFinished):
        run.log({"x": 2.0})
    assert run.finish() is run.finish()  # finishing twice returns the same report
    with pytest.raises(ZeroDivisionError):
        with rllog.init(run_dir=tmp_path / "bad") as run:
            run.log({"x": 1.0})
            raise ZeroDivisionError
    assert parquet_status(tmp_path / "bad") == "failed"
    assert metrics_by_key(tmp_path / "bad") == {"x": [(0, 1.0)]}


@pytest.mark.parametrize("crash, status", [("", "finished"), ("raise SystemError('boom')", "failed")])
def test_unfinished_run_is_finished_at_interpreter_exit(tmp_path, crash, status):
    script = f"import rllog\nrun = rllog.init(run_dir={str(tmp_path / 'r')!r})\nrun.log({{'x': 42.0}}, step=3)\n{crash}\n"
    subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert parquet_status(tmp_path / "r") == status
    assert metrics_by_key(tmp_path / "r") == {"x": [(3, 42.0)]}


def test_records_are_immutable():
    r = MetricsRecord(1, 2, 3.0, {"a": 1.0})
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.step = 5
    with pytest.raises(TypeError):
        r.values["a"] = 2.0
    info = RunInfo("p", "n", "/tmp/x", "id", {"lr": 1})
    with pytest.raises(TypeError):
        info.config["lr"] = 2
    t = TableRecord(1, 2, 3.0, "t", pa.table({"a": [1]}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.name = "u"


def test_protocol_is_structural_and_sink_objects_are_used_directly(tmp_path):
    sink = MemorySink()
    assert isinstance(sink, MetricSink)
    assert not isinstance(object(), MetricSink)
    run = rllog.init(
        report_to=[sink, "parquet"], run_dir=tmp_path / "r", config={"hub_token": "hf_secret", "nested": {"lr": 0.1}}
    )
    for i in range(5):
        run.log({"x": float(i)})
    run.log_table("t", {"a": [1, 2]})
    report = run.finish()
    assert set(report) == {"memorysink", "parquet"} and report.ok
    assert [r.values["x"] for r in sink.metrics] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [(t.step, t.table.column("a").to_pylist()) for t in sink.tables] == [(4, [1, 2])]
    assert sink.closed_with == "finished"
    assert dict(sink.opened.config) == {"hub_token": "***REDACTED***", "nested/lr": 0.1}
    assert json.loads((tmp_path / "r" / "parquet" / "meta.json").read_text())["config"]["hub_token"] == "***REDACTED***"


def test_optional_protocol_members_are_optional_and_capabilities_must_match_methods(tmp_path):
    from rllog.errors import InvalidSink

    class Minimal:  # no flush, no write_table, no write_alert: metrics only, written through
        capabilities = rllog.Capabilities(tables=False)

        def __init__(self):
            self.got = []

        def open(self, run_info):
            pass

        def write_metrics(self, records):
            self.got += [r.values["x"] for r in records]

        def close(self, status):
            self.status = status

    minimal = Minimal()
    run = rllog.init(report_to=[minimal], run_dir=tmp_path / "r")
    run.log({"x": 1.0})
    run.log_table("t", {"a": [1]})  # a sink that takes no tables acknowledges them
    report = run.finish()
    assert report.ok and minimal.got == [1.0] and minimal.status == "finished" and report["minimal"].delivered == 2

    class ClaimsAlerts(Minimal):
        capabilities = rllog.Capabilities(tables=False, alerts=True)

    with pytest.raises(InvalidSink, match=r"capabilities\.alerts but has no write_alert"):
        rllog.init(report_to=[ClaimsAlerts()], run_dir=tmp_path / "r2")


def test_run_dir_that_is_not_writable_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(RunDirError):
        rllog.init(run_dir=blocker / "sub")


def test_run_dir_holding_a_run_is_refused(tmp_path):
    with rllog.init(report_to="none", run_dir=tmp_path / "r") as run:
        run.log({"x": 1.0})
    with pytest.raises(RunDirError, match=r"already holds run 'run-\w+' \(id \w+\); continue it with .*resume='must'") as raised:
        rllog.init(run_dir=tmp_path / "r")
    assert "replay" not in str(raised.value)  # replay delivers a run again; it does not continue one


def test_module_level_log_uses_the_current_run(tmp_path):
    run = rllog.init(run_dir=tmp_path / "r")
    assert rllog.current_run() is run
    rllog.log({"a": 1.0}, step=2)
    rllog.log_table("t", {"c": [1]})
    run.finish()
    assert metrics_by_key(tmp_path / "r") == {"a": [(2, 1.0)]}
    assert rllog.read_table(tmp_path / "r", "t").column("_step").to_pylist() == [2]


def test_retry_policy_object_is_kept(tmp_path):
    run = rllog.init(report_to="none", run_dir=tmp_path / "r", retry=RetryPolicy(base=0.01, cap=0.1, give_up_after=5))
    assert json.loads((tmp_path / "r" / "run.json").read_text())["retry"] == {"base": 0.01, "cap": 0.1, "give_up_after": 5}
    run.finish()


def test_parquet_store_is_parquet_only_after_close_and_columns_grow(tmp_path):
    from rllog_backends.parquet import ParquetSink

    sink = ParquetSink()
    sink.open(RunInfo("p", "n", str(tmp_path), "id"))
    for i in range(6):  # six flushes: appended to each directory's tail
        sink.write_metrics([MetricsRecord(2 * i + 1, i, 0.0, {"x": float(i)})])
        sink.write_table(TableRecord(2 * i + 2, i, 0.0, "t", pa.table({"a": [i]} if i < 3 else {"a": [i], "b": ["new"]})))
        sink.flush()
        assert rllog.read_metrics(tmp_path).num_rows == i + 1  # readable at once
    sink.close("finished")
    assert [p.name.startswith("part-") for p in (tmp_path / "parquet" / "metrics").iterdir()] == [True]
    assert all(p.suffix == ".parquet" for p in (tmp_path / "parquet" / "tables" / "t").iterdir())
    assert rllog.read_metrics(tmp_path).column("value").to_pylist() == [float(i) for i in range(6)]
    table = rllog.read_table(tmp_path, "t")
    assert table.column("a").to_pylist() == list(range(6)) and table.column("b").to_pylist() == [None] * 3 + ["new"] * 3
    import pandas as pd

    assert pd.read_parquet(tmp_path / "parquet" / "metrics")["value"].tolist() == [float(i) for i in range(6)]


def test_no_import_cycle_in_rllog():
    """Data flows one way: no module of rllog/ imports (even lazily) one that imports it back."""
    import ast
    from pathlib import Path

    root = Path(rllog.__file__).parent
    names = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__") for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rllog"):
                deps |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in names} or {node.module}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in names}
        graph[name] = {d for d in deps if d != name and d != "rllog"}

    def reaches(start: str, target: str, seen: set) -> bool:
        for dep in graph.get(start, ()):
            if dep == target or (dep not in seen and not seen.add(dep) and reaches(dep, target, seen)):
                return True
        return False

    cycles = sorted(name for name in graph if reaches(name, name, set()))
    assert cycles == [], cycles


@dataclasses.dataclass
class _Optim:
    lr: float = 0.1
    betas: tuple = (0.9, 0.99)


def test_a_dataclass_or_namespace_inside_the_config_is_flattened_like_a_dict(tmp_path):
    """Lightning's ``save_hyperparameters()`` keeps a dataclass argument whole; its MLflow and TensorBoard loggers
    flatten it (``optim/lr``). rllog stored its ``repr`` as one text value."""
    import argparse

    config = {"optim": _Optim(), "args": argparse.Namespace(seed=7, data={"path": "d"}), "name": "x"}
    with rllog.init(report_to="parquet", run_dir=tmp_path / "r", config=config, health=False) as run:
        run.log({"x": 1.0}, step=0)
    stored = json.loads((tmp_path / "r" / "run.json").read_text())["config"]
    assert {k: stored[k] for k in ("optim/lr", "optim/betas", "args/seed", "args/data/path", "name")} == {
        "optim/lr": 0.1,
        "optim/betas": [0.9, 0.99],
        "args/seed": 7,
        "args/data/path": "d",
        "name": "x",
    }
