"""The follower: one thread per sink that reads the run's journal from the sink's cursor and delivers it.

This is the one loop of delivery (the "processor"; a :class:`rllog.sink.MetricSink` is the "exporter"). One
:class:`Follower` serves one sink on its own thread, so a slow, hung or failing sink never holds up another one.
What it relies on, each in its own module: the cursor file (:mod:`rllog.delivery.cursor`), the durable-prefix
ledger (:mod:`rllog.delivery.ledger`), the calls with their retries and dead letters (:mod:`rllog.delivery.calls`),
and the flush schedule (:mod:`rllog.delivery.flush`).

A cursor means durable: it moves past a record only once the sink can no longer lose it: after the ``flush()``
that followed the write, or right after the write for a sink whose ``capabilities.durable_writes`` says its writes
are durable. An agent killed at any instant then re-sends at most what was in flight, and never skips what a sink
only buffered.

How much one read takes: at most :data:`BATCH_RECORDS` records and :data:`BATCH_BYTES` of their payloads (a record
larger than that alone), so the agent's memory is bounded by bytes whatever the width of a record.

A cursor save the machine has no room for (a full disk, no descriptor, no memory) waits for it. A file lock
(``RUN_DIR/delivery/<sink>.lock``) makes sure two deliverers never serve one sink of one run.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from rllog import messages
from rllog.delivery.calls import _SPARE_DESCRIPTORS, RAN_OUT, RetryPolicy, SinkCalls, note_ran_out
from rllog.delivery.cursor import CursorStore, SinkState
from rllog.delivery.flush import POLL_INTERVAL, FlushSchedule
from rllog.delivery.ledger import DurableLedger
from rllog.errors import SinkBusy
from rllog.journal import Damage, End, JournalReader
from rllog.records import AlertRecord, ConfigRecord, MetricsRecord, RunInfo, TableRecord
from rllog.settings import (  # the tuning constants, each explained there
    BATCH_BYTES,
    BATCH_RECORDS,
    CURSOR_SAVE_RETRY,
    FINISH_DEADLINE_LOOK_SECONDS,
)
from rllog.sink import MetricSink
from rllog.sink_errors import is_resource_exhausted

log = logging.getLogger("rllog.delivery")


class Follower(SinkCalls):
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
            the cursor of a sink that buffers moves then); sooner when ``Run.flush`` asks
            (:func:`rllog.delivery.request_flush`).
        say: where a failure, or the first dead letter, is said when it happens (default: this process's stderr:
            the trainer's with ``delivery="thread"``, agent.log in the agent, whose supervisor says it again).
        restartable: a fresh process starts this follower again from its cursor when it ends for a restart (a live
            agent's followers): in a process that ran out of a resource (:data:`rllog.delivery.calls.RAN_OUT`) it
            then fails nothing for good, and ends for a restart instead.
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
        say: Callable[[str], None] = messages.say,
        hold: Callable[[threading.Event], None] | None = None,
        restartable: bool = False,
    ):
        self.name = name
        self._sink_or_factory = sink
        self.sink: MetricSink | None = None
        self.run_info = run_info
        self.run_dir = run_info.run_dir
        self.say = say
        self.follow = follow
        self.restartable = restartable
        self.writer_gone = writer_gone
        self.hold = hold  # returns when the follower may work (the agent waits for a busy trainer), or on stop
        self.attempt_starts = attempt_starts
        self.batch_size = batch_size
        self.batch_bytes = batch_bytes
        self.schedule = FlushSchedule(run_info.run_dir, flush_interval, poll_interval)
        self.retry = retry or RetryPolicy()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._sleep = sleep or self._stop.wait
        self.on_progress = on_progress
        self.cursor = CursorStore(run_info.run_dir, name)
        self.saved = self.cursor.load()
        self.ledger = DurableLedger(self.saved.seq, self.saved.ahead)
        self.state = SinkState.WAITING
        self.error: str | None = None
        self.status: str | None = self.saved.status
        self.thread: threading.Thread | None = None
        self._dirty = False  # written since the last flush
        self._closing = False  # close() was called on the sink
        self._said_failed = False  # the failure was said on stderr (see SinkCalls._say_failed)
        self._saved_key = ""  # what the cursor file holds (see _save)
        self._delivered_seq = self.ledger.seq  # the last seq handed to the sink (or skipped)
        self.caught_up_at = time.monotonic()  # when a read last found nothing new (the delivery lag is measured from it)
        self._suspects: list[tuple[Any, str]] = []  # records rejected since the sink last succeeded
        self._damage = Damage(**self.saved.damage)
        self.needs_restart = False  # ended for want of memory or descriptors: start it again from its cursor
        self.retry_due: float | None = None  # while it waits to retry a call: the monotonic time of the next try
        _SPARE_DESCRIPTORS.hold()

    @property
    def seq(self) -> int:
        """The cursor: every readable record at or below it is durable in the sink (or dead-lettered)."""
        return self.ledger.seq

    @property
    def ahead(self) -> set[int]:
        """Durable seqs above :attr:`seq`."""
        return self.ledger.ahead

    @property
    def flush_interval(self) -> float:
        return self.schedule.flush_interval

    @property
    def poll_interval(self) -> float:
        return self.schedule.poll_interval

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
        self.ledger, self.status = DurableLedger(self.saved.seq, self.saved.ahead), self.saved.status
        self._delivered_seq = self.ledger.seq
        self._damage = Damage(**self.saved.damage)
        self.thread = threading.Thread(target=self.run, name=f"rllog-follower-{self.name}", daemon=True)
        self.thread.start()
        return self

    def join(self, timeout: float | None = None) -> bool:
        if self.thread is not None:
            self.thread.join(timeout)
            return not self.thread.is_alive()
        return True

    def waits_past(self, deadline: float) -> bool:
        """Whether it waits to retry its sink and the next try comes after ``deadline`` (monotonic): stopped at the
        deadline, it would deliver nothing more before it than stopped now."""
        due = self.retry_due
        return due is not None and due > deadline

    def join_before(self, deadline: float) -> bool:
        """Wait for the thread to end until ``deadline`` (monotonic); False at the deadline, or at once when it
        :meth:`waits_past` it."""
        while not self.join(max(0.0, min(FINISH_DEADLINE_LOOK_SECONDS, deadline - time.monotonic()))):
            if self.waits_past(deadline) or time.monotonic() >= deadline:
                return False
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
        self.schedule.restart_clock()
        self._save(SinkState.RUNNING)
        try:
            # A live run opens its tracker at once (the tracker's run appears when training starts);
            # a replay opens it only if there is something to deliver.
            if self.hold is not None:
                self.hold(self._stop)
            if self.follow and not self._ensure_open():
                return
            while not self._stop.is_set():
                if self.hold is not None:
                    self.hold(self._stop)
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
                if self._dirty and self.schedule.due(self.ledger.seq, self._delivered_seq):
                    if not self._flush():
                        return
                    self.schedule.restart_clock()
                if end is not None:
                    self.status = end.status
                if end is not None or (not batch and (gone or not self.follow)):
                    self._close(self.status or "killed")  # no end marker: the trainer died
                    return
                if not batch:
                    self.caught_up_at = time.monotonic()
                    self._wake.wait(self.schedule.wait_before_reading(self._dirty, self.ledger.seq, self._delivered_seq))
                    self._wake.clear()
        except Exception as exc:
            ran_out = note_ran_out(exc)
            if (ran_out or (RAN_OUT.is_set() and self.restartable)) and not self._stop.is_set():
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
        wait for it), or anything went wrong in a process that ran out of something before (:data:`RAN_OUT`): its
        records in memory may be half booked, so it ends here, its cursor still ``running`` and saying why, for its
        agent to start again from the cursor (:attr:`needs_restart`)."""
        self.needs_restart = True
        try:
            after = "" if is_resource_exhausted(exc) else " (after this process ran out of a resource: judged again)"
            self.error = f"{type(exc).__name__} while delivering: {exc}{after}; delivery starts again from the cursor"
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
        self.schedule.read(len(batch), reader.last_bytes)
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
        self.ledger.read(r.seq for r in records)
        todo = self.ledger.untaken(records)
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
        self.ledger.durable(r.seq for r in todo if r.seq not in taken)  # a record no call takes is done
        for part, call in calls:
            if not self._write(call, part):
                return False
        self._advance()
        return True

    def _flush(self) -> bool:
        flush = getattr(self.sink, "flush", None)
        if flush is not None and self._call(flush) is not None:
            return False
        self.ledger.flushed()
        self._dirty = False
        self.schedule.flushed()
        self._advance()
        return True

    def _advance(self) -> None:
        """Move the cursor past the durable prefix of what was read; keep later durable seqs in ``ahead``."""
        moved = self.ledger.advance()
        self._save(self.state)
        if moved and self.on_progress:
            self.on_progress(self.seq)

    def _close(self, status: str) -> None:
        if self.sink is not None:
            sink: Any = self.sink
            self._closing = True
            if self._call(lambda: sink.close(status)) is not None:
                return
            self.ledger.flushed()  # close flushes
        self._advance()
        if self._suspects:  # rejected, and no later record was taken to show the sink works: they stay pending
            record, error = self._suspects[-1]
            self.error = f"{len(self._suspects)} records rejected at the end of the journal (last: seq {record.seq}): {error}"
            self._say_failed()  # before the cursor says it: whoever sees the cursor failed finds it said
            self._save(SinkState.FAILED)
            return
        self._save(SinkState.CLOSED)

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
                if not note_ran_out(exc):
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
