"""The run's append-only journal: the source of truth between the trainer and every sink.

Layout: ``RUN_DIR/journal/<first_seq:012d>.rlj`` segments. Each record is one frame::

    magic b"RJ" | kind u8 | pad u8 | seq u64 | length u32 | crc32 u32 | payload (length bytes)

Kinds: metrics (JSON ``{"step", "time", "values"}``; NaN/inf as JSON's NaN/Infinity), table (u32 header
length, JSON header ``{"step", "time", "name"}``, Arrow IPC stream), alert (JSON of the
:class:`AlertRecord` fields), end (JSON ``{"status", "time"}``, seq 0). A writer never appends to a segment it did not create, so a torn frame (process killed
mid-write) can only be the tail of a segment: readers skip it with a warning and go on.

One background thread per run writes; ``append`` only puts the entry in a deque (no disk wait).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import struct
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa

from rllog.errors import RunDirError
from rllog.records import AlertRecord, MetricsRecord, TableRecord

log = logging.getLogger("rllog.journal")

HEADER = struct.Struct("<2sBxQII")
MAGIC = b"RJ"
KIND_METRICS, KIND_TABLE, KIND_END, KIND_ALERT = 1, 2, 3, 4
SEGMENT_BYTES = 64 * 1024 * 1024
SUFFIX = ".rlj"


@dataclass(frozen=True)
class End:
    """The end marker ``Run.finish`` writes: the run's final status."""

    status: str
    time: float


@dataclass
class PendingMetrics:
    """A ``log`` call waiting for the writer thread; ``tensors`` is one stacked tensor (or None)."""

    seq: int
    step: int
    time: float
    values: dict[str, float]
    tensor_keys: tuple[str, ...] = ()
    tensors: Any = None


def journal_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "journal"


def _segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("*" + SUFFIX)) if directory.is_dir() else []


def _frame(kind: int, seq: int, payload: bytes) -> bytes:
    return HEADER.pack(MAGIC, kind, seq, len(payload), zlib.crc32(payload)) + payload


def encode_metrics(seq: int, step: int, t: float, values: dict[str, float]) -> bytes:
    return _frame(KIND_METRICS, seq, json.dumps({"step": step, "time": t, "values": values}, separators=(",", ":")).encode())


def encode_table(seq: int, step: int, t: float, name: str, table: pa.Table) -> bytes:
    header = json.dumps({"step": step, "time": t, "name": name}).encode()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as stream:
        stream.write_table(table)
    return _frame(KIND_TABLE, seq, struct.pack("<I", len(header)) + header + sink.getvalue().to_pybytes())


def encode_alert(a: AlertRecord) -> bytes:
    fields = {"step": a.step, "time": a.time, "rule": a.rule, "metric": a.metric, "value": a.value, "message": a.message, "level": a.level}
    return _frame(KIND_ALERT, a.seq, json.dumps(fields).encode())


def encode_end(status: str, t: float) -> bytes:
    return _frame(KIND_END, 0, json.dumps({"status": status, "time": t}).encode())


def _decode(kind: int, seq: int, payload: bytes) -> MetricsRecord | TableRecord | AlertRecord | End:
    if kind == KIND_ALERT:
        return AlertRecord(seq=seq, **json.loads(payload))
    if kind == KIND_METRICS:
        data = json.loads(payload)
        return MetricsRecord(seq, data["step"], data["time"], data["values"])
    if kind == KIND_TABLE:
        (n,) = struct.unpack_from("<I", payload)
        header = json.loads(payload[4 : 4 + n])
        table = pa.ipc.open_stream(pa.py_buffer(payload[4 + n :])).read_all()
        return TableRecord(seq, header["step"], header["time"], header["name"], table)
    data = json.loads(payload)
    return End(data["status"], data["time"])


def _materialise_tensors(entries: list[PendingMetrics]) -> None:
    """Copy every pending tensor to the host in one transfer per device (one sync per flush)."""
    with_tensors = [e for e in entries if e.tensors is not None]
    if not with_tensors:
        return
    torch = sys.modules["torch"]
    by_device: dict[Any, list[PendingMetrics]] = collections.defaultdict(list)
    for entry in with_tensors:
        by_device[entry.tensors.device].append(entry)
    for group in by_device.values():
        flat = torch.cat([e.tensors for e in group]).tolist()
        i = 0
        for entry in group:
            for key in entry.tensor_keys:
                entry.values[key] = float(flat[i])
                i += 1
            entry.tensors = None


