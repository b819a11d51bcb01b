"""Delivery: followers that read the journal from each sink's cursor and write to the sink.

This is the one place for batching, retries, backoff and cursors (the "processor"; a
:class:`rllog.sink.MetricSink` is the "exporter"). One :class:`Follower` serves one sink on its own
thread, so a slow, hung or failing sink never holds up another one.

A cursor means durable. A sink's cursor file (``RUN_DIR/delivery/<sink>.json``, see
:class:`CursorStore`) moves past a record only once the sink can no longer lose it: after the
``flush()`` that followed the write, or right after the write for a sink whose
``capabilities.durable_writes`` says its writes are durable. An agent killed at any instant then
re-sends at most what was in flight, and never skips what a sink only buffered.

One bad record never stops a sink. A record the sink rejects with a permanent error (anything but
:class:`rllog.errors.TransientError`) is set aside; once a later call to the same sink succeeds (so
the sink works and the record was the problem) it goes to the sink's dead-letter list and delivery
goes on. Records still set aside when the journal ends stay pending, and the sink is reported failed. When :data:`MAX_SUSPECTS` records in a row fail, the sink itself is broken: it is marked
failed and those records stay pending for ``rllog replay``.

When a sink is flushed: at least every ``flush_interval`` while records flow, at the end of the journal,
and as soon as its follower has delivered every record up to a seq the trainer asked for
(:func:`request_flush`, written by ``Run.flush`` and by ``Run.request_flush(at_once=True)``: the end of
``train()``/``evaluate()``, which does not wait). A request nobody waits for (``Run.request_flush()``,
``soon=True``) is honoured at most every :data:`ASKED_FLUSH_MIN_GAP`: when the HF integration asked so at
every step of the last second of training, one flush per step made MLflow's and trackio's fixed cost per
transaction the agent's largest cost in that second (MLflow 20 ms of CPU per one-step flush against 7 ms per
step in larger ones). ``Run.request_flush`` writes the request before the journal holds its records: a
follower that read too early looks again every :data:`POLL_INTERVAL` for :data:`ASKED_RECORDS_PATIENCE`. Not every time a follower catches up with the journal: with SQLite-backed trackers (MLflow,
trackio) a flush is a transaction with several ``fdatasync``s, and one per step (measured: 340 commits in a
60-step GRPO run) slowed the training process on the other core.

How often a follower reads the journal: at once again after a batch, and every ``poll_interval`` once it has
caught up. A live run's followers poll every half ``flush_interval`` (:func:`live_poll_interval`: 0.5 s by
default), so each sink takes half a second of steps in one call rather than one step per call (measured with
five trackers: 20-22 ms of the agent's CPU per training step instead of 25-31 at 0.05 s); a flush request
wakes them at once (:meth:`Follower.wake`, :class:`FlushWatcher`), so ``Run.flush`` waits no longer than before.

What the machine runs out of is waited for, never blamed on a record or a sink: a ``MemoryError``, or an
``OSError`` in :data:`rllog.sink_errors.RESOURCE_ERRNOS` (no descriptor, no memory, a full disk), raised by a
sink call or while reading the journal, is retried like a :class:`rllog.errors.TransientError`, backing off
to at most :data:`LOCAL_RETRY_CAP` (the resource is on this machine: another thread closing a file or freeing
memory brings it back, and no remote service needs sparing). A cursor save that meets one waits for it.

How much one read takes: at most :data:`BATCH_RECORDS` records and :data:`BATCH_BYTES` of their payloads
(a record larger than that alone), so the agent's memory is bounded by bytes whatever the width of a
record; a sink is flushed once :data:`FLUSH_DUE_RECORDS` records or :data:`FLUSH_DUE_BYTES` were delivered
since its last flush, whatever the time, so a backlog read at full speed reaches the sink's storage in
bounded pieces.

A file lock (``RUN_DIR/delivery/<sink>.lock``) makes sure two deliverers never serve one sink of one run.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import logging
import math
import os
import random
import re
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from rllog.errors import RateLimited, SinkBusy, TransientError
from rllog.files import replace_file
from rllog.journal import Damage, End, JournalReader
from rllog.records import AlertRecord, ConfigRecord, MetricsRecord, RunInfo, TableRecord
from rllog.settings import (  # the tuning constants, each explained there
    ASKED_FLUSH_MIN_GAP,
    ASKED_RECORDS_PATIENCE,
    BATCH_BYTES,
    BATCH_RECORDS,
    CURSOR_SAVE_RETRY,
    DEAD_LETTERS_KEPT,
    FLUSH_DUE_BYTES,
    FLUSH_DUE_RECORDS,
    FLUSH_WATCH_INTERVAL,
    LIVE_POLL_MAX,
    LOCAL_RETRY_CAP,
    MAX_SUSPECTS,
    POLL_INTERVAL,
    RETRY_BASE_SECONDS,
    RETRY_CAP_SECONDS,
    RETRY_GIVE_UP_SECONDS,
)
from rllog.sink import MetricSink
from rllog.sink_errors import is_resource_exhausted

log = logging.getLogger("rllog.delivery")


class SinkState:
    """A sink's delivery state, as written in its cursor file."""

    WAITING = "waiting"  # no deliverer has started
    RUNNING = "running"
    CLOSED = "closed"  # saw the end (or the trainer's death), closed the sink
    FAILED = "failed"  # a permanent error: open/flush/close failed, or MAX_SUSPECTS records in a row
    GAVE_UP = "gave_up"  # transient errors for longer than RetryPolicy.give_up_after
    STOPPED = "stopped"  # the deliverer was told to stop while retrying

    BROKEN = (FAILED, GAVE_UP)


