"""The user-facing run: ``log``, ``log_table``, ``finish``.

The hot path (``log``/``log_table``) validates, stamps a sequence number, a step and the time, and
hands the record to the journal writer: no tracker call, no disk wait. Everything after that (tracker
imports, ``init`` calls, writes, retries) happens in the delivery agent process
(:class:`rllog.agent.AgentProcess`), or in follower threads with ``delivery="thread"``. The run
directory's files and the report are :mod:`rllog.rundir`'s.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import os
import secrets
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rllog import distributed, journal, settings
from rllog.delivery import CursorStore, Follower, RetryPolicy
from rllog.errors import ForkedChild, InvalidArgument, RunDirError, RunFinished
from rllog.journal import JournalWriter, PendingMetrics
from rllog.records import STATUSES, AlertRecord, ConfigRecord, RunInfo, TableRecord
from rllog.registry import parse_report_to
from rllog.rundir import (
    FinishReport,
    RunFile,
    RunLock,
    SinkReport,
    SinkSpec,
    claim,
    default_run_dir,
    find_run,
    holds_run,
    load_run_info,
    report,
)
from rllog.settings import (
    FLUSH_FAST_POLL_FOR,
    FLUSH_POLL_SECONDS,
    FLUSH_SLOW_POLL_SECONDS,
    JOURNAL_WRITE_INTERVAL,
    SIGTERM_FINISH_SECONDS,
    SIGTERM_JOIN_MARGIN_SECONDS,
    SIGTERM_LOCK_PROBE_SECONDS,
    SIGTERM_RESEND_SECONDS,
    SIGTERM_RESENDS,
    STOP_GRACE_SECONDS,
    SYSTEM_METRICS_INTERVAL,
)
from rllog.values import (
    TableSchemas,
    check_step,
    flatten_config,
    normalise_metrics,
    redact,
    redact_args,
    stack_scalars,
    to_arrow_table,
)

__all__ = ["FinishReport", "NullRun", "Run", "SinkReport", "load_run_info", "report"]

log = logging.getLogger("rllog")


def _to_host(tensors: dict[str, Any]) -> dict[str, float]:
    """One-element tensors -> floats with one device-to-host copy."""
    if not tensors:
        return {}
    return dict(zip(tensors, stack_scalars(list(tensors.values())).tolist(), strict=True))


class RunBase:
    """What every rank's run object shares: validation, the collectives of a multi-process run, and the lifecycle."""

    _distributed = False
    _takes_tables = True
    sink_names: list[str]

    def __init__(self, reduce_across_ranks: bool | None) -> None:
        # None: reduce when torch.distributed is up. False: only this process logs (a trainer that
        # already reduced its metrics, like the HF/TRL integration, logs from the main process alone).
        self._distributed = distributed.is_distributed() if reduce_across_ranks is None else reduce_across_ranks
        if self._distributed:
            distributed.reset()  # every rank creates its run object: a new run forgets the old run's keys
        self._step = -1
        self._finished: FinishReport | None = None
        self._table_schemas = TableSchemas()  # a column's type may change between calls only as documented

    def _prepare_metrics(self, values: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
        floats, tensors = normalise_metrics(values)
        if self._distributed:  # a collective: same call on every rank
            floats = distributed.reduce_metrics(floats | _to_host(tensors))
            tensors = {}
        return floats, tensors

    def _prepare_table(self, name: str, table: Any) -> Any:
        arrow = to_arrow_table(name, table)
        if self._distributed and self._takes_tables:
            rows = distributed.gather_rows(arrow.to_pylist())
            arrow = to_arrow_table(name, rows) if rows is not None else None
        return None if arrow is None else self._table_schemas.check(name, arrow)

    @property
    def step(self) -> int:
        """The step of the last logged metrics (-1 before the first)."""
        return self._step

    @property
    def finished(self) -> bool:
        return self._finished is not None

    def finish(self, status: str = "finished", timeout: float = 120.0) -> FinishReport:
        raise NotImplementedError

    def __enter__(self) -> RunBase:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.finish("failed" if exc_type is not None else "finished")


class NullRun(RunBase):
    """What ranks other than global rank 0 get from :func:`rllog.init`: same calls, no trackers, no files.

    It validates like a real run and takes part in the cross-rank reduction, so user code never
    branches on rank.
    """

    def __init__(self, report_to: Any = None, reduce_across_ranks: bool | None = None, **kwargs: Any):
        super().__init__(reduce_across_ranks)
        self._takes_tables = _takes_tables(parse_report_to(report_to))
        self.run_dir: None = None
        self.sink_names = []

    def log(self, values: Mapping[str, Any], step: int | None = None) -> None:
        if self._finished is not None:
            raise RunFinished("this run has finished")
        self._prepare_metrics(values)
        self._step = self._step + 1 if step is None else check_step(step)

    def log_table(self, name: str, table: Any, step: int | None = None) -> None:
        if self._finished is not None:
            raise RunFinished("this run has finished")
        self._prepare_table(name, table)

    def update_config(self, values: Any) -> None:
        flatten_config(values, keep_lists=True)  # validated like the real run's

    def flush(self, timeout: float = 60.0) -> FinishReport:
        return FinishReport()

    def request_flush(self, at_once: bool = False) -> None:
        pass

    def finish(self, status: str = "finished", timeout: float = 120.0) -> FinishReport:
        self._finished = self._finished or FinishReport()
        return self._finished


def _takes_tables(selected: list) -> bool:
    """Whether any selected sink stores tables (checked from the sink classes; no tracker is imported)."""
    from rllog import registry

    for item in selected:
        cls = registry.resolve(item).load() if isinstance(item, str) else item
        if getattr(getattr(cls, "capabilities", None), "tables", False):
            return True
    return False


# "continue": as "must", for a run finished cleanly and reopened by the same trainer (a later evaluate() or
# Lightning stage): the attempt carries on from where the run stopped, so it supersedes nothing of the earlier ones.
RESUME_MODES = ("allow", "must", "never", "continue")
SYSTEM_METRICS_ENV = settings.SYSTEM_METRICS.name


def system_interval(system_metrics: bool | float | None) -> float | None:
    """Seconds between samples of the trainer's system metrics, or None for none (``None``: ``$RLLOG_SYSTEM_METRICS``).

    Raises:
        InvalidArgument: ``system_metrics`` is not a switch or an interval.
        InvalidSetting: ``$RLLOG_SYSTEM_METRICS`` is not one either.
    """
    if system_metrics is None:
        system_metrics = settings.SYSTEM_METRICS.get()
    if system_metrics is True:
        return SYSTEM_METRICS_INTERVAL
    if system_metrics is False or system_metrics is None:
        return None
    if isinstance(system_metrics, (int, float)) and math.isfinite(system_metrics) and system_metrics > 0:
        return float(system_metrics)
    raise InvalidArgument(f"system_metrics must be True, False or a sampling interval in seconds, got {system_metrics!r}")


def _check_resume(resume: Any, run_id: Any) -> str:
    """``None`` is ``"never"``, unless a ``run_id`` is given: naming a run's id means continuing it if it exists."""
    if resume is None:
        resume = "allow" if run_id is not None else "never"
    if resume not in RESUME_MODES:
        raise InvalidArgument(f"resume must be one of {RESUME_MODES} (or None), got {resume!r}")
    if run_id is not None and (not isinstance(run_id, str) or not run_id or not all(c.isalnum() or c in "-_." for c in run_id)):
        raise InvalidArgument(f"run_id must be a non-empty string of letters, digits, '-', '_' and '.', got {run_id!r}")
    return resume


def _check_options(flush_interval: Any, max_pending: Any, delivery: Any) -> float:
    if delivery not in ("process", "thread"):
        raise InvalidArgument(f"delivery must be 'process' or 'thread', got {delivery!r}")
    if (
        isinstance(flush_interval, bool)
        or not isinstance(flush_interval, (int, float))
        or not math.isfinite(flush_interval)
        or not 0 < flush_interval <= 3600
    ):
        raise InvalidArgument(f"flush_interval must be a number of seconds in (0, 3600], got {flush_interval!r}")
    if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
        raise InvalidArgument(f"max_pending must be a positive int, got {max_pending!r}")
    return float(flush_interval)


class Run(RunBase):
    """One training run. Create it with :func:`rllog.init`.

    Args:
        flush_interval: seconds. Every record reaches the journal (the OS) within half of it (at most
            :data:`JOURNAL_WRITE_INTERVAL`), and every sink is flushed (its cursor moved) at least this often
            while records flow; ``flush()`` asks for a flush at once.

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
        retry: RetryPolicy | None = None,
        health: Any = True,
        max_pending: int = 100_000,
        reduce_across_ranks: bool | None = None,
        run_id: str | None = None,
        resume: str | None = None,
        system_metrics: bool | float | None = None,
    ):
        self.flush_interval = _check_options(flush_interval, max_pending, delivery)
        resume = _check_resume(resume, run_id)
        interval = None
        if delivery == "process":  # the agent's settings, checked before the run directory is claimed
            interval = system_interval(system_metrics)
            settings.check_agent_settings()
        selected = parse_report_to(report_to)
        super().__init__(reduce_across_ranks)
        self._takes_tables = _takes_tables(selected) if self._distributed else True
        existing = (
            Path(run_dir)
            if run_dir is not None and holds_run(Path(run_dir))
            else (find_run(run_id) if run_id and run_dir is None else None)
        )
        self.resumed = existing is not None and resume != "never"
        if resume in ("must", "continue") and not self.resumed:
            raise RunDirError(
                f"resume={resume!r} but there is no run to resume ({'run_dir ' + str(run_dir) if run_dir else 'run_id ' + str(run_id)})"
            )
        next_seq, attempts, config_flat = 1, [], flatten_config(config, keep_lists=True)
        if self.resumed:
            assert existing is not None
            self.run_dir = existing.resolve()
            self._run_lock = RunLock(self.run_dir).acquire(f"cannot resume {self.run_dir}")
            previous = RunFile.read(self.run_dir)
            if run_id is not None and run_id != previous.run_id:
                self._run_lock.release()
                raise RunDirError(f"{self.run_dir} holds run {previous.run_id!r}, not {run_id!r}")
            project, name, run_id, tags = previous.project, previous.name, previous.run_id, tuple(tags) or tuple(previous.tags)
            config_flat = {**previous.config, **config_flat}
            attempts = list(previous.attempts) or [
                {"attempt": 1, "first_seq": 1, "started": previous.started, "pid": previous.pid}
            ]
            next_seq = _resumed_first_seq(self.run_dir)
            self._step = journal.last_step(self.run_dir)
        else:
            run_id = run_id or secrets.token_hex(8)
            self.run_dir = claim(Path(run_dir) if run_dir is not None else default_run_dir(name, run_id))
            self._run_lock = RunLock(self.run_dir).acquire(f"cannot start a run in {self.run_dir}")
        self.attempt = len(attempts) + 1
        self._attempts = [*attempts, {"attempt": self.attempt, "first_seq": next_seq, "started": time.time(), "pid": os.getpid()}]
        if resume == "continue":
            self._attempts[-1]["continues"] = True
        self.info = RunInfo(
            project,
            name or f"run-{run_id}",
            str(self.run_dir),
            run_id,
            config_flat,
            tuple(tags),
            attempt_starts=tuple(a["first_seq"] for a in self._attempts),
            continuing_starts=tuple(a["first_seq"] for a in self._attempts if a.get("continues")),
            program=_program(),
            args=redact_args(sys.argv[1:]),
        )
        self.delivery = delivery
        self.retry = retry or RetryPolicy()
        from rllog.registry import resolve

        options = {resolve(k).name: dict(v) for k, v in (backend_options or {}).items()}  # "comet" -> "comet_ml"
        # Names go to the agent process (or to threads); sink objects are always delivered in-process.
        self._named = [s for s in selected if isinstance(s, str)]
        self._objects = [s for s in selected if not isinstance(s, str)]
        self.sink_names = list(self._named) + self._object_names(self._objects)
        self._options = options
        self._run_file(options).write(self.run_dir)
        self.max_pending = max_pending
        self._backpressure_warned = False
        self._monitor = _health_monitor(health)
        self._wake_at = 0  # a flush request's seq: in-process followers are woken once the journal holds it
        self._followers: list[Follower] = []
        self._writer = JournalWriter(
            self.run_dir,
            min(self.flush_interval / 2, JOURNAL_WRITE_INTERVAL),
            next_seq=next_seq,
            on_written=self._check_health if self._monitor else None,
            on_landed=self._wake_followers_if_asked,
        )
        self._lock = threading.Lock()
        self._scan_lock = threading.Lock()
        self._scanner: journal.Scanner | None = None  # see _scan
        self._seq = next_seq - 1
        self._finishing: threading.Event | None = None
        self._finisher: int | None = None  # the thread that called finish() first
        self._forked = False
        self._pid = os.getpid()
        # Where an omitted step comes from when a trainer owns the step (set by the HF/TRL integration).
        self.step_source: Callable[[], int] | None = None
        self._agent = None
        if self._named and delivery == "process":
            from rllog.agent import AgentProcess

            self._agent = AgentProcess(
                self.run_dir,
                {n: options.get(n, {}) for n in self._named},
                sink_names=self._named,
                system_interval=interval,
                on_system=self._log_system,
            ).start()
        else:
            self._followers += [self._follower(n, _factory(n, options.get(n))) for n in self._named]
        self._followers += [self._follower(n, s) for n, s in zip(self.sink_names[len(self._named) :], self._objects, strict=True)]
        for follower in self._followers:
            follower.start()
        _live_runs.add(self)
        _install_sigterm_handler()

    # -- the hot path ----------------------------------------------------------------------------
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
        if step is not None:
            step = check_step(step)
        now = time.time()
        with self._lock:
            self._check_open()
            self._seq += 1
            if step is None:
                step = self.step_source() if self.step_source is not None else self._step + 1
            self._step = step
            self._writer.append(PendingMetrics(self._seq, step, now, floats, tuple(tensors), stacked))
        if self._writer.backlog > self.max_pending:
            self._wait_for_journal()

    def log_table(self, name: str, table: Any, step: int | None = None) -> None:
        """Log a table (e.g. completions) at ``step`` (default: the step of the last ``log``).

        ``table`` may be a dict of equal-length columns, a list of row dicts, a ``pyarrow.Table`` or a
        pandas DataFrame.

        Raises:
            InvalidTable: ragged columns (names each column's length), a column type no tracker can
                store, or a column whose type changed since an earlier call with this name.
        """
        arrow = self._prepare_table(name, table)
        if step is not None:
            step = check_step(step)
        now = time.time()
        with self._lock:
            self._check_open()
            self._seq += 1
            if step is None:
                step = self.step_source() if self.step_source is not None else max(self._step, 0)
            self._writer.append(TableRecord(self._seq, step, now, name, arrow))
        if self._writer.backlog > self.max_pending:
            self._wait_for_journal()

    def _log_system(self, sample: dict[str, Any]) -> None:
        """A sample of the trainer's system metrics, taken by the agent: journaled at the trainer's current step."""
        values = {k: float(v) for k, v in sample["values"].items()}
        with self._lock:
            if self._finishing is not None or self._forked:
                return
            self._seq += 1
            self._writer.append(PendingMetrics(self._seq, max(self._step, 0), float(sample["time"]), values))

    def update_config(self, values: Any) -> None:
        """Add or change hyperparameters after ``init`` (accelerate and Lightning hand config over late).

        ``values`` is flattened and redacted like ``init``'s ``config`` and journaled; every sink that
        takes config records it (MLflow params, wandb config, parquet's run file, ...).
        """
        flat = flatten_config(values, keep_lists=True)
        now = time.time()
        with self._lock:
            self._check_open()
            self._seq += 1
            self._writer.append(ConfigRecord(self._seq, max(self._step, 0), now, flat))
            # a sink opened again (agent restart, replay, resume) starts from the config as it is now
            self.info = dataclasses.replace(self.info, config={**self.info.config, **flat})
        self._run_file(self._options).write(self.run_dir)

    def flush(self, timeout: float = 60.0) -> FinishReport:
        """Block until every record logged before the call is written and flushed in every healthy sink.

        Returns a report like ``finish``'s, on those records: ``delivered`` for a sink that holds them
        all. A failed sink is not waited for; one still behind at ``timeout`` is reported ``pending``.
        """
        with self._lock:
            self._check_open()
            target = self._seq
        started = time.monotonic()
        deadline = started + timeout
        self._writer.wake()
        self._writer.wait_written(target, timeout)
        from rllog.delivery import CursorStore, SinkState

        self._ask_flush(target)
        stores = [CursorStore(self.run_dir, n) for n in self.sink_names]
        while time.monotonic() < deadline:
            cursors = [store.load() for store in stores]
            if all(c.seq >= target or c.state in SinkState.BROKEN for c in cursors):
                break
            fast = time.monotonic() - started < FLUSH_FAST_POLL_FOR
            time.sleep(FLUSH_POLL_SECONDS if fast else FLUSH_SLOW_POLL_SECONDS)  # a train() ends with this wait
        return report(self.run_dir, self.sink_names, upto=target, scan=self._scan())

    def request_flush(self, at_once: bool = False) -> None:
        """Ask every sink to flush what was logged so far soon, without waiting: a later :meth:`flush` then waits
        for less. The Hugging Face integration asks ``at_once`` as ``train()`` and ``evaluate()`` end, and returns.
        A sink is flushed at most every :data:`rllog.delivery.ASKED_FLUSH_MIN_GAP` for these requests (a flush per
        step cost the agent more than it saved), unless ``at_once``; its follower reads the journal at once, and
        again every :data:`rllog.delivery.POLL_INTERVAL` until the records land.

        The journal writer is woken last: woken first, it took the GIL from the training thread while this call
        wrote the request (1-5 ms a call in a 60-step GRPO run, against 0.5 ms now). The agent looks at the request
        every 10 ms."""
        with self._lock:
            self._check_open()
            target = self._seq
        # In-process followers (delivery="thread", sink objects) woken now would read before the writer wrote the
        # records and honour the request only at their next poll: the writer wakes them once they are written.
        self._wake_at = target
        self._ask_flush(target, wake_followers=False, soon=not at_once)
        self._writer.wake()
        self._wake_followers_if_asked(self._writer.written_seq)  # written already (the writer's last tick)

    def _ask_flush(self, target: int, quiet: bool = False, wake_followers: bool = True, soon: bool = False) -> None:
        """Ask the followers (the agent's through the request file) to read the journal now and flush up to ``target``
        (``soon``: nobody waits; see :func:`rllog.delivery.request_flush`)."""
        from rllog.delivery import request_flush

        if wake_followers:
            for follower in self._followers:
                follower.wake()
        try:
            request_flush(self.run_dir, target, soon=soon)
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
        from any thread, returns the same report (a second caller waits for the first).
        """
        if status not in STATUSES:
            raise InvalidArgument(f"status must be one of {STATUSES}, got {status!r}")
        if self._forked:
            raise ForkedChild("finish() called in a forked child process; finish the run in the process that started it")
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
            _live_runs.discard(self)
            self._run_lock.release()
            finishing.set()
            _act_on_deferred_sigterm()
        if not self._finished.ok:
            log.warning("rllog: run %s finished with undelivered records:\n%s", self.run_dir, self._finished)
        return self._finished

    def _finish(self, status: str, deadline: float) -> FinishReport:
        self._writer.close(status, timeout=max(0.0, deadline - time.monotonic()))
        self._ask_flush(self._seq, quiet=True)  # the followers read the end marker now, not at their next poll
        notes, cause = [], None
        stats = self._writer.stats
        if stats.unwritten or stats.unencodable:
            lost = stats.unwritten + len(stats.unencodable)
            why = f"the journal could not be written ({self._writer.error})" if stats.unwritten else "they could not be encoded"
            cause = f"{lost} records never reached the journal: {why}; they are lost"
            notes.append(f"journal: {cause}")
        if self._agent is not None:
            self._agent.wait_while_alive(deadline)
            if not self._agent.stop(deadline):
                notes.append("the delivery agent was stopped at the finish deadline")
            cause = cause or self._agent.cause
            if self._agent.restarts:
                notes.append(f"the delivery agent was restarted {self._agent.restarts} times")
        for follower in self._followers:
            if not follower.join(max(0.0, deadline - time.monotonic())):
                follower.stop()  # one retrying wakes, keeps what its sink holds and saves its cursor: a moment
                follower.join(STOP_GRACE_SECONDS)
            else:  # in this process nobody restarts a follower: one that ended while running says so, as in the agent
                follower.settle(patience=max(0.0, deadline - time.monotonic()))
        scan = self._scan(final=True)
        return report(
            self.run_dir, self.sink_names, unwritten=stats.unwritten + len(stats.unencodable), notes=notes, cause=cause, scan=scan
        )

    # -- internals -------------------------------------------------------------------------------
    def _wake_followers_if_asked(self, written_seq: int) -> None:
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
        for entry in entries:
            for draft in self._monitor.observe(entry.step, entry.values):
                with self._lock:
                    self._seq += 1
                    alert = AlertRecord(
                        self._seq,
                        draft.step,
                        time.time(),
                        draft.rule,
                        draft.metric,
                        float(draft.value),
                        draft.message,
                        draft.level,
                    )
                    self._writer.append(alert)
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
                "log from the parent process (return the values to it)"
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

    def _follower(self, name: str, sink: Any) -> Follower:
        from rllog.delivery import live_poll_interval

        return Follower(
            name,
            sink,
            self.info,
            follow=True,
            flush_interval=self.flush_interval,
            poll_interval=live_poll_interval(self.flush_interval),
            retry=self.retry,
        )

    def _run_file(self, options: dict | None = None) -> RunFile:
        options = options or {}
        return RunFile(
            project=self.info.project,
            name=self.info.name,
            run_id=self.info.run_id,
            config=dict(self.info.config),
            tags=list(self.info.tags),
            flush_interval=self.flush_interval,
            retry=self.retry.as_dict(),
            sinks=[SinkSpec(n, redact(options.get(n, {}))) for n in self._named],
            pid=os.getpid(),
            started=self._attempts[0]["started"],
            attempts=self._attempts,
            program=self.info.program,
            args=list(self.info.args),
        )


def _resumed_first_seq(run_dir: Path) -> int:
    """The first seq of a resumed attempt: past every record the journal holds and every one a sink's cursor has
    passed. A delivered last frame damaged since (bit rot, a power cut after the agent read it from the page cache)
    is not readable, so counting readable frames alone gave its seq to the attempt's first record, which every sink
    then skipped as delivered, the report saying so."""
    last = journal.scan(run_dir).last_seq
    for name in CursorStore.names(run_dir):
        cursor = CursorStore(run_dir, name).load()
        last = max(last, cursor.seq, *cursor.ahead)
    return last + 1


def _program() -> str:
    """The trainer's program as a user would name it: the script, or ``-m module`` / ``-c``."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return f"-m {spec.name.removesuffix('.__main__')}"
    return sys.argv[0] if sys.argv and sys.argv[0] else "<python>"


def _health_monitor(health: Any) -> Any:
    """``True``: the default rules; ``False``/None: none; a dict: ``HealthMonitor(**health)``; else a monitor object."""
    if health is False or health is None:
        return None
    if health is True or isinstance(health, Mapping):
        from rllog.health import HealthMonitor

        return HealthMonitor(**(health if isinstance(health, Mapping) else {}))
    return health


def _factory(name: str, options: Mapping[str, Any] | None) -> Callable[[], Any]:
    from rllog import registry

    return lambda: registry.create(name, dict(options or {}))


_live_runs: weakref.WeakSet[Run] = weakref.WeakSet()
_previous_sigterm: Any = None
_handling_sigterm = False
_deferred_sigterm: tuple[int, Any] | None = None  # a SIGTERM that interrupted the main thread's own finish()
_sigterm_resends = 0


def _after_fork_in_child() -> None:
    """A forked child shares no writer thread with its parent's runs: their log() raises there, and the
    child's exit finishes nothing (the parent does). Each run gets new locks: one that another thread of the
    parent held at the fork would stay held in the child, where no thread will release it."""
    global _deferred_sigterm
    for run in list(_live_runs):
        run._forked = True
        run._lock = threading.Lock()
        run._scan_lock = threading.Lock()
    _live_runs.clear()
    _deferred_sigterm = None
    _restore_sigterm()


def _restore_sigterm() -> None:
    """Give a forked child back the SIGTERM handler it had before rllog: it has no run to finish. A Python-level
    handler also makes SIGTERM miss a process that blocks in C just as the signal lands (the handler runs only
    when the blocking call returns): a ``multiprocessing`` pool worker waiting for a task then never exits, and
    ``Pool.terminate()`` (the end of ``with Pool(...)``) waited forever (measured: 1 in 12 to 1 in 40 runs of a
    trainer with a pool, under CPU load)."""
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, _previous_sigterm if _previous_sigterm is not None else signal.SIG_DFL)
    except (ValueError, TypeError, OSError):  # not the main thread, or a handler Python cannot set back
        pass


os.register_at_fork(after_in_child=_after_fork_in_child)


def _on_sigterm(signum: int, frame: Any) -> None:
    """Finish every live run as ``killed``, then hand the signal to whoever had it before.

    Python runs this on the main thread between two steps of whatever that thread was doing, so it must not wait
    for what that code holds (it would wait for itself):

    - a SIGTERM that interrupts this thread's own ``finish`` is acted on when that ``finish`` ends;
    - one that lands while this thread holds a run's lock (inside ``log`` or ``flush``) is sent again
      :data:`SIGTERM_RESEND_SECONDS` later, at most :data:`SIGTERM_RESENDS` times (then the runs it cannot
      finish are left to the journal and ``rllog replay``);
    - the runs are finished on another thread, waited for at most :data:`SIGTERM_FINISH_SECONDS` each (plus
      a margin), so a lock held by the interrupted code that nobody foresaw costs that wait, not a hang;
    - a second SIGTERM while the first is handled changes nothing (the first is passed on at the end).
    """
    global _deferred_sigterm, _handling_sigterm, _sigterm_resends
    if _handling_sigterm:
        return
    runs = list(_live_runs)
    me = threading.get_ident()
    if any(run._finisher == me and not run.finished for run in runs):
        _deferred_sigterm = (signum, frame)
        return
    held = [run for run in runs if not (_lock_is_free(run._lock) and _lock_is_free(run._scan_lock))]
    if held and _sigterm_resends < SIGTERM_RESENDS:
        _sigterm_resends += 1
        resend = threading.Timer(SIGTERM_RESEND_SECONDS, os.kill, (os.getpid(), signum))
        resend.daemon = True
        resend.start()
        return
    for run in held:
        log.error("rllog: run %s not finished on SIGTERM (its lock stayed held); `rllog replay` delivers it", run.run_dir)
    free = [run for run in runs if run not in held]
    _handling_sigterm = True
    try:
        worker = threading.Thread(target=_finish_as_killed, args=(free,), name="rllog-sigterm", daemon=True)
        worker.start()
        worker.join(SIGTERM_FINISH_SECONDS * len(free) + SIGTERM_JOIN_MARGIN_SECONDS)
        if worker.is_alive():
            log.error("rllog: finishing the runs on SIGTERM took too long; what is pending stays in their journals")
    finally:
        _handling_sigterm = False
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:  # the default action: die of SIGTERM, as the sender expects
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _finish_as_killed(runs: list[Run]) -> None:
    for run in runs:
        try:
            run.finish("killed", timeout=SIGTERM_FINISH_SECONDS)
        except Exception as exc:
            log.error("rllog: finishing %s on SIGTERM failed: %s", run.run_dir, exc)


def _lock_is_free(lock: Any) -> bool:
    """Whether ``lock`` can be taken within :data:`SIGTERM_LOCK_PROBE_SECONDS` (it is released at once)."""
    if lock.acquire(timeout=SIGTERM_LOCK_PROBE_SECONDS):
        lock.release()
        return True
    return False


def _act_on_deferred_sigterm() -> None:
    """Handle a SIGTERM that interrupted the main thread's own ``finish``, now that it has ended."""
    global _deferred_sigterm
    if _deferred_sigterm is None or threading.current_thread() is not threading.main_thread():
        return
    deferred, _deferred_sigterm = _deferred_sigterm, None
    _on_sigterm(*deferred)


def _install_sigterm_handler() -> None:
    """Chain onto SIGTERM once, from the main thread (signal handlers can only be set there)."""
    global _previous_sigterm
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is _on_sigterm:
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN:
        return  # the process chose to survive SIGTERM; so do we
    _previous_sigterm = previous
    signal.signal(signal.SIGTERM, _on_sigterm)


@atexit.register
def _finish_live_runs() -> None:
    """Finish runs the user did not finish: ``failed`` after an uncaught exception, else ``finished``."""
    status = "failed" if getattr(sys, "last_type", None) is not None else "finished"
    for run in list(_live_runs):
        try:
            run.finish(status)
        except Exception as exc:  # at exit there is no caller left to raise to
            log.error("rllog: finishing %s at exit failed: %s", run.run_dir, exc)