class JournalWriter:
    """Appends records to the journal from one background thread.

    Args:
        run_dir: the run directory; segments go to ``run_dir/journal``.
        flush_interval: every entry is handed to the OS (``os.write``) within this many seconds.
        next_seq: the sequence number the first appended record has.
    """

    def __init__(self, run_dir: str | os.PathLike, flush_interval: float = 1.0, next_seq: int = 1, on_metrics=None, on_tick=None):
        self.directory = journal_dir(run_dir)
        self.flush_interval = flush_interval
        self._pending: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._end: tuple[str, float] | None = None
        self.error: BaseException | None = None
        self.written_seq = next_seq - 1
        self.on_metrics = on_metrics  # called on the writer thread with each batch's metrics, host values filled in
        self.on_tick = on_tick  # called on the writer thread at every wake-up (the agent watchdog)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._fd = self._open_segment(next_seq)
        except OSError as exc:
            raise RunDirError(f"cannot write the journal in {self.directory}: {exc}") from exc
        self._thread = threading.Thread(target=self._run, name="rllog-journal", daemon=True)
        self._thread.start()

    def _open_segment(self, first_seq: int) -> int:
        path = self.directory / f"{first_seq:012d}{SUFFIX}"
        n = 0
        while path.exists():  # a resumed run never appends to an older segment
            n += 1
            path = self.directory / f"{first_seq:012d}.{n}{SUFFIX}"
        self._size = 0
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)

    def append(self, entry: PendingMetrics | TableRecord | AlertRecord) -> None:
        """Queue one entry; returns at once."""
        self._pending.append(entry)

    @property
    def backlog(self) -> int:
        return len(self._pending)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def wake(self) -> None:
        """Write what is pending now instead of at the next tick."""
        self._wake.set()

    def close(self, status: str, timeout: float | None = None) -> None:
        """Write everything pending and the end marker, then stop the thread."""
        self._end = (status, time.time())
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.flush_interval / 2)
            self._wake.clear()
            closing = self._closed.is_set()
            self._write_pending()
            if self.on_tick is not None and not closing:
                try:
                    self.on_tick()
                except Exception as exc:
                    log.error("rllog: %s", exc)
            if closing and not self._pending:
                break
        try:
            if self._end is not None and self.error is None:
                os.write(self._fd, encode_end(*self._end))
            os.close(self._fd)
        except OSError as exc:
            self.error = exc

    def _write_pending(self) -> None:
        entries = []
        while self._pending:
            entries.append(self._pending.popleft())
        if not entries:
            return
        try:
            metrics = [e for e in entries if isinstance(e, PendingMetrics)]
            _materialise_tensors(metrics)
            chunks = []
            for e in entries:
                if isinstance(e, PendingMetrics):
                    chunks.append(encode_metrics(e.seq, e.step, e.time, e.values))
                elif isinstance(e, AlertRecord):
                    chunks.append(encode_alert(e))
                else:
                    chunks.append(encode_table(e.seq, e.step, e.time, e.name, e.table))
            self._write(b"".join(chunks), entries[0].seq)
            self.written_seq = entries[-1].seq
        except Exception as exc:  # keep the entries for the next tick; never lose them
            if self.error is None:
                log.error("rllog journal: cannot write (%s); keeping %d records in memory and retrying", exc, len(entries))
            self.error = exc
            self._pending.extendleft(reversed(entries))
            if not self._closed.is_set():
                time.sleep(self.flush_interval)
            else:
                raise
        else:
            self.error = None
            if self.on_metrics is not None and metrics:
                try:
                    self.on_metrics(metrics)
                except Exception as exc:  # a health rule must never stop the journal
                    log.error("rllog: health check failed: %s", exc)

    def _write(self, data: bytes, first_seq: int) -> None:
        if self._size and self._size + len(data) > SEGMENT_BYTES:
            os.close(self._fd)
            self._fd = self._open_segment(first_seq)
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self._size += len(data)