RETRY_NOTE = "retrying since"  # how a cursor's error starts while its follower retries (see Follower._call)


@dataclass
class RetryPolicy:
    """Capped exponential backoff with full jitter, ``Retry-After`` honoured, and a give-up deadline.

    Args:
        base: first backoff ceiling in seconds.
        cap: the largest backoff ceiling.
        give_up_after: seconds of continuous failure after which the sink is given up (its records
            stay pending in the journal); None retries for as long as the run lasts.
        random: a source of uniform [0, 1) numbers (injectable for tests).
    """

    base: float = RETRY_BASE_SECONDS
    cap: float = RETRY_CAP_SECONDS
    give_up_after: float | None = RETRY_GIVE_UP_SECONDS
    random: Callable[[], float] = field(default=random.random, repr=False)

    def delay(self, attempt: int, error: BaseException) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based) after ``error``."""
        if isinstance(error, RateLimited) and error.retry_after is not None:
            return error.retry_after
        cap = min(self.cap, LOCAL_RETRY_CAP) if is_resource_exhausted(error) else self.cap
        return self.random() * min(cap, self.base * 2.0 ** min(attempt, 64))  # 2**attempt overflows a float past ~1000 attempts

    def as_dict(self) -> dict[str, Any]:
        return {"base": self.base, "cap": self.cap, "give_up_after": self.give_up_after}


@dataclass
class Cursor:
    """What a sink's cursor file holds.

    Attributes:
        seq: every readable record with a seq at or below this is durable in the sink (or dead-lettered).
        ahead: seqs above ``seq`` that are durable too (a batch that failed midway).
        dead_letters: records the sink rejected for good: ``{"seq", "step", "kind", "error"}``
            (the first :data:`DEAD_LETTERS_KEPT`); ``dead_letter_count`` is exact.
        damage: what the reader skipped (damaged bytes, torn tails), and where (each place counted once).
    """

    seq: int = 0
    ahead: list[int] = field(default_factory=list)
    state: str = SinkState.WAITING
    error: str | None = None
    status: str | None = None
    dead_letters: list[dict] = field(default_factory=list)
    dead_letter_count: int = 0
    damage: dict[str, Any] = field(default_factory=dict)
    pid: int | None = None
    time: float | None = None

    @classmethod
    def from_dict(cls, data: dict) -> Cursor:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


CURSOR_FORMAT = 2
CURSOR_FILE_BYTES = 4096  # a cursor file's size (and the step it grows by): one page, written over in one pwrite
CURSOR_READ_TRIES = 5  # reads of a cursor that fails its checksum (a save in progress) before it counts as damaged
_CURSOR_PREFIX = re.compile(rb'^\{"format":(\d+),"crc":"([0-9a-f]{8})",')


class CursorStore:
    """The persisted delivery position and state of one sink of one run (``RUN_DIR/delivery/<sink>.json``).

    The file is written over in place, never replaced: a disk the journal filled (or anything else did) must not
    stop a sink's cursor from moving, and a new file and a rename need a block and a directory entry each time.
    Format 2: one JSON object, ``{"format":2,"crc":"<crc32 hex>",<the cursor's fields>}``, padded with spaces
    and a newline to a fixed size (:data:`CURSOR_FILE_BYTES`, or a multiple of it for a cursor that outgrew it:
    a long dead-letter list); ``crc`` is the CRC-32 of ``{<the cursor's fields>}`` as written. The file is made
    at that size once (its blocks allocated) and then written with one ``pwrite`` at offset 0: no new inode or
    block is needed. A reader that races a write sees a checksum that does not match and reads again. The file is
    still JSON (``json.load`` reads it); a format-1 file (the cursor's fields as plain JSON) loads as before and
    is replaced by a format-2 file at the next save.
    """

    def __init__(self, run_dir: str | os.PathLike, sink_name: str):
        self.directory = Path(run_dir) / "delivery"
        self.path = self.directory / f"{sink_name}.json"
        self._lock_path = self.directory / f"{sink_name}.lock"
        self._lock: FileLock | None = None

    @staticmethod
    def names(run_dir: str | os.PathLike) -> list[str]:
        """The sinks that have a cursor in ``run_dir``."""
        return sorted(p.stem for p in (Path(run_dir) / "delivery").glob("*.json"))

    def load(self) -> Cursor:
        for _ in range(CURSOR_READ_TRIES):
            try:
                data = self.path.read_bytes()
            except FileNotFoundError:
                return Cursor()
            fields = decode_cursor(data)
            if fields is not None:
                try:
                    return Cursor.from_dict(fields)
                except TypeError:
                    break
            time.sleep(0.001)  # a save in progress: it is one pwrite, done in microseconds
        log.warning("rllog: cursor file %s is damaged; delivery to that sink starts from the journal's start", self.path)
        return Cursor()

    def save(self, cursor: Cursor) -> None:
        body = json.dumps(cursor.__dict__, separators=(",", ":"))
        head = f'{{"format":{CURSOR_FORMAT},"crc":"{zlib.crc32(body.encode()):08x}",'
        text = head + body[1:]
        needed = len(text) + 1  # and a newline
        try:
            fd = os.open(self.path, os.O_WRONLY)
        except FileNotFoundError:
            fd = None
        if fd is not None:
            try:
                size = os.fstat(fd).st_size
                if size >= needed and size % CURSOR_FILE_BYTES == 0:
                    data = (text + " " * (size - needed) + "\n").encode()
                    if os.pwrite(fd, data, 0) == len(data):
                        return
                    raise OSError(errno.ENOSPC, f"cursor {self.path}: short write")
            finally:
                os.close(fd)
        size = -(-needed // CURSOR_FILE_BYTES) * CURSOR_FILE_BYTES  # made (or grown) at its fixed size, once
        replace_file(self.path, text + " " * (size - needed) + "\n")

    def acquire(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        # acquired by the thread that starts a follower, released by the follower thread itself
        self._lock = FileLock(str(self._lock_path), thread_local=False)
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise SinkBusy(f"another process is delivering to {self.path.stem!r} of this run (lock {self._lock_path})") from None

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()


def decode_cursor(data: bytes) -> dict | None:
    """The fields of a cursor file's content (format 2, or format 1: plain JSON); None when it fails its checksum
    or is not JSON (a save in progress, or damage)."""
    text = data.rstrip(b" \n")
    match = _CURSOR_PREFIX.match(text)
    if match is None:  # format 1
        try:
            fields = json.loads(text)
        except ValueError:
            return None
        return fields if isinstance(fields, dict) else None
    body = b"{" + text[match.end() :]
    if int(match[2], 16) != zlib.crc32(body):
        return None
    try:
        fields = json.loads(body)
    except ValueError:
        return None
    return fields if isinstance(fields, dict) else None


FLUSH_REQUEST = "flush-request"  # RUN_DIR/delivery/flush-request: one fixed-length line, see request_flush
SOON = "soon"
WAITED = "wait"


def request_flush(run_dir: str | os.PathLike, seq: int, soon: bool = False) -> None:
    """Ask every follower of the run to flush its sink as soon as it has delivered the records up to ``seq``.

    ``soon``: nobody waits for this flush (``Run.request_flush()``); a follower may put it off for up to
    :data:`ASKED_FLUSH_MIN_GAP` after its previous flush. Without it (``Run.flush``, and
    ``Run.request_flush(at_once=True)`` at the end of ``train()``), it is made at once.

    The request is one line, ``<seq> <soon|wait> <nonce> <crc32>``, every field fixed-width, written over the
    previous one in place: an ``open`` and a ``write``, with no new file to create, rename and delete in the run's
    directory (that cost 0.2-0.4 ms of the training thread's CPU a call while the agent worked in the same
    directory, when the last second of ``train()`` asked at every step). The nonce makes every request new to a reader;
    the checksum lets a reader that raced the write see it as not written yet (:func:`read_flush_request`).
    """
    body = f"{int(seq):020d} {SOON if soon else WAITED} {time.monotonic_ns() % 10**20:020d}"
    line = f"{body} {zlib.crc32(body.encode()):08x}\n".encode()
    path = Path(run_dir) / "delivery" / FLUSH_REQUEST
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    except FileNotFoundError:  # no follower has made the directory yet
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, line)
    finally:
        os.close(fd)
    if written != len(line):  # a full disk: the line would read as torn (refused), like no request
        raise OSError(errno.ENOSPC, f"flush request: wrote {written} of {len(line)} bytes")


def read_flush_request(run_dir: str | os.PathLike) -> tuple[bytes, int, bool] | None:
    """The last request: (its line, seq, soon), or None when there is none or it is being written."""
    try:
        with open(Path(run_dir) / "delivery" / FLUSH_REQUEST, "rb") as f:
            line = f.read(128)
        body, crc = line.decode("ascii").rstrip("\n").rsplit(" ", 1)
        if int(crc, 16) != zlib.crc32(body.encode()):
            return None
        seq, kind, _nonce = body.split(" ")
        return line, int(seq), kind == SOON
    except (OSError, ValueError):  # missing, or read while being written over (torn: the checksum does not match)
        return None


def live_poll_interval(flush_interval: float) -> float:
    """A live run's follower polls every half flush interval, between :data:`POLL_INTERVAL` and :data:`LIVE_POLL_MAX`."""
    return min(LIVE_POLL_MAX, max(POLL_INTERVAL, flush_interval / 2))


class FlushRequest:
    """The follower's view of :func:`request_flush`.

    ``seq``: the seq of the latest request; ``waited_seq``: that of the latest one a ``Run.flush`` waits for. The
    latest, not the highest ever read: a trainer killed between writing a request and journaling the records it
    names leaves a seq the journal never got, the resumed run numbers its records below it, and taking the highest
    ignored every request of the resumed run until its records passed that seq (its ``flush`` then waited for
    the periodic one).
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = run_dir
        self._seen: bytes | None = None
        self.seq = 0
        self.waited_seq = 0
        self.noticed_at = -math.inf  # monotonic time the latest request that is waited for was first read

    def replaced(self) -> bool:
        """Whether a request was written since the last look (the seq read then)."""
        request = read_flush_request(self.run_dir)
        if request is None or request[0] == self._seen:
            return False
        self._seen, seq, soon = request
        self.seq = seq
        if not soon:
            self.waited_seq = seq
            self.noticed_at = time.monotonic()
        return True


class FlushWatcher:
    """Wakes the followers of a run in another process (the agent) when the trainer asks for a flush, and when
    the trainer is gone (``writer_gone``).

    One thread looks at the request file every :data:`FLUSH_WATCH_INTERVAL`, so the followers can wait a
    whole :func:`live_poll_interval` between reads of the journal without making ``Run.flush`` wait for it.
    """

    def __init__(self, run_dir: str | os.PathLike, followers: list[Follower], writer_gone: Callable[[], bool] = lambda: False):
        self.request = FlushRequest(run_dir)
        self.request.replaced()  # a request from before this agent started is not news
        self.followers = followers
        self.writer_gone = writer_gone

    def start(self) -> FlushWatcher:
        threading.Thread(target=self._run, name="rllog-flush-watcher", daemon=True).start()
        return self

    def _run(self) -> None:
        gone = False
        while any(f.thread is not None and f.thread.is_alive() for f in self.followers):
            just_gone = not gone and self.writer_gone()
            gone = gone or just_gone
            if self.request.replaced() or just_gone:
                for follower in self.followers:
                    follower.wake()
            time.sleep(FLUSH_WATCH_INTERVAL)


def _kind(record: Any) -> str:
    return {MetricsRecord: "metrics", TableRecord: "table", AlertRecord: "alert", ConfigRecord: "config"}.get(
        type(record), type(record).__name__
    )


class Follower:
    """Delivers one run's journal to one sink, from that sink's cursor.

    Args:
        name: the sink's name (its cursor file's name).
        sink: the sink, or a zero-argument factory that builds it (so tracker imports happen on the
            follower's thread, off the caller's).
        run_info: passed to ``sink.open``.
        follow: keep reading while the journal grows until its end marker (or until ``writer_gone``
            says no writer is left); otherwise deliver what is there now and close.
        writer_gone: returns True once the process writing the journal is dead.
        attempt_starts: the first seq of each of the run's attempts as they are now (``run.json``: a resumed run
            adds one). Once the writer is gone the follower delivers nothing from a later attempt than its own.
        flush_interval: the sink's ``flush`` is called at least this often while records flow (and
            the cursor of a sink that buffers moves then); sooner when ``Run.flush`` asks (:func:`request_flush`).
    """

    def __init__(
        self,
        name: str,
        sink: MetricSink | Callable[[], MetricSink],
        run_info: RunInfo,
        *,
        follow: bool = True,
        writer_gone: Callable[[], bool] = lambda: False,
        attempt_starts: Callable[[], tuple[int, ...]] | None = None,
        flush_interval: float = 1.0,
        batch_size: int = BATCH_RECORDS,
        batch_bytes: int = BATCH_BYTES,
        poll_interval: float = POLL_INTERVAL,
        retry: RetryPolicy | None = None,
        sleep: Callable[[float], None] | None = None,
        on_progress: Callable[[int], None] | None = None,
    ):
        self.name = name
        self._sink_or_factory = sink
        self.sink: MetricSink | None = None
        self.run_info = run_info
        self.follow = follow
        self.writer_gone = writer_gone
        self.attempt_starts = attempt_starts
        self.flush_interval = flush_interval
        self.batch_size = batch_size
        self.batch_bytes = batch_bytes
        self.poll_interval = poll_interval
        self.retry = retry or RetryPolicy()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._sleep = sleep or self._stop.wait
        self.on_progress = on_progress
        self.cursor = CursorStore(run_info.run_dir, name)
        self.saved = self.cursor.load()
        self.seq = self.saved.seq
        self.ahead: set[int] = set(self.saved.ahead)
        self.state = SinkState.WAITING
        self.error: str | None = None
        self.status: str | None = self.saved.status
        self.thread: threading.Thread | None = None
        self._dirty = False  # written since the last flush
        self._closing = False  # close() was called on the sink
        self._flush_request = FlushRequest(run_info.run_dir)
        self._saved_key = ""  # what the cursor file holds (see _save)
        self._delivered_seq = self.seq  # the last seq handed to the sink (or skipped)
        self.caught_up_at = time.monotonic()  # when a read last found nothing new (the delivery lag is measured from it)
        self._outstanding: collections.deque[int] = collections.deque()  # read, not yet durable, in read order
        self._durable: set[int] = set()  # outstanding seqs that are durable (or dead-lettered)
        self._in_flight: set[int] = set()  # accepted by a sink that buffers, waiting for its flush
        self._suspects: list[tuple[Any, str]] = []  # records rejected since the sink last succeeded
        self._damage = Damage(**self.saved.damage)
        self._unflushed_records = 0  # read since the last flush (see FLUSH_DUE_RECORDS)
        self._unflushed_bytes = 0
        self.needs_restart = False  # ended for want of memory or descriptors: start it again from its cursor
        _SPARE_DESCRIPTORS.hold()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, wait: float = 0.0) -> Follower:
        """Take the sink's lock (waiting up to ``wait`` s for another deliverer, e.g. the agent of a run's
        previous attempt finishing its work) and start delivering on a new thread."""
        deadline = time.monotonic() + wait
        while True:
            try:
                self.cursor.acquire()
                break
            except SinkBusy:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
        self.saved = self.cursor.load()  # the other deliverer may have moved it
        self.seq, self.ahead, self.status = self.saved.seq, set(self.saved.ahead), self.saved.status
        self._delivered_seq = self.seq
        self._damage = Damage(**self.saved.damage)
        self.thread = threading.Thread(target=self.run, name=f"rllog-follower-{self.name}", daemon=True)
        self.thread.start()
        return self

    def join(self, timeout: float | None = None) -> bool:
        if self.thread is not None:
            self.thread.join(timeout)
            return not self.thread.is_alive()
        return True

    def stop(self) -> None:
        """Ask the follower to stop waiting (used when the caller gives up on it)."""
        self._stop.set()
        self._wake.set()

    def wake(self) -> None:
        """Read the journal now rather than at the end of the current ``poll_interval`` (a flush was asked)."""
        self._wake.set()

    def run(self) -> None:
        """Deliver until the end of the journal (follow) or until what is there now is delivered."""
        reader = JournalReader(self.run_info.run_dir, after_seq=self.seq)
        reader.damage = self._damage
        last_flush = time.monotonic()
        self._save(SinkState.RUNNING)
        try:
            # A live run opens its tracker at once (the tracker's run appears when training starts);
            # a replay opens it only if there is something to deliver.
            if self.follow and not self._ensure_open():
                return
            while not self._stop.is_set():
                gone = self.writer_gone()
                batch = self._read(reader, final=gone or not self.follow)
                if batch is None:  # the journal could not be read (the state says why)
                    return
                if gone and self.follow:
                    batch, superseded = self._own_attempts(batch)
                    if superseded:  # what follows belongs to the resumed run's agent
                        batch.append(End(status="killed", time=time.time()))
                end = next((r for r in batch if isinstance(r, End) and r.ends_run(self.run_info.run_dir)), None)
                records = [r for r in batch if not isinstance(r, End)]
                if records and not self._deliver(records):
                    return
                if records:
                    self._delivered_seq = records[-1].seq
                if self._dirty and self._flush_due(last_flush):
                    if not self._flush():
                        return
                    last_flush = time.monotonic()
                if end is not None:
                    self.status = end.status
                if end is not None or (not batch and (gone or not self.follow)):
                    self._close(self.status or "killed")  # no end marker: the trainer died
                    return
                if not batch:
                    self.caught_up_at = time.monotonic()
                    self._wake.wait(self._wait_before_reading(last_flush))
                    self._wake.clear()
        except Exception as exc:
            if is_resource_exhausted(exc) and not self._stop.is_set():
                self._restart_from_cursor(exc)
            else:
                self._last_resort(exc)
        except BaseException as exc:  # never let a bug kill the thread silently
            self._last_resort(exc)
        finally:
            try:
                reader.close()
                self.cursor.release()
            except Exception:
                pass

    def settle(self, patience: float = 5.0) -> None:
        """After the thread ended: make the cursor file say how, if it does not (the thread ended while its state
        said running, or its last save could not be made), trying for up to ``patience`` seconds; log it."""
        if self.thread is not None and self.thread.is_alive():
            return
        state = self.state
        if state in (SinkState.WAITING, SinkState.RUNNING) and self.needs_restart:
            state = SinkState.FAILED  # nobody restarts it (a replay): it failed, and says why
        elif state in (SinkState.WAITING, SinkState.RUNNING) and self._stop.is_set():
            state = SinkState.STOPPED  # told to stop: its records are pending, nothing failed
        elif state in (SinkState.WAITING, SinkState.RUNNING):
            self.error = f"the delivery thread ended unexpectedly (last error: {self.error or 'none recorded'})"
            state = SinkState.FAILED
        elif self.cursor_saved:
            return
        log.error("rllog: sink %r ended %s: %s", self.name, state, self.error)
        deadline = time.monotonic() + patience
        try:
            while not self._save(state, wait=False) and time.monotonic() < deadline:
                time.sleep(CURSOR_SAVE_RETRY)
        except Exception as exc:
            log.error("rllog: sink %r: its cursor could not be saved: %r", self.name, exc)

    @property
    def cursor_saved(self) -> bool:
        """Whether the cursor file holds this follower's latest state (False after a save that could not be made)."""
        return self._saved_key == self._cursor_key()

    def _restart_from_cursor(self, exc: Exception) -> None:
        """The machine ran out of something in the follower's own work (not in a sink call or a journal read, which
        wait for it): its records in memory may be half booked, so it ends here, its cursor still ``running`` and
        saying why, for its agent to start again from the cursor (:attr:`needs_restart`)."""
        self.needs_restart = True
        try:
            self.error = f"{type(exc).__name__} while delivering: {exc}; delivery starts again from the cursor"
            log.error("rllog: sink %r: %s", self.name, self.error)
            self._save(self.state, wait=False)
        except BaseException:  # what was saved last stands; the agent restarts it all the same
            pass

    def _last_resort(self, exc: BaseException) -> None:
        """Fail the sink with ``exc``, whatever else goes wrong: this runs where nothing may raise any more."""
        try:
            self._fail(exc)
        except BaseException as again:
            self.state, self.error = SinkState.FAILED, f"{type(exc).__name__}: {exc}"
            try:
                log.error("rllog: sink %r failed (%s) and its cursor could not be saved: %r", self.name, self.error, again)
            except BaseException:
                pass

    def _read(self, reader: JournalReader, final: bool) -> list | None:
        """The next batch of the journal, waiting out what the machine ran out of (a ``MemoryError`` while
        decoding: the reader stays before that frame); None when the follower stopped or failed meanwhile."""
        batch: list = []

        def read() -> None:
            batch[:] = reader.read(self.batch_size, final=final, max_bytes=self.batch_bytes)

        if self._call(read, what="reading the journal") is not None:
            return None
        self._unflushed_records += len(batch)
        self._unflushed_bytes += reader.last_bytes
        return batch

    # -- internals -------------------------------------------------------------------------------
    def _own_attempts(self, batch: list) -> tuple[list, bool]:
        """``batch`` without the records of an attempt that started after this follower's (the trainer died and
        the run was resumed, appending to the same journal), and whether any were cut. A deliverer of the dead
        attempt would otherwise write them with the old attempt's run info (TensorBoard would not mark the
        restart); the resumed run's agent delivers them once this one lets go of the sink."""
        if self.attempt_starts is None:
            return batch, False
        try:
            starts = self.attempt_starts()
        except Exception:  # no readable run file: nothing says a later attempt exists
            return batch, False
        later = [seq for seq in starts if seq > max(self.run_info.attempt_starts)]
        if not later:
            return batch, False
        kept = [r for r in batch if isinstance(r, End) or r.seq < min(later)]
        return kept, len(kept) < len(batch)

    def _flush_due(self, last_flush: float) -> bool:
        """Whether to flush the sink now: ``flush_interval`` has passed since ``last_flush``, or the trainer asked
        (:func:`request_flush`) for records this follower has delivered but not flushed. A request nobody waits for
        is put off until :data:`ASKED_FLUSH_MIN_GAP` after the previous flush (see :meth:`_wait_before_reading`)."""
        since = time.monotonic() - last_flush
        if since >= self.flush_interval:
            return True
        if self._unflushed_records >= FLUSH_DUE_RECORDS or self._unflushed_bytes >= FLUSH_DUE_BYTES:
            return True
        request = self._flush_request
        request.replaced()
        if self._holds_unflushed(request.waited_seq):
            return True
        return self._holds_unflushed(request.seq) and since >= ASKED_FLUSH_MIN_GAP

    def _holds_unflushed(self, seq: int) -> bool:
        """Whether record ``seq`` was delivered to the sink and not yet flushed."""
        return self.seq < seq <= self._delivered_seq

    def _wait_before_reading(self, last_flush: float) -> float:
        """How long a caught-up follower waits before it reads again: ``poll_interval``; :data:`POLL_INTERVAL` while
        a flush was just asked for records not in the journal yet (:data:`ASKED_RECORDS_PATIENCE`); or until a
        flush it put off (asked for records it holds unflushed) is due."""
        request = self._flush_request
        request.replaced()
        if request.waited_seq > self._delivered_seq and time.monotonic() - request.noticed_at < ASKED_RECORDS_PATIENCE:
            return min(self.poll_interval, POLL_INTERVAL)
        if not (self._dirty and self._holds_unflushed(request.seq)):
            return self.poll_interval
        return min(self.poll_interval, max(0.0, last_flush + ASKED_FLUSH_MIN_GAP - time.monotonic()))

    def _ensure_open(self) -> bool:
        if self.sink is not None:
            return True

        def open_sink() -> None:
            factory = self._sink_or_factory
            sink = factory() if callable(factory) and not isinstance(factory, MetricSink) else factory
            sink.open(self.run_info)
            self.sink = sink

        return self._call(open_sink) is None

    @property
    def _durable_writes(self) -> bool:
        """A sink without ``flush`` writes through: what its write returned is as durable as it gets."""
        caps = getattr(self.sink, "capabilities", None)
        return bool(getattr(caps, "durable_writes", False)) or not hasattr(self.sink, "flush")

    def _deliver(self, records: list) -> bool:
        """Deliver one batch: its metrics in one ``write_metrics`` call, then its tables and alerts.

        Grouping the metrics is what makes a live run cheap to deliver: a tracker's per-call cost (an
        MLflow transaction, a trackio connection) is paid per batch rather than per step. Every record
        carries its step, so no tracker depends on the interleaving. A rejected call is repeated record
        by record, so one bad record costs only itself.
        """
        self._outstanding.extend(r.seq for r in records)
        todo = [r for r in records if r.seq not in self.ahead]
        self._durable.update(r.seq for r in records if r.seq in self.ahead)
        if todo and not self._ensure_open():
            return False
        sink: Any = self.sink  # optional members are checked through capabilities
        takes_tables = bool(todo) and getattr(sink.capabilities, "tables", False)
        takes_alerts = bool(todo) and getattr(sink.capabilities, "alerts", False)
        takes_config = bool(todo) and getattr(sink.capabilities, "config", False) and hasattr(sink, "write_config")
        metrics = [r for r in todo if isinstance(r, MetricsRecord)]
        calls: list[tuple[list, Callable[[list], None]]] = []
        if metrics:
            calls.append((metrics, lambda part: sink.write_metrics(part)))
        for r in todo:
            if isinstance(r, TableRecord) and takes_tables:
                calls.append(([r], lambda part: sink.write_table(part[0])))
            elif isinstance(r, AlertRecord) and takes_alerts:
                calls.append(([r], lambda part: sink.write_alert(part[0])))
            elif isinstance(r, ConfigRecord) and takes_config:
                calls.append(([r], lambda part: sink.write_config(part[0])))
        taken = {r.seq for part, _ in calls for r in part}
        self._durable.update(r.seq for r in todo if r.seq not in taken)  # a record no call takes is done
        for part, call in calls:
            error = self._call(partial(call, part), permanent_ok=True)
            if error is not None and len(part) > 1 and self.state == SinkState.RUNNING:  # find the bad record(s)
                for record in part:
                    one = self._call(partial(call, [record]), permanent_ok=True)
                    if not self._accepted([record], one):
                        return False
            elif not self._accepted(part, error):
                return False
        self._advance()
        return True

    def _accepted(self, part: list, error: str | None) -> bool:
        """Book the result of one call. False when delivery must stop (the sink failed)."""
        if self.state in SinkState.BROKEN or self.state == SinkState.STOPPED:
            self._advance()
            return False
        if error is None:
            self._confirm_suspects()  # the sink took a later record: the ones it rejected were bad, not the sink
            seqs = {r.seq for r in part}
            self._dirty = True
            if self._durable_writes:
                self._durable |= seqs
            else:
                self._in_flight |= seqs
            return True
        self._suspects.extend((r, error) for r in part)
        if len(self._suspects) >= MAX_SUSPECTS:
            self.error = f"{len(self._suspects)} records in a row rejected; last: {error}"
            log.error("rllog: sink %r failed: %s", self.name, self.error)
            self._keep_what_the_sink_holds()
            self._advance()
            self._save(SinkState.FAILED)
            return False
        return True

    def _confirm_suspects(self) -> None:
        """The sink took a later call: the records it rejected before were bad, not the sink."""
        for record, error in self._suspects:
            self.saved.dead_letter_count += 1
            if len(self.saved.dead_letters) < DEAD_LETTERS_KEPT:
                self.saved.dead_letters.append({"seq": record.seq, "step": record.step, "kind": _kind(record), "error": error})
            self._durable.add(record.seq)
            log.error(
                "rllog: sink %r rejected record seq %d (step %d) for good: %s; it is in the dead-letter list, delivery goes on",
                self.name,
                record.seq,
                record.step,
                error,
            )
        self._suspects = []

    def _flush(self) -> bool:
        flush = getattr(self.sink, "flush", None)
        if flush is not None and self._call(flush) is not None:
            return False
        self._durable |= self._in_flight
        self._in_flight = set()
        self._dirty = False
        self._unflushed_records = self._unflushed_bytes = 0
        self._advance()
        return True

    def _advance(self) -> None:
        """Move the cursor past the durable prefix of what was read; keep later durable seqs in ``ahead``."""
        moved = 0
        while self._outstanding and self._outstanding[0] in self._durable:
            self.seq = self._outstanding.popleft()
            self._durable.discard(self.seq)
            moved += 1
        self.ahead = {s for s in self.ahead | self._durable if s > self.seq}
        self._save(self.state)
        if moved and self.on_progress:
            self.on_progress(self.seq)

    def _call(self, fn: Callable[[], None], permanent_ok: bool = False, what: str = "") -> str | None:
        """Run ``fn`` with retries. Returns None on success, else the error (state saved).

        Retried: :class:`TransientError` and what this machine ran out of (:func:`is_resource_exhausted`),
        until ``retry.give_up_after`` (a live run's follower waits for what the machine ran out of until it is
        stopped). With ``permanent_ok`` another error is returned to the caller (the
        record may be bad); otherwise it fails the sink. ``what`` names the work in messages.
        """
        attempt, first_failure = 0, None
        prefix = f"{what}: " if what else ""
        while True:
            try:
                fn()
            except Exception as exc:
                if not isinstance(exc, TransientError) and not is_resource_exhausted(exc):
                    if self.error is not None and self.error.startswith(RETRY_NOTE):  # retrying is over either way
                        self.error = None
                    if permanent_ok:
                        return f"{type(exc).__name__}: {exc}"
                    return self._fail(exc, prefix=prefix)
                now = time.monotonic()
                if first_failure is None:
                    first_failure = now
                    # what the cursor, and a report made meanwhile, say while this waits; not waited for itself
                    self.error = f"{RETRY_NOTE} {time.strftime('%H:%M:%S')}: {prefix}{type(exc).__name__}: {exc}"
                    self._save(self.state, wait=False)
                # What this machine ran out of is waited for while the run lives (finish's deadline ends the wait,
                # its records pending and the cause named), as the journal waits out a full disk; a replay, or an
                # agent whose trainer died (nobody will call finish), gives up on it like on a tracker that stays down.
                waits_for_the_run = self.follow and is_resource_exhausted(exc) and not self.writer_gone()
                give_up = self.retry.give_up_after is not None and not waits_for_the_run
                if give_up and now - first_failure >= (self.retry.give_up_after or 0.0):
                    return self._fail(exc, SinkState.GAVE_UP, prefix)
                wait = self.retry.delay(attempt, exc)
                log.info("rllog: sink %r: %s%s: %s; retrying in %.2fs", self.name, prefix, type(exc).__name__, exc, wait)
                attempt += 1
                self._sleep(wait)
                if self._stop.is_set():
                    return self._fail(exc, SinkState.STOPPED, prefix)
            else:  # outside the try: a cursor save that fails is not the sink rejecting what it took
                if self.error is not None and self.error.startswith(RETRY_NOTE):  # the retry note is no longer true
                    self.error = None
                    self._save(self.state, wait=False)
                return None

    def _close(self, status: str) -> None:
        if self.sink is not None:
            sink: Any = self.sink
            self._closing = True
            if self._call(lambda: sink.close(status)) is not None:
                return
            self._durable |= self._in_flight  # close flushes
            self._in_flight = set()
        self._advance()
        if self._suspects:  # rejected, and no later record was taken to show the sink works: they stay pending
            record, error = self._suspects[-1]
            self.error = f"{len(self._suspects)} records rejected at the end of the journal (last: seq {record.seq}): {error}"
            self._save(SinkState.FAILED)
            return
        self._save(SinkState.CLOSED)

    def _fail(self, exc: BaseException, state: str = SinkState.FAILED, prefix: str = "") -> str:
        self.error = f"{prefix}{type(exc).__name__}: {exc}"
        log.error("rllog: sink %r %s at seq %d: %s", self.name, state.replace("_", " "), self.seq, self.error)
        if state in SinkState.BROKEN or state == SinkState.STOPPED:
            self._keep_what_the_sink_holds()
        self._save(state)
        return self.error

    def _keep_what_the_sink_holds(self) -> None:
        """Before delivery stops on a broken sink, or is stopped at the deadline while a call is retried: one
        flush, not retried, so that the records the sink accepted
        and holds count as delivered. Left in flight, they would stay behind the cursor and ``rllog replay`` would
        send them again: a tracker that sends on write (wandb, MLflow, trackio) would show them twice."""
        flush = getattr(self.sink, "flush", None)
        if not self._in_flight or flush is None or self._closing:  # a sink whose close failed may be half closed:
            return  # its flush could return without writing anything, and the cursor must not move on that
        try:
            flush()
        except Exception as exc:  # the sink is broken already; what it holds stays pending
            log.warning("rllog: sink %r: the flush before stopping failed too (%s: %s)", self.name, type(exc).__name__, exc)
            return
        self._durable |= self._in_flight
        self._in_flight = set()
        self._advance()

    def _cursor_key(self) -> str:
        return json.dumps([self.seq, sorted(self.ahead), self.state, self.error, self.status, self._damage.as_dict(),
                           self.saved.dead_letter_count])  # fmt: skip

    def _save(self, state: str, wait: bool = True) -> bool:
        """Persist the cursor, if it changed; True once the file holds it.

        A save the machine has no room for (a full disk, no descriptor left, no memory) is tried again until it
        is made or the follower is told to stop; without ``wait`` it is left for the next save. A save refused
        for want of a descriptor is made with one of :data:`_SPARE_DESCRIPTORS`.
        """
        self.state = state
        # A write that acknowledges nothing (a buffering sink between flushes) saves nothing: a cursor file
        # is a new file and a swap (rllog.files), metadata the filesystem journals, ~20 a second per sink otherwise.
        key = self._cursor_key()
        if key == self._saved_key:
            return True
        self.saved.seq, self.saved.ahead = self.seq, sorted(self.ahead)
        self.saved.state, self.saved.error, self.saved.status = state, self.error, self.status
        self.saved.damage = self._damage.as_dict()
        self.saved.pid, self.saved.time = os.getpid(), time.time()
        warned = False
        while True:
            try:
                try:
                    self.cursor.save(self.saved)
                except OSError as exc:
                    if exc.errno not in (errno.EMFILE, errno.ENFILE):
                        raise
                    with _SPARE_DESCRIPTORS.lent():
                        self.cursor.save(self.saved)
                self._saved_key = key
                return True
            except Exception as exc:
                if not is_resource_exhausted(exc):
                    raise
                if not wait:
                    return False
                if self._stop.is_set():  # told to stop: the last saved cursor stands (a replay re-sends from it)
                    log.error("rllog: sink %r: cursor not saved (%s); it stays as last saved", self.name, exc)
                    return False
                if not warned:
                    log.error("rllog: sink %r: cannot save its cursor (%s); retrying until there is room", self.name, exc)
                    warned = True
                self._stop.wait(CURSOR_SAVE_RETRY)


class SpareDescriptors:
    """Descriptors held in reserve so that a cursor can be saved when the process has none left (EMFILE):
    a sink that opens a file per table can take every descriptor the process may have, and a cursor that
    cannot be saved hides why its sink stopped.

    Example:
        >>> spare = SpareDescriptors(2).hold()
        >>> with spare.lent():          # the reserve is closed here, and taken again after
        ...     save_the_cursor()
    """

    def __init__(self, count: int):
        self.count = count
        self._fds: list[int] = []
        self._lock = threading.Lock()

    def hold(self) -> SpareDescriptors:
        """Take the descriptors missing from the reserve, as far as the process has them."""
        with self._lock:
            self._refill()
        return self

    def _refill(self) -> None:
        while len(self._fds) < self.count:
            try:
                self._fds.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:  # none left now: the next hold() tries again
                return

    @contextlib.contextmanager
    def lent(self) -> Iterator[None]:
        """Release the reserve for the block (one thread at a time), and take it again after."""
        with self._lock:
            while self._fds:
                os.close(self._fds.pop())
            try:
                yield
            finally:
                self._refill()


# replace_file needs one descriptor (the new file); two leave room for a lock file or a log line
_SPARE_DESCRIPTORS = SpareDescriptors(2)
