"""The embedded default backend: analysis-friendly Parquet files in the run directory.

Layout (``RUN_DIR/parquet/``)::

    metrics/part-000001.parquet ...     long format: step, key, value, time, seq
    tables/<name>/part-000001.parquet   _step, _seq, then the table's own columns
    alerts/part-000001.parquet          step, seq, time, rule, metric, value, message, level
    run.json                            project, name, run_id, config, status

A part file is written at every ``flush`` (the delivery layer flushes at least every
``flush_interval`` while data flows), atomically (written to a temporary name, then renamed), so a
reader never sees a partial file. ``close`` compacts a directory of more than ``compact_above`` parts into one file. Open the
data with :func:`rllog.read_metrics` / :func:`rllog.read_table`, or directly::

    pandas.read_parquet("RUN_DIR/parquet/metrics")
    duckdb.sql("select * from read_parquet('RUN_DIR/parquet/tables/completions/*.parquet', union_by_name=true)")
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from rllog.records import AlertRecord, MetricsRecord, RunInfo, TableRecord
from rllog.sink import Capabilities

METRICS_SCHEMA = pa.schema([("step", pa.int64()), ("key", pa.string()), ("value", pa.float64()), ("time", pa.float64()), ("seq", pa.int64())])
ALERTS_SCHEMA = pa.schema([("step", pa.int64()), ("seq", pa.int64()), ("time", pa.float64()), ("rule", pa.string()), ("metric", pa.string()),
                           ("value", pa.float64()), ("message", pa.string()), ("level", pa.string())])


def table_dir_name(name: str) -> str:
    """A table name as a directory name: characters other than letters, digits, ``._-`` become ``_``
    (``/`` becomes ``__``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name.replace("/", "__")) or "_"


def _parts(directory: Path) -> list[Path]:
    return sorted(directory.glob("part-*.parquet"))


def _write_atomic(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def _last_part_number(directory: Path) -> int:
    parts = _parts(directory)
    return int(parts[-1].stem.split("-")[1]) if parts else 0


def read_parts(directory: Path, seq_column: str) -> pa.Table | None:
    """Every part in ``directory`` as one table, schemas unified (a later column is null in earlier rows).

    A part whose records (``seq_column``) all appear in a bigger part is skipped: that is the instant
    of compaction, when the merged file exists and the parts it replaces are not yet removed.
    """
    tables = []
    for path in _parts(directory):
        try:
            tables.append(pq.read_table(path))
        except FileNotFoundError:  # removed by a compaction since the listing
            continue
    seen: set[int] = set()
    kept = []
    for table in sorted(tables, key=lambda t: -t.num_rows):
        seqs = set(table.column(seq_column).to_pylist())
        if seqs and seqs <= seen:
            continue
        seen |= seqs
        kept.append(table)
    if not kept:
        return None
    merged = pa.concat_tables(kept, promote_options="permissive")
    return merged.sort_by([(seq_column, "ascending")])


class ParquetSink:
    """Writes metrics and tables as Parquet files under ``RUN_DIR/parquet`` (or ``directory``).

    Args:
        directory: where to write; default ``<run_dir>/parquet``.
        compact: merge each directory's part files into one at ``close``...
        compact_above: ...when it holds more than this many parts (a short run keeps its few parts).

    Example:
        >>> run = rllog.init(report_to="parquet")   # also the default
        >>> ...
        >>> rllog.read_metrics(run.run_dir).to_pandas()
    """

    capabilities = Capabilities(tables=True, config=True, alerts=True)

    def __init__(self, directory: str | None = None, compact: bool = True, compact_above: int = 16):
        self.directory = Path(directory) if directory else None
        self.compact = compact
        self.compact_above = compact_above
        self._rows: list[tuple[int, str, float, float, int]] = []
        self._tables: dict[str, list[pa.Table]] = {}
        self._alerts: list[dict] = []
        self._part_numbers: dict[Path, int] = {}  # directory -> its last part's number (listed once per directory)

    def open(self, run_info: RunInfo) -> None:
        self.directory = self.directory or Path(run_info.run_dir) / "parquet"
        (self.directory / "metrics").mkdir(parents=True, exist_ok=True)
        self._meta = {"project": run_info.project, "name": run_info.name, "run_id": run_info.run_id, "config": dict(run_info.config), "tags": list(run_info.tags), "status": "running"}
        self._write_meta()

    MAX_BUFFERED_ROWS = 100_000  # a part is written early past this: memory stays bounded while catching up

    def write_metrics(self, records: Sequence[MetricsRecord]) -> None:
        for r in records:
            for key, value in r.values.items():
                self._rows.append((r.step, key, value, r.time, r.seq))
        if len(self._rows) >= self.MAX_BUFFERED_ROWS:
            self.flush()

    def write_table(self, record: TableRecord) -> None:
        n = record.table.num_rows
        table = record.table.add_column(0, "_step", pa.repeat(pa.scalar(record.step, pa.int64()), n))
        table = table.add_column(1, "_seq", pa.repeat(pa.scalar(record.seq, pa.int64()), n))
        self._tables.setdefault(record.name, []).append(table)

    def write_alert(self, record: AlertRecord) -> None:
        self._alerts.append({"step": record.step, "seq": record.seq, "time": record.time, "rule": record.rule, "metric": record.metric,
                             "value": record.value, "message": record.message, "level": record.level})

    def flush(self) -> None:
        if self._alerts:
            (self.directory / "alerts").mkdir(exist_ok=True)
            _write_atomic(pa.Table.from_pylist(self._alerts, schema=ALERTS_SCHEMA), self._next_part(self.directory / "alerts"))
            self._alerts = []
        if self._rows:
            columns = list(zip(*self._rows))
            table = pa.Table.from_arrays([pa.array(c, t.type) for c, t in zip(columns, METRICS_SCHEMA)], schema=METRICS_SCHEMA)
            _write_atomic(table, self._next_part(self.directory / "metrics"))
            self._rows = []
        for name, tables in self._tables.items():
            directory = self.directory / "tables" / table_dir_name(name)
            directory.mkdir(parents=True, exist_ok=True)
            _write_atomic(pa.concat_tables(tables, promote_options="permissive"), self._next_part(directory))
        self._tables = {}

    def close(self, status: str) -> None:
        self.flush()
        if self.compact:
            for directory in [self.directory / "metrics", self.directory / "alerts", *(self.directory / "tables").glob("*")]:
                self._compact(directory)
        self._meta["status"] = status
        self._write_meta()

    def _next_part(self, directory: Path) -> Path:
        if directory not in self._part_numbers:
            self._part_numbers[directory] = _last_part_number(directory)
        self._part_numbers[directory] += 1
        return directory / f"part-{self._part_numbers[directory]:06d}.parquet"

    def _compact(self, directory: Path) -> None:
        parts = _parts(directory)
        if len(parts) <= max(1, self.compact_above):
            return
        merged = read_parts(directory, "_seq" if directory.parent.name == "tables" else "seq")
        # Written under the last part's name; for the instant before the older parts are removed,
        # read_parts skips parts the merged file covers.
        _write_atomic(merged, parts[-1])
        for p in parts[:-1]:
            p.unlink()

    def _write_meta(self) -> None:
        tmp = self.directory / ".run.json.tmp"
        tmp.write_text(json.dumps(self._meta, indent=1, default=str))
        os.replace(tmp, self.directory / "run.json")