class JournalReader:
    """Reads the journal from any sequence number, and follows it while it grows.

    Args:
        run_dir: the run directory.
        after_seq: records with ``seq <= after_seq`` are skipped (a sink's cursor).

    Example:
        >>> reader = JournalReader(run_dir, after_seq=cursor)
        >>> batch = reader.read(max_records=1000)          # [] when nothing new has been written yet
        >>> batch = reader.read(1000, final=True)          # the writer is gone: skip a torn tail
    """

    def __init__(self, run_dir: str | os.PathLike, after_seq: int = 0):
        self.directory = journal_dir(run_dir)
        self.after_seq = after_seq
        self.end: End | None = None
        self._path: Path | None = None
        self._file = None
        self._offset = 0
        self._done_paths: set[Path] = set()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _next_segment(self) -> Path | None:
        segments = [p for p in _segments(self.directory) if p not in self._done_paths]
        if not segments:
            return None
        if self._path is None:  # first open: start at the segment holding after_seq + 1
            starts = [(int(p.name.split(".")[0]), p) for p in segments]
            candidates = [p for first, p in starts if first <= self.after_seq + 1]
            chosen = candidates[-1] if candidates else segments[0]
            self._done_paths.update(p for p in segments if p < chosen)
            return chosen
        return segments[0]

    def _switch(self, path: Path) -> None:
        self.close()
        if self._path is not None:
            self._done_paths.add(self._path)
        self._path, self._offset = path, 0
        self._file = open(path, "rb")

    def read(self, max_records: int = 1000, final: bool = False) -> list[MetricsRecord | TableRecord | End]:
        """Return up to ``max_records`` complete records after the cursor (an ``End`` marker included).

        ``final=True`` means no writer will append any more: an incomplete frame at the tail is skipped
        with a warning instead of waited for.
        """
        out: list = []
        if self._file is None:
            first = self._next_segment()
            if first is None:
                return out
            self._switch(first)
        while len(out) < max_records:
            item = self._read_frame()
            if item is not None:
                if isinstance(item, End):
                    self.end = item
                    out.append(item)
                elif item.seq > self.after_seq:
                    self.after_seq = item.seq
                    out.append(item)
                continue
            # nothing complete at this offset: the segment is finished, torn, or still being written
            later = [p for p in _segments(self.directory) if p not in self._done_paths and p != self._path]
            size = os.fstat(self._file.fileno()).st_size
            if size > self._offset and (later or final):
                log.warning("rllog journal: skipping %d torn bytes at the end of %s", size - self._offset, self._path)
                self._offset = size
            if later and os.fstat(self._file.fileno()).st_size <= self._offset:
                self._switch(later[0])
                continue
            break
        return out

    def _read_frame(self):
        f = self._file
        f.seek(self._offset)
        head = f.read(HEADER.size)
        if len(head) < HEADER.size:
            return None
        magic, kind, seq, length, crc = HEADER.unpack(head)
        if magic != MAGIC or kind not in (KIND_METRICS, KIND_TABLE, KIND_END, KIND_ALERT):
            return None
        if kind != KIND_END and seq <= self.after_seq:  # skip without reading the payload
            if os.fstat(f.fileno()).st_size < self._offset + HEADER.size + length:
                return None
            self._offset += HEADER.size + length
            return _SKIPPED
        payload = f.read(length)
        if len(payload) < length or zlib.crc32(payload) != crc:
            return None
        self._offset += HEADER.size + length
        return _decode(kind, seq, payload)


class _Skipped:
    seq = -1


_SKIPPED = _Skipped()


def read_all(run_dir: str | os.PathLike, after_seq: int = 0) -> Iterator[MetricsRecord | TableRecord | End]:
    """Every complete record of a journal that is no longer being written (torn tails skipped)."""
    reader = JournalReader(run_dir, after_seq)
    try:
        while batch := reader.read(10_000, final=True):
            yield from batch
    finally:
        reader.close()


def last_seq(run_dir: str | os.PathLike) -> int:
    """The highest sequence number of a complete frame in the journal (0 when empty); reads headers only."""
    highest = 0
    for path in _segments(journal_dir(run_dir)):
        size = path.stat().st_size
        with open(path, "rb") as f:
            offset = 0
            while offset + HEADER.size <= size:
                f.seek(offset)
                magic, kind, seq, length, _ = HEADER.unpack(f.read(HEADER.size))
                if magic != MAGIC or offset + HEADER.size + length > size:
                    break
                if kind != KIND_END:
                    highest = max(highest, seq)
                offset += HEADER.size + length
    return highest
