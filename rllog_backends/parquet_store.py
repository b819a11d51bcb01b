"""One directory of the parquet backend's store: a tail in Arrow IPC, merged in tiers into Parquet parts.

A long run flushes thousands of times; a Parquet file per flush would leave thousands of files to list
and open, and compacting them all at close would read the whole run into memory. So a directory holds::

    _tail-<first_seq>.arrows                          what the latest flushes appended (Arrow IPC stream)
    part-<first_seq>-<last_seq>-L<level>.parquet       Parquet parts covering [first_seq, last_seq]

- ``append`` + ``flush`` add record batches to the tail and hand them to the OS: durable against a killed
  process from then on (the delivery layer moves the sink's cursor after ``flush``) and readable at once by
  :meth:`PartStore.read`. The leading ``_`` keeps the tail out of pandas/pyarrow dataset discovery and
  ``*.parquet`` globs, which see the parts only.
- The tail's batches are compressed (:data:`TAIL_CODEC`) and a tail is bounded in bytes as well as rows: the store
  is derived from the journal and shares its disk, so it must stay well below the journal's size
  (docs/decisions.md has the codecs measured). When the tail holds :data:`TAIL_ROWS` rows or :data:`TAIL_BYTES`
  bytes, or is older than :data:`TAIL_SECONDS`, it becomes a level-0 part (one Parquet write for many flushes). When :data:`FAN_IN` parts share a level, the oldest are merged,
  streaming row group by row group, into one part of the next level. A directory therefore holds at most
  ``(FAN_IN - 1)`` parts per level plus its tail, and each row is rewritten about ``log_FAN_IN(parts)`` times.
- Crash safety: every new file is written under a temporary name and renamed; the files it replaces are
  removed after. A reader (and the next :meth:`PartStore.open`) ignores a file whose seq range another file
  covers, so a kill between the rename and the removal neither loses nor duplicates a row; a torn batch at
  the end of a tail is skipped.

Reading: :func:`read_store` is the store's read API (what ``rllog.read_metrics`` and friends use): it imports
pyarrow only, never a tracker, and is safe while a writer appends, merges or closes.
"""

from __future__ import annotations

import bisect
import errno
import functools
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rllog.errors import InvalidKey, InvalidTable
from rllog.rundir import table_dir_name

TAIL_ROWS = 262_144
TAIL_SECONDS = 300.0
# A tail past this many bytes becomes a part: a flush per training step writes a small batch whose IPC framing
# outweighs its rows (~800 B a step of 20 metrics, more than the journal's), and a part of those rows is ~200 B.
TAIL_BYTES = 256 * 1024
# zstd for the tail's batches: the smallest of the codecs Arrow IPC offers at the batch sizes a live run flushes
# (20 metrics a step, 25 steps a batch: zstd 244 B a step, lz4 292, none 915), at the same write cost as lz4 there.
TAIL_CODEC = "zstd"
PART_CODEC = "zstd"  # parts: 197 B a step against snappy's 223 (pyarrow's default), and faster to write
FAN_IN = 4
BATCH_ROWS = 131_072
ROW_GROUP_ROWS = 524_288
_PART = re.compile(r"^part-(\d{12})-(\d{12})-L(\d+)\.parquet$")
_TAIL = re.compile(r"^_tail-(\d{12})\.arrows$")

# -- what the store can hold, checked in the trainer before a table is journaled (ParquetSink.check_table) -----------
# A table name's length once percent-encoded: the store names a directory after it, and file systems allow 255 bytes
# for a name (a longer one failed the whole sink inside delivery: "File name too long").
MAX_TABLE_NAME_ENCODED = 255


def check_table(name: str, table: pa.Table) -> None:
    """Raise unless the store can hold ``table`` under ``name``: a directory name the file system takes, and
    column types Parquet writes and reads back.

    Raises:
        InvalidKey: the name is too long once percent-encoded.
        InvalidTable: naming each column whose type Parquet refuses.
    """
    if len(table_dir_name(name)) > MAX_TABLE_NAME_ENCODED:
        raise InvalidKey(
            f"table name {name[:40]!r}... is too long for the parquet backend: at most {MAX_TABLE_NAME_ENCODED} "
            "characters once percent-encoded (it names a directory after it; non-ASCII characters take 6-12)"
        )
    check_parquet_types(name, table.schema)


