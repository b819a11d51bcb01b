"""Calls to a sink: retries with backoff, records set aside (suspects) and dead letters, and the re-send rule.

Retried: :class:`rllog.errors.TransientError` and what this machine ran out of (a ``MemoryError``, or an
``OSError`` in :data:`rllog.sink_errors.RESOURCE_ERRNOS`: no descriptor, no memory, a full disk), raised by a sink
call or while reading the journal, backing off to at most :data:`LOCAL_RETRY_CAP` for the latter (the resource is on
this machine: another thread closing a file or freeing memory brings it back, and no remote service needs sparing).

A retried write hands the sink only the records it has not taken: a sink that stores a batch in several tracker
calls says how far it got (:func:`rllog.sink.took`), and the records up to there are booked as taken (in flight, or
durable) before the call is repeated with the rest. A sink therefore keeps no record of what it was sent (see
:mod:`rllog.delivery.ledger` for the one case where it sees a record again).

One bad record never stops a sink. A record the sink rejects with a permanent error (anything but a
:class:`rllog.errors.TransientError`) is set aside; once a later call to the same sink succeeds (so the sink works
and the record was the problem) it goes to the sink's dead-letter list and delivery goes on. Records still set aside
when the journal ends stay pending, and the sink is reported failed. When :data:`MAX_SUSPECTS` records in a row fail,
the sink itself is broken: it is marked failed and those records stay pending for ``rllog replay``. The first dead
letter and a failure are said at once on stderr (:mod:`rllog.delivery.notices`).

A process that ran out of a resource is not trusted to call anything permanent (:data:`RAN_OUT`): a live agent's
follower that would fail a sink or reject a record there ends for a restart of its agent from the cursors instead,
and a fresh interpreter judges the same call again.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from rllog.delivery import notices
from rllog.delivery.cursor import RETRY_NOTE, Cursor, SinkState
from rllog.delivery.ledger import DurableLedger
from rllog.errors import RateLimited, TransientError
from rllog.records import AlertRecord, ConfigRecord, MetricsRecord, TableRecord
from rllog.settings import (  # the tuning constants, each explained there
    DEAD_LETTERS_KEPT,
    LOCAL_RETRY_CAP,
    MAX_SUSPECTS,
    RETRY_AFTER_CAP_SECONDS,
    RETRY_BASE_SECONDS,
    RETRY_CAP_SECONDS,
    RETRY_GIVE_UP_SECONDS,
)
from rllog.sink import Batch
from rllog.sink_errors import is_resource_exhausted

log = logging.getLogger("rllog.delivery")

#: Set once this process ran out of a resource (a sink call or a journal read raised what
#: :func:`rllog.sink_errors.is_resource_exhausted` sees). What ran out can leave the interpreter damaged in ways that
#: name no resource later: an import cut part-way for want of a descriptor or memory leaves the submodules that loaded
#: in ``sys.modules``, unbound from the package, and the next import of that package in any thread raises a
#: ``NameError`` (``asyncio``'s ``base_events``, in the explorer's agent). From then on a live agent's follower
#: (``restartable``) does not fail a sink or reject a record on this process's word: it ends for a restart from its
#: cursor (:meth:`rllog.delivery.Follower._restart_from_cursor`), and the restarted agent starts clean.
RAN_OUT = threading.Event()


def note_ran_out(exc: BaseException) -> bool:
    """Whether ``exc`` says this machine ran out of something (:func:`rllog.sink_errors.is_resource_exhausted`);
    remembered for the process in :data:`RAN_OUT` when it does."""
    if is_resource_exhausted(exc):
        RAN_OUT.set()
        return True
    return False


@dataclass
class RetryPolicy:
    """Capped exponential backoff with full jitter, ``Retry-After`` honoured (up to
    :data:`rllog.settings.RETRY_AFTER_CAP_SECONDS`; one that is no number backs off instead), and a give-up deadline.

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
        if isinstance(error, RateLimited) and (asked := _seconds(error.retry_after)) is not None:
            return min(max(asked, 0.0), RETRY_AFTER_CAP_SECONDS)
        cap = min(self.cap, LOCAL_RETRY_CAP) if is_resource_exhausted(error) else self.cap
        return self.random() * min(cap, self.base * 2.0 ** min(attempt, 64))  # 2**attempt overflows a float past ~1000 attempts

    def as_dict(self) -> dict[str, Any]:
        return {"base": self.base, "cap": self.cap, "give_up_after": self.give_up_after}


