"""Read a wandb run back from its own files: ``<WANDB_DIR>/wandb/*run-*/run-<id>.wandb``.

The ``.wandb`` file is wandb's transaction log, in LevelDB's log format: a 7-byte file header
(``:W&B``, 0xBEE1 little-endian, version 0), then 32 KiB blocks of chunks, each with a 7-byte header
``<IHB`` (crc32 of type byte + payload, payload length, type: 1 full, 2 first, 3 middle, 4 last); a
block tail shorter than 7 bytes is zero padding. Each reassembled payload is a
``wandb.proto.wandb_internal_pb2.Record``.

A run opened several times (``resume="allow"``; offline, each session gets its own
``offline-run-<time>-<id>[-N]`` folder) is read session by session, ordered by the run record's start
time: metrics and tables concatenated, config merged, the status from the last session.

Metrics: history rows; the rllog step of each value is the row's step key (``rllog/step``, or what the
file's ``define_metric("*", step_metric=...)`` record says); wandb's own ``_step``, ``_runtime``,
``_timestamp`` are left out. NaN/inf are stored as the JSON tokens ``NaN``/``Infinity``/``-Infinity``.
Tables: history items ``<name>.{_type: "table-file", path: ...}`` pointing to
``files/media/table/...table.json`` (``{"columns": [...], "data": [[...], ...]}``).
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from readers import ReadBack
from rllog_backends._conventions import Remembered
from rllog_backends.wandb import STEP_KEY, status_for, wandb_run_id

FILE_HEADER = 7
BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
WANDB_OWN_KEYS = {"_step", "_runtime", "_timestamp"}


def iter_payloads(path: str | Path) -> Iterator[bytes]:
    """Every record payload of a ``.wandb`` file, in order; stops quietly at a torn or corrupt tail."""
    data = Path(path).read_bytes()
    if data[:4] != b":W&B" or len(data) < FILE_HEADER:
        raise ValueError(f"{path}: not a wandb transaction log")
    pos, pending = FILE_HEADER, None
    while pos < len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # zero padding at the end of a block
            pos += left
            continue
        if pos + CHUNK_HEADER > len(data):
            return
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        start = pos + CHUNK_HEADER
        chunk = data[start : start + length]
        if kind == 0 or len(chunk) < length or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            return  # torn tail (a crash mid-write) or preallocated space
        pos = start + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE and pending is not None:
            pending += chunk
        elif kind == LAST and pending is not None:
            yield pending + chunk
            pending = None


def iter_records(path: str | Path):
    """``(record_type, message)`` for every record of a ``.wandb`` file."""
    from wandb.proto import wandb_internal_pb2 as pb

    for payload in iter_payloads(path):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind:
            yield kind, getattr(record, kind)


def run_files(wandb_dir: str | Path, run_id: str) -> list[Path]:
    """The ``.wandb`` files of wandb run ``run_id`` below ``wandb_dir``, oldest session first."""
    root = Path(wandb_dir) / "wandb"
    files = {p.resolve() for p in root.glob(f"*run-*/run-{run_id}.wandb")}

    def started(path: Path) -> tuple:
        for kind, msg in iter_records(path):
            if kind == "run":
                return (msg.start_time.seconds, msg.start_time.nanos, path.parent.name)
        return (float("inf"), 0, path.parent.name)

    return sorted(files, key=started)


def _key(item) -> tuple[str, ...]:
    return (item.key,) if item.key else tuple(item.nested_key)


def _config(update_items, config: dict[str, Any]) -> None:
    for item in update_items:
        key = "/".join(_key(item))
        if key != "_wandb":
            config[key] = json.loads(item.value_json)


def read_file(path: Path, out: ReadBack) -> None:
    """Add one session's metrics, tables, config and status to ``out``."""
    step_key = STEP_KEY
    out.status = None
    for kind, msg in iter_records(path):
        if kind == "run":
            _config(msg.config.update, out.config)
        elif kind == "config":
            _config(msg.update, out.config)
            for item in msg.remove:
                out.config.pop("/".join(_key(item)), None)
        elif kind == "metric" and msg.glob_name == "*" and msg.step_metric:
            step_key = msg.step_metric
        elif kind == "history":
            scalars: dict[str, Any] = {}
            media: dict[str, dict[str, Any]] = {}
            for item in msg.item:
                key = _key(item)
                if len(key) == 1:
                    scalars[key[0]] = json.loads(item.value_json)
                else:
                    media.setdefault(key[0], {})["/".join(key[1:])] = json.loads(item.value_json)
            step = scalars.pop(step_key, None)
            if step is None:
                continue  # not a row rllog wrote
            for key, value in scalars.items():
                if key in WANDB_OWN_KEYS:
                    continue
                if isinstance(value, dict) and value.get("_type") == "table-file":
                    media[key] = value
                    continue
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    out.metrics.setdefault(key, []).append((int(step), float(value)))
            for name, value in media.items():
                if value.get("_type") == "table-file":
                    table = json.loads((path.parent / "files" / value["path"]).read_text(encoding="utf-8"))
                    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
                    out.tables.setdefault(name, []).append((int(step), rows))
        elif kind == "alert":
            out.alerts.append({"title": msg.title, "text": msg.text, "level": msg.level})
        elif kind == "exit":
            out.status = status_for(msg.exit_code)


def run_id_of(run_info) -> str:
    """The wandb id the sink used for ``run_info``: the one it remembered in the run directory, else the derived one."""
    return Remembered(run_info.run_dir, "wandb", run_info.run_id).get("id") or wandb_run_id(run_info.run_id)


def read_back(env: dict, run_info) -> ReadBack:
    """What wandb stored for the run ``run_info`` describes (offline or online run folders)."""
    out = ReadBack()
    files = run_files(env["WANDB_DIR"], run_id_of(run_info))
    if not files:
        raise FileNotFoundError(f"no wandb run {run_id_of(run_info)!r} under {env['WANDB_DIR']}/wandb")
    for path in files:
        read_file(path, out)
    return out


# -- the contract suite's hooks (see readers/__init__.py) -------------------------------------------
DISK_FULL_SKIP = (
    "wandb writes its transaction log in its own service process: on a full disk it drops records with only a line in "
    "debug-internal.log, so no call of the sink fails (docs/backends.md)"
)


def alert_level(level: str) -> str:
    return "ERROR" if level == "error" else "WARN"  # wandb.AlertLevel


def run_ids(env: dict, run_info) -> set[str]:
    """Every wandb run id with a transaction log under ``WANDB_DIR``."""
    return {p.stem[len("run-") :] for p in (Path(env["WANDB_DIR"]) / "wandb").glob("*run-*/run-*.wandb")}


def break_next_write(monkeypatch, sink) -> None:
    """The 2nd ``run.log`` of the next call fails with wandb's own HTTP 503, after the 1st was logged."""
    from wandb.errors import CommError

    real_log, calls = sink.run.log, []

    def log(row, *args, **kwargs):
        calls.append(row)
        if len(calls) == 2:
            raise CommError("HTTP 503: Service Unavailable")
        return real_log(row, *args, **kwargs)

    monkeypatch.setattr(sink.run, "log", log)


TABLE_CELLS = "nested"  # lists and dicts in table cells: kept nested


def cell(value):
    """Table cells follow rllog_backends/_cells.py: NaN and ±inf are ``null``."""
    return None if isinstance(value, float) and not math.isfinite(value) else value
