"""Read a run back from trackio's own project database, ``$TRACKIO_DIR/<project>.db``, with plain SQLite.

- metrics: every numeric value of the run's ``metrics`` rows (``WHERE run_id = ?``, in row order),
  ``"NaN"`` / ``"Infinity"`` / ``"-Infinity"`` (how trackio stores them) decoded to floats. Exact:
  trackio keeps float64 as JSON.
- tables: values stored as ``{"_type": "trackio.table", "_value": rows}``; rows come back as stored
  (cells JSON: numbers, strings, bools, null; a NaN cell comes back as the string ``"NaN"``).
- config: the ``configs`` row, without trackio's own ``_Username`` / ``_Created`` / ``_Group``.
- status: the last ``run <status>`` alert the sink wrote at close.

Rows still waiting as JSONL fragments in ``$TRACKIO_DIR/inbox`` (trackio's network-filesystem mode,
imported into the database by the dashboard) are read too, after the database's rows.
"""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path

from readers import ReadBack
from rllog.records import RUN_STATUSES

TRACKIO_META = ("_Username", "_Created", "_Group")
SPECIAL = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def canonical_project_name(project: str) -> str:
    """trackio's on-disk project name (``trackio.utils.canonical_project_name``)."""
    safe = "".join(c for c in project if c.isalnum() or c in ("-", "_")).rstrip()
    return safe or "default"


def db_path(env: dict, project: str) -> Path:
    return Path(env["TRACKIO_DIR"]) / f"{canonical_project_name(project)}.db"


def _rows(env: dict, project: str, run_id: str) -> tuple[list[dict], dict | None, list[dict]]:
    metrics, config, alerts = [], None, []
    path = db_path(env, project)
    if path.exists():
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        conn.row_factory = sqlite3.Row
        try:
            metrics = [
                dict(r) for r in conn.execute("SELECT step, metrics, log_id FROM metrics WHERE run_id = ? ORDER BY id", (run_id,))
            ]
            row = conn.execute("SELECT config FROM configs WHERE run_id = ?", (run_id,)).fetchone()
            config = json.loads(row["config"]) if row else None
            alerts = [
                dict(r)
                for r in conn.execute(
                    "SELECT title, text, level, step, alert_id FROM alerts WHERE run_id = ? ORDER BY id", (run_id,)
                )
            ]
        finally:
            conn.close()
    seen = {m["log_id"] for m in metrics}
    seen_alerts = {a["alert_id"] for a in alerts}
    for fragment in sorted((Path(env["TRACKIO_DIR"]) / "inbox").rglob("*.jsonl")):
        for line in fragment.read_bytes().splitlines():
            record = json.loads(line)
            if record.get("run_id") != run_id or record.get("project") != project:
                continue
            if record["kind"] == "metric" and record.get("log_id") not in seen:
                metrics.append({"step": record["step"], "metrics": json.dumps(record["metrics"]), "log_id": record.get("log_id")})
                config = record.get("config") or config
            elif record["kind"] == "alert" and record.get("alert_id") not in seen_alerts:
                alerts.append(record)
    return metrics, config, alerts


def read_back(env: dict, run_info, project: str | None = None) -> ReadBack:
    metrics, config, alerts = _rows(env, project or run_info.project, run_info.run_id)
    out = ReadBack()
    for row in metrics:
        for key, value in json.loads(row["metrics"]).items():
            if isinstance(value, dict) and value.get("_type") == "trackio.table":
                out.tables.setdefault(key, []).append((row["step"], value["_value"]))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out.metrics.setdefault(key, []).append((row["step"], float(value)))
            elif isinstance(value, str) and value in SPECIAL:
                out.metrics.setdefault(key, []).append((row["step"], SPECIAL[value]))
    if config:
        out.config = {k: SPECIAL.get(v, v) if isinstance(v, str) else v for k, v in config.items() if k not in TRACKIO_META}
    for alert in alerts:
        status = alert["title"][len("run ") :] if alert["title"].startswith("run ") else None
        if status in RUN_STATUSES:
            out.status = status
        else:
            out.alerts.append(
                {"title": alert["title"], "text": alert.get("text"), "level": alert.get("level"), "step": alert.get("step")}
            )
    return out


def pin_trackio_dir(monkeypatch, path) -> None:
    """Point an already imported trackio at ``path``.

    trackio reads ``TRACKIO_DIR`` once, when it is first imported, into module globals; a test that
    changes the variable afterwards (as the ``tracker_dirs`` fixture does) must repoint them.
    """
    import trackio
    import trackio.media.media
    import trackio.run
    import trackio.sqlite_storage
    import trackio.table
    import trackio.utils

    path = Path(path)
    for module in (trackio, trackio.utils, trackio.sqlite_storage):
        monkeypatch.setattr(module, "TRACKIO_DIR", path, raising=False)
    for module in (trackio.utils, trackio.run, trackio.table, trackio.media.media):
        monkeypatch.setattr(module, "MEDIA_DIR", path / "media", raising=False)


# -- the contract suite's hooks (see readers/__init__.py) -------------------------------------------
def prepare(monkeypatch, env) -> None:
    pin_trackio_dir(monkeypatch, env["TRACKIO_DIR"])
    monkeypatch.delenv("TRACKIO_STORAGE_MODE", raising=False)


def cell(value):
    """trackio keeps NaN/inf cells as its JSON strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def alert_level(level: str) -> str:
    return "error" if level == "error" else "warn"


def run_ids(env: dict, run_info) -> set[str]:
    path = db_path(env, run_info.project)
    if not path.exists():
        return set()
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {r[0] for r in conn.execute("SELECT DISTINCT run_id FROM metrics")} | {
            r[0] for r in conn.execute("SELECT run_id FROM configs")
        }
    finally:
        conn.close()


def break_next_write(monkeypatch, sink) -> None:
    """The next storage write commits, then fails with "database is locked" (the acknowledgement is lost)."""
    from trackio.sqlite_storage import SQLiteStorage

    real, fired = SQLiteStorage.bulk_log, []

    def bulk_log(*args, **kwargs):
        real(*args, **kwargs)
        if not fired:
            fired.append(True)
            raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(SQLiteStorage, "bulk_log", staticmethod(bulk_log))