def _seconds(value: Any) -> float | None:
    """A ``Retry-After`` a sink passed, as seconds; None for none, or for what is no number (NaN, a word): backoff."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(seconds) else seconds


def _kind(record: Any) -> str:
    return {MetricsRecord: "metrics", TableRecord: "table", AlertRecord: "alert", ConfigRecord: "config"}.get(
        type(record), type(record).__name__
    )


class SinkCalls:
    """The sink-calling half of a :class:`rllog.delivery.Follower` (which holds the state it uses: ``name``,
    ``sink``, ``retry``, ``ledger``, ``state``, ``error``, ``saved``, ``follow``, ``restartable``, ``writer_gone``, ``_stop``,
    ``_sleep``, ``retry_due``, ``_save``, ``_advance``, ``_durable_writes``, ``say``)."""

    name: str
    sink: Any
    retry: RetryPolicy
    error: str | None
    state: str
    follow: bool
    restartable: bool
    run_dir: str | os.PathLike
    ledger: DurableLedger
    saved: Cursor
    say: Callable[[str], None]
    writer_gone: Callable[[], bool]
    _stop: threading.Event
    _sleep: Callable[[float], Any]
    retry_due: float | None
    _suspects: list[tuple[Any, str]]
    _dirty: bool
    _closing: bool
    _said_failed: bool

    # what the follower provides
    @property
    def _durable_writes(self) -> bool:
        raise NotImplementedError

    def _save(self, state: str, wait: bool = True) -> bool:
        raise NotImplementedError

    def _advance(self) -> None:
        raise NotImplementedError

    def _write(self, call: Callable[[list], None], part: list) -> bool:
        """One write of ``part`` (repeated with the records the sink has not taken); a rejected write of several
        records is made again record by record, so one bad record costs only itself. False when delivery must stop."""
        batch = Batch(part)
        error = self._call(partial(self._attempt, call, batch), permanent_ok=True, before_retrying=self._keep_what_the_sink_holds)
        if error is not None and len(batch) > 1 and self.state == SinkState.RUNNING:  # find the bad record(s)
            for record in list(batch):
                one = Batch([record])
                error = self._call(
                    partial(self._attempt, call, one), permanent_ok=True, before_retrying=self._keep_what_the_sink_holds
                )
                if not self._accepted(one, error):
                    return False
            return True
        return self._accepted(batch, error)

    def _attempt(self, call: Callable[[list], None], batch: Batch) -> None:
        """Hand ``batch`` to the sink; if it raises, book what it said it took and leave only the rest in ``batch``."""
        if not batch:  # everything was taken by an earlier attempt that raised after it
            return
        try:
            call(batch)
        except BaseException:
            taken = batch.drop_taken()
            if taken:
                self._book_taken({r.seq for r in taken})
            raise

    def _book_taken(self, seqs: set[int]) -> None:
        self._confirm_suspects()  # the sink took a later record: the ones it rejected before were bad, not the sink
        self._dirty = True
        self.ledger.took(seqs, durable=self._durable_writes)

    def _accepted(self, part: list, error: str | None) -> bool:
        """Book the result of one call. False when delivery must stop (the sink failed)."""
        if self.state in SinkState.BROKEN or self.state == SinkState.STOPPED:
            self._advance()
            return False
        if error is None:
            self._book_taken({r.seq for r in part})
            return True
        self._suspects.extend((r, error) for r in part)
        if len(self._suspects) >= MAX_SUSPECTS:
            self.error = f"{len(self._suspects)} records in a row rejected; last: {error}"
            log.error("rllog: sink %r failed: %s", self.name, self.error)
            self._keep_what_the_sink_holds()
            self._advance()
            self._say_failed()  # before the cursor says it: whoever sees the cursor failed finds it said
            self._save(SinkState.FAILED)
            return False
        return True

    def _confirm_suspects(self) -> None:
        """The sink took a later call: the records it rejected before were bad, not the sink."""
        for record, error in self._suspects:
            if self.saved.dead_letter_count == 0:
                self.say(notices.dead_lettering(self.name, record.seq, record.step, error, self.run_dir))
            self.saved.dead_letter_count += 1
            if len(self.saved.dead_letters) < DEAD_LETTERS_KEPT:
                self.saved.dead_letters.append({"seq": record.seq, "step": record.step, "kind": _kind(record), "error": error})
            self.ledger.durable([record.seq])
            log.error(
                "rllog: sink %r rejected record seq %d (step %d) for good: %s; it is in the dead-letter list, delivery goes on",
                self.name,
                record.seq,
                record.step,
                error,
            )
        self._suspects = []

    def _say_failed(self) -> None:
        """Say on stderr, once, that the sink failed (the agent's supervisor says it from the cursor too)."""
        if not self._said_failed:
            self._said_failed = True
            self.say(notices.failed(self.name, self.error, self.run_dir))

    def _call(
        self,
        fn: Callable[[], None],
        permanent_ok: bool = False,
        what: str = "",
        before_retrying: Callable[[], None] | None = None,
    ) -> str | None:
        """Run ``fn`` with retries. Returns None on success, else the error (state saved).

        Retried: :class:`TransientError` and what this machine ran out of (:func:`is_resource_exhausted`),
        until ``retry.give_up_after`` (a live run's follower waits for what the machine ran out of until it is
        stopped). With ``permanent_ok`` another error is returned to the caller (the
        record may be bad); otherwise it fails the sink. ``what`` names the work in messages. ``before_retrying`` runs
        once, at the first failure that will be retried (a write keeps what the sink holds before a long wait).
        """
        attempt, first_failure = 0, None
        prefix = f"{what}: " if what else ""
        while True:
            try:
                fn()
            except Exception as exc:
                ran_out = note_ran_out(exc)
                if not ran_out and not isinstance(exc, TransientError):
                    if RAN_OUT.is_set() and self.restartable and not self._stop.is_set():
                        self._keep_what_the_sink_holds()  # or the fresh agent sends it again
                        raise  # judged again by a fresh agent (RAN_OUT): the follower ends for a restart
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
                    if before_retrying is not None:
                        before_retrying()
                # What this machine ran out of is waited for while the run lives (finish's deadline ends the wait,
                # its records pending and the cause named), as the journal waits out a full disk; a replay, or an
                # agent whose trainer died (nobody will call finish), gives up on it like on a tracker that stays down.
                waits_for_the_run = self.follow and ran_out and not self.writer_gone()
                give_up = self.retry.give_up_after is not None and not waits_for_the_run
                if give_up and now - first_failure >= (self.retry.give_up_after or 0.0):
                    return self._fail(exc, SinkState.GAVE_UP, prefix)
                wait = self.retry.delay(attempt, exc)
                past_give_up = give_up and now + wait > first_failure + (self.retry.give_up_after or 0.0)
                asked = isinstance(exc, RateLimited) and _seconds(exc.retry_after) is not None
                if past_give_up and asked and not self.follow:  # a replay has no later to wait for; a backoff is waited
                    again = time.strftime("%H:%M", time.localtime(time.time() + wait + 59))  # the minute rounded up
                    later = f"; asked to wait {wait:.0f}s, past this replay's give-up deadline: replay again after {again}"
                    return self._fail(exc, SinkState.STOPPED, prefix, later)
                log.info("rllog: sink %r: %s%s: %s; retrying in %.2fs", self.name, prefix, type(exc).__name__, exc, wait)
                attempt += 1
                self.retry_due = time.monotonic() + wait
                try:
                    self._sleep(wait)
                finally:
                    self.retry_due = None
                if self._stop.is_set():
                    return self._fail(exc, SinkState.STOPPED, prefix)
            else:  # outside the try: a cursor save that fails is not the sink rejecting what it took
                if self.error is not None and self.error.startswith(RETRY_NOTE):  # the retry note is no longer true
                    self.error = None
                    self._save(self.state, wait=False)
                return None

    def _fail(self, exc: BaseException, state: str = SinkState.FAILED, prefix: str = "", then: str = "") -> str:
        self.error = f"{prefix}{type(exc).__name__}: {exc}{then}"
        log.error("rllog: sink %r %s at seq %d: %s", self.name, state.replace("_", " "), self.ledger.seq, self.error)
        if state in SinkState.BROKEN or state == SinkState.STOPPED:
            self._keep_what_the_sink_holds()
        if state in SinkState.BROKEN:
            self._say_failed()
        self._save(state)
        return self.error

    def _keep_what_the_sink_holds(self) -> None:
        """Before delivery stops on a broken sink, is stopped at the deadline while a call is retried, or starts
        retrying a write: one flush, not retried, so that the records the sink accepted and holds count as delivered.
        Left in flight, they would stay behind the cursor through the wait, and if the agent then ended (killed, or
        stopped at the deadline inside a call that hangs) ``rllog replay`` would send them again: a tracker that sends
        on write (wandb, MLflow, trackio) would show them twice."""
        flush = getattr(self.sink, "flush", None)
        if not self.ledger.has_in_flight or flush is None or self._closing:  # a sink whose close failed may be half closed:
            return  # its flush could return without writing anything, and the cursor must not move on that
        try:
            flush()
        except Exception as exc:  # the sink is broken, or down: what it holds stays pending
            log.warning("rllog: sink %r: the flush of what it holds failed too (%s: %s)", self.name, type(exc).__name__, exc)
            return
        self.ledger.flushed()
        self._advance()


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
