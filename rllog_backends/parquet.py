"""The embedded default backend: analysis-friendly Parquet files in the run directory, and reading them.

Layout (``RUN_DIR/parquet/``, or the ``directory`` option)::

    metrics/part-000001.parquet ...     long format: step, key, value, time, seq
    tables/<name>/part-000001.parquet   _step, _seq, then the table's own columns
    alerts/part-000001.parquet          step, seq, time, rule, metric, value, message, level
    meta.json                           the store's record of the run: project, name, run_id, tags,
                                        config (with Run.update_config's changes), status

``<name>`` is the table name percent-encoded (``eval/samples`` -> ``eval%2Fsamples``), so two table
names never share a directory. A part file is written at every ``flush`` (the delivery layer flushes at
least every ``flush_interval`` while data flows), atomically (written to a temporary name, then renamed),
so a reader never sees a partial file. ``close`` compacts a directory of more than ``compact_above``
parts into one file.

The sink buffers until ``flush``, so its writes are not durable (``durable_writes=False``): the delivery
layer moves its cursor only after a flush. Records re-sent after an agent was killed between a flush
and its cursor save are recognised by their ``seq`` (each directory's highest seq is read from the part
files' statistics when the sink opens it) and not written twice.

Open the data with :func:`read_metrics` / :func:`read_table` (``rllog.read_metrics`` and friends), or directly::

    pandas.read_parquet("RUN_DIR/parquet/metrics")
    duckdb.sql("select * from read_parquet('RUN_DIR/parquet/tables/completions/*.parquet', union_by_name=true)")
"""

from __future__ import annotations

import json
import os
import urllib.parse
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rllog.errors import InvalidTable, TransientError
from rllog.records import AlertRecord, ConfigRecord, MetricsRecord, RunInfo, TableRecord
from rllog.sink import Capabilities
from rllog.sink_errors import is_disk_full

METRICS_SCHEMA = pa.schema([("step", pa.int64()), ("key", pa.string()), ("value", pa.float64()), ("time", pa.float64()), ("seq", pa.int64())])
ALERTS_SCHEMA = pa.schema([("step", pa.int64()), ("seq", pa.int64()), ("time", pa.float64()), ("rule", pa.string()), ("metric", pa.string()),
                           ("value", pa.float64()), ("message", pa.string()), ("level", pa.string())])
DEFAULT_DIRECTORY = "parquet"
META_FILE = "meta.json"


def table_dir_name(name: str) -> str:
    """A table name as a directory name, one-to-one: percent-encoding of everything but letters, digits and ``_.-~``
    (and of a leading dot)."""
    encoded = urllib.parse.quote(name, safe="")
    return "%2E" + encoded[1:] if encoded.startswith(".") else encoded


def table_name(dir_name: str) -> str:
    """The table name a directory of :func:`table_dir_name` holds."""
    return urllib.parse.unquote(dir_name)


def _parts(directory: Path) -> list[Path]:
    return sorted(directory.glob("part-*.parquet"))