def check_parquet_types(name: str, schema: pa.Schema) -> None:
    """Raise unless parquet can write a table of ``schema`` and read it back (checked once per schema).

    Raises:
        InvalidTable: naming each column whose type parquet refuses.
    """
    if any(schema.equals(known) for known in _accepted):  # ~0.1 us each, against ~10 us to hash a schema
        return
    if _parquet_refusal(schema.remove_metadata()) is None:
        _accepted.insert(0, schema)
        del _accepted[ACCEPTED_SCHEMAS_KEPT:]
        return
    refused = [(field, _parquet_refusal(pa.schema([field]))) for field in schema]
    detail = "; ".join(f"column {field.name!r} of type {field.type}: {why}" for field, why in refused if why)
    detail = detail or str(_parquet_refusal(schema))  # only the columns together are refused
    raise InvalidTable(
        f"table {name!r} has a column type parquet cannot store ({detail}); convert the column, e.g. to text "
        "(a struct column needs at least one field: not [{}, {}])"
    )


# The schemas parquet took, the latest first: a table logged every step has the schema of its last call, and
# comparing schemas is cheaper than the hash the cache below needs (~0.1 against ~10 us warm, ~90 us on a training
# thread whose caches torch has just used).
ACCEPTED_SCHEMAS_KEPT = 16
_accepted: list[pa.Schema] = []


@functools.lru_cache(maxsize=256)
def _parquet_refusal(schema: pa.Schema) -> str | None:
    """Why parquet cannot write a table of ``schema`` and read it back, or None."""
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    try:
        pq.write_table(schema.empty_table(), sink)
        pq.read_table(pa.BufferReader(sink.getvalue()))
    except (pa.ArrowException, ValueError, TypeError, OSError) as exc:  # OSError: a struct nested past what it reads back
        return f"{type(exc).__name__}: {exc}"
    return None


@dataclass(frozen=True)
class _File:
    path: Path
    first: int
    last: int  # for a tail: unknown until read (-1)
    level: int  # -1 for a tail

    @property
    def is_tail(self) -> bool:
        return self.level < 0


def _listing(directory: Path) -> list[_File]:
    files = []
    for path in directory.iterdir() if directory.is_dir() else []:
        if m := _PART.match(path.name):
            files.append(_File(path, int(m[1]), int(m[2]), int(m[3])))
        elif m := _TAIL.match(path.name):
            files.append(_File(path, int(m[1]), -1, -1))
    return files


def _live(files: list[_File]) -> list[_File]:
    """The files a reader uses, in seq order: a part inside another part's range is the input of a merge whose
    output exists; a tail whose first seq a part covers was converted already."""
    parts = [f for f in files if not f.is_tail]
    live = []
    for f in files:
        if f.is_tail:
            covered = any(p.first <= f.first <= p.last for p in parts)
        else:
            covered = any(
                p is not f and p.first <= f.first and f.last <= p.last and (p.last - p.first) > (f.last - f.first) for p in parts
            )
        if not covered:
            live.append(f)
    return sorted(live, key=lambda f: f.first)


def read_tail(path: Path) -> pa.Table | None:
    """The complete record batches of a tail file (a torn last batch, a writer killed mid-write, is left out).

    Raises:
        FileNotFoundError: the tail is gone: turned into a part since it was listed, so the caller lists again
            (a tail read as empty instead hid all its rows from a reader racing the writer).
    """
    try:
        source = pa.memory_map(str(path))
    except FileNotFoundError:
        raise
    except OSError:
        return None
    try:
        reader = pa.ipc.open_stream(source)
    except (pa.ArrowInvalid, OSError):
        return None  # not even a complete schema message
    batches = []
    while True:
        try:
            batches.append(reader.read_next_batch())
        except StopIteration:
            break
        except (pa.ArrowInvalid, OSError):
            break
    return pa.Table.from_batches(batches, schema=reader.schema)


def conform(table: pa.Table | pa.RecordBatch, schema: pa.Schema) -> pa.Table:
    """``table`` with ``schema``'s columns, in its order: missing columns as nulls, types cast (a promotion)."""
    if not isinstance(table, pa.Table):
        table = pa.Table.from_batches([table])
    if table.schema.equals(schema):
        return table
    columns = []
    for field in schema:
        if field.name in table.column_names:
            column = table.column(field.name)
            columns.append(column if column.type.equals(field.type) else column.cast(field.type))
        else:
            columns.append(pa.nulls(table.num_rows, field.type))
    return pa.Table.from_arrays(columns, schema=schema)


