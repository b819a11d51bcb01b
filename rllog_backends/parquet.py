"""The embedded default backend: analysis-friendly Parquet files in the run directory, and reading them.

Layout (``RUN_DIR/parquet/``, or the ``directory`` option)::

    metrics/part-*.parquet           long format: step, key, value, time, seq
    tables/<name>/part-*.parquet     _step, _seq, then the table's own columns
    alerts/part-*.parquet            step, seq, time, rule, metric, value, message, level
    */_tail-*.arrows                 the latest flushes, not yet in a part (Arrow IPC; read by rllog.read_*)
    meta.json                        the store's record of the run: project, name, run_id, tags,
                                     config (with Run.update_config's changes), status

``<name>`` is the table name percent-encoded (``eval/samples`` -> ``eval%2Fsamples``), so two table
names never share a directory. Each directory is a :class:`rllog_backends.parquet_store.PartStore`: a
``flush`` appends to its tail (durable against a killed process, readable at once by :func:`read_metrics`),
full tails become Parquet parts and parts are merged in tiers while the run goes on, so a run of any
length keeps a bounded number of files and the agent never holds the whole run in memory. At ``close``
the tails become parts: a finished run is Parquet only.

The sink buffers until ``flush``, so its writes are not durable (``durable_writes=False``): the delivery
layer moves its cursor only after a flush. Records re-sent after an agent was killed between a flush and
its cursor save are recognised by their ``seq`` (each directory knows its highest) and not written twice.

Open the data with :func:`read_metrics` / :func:`read_table` (``rllog.read_metrics`` and friends), or
directly (the parts only: a running run's latest flushes are in the tails)::

    pandas.read_parquet("RUN_DIR/parquet/metrics")
    duckdb.sql("select * from read_parquet('RUN_DIR/parquet/tables/completions/*.parquet', union_by_name=true)")
"""

from __future__ import annotations

import errno
import json
import os
import resource
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from rllog.errors import InvalidTable, TransientError
from rllog.files import JOURNAL_RESERVE_MIN_BYTES, free_bytes, holds_reserve
from rllog.records import (
    ALERTS_SCHEMA,
    METRICS_SCHEMA,
    AlertRecord,
    ConfigRecord,
    MetricsRecord,
    RunInfo,
    Supersession,
    TableRecord,
)
from rllog.rundir import RunFile
from rllog.sink import Capabilities, took
from rllog.sink_errors import is_disk_full
from rllog_backends.parquet_store import PartStore, check_table, table_dir_name, whole_record_slices

DEFAULT_DIRECTORY = "parquet"
META_FILE = "meta.json"
# The open tails may hold at most this share of the process's open-file limit (RLIMIT_NOFILE): the trackers, the
# journal reader, sockets and the agent's own files need the rest, and one file too many fails every sink alike.
OPEN_FILES_SHARE = 8


