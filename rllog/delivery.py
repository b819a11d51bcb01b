"""Delivery: followers that read the journal from each sink's cursor and write to the sink.

This is the one place for batching, retries, backoff and cursors (the "processor"; a
:class:`rllog.sink.MetricSink` is the "exporter"). One :class:`Follower` serves one sink on its own
thread, so a slow, hung or failing sink never holds up another one.

Cursor files live in ``RUN_DIR/delivery/<sink>.json`` (``{"seq", "state", "error", ...}``); a cursor
only moves after the sink accepted the records below it, and a file lock
(``RUN_DIR/delivery/<sink>.lock``) makes sure two deliverers never serve one sink of one run.
"""

from __future__ import annotations

import email.utils
import json
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from filelock import FileLock, Timeout

from rllog.errors import RateLimited, SinkBusy, TransientError
from rllog.journal import End, JournalReader
from rllog.records import AlertRecord, MetricsRecord, RunInfo, TableRecord
from rllog.sink import MetricSink

log = logging.getLogger("rllog.delivery")

# Sink states, as written in the cursor file and reported by ``Run.finish``.
WAITING, RUNNING, CLOSED, FAILED, GAVE_UP, STOPPED = "waiting", "running", "closed", "failed", "gave_up", "stopped"


def parse_retry_after(value: str | float | int | None, now: float | None = None) -> float | None:
    """Seconds to wait from an HTTP ``Retry-After`` value (delta-seconds or an HTTP-date), or None."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return max(0.0, float(value))
    text = str(value).strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


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

    base: float = 0.5
    cap: float = 30.0
    give_up_after: float | None = 600.0
    random: Callable[[], float] = field(default=random.random, repr=False)

    def delay(self, attempt: int, error: BaseException) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based) after ``error``."""
        if isinstance(error, RateLimited) and error.retry_after is not None:
            return error.retry_after
        return self.random() * min(self.cap, self.base * (2 ** attempt))