def whole_record_slices(table: pa.Table, seq_column: str, rows: int) -> Iterator[pa.Table]:
    """``table`` in slices of about ``rows`` rows, cut only where the seq changes (one record of more than ``rows``
    rows is one slice)."""
    seqs = table.column(seq_column)
    changes = pc.indices_nonzero(pc.not_equal(seqs[1:], seqs[:-1])).to_pylist() if len(seqs) > 1 else []
    start = 0
    while start < table.num_rows:
        i = bisect.bisect_left(changes, start + rows - 1)  # the first cut at or after a full slice
        end = changes[i] + 1 if i < len(changes) else table.num_rows
        yield table.slice(start, end - start)
        start = end


def _whole_record_batches(table: pa.Table, seq_column: str):
    """``table`` in record batches of about :data:`BATCH_ROWS` rows, cut only where the seq changes.

    Each batch reaches the disk as it is written, so a writer killed between two batches of one append leaves the
    first in the tail; :meth:`PartStore.open` then counts the highest seq it holds as written and the re-sent
    records up to it are skipped. A record cut in two would lose its second half for good: no record spans two
    batches (one record of more than :data:`BATCH_ROWS` rows is one batch).
    """
    for piece in whole_record_slices(table, seq_column, BATCH_ROWS):
        yield from piece.combine_chunks().to_batches()  # one batch, chunks joined


_TAIL_OPTIONS = pa.ipc.IpcWriteOptions(compression=TAIL_CODEC)


