"""trackio backend: the run's rows go into trackio's local project database, synchronously.

trackio keeps one SQLite file per project, ``$TRACKIO_DIR/<project>.db`` (``TRACKIO_DIR`` defaults to
``$HF_HOME/trackio``). The sink creates the run as a :class:`trackio.Run` with
``run_id = run_info.run_id`` (so a replay resumes the same trackio run, and two rllog runs with the same
name stay two trackio runs), then writes each batch with the storage call trackio's own background
sender makes (``SQLiteStorage.bulk_log``; on a network filesystem, where trackio itself switches to
JSONL fragments, ``FragmentWriter.write_local``). Rows are held until ``flush``, which writes them in one
call (one connection and one transaction, instead of two per step) and returns once they are committed.

Why not ``Run.log``: it queues the row for a background thread that writes every 0.5 s; when that
write fails (e.g. "database is locked") trackio only warns, once, and the batch is dropped; rows
are stamped with the flush time, not the log time; and there is no public flush. Writing through
the storage layer instead makes ``flush`` durable when it returns, raises on failure (a
locked database becomes :class:`~rllog.errors.TransientError`, retried), and stays idempotent:
every row carries a ``log_id`` derived from ``(run_id, seq)`` and trackio inserts with
``INSERT OR IGNORE`` on it, so a retried or replayed batch never duplicates a row.

Mapping: metric keys are kept, except trackio's reserved names (``project run timestamp step time
metrics`` and keys starting with ``__``) which get a ``__`` prefix, as ``trackio.log`` does; tables are
``trackio.Table`` values under their name; config keys starting with ``_`` (reserved by trackio) become
``config/_<key>``; alerts are trackio alerts; the end status is an alert titled ``run <status>``
(trackio has no run status field).

Config given after ``open`` (``Run.update_config``) is merged into the run's config and stored at once
the way trackio stores config: with a metrics row (an empty one, at the update's step, deduplicated on
its ``log_id`` like every row). trackio's own CPU/GPU monitors stay off: they would measure rllog's
delivery process; rllog sends the trainer's ``system/...`` metrics itself.

Read back with plain SQLite::

    SELECT step, metrics FROM metrics WHERE run_id = :run_id ORDER BY id
    SELECT config FROM configs WHERE run_id = :run_id
    SELECT title, level, step FROM alerts WHERE run_id = :run_id ORDER BY id

or open the dashboard: ``trackio show --project <project>``.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import sqlite3
import uuid
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from rllog.errors import TransientError
from rllog.records import AlertRecord, ConfigRecord, MetricsRecord, RunInfo, TableRecord
from rllog.sink import Capabilities
from rllog.sink_errors import map_errors
from rllog_backends._conventions import remember_location

log = logging.getLogger(__name__)

ALERT_LEVELS = ("info", "warn", "error")
STATUS_TITLE = "run {status}"


def _iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).isoformat()


def _json_safe(value: Any) -> Any:
    """A table cell as a value trackio can store (JSON; NaN/inf are handled by trackio)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="backslashreplace")
    if isinstance(value, (_dt.datetime, _dt.date, _dt.time)):
        return value.isoformat()
    return str(value)


def _config_keys(config: Any) -> dict[str, Any]:
    """Config keys as stored: a key starting with ``_`` (reserved by trackio) becomes ``config/_<key>``."""
    return {(f"config/{k}" if k.startswith("_") else k): v for k, v in config.items()}


def trackio_key(name: str) -> str:
    """A metric key or table name as ``trackio.log`` stores it: reserved names get a ``__`` prefix."""
    from trackio.utils import RESERVED_KEYS

    return f"__{name}" if name in RESERVED_KEYS or name.startswith("__") else name


