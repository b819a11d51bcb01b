"""Read the parquet backend's files back (the embedded default)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

import rllog
from readers import ReadBack


def read_back(env: dict, run_info) -> ReadBack:
    out = ReadBack()
    for row in rllog.read_metrics(run_info.run_dir).to_pylist():
        out.metrics.setdefault(row["key"], []).append((row["step"], row["value"]))
    tables_dir = Path(run_info.run_dir) / "parquet" / "tables"
    for directory in sorted(tables_dir.glob("*")) if tables_dir.exists() else []:
        name = pq.read_schema(next(directory.glob("*.parquet"))) and directory.name
        by_seq: dict[int, tuple[int, list]] = {}
        for row in rllog.read_table(run_info.run_dir, name).to_pylist():
            step, seq = row.pop("_step"), row.pop("_seq")
            by_seq.setdefault(seq, (step, []))[1].append(row)
        out.tables[name] = [by_seq[s] for s in sorted(by_seq)]
    meta = json.loads((Path(run_info.run_dir) / "parquet" / "run.json").read_text())
    out.config, out.status = meta["config"], meta["status"]
    return out