def open_tail_cap(cap: int) -> int:
    """``cap``, or less under a low open-file limit: at most 1/:data:`OPEN_FILES_SHARE` of the soft limit, read
    now (``ulimit -n`` and ``prlimit`` change it while a process runs), never below one."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return cap
    return max(1, min(cap, soft // OPEN_FILES_SHARE))


def store_directories(directory: Path) -> list[Path]:
    """Every store directory of a parquet store: metrics, alerts and one per table."""
    tables = directory / "tables"
    found = [directory / "metrics", directory / "alerts", *(sorted(tables.iterdir()) if tables.is_dir() else [])]
    return [d for d in found if d.is_dir()]


def repair(directory: Path, status: str | None) -> None:
    """Finish what a writer killed at close left in a store (``rllog replay`` calls it, holding the sink's lock):
    leftover temporary files and files a merge replaced are removed; for a run that ended (``status``, from the
    end of its journal) tails become parts, each directory is merged into one part, and ``meta.json`` says the
    status. A running run's store is only tidied (its writer merges in tiers)."""
    with _disk_errors():
        for path in store_directories(directory):
            store = PartStore(path, "_seq" if path.parent.name == "tables" else "seq")
            store.open()
            if status is not None:
                store.close()
        meta_path = directory / META_FILE
        if status is not None and meta_path.exists():
            try:
                meta = json.loads(meta_path.read_text())
            except ValueError:
                return
            if meta.get("status") == "running":
                meta["status"] = status
                _replace_meta(directory, meta)


def table_name(dir_name: str) -> str:
    """The table name a directory of :func:`table_dir_name` holds."""
    return urllib.parse.unquote(dir_name)


def read_parts(directory: Path) -> pa.Table | None:
    """Every row of one store directory, in seq order (None when it holds none)."""
    return PartStore.read(directory)


# -- reading a run's files -------------------------------------------------------------------------


def _run_file(run_dir: Path) -> RunFile | None:
    try:
        return RunFile.read(run_dir)
    except (FileNotFoundError, ValueError, TypeError, KeyError):
        return None


def store_dir(run_dir: str | os.PathLike) -> Path:
    """Where the parquet backend of ``run_dir`` writes: its ``directory`` option from ``run.json``, else ``RUN_DIR/parquet``."""
    run_dir = Path(run_dir)
    run_file = _run_file(run_dir)
    for spec in run_file.sinks if run_file is not None else []:
        directory = spec.options.get("directory") if spec.name == "parquet" else None
        if directory:
            return Path(directory) if Path(directory).is_absolute() else run_dir / directory
    return run_dir / DEFAULT_DIRECTORY


def _supersession(run_dir: Path, metrics: pa.Table) -> Supersession:
    """The run's :class:`~rllog.records.Supersession` with every later attempt's restart decided from ``metrics``
    (long format, in seq order): the first rows of each attempt, in order, until one decides."""
    run_file = _run_file(run_dir)
    rule = Supersession.of(run_file.run_info(run_dir)) if run_file is not None else Supersession()
    return rule.decide_from(metrics)


def _metrics_all(run_dir: Path) -> pa.Table:
    table = read_parts(store_dir(run_dir) / "metrics")
    return table if table is not None else METRICS_SCHEMA.empty_table()


def read_metrics(run_dir: str | os.PathLike, attempts: str = "latest") -> pa.Table:
    """The metrics of ``run_dir``: a ``pyarrow.Table`` (step, key, value, time, seq), in seq order.

    Args:
        attempts: ``"latest"`` (default): a resumed run's values as the latest attempt left them (what an
            earlier attempt logged from the step a later one restarted at is left out); ``"all"``: every row.
    """
    run_dir = Path(run_dir)
    table = _metrics_all(run_dir)
    return table if attempts == "all" else _supersession(run_dir, table).without_superseded(table, "seq", "step")


def read_alerts(run_dir: str | os.PathLike, attempts: str = "latest") -> pa.Table:
    """The health alerts of ``run_dir``: a ``pyarrow.Table`` (step, seq, time, rule, metric, value, message, level)."""
    run_dir = Path(run_dir)
    table = read_parts(store_dir(run_dir) / "alerts")
    table = table if table is not None else ALERTS_SCHEMA.empty_table()
    return table if attempts == "all" else _supersession(run_dir, _metrics_all(run_dir)).without_superseded(table, "seq", "step")


def read_table(run_dir: str | os.PathLike, name: str, attempts: str = "latest") -> pa.Table:
    """Every row logged to table ``name`` in ``run_dir``: a ``pyarrow.Table`` (_step, _seq, columns...).

    Raises:
        KeyError: no table of that name.
    """
    run_dir = Path(run_dir)
    table = read_parts(store_dir(run_dir) / "tables" / table_dir_name(name))
    if table is None:
        raise KeyError(f"no table {name!r} in {run_dir}")
    return (
        table if attempts == "all" else _supersession(run_dir, _metrics_all(run_dir)).without_superseded(table, "_seq", "_step")
    )


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

    Example:
        >>> run = rllog.init(report_to="parquet")   # also the default
        >>> ...
        >>> rllog.read_metrics(run.run_dir).to_pandas()
    """

    capabilities = Capabilities(tables=True, config=True, alerts=True, durable_writes=False)
    check_table = staticmethod(check_table)  # what the store can hold, asked in the trainer at log_table
    MAX_BUFFERED_ROWS = 100_000  # rows are appended early past this: memory stays bounded while catching up
    MAX_OPEN_TAILS = 16  # tail files kept open; a run logging many table names would hold one handle per name
    MAX_OPEN_TAILS_IN_USE = 256  # ... but those written at the last flush stay open, up to this many
    # Rows committed per append: a flush of a large backlog commits piece by piece, so a disk with room for part of
    # it takes that part (the rest waits, never written twice) rather than refusing one append of everything forever.
    # 16,384 rows of 20-metric steps are ~200 KB in a compressed tail.
    PIECE_ROWS = 16_384

    def __init__(self, directory: str | None = None):
        self._option = directory
        self.directory: Path | None = None
        self._rows: list[tuple[int, str, float, float, int]] = []
        self._tables: dict[str, list[pa.Table]] = {}
        self._table_seqs: dict[str, int] = {}  # the first buffered record's seq, per table (names an empty table's part)
        self._alerts: list[dict] = []
        self._stores: dict[Path, PartStore] = {}
        self._written_now: set[Path] = set()  # directories written since the last flush (their tails stay open)

    def open(self, run_info: RunInfo) -> None:
        if self._option:
            option = Path(self._option)
            self.directory = option if option.is_absolute() else Path(run_info.run_dir) / option
        else:
            self.directory = Path(run_info.run_dir) / DEFAULT_DIRECTORY
        self._journal = Path(run_info.run_dir) / "journal"
        with _disk_errors():
            self.directory.mkdir(parents=True, exist_ok=True)
            self._meta: dict[str, Any] = {
                "project": run_info.project,
                "name": run_info.name,
                "run_id": run_info.run_id,
                "config": dict(run_info.config),
                "tags": list(run_info.tags),
                "status": "running",
            }
            previous = self.directory / META_FILE
            if previous.exists():  # a resumed run or a replay: keep the config updates delivered before
                try:
                    self._meta["config"] = {**json.loads(previous.read_text()).get("config", {}), **self._meta["config"]}
                except ValueError:
                    pass
            self._write_meta()
            for path in store_directories(self.directory):  # leftovers of a writer killed inside a merge
                self._store_at(path)

    def _store_at(self, directory: Path) -> PartStore:
        store = self._stores.get(directory)
        if store is None:
            store = PartStore(directory, "_seq" if directory.parent.name == "tables" else "seq")
            with _disk_errors():
                store.open()
            self._stores[directory] = store
        return store

    def _store(self, *parts: str) -> PartStore:
        return self._store_at(self._dir(*parts))

    @staticmethod
    def _is_new(store: PartStore, seq: int) -> bool:
        """Whether record ``seq`` is not in the store yet: one sent again after a killed agent had stored it (and
        not saved its cursor) is recognised by its seq, the store knowing its highest. A record buffered and not
        stored is never sent again to the same sink (the delivery layer's rule; :func:`rllog.sink.took`)."""
        return seq > store.written_seq

    def write_metrics(self, records: Sequence[MetricsRecord]) -> None:
        store = self._store("metrics")
        for r in records:
            if self._is_new(store, r.seq):
                if self._rows and len(self._rows) + len(r.values) > self.MAX_BUFFERED_ROWS:
                    self.flush()  # per record, not after the call: a batch of wide records stays bounded
                self._rows.extend([(r.step, key, value, r.time, r.seq) for key, value in r.values.items()])  # whole or not at all
                took(records, r.seq)  # buffered: a flush below that fails (a full disk) keeps it for the next one
                if len(self._rows) >= self.MAX_BUFFERED_ROWS:
                    self.flush()

    def write_table(self, record: TableRecord) -> None:
        store = self._store("tables", table_dir_name(record.name))
        if not self._is_new(store, record.seq):
            return
        n = record.table.num_rows
        table = record.table.add_column(0, "_step", pa.repeat(pa.scalar(record.step, pa.int64()), n))
        table = table.add_column(1, "_seq", pa.repeat(pa.scalar(record.seq, pa.int64()), n))
        known = [store.schema] if store.schema is not None else []
        try:  # a column's type that cannot be promoted is refused here, so this record alone is rejected (dead-lettered)
            pa.unify_schemas(
                [*known, *(t.schema for t in self._tables.get(record.name, [])), table.schema], promote_options="permissive"
            )
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise InvalidTable(f"table {record.name!r}: a column's type changed from earlier steps: {exc}") from exc
        self._tables.setdefault(record.name, []).append(table)
        self._table_seqs.setdefault(record.name, record.seq)

    def write_config(self, record: ConfigRecord) -> None:
        self._meta["config"].update(record.values)
        with _disk_errors():
            self._write_meta()

    def write_alert(self, record: AlertRecord) -> None:
        store = self._store("alerts")
        if self._is_new(store, record.seq):
            self._alerts.append(
                {
                    "step": record.step,
                    "seq": record.seq,
                    "time": record.time,
                    "rule": record.rule,
                    "metric": record.metric,
                    "value": record.value,
                    "message": record.message,
                    "level": record.level,
                }
            )

    def flush(self) -> None:
        """Each buffer is appended to its directory's tail and committed (durable) in pieces of whole records, each
        piece dropped from the buffer once committed. A piece the disk refuses (full, or below the room left to the
        journal) is cut back to the last commit and stays buffered with what follows it, for the retry. Parts and
        merges follow, also after a refused piece: a tail turned into a part is what makes room on a full disk."""
        try:
            with _disk_errors():
                self._write_buffers()
        finally:
            with _disk_errors():
                for store in self._stores.values():
                    store.maintain()  # a full disk leaves parts and merges for a later flush

    def _write_buffers(self) -> None:
        if self._alerts:
            table = pa.Table.from_pylist(self._alerts, schema=ALERTS_SCHEMA)
            self._commit(self._store("alerts"), table, lambda n: self._alerts.__delitem__(slice(0, n)))
        if self._rows:
            columns = list(zip(*self._rows, strict=True))
            arrays = [pa.array(c, t.type) for c, t in zip(columns, METRICS_SCHEMA, strict=True)]
            table = pa.Table.from_arrays(arrays, schema=METRICS_SCHEMA)
            self._commit(self._store("metrics"), table, lambda n: self._rows.__delitem__(slice(0, n)))
        for name in list(self._tables):
            tables = self._tables[name]
            table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
            self._tables[name] = [table]

            def committed(n: int, name: str = name) -> None:
                rest = self._tables[name][0].slice(n)
                if rest.num_rows:
                    self._tables[name], self._table_seqs[name] = [rest], rest.column("_seq")[0].as_py()
                else:
                    del self._tables[name], self._table_seqs[name]

            self._commit(self._store("tables", table_dir_name(name)), table, committed, seq=self._table_seqs[name])
        self._release_idle_tails()

    def _commit(self, store: PartStore, table: pa.Table, committed: Callable[[int], None], seq: int | None = None) -> None:
        """Append and commit ``table`` in pieces of whole records; ``committed(n)`` after each piece, ``n`` its rows
        (the caller drops them from the front of its buffer)."""
        self._stores[store.directory] = self._stores.pop(store.directory)  # the stores in the order last written
        self._written_now.add(store.directory)
        if not store.holds_open_file:
            self._make_tail_room(store)
        if not table.num_rows:
            store.append(table, seq=seq)
            committed(0)
            return
        for piece in whole_record_slices(table, store.seq_column, self.PIECE_ROWS):
            self._check_room()
            store.append(piece)
            store.commit()
            committed(piece.num_rows)

    def _check_room(self) -> None:
        """Yield to the journal: refuse to write (the delivery layer retries later) while the disk has less free than
        the journal's smallest top-up of its reserve (:data:`rllog.files.JOURNAL_RESERVE_MIN_BYTES`) and the journal,
        on the same file system, holds a reserve (its writer is live). A journal that has ended gave its reserve
        back, so the store may then take the disk's last bytes; one whose reserve ran out cannot be helped by 64 KiB."""
        assert self.directory is not None
        free = free_bytes(self.directory)
        if free is None or free >= JOURNAL_RESERVE_MIN_BYTES:
            return
        try:
            if os.stat(self.directory).st_dev != os.stat(self._journal).st_dev:
                return
        except OSError:
            return
        if holds_reserve(self._journal):  # a full disk to the delivery layer: waited for while the run lives
            raise TransientError(
                f"disk full: {free} bytes free in {self.directory}, under the {JOURNAL_RESERVE_MIN_BYTES} kept for the run's journal"
            ) from OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def _make_tail_room(self, store: PartStore) -> None:
        """Before ``store`` opens a tail: close the least recently written open tails past the cap (a flush that
        writes many table names would otherwise open one file per name before :meth:`_release_idle_tails`)."""
        open_tails = [s for s in self._stores.values() if s.holds_open_file and s is not store]
        for idle in open_tails[: max(0, len(open_tails) + 1 - open_tail_cap(self.MAX_OPEN_TAILS_IN_USE))]:
            idle.release()

    def _release_idle_tails(self) -> None:
        """Close the tails of the least recently written directories past :attr:`MAX_OPEN_TAILS`: each table name
        has a directory, and 200 names held 200 file handles until close (a process has a limit, often 1,024)."""
        open_tails = [store for store in self._stores.values() if store.holds_open_file]
        idle = [store for store in open_tails if store.directory not in self._written_now]  # least recently first
        busy = [store for store in open_tails if store.directory in self._written_now]
        for store in idle[: max(0, len(open_tails) - open_tail_cap(self.MAX_OPEN_TAILS))]:
            store.release()
        # tails written at this flush stay open (closed, each would be a new part at every flush), up to a hard cap
        for store in busy[: max(0, len(busy) - open_tail_cap(self.MAX_OPEN_TAILS_IN_USE))]:
            store.release()
        self._written_now.clear()

    def close(self, status: str) -> None:
        self.flush()
        with _disk_errors():
            for store in self._stores.values():
                store.close()
            self._meta["status"] = status
            self._write_meta()

    # -- internals ---------------------------------------------------------------------------------
    def _dir(self, *parts: str) -> Path:
        assert self.directory is not None, "open() first"
        return self.directory.joinpath(*parts)

    def _write_meta(self) -> None:
        _replace_meta(self._dir(), self._meta)


def _replace_meta(directory: Path, meta: dict) -> None:
    tmp = directory / f".{META_FILE}.tmp"
    tmp.write_text(json.dumps(meta, indent=1, default=str))
    os.replace(tmp, directory / META_FILE)


class _disk_errors:
    """A full disk is worth retrying (space comes back); other errors propagate."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None and is_disk_full(exc):
            raise TransientError(f"disk full: {exc}") from exc
