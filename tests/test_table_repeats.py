"""A table that repeats the columns of the last one of its name skips Arrow on the caller's thread
(``TableSchemas.repeat``): it must be taken, refused and stored exactly as the full path would."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

import rllog
from rllog.errors import InvalidTable
from rllog.journal import read_all
from rllog.records import TableRecord
from rllog.validate import TableColumns, TableSchemas

SPECIAL_CELLS = {
    int: [0, -1, 7, 2**53 + 1, 2**63 - 1, -(2**63), 2**63, 2**64 + 5, -(2**63) - 1],
    float: [0.5, -0.0, float("nan"), float("inf"), -float("inf"), 1e308],
    str: ["a", "", "é", "日本", "\ud800 lone surrogate", "x" * 40],
    bool: [True, False],
}
KINDS = (int, float, str, bool)


def _cell(rng: random.Random, kind: type, special: float) -> object:
    if rng.random() < special:
        if rng.random() < 0.3:
            return None
        return rng.choice(SPECIAL_CELLS[kind] + SPECIAL_CELLS[rng.choice(KINDS)])  # sometimes another type
    return {int: rng.randrange(-5, 100), float: rng.random(), str: f"t{rng.randrange(9)}", bool: rng.random() < 0.5}[kind]


def _tables(seed: int) -> list[dict]:
    """Tables for one name: mostly one template's columns (repeats), at times another template, a ragged one, a
    cell of another type or range, an empty one."""
    rng = random.Random(seed)
    templates = [{f"c{i}": rng.choice(KINDS) for i in range(rng.randrange(1, 5))} for _ in range(2)]
    tables = []
    for _ in range(8):
        template = templates[0] if rng.random() < 0.8 else templates[1]
        rows = rng.choice((0, 1, 2, 3, 16)) if rng.random() < 0.2 else 3
        special = 0.0 if rng.random() < 0.7 else 0.3
        table = {name: [_cell(rng, kind, special) for _ in range(rows)] for name, kind in template.items()}
        if rng.random() < 0.05:
            next(iter(table.values())).append(_cell(rng, int, 0.0))  # ragged
        tables.append(table)
    return tables


# Sequences where a repeat's values, not its types, decide: text that is not UTF-8, ints past int64 or into uint64.
EDGE_SEQUENCES = [
    [{"s": ["a", "b"]}, {"s": ["c", "\ud800"]}, {"s": ["d", "e"]}],
    [{"n": [2**63]}, {"n": [-1]}, {"n": [5]}],
    [{"n": [1]}, {"n": [2**63]}, {"n": [2]}],
    [{"n": [1]}, {"n": [2**64]}, {"n": [-(2**63) - 1]}, {"n": [3]}],
    [{"a": [1], "b": ["x"]}, {"a": [1, 2], "b": ["y"]}, {"a": [2], "b": ["z"]}],
    [{"a": [1.5]}, {"a": [None]}, {"a": [None]}, {"a": [2.5]}],
    [{"a": []}, {"a": []}, {"a": ["x"]}],
    [{"\ud800": [1]}, {"\ud800": [2]}, {"\ud800": [3]}],
    [
        pa.table({"a": pa.array([1])}, schema=pa.schema([pa.field("a", pa.int64(), metadata={"unit": "s"})])),
        {"a": [2]},
        {"a": [3]},
    ],  # a column name that is not UTF-8: replaced, every time
    [{"a": list(range(5000)), "b": [0.5] * 5000}, {"a": list(range(5000)), "b": [1.5] * 5000}],  # past REPEAT_MAX_CELLS
]


def _outcomes(tmp_path, name: str, tables: list[dict]) -> tuple[list[str], list[tuple[int, str, str]]]:
    """What each ``log_table`` call did, and the tables the journal holds (step, schema, cells)."""
    run = rllog.init(["parquet"], run_dir=tmp_path / name, delivery="thread", health=False, system_metrics=False)
    outcomes = []
    for step, table in enumerate(tables):
        try:
            run.log_table("t", table, step=step)
            outcomes.append("taken")
        except InvalidTable as exc:
            outcomes.append(f"refused: {exc}")
    assert run.finish().ok
    stored = [
        (r.step, str(r.table.schema), repr(r.table.to_pylist())) for r in read_all(tmp_path / name) if isinstance(r, TableRecord)
    ]
    return outcomes, stored


@pytest.mark.parametrize("seeds", [range(0, 25), range(25, 50), "edges"])
def test_repeated_tables_are_taken_refused_and_stored_as_the_full_path_would(tmp_path, monkeypatch, seeds):
    repeats = []
    real_repeat = TableSchemas.repeat

    def counted(self, name, table):
        result = real_repeat(self, name, table)
        repeats.append(result is not None)
        return result

    monkeypatch.setattr(TableSchemas, "repeat", counted)
    sequences = dict(enumerate(EDGE_SEQUENCES)) if seeds == "edges" else {seed: _tables(seed) for seed in seeds}
    with_repeats = {seed: _outcomes(tmp_path, f"fast-{seed}", tables) for seed, tables in sequences.items()}
    monkeypatch.setattr(TableSchemas, "repeat", lambda self, name, table: None)
    for seed, tables in sequences.items():
        assert with_repeats[seed] == _outcomes(tmp_path, f"full-{seed}", tables), f"sequence {seed}"
    assert sum(repeats) > (0 if seeds == "edges" else len(repeats) / 4)  # the repeat path was taken, often
    assert any(o.startswith("refused") for outcomes, _ in with_repeats.values() for o in outcomes)


def test_a_repeated_table_keeps_the_values_it_had_when_logged(tmp_path):
    run = rllog.init(["parquet"], run_dir=tmp_path / "r", delivery="thread", health=False, system_metrics=False)
    prompts, scores = ["p0", "p1"], [0.0, 1.0]
    run.log_table("t", {"prompt": prompts, "score": scores}, step=0)
    run.log_table("t", {"prompt": prompts, "score": scores}, step=1)
    prompts[0], scores[1] = "changed", 9.0  # the caller reuses its lists after the call
    assert run.finish().ok
    stored = rllog.read_table(tmp_path / "r", "t")
    assert stored.column("prompt").to_pylist() == ["p0", "p1"] * 2
    assert stored.column("score").to_pylist() == [0.0, 1.0] * 2


def test_the_int_range_of_repeats_counts_when_the_column_turns_float(tmp_path):
    """int64 -> double is refused for values a double cannot hold exactly: a repeat's values count too."""
    run = rllog.init(["parquet"], run_dir=tmp_path / "r", delivery="thread", health=False, system_metrics=False)
    schemas = run._table_schemas
    run.log_table("t", {"n": [1]}, step=0)
    assert isinstance(schemas.repeat("t", {"n": [2]}), TableColumns)  # a repeat, as the next call will be
    run.log_table("t", {"n": [2**60 + 1]}, step=1)
    with pytest.raises(InvalidTable, match=r"holds int64 values from 1 to 1152921504606846977"):
        run.log_table("t", {"n": [0.5]}, step=2)
    assert run.finish().ok


def test_a_table_name_that_is_not_text_is_refused_by_name_first_or_repeated(tmp_path):
    from rllog.errors import InvalidKey

    run = rllog.init(["parquet"], run_dir=tmp_path / "r", delivery="thread", health=False, system_metrics=False)
    run.log_table("t", {"a": [1]}, step=0)
    for name in (["t"], None, 3):
        with pytest.raises(InvalidKey, match="table names must be non-empty strings"):
            run.log_table(name, {"a": [2]}, step=1)
    assert run.finish().ok
