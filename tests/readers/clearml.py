"""Read a run back from ClearML's offline sessions: ``<CLEARML_CACHE_DIR>/offline/offline-<id>/``.

A session folder holds ``task.json`` (the task: name, project, tags, hyperparameters), ``metrics.jsonl``
(JSON lists of events) and ``log.jsonl``. The run's sessions are those tagged ``rllog.run_id=<run_id>``, read
in the order of their first log line (ClearML writes one when the task starts).

- metrics: ``training_stats_scalar`` events, ``(iter, value)`` under :func:`rllog_backends.clearml.key_of`
  of (metric, variant), in the order written. NaN is stored as the JSON token ``NaN``; ±inf as ±1.797e308.
- tables: ``plot`` events whose plotly data is a table (header values, column-wise cell values).
- config: the ``General`` hyperparameter section, values as ClearML stores them (text).
- status: the ``rllog.status=<status>`` tag.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from readers import ReadBack
from rllog_backends.clearml import MAX_DOUBLE, RUN_ID_TAG, SECTION, STATUS_TAG, key_of


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [event for line in path.read_text(encoding="utf-8").splitlines() if line.strip() for event in json.loads(line)]


def sessions(cache_dir: str | Path, run_id: str) -> list[tuple[dict, list[dict]]]:
    """``(task.json, metric events)`` of every offline session of the run, oldest first."""
    found = []
    for task_file in Path(cache_dir).glob("offline/offline-*/task.json"):
        task = json.loads(task_file.read_text(encoding="utf-8"))
        if RUN_ID_TAG + run_id not in (task.get("tags") or []):
            continue
        logs = _events(task_file.parent / "log.jsonl")
        started = min((e["timestamp"] for e in logs), default=task_file.stat().st_mtime * 1000)
        found.append((started, task, _events(task_file.parent / "metrics.jsonl")))
    return [(task, events) for _, task, events in sorted(found, key=lambda t: t[0])]


def _table(plot_str: str) -> list[dict] | None:
    data = json.loads(plot_str).get("data") or [{}]
    if data[0].get("type") != "table":
        return None
    header = [h[0] if isinstance(h, list) else h for h in data[0]["header"]["values"]]
    columns = data[0]["cells"]["values"]
    return [dict(zip(header, row, strict=True)) for row in zip(*columns, strict=True)] if columns else []


def read_back(env: dict, run_info) -> ReadBack:
    out = ReadBack()
    found = sessions(env["CLEARML_CACHE_DIR"], run_info.run_id)
    if not found:
        raise FileNotFoundError(
            f"no ClearML offline session tagged {RUN_ID_TAG + run_info.run_id} under {env['CLEARML_CACHE_DIR']}"
        )
    for task, events in found:
        for event in events:
            key = key_of(event["metric"], event["variant"])
            if event["type"] == "training_stats_scalar":
                out.metrics.setdefault(key, []).append((event["iter"], float(event["value"])))
            elif event["type"] == "plot" and (rows := _table(event["plot_str"])) is not None:
                out.tables.setdefault(key, []).append((event["iter"], rows))
        params = (task.get("hyperparams") or {}).get(SECTION, {})
        out.config.update({name: p.get("value") for name, p in params.items()})
        status = [t[len(STATUS_TAG) :] for t in task.get("tags") or [] if t.startswith(STATUS_TAG)]
        out.status = status[-1] if status else None
    return out


# -- the contract suite's hooks (see readers/__init__.py) -------------------------------------------
DISK_FULL_SKIP = (
    "ClearML's reporter thread writes metrics.jsonl outside the sink's calls: a write failing there is ClearML's to handle, "
    "no call of the sink sees it (docs/backends/clearml.md)"
)


def prepare(monkeypatch, env) -> None:
    """ClearML's offline sessions go under the test's storage (``CLEARML_CACHE_DIR``)."""
    if "CLEARML_CACHE_DIR" not in env:  # a storage dict made by the test itself (e.g. on a small disk)
        env["CLEARML_CACHE_DIR"] = str(Path(env["tmp"]) / "clearml")
    Path(env["CLEARML_CACHE_DIR"]).mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("CLEARML_CACHE_DIR", env["CLEARML_CACHE_DIR"])


def stored(value: float) -> float:
    """ClearML has one replacement for both infinities: the sink writes ±inf as ±the largest double."""
    return math.copysign(MAX_DOUBLE, value) if math.isinf(value) else value


TABLE_CELLS = "text"  # lists and dicts in table cells: JSON text (its table takes scalars)


def cell(value):
    """Table cells follow rllog_backends/_cells.py: NaN and ±inf are ``null``."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def config_value(value) -> str:
    """ClearML keeps hyperparameters as text (``None`` as an empty string)."""
    return "" if value is None else str(value)


# No run_ids: offline, ClearML cannot continue a task, so each session is its own offline task carrying the run's
# tag (docs/backends/clearml.md says how to import them into one task); with a server the task is continued.