def _write_atomic(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _max_seq(directory: Path, column: str) -> int:
    """The highest ``column`` value in a directory's parts, from their footers' statistics (no data read)."""
    highest = 0
    for path in _parts(directory):
        try:
            meta = pq.ParquetFile(path).metadata
        except (FileNotFoundError, pa.ArrowInvalid):
            continue
        index = meta.schema.to_arrow_schema().get_field_index(column)
        for i in range(meta.num_row_groups):
            stats = meta.row_group(i).column(index).statistics
            if stats is not None and stats.has_min_max:
                highest = max(highest, int(stats.max))
    return highest


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


# -- reading a run's files -------------------------------------------------------------------------

def _run_file(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def store_dir(run_dir: str | os.PathLike) -> Path:
    """Where the parquet backend of ``run_dir`` writes: its ``directory`` option from ``run.json``, else ``RUN_DIR/parquet``."""
    run_dir = Path(run_dir)
    for spec in _run_file(run_dir).get("sinks", []):
        directory = (spec.get("options") or {}).get("directory") if spec.get("name") == "parquet" else None
        if directory:
            return Path(directory) if Path(directory).is_absolute() else run_dir / directory
    return run_dir / DEFAULT_DIRECTORY


def _attempt_starts(run_dir: Path, metrics: pa.Table) -> list[tuple[int, int]]:
    """``(first_seq, first_step)`` of every resumed attempt that logged metrics (attempt 2 on)."""
    firsts = sorted(a["first_seq"] for a in _run_file(run_dir).get("attempts", []))[1:]
    starts = []
    for i, first in enumerate(firsts):
        end = firsts[i + 1] if i + 1 < len(firsts) else None
        mask = pc.greater_equal(metrics.column("seq"), first)
        if end is not None:
            mask = pc.and_(mask, pc.less(metrics.column("seq"), end))
        steps = metrics.filter(mask).column("step")
        if len(steps):
            starts.append((first, pc.min(steps).as_py()))
    return starts


def _latest(table: pa.Table, starts: list[tuple[int, int]], seq: str, step: str) -> pa.Table:
    """Drop the rows an attempt superseded: an earlier attempt's rows at or after the step a later attempt restarted from."""
    if not starts or not table.num_rows:
        return table
    superseded = None
    for first_seq, first_step in starts:
        hit = pc.and_(pc.less(table.column(seq), first_seq), pc.greater_equal(table.column(step), first_step))
        superseded = hit if superseded is None else pc.or_(superseded, hit)
    return table.filter(pc.invert(superseded))


def _metrics_all(run_dir: Path) -> pa.Table:
    table = read_parts(store_dir(run_dir) / "metrics", "seq")
    return table if table is not None else METRICS_SCHEMA.empty_table()


def read_metrics(run_dir: str | os.PathLike, attempts: str = "latest") -> pa.Table:
    """The metrics of ``run_dir``: a ``pyarrow.Table`` (step, key, value, time, seq), in seq order.

    Args:
        attempts: ``"latest"`` (default): a resumed run's values as the latest attempt left them (what an
            earlier attempt logged from the step a later one restarted at is left out); ``"all"``: every row.
    """
    run_dir = Path(run_dir)
    table = _metrics_all(run_dir)
    return table if attempts == "all" else _latest(table, _attempt_starts(run_dir, table), "seq", "step")


def read_alerts(run_dir: str | os.PathLike, attempts: str = "latest") -> pa.Table:
    """The health alerts of ``run_dir``: a ``pyarrow.Table`` (step, seq, time, rule, metric, value, message, level)."""
    run_dir = Path(run_dir)
    table = read_parts(store_dir(run_dir) / "alerts", "seq")
    table = table if table is not None else ALERTS_SCHEMA.empty_table()
    return table if attempts == "all" else _latest(table, _attempt_starts(run_dir, _metrics_all(run_dir)), "seq", "step")


def read_table(run_dir: str | os.PathLike, name: str, attempts: str = "latest") -> pa.Table:
    """Every row logged to table ``name`` in ``run_dir``: a ``pyarrow.Table`` (_step, _seq, columns...).

    Raises:
        KeyError: no table of that name.
    """
    run_dir = Path(run_dir)
    table = read_parts(store_dir(run_dir) / "tables" / table_dir_name(name), "_seq")
    if table is None:
        raise KeyError(f"no table {name!r} in {run_dir}")
    return table if attempts == "all" else _latest(table, _attempt_starts(run_dir, _metrics_all(run_dir)), "_seq", "_step")


def read_meta(run_dir: str | os.PathLike) -> dict:
    """The store's record of the run: project, name, run_id, tags, config (updates applied) and status."""
    return json.loads((store_dir(run_dir) / META_FILE).read_text())


def table_names(run_dir: str | os.PathLike) -> list[str]:
    """The names of the tables ``run_dir`` holds."""
    tables = store_dir(run_dir) / "tables"
    return sorted(table_name(p.name) for p in tables.iterdir() if p.is_dir()) if tables.is_dir() else []


# -- writing ---------------------------------------------------------------------------------------

class ParquetSink:
    """Writes metrics and tables as Parquet files under ``RUN_DIR/parquet`` (or ``directory``).

    Args:
        directory: where to write; default ``<run_dir>/parquet`` (a relative path is below the run directory).
        compact: merge each directory's part files into one at ``close``...
        compact_above: ...when it holds more than this many parts (a short run keeps its few parts).

    Example:
        >>> run = rllog.init(report_to="parquet")   # also the default
        >>> ...
        >>> rllog.read_metrics(run.run_dir).to_pandas()
    """

    capabilities = Capabilities(tables=True, config=True, alerts=True, durable_writes=False)
    MAX_BUFFERED_ROWS = 100_000  # a part is written early past this: memory stays bounded while catching up

    def __init__(self, directory: str | None = None, compact: bool = True, compact_above: int = 16):
        self._option = directory
        self.directory: Path | None = None
        self.compact = compact
        self.compact_above = compact_above
        self._rows: list[tuple[int, str, float, float, int]] = []
        self._tables: dict[str, list[pa.Table]] = {}
        self._alerts: list[dict] = []
        self._part_numbers: dict[Path, int] = {}  # directory -> its last part's number (listed once per directory)
        self._written_seq: dict[Path, int] = {}  # directory -> highest seq on disk (records at or below it are not written again)
        self._schemas: dict[str, pa.Schema] = {}  # table name -> the schema its parts unify to

    def open(self, run_info: RunInfo) -> None:
        if self._option:
            option = Path(self._option)
            self.directory = option if option.is_absolute() else Path(run_info.run_dir) / option
        else:
            self.directory = Path(run_info.run_dir) / DEFAULT_DIRECTORY
        with _disk_errors():
            (self.directory / "metrics").mkdir(parents=True, exist_ok=True)
            self._meta = {"project": run_info.project, "name": run_info.name, "run_id": run_info.run_id, "config": dict(run_info.config),
                          "tags": list(run_info.tags), "status": "running"}
            self._write_meta()

    def _new(self, directory: Path, seq: int, column: str = "seq") -> bool:
        """Whether a record is not on disk yet (a re-send after a killed agent is)."""
        if directory not in self._written_seq:
            self._written_seq[directory] = _max_seq(directory, column)
        return seq > self._written_seq[directory]

    def write_metrics(self, records: Sequence[MetricsRecord]) -> None:
        directory = self._dir("metrics")
        for r in records:
            if self._new(directory, r.seq):
                for key, value in r.values.items():
                    self._rows.append((r.step, key, value, r.time, r.seq))
        if len(self._rows) >= self.MAX_BUFFERED_ROWS:
            self.flush()

    def write_table(self, record: TableRecord) -> None:
        directory = self._dir("tables", table_dir_name(record.name))
        if not self._new(directory, record.seq, "_seq"):
            return
        n = record.table.num_rows
        table = record.table.add_column(0, "_step", pa.repeat(pa.scalar(record.step, pa.int64()), n))
        table = table.add_column(1, "_seq", pa.repeat(pa.scalar(record.seq, pa.int64()), n))
        self._schemas[record.name] = self._unified(record.name, directory, table.schema)
        self._tables.setdefault(record.name, []).append(table)

    def _unified(self, name: str, directory: Path, schema: pa.Schema) -> pa.Schema:
        """The table's schema with this batch's columns; a column whose type cannot be promoted is refused here,
        so the record is rejected alone (and dead-lettered) rather than failing the flush of every table."""
        known = self._schemas.get(name)
        if known is None:
            parts = _parts(directory)
            known = pq.read_schema(parts[-1]) if parts else schema
        try:
            return pa.unify_schemas([known, schema], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise InvalidTable(f"table {name!r}: a column's type changed from earlier steps: {exc}") from exc

    def write_config(self, record: ConfigRecord) -> None:
        self._meta["config"].update(record.values)
        with _disk_errors():
            self._write_meta()

    def write_alert(self, record: AlertRecord) -> None:
        if self._new(self._dir("alerts"), record.seq):
            self._alerts.append({"step": record.step, "seq": record.seq, "time": record.time, "rule": record.rule, "metric": record.metric,
                                 "value": record.value, "message": record.message, "level": record.level})

    def flush(self) -> None:
        """Write one part per directory that has buffered data; each buffer is emptied once its part is on disk."""
        with _disk_errors():
            if self._alerts:
                self._write_part(self._dir("alerts"), pa.Table.from_pylist(self._alerts, schema=ALERTS_SCHEMA), "seq")
                self._alerts = []
            if self._rows:
                columns = list(zip(*self._rows, strict=True))
                table = pa.Table.from_arrays([pa.array(c, t.type) for c, t in zip(columns, METRICS_SCHEMA, strict=True)], schema=METRICS_SCHEMA)
                self._write_part(self._dir("metrics"), table, "seq")
                self._rows = []
            for name in list(self._tables):
                directory = self._dir("tables", table_dir_name(name))
                self._write_part(directory, pa.concat_tables(self._tables[name], promote_options="permissive"), "_seq")
                del self._tables[name]

    def close(self, status: str) -> None:
        self.flush()
        with _disk_errors():
            if self.compact:
                for directory in [self._dir("metrics"), self._dir("alerts"), *self._dir("tables").glob("*")]:
                    self._compact(directory)
            self._meta["status"] = status
            self._write_meta()

    # -- internals ---------------------------------------------------------------------------------
    def _dir(self, *parts: str) -> Path:
        assert self.directory is not None, "open() first"
        return self.directory.joinpath(*parts)

    def _write_part(self, directory: Path, table: pa.Table, seq_column: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        _write_atomic(table, self._next_part(directory))
        self._written_seq[directory] = max(self._written_seq.get(directory, 0), pc.max(table.column(seq_column)).as_py() or 0)

    def _next_part(self, directory: Path) -> Path:
        if directory not in self._part_numbers:
            parts = _parts(directory)
            self._part_numbers[directory] = int(parts[-1].stem.split("-")[1]) if parts else 0
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
        tmp = self._dir(f".{META_FILE}.tmp")
        tmp.write_text(json.dumps(self._meta, indent=1, default=str))
        os.replace(tmp, self._dir(META_FILE))


class _disk_errors:
    """A full disk is worth retrying (space comes back); other errors propagate."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None and is_disk_full(exc):
            raise TransientError(f"disk full: {exc}") from exc