def _write_atomic(path: Path, schema: pa.Schema, tables) -> None:
    """Stream ``tables`` (an iterable) into a Parquet file at ``path``, written under a temporary name first."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with pq.ParquetWriter(tmp, schema, compression=PART_CODEC) as writer:
            pending: list[pa.Table] = []
            rows = 0
            for table in tables:  # batches gathered into row groups of ROW_GROUP_ROWS: few, large groups read fastest
                if table.num_rows:
                    pending.append(conform(table, schema))
                    rows += table.num_rows
                if rows >= ROW_GROUP_ROWS:
                    writer.write_table(pa.concat_tables(pending), row_group_size=ROW_GROUP_ROWS)
                    pending, rows = [], 0
            if pending:
                writer.write_table(pa.concat_tables(pending), row_group_size=ROW_GROUP_ROWS)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        pa.default_memory_pool().release_unused()  # the agent's memory stays bounded between merges


class PartStore:
    """The files of one directory (metrics, alerts, or one table), written by one sink at a time.

    Writing is two-phase: :meth:`append` writes rows to the tail, :meth:`commit` makes them count (durable: the
    caller may forget them). A failed append or commit (a full disk) is cut back to the last commit and the tail is
    set aside, so the caller appends the same rows again later and nothing is stored twice or left torn.
    :meth:`maintain` then turns full tails into parts and merges levels; on a full disk it leaves that for later.

    Args:
        directory: the directory.
        seq_column: the column that holds each row's record seq (``seq`` or ``_seq``).
    """

    def __init__(self, directory: Path, seq_column: str):
        self.directory = directory
        self.seq_column = seq_column
        self.written_seq = 0  # the highest committed seq: a re-sent record at or below it is not stored again
        self.schema: pa.Schema | None = None  # what the directory's rows unify to
        self._tail: pa.ipc.RecordBatchStreamWriter | None = None
        self._tail_file: pa.OSFile | None = None
        self._tail_path: Path | None = None
        self._tail_schema: pa.Schema | None = None
        self._tail_rows = 0
        self._tail_since = 0.0
        self._tail_last = 0
        self._committed_size = 0  # the tail file's size at the last commit
        self._opened = False

    # -- writing ---------------------------------------------------------------------------------
    def open(self) -> None:
        """Take over the directory: tails left by a killed writer become parts, files a merge replaced are removed."""
        if self._opened:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        for leftover in self.directory.glob(".*.tmp"):  # a write killed before its rename
            leftover.unlink(missing_ok=True)
        files = _listing(self.directory)
        live = set(_live(files))
        for f in files:
            if f not in live:
                f.path.unlink(missing_ok=True)
        self._convert_old_tails()
        for f in _listing(self.directory):
            self.written_seq = max(self.written_seq, f.last)
            if not f.is_tail:
                part_schema = pq.read_schema(f.path)
                self.schema = (
                    part_schema
                    if self.schema is None
                    else pa.unify_schemas([self.schema, part_schema], promote_options="permissive")
                )
        self._opened = True

    def append(self, table: pa.Table, seq: int | None = None) -> None:
        """Write rows (in seq order, all above ``written_seq``) to the tail; they count once :meth:`commit` returned.

        A table with no rows (logged by the user as such, with record ``seq``) leaves its columns in an empty part
        when the directory has nothing yet, so that it can be read back.
        """
        self.open()
        try:
            if not table.num_rows:
                if seq is not None and not _listing(self.directory):
                    _write_atomic(self.directory / f"part-{seq:012d}-{seq:012d}-L0.parquet", table.schema, [table])
                    self.schema = table.schema
                return
            schema = (
                table.schema
                if self.schema is None
                else pa.unify_schemas([self.schema, table.schema], promote_options="permissive")
            )
            if self._tail is not None and not schema.equals(self._tail_schema):
                self._close_tail()  # a stream has one schema: a new column or a promoted type starts a new tail
            if self._tail is None:
                first = pc.min(table.column(self.seq_column)).as_py()
                self._tail_path = self.directory / f"_tail-{first:012d}.arrows"
                self._tail_file = pa.OSFile(str(self._tail_path), "wb")
                self._tail = pa.ipc.new_stream(self._tail_file, schema, options=_TAIL_OPTIONS)
                self._tail_schema, self._tail_rows, self._tail_since, self._committed_size = schema, 0, time.monotonic(), 0
            for batch in _whole_record_batches(conform(table, schema), self.seq_column):
                self._tail.write_batch(batch)
            self._tail_rows += table.num_rows
            self._tail_last = max(self._tail_last, pc.max(table.column(self.seq_column)).as_py())
            self.schema = schema
        except BaseException:
            self.discard_uncommitted()
            raise

    def commit(self) -> None:
        """What was appended is handed to the OS and counts: durable against a killed process from here on."""
        if self._tail_file is None:
            return
        try:
            self._tail_file.flush()
            self._committed_size = self._tail_file.tell()
        except BaseException:
            self.discard_uncommitted()
            raise
        self.written_seq = max(self.written_seq, self._tail_last)

    def discard_uncommitted(self) -> None:
        """Cut the tail back to its last commit and set it aside (the next append starts a new tail)."""
        if self._tail_path is None:
            return
        path, size = self._tail_path, self._committed_size
        for handle in (self._tail_file,):
            try:
                if handle is not None:
                    handle.close()
            except OSError:
                pass
        self._tail = self._tail_file = self._tail_path = None
        self._tail_last = self.written_seq
        try:
            if size:
                os.truncate(path, size)  # frees space: cannot fail for want of it
            else:
                path.unlink(missing_ok=True)
        except OSError:
            pass

    @property
    def holds_open_file(self) -> bool:
        """Whether a tail file is open for writing (one file handle)."""
        return self._tail_file is not None

    def release(self) -> None:
        """Close the tail's file, whose rows are committed: it becomes a part at the next :meth:`maintain`, and the
        next append starts a new tail. A full disk refusing the end-of-stream marker leaves the tail without one
        (readable all the same)."""
        try:
            self._close_tail()
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self.discard_uncommitted()  # closes the file; cuts the torn marker back to the last commit

    def flush(self) -> None:
        """:meth:`commit`, then :meth:`maintain`."""
        self.commit()
        self.maintain()

    def maintain(self) -> None:
        """Turn a full or old tail into a part and merge full levels. A full disk leaves it for a later call."""
        if self._tail is not None and (
            self._tail_rows >= TAIL_ROWS
            or self._committed_size >= TAIL_BYTES
            or time.monotonic() - self._tail_since >= TAIL_SECONDS
        ):
            self.release()
        try:
            self._convert_old_tails()
            self._merge_full_levels()
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise

    def roll(self) -> None:
        """Close the tail and turn it into a level-0 part (then merge levels that are full)."""
        self._close_tail()
        self._convert_old_tails()
        self._merge_full_levels()

    def close(self) -> None:
        """Everything into one Parquet part (a finished run reads as fast as one file), streamed batch by batch.

        Everything is committed already: a disk without room for a part or a merge (each written beside its inputs)
        leaves the tails and parts as they are, every row readable, for the next :meth:`open` or ``rllog replay``.
        """
        self.release()
        try:
            self._convert_old_tails()
            self._merge_full_levels()
            parts = [f for f in _live(_listing(self.directory)) if not f.is_tail]
            if len(parts) > 1:
                self._merge(parts, 1 + max(f.level for f in parts))
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise

    def _close_tail(self) -> None:
        """End the tail's stream (what it holds is committed); it becomes a part at the next conversion."""
        if self._tail is None:
            return
        assert self._tail_file is not None
        self.commit()
        self._tail.close()  # the end-of-stream marker
        self._tail_file.close()
        self._tail = self._tail_file = self._tail_path = None

    def _convert_old_tails(self) -> None:
        """Every tail but the one being written becomes a level-0 part, oldest first."""
        for f in sorted((f for f in _listing(self.directory) if f.is_tail and f.path != self._tail_path), key=lambda f: f.first):
            self._convert_tail(f.path, f.first)

    def _convert_tail(self, path: Path, first: int) -> None:
        try:
            table = read_tail(path)
        except FileNotFoundError:
            return  # converted already
        if table is not None and table.num_rows:
            last = pc.max(table.column(self.seq_column)).as_py()
            _write_atomic(self.directory / f"part-{first:012d}-{last:012d}-L0.parquet", table.schema, [table])
        path.unlink(missing_ok=True)

    def _merge_full_levels(self) -> None:
        """While a level holds FAN_IN parts, merge its oldest FAN_IN (adjacent in seq) into one part a level up."""
        level = 0
        while True:
            live = _live(_listing(self.directory))
            parts = [f for f in live if f.level == level]
            if len(parts) >= FAN_IN:
                self._merge(parts[:FAN_IN], level + 1)
                continue
            if not any(f.level > level for f in live):
                return
            level += 1

    def _merge(self, inputs: list[_File], level: int) -> None:
        """Stream ``inputs`` (adjacent in seq) into one part of ``level``; then remove them."""
        schema = pa.unify_schemas([pq.read_schema(f.path) for f in inputs], promote_options="permissive")
        target = self.directory / f"part-{inputs[0].first:012d}-{inputs[-1].last:012d}-L{level}.parquet"
        _write_atomic(target, schema, (batch for f in inputs for batch in _batches(f.path)))
        for f in inputs:  # a kill before these removals leaves inputs that readers ignore (covered)
            f.path.unlink(missing_ok=True)

    # -- reading ---------------------------------------------------------------------------------
    @staticmethod
    def read(directory: Path) -> pa.Table | None:
        """Every row of the directory, in seq order, schemas unified (a later column is null in earlier rows)."""
        live = _live(_listing(directory))
        parts = [f for f in live if not f.is_tail]
        tables = []
        try:
            schemas = [pq.read_schema(f.path) for f in parts]
            if len(parts) > 1 and all(schema.equals(schemas[0]) for schema in schemas):
                import pyarrow.dataset as ds  # reads the parts in parallel, in the order given

                tables.append(ds.dataset([str(f.path) for f in parts], schema=schemas[0], format="parquet").to_table())
            else:
                tables += [pq.read_table(f.path) for f in parts]
            tables += [t for t in (read_tail(f.path) for f in live if f.is_tail) if t is not None]
        except FileNotFoundError:  # a part replaced by a merge, a tail turned into a part, since the listing: read again
            return PartStore.read(directory)
        if not tables:
            return None
        tables = [t for t in tables if t.num_rows] or tables[:1]  # an empty table keeps its columns
        return pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]

    @staticmethod
    def files(directory: Path) -> list[Path]:
        return [f.path for f in _listing(directory)]


def _batches(path: Path):
    parquet = pq.ParquetFile(path)
    for batch in parquet.iter_batches(batch_size=BATCH_ROWS):
        yield pa.Table.from_batches([batch])


def read_store(directory: Path) -> pa.Table | None:
    """Every row of one store directory (``metrics``, ``alerts``, ``tables/<name>``), in seq order, schemas unified;
    None when the directory holds no data."""
    return PartStore.read(directory)