class TrackioSink:
    """Writes rllog records to trackio's local project database.

    Args:
        project: trackio project; default ``run_info.project``.
        name: trackio run name; default ``run_info.name``.
        group: trackio run group (the dashboard can toggle a group at once); default none.

    The database's directory is ``TRACKIO_DIR`` (read by trackio when it is first imported).
    ``TRACKIO_SPACE_ID`` / ``TRACKIO_SERVER_URL`` are not used: the sink writes locally; push a
    project to a Space afterwards with ``trackio sync``.

    Example:
        >>> run = rllog.init(report_to="trackio", project="grpo-math", config=args)
        >>> run.log({"reward": 0.41}, step=10)
        >>> run.finish()
        $ trackio show --project grpo-math
    """

    # Rows are held until flush(), which commits them in one storage call (trackio's bulk_log opens two
    # connections, checks the schema and commits: per call, not per row).
    capabilities = Capabilities(tables=True, config=True, alerts=True, durable_writes=False)
    prepare_imports = ("trackio.sqlite_storage", "trackio.fragments")  # a standby agent imports them ahead: rllog.prepare

    def __init__(self, project: str | None = None, name: str | None = None, group: str | None = None):
        self.project = project
        self.name = name
        self.group = group
        self._run: Any = None
        self._project = ""  # the project written to, once open
        self._last_step = 0
        self._pending: list[tuple[dict, MetricsRecord | TableRecord | ConfigRecord]] = []  # rows held until flush

    def open(self, run_info: RunInfo) -> None:
        import trackio
        from trackio import utils
        from trackio.sqlite_storage import SQLiteStorage

        for var in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
            if os.environ.get(var):
                log.warning("rllog: the trackio sink writes to the local database only; %s is ignored (use `trackio sync`)", var)
        self._project = self.project or run_info.project
        SQLiteStorage.validate_project_name(self._project)
        config = _config_keys(run_info.config)
        with _mapped_errors():
            self._run = trackio.Run(
                url=None,
                project=self._project,
                client=None,
                name=self.name or run_info.name,
                run_id=run_info.run_id,
                group=self.group,
                config=config,
                auto_log_cpu=False,
                auto_log_gpu=False,
            )
        try:  # a resumed run keeps its creation time
            previous = SQLiteStorage.get_run_config(self._project, run_id=self._run.id) or {}
        except Exception:
            previous = {}
        if previous.get("_Created"):
            self._run.config["_Created"] = previous["_Created"]
        self._jsonl = utils.get_storage_mode() == "jsonl"
        if self._jsonl:
            from trackio import fragments

            # One writer directory per open, named to sort in time order (trackio imports the
            # inbox's fragments in path order).
            self._fragments = fragments.FragmentWriter(f"rllog-{self._run.id}-{int(_dt.datetime.now().timestamp() * 1000):013d}")
        self._config_written = False
        remember_location(run_info, "trackio", project=self._project, db=str(SQLiteStorage.get_project_db_path(self._project)))

    def write_metrics(self, records: Sequence[MetricsRecord]) -> None:
        self._write([({trackio_key(k): v for k, v in r.values.items()}, r) for r in records if r.values])

    def write_table(self, record: TableRecord) -> None:
        import trackio

        name = trackio_key(record.name)
        rows = [_json_safe(row) for row in record.table.to_pylist()]
        value = trackio.Table(data=rows)._to_dict(project=self._project, run=self._run.name, step=record.step)
        self._write([({name: value}, record)])

    def write_config(self, record: ConfigRecord) -> None:
        """Config given after ``open``: merged into the run's config and stored at the next flush, with an empty metrics row."""
        self._run.config.update(_config_keys(record.values))
        self._config_written = False
        self._write([({}, record)])

    def write_alert(self, record: AlertRecord) -> None:
        """A health alert as a trackio alert (deduplicated on its ``seq``)."""
        self._store_alert(
            f"{record.rule}: {record.metric}",
            record.message,
            level="error" if record.level == "error" else "warn",
            step=record.step,
            time=record.time,
            alert_id=uuid.uuid5(uuid.NAMESPACE_URL, f"rllog:{self._run.id}:{record.seq}").hex,
        )

    def _store_alert(
        self,
        title: str,
        text: str | None = None,
        level: str = "warn",
        step: int | None = None,
        time: float | None = None,
        alert_id: str | None = None,
    ) -> None:
        """Store a trackio alert (listed in the dashboard's alerts).

        ``level`` is ``info``, ``warn`` or ``error``; ``step`` defaults to the last step written.
        """
        level = level.lower() if level and level.lower() in ALERT_LEVELS else "warn"
        step = self._last_step if step is None else step
        timestamp = _iso(time if time is not None else _dt.datetime.now().timestamp())
        alert_id = alert_id or uuid.uuid4().hex
        run = self._run
        if self._jsonl:
            from trackio import fragments

            entry = {
                "project": self._project,
                "run": run.name,
                "run_id": run.id,
                "title": title,
                "text": text,
                "level": level,
                "step": step,
                "timestamp": timestamp,
                "alert_id": alert_id,
            }
            self._call(lambda: self._fragments.write_local([fragments.alert_record(entry)]))
        else:
            from trackio.sqlite_storage import SQLiteStorage

            self._call(
                lambda: SQLiteStorage.bulk_alert(
                    project=self._project,
                    run=run.name,
                    run_id=run.id,
                    titles=[title],
                    texts=[text],
                    levels=[level],
                    steps=[step],
                    timestamps=[timestamp],
                    alert_ids=[alert_id],
                )
            )

    def flush(self) -> None:
        """Commit the rows written since the last flush, in one storage call."""
        if self._pending:
            self._store(self._pending)
            self._pending = []

    def close(self, status: str) -> None:
        if self._run is None:
            return
        self.flush()
        self._store_alert(
            STATUS_TITLE.format(status=status),
            f"rllog closed this run with status {status!r}.",
            level="info" if status == "finished" else "error",
            alert_id=uuid.uuid5(uuid.NAMESPACE_URL, f"rllog:{self._run.id}:status:{status}").hex,
        )
        with _mapped_errors():
            self._run.finish()  # stops the Run's (idle) sender thread
        self._run = None

    # -- internals -------------------------------------------------------------------------------
    def _write(self, items: list[tuple[dict, MetricsRecord | TableRecord | ConfigRecord]]) -> None:
        self._pending.extend(items)
        if items:
            self._last_step = max(self._last_step, *(r.step for _, r in items))

    def _store(self, items: list[tuple[dict, MetricsRecord | TableRecord | ConfigRecord]]) -> None:
        run = self._run
        metrics = [m for m, _ in items]
        steps = [r.step for _, r in items]
        timestamps = [_iso(r.time) for _, r in items]
        log_ids = [uuid.uuid5(uuid.NAMESPACE_URL, f"rllog:{run.id}:{r.seq}").hex for _, r in items]
        config = None if self._config_written else run.config
        if self._jsonl:
            from trackio import fragments

            records = [
                fragments.metric_record(
                    {
                        "project": self._project,
                        "run": run.name,
                        "run_id": run.id,
                        "metrics": m,
                        "step": s,
                        "timestamp": t,
                        "config": config if i == 0 else None,
                        "log_id": lid,
                    }
                )
                for i, (m, s, t, lid) in enumerate(zip(metrics, steps, timestamps, log_ids, strict=True))
            ]
            self._call(lambda: self._fragments.write_local(records))
        else:
            from trackio.sqlite_storage import SQLiteStorage

            self._call(
                lambda: SQLiteStorage.bulk_log(
                    project=self._project,
                    run=run.name,
                    run_id=run.id,
                    metrics_list=metrics,
                    steps=steps,
                    timestamps=timestamps,
                    config=config,
                    log_ids=log_ids,
                )
            )
        self._config_written = True

    @staticmethod
    def _call(fn) -> None:
        """Run one storage call, its failures worth a retry raised as rllog's."""
        with _mapped_errors():
            fn()


def _busy(exc: BaseException) -> TransientError | None:
    """trackio's "the database is in use" errors: SQLite's own, and its file lock's timeout."""
    message = str(exc).lower()
    if isinstance(exc, sqlite3.OperationalError) and ("locked" in message or "busy" in message):
        return TransientError(f"trackio database busy: {exc}")
    if isinstance(exc, OSError) and "could not acquire database lock" in message:
        return TransientError(f"trackio database lock: {exc}")
    return None


def _mapped_errors() -> AbstractContextManager[None]:
    """Re-raises a busy database and a full disk (:mod:`rllog.sink_errors`) as :class:`~rllog.errors.TransientError`."""
    return map_errors("trackio", classify=_busy)
