"""The journal's writer: one background thread per run appends frames (:mod:`rllog.journal.format`) to
``RUN_DIR/journal/``, handing them to the OS within ``write_interval`` of their append; a full disk, or memory that runs
out while a record is encoded, waits, never loses a frame."""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rllog.errors import RunDirError
from rllog.files import JOURNAL_RESERVE_BYTES, JOURNAL_RESERVE_MIN_BYTES, reserve
from rllog.journal.format import (
    SEGMENT_BYTES,
    SUFFIX,
    EncodedEntry,
    encode_alert,
    encode_config,
    encode_end,
    encode_metrics,
    encode_table,
    encode_table_columns,
    journal_dir,
    segments,
)
from rllog.records import AlertRecord, ConfigRecord, TableRecord
from rllog.settings import WRITER_ALIVE_CHECK_SECONDS

log = logging.getLogger("rllog.journal")


@dataclass
class PendingMetrics:
    """A ``log`` call waiting for the writer thread; ``tensors`` is one stacked tensor (or None)."""

    seq: int
    step: int
    time: float
    values: dict[str, float]
    tensor_keys: tuple[str, ...] = ()
    tensors: Any = None


@dataclass
class PendingTable:
    """A ``log_table`` call whose table repeats the columns of the last one of its name (``table``: a
    :class:`rllog.validate.TableColumns`): the writer thread encodes it, as JSON."""

    seq: int
    step: int
    time: float
    name: str
    table: Any


def _materialise_tensors(entries: list[PendingMetrics]) -> None:
    """Copy every pending tensor to the host in one transfer per device (one sync per flush).

    A group that cannot be copied (a device that failed since the ``log`` call) is retried entry by
    entry; values no entry can give back become NaN, and the error is logged: the writer never gets
    stuck on one entry. A ``MemoryError`` is raised: memory comes back, and the writer waits for it.
    """
    with_tensors = [e for e in entries if e.tensors is not None]
    if not with_tensors:
        return
    torch = sys.modules["torch"]
    by_device: dict[Any, list[PendingMetrics]] = collections.defaultdict(list)
    for entry in with_tensors:
        by_device[entry.tensors.device].append(entry)
    for group in by_device.values():
        try:
            flat = torch.cat([e.tensors for e in group]).tolist()
        except Exception:
            flat = []
            for entry in group:
                try:
                    flat.extend(entry.tensors.tolist())
                except MemoryError:  # waited out by the writer (JournalWriter._write_pending), not a failed device
                    raise
                except Exception as exc:
                    log.error(
                        "rllog journal: cannot copy the tensors of step %d to the host (%s); storing NaN for %s",
                        entry.step,
                        exc,
                        list(entry.tensor_keys),
                    )
                    flat.extend([float("nan")] * len(entry.tensor_keys))
        i = 0
        for entry in group:
            for key in entry.tensor_keys:
                entry.values[key] = float(flat[i])
                i += 1
            entry.tensors = None


Entry = PendingMetrics | PendingTable | TableRecord | AlertRecord | ConfigRecord


def _encode(entry: Entry) -> bytes:
    if isinstance(entry, PendingMetrics):
        return encode_metrics(entry.seq, entry.step, entry.time, entry.values)
    if isinstance(entry, PendingTable):
        return encode_table_columns(entry.seq, entry.step, entry.time, entry.name, entry.table.columns, entry.table.schema_ipc)
    if isinstance(entry, AlertRecord):
        return encode_alert(entry)
    if isinstance(entry, ConfigRecord):
        return encode_config(entry)
    return encode_table(entry.seq, entry.step, entry.time, entry.name, entry.table)


@dataclass
class WriterStats:
    """What the writer could not do, for ``finish``'s report."""

    unwritten: int = 0  # records still in memory when the writer had to give up (disk full at the deadline)
    unencodable: list[str] = field(default_factory=list)  # records that could not be encoded (a bug; logged)
    end_written: bool = False