class CursorStore:
    """The persisted delivery position and state of one sink of one run."""

    def __init__(self, run_dir: str | os.PathLike, sink_name: str):
        self.directory = Path(run_dir) / "delivery"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"{sink_name}.json"
        # acquired by the thread that starts a follower, released by the follower thread itself
        self.lock = FileLock(str(self.directory / f"{sink_name}.lock"), thread_local=False)

    def load(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return {"seq": 0, "state": WAITING, "error": None}

    def save(self, **state) -> None:
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.path)

    def acquire(self) -> None:
        try:
            self.lock.acquire(timeout=0)
        except Timeout:
            raise SinkBusy(f"another process is delivering to {self.path.stem!r} of this run ({self.lock.lock_file})") from None

    def release(self) -> None:
        self.lock.release()


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
        flush_interval: the sink's ``flush`` is called at least this often while records flow.
    """

    def __init__(
        self,
        name: str,
        sink: MetricSink | Callable[[], MetricSink],
        run_info: RunInfo,
        *,
        follow: bool = True,
        writer_gone: Callable[[], bool] = lambda: False,
        flush_interval: float = 1.0,
        batch_size: int = 1000,
        poll_interval: float = 0.05,
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
        self.flush_interval = flush_interval
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self.retry = retry or RetryPolicy()
        self._stop = threading.Event()
        self._sleep = sleep or self._stop.wait
        self.on_progress = on_progress
        self.cursor = CursorStore(run_info.run_dir, name)
        saved = self.cursor.load()
        self.seq = saved.get("seq", 0)
        self.ahead: set[int] = set(saved.get("ahead", ()))  # delivered beyond ``seq`` by a batch that failed midway
        self.state = WAITING
        self.error: str | None = None
        self.status: str | None = None
        self.thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "Follower":
        self.cursor.acquire()
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

    def run(self) -> None:
        """Deliver until the end of the journal (follow) or until what is there now is delivered."""
        reader = JournalReader(self.run_info.run_dir, after_seq=self.seq)
        last_flush, dirty = time.monotonic(), False
        self._save(RUNNING)
        try:
            # A live run opens its tracker at once (the tracker's run appears when training starts);
            # a replay opens it only if there is something to deliver.
            if self.follow and not self._ensure_open():
                return
            while not self._stop.is_set():
                gone = self.writer_gone()
                batch = reader.read(self.batch_size, final=gone or not self.follow)
                end = next((r for r in batch if isinstance(r, End)), None)
                records = [r for r in batch if not isinstance(r, End)]
                if records:
                    if not self._deliver(records):
                        return
                    dirty = True
                if dirty and (time.monotonic() - last_flush >= self.flush_interval or not records):
                    if not self._call(self.sink.flush):
                        return
                    last_flush, dirty = time.monotonic(), False
                if end is not None:
                    self.status = end.status
                if end is not None or (not batch and (gone or not self.follow)):
                    self._close(self.status or "killed")  # no end marker: the trainer died
                    return
                if not batch:
                    self._stop.wait(self.poll_interval)
        except BaseException as exc:  # never let a bug kill the thread silently
            self._fail(exc)
        finally:
            reader.close()
            try:
                self.cursor.release()
            except Exception:
                pass

    # -- internals -------------------------------------------------------------------------------
    def _ensure_open(self) -> bool:
        if self.sink is not None:
            return True

        def open_sink():
            sink = self._sink_or_factory() if callable(self._sink_or_factory) and not isinstance(self._sink_or_factory, MetricSink) else self._sink_or_factory
            sink.open(self.run_info)
            self.sink = sink

        return self._call(open_sink)

    def _deliver(self, records: list) -> bool:
        """Deliver one batch: its metrics in one ``write_metrics`` call, then its tables and alerts.

        Grouping the metrics is what makes a live run cheap to deliver: the journal hands a
        batch of steps (metrics and a completions table each) to the follower at once, and a
        tracker's per-call cost (an MLflow transaction, a trackio connection) is paid per batch
        rather than per step. Every record carries its step, so no tracker depends on the
        interleaving. The cursor is saved after each call of a batch: what a call delivered past
        the contiguous prefix is remembered (``ahead``), so neither a failed call nor a killed
        agent makes a replay repeat more than the call in flight.
        """
        todo = [r for r in records if r.seq not in self.ahead]
        if not todo:  # all of it delivered before a failure: move the cursor, open nothing
            self._advance(records, set())
            return True
        if not self._ensure_open():
            return False
        takes_tables = getattr(self.sink.capabilities, "tables", False)
        takes_alerts = getattr(self.sink.capabilities, "alerts", False) and hasattr(self.sink, "write_alert")
        metrics = [r for r in todo if isinstance(r, MetricsRecord)]
        calls: list[tuple[list, Callable[[], None]]] = []
        if metrics:
            calls.append((metrics, lambda: self.sink.write_metrics(metrics)))
        for r in todo:
            if isinstance(r, TableRecord) and takes_tables:
                calls.append(([r], lambda r=r: self.sink.write_table(r)))
            elif isinstance(r, AlertRecord) and takes_alerts:
                calls.append(([r], lambda r=r: self.sink.write_alert(r)))
        # a record no call takes (or delivered before) counts as delivered
        done = {r.seq for r in records} - {r.seq for part, _ in calls for r in part}
        for part, call in calls:  # the cursor is saved after each call: a killed agent repeats only the call in flight
            delivered = self._call(call)
            if delivered:
                done.update(r.seq for r in part)
            self._advance(records, done)
            if not delivered:
                return False
        if not calls:
            self._advance(records, done)
        if self.on_progress:
            self.on_progress(self.seq + len(self.ahead))
        return True

    def _advance(self, records: list, done: set[int]) -> None:
        """Move the cursor past the delivered prefix of ``records``; keep later delivered ones in ``ahead``."""
        done = done | self.ahead
        for r in records:
            if r.seq not in done:
                break
            self.seq = r.seq
        self.ahead = {s for s in self.ahead | done if s > self.seq}
        self._save(self.state)

    def _call(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` with retries. False when the sink failed or was given up (state saved)."""
        attempt, first_failure = 0, None
        while True:
            try:
                fn()
                return True
            except TransientError as exc:
                now = time.monotonic()
                first_failure = first_failure or now
                if self.retry.give_up_after is not None and now - first_failure >= self.retry.give_up_after:
                    self._fail(exc, GAVE_UP)
                    return False
                wait = self.retry.delay(attempt, exc)
                log.info("rllog: sink %r: %s; retrying in %.2fs", self.name, exc, wait)
                attempt += 1
                self._sleep(wait)
                if self._stop.is_set():
                    self._fail(exc, STOPPED)
                    return False
            except Exception as exc:
                self._fail(exc)
                return False

    def _close(self, status: str) -> None:
        if self.sink is not None:
            if not self._call(lambda: self.sink.close(status)):
                return
        self._save(CLOSED)

    def _fail(self, exc: BaseException, state: str = FAILED) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        log.error("rllog: sink %r %s at seq %d: %s", self.name, state.replace("_", " "), self.seq, self.error)
        self._save(state)

    def _save(self, state: str) -> None:
        self.state = state
        self.cursor.save(seq=self.seq, ahead=sorted(self.ahead), state=state, error=self.error, status=self.status, pid=os.getpid(), time=time.time())
