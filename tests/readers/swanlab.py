"""Read a run back from SwanLab's own files: ``<SWANLAB_LOG_DIR>/run-<time>-<id>/run-<id>.swanlab``.

The run file is a LevelDB-style log of ``swanlab.proto.swanlab.record.v1.record_pb2.Record`` messages, read
with SwanLab's own ``DataStoreReader``. A run opened several times offline has one folder per session, all
with the same id; they are read in the order of their start records.

- metrics: ``scalar`` records; SwanLab's step is the record's ``seq``, the rllog step is the value of
  ``rllog/step`` at the same SwanLab step. Values are float64 as given (NaN and ±inf kept).
- tables: ``media`` records of type ECHARTS, each a ``media/echarts/<file>.json`` in the session's folder
  (``{"_swanLab": "table", "colDefs": [...], "rowData": [...]}``); NaN/inf cells come back as ``None``.
- config: ``files/config.yaml`` of the last session (``{key: {value, desc, sort}}``), values as YAML keeps them.
- status: the ``finish`` record's state mapped back (FINISHED -> finished, crashed -> failed, aborted -> killed).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from readers import ReadBack
from rllog_backends.swanlab import STEP_KEY, swanlab_run_id

STATUS = {"RUN_STATE_FINISHED": "finished", "RUN_STATE_CRASHED": "failed", "RUN_STATE_ABORTED": "killed"}


def records(path: Path) -> list:
    """Every record of one run file, in the order SwanLab wrote them."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    reader = DataStoreReader()
    reader.open(path)
    out = []
    try:
        while (data := reader.scan()) is not None:
            record = Record()
            record.ParseFromString(data)
            out.append(record)
    finally:
        reader.close()
    return out


def sessions(log_dir: str | Path, run_id: str) -> list[tuple[Path, list]]:
    """``(run folder, records)`` of every session of SwanLab run ``run_id``, oldest first."""
    found = []
    for path in Path(log_dir).glob("*/run-*.swanlab"):  # the file name is the id made folder-safe ("-" -> "_")
        recs = records(path)
        start = next((r.start for r in recs if r.HasField("start")), None)
        if start is not None and start.id == run_id:
            found.append((start.started_at.ToNanoseconds(), path.parent, recs))
    return [(folder, recs) for _, folder, recs in sorted(found, key=lambda t: (t[0], str(t[1])))]


def read_session(folder: Path, recs: list, out: ReadBack) -> None:
    step_at = {r.scalar.step: int(r.scalar.value.number) for r in recs if r.HasField("scalar") and r.scalar.key == STEP_KEY}
    for r in recs:
        if r.HasField("scalar") and r.scalar.key != STEP_KEY:
            out.metrics.setdefault(r.scalar.key, []).append((step_at[r.scalar.step], r.scalar.value.number))
        elif r.HasField("media") and _is_echarts(r.media):
            for item in r.media.value.items:
                chart = json.loads((folder / "media" / "echarts" / item.filename).read_text(encoding="utf-8"))
                if chart.get("_swanLab") == "table":
                    columns = [c["field"] for c in chart["colDefs"]]
                    rows = [{c: row.get(c) for c in columns} for row in chart["rowData"]]
                    out.tables.setdefault(r.media.key, []).append((step_at[r.media.step], rows))
        elif r.HasField("finish"):
            from swanlab.proto.swanlab.run.v1.run_pb2 import RunState

            out.status = STATUS.get(RunState.Name(r.finish.state))
    import yaml

    config_file = folder / "files" / "config.yaml"
    if config_file.exists():
        out.config.update({k: v["value"] for k, v in (yaml.safe_load(config_file.read_text(encoding="utf-8")) or {}).items()})


def _is_echarts(media) -> bool:
    from swanlab.proto.swanlab.metric.column.v1.column_pb2 import ColumnType

    return media.type == ColumnType.COLUMN_TYPE_ECHARTS


def read_back(env: dict, run_info) -> ReadBack:
    out = ReadBack()
    found = sessions(env["SWANLAB_LOG_DIR"], swanlab_run_id(run_info.run_id))
    if not found:
        raise FileNotFoundError(f"no SwanLab run {run_info.run_id!r} under {env['SWANLAB_LOG_DIR']}")
    for folder, recs in found:
        out.status = None
        read_session(folder, recs, out)
    return out


# -- the contract suite's hooks (see readers/__init__.py) -------------------------------------------
DISK_FULL_SKIP = (
    "SwanLab writes its run file from its own background thread and keeps a batch that failed to write, retrying it "
    "itself; no call of the sink fails (flush() waits for the writer, with a timeout): docs/backends/swanlab.md"
)


def prepare(monkeypatch, env) -> None:
    """SwanLab's run folders go under the test's storage (``SWANLAB_LOG_DIR``)."""
    if "SWANLAB_LOG_DIR" not in env:  # a storage dict made by the test itself (e.g. on a small disk)
        env["SWANLAB_LOG_DIR"] = str(Path(env["tmp"]) / "swanlab")
    Path(env["SWANLAB_LOG_DIR"]).mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("SWANLAB_LOG_DIR", env["SWANLAB_LOG_DIR"])


TABLE_CELLS = "text"  # lists and dicts in table cells: JSON text (its table takes scalars)


def cell(value):
    """Table cells follow rllog_backends/_cells.py: NaN and ±inf are ``null``."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def run_ids(env: dict, run_info) -> set[str]:
    """The SwanLab run ids with a run file under the log dir (a resumed run adds a folder, not an id)."""
    return {r.start.id for p in Path(env["SWANLAB_LOG_DIR"]).glob("*/run-*.swanlab") for r in records(p) if r.HasField("start")}
