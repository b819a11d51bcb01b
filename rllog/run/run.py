"""The user-facing run: ``log``, ``log_table``, ``update_config``, ``flush``, ``finish``.

The hot path (``log``/``log_table``/``update_config``, and the system samples the agent sends) validates, then
:meth:`Run._append` stamps a sequence number, a step and the time under the run's lock and hands the record to the
journal writer: no tracker call, no disk wait. Everything after that (tracker imports, ``init`` calls, writes,
retries) happens in the delivery agent process, or in follower threads with ``delivery="thread"``
(:mod:`rllog.run.delivery_link`). Opening the run directory is :mod:`rllog.run.opening`'s; SIGTERM, fork and exit
are :mod:`rllog.run.signals`'; the run directory's files and the report are :mod:`rllog.rundir`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from rllog import journal, messages, settings
from rllog.errors import ForkedChild, InvalidArgument, RunFinished
from rllog.journal import JournalWriter, PendingMetrics, PendingTable
from rllog.records import RUN_STATUSES, AlertRecord, ConfigRecord, TableRecord
from rllog.run import delivery_link, signals
from rllog.run.base import RunBase, takes_tables
from rllog.run.opening import (
    OpenedRunDir,
    agent_interval,
    check_options,
    check_resume,
    health_monitor,
    new_attempt,
    open_run_dir,
    run_info,
    select_sinks,
)
from rllog.run.signals import SignalAwareLock
from rllog.rundir import FinishReport, RunFile, SinkSpec, html_table, report
from rllog.settings import (
    JOURNAL_WRITE_INTERVAL,
    STOP_GRACE_SECONDS,
)
from rllog.validate import TableColumns, check_step, flatten_config, redact, stack_scalars

log = logging.getLogger("rllog")

# A journal record before _append numbers it: (seq, step, time, *fields) -> the record.
RecordMaker = Callable[..., Any]
# Who appends a record (Run._append): the user's call, the agent's system sample, the journal writer's health alert.
USER, AGENT, WRITER = "user", "agent", "writer"
WORKERS_DOC = "docs/workers.md"


class Run(RunBase):
    """One training run. Create it with :func:`rllog.init`.

    Args:
        flush_interval: seconds. Every record reaches the journal (the OS) within a quarter of it (at most
            :data:`JOURNAL_WRITE_INTERVAL`), and every sink is flushed (its cursor moved) at least this often
            while records flow; ``flush()`` asks for a flush at once.
        quiet: print nothing: neither ``init``'s line naming the run directory nor ``finish``'s line per tracker
            (default: ``$RLLOG_QUIET``, else False).

    Example:
        >>> with rllog.init(report_to="parquet", project="grpo") as run:
        ...     run.log({"reward": 0.4, "kl": 0.01}, step=1)
        ...     run.log_table("completions", {"prompt": ["2+2="], "completion": ["4"]}, step=1)
    """

    def __init__(
        self,
        report_to: Any = None,
        *,
        project: str = "rllog",
        name: str | None = None,
        config: Any = None,
        tags: list[str] | tuple[str, ...] = (),
        run_dir: str | os.PathLike | None = None,
        flush_interval: float = 1.0,
        delivery: str = "process",
        backend_options: Mapping[str, Mapping[str, Any]] | None = None,
        retry: Any = None,
        health: Any = True,
        max_pending: int = 100_000,
        reduce_across_ranks: bool | None = None,
        run_id: str | None = None,
        resume: str | None = None,
        system_metrics: bool | float | None = None,
        quiet: bool | None = None,
    ):
        self.flush_interval = check_options(flush_interval, max_pending, delivery)
        resume = check_resume(resume, run_id)
        self.quiet = settings.QUIET.get() if quiet is None else bool(quiet)
        self.delivery = delivery
        self.max_pending = max_pending
        interval = agent_interval(delivery, system_metrics)
        sinks = select_sinks(report_to, backend_options)
        self._selected, self._named, self._objects, self._options = sinks.selected, sinks.named, sinks.objects, sinks.options
        super().__init__(reduce_across_ranks)
        self._takes_tables = takes_tables(sinks.selected) if self._distributed else True
        opened = open_run_dir(run_dir, run_id, resume, project, name, tuple(tags), flatten_config(config, keep_lists=True))
        self._take_run_dir(opened, continues=resume == "continue")
        self.retry = retry or delivery_link.default_retry()
        self.sink_names = list(self._named) + self._object_names(self._objects)
        self._run_file().write(self.run_dir)
        self._start_journal(opened.next_seq, health)
        self._start_delivery(interval)
        signals.register(self)
        if not self.quiet:
            messages.say(self._opening_line())

    # -- opening (the steps of __init__) ---------------------------------------------------------
    def _take_run_dir(self, opened: OpenedRunDir, continues: bool) -> None:
        """Hold the claimed (or resumed) run directory and start this attempt from where its journal stops."""
        self.run_dir = opened.run_dir
        self._run_lock = opened.lock
        self.resumed = opened.resumed
        self._step = opened.last_step
        self._attempts = new_attempt(opened.attempts, opened.next_seq, continues=continues)
        self.attempt = len(self._attempts)
        self.info = run_info(opened, self._attempts)

    def _start_journal(self, next_seq: int, health: Any) -> None:
        """The hot path's state, and the journal writer thread that takes records from ``next_seq`` on."""
        self._backpressure_warned = False
        self._monitor = health_monitor(health)
        self._wake_at = 0  # a flush request's seq: in-process followers are woken once the journal holds it
        self._followers: list[Any] = []
        self._writer = JournalWriter(
            self.run_dir,
            min(self.flush_interval / 4, JOURNAL_WRITE_INTERVAL),
            next_seq=next_seq,
            on_written=self._check_health if self._monitor else None,
            on_landed=self._wake_asked_followers,
        )
        self._lock = SignalAwareLock()
        self._scan_lock = SignalAwareLock()
        self._scanner: journal.Scanner | None = None  # see _scan
        self._seq = next_seq - 1
        self._finishing: threading.Event | None = None
        self._finisher: int | None = None  # the thread that called finish() first
        self._forked = False
        self._pid = os.getpid()
        # Where an omitted step comes from when a trainer owns the step (set by the HF/TRL integration).
        self.step_source: Callable[[], int] | None = None

    def _start_delivery(self, interval: float | None) -> None:
        """The agent process for the named backends (``delivery="process"``; ``interval``: its system samples),
        else a follower thread each; sink objects always get a follower thread."""
        self._agent: Any = None
        if self._named and self.delivery == "process":
            self._agent = delivery_link.start_agent(self.run_dir, self._options, self._named, interval, self._log_system)
        else:
            factory = delivery_link.sink_factory
            self._followers += [self._follower(n, factory(n, self._options.get(n))) for n in self._named]
        objects = zip(self.sink_names[len(self._named) :], self._objects, strict=True)
        self._followers += [self._follower(n, s) for n, s in objects]
        for follower in self._followers:
            follower.start()

    # -- the hot path ----------------------------------------------------------------------------
    def _append(
        self,
        make: RecordMaker,
        fields: tuple[Any, ...],
        step: int | Callable[[], int] | None,
        source: str = USER,
        stamp: float | None = None,
        advances_step: bool = False,
    ) -> None:
        """Number a record, date it and hand it to the journal writer: the one place a record gets its seq and step.

        Args:
            make: the record's class, or a function, called as ``make(seq, step, time, *fields)`` under the run's
                lock.
            fields: the rest of the record.
            step: the record's step; None: the next one (the trainer's current step where an integration owns the
                step, else the last step + 1); or a function that picks it under the lock.
            source: :data:`USER` (a closed run raises; ``log`` waits while the writer is ``max_pending`` behind),
                :data:`AGENT` (a system sample: dropped once the run closes) or :data:`WRITER` (a health alert, on
                the writer's own thread: always taken, never waits for the writer).
            stamp: the record's time (default: now).
            advances_step: the record's step becomes the run's step (metrics).
        """
        # Written for ``log``'s cost (it is most of it): the bare C lock, no helper calls on the common path.
        now = time.time() if stamp is None else stamp
        try:
            with self._lock.raw:
                if self._forked or self._finishing is not None:
                    if source == USER:
                        self._check_open()
                    elif source == AGENT:
                        return
                self._seq += 1
                if step is None:
                    at = self.step_source() if self.step_source is not None else self._step + 1
                else:
                    at = step() if callable(step) else step
                if advances_step:
                    self._step = at
                self._writer.append(make(self._seq, at, now, *fields))
        finally:  # what ``with lock:`` does on the way out (see rllog.run.signals.SignalAwareLock)
            if signals.deferred_sigterm is not None:
                signals.act_on_deferred_sigterm()
        if source == USER and self._writer.backlog > self.max_pending:
            self._wait_for_journal()

    def log(self, values: Mapping[str, Any], step: int | None = None) -> None:
        """Log scalar metrics at ``step`` (default: the last step + 1, or the trainer's current step when a
        trainer integration drives the run).

        Values may be Python or numpy numbers, bools or one-element torch tensors (kept on their device
        and copied to the host together at the next flush); nested dicts are flattened with ``/``.

        Raises:
            InvalidValue: a value that is not one real number (names the key and the type).
            InvalidStep: a step that is not an int in [0, 2**63 - 1].
            RunFinished: the run has finished.
            ForkedChild: called in a process forked from the one that started the run.
        """
        floats, tensors = self._prepare_metrics(values)
        stacked = stack_scalars(list(tensors.values())) if tensors else None
        self._append(
            PendingMetrics, (floats, tuple(tensors), stacked), None if step is None else check_step(step), USER, None, True
        )

    def log_table(self, name: str, table: Any, step: int | None = None) -> None:
        """Log a table (e.g. completions) at ``step`` (default: the step of the last ``log``).

        ``table`` may be a dict of equal-length columns, a list of row dicts, a ``pyarrow.Table`` or a
        pandas DataFrame.

        Raises:
            InvalidTable: ragged columns (names each column's length), a column type no tracker can
                store, or a column whose type changed since an earlier call with this name.
        """
        prepared = self._prepare_table(name, table)
        if step is not None:
            step = check_step(step)
        table_step = step if step is not None else (lambda: self._trainer_step(max(self._step, 0)))
        self._append(PendingTable if isinstance(prepared, TableColumns) else TableRecord, (name, prepared), table_step)

    def _log_system(self, sample: dict[str, Any]) -> None:
        """A sample of the trainer's system metrics, taken by the agent: journaled at the trainer's current step."""
        values = {k: float(v) for k, v in sample["values"].items()}
        self._append(PendingMetrics, (values,), self._current_step, AGENT, float(sample["time"]))

    def update_config(self, values: Any) -> None:
        """Add or change hyperparameters after ``init`` (accelerate and Lightning hand config over late).

        ``values`` is flattened and redacted like ``init``'s ``config`` and journaled; every sink that
        takes config records it (MLflow params, wandb config, parquet's run file, ...).
        """
        flat = flatten_config(values, keep_lists=True)

        def record(seq: int, at: int, now: float) -> ConfigRecord:
            # under the lock, with the record: a sink opened again (agent restart, replay, resume) starts from
            # the config as it is now
            self.info = dataclasses.replace(self.info, config={**self.info.config, **flat})
            return ConfigRecord(seq, at, now, flat)

        self._append(record, (), self._current_step)
        self._run_file().write(self.run_dir)

    def _trainer_step(self, otherwise: int) -> int:
        """The trainer's current step where an integration owns the step, else ``otherwise``."""
        return self.step_source() if self.step_source is not None else otherwise

    def _current_step(self) -> int:
        return max(self._step, 0)

    def flush(self, timeout: float = 60.0) -> FinishReport:
        """Block until every record logged before the call is written and flushed in every healthy sink.

        Returns a report like ``finish``'s, on those records: ``delivered`` for a sink that holds them
        all. A failed sink is not waited for; one still behind at ``timeout`` is reported ``pending``.
        """
        if not self._forked and self._finishing is None:
            self._log_held()
        with self._lock:
            self._check_open()
            target = self._seq
        deadline = time.monotonic() + timeout
        self._writer.wake()
        self._writer.wait_written(target, timeout)
        self._ask_flush(target)
        delivery_link.wait_flushed(self.run_dir, self.sink_names, target, deadline)  # a train() ends with this wait
        return report(self.run_dir, self.sink_names, upto=target, scan=self._scan())

    def request_flush(self, at_once: bool = False) -> None:
        """Ask every sink to flush what was logged so far soon, without waiting: a later :meth:`flush` then waits
        for less. The Hugging Face integration asks ``at_once`` as ``train()`` and ``evaluate()`` end, and returns.
        A sink is flushed at most every :data:`rllog.settings.ASKED_FLUSH_MIN_GAP` for these requests (a flush per
        step costs the agent more than it saves), unless ``at_once``; its follower reads the journal at once, and
        again every :data:`rllog.settings.POLL_INTERVAL` until the records land.

        The journal writer is woken last: woken first, it would take the GIL from the training thread while this
        call writes the request. The agent is woken by a byte down its stdin (:func:`rllog.delivery.request_flush`)."""
        with self._lock:
            self._check_open()
            target = self._seq
        # In-process followers (delivery="thread", sink objects) woken now would read before the writer wrote the
        # records and honour the request only at their next poll: the writer wakes them once they are written.
        self._wake_at = target
        self._ask_flush(target, wake_followers=False, soon=not at_once)
        self._writer.wake()
        self._wake_asked_followers(self._writer.written_seq)  # written already (the writer's last tick)

    def _ask_flush(self, target: int, quiet: bool = False, wake_followers: bool = True, soon: bool = False) -> None:
        """Ask the followers (the agent's through the request file) to read the journal now and flush up to ``target``
        (``soon``: nobody waits; see :func:`rllog.delivery.request_flush`)."""
        if wake_followers:
            for follower in self._followers:
                follower.wake()
        try:
            delivery_link.ask_flush(self.run_dir, target, soon=soon, agent=self._agent)
        except OSError as exc:  # a full disk: the sinks are still flushed every flush_interval
            if not quiet:
                log.warning("rllog: cannot ask the sinks to flush now (%s); waiting for their next flush", exc)

    @property
    def run_id(self) -> str:
        """The run's stable id (trackers use it to resume the same run on replay)."""
        return self.info.run_id

    # -- the end ---------------------------------------------------------------------------------
    def finish(self, status: str = "finished", timeout: float = 120.0) -> FinishReport:
        """Write the end marker, wait up to ``timeout`` s for every sink, and report per sink.

        A sink still busy at the deadline is stopped (the agent process is killed); what it has not
        acknowledged stays in the journal for ``rllog replay``. It returns within ``timeout`` plus
        :data:`rllog.settings.FINISH_OVERRUN_MAX_SECONDS` whatever the agent does (a frozen agent is killed at
        once), plus the time to read the journal's last records for the report. Calling ``finish`` again,
        from any thread, returns the same report (a second caller waits for the first). Unless the run is
        ``quiet``, it prints one line per tracker: delivered or not, and where its data is.
        """
        if status not in RUN_STATUSES:
            raise InvalidArgument(f"status must be one of {RUN_STATUSES}, got {status!r}")
        if self._forked:
            raise ForkedChild("finish() called in a forked child process; finish the run in the process that started it")
        if self._finishing is None:
            self._log_held()
        with self._lock:
            first = self._finishing is None
            if first:
                self._finishing = threading.Event()  # from here on log() raises RunFinished
                self._finisher = threading.get_ident()
            finishing = self._finishing
        assert finishing is not None
        if not first:
            finishing.wait()
            assert self._finished is not None
            return self._finished
        try:
            self._finished = self._finish(status, time.monotonic() + timeout)
        finally:
            if self._finished is None:
                self._finished = FinishReport(notes=["finish() was interrupted"])
            signals.forget(self)
            self._run_lock.release()
            finishing.set()
            signals.act_on_deferred_sigterm()
        if not self.quiet:
            messages.say(self._finished.summary(f"rllog: run {self.info.name!r} {status}"))
        elif not self._finished.ok:
            log.warning("rllog: run %s finished with undelivered records:\n%s", self.run_dir, self._finished)
        return self._finished

    def _finish(self, status: str, deadline: float) -> FinishReport:
        self._writer.close(status, timeout=max(0.0, deadline - time.monotonic()))
        self._ask_flush(self._seq, quiet=True)  # the followers read the end marker now, not at their next poll
        notes, cause = [], None
        stats = self._writer.stats
        if stats.unwritten or stats.unencodable:
            lost = stats.unwritten + len(stats.unencodable)
            held = self._writer.why_held
            why = (
                f"the journal could not be written ({str(held) or type(held).__name__})"
                if stats.unwritten
                else "they could not be encoded"
            )
            cause = f"{lost} records never reached the journal: {why}; they are lost"
            notes.append(f"journal: {cause}")
        if self._agent is not None:
            delivery_link.tell_finish_deadline(self.run_dir, deadline)
            self._agent.wait_while_alive(deadline)
            if not self._agent.stop(deadline):
                notes.append("the delivery agent was stopped at the finish deadline")
            cause = cause or self._agent.cause
            if self._agent.restarts:
                notes.append(f"the delivery agent was restarted {self._agent.restarts} times")
        for follower in self._followers:
            if not follower.join_before(deadline):  # at once when its next try comes after the deadline
                follower.stop()  # one retrying wakes, keeps what its sink holds and saves its cursor: a moment
                follower.join(STOP_GRACE_SECONDS)
            else:  # in this process nobody restarts a follower: one that ended while running says so, as in the agent
                follower.settle(patience=max(0.0, deadline - time.monotonic()))
        scan = self._scan(final=True)
        return report(
            self.run_dir, self.sink_names, unwritten=stats.unwritten + len(stats.unencodable), notes=notes, cause=cause, scan=scan
        )

    # -- how a run shows itself ------------------------------------------------------------------
    def _opening_line(self) -> str:
        trackers = ", ".join(self.sink_names) or "none"
        if self.resumed:
            return f"rllog: resuming run {self.info.name!r} (attempt {self.attempt}) in {self.run_dir} (trackers: {trackers})"
        return f"rllog: run {self.info.name!r} logs to {self.run_dir} (trackers: {trackers})"

    def _state(self) -> str:
        if self._forked:
            return f"started in process {self._pid}"
        if self._finished is not None:
            return "finished, all delivered" if self._finished.ok else "finished, not all delivered"
        return "finishing" if self._finishing is not None else "live"

    def __repr__(self) -> str:
        return (
            f"<rllog.Run {self.info.name!r} id={self.run_id} step={self._step} {self._state()} "
            f"trackers=[{', '.join(self.sink_names)}] dir={self.run_dir}>"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # IPython's plain display
        printer.text(repr(self))

    def _repr_html_(self) -> str:
        rows = {
            "name": self.info.name,
            "id": self.run_id,
            "project": self.info.project,
            "state": self._state(),
            "step": str(self._step),
            "trackers": ", ".join(self.sink_names) or "none",
            "directory": str(self.run_dir),
        }
        return html_table("rllog.Run", rows)

    def __reduce__(self) -> Any:
        """A run lives in the process that started it: sending it to another process (a spawn or forkserver worker
        pickles what it is given) would give that process a run with no journal writer."""
        raise ForkedChild(
            f"run {self.info.name!r} cannot be sent to another process (pickled, e.g. as a multiprocessing argument): "
            f"log from the process that started it (pid {self._pid}); return the values from the worker "
            f"and log them there ({WORKERS_DOC})"
        )

    # -- internals -------------------------------------------------------------------------------
    def _wake_asked_followers(self, written_seq: int) -> None:
        """Wake the in-process followers for a :meth:`request_flush` whose records the journal now holds."""
        wanted = self._wake_at
        if wanted and written_seq >= wanted:
            self._wake_at = 0
            for follower in self._followers:
                follower.wake()

    def _scan(self, final: bool = False) -> journal.JournalScan:
        """The journal's scan, brought up to date (verifying only what was written since the last call); ``final``
        (at ``finish``: no more writes) reads a torn tail as such and closes the scanner."""
        with self._scan_lock:
            if self._scanner is None:
                self._scanner = journal.Scanner(self.run_dir)
            scan = self._scanner.update(final=final)
            if final:
                self._scanner.close()
            return scan

    def _check_health(self, entries: list[PendingMetrics]) -> None:
        """On the journal writer thread: run the health rules, journal and log what they raise."""
        logged = [(entry.step, entry.values) for entry in entries]
        observe_many = getattr(self._monitor, "observe_many", None)
        if observe_many is not None:
            drafts = observe_many(logged)
        else:  # a monitor of the user's with only observe
            from rllog.health import observe_each

            drafts = observe_each(self._monitor, logged)
        for draft in drafts:

            def alert(seq: int, at: int, now: float, draft: Any = draft) -> AlertRecord:
                return AlertRecord(seq, at, now, draft.rule, draft.metric, float(draft.value), draft.message, draft.level)

            self._append(alert, (), draft.step, WRITER)
            log.log(
                logging.ERROR if draft.level == "error" else logging.WARNING,
                "rllog alert [%s] step %d: %s",
                draft.rule,
                draft.step,
                draft.message,
            )

    def _wait_for_journal(self) -> None:
        """Backpressure: the writer is ``max_pending`` records behind (a stalled or full disk); wait rather than drop."""
        if not self._backpressure_warned:
            self._backpressure_warned = True
            log.warning(
                "rllog: the journal writer is %d records behind; log() waits for it (nothing is dropped)", self._writer.backlog
            )
        self._writer.wake()
        while self._writer.backlog > self.max_pending // 2 and self._writer.alive:
            time.sleep(0.001)

    def _check_open(self) -> None:
        if self._forked:
            raise ForkedChild(
                f"run {self.info.name!r} was started in process {self._pid}; this is a forked child ({os.getpid()}): "
                f"log from the parent process (return the values to it; {WORKERS_DOC})"
            )
        if self._finishing is not None:
            raise RunFinished(f"run {self.info.name!r} has finished; start a new one with rllog.init()")

    @staticmethod
    def _object_names(objects: list) -> list[str]:
        names: list[str] = []
        for obj in objects:
            base = str(getattr(obj, "name", None) or type(obj).__name__).lower()
            name, n = base, 1
            while name in names:
                n += 1
                name = f"{base}-{n}"
            names.append(name)
        return names

    def _follower(self, name: str, sink: Any) -> Any:
        return delivery_link.follower(name, sink, self.info, self.flush_interval, self.retry)

    def _run_file(self) -> RunFile:
        return RunFile(
            project=self.info.project,
            name=self.info.name,
            run_id=self.info.run_id,
            config=dict(self.info.config),
            tags=list(self.info.tags),
            flush_interval=self.flush_interval,
            retry=self.retry.as_dict(),
            sinks=[SinkSpec(n, redact(self._options.get(n, {}))) for n in self._named],
            pid=os.getpid(),
            started=self._attempts[0]["started"],
            attempts=self._attempts,
            program=self.info.program,
            args=list(self.info.args),
        )
