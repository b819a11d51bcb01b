"""The run's append-only journal: the source of truth between the trainer and every sink.

Layout: ``RUN_DIR/journal/<first_seq:012d>.rlj`` segments (``<first_seq:012d>.<n>.rlj`` when a
segment of that name exists already). Each record is one frame, little-endian::

    magic b"RLJ2" | kind u8 | flags u8 (0) | reserved u16 (0) | seq u64 | length u32 | header_crc u32 | crc u32 | payload

``header_crc`` is the CRC-32 of the 20 bytes before it; ``crc`` is the CRC-32 of those same 20 bytes
followed by the payload: the checksum covers header and payload. A reader trusts a frame's length only
once its header checksum holds, so one damaged byte anywhere costs at most the frame it hits:

- a damaged header (magic, kind, seq, length): the reader searches forward for the next position where
  a header with a valid checksum starts (re-synchronises) and counts the bytes it skipped;
- a damaged payload: the header's length is trusted, the frame is skipped and counted;
- a frame that ends past the end of the file: still being written, or the torn tail of a writer that
  was killed mid-write. Followers wait for it; once no writer is left (``final``) or a later segment
  exists, it is skipped and counted as torn.

Kinds: metrics (JSON ``{"step", "time", "values"}``; NaN/inf as JSON's NaN/Infinity), table (u32 header
length, JSON header ``{"step", "time", "name"}``, Arrow IPC stream), table as columns (u32 header length, the same
JSON header, u32 schema length, the table's Arrow schema as an IPC message, then JSON ``{column: [cells]}`` read as
``pa.table(columns, schema=schema)``: a table that repeats the columns of the last one of its name, encoded on the
writer's thread without Arrow, :class:`rllog.validate.TableColumns`), alert (JSON of the
:class:`AlertRecord` fields), config (JSON ``{"step", "time", "values"}``), end (JSON ``{"status", "time"}``,
seq 0). A resumed run (a new attempt) starts a new segment; an end marker followed by a later segment
ended an attempt, not the run.

One background thread per run writes (:class:`rllog.journal.JournalWriter`, :mod:`rllog.journal.writer`);
``append`` only puts the entry in a deque (no disk wait; an Arrow table is encoded first, on the caller's thread). A writer
never appends to a segment it did not create, and a write the disk refuses halfway (ENOSPC) is cut back to the last
complete frame and retried later: a segment never holds a broken frame except a crash's tail. Readers:
:mod:`rllog.journal.reader`. This module is the format: its constants, framing, encoding and decoding.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from rllog.records import AlertRecord, ConfigRecord, MetricsRecord, TableRecord

MAGIC = b"RLJ2"
HEADER_PREFIX = struct.Struct("<4sBBHQI")  # the 20 bytes header_crc covers
HEADER = struct.Struct("<4sBBHQIII")
KIND_METRICS, KIND_TABLE, KIND_END, KIND_ALERT, KIND_CONFIG, KIND_TABLE_COLUMNS = 1, 2, 3, 4, 5, 6
KINDS = (KIND_METRICS, KIND_TABLE, KIND_END, KIND_ALERT, KIND_CONFIG, KIND_TABLE_COLUMNS)
SEGMENT_BYTES = 64 * 1024 * 1024
SUFFIX = ".rlj"
READ_CHUNK = 4 * 1024 * 1024
READ_ALL_BYTES = 16 * 1024 * 1024  # payload bytes read_all decodes at a time: memory bounded whatever a record's width
# What a payload that passed its checksum raises when it does not decode as its kind: bad bytes (damage). Anything
# else (MemoryError, an OSError, a bug) says nothing about the frame: it propagates, and the frame is read again.
DECODE_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,  # JSON, UTF-8, Arrow's ArrowInvalid
    KeyError,
    TypeError,  # a JSON document of the wrong shape for its record
    IndexError,
    struct.error,
    pa.ArrowNotImplementedError,  # an Arrow stream naming a type that does not exist
)
DAMAGE_PLACES_KEPT = 1000  # places of damage a Damage remembers (and a cursor file lists) to count each once
MAX_FRAME = 1 << 31  # a length above this is damage, not data (a table of 2 GiB is refused long before)


@dataclass(frozen=True)
class End:
    """The end marker ``Run.finish`` writes: the run's final status."""

    status: str
    time: float
    segment: str = field(default="", compare=False)  # the segment it was read from

    def ends_run(self, run_dir: str | os.PathLike) -> bool:
        """False when a later segment exists: this marker ended an attempt, and the run was resumed after it."""
        later = segments(journal_dir(run_dir))
        return not later or later[-1].name == self.segment or not self.segment


Record = MetricsRecord | TableRecord | AlertRecord | ConfigRecord


def journal_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "journal"


def segment_key(path: Path) -> tuple[int, int]:
    parts = path.name.split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) == 3 else 0
    except ValueError:
        return (1 << 62, 0)


def segments(directory: Path) -> list[Path]:
    """The journal's segment files, in the order they were written."""
    return sorted(directory.glob("*" + SUFFIX), key=segment_key) if directory.is_dir() else []


# -- encoding ------------------------------------------------------------------------------------


def frame(kind: int, seq: int, payload: bytes) -> bytes:
    prefix = HEADER_PREFIX.pack(MAGIC, kind, 0, 0, seq, len(payload))
    head_crc = zlib.crc32(prefix)
    return prefix + struct.pack("<II", head_crc, zlib.crc32(payload, head_crc)) + payload


