"""Bad input: each case gets a clear rllog.errors exception or a documented sanitisation (docs/reliability.md).

Accepted cases are read back from the parquet files, so a silent drop would fail the test.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import rllog
from rllog import journal
from rllog.errors import InvalidKey, InvalidStep, InvalidTable, InvalidValue, RllogError, RunDirError, RunFinished
from rllog.rundir import RunFile
from rllog.validate import MAX_NESTING_DEPTH

torch = pytest.importorskip("torch")


@pytest.fixture
def run(tmp_path):
    # validation, not delivery, is tested here
    r = rllog.init(run_dir=tmp_path / "r", flush_interval=0.05, health=False, delivery="thread")
    yield r
    r.finish()


def delivered(run):
    report = run.finish()
    assert report.ok
    out = {}
    for row in rllog.read_metrics(run.run_dir).to_pylist():
        out.setdefault(row["key"], []).append((row["step"], row["value"]))
    return out


# -- values that are accepted (each delivered as documented) --------------------------------------
ACCEPTED = [
    ("nan", float("nan"), "nan"),
    ("inf", float("inf"), math.inf),
    ("neg_inf", float("-inf"), -math.inf),
    ("numpy_float16", np.float16(0.5), 0.5),
    ("numpy_int8", np.int8(-3), -3.0),
    ("numpy_uint64_big", np.uint64(2**53), float(2**53)),
    ("numpy_bool", np.bool_(True), 1.0),
    ("numpy_0d_array", np.array(4.25), 4.25),
    ("torch_float16", torch.tensor(0.5, dtype=torch.float16), 0.5),
    ("torch_bool", torch.tensor(True), 1.0),
    ("torch_shape_1", torch.tensor([2.5]), 2.5),
    ("torch_requires_grad", torch.tensor(1.5, requires_grad=True) * 2, 3.0),
    ("python_big_int", 10**20, 1e20),
    ("bool_false", False, 0.0),
]


@pytest.mark.parametrize("name, value, expected", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_accepted_values_are_delivered(run, name, value, expected):
    run.log({name: value}, step=1)
    [(step, got)] = delivered(run)[name]
    assert step == 1
    assert math.isnan(got) if expected == "nan" else got == expected


REJECTED = [
    ("string", "0.5", InvalidValue, r"'bad'.*str"),
    ("none", None, InvalidValue, r"'bad'.*NoneType"),
    ("list", [1.0, 2.0], InvalidValue, r"'bad'.*list"),
    ("tuple", (1.0,), InvalidValue, r"'bad'.*tuple"),
    ("bytes", b"1", InvalidValue, r"'bad'.*bytes"),
    ("complex", 1j, InvalidValue, r"'bad'.*complex"),
    ("multi_element_tensor", torch.ones(2, 2), InvalidValue, r"'bad'.*\(2, 2\)"),
    ("empty_tensor", torch.ones(0), InvalidValue, r"'bad'.*\(0,\)"),
    ("complex_tensor", torch.tensor(1j), InvalidValue, r"'bad'"),
    ("numpy_vector", np.ones(3), InvalidValue, r"'bad'.*\(3,\)"),
    ("numpy_string", np.str_("x"), InvalidValue, r"'bad'"),
]


@pytest.mark.parametrize("name, value, error, match", REJECTED, ids=[c[0] for c in REJECTED])
def test_rejected_values_raise_and_log_nothing(run, name, value, error, match):
    with pytest.raises(error, match=match):
        run.log({"good": 1.0, "bad": value}, step=1)
    run.log({"after": 2.0}, step=2)
    assert delivered(run) == {"after": [(2, 2.0)]}  # the rejected call left nothing half-logged


def test_not_a_dict(run):
    with pytest.raises(InvalidValue, match="dict"):
        run.log([("a", 1.0)])


@pytest.mark.parametrize("key, error", [("", InvalidKey), (None, InvalidKey), (5, InvalidKey), ("bad\udcffname", InvalidKey)])
def test_bad_names(run, key, error):
    with pytest.raises(error):
        run.log({key: 1.0})


def test_names_with_every_special_character_and_very_long_names_are_kept_verbatim(run):
    special = "".join(chr(c) for c in range(32, 127)) + " é中🙂\t\n"
    long = "x" * 5000
    run.log({special: 1.0, long: 2.0, "a//b/": 3.0}, step=0)
    got = delivered(run)
    assert got[special] == [(0, 1.0)] and got[long] == [(0, 2.0)] and got["a//b/"] == [(0, 3.0)]


def test_nested_and_huge_dicts(run):
    huge = {f"k{i}": float(i) for i in range(20_000)}
    run.log({"outer": {"inner": {"leaf": 1.0}}, "big": huge}, step=3)
    got = delivered(run)
    assert got["outer/inner/leaf"] == [(3, 1.0)]
    assert len([k for k in got if k.startswith("big/")]) == 20_000 and got["big/k19999"] == [(3, 19999.0)]


@pytest.mark.parametrize(
    "step", [-1, 1.5, "3", True, None.__class__, np.float64(2.0), 2**63, np.uint64(2**63), 2**64, np.int64(-1)]
)
def test_bad_steps(run, step):
    with pytest.raises(InvalidStep):
        run.log({"x": 1.0}, step=step)
    with pytest.raises(InvalidStep):
        run.log_table("t", {"a": [1]}, step=step)


def test_steps_up_to_the_largest_int64_are_delivered_and_beyond_it_refused(run):
    """Every tracker stores steps as int64: 2**63 failed parquet, TensorBoard and MLflow for good."""
    top = 2**63 - 1
    with pytest.raises(InvalidStep, match="int64"):
        run.log({"x": 0.0}, step=2**63)
    run.log({"x": 1.0}, step=np.uint64(top))
    run.log_table("t", {"a": [1]}, step=top)
    assert delivered(run) == {"x": [(top, 1.0)]}
    assert rllog.read_table(run.run_dir, "t").column("_step").to_pylist() == [top]


def test_steps_going_backwards_are_kept(run):
    for step in [5, 3, 3, 0]:
        run.log({"x": float(step)}, step=step)
    assert delivered(run)["x"] == [(5, 5.0), (3, 3.0), (3, 3.0), (0, 0.0)]


COLLISIONS = [
    ({"train/loss": 1.0, "train": {"loss": 2.0}}, "train/loss"),
    ({"train": {"loss": 2.0}, "train/loss": 1.0}, "train/loss"),
    ({"a": {"b/c": 1.0}, "a/b": {"c": 2.0}}, "a/b/c"),
    ({"t": torch.tensor(1.0), "x/t": 1.0, "x": {"t": torch.tensor(2.0)}}, "x/t"),
]


@pytest.mark.parametrize("values, name", COLLISIONS, ids=[c[1] + str(i) for i, c in enumerate(COLLISIONS)])
def test_names_that_collide_once_flattened_raise_and_log_nothing(run, values, name):
    with pytest.raises(InvalidKey, match=f"'{name}' is given twice"):
        run.log(values, step=1)
    run.log({"train": {"loss": 3.0}, "train/acc": 0.5}, step=2)  # nested and flat names that do not collide
    assert delivered(run) == {"train/loss": [(2, 3.0)], "train/acc": [(2, 0.5)]}


# -- tables ---------------------------------------------------------------------------------------
UNSTORABLE = [
    ("empty_struct", {"info": [{}, {}]}, "info"),
    ("nested_empty_struct", {"meta": [{"extra": {}}], "ok": [1]}, "meta"),
    ("list_of_empty_structs", {"calls": [[{}], []]}, "calls"),
    ("interval", {"span": [pd.DateOffset(months=1)]}, "span"),  # Arrow's month_day_nano_interval
    (
        "union",
        pa.table({"u": pa.UnionArray.from_sparse(pa.array([0, 1], pa.int8()), [pa.array([1, 2]), pa.array(["a", "b"])])}),
        "u",
    ),
]


@pytest.mark.parametrize("table, column", [c[1:] for c in UNSTORABLE], ids=[c[0] for c in UNSTORABLE])
def test_column_types_parquet_cannot_store_are_refused_at_the_call(run, table, column):
    with pytest.raises(InvalidTable, match=f"column '{column}' of type"):
        run.log_table("t", table, step=0)
    run.log_table("t", {"a": [1]}, step=1)
    run.finish()
    assert journal.last_seq(run.run_dir) == 1  # the refused table was not journaled
    assert rllog.read_table(run.run_dir, "t").column("a").to_pylist() == [1]


@pytest.mark.parametrize("flush_each_call", [False, True], ids=["one_part", "a_part_per_call"])
def test_a_column_may_change_type_between_calls_as_arrow_promotes_it(tmp_path, flush_each_call):
    # The parquet backend concatenates within a flush and across flushes: both must hold. Flushed only when asked
    # (and at the end), so "one_part" is one flush however slow the machine.
    run = rllog.init(run_dir=tmp_path / "r", flush_interval=3600, health=False, delivery="thread")
    tables = [
        {"reward": [1, 0], "note": [None, None]},  # int64, null
        {"reward": [0.5], "note": ["ok"], "extra": [True]},  # int -> float, null -> string, a new column
        {"reward": [2]},  # an int again: stored as float; missing columns are null
        pd.DataFrame({"reward": [1.5], "note": pd.Categorical(["cat"])}),  # a categorical is stored as its values
    ]
    for step, table in enumerate(tables):
        run.log_table("t", table, step=step)
        if flush_each_call:
            assert run.flush(timeout=30).ok
    with pytest.raises(
        InvalidTable, match=r"column 'reward' was double in earlier calls and is string now; .*permissive promotion"
    ):
        run.log_table("t", {"reward": ["high"]}, step=4)
    with pytest.raises(InvalidTable, match=r"column 'note' was (large_)?string in earlier calls and is int64 now"):
        run.log_table("t", {"note": [3]}, step=5)
    run.log_table("other", {"reward": ["high"]}, step=6)  # the rule is per table name
    run.finish()
    rows = rllog.read_table(run.run_dir, "t").to_pylist()
    assert [(r["_step"], r["reward"], r["note"], r["extra"]) for r in rows] == [
        (0, 1.0, None, None),
        (0, 0.0, None, None),
        (1, 0.5, "ok", True),
        (2, 2.0, None, None),
        (3, 1.5, "cat", None),
    ]
    assert rllog.read_table(run.run_dir, "other").column("reward").to_pylist() == ["high"]


def test_ints_that_a_promoted_type_cannot_hold_exactly_are_refused(run):
    run.log_table("ids", {"id": [2**60 + 1]}, step=0)
    with pytest.raises(InvalidTable, match=r"column 'id' holds int64 values .* cannot hold exactly"):
        run.log_table("ids", {"id": [0.5]}, step=1)  # 2**60 + 1 is no float64
    run.log_table("ids", {"id": [7]}, step=2)
    run.log_table("small", {"n": [3]}, step=0)
    run.log_table("small", {"n": [0.5]}, step=1)  # ints that a float holds exactly: promoted
    run.log_table("unsigned", pa.table({"u": pa.array([2**64 - 1], pa.uint64())}), step=0)
    with pytest.raises(InvalidTable, match=r"column 'u' holds uint64 values"):
        run.log_table("unsigned", {"u": [-1]}, step=1)  # uint64 with int64 promotes to int64, which 2**64 - 1 is not
    run.finish()
    assert rllog.read_table(run.run_dir, "ids").column("id").to_pylist() == [2**60 + 1, 7]
    assert rllog.read_table(run.run_dir, "small").column("n").to_pylist() == [3.0, 0.5]
    assert rllog.read_table(run.run_dir, "unsigned").column("u").to_pylist() == [2**64 - 1]


def test_ragged_table(run):
    with pytest.raises(InvalidTable, match=r"a=1, b=2"):
        run.log_table("t", {"a": [1], "b": [1, 2]})


def test_empty_table_with_columns_is_kept_and_without_columns_is_rejected(run):
    run.log_table("empty", {"prompt": [], "reward": []}, step=1)
    run.log_table("empty", pa.table({"prompt": pa.array([], pa.string())}), step=2)
    with pytest.raises(InvalidTable, match="no columns"):
        run.log_table("none", {})
    with pytest.raises(InvalidTable, match="no columns"):
        run.log_table("none", [])
    run.finish()
    assert rllog.read_table(run.run_dir, "empty").num_rows == 0
    assert journal.last_seq(run.run_dir) == 2  # both empty tables journaled


def test_mixed_type_column(run):
    with pytest.raises(InvalidTable, match="incompatible types"):
        run.log_table("t", {"a": [1, "x", None]})
    with pytest.raises(InvalidTable, match="incompatible types"):
        run.log_table("t", {"a": [2**64]})  # beyond int64
    run.log_table("t", {"a": [1, 2.5, None]}, step=0)  # int and float unify to float
    run.finish()
    assert rllog.read_table(run.run_dir, "t").column("a").to_pylist() == [1.0, 2.5, None]


def test_huge_text_cells_are_kept_whole_in_the_journal_and_parquet(run):
    cell = "token " * 200_000  # 1.2 MB
    run.log_table("completions", {"completion": [cell, "short"]}, step=0)
    run.finish()
    assert rllog.read_table(run.run_dir, "completions").column("completion").to_pylist() == [cell, "short"]


def test_non_utf8_bytes_and_lone_surrogates_in_tables_are_replaced(run):
    run.log_table("t", {"raw": [b"ok", b"\xff\xfe"], "text": ["fine", "bad\udcff"]}, step=0)
    run.finish()
    rows = rllog.read_table(run.run_dir, "t").to_pylist()
    assert [r["raw"] for r in rows] == ["ok", "\ufffd\ufffd"]
    assert [r["text"] for r in rows] == ["fine", "bad?"]


def test_table_in_every_accepted_form_and_a_reserved_column(run):
    with pytest.raises(InvalidTable, match="reserved"):
        run.log_table("t", {"_seq": [1]})
    with pytest.raises(InvalidTable, match="expected a dict"):
        run.log_table("t", 42)
    with pytest.raises(InvalidTable, match="expected a dict"):
        run.log_table("t", [1, 2, 3])
    run.log_table("t", pd.DataFrame({"a": [1]}), step=0)
    run.finish()
    assert rllog.read_table(run.run_dir, "t").column("a").to_pylist() == [1]


# -- the run's life -------------------------------------------------------------------------------
def test_run_dir_not_writable(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores permissions: use a path under a file instead
            (ro / "f").parent.chmod(0o700)
            (tmp_path / "file").write_text("x")
            target = tmp_path / "file" / "run"
        else:
            target = ro / "run"
        with pytest.raises(RunDirError):
            rllog.init(run_dir=target)
    finally:
        os.chmod(ro, 0o700)


def test_log_after_finish_and_finish_twice(run):
    run.log({"x": 1.0})
    first = run.finish()
    assert run.finish() is first
    with pytest.raises(RunFinished):
        run.log({"x": 2.0})
    with pytest.raises(RunFinished):
        run.log_table("t", {"a": [1]})
    with pytest.raises(ValueError):
        rllog.init(report_to="none", run_dir=run.run_dir.parent / "s").finish(status="exploded")


def test_full_queue_applies_backpressure_and_drops_nothing(tmp_path, monkeypatch, caplog):
    real_write = journal.JournalWriter._flush_frames

    def slow_write(self):
        time.sleep(0.05)  # a stalled disk
        return real_write(self)

    monkeypatch.setattr(journal.JournalWriter, "_flush_frames", slow_write)
    run = rllog.init(run_dir=tmp_path / "r", flush_interval=0.05, max_pending=50, health=False)
    for i in range(2000):
        run.log({"i": float(i)}, step=i)
        assert run._writer.backlog <= 51
    assert run.finish().ok
    assert "log() waits" in caplog.text
    assert rllog.read_metrics(tmp_path / "r").column("value").to_pylist() == [float(i) for i in range(2000)]


def test_errors_share_one_base_class():
    for error in (InvalidValue, InvalidKey, InvalidStep, InvalidTable, RunFinished, RunDirError):
        assert issubclass(error, RllogError)


def test_a_table_name_too_long_for_a_directory_is_refused_at_the_call_and_the_run_goes_on(tmp_path):
    """The Parquet store names a directory after the table: a name longer than a file system allows was accepted,
    then failed the whole sink inside delivery ("File name too long": every record of the run pending)."""
    with rllog.init(report_to="parquet", run_dir=tmp_path / "r", health=False) as run:
        with pytest.raises(InvalidKey, match="too long"):
            run.log_table("long name " + "x" * 300, {"a": [1]})
        with pytest.raises(InvalidKey, match="too long"):
            run.log_table("表" * 30, {"a": [1]})  # 30 characters, 270 once percent-encoded
        with pytest.raises(InvalidKey, match="too long"):
            run.log_table("." + "x" * 254, {"a": [1]})  # 255 percent-encoded, but a leading dot's directory: 257
        run.log_table("表" * 20, {"a": [2]}, step=0)
        run.log({"x": 1.0}, step=0)
    assert rllog.read_table(tmp_path / "r", "表" * 20).column("a").to_pylist() == [2]
    assert rllog.read_metrics(tmp_path / "r").column("value").to_pylist() == [1.0]


def test_a_text_value_given_as_a_column_is_refused_not_split_into_characters(tmp_path):
    with rllog.init(report_to="parquet", run_dir=tmp_path / "r", health=False) as run:
        with pytest.raises(InvalidTable, match="text, not columns"):
            run.log_table("t", {"prompt": "abc", "reward": [1.0, 2.0, 3.0]})
        run.log_table("t", {"prompt": ["abc"], "reward": [1.0]}, step=0)
    assert rllog.read_table(tmp_path / "r", "t").column("prompt").to_pylist() == ["abc"]


@pytest.mark.parametrize("values", [{"x": 10**400}, {"x": 1.0, "y": 10**400}, {"a": {"x": 10**400}}])
def test_an_int_beyond_a_floats_range_is_an_invalid_value_naming_the_key(tmp_path, values):
    with rllog.init(report_to="parquet", run_dir=tmp_path / "r", health=False) as run:
        with pytest.raises(InvalidValue, match="beyond a float's range"):
            run.log(values)


# -- values nested past MAX_NESTING_DEPTH, or containing themselves -------------------------------------
def _nested(levels: int) -> dict:
    """A dict ``levels`` dicts deep, ``{"k": {"k": ... {"v": 1.0}}}``, built without recursion."""
    value: dict = {"v": 1.0}
    for _ in range(levels - 1):
        value = {"k": value}
    return value


def _self_referencing_dict() -> dict:
    value: dict = {"x": 1.0}
    value["me"] = value
    return value


def _self_referencing_list() -> list:
    value: list = [1.0]
    value.append(value)
    return value


TOO_DEEP = [
    ("1200_levels", lambda: _nested(1_200), f"nests more than {MAX_NESTING_DEPTH} levels", "'outer/k/k/k/"),
    ("self_reference", _self_referencing_dict, "contains itself", "'outer/me/me/me/"),
]


@pytest.mark.parametrize("make, why, path", [c[1:] for c in TOO_DEEP], ids=[c[0] for c in TOO_DEEP])
def test_metrics_and_config_nested_too_deep_or_containing_themselves_are_invalid_values_naming_the_key_path(
    tmp_path, make, why, path
):
    """A dict nested 1,200 deep (or one that contains itself) raised a bare RecursionError from flatten."""
    with pytest.raises(InvalidValue, match=why) as raised:
        rllog.init(report_to="parquet", run_dir=tmp_path / "refused", health=False, config={"outer": make()})
    assert path in str(raised.value)
    assert not (tmp_path / "refused").exists()  # refused before the run directory is claimed
    with rllog.init(report_to="parquet", run_dir=tmp_path / "r", health=False, config={"lr": 0.1}) as run:
        with pytest.raises(InvalidValue, match=why) as raised:
            run.log({"outer": make(), "fine": 1.0}, step=0)
        assert path in str(raised.value)
        with pytest.raises(InvalidValue, match=why) as raised:
            run.update_config({"outer": make()})
        assert path in str(raised.value)
        with pytest.raises(InvalidValue, match="contains itself") as raised:
            run.update_config({"outer": [1, _self_referencing_list()]})
        assert "config/outer[1][1][1]" in str(raised.value)
        run.log({"outer": _nested(MAX_NESTING_DEPTH - 1)}, step=1)  # MAX_NESTING_DEPTH levels with "outer": accepted
        run.update_config({"deep": _nested(MAX_NESTING_DEPTH - 1)})
    rows = rllog.read_metrics(tmp_path / "r").to_pylist()
    assert [(r["key"], r["step"]) for r in rows] == [("outer/" + "k/" * (MAX_NESTING_DEPTH - 2) + "v", 1)]
    config = RunFile.read(tmp_path / "r").config
    assert config["lr"] == 0.1 and config["deep/" + "k/" * (MAX_NESTING_DEPTH - 2) + "v"] == 1.0
    assert not [k for k in config if k.startswith("outer")]


def test_table_cells_nested_too_deep_are_refused_naming_table_column_and_row(run):
    with pytest.raises(InvalidTable, match=rf"table 't', column 'c', row 1: nests more than {MAX_NESTING_DEPTH} levels"):
        run.log_table("t", {"c": [{"a": 1}, _nested(1_200)]})
    with pytest.raises(InvalidTable, match=r"column 'c', row 0: nests more than"):
        run.log_table("t", [{"c": _nested(MAX_NESTING_DEPTH + 1)}])
    with pytest.raises(InvalidTable, match=r"column 'c', row 0: nests more than"):
        run.log_table("t", pd.DataFrame({"c": [_nested(MAX_NESTING_DEPTH + 1)]}))
    # An Arrow struct deeper than Parquet reads back raised a bare OSError ("Invalid flatbuffers message").
    with pytest.raises(InvalidTable, match="parquet cannot store"):
        run.log_table("t", pa.table({"c": pa.array([_nested(130)])}))
    run.log_table("t", {"c": [_nested(20)]}, step=0)
    report = run.finish()
    assert report.ok, str(report)
    assert rllog.read_table(run.run_dir, "t").num_rows == 1


SELF_REFERENCING_CELLS = r"""
import sys, rllog
from rllog.errors import InvalidTable
cell = {"x": 1}
cell["me"] = cell
with rllog.init(report_to="parquet", run_dir=sys.argv[1], health=False) as run:
    for table in ({"c": [cell]}, [{"c": cell}], {"c": [[1, cell]]}):
        try:
            run.log_table("t", table, step=0)
        except InvalidTable as exc:
            print(exc)
    run.log_table("t", {"c": [{"x": 1}]}, step=0)
"""


def test_a_table_cell_that_contains_itself_is_refused_not_a_crash_of_the_trainer(tmp_path):
    """pyarrow converting a cell that contains itself killed the process (SIGSEGV); run in a child to see it."""
    done = subprocess.run([sys.executable, "-c", SELF_REFERENCING_CELLS, str(tmp_path / "r")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 3 and all("column 'c', row 0: contains itself" in line for line in lines), lines
    assert rllog.read_table(tmp_path / "r", "t").column("c").to_pylist() == [{"x": 1}]


def test_a_5_mb_cell_is_stored_whole(tmp_path):
    cell = "x" * (5 * 1024 * 1024 - 1) + "!"
    with rllog.init(report_to="parquet", run_dir=tmp_path / "r") as run:
        run.log_table("big", {"text": [cell, "small"]}, step=1)
        run.log({"a": 1.0}, step=1)
    back = rllog.read_table(tmp_path / "r", "big").column("text").to_pylist()
    assert back == [cell, "small"]
    assert rllog.read_metrics(tmp_path / "r").column("value").to_pylist() == [1.0]