class JournalWriter:
    """Appends records to the journal from one background thread.

    Args:
        run_dir: the run directory; segments go to ``run_dir/journal``.
        write_interval: every entry is handed to the OS (``os.write``) within this many seconds.
        next_seq: the sequence number the first appended record has.
        on_landed: called on the writer thread with ``written_seq`` after a write put frames on disk.
        on_written: called on the writer thread with each batch's metrics once their host values are
            filled in (the health rules); it may ``append`` more entries.

    A disk that refuses a write (full, quota) never loses an entry: the part of the write that landed
    is cut back to the last complete frame, the rest stays in memory and is retried every
    ``write_interval`` until the disk takes it. ``error`` holds the last such failure (None once
    writing works again). Memory that runs out while an entry is encoded is waited for the same way
    (:meth:`_write_pending`); :attr:`why_held` says which of the two holds entries back.

    The journal shares its disk with what is derived from it (the Parquet store, cursor files), so the writer
    keeps :data:`rllog.files.JOURNAL_RESERVE_BYTES` allocated past the segment's end (``fallocate`` with
    ``FALLOC_FL_KEEP_SIZE``: the file's size, which readers go by, does not change), topped up once half is
    used, in smaller pieces down to :data:`rllog.files.JOURNAL_RESERVE_MIN_BYTES` when the disk has less:
    whoever fills the disk, the journal's next writes land. The reserve is given back when a segment ends,
    and by the next writer of the run for a writer that was killed.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        write_interval: float = 0.5,
        next_seq: int = 1,
        on_written: Callable[[list[PendingMetrics]], None] | None = None,
        on_landed: Callable[[int], None] | None = None,
    ):
        self.directory = journal_dir(run_dir)
        self.write_interval = write_interval
        self._pending: collections.deque = collections.deque()
        self._taken: collections.deque = collections.deque()  # taken from _pending, not yet encoded (_write_pending)
        self._frames: list[tuple[int, bytes]] = []  # encoded, not yet on disk: (seq, frame)
        self._wake = threading.Event()  # write now: a flush, close, backpressure (cuts the batching wait short)
        self._work = threading.Event()  # something to write: ends the idle wait
        self._idle = False  # the writer is (about to be) in its idle wait: the next append sets _work
        self._landed = threading.Condition()  # notified each time written_seq moves
        self._closed = threading.Event()
        self._abandon = threading.Event()
        self._end: tuple[str, float] | None = None
        self.error: OSError | None = None
        self._memory_error: MemoryError | None = None  # the last encoding that ran out of memory (None once one works)
        self.stats = WriterStats()
        self.written_seq = next_seq - 1
        self.on_written = on_written
        self.on_landed = on_landed
        self._next_seq = next_seq
        self._reserved = 0  # the offset up to which the current segment has disk allocated (past _size: the reserve)
        self._last_write = -math.inf  # when the last batch was written (monotonic): how soon the next entry came
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _give_back_reserves(self.directory)
            self._fd = self._open_segment(next_seq)
            self._size = 0
            self._top_up()
        except OSError as exc:
            raise RunDirError(f"cannot write the journal in {self.directory}: {exc}") from exc
        self._thread = threading.Thread(target=self._run, name="rllog-journal", daemon=True)
        self._thread.start()

    def _open_segment(self, first_seq: int) -> int:
        path = self.directory / f"{first_seq:012d}{SUFFIX}"
        n = 0
        while path.exists():  # a writer never appends to a segment it did not create
            n += 1
            path = self.directory / f"{first_seq:012d}.{n}{SUFFIX}"
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)

    def append(self, entry: Entry) -> None:
        """Queue one entry; returns without waiting for the disk.

        An Arrow table is encoded here, on the caller's thread (~0.1 ms for a 16-row completions table). pyarrow's IPC
        writer releases the GIL several times per table, and each time it did so on the writer thread a training
        thread that released the GIL meanwhile (every torch op does) had to wait to take it back: in a tiny GRPO run
        (parquet only, 240 steps) the training thread blocked ~1,050 times instead of ~350, and its CPU time per
        step rose ~1 ms (docs/decisions.md). A :class:`PendingTable` (the same columns as the last table of its name,
        the common case) is encoded on the writer thread instead: as JSON, which holds the GIL throughout.
        """
        if isinstance(entry, TableRecord):
            try:
                self._pending.append(EncodedEntry(entry.seq, _encode(entry)))
            except MemoryError:  # the writer thread encodes it, once there is memory again
                self._pending.append(entry)
            except Exception as exc:  # validation at the call should make this impossible
                self._unencodable(entry.seq, exc)
                return
        else:
            self._pending.append(entry)
        if self._idle:  # the first entry since the writer went idle; the rest of a batch costs no wake-up
            self._idle = False
            self._work.set()

    def _unencodable(self, seq: int, exc: Exception) -> None:
        self.stats.unencodable.append(f"seq {seq}: {type(exc).__name__}: {exc}")
        log.error("rllog journal: cannot encode record seq %d (%s); it is reported as lost", seq, exc)

    @property
    def why_held(self) -> BaseException | None:
        """What keeps entries in memory now: the disk's last refusal, else the last encoding that ran out of memory."""
        return self.error or self._memory_error

    @property
    def backlog(self) -> int:
        """Entries not yet on disk."""
        return len(self._pending) + len(self._taken) + len(self._frames)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def wake(self) -> None:
        """Write what is pending now, without the wait for the rest of a batch."""
        self._wake.set()
        self._work.set()

    def wait_written(self, seq: int, timeout: float) -> bool:
        """Block until every entry up to ``seq`` is handed to the OS; False at ``timeout`` or if the writer stopped.

        Woken by the write itself (the end of a ``train()`` waits here: polling every 5 ms added 2.5 ms on average).
        """
        deadline = time.monotonic() + timeout
        with self._landed:
            while self.written_seq < seq and self.alive:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._landed.wait(min(left, WRITER_ALIVE_CHECK_SECONDS))  # also notices a writer that died
        return self.written_seq >= seq

    def close(self, status: str, timeout: float | None = None) -> bool:
        """Write everything pending and the end marker, then stop the thread.

        Returns True when everything and the end marker are on disk. Past ``timeout`` (a disk that
        stays full) the writer gives up: ``stats.unwritten`` counts what it still held.
        """
        self._end = (status, time.time())
        self._closed.set()
        self.wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._abandon.set()
            self.wake()
            self._thread.join()
        return self.stats.end_written

    def _run(self) -> None:
        """Write batches until closed. A batch is what comes within ``write_interval`` of its first entry. When the next
        entry came within half an interval of the last write (a training loop logging every step), the writer
        goes on from batch to batch on its timer alone (*streaming*): one wake-up a batch rather than two (the idle
        wait the entry ends, then the batch's wait), each of which takes the GIL and a CPU from training. An interval
        that brings nothing ends streaming. Either way an entry is handed to the OS within ``write_interval`` of its
        append, plus the time the write before it took."""
        streaming = False
        while True:
            if not streaming:
                self._wait_for_work()
                streaming = time.monotonic() - self._last_write < self.write_interval / 2
            self._wake.wait(self.write_interval)  # the rest of the batch: a step logs its metrics and tables together
            self._wake.clear()
            closing = self._closed.is_set()
            if streaming and not self.backlog and not closing:
                streaming = False  # a whole interval brought nothing: sleep with no timer until the next entry
                continue
            try:
                self._write_pending()
            except MemoryError as exc:
                self._short_of_memory(exc)
            self._last_write = time.monotonic()
            if closing and not self.backlog:
                self._write_end()
            if self._abandon.is_set() or (closing and self.stats.end_written):
                break
        self.stats.unwritten = self.backlog
        try:
            self._end_segment(self._fd, self._size)
        except OSError:
            pass

    def _wait_for_work(self) -> None:
        """Sleep, with no timer, while nothing is pending: every wake-up of this thread takes the GIL from a training
        thread, which then waits to take it back (a 50 ms tick with nothing to write made the training thread block
        20 more times a second, on a GPU a few dozen times a step). ``_idle`` is set before ``_pending`` is looked
        at, so an ``append`` racing with the look either is seen here or sees ``_idle`` and sets ``_work``."""
        self._work.clear()
        self._idle = True
        if self.backlog or self._closed.is_set():
            self._idle = False
            return
        self._work.wait()
        self._idle = False

    def _top_up(self) -> None:
        """Allocate the reserve past the segment's end again once half of it is used (see the class)."""
        if self._reserved - self._size >= JOURNAL_RESERVE_BYTES // 2:
            return
        length = min(JOURNAL_RESERVE_BYTES, SEGMENT_BYTES - self._size)
        while length >= JOURNAL_RESERVE_MIN_BYTES:
            if reserve(self._fd, self._size, length):
                self._reserved = self._size + length
                return
            length //= 2

    @staticmethod
    def _end_segment(fd: int, size: int) -> None:
        """Close a segment the writer is done with, its reserve given back (a truncation to its own size frees the
        blocks allocated past the end)."""
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def _write_pending(self) -> None:
        """Encode what is pending into frames, in order, and write them.

        Every entry is always held by one of ``_pending``, ``_taken`` (the batch being encoded) or ``_frames``, and
        moves from one to the next only once it is in the next: a ``MemoryError`` anywhere here (copying tensors to
        the host, encoding, joining frames) leaves nothing half done, and :meth:`_run` tries again after
        ``write_interval``, like a full disk. (The health rules are shown a batch's metrics once it is encoded; of a
        batch a ``MemoryError`` cut, those encoded after it: alerts are derived, the records are what must land.)
        """
        while self._pending:
            self._taken.append(self._pending[0])
            self._pending.popleft()
        if self._taken:
            metrics = [e for e in self._taken if isinstance(e, PendingMetrics)]
            _materialise_tensors(metrics)
            while self._taken:
                e = self._taken[0]
                try:
                    frame = e.frame if isinstance(e, EncodedEntry) else _encode(e)
                except MemoryError:
                    raise
                except Exception as exc:  # validation at the call should make this impossible
                    self._unencodable(e.seq, exc)
                else:
                    self._frames.append((e.seq, frame))
                self._taken.popleft()
            if self.on_written is not None and metrics:
                try:
                    self.on_written(metrics)
                except Exception as exc:  # a health rule must never stop the journal
                    log.error("rllog: health check failed: %s", exc)
        if self._frames:
            self._flush_frames()
        if self._memory_error is not None:
            self._memory_error = None
            log.warning("rllog journal: writing again (memory available)")

    def _short_of_memory(self, exc: MemoryError) -> None:
        """Memory ran out in :meth:`_write_pending`: say so once, and back off."""
        if self._memory_error is None:
            with contextlib.suppress(MemoryError):
                log.error(
                    "rllog journal: out of memory while encoding (%s); %d records kept and retried every %.2fs "
                    "(nothing is dropped)",
                    str(exc) or type(exc).__name__, self.backlog, self.write_interval,
                )  # fmt: skip
        self._memory_error = exc
        self._back_off()

    def _back_off(self) -> None:
        """Wait ``write_interval`` before the next try (the loop's own wait is cut short by ``wake()``)."""
        if not self._abandon.is_set():
            time.sleep(self.write_interval)

    def _flush_frames(self) -> None:
        """Write the encoded frames; on a refused write keep what did not land whole."""
        if self._size and self._size + sum(len(f) for _, f in self._frames) > SEGMENT_BYTES:
            try:
                fd = self._open_segment(self._frames[0][0])
            except OSError as exc:  # the old segment stays the one written, its size known: a cut-back stays in it
                return self._failed(exc)
            try:
                self._end_segment(self._fd, self._size)
            except OSError:
                pass
            self._fd, self._size, self._reserved = fd, 0, 0
            self._top_up()
        self._top_up()  # space may have come back since the reserve ran out
        data = memoryview(b"".join(f for _, f in self._frames))
        written = 0
        try:
            while written < len(data):
                written += os.write(self._fd, data[written:])
        except OSError as exc:
            self._keep_whole_frames(written)
            return self._failed(exc)
        self._size += written
        self._top_up()
        with self._landed:
            self.written_seq = self._frames[-1][0]
            self._landed.notify_all()
        self._frames.clear()  # allocates nothing: a MemoryError past the write must not write the frames again
        if self.on_landed is not None:
            try:
                self.on_landed(self.written_seq)
            except Exception as exc:  # must never stop the journal
                log.error("rllog journal: after-write callback failed: %s", exc)
        if self.error is not None:
            log.warning("rllog journal: writing again (%s cleared)", self.error.strerror or self.error)
            self.error = None

    def _keep_whole_frames(self, written: int) -> None:
        """After a write that landed ``written`` bytes: drop the frames that landed whole, cut the
        segment back to the end of the last of them (the rest is written again later)."""
        done, landed = 0, 0
        for _, f in self._frames:
            if landed + len(f) > written:
                break
            landed += len(f)
            done += 1
        if landed < written:
            os.ftruncate(self._fd, self._size + landed)  # frees space (the reserve too): never fails for want of it
            self._reserved = 0
        self._size += landed
        if done:
            with self._landed:
                self.written_seq = self._frames[done - 1][0]
                self._landed.notify_all()
        del self._frames[:done]

    def _failed(self, exc: OSError) -> None:
        if self.error is None or self.error.errno != exc.errno:
            what = "the disk is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else str(exc)
            log.error(
                "rllog journal: cannot write (%s); %d records kept in memory and retried every %.2fs (nothing is dropped)",
                what,
                self.backlog,
                self.write_interval,
            )
        self.error = exc
        self._back_off()

    def _write_end(self) -> None:
        assert self._end is not None
        data = encode_end(*self._end)
        try:
            n = os.write(self._fd, data)
        except OSError as exc:
            return self._failed(exc)
        if n < len(data):
            os.ftruncate(self._fd, self._size)
            self._reserved = 0
            return self._failed(OSError(errno.ENOSPC, "short write of the end marker"))
        self._size += n
        self.stats.end_written = True


def _give_back_reserves(directory: Path) -> None:
    """Free the reserve a killed writer left allocated past the end of its last segment (a resumed run's writer
    takes the run over, holding its lock, before it writes)."""
    for path in segments(directory)[-1:]:
        try:
            st = path.stat()
            if st.st_blocks * 512 > st.st_size + JOURNAL_RESERVE_MIN_BYTES:
                os.truncate(path, st.st_size)
        except OSError:
            pass


# -- reading -------------------------------------------------------------------------------------