def _compact_json(ensure_ascii: bool) -> Callable[[Any], str]:
    """``json.dumps(obj, separators=(",", ":"), ensure_ascii=...)``, its encoder made once: ``dumps`` with arguments
    of its own builds a ``JSONEncoder`` per call, and ``JSONEncoder.encode`` its C encoder per call (together ~1.2 us
    of a one-key record's 2.7 us). What the journal encodes is flat (metrics, table columns of cells): no cycle
    check."""
    python = json.JSONEncoder(separators=(",", ":"), ensure_ascii=ensure_ascii)
    make = getattr(json.encoder, "c_make_encoder", None)  # not in typeshed: json's C speedups
    if make is None:  # a Python without json's C speedups
        return python.encode
    quote = json.encoder.encode_basestring_ascii if ensure_ascii else json.encoder.encode_basestring
    encoder = make(None, python.default, quote, None, ":", ",", False, False, True)
    return lambda obj: "".join(encoder(obj, 0))


_COMPACT_JSON = _compact_json(ensure_ascii=True)
_COMPACT_UTF8_JSON = _compact_json(ensure_ascii=False)


def encode_metrics(seq: int, step: int, t: float, values: dict[str, float]) -> bytes:
    return frame(KIND_METRICS, seq, _COMPACT_JSON({"step": step, "time": t, "values": values}).encode())


# Given, pyarrow's writer does not read ARROW_PRE_0_15_IPC_FORMAT and ARROW_PRE_1_0_METADATA_VERSION from the
# environment for every table (on the training thread): the journal's tables are the current
# format whatever the environment says.
IPC_OPTIONS = pa.ipc.IpcWriteOptions()


def _table_header(step: int, t: float, name: str) -> bytes:
    """What both table kinds start with: u32 length, JSON ``{"step", "time", "name"}``."""
    header = json.dumps({"step": step, "time": t, "name": name}).encode()
    return struct.pack("<I", len(header)) + header


def encode_table(seq: int, step: int, t: float, name: str, table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=IPC_OPTIONS) as stream:
        stream.write_table(table)
    return frame(KIND_TABLE, seq, _table_header(step, t, name) + sink.getvalue().to_pybytes())


def encode_table_columns(seq: int, step: int, t: float, name: str, columns: dict[str, list], schema_ipc: bytes) -> bytes:
    cells = _COMPACT_UTF8_JSON(columns).encode()  # its text was checked to be valid UTF-8
    return frame(KIND_TABLE_COLUMNS, seq, _table_header(step, t, name) + struct.pack("<I", len(schema_ipc)) + schema_ipc + cells)


@dataclass(frozen=True)
class EncodedEntry:
    """An entry encoded on the thread that appended it (a table: see :meth:`JournalWriter.append`)."""

    seq: int
    frame: bytes


def encode_alert(a: AlertRecord) -> bytes:
    fields = {
        "step": a.step,
        "time": a.time,
        "rule": a.rule,
        "metric": a.metric,
        "value": a.value,
        "message": a.message,
        "level": a.level,
    }
    return frame(KIND_ALERT, a.seq, json.dumps(fields).encode())


def encode_config(c: ConfigRecord) -> bytes:
    return frame(KIND_CONFIG, c.seq, json.dumps({"step": c.step, "time": c.time, "values": dict(c.values)}, default=str).encode())


def encode_end(status: str, t: float) -> bytes:
    return frame(KIND_END, 0, json.dumps({"status": status, "time": t}).encode())


def decode_frame(kind: int, seq: int, payload: bytes) -> Record | End:
    if kind == KIND_ALERT:
        return AlertRecord(seq=seq, **json.loads(payload))
    if kind == KIND_METRICS:
        data = json.loads(payload)
        return MetricsRecord(seq, data["step"], data["time"], data["values"])
    if kind == KIND_CONFIG:
        data = json.loads(payload)
        return ConfigRecord(seq, data["step"], data["time"], data["values"])
    if kind in (KIND_TABLE, KIND_TABLE_COLUMNS):
        (n,) = struct.unpack_from("<I", payload)
        header = json.loads(payload[4 : 4 + n])
        if kind == KIND_TABLE:
            table = pa.ipc.open_stream(pa.py_buffer(payload[4 + n :])).read_all()
        else:
            (m,) = struct.unpack_from("<I", payload, 4 + n)
            schema = pa.ipc.read_schema(pa.py_buffer(payload[8 + n : 8 + n + m]))
            table = pa.table(json.loads(payload[8 + n + m :]), schema=schema)
        return TableRecord(seq, header["step"], header["time"], header["name"], table)
    data = json.loads(payload)
    return End(data["status"], data["time"])


def header_at(buf: bytes | memoryview, pos: int) -> tuple[int, int, int, int] | None:
    """``(kind, seq, length, crc)`` of a header with a valid checksum at ``pos``, else None."""
    magic, kind, _flags, _reserved, seq, length, head_crc, crc = HEADER.unpack_from(buf, pos)
    if magic != MAGIC or zlib.crc32(buf[pos : pos + HEADER_PREFIX.size]) != head_crc:
        return None
    if kind not in KINDS or length > MAX_FRAME:
        return None
    return kind, seq, length, crc


# -- writing -------------------------------------------------------------------------------------
