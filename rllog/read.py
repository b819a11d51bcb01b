"""Reading a run's data back as pyarrow tables, whichever trackers it was delivered to.

Every record of a run is in its journal (``RUN_DIR/journal``), so every run can be read from there. When the
run's Parquet store holds every record of the journal (the parquet sink was selected, closed with nothing
pending and nothing dead-lettered), it is read instead: columnar files read many times faster than the journal
is decoded. Both give the same columns and the same rows, in seq order.

``attempts="latest"`` shows a resumed run as its latest attempt left it (the one rule,
:class:`rllog.records.Supersession`, says which rows a later attempt superseded); ``"all"`` keeps every row.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from rllog.errors import RllogError
from rllog.records import ALERTS_SCHEMA, METRICS_SCHEMA, AlertRecord, MetricsRecord, Supersession, TableRecord

ATTEMPTS = ("latest", "all")
PARQUET = "parquet"  # the embedded default backend's name, and its store's default directory in a run


def _check(run_dir: str | os.PathLike, attempts: str) -> Path:
    from rllog.rundir import RUN_FILE

    if attempts not in ATTEMPTS:
        raise RllogError(f"attempts={attempts!r}: use 'latest' (a resumed run as its latest attempt left it) or 'all'")
    path = Path(run_dir)
    if not (path / RUN_FILE).is_file() and not (path / PARQUET).is_dir():
        raise FileNotFoundError(f"{path} holds no rllog run (no {RUN_FILE}); `rllog runs {path}` lists the runs under a folder")
    return path


def _journal_tail(run_dir: Path) -> tuple[int, bool]:
    """``(highest seq of a readable record, whether the journal ends with an end marker)``, from the last segment
    that holds a frame (earlier segments are not read)."""
    from rllog import journal

    for segment in reversed(journal.segments(journal.journal_dir(run_dir))):
        first = int(segment.name.split(".")[0])
        reader = journal.JournalReader(run_dir, after_seq=first - 1, decode=False)
        last, ended, framed = 0, False, False
        try:
            while batch := reader.read(100_000):
                for kind, seq in batch:
                    framed = True
                    ended = kind == journal.KIND_END
                    last = last if ended else max(last, seq)
        finally:
            reader.close()
        if framed:  # a run that logged nothing still ends with its end marker
            return last, ended
    return 0, False


def journal_end(run_dir: str | os.PathLike) -> str | None:
    """The status of the end marker the journal ends with (``finished``, ``failed``, ``killed``), None when it
    does not end with one (a live run, or a trainer killed before ``finish``)."""
    from rllog.journal import End, read_all

    last, ended = _journal_tail(Path(run_dir))
    if not ended:
        return None
    status = None
    for item in read_all(run_dir, after_seq=last):  # records up to ``last`` are skipped without decoding
        status = item.status if isinstance(item, End) else None
    return status


def trainer_alive(run_dir: str | os.PathLike) -> bool:
    """Whether the process that last opened the run (run.json's ``pid``) is alive."""
    import psutil

    from rllog.rundir import RunFile

    try:
        pid = RunFile.read(run_dir).pid
    except (OSError, ValueError, TypeError, KeyError):
        return False
    return pid is not None and psutil.pid_exists(pid)


def run_status(run_dir: str | os.PathLike) -> str:
    """``finished``/``failed``/``killed`` (the journal's end marker), ``running`` (no end marker, its trainer is
    alive) or ``stopped`` (no end marker and no live trainer: killed before ``finish``)."""
    end = journal_end(run_dir)
    if end is not None:
        return end
    return "running" if trainer_alive(run_dir) else "stopped"


def parquet_store(run_dir: str | os.PathLike) -> Path | None:
    """The run's Parquet store directory when it is the run's data, else None (read the journal).

    The store is the run's data when the parquet sink is one of the run's sinks, has not failed and has
    dead-lettered nothing, and, once the run has ended (or its trainer died), holds every record of the journal. A
    live run's store lags the journal by up to ``flush_interval``, as every tracker does."""
    from rllog.delivery import CursorStore, SinkState
    from rllog.rundir import RUN_FILE, RunFile

    run_dir = Path(run_dir)
    if not (run_dir / RUN_FILE).is_file():  # a store a ParquetSink wrote on its own, outside a run
        return run_dir / PARQUET
    sinks = RunFile.read(run_dir).sinks
    spec = next((s for s in sinks if s.name == PARQUET), None)
    if spec is None or not (run_dir / "delivery" / f"{PARQUET}.json").is_file():
        return None
    cursor = CursorStore(run_dir, PARQUET).load()
    if cursor.state in SinkState.BROKEN or cursor.dead_letter_count:
        return None
    last, ended = _journal_tail(run_dir)
    if cursor.seq < last and (ended or not trainer_alive(run_dir)):
        return None  # delivery stopped short (a deadline, a killed agent) and will not catch up: the journal has the rest
    directory = Path(spec.options.get("directory") or PARQUET)
    return directory if directory.is_absolute() else run_dir / directory


def _read_store(directory: Path) -> pa.Table | None:
    from rllog_backends.parquet_store import read_store  # the store's documented read API; pyarrow only

    return read_store(directory)


def _journal(run_dir: Path) -> Iterator[MetricsRecord | TableRecord | AlertRecord]:
    from rllog.journal import End, read_all

    for item in read_all(run_dir):
        if not isinstance(item, End):
            yield item  # type: ignore[misc]  # a ConfigRecord is yielded too; every caller picks its kind


def _metrics(run_dir: Path) -> pa.Table:
    store = parquet_store(run_dir)
    if store is not None:
        table = _read_store(store / "metrics")
        return table if table is not None else METRICS_SCHEMA.empty_table()
    columns: dict[str, list] = {name: [] for name in METRICS_SCHEMA.names}
    for record in _journal(run_dir):
        if isinstance(record, MetricsRecord):
            for key, value in record.values.items():
                columns["step"].append(record.step)
                columns["key"].append(key)
                columns["value"].append(value)
                columns["time"].append(record.time)
                columns["seq"].append(record.seq)
    return pa.table(columns, schema=METRICS_SCHEMA)


def _supersession(run_dir: Path, metrics: pa.Table | None = None) -> Supersession:
    """The run's :class:`~rllog.records.Supersession`, every later attempt's restart decided; ``metrics`` (the run's,
    every attempt) are read only when the run has later attempts."""
    from rllog.rundir import RUN_FILE, load_run_info

    if not (run_dir / RUN_FILE).is_file():
        return Supersession()
    rule = Supersession.of(load_run_info(run_dir)[0])
    if not rule.later_attempts():
        return rule
    return rule.decide_from(metrics if metrics is not None else _metrics(run_dir))


def read_metrics(run_dir: str | os.PathLike, attempts: str = "latest") -> pa.Table:
    """Every metric value of ``run_dir``: a ``pyarrow.Table`` (step, key, value, time, seq), in seq order.

    Raises:
        FileNotFoundError: ``run_dir`` holds no run.
        RllogError: ``attempts`` is neither ``"latest"`` nor ``"all"``.
    """
    path = _check(run_dir, attempts)
    table = _metrics(path)
    return table if attempts == "all" else _supersession(path, table).without_superseded(table, "seq", "step")


def read_alerts(run_dir: str | os.PathLike, attempts: str = "latest") -> pa.Table:
    """The health alerts of ``run_dir``: a ``pyarrow.Table`` (step, seq, time, rule, metric, value, message, level)."""
    path = _check(run_dir, attempts)
    store = parquet_store(path)
    if store is not None:
        table = _read_store(store / "alerts")
        table = table if table is not None else ALERTS_SCHEMA.empty_table()
    else:
        alerts = [a for a in _journal(path) if isinstance(a, AlertRecord)]
        table = pa.table({name: [getattr(a, name) for a in alerts] for name in ALERTS_SCHEMA.names}, schema=ALERTS_SCHEMA)
    return table if attempts == "all" else _supersession(path).without_superseded(table, "seq", "step")


def _table_from_journal(run_dir: Path, name: str) -> pa.Table | None:
    parts = []
    for record in _journal(run_dir):
        if isinstance(record, TableRecord) and record.name == name:
            n = record.table.num_rows
            table = record.table.add_column(0, "_seq", pa.array([record.seq] * n, pa.int64()))
            parts.append(table.add_column(0, "_step", pa.array([record.step] * n, pa.int64())))
    if not parts:
        return None
    return pa.concat_tables(parts, promote_options="permissive")


def table_names(run_dir: str | os.PathLike) -> list[str]:
    """The names of the tables logged in ``run_dir``."""
    path = _check(run_dir, "all")
    return sorted({r.name for r in _journal(path) if isinstance(r, TableRecord)})


def read_table(run_dir: str | os.PathLike, name: str, attempts: str = "latest") -> pa.Table:
    """Every row logged to table ``name`` in ``run_dir``: a ``pyarrow.Table`` (_step, _seq, columns...).

    Raises:
        KeyError: no table of that name (the message lists the tables the run has).
    """
    from rllog.rundir import table_dir_name

    path = _check(run_dir, attempts)
    store = parquet_store(path)
    table = _read_store(store / "tables" / table_dir_name(name)) if store is not None else _table_from_journal(path, name)
    if table is None:
        names = table_names(path)
        raise KeyError(f"no table {name!r} in {path}; it has: {', '.join(map(repr, names)) if names else 'no tables'}")
    return table if attempts == "all" else _supersession(path).without_superseded(table, "_seq", "_step")
