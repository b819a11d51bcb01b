"""The user-facing ``Run``: ``log``, ``log_table``, ``finish``.

The hot path (``log``/``log_table``) validates, stamps a sequence number, a step and the time, and
hands the record to the journal writer: no tracker call, no disk wait. Everything after that (tracker
imports, ``init`` calls, writes, retries) happens in the delivery agent process, or in follower threads
with ``delivery="thread"``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from rllog import distributed
from rllog import journal as journal_mod
from rllog.delivery import CLOSED, Follower, RetryPolicy
from rllog.errors import InvalidStep, RunDirError, RunFinished
from rllog.journal import JournalWriter, PendingMetrics
from rllog.records import STATUSES, AlertRecord, RunInfo, TableRecord
from rllog.registry import parse_report_to
from rllog.values import flatten_config, normalise_metrics, stack_scalars, to_arrow_table

log = logging.getLogger("rllog")

RUN_FILE = "run.json"  # RunInfo + the sinks the agent must serve


@dataclass(frozen=True)
class SinkReport:
    """How far one sink got: ``state`` is ``delivered``, ``pending`` or ``failed``."""

    name: str
    state: str
    delivered: int
    pending: int
    error: str | None = None


class FinishReport(dict):
    """``Run.finish``'s result: sink name -> :class:`SinkReport`; ``ok`` when every sink has everything."""

    @property
    def ok(self) -> bool:
        return all(r.state == "delivered" for r in self.values())

    def __str__(self) -> str:
        lines = [f"{r.name}: {r.state} ({r.delivered} delivered, {r.pending} pending)" + (f": {r.error}" if r.error else "") for r in self.values()]
        return "\n".join(lines) or "no sinks"


def _check_step(step: Any) -> int:
    if type(step) is int and step >= 0:
        return step
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise InvalidStep(f"step must be a non-negative int, got {type(step).__name__}: {step!r}")
    step = step.__index__()  # numpy integers
    if step < 0:
        raise InvalidStep(f"step must be a non-negative int, got {step}")
    return step


def default_run_dir(name: str, run_id: str) -> Path:
    base = Path(os.environ.get("RLLOG_DIR", "rllog_runs"))
    return base / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-{run_id}"


def report(run_dir: str | os.PathLike, sink_names: list[str] | None = None) -> FinishReport:
    """Delivery state of every sink of ``run_dir``, read from the journal and the cursor files."""
    run_dir = Path(run_dir)
    total = journal_mod.last_seq(run_dir)
    if sink_names is None:
        sink_names = sorted(p.stem for p in (run_dir / "delivery").glob("*.json"))
    result = FinishReport()
    for name in sink_names:
        try:
            saved = json.loads((run_dir / "delivery" / f"{name}.json").read_text())
        except (FileNotFoundError, ValueError):
            saved = {"seq": 0, "state": "waiting", "error": None}
        delivered = saved.get("seq", 0) + len(saved.get("ahead", ()))  # ahead: delivered past a batch that failed midway
        pending = max(0, total - delivered)
        if saved.get("state") in ("failed", "gave_up"):
            state = "failed"
        elif pending == 0 and saved.get("state") == CLOSED:
            state = "delivered"
        else:
            state = "pending"
        error = saved.get("error") or (None if state != "pending" else "not delivered before the deadline; run `rllog replay`")
        result[name] = SinkReport(name, state, delivered, pending, error)
    return result


def _to_host(tensors: dict[str, Any]) -> dict[str, float]:
    """One-element tensors -> floats with one device-to-host copy."""
    if not tensors:
        return {}
    return dict(zip(tensors, stack_scalars(list(tensors.values())).tolist()))


class _Prepare:
    """Validation shared by every rank's run object, and the collectives of a multi-process run."""

    _distributed = False
    _takes_tables = True

    def _set_reduction(self, reduce_across_ranks: bool | None) -> None:
        # None: reduce when torch.distributed is up. False: only this process logs (a trainer that
        # already reduced its metrics, like the HF/TRL integration, logs from the main process alone).
        self._distributed = distributed.is_distributed() if reduce_across_ranks is None else reduce_across_ranks
        if self._distributed:
            distributed.reset()  # every rank creates its run object: a new run forgets the old run's keys

    def _prepare_metrics(self, values: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
        floats, tensors = normalise_metrics(values)
        if self._distributed:  # a collective: same call on every rank
            floats = distributed.reduce_metrics(floats | _to_host(tensors))
            tensors = {}
        return floats, tensors

    def _prepare_table(self, name: str, table: Any):
        arrow = to_arrow_table(name, table)
        if self._distributed and self._takes_tables:
            rows = distributed.gather_rows(arrow.to_pylist())
            arrow = to_arrow_table(name, rows) if rows is not None else None
        return arrow


class NullRun(_Prepare):
    """What ranks other than global rank 0 get from :func:`rllog.init`: same calls, no trackers, no files.

    It validates like a real run and takes part in the cross-rank reduction, so user code never
    branches on rank.
    """

    def __init__(self, report_to: Any = None, reduce_across_ranks: bool | None = None, **kwargs: Any):
        self._set_reduction(reduce_across_ranks)
        self._takes_tables = _takes_tables(parse_report_to(report_to))
        self.run_dir = None
        self.sink_names: list[str] = []
        self._step = -1
        self._finished: FinishReport | None = None

    def log(self, values: Mapping[str, Any], step: int | None = None) -> None:
        if self._finished is not None:
            raise RunFinished("this run has finished")
        self._prepare_metrics(values)
        self._step = self._step + 1 if step is None else _check_step(step)

    def log_table(self, name: str, table: Any, step: int | None = None) -> None:
        if self._finished is not None:
            raise RunFinished("this run has finished")
        self._prepare_table(name, table)

    @property
    def step(self) -> int:
        return self._step

    def finish(self, status: str = "finished", timeout: float = 120.0) -> FinishReport:
        self._finished = self._finished or FinishReport()
        return self._finished

    @property
    def finished(self) -> bool:
        return self._finished is not None

    def __enter__(self) -> "NullRun":
        return self

    def __exit__(self, *exc) -> None:
        self.finish()


def _takes_tables(selected: list) -> bool:
    """Whether any selected sink stores tables (checked from the sink classes; no tracker is imported)."""
    from rllog import registry

    for item in selected:
        cls = registry.resolve(item).load() if isinstance(item, str) else item
        if getattr(getattr(cls, "capabilities", None), "tables", False):
            return True
    return False


class Run(_Prepare):
    """One training run. Create it with :func:`rllog.init`.

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
    ):
        if delivery not in ("process", "thread"):
            raise ValueError(f"delivery must be 'process' or 'thread', got {delivery!r}")
        selected = parse_report_to(report_to)
        self._set_reduction(reduce_across_ranks)
        self._takes_tables = _takes_tables(selected) if self._distributed else True
        run_id = secrets.token_hex(8)
        name = name or f"run-{run_id}"
        run_dir = Path(run_dir) if run_dir is not None else default_run_dir(name, run_id)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            if any(journal_mod.journal_dir(run_dir).glob("*" + journal_mod.SUFFIX)):
                raise RunDirError(f"{run_dir} already holds a run; use a new run_dir (or `rllog replay` to deliver it again)")
        except OSError as exc:
            raise RunDirError(f"cannot create the run directory {run_dir}: {exc}") from exc
        self.run_dir = run_dir.resolve()
        self.info = RunInfo(project, name, str(self.run_dir), run_id, flatten_config(config), tuple(tags))
        self.flush_interval = flush_interval
        self.delivery = delivery
        self.retry = retry or RetryPolicy()
        from rllog.registry import resolve

        options = {resolve(k).name: dict(v) for k, v in (backend_options or {}).items()}  # "comet" -> "comet_ml"
        # Names go to the agent process (or to threads); sink objects are always delivered in-process.
        self._named = [s for s in selected if isinstance(s, str)]
        self._objects = [s for s in selected if not isinstance(s, str)]
        self.sink_names = list(self._named) + self._object_names(self._objects)
        self._write_run_file(options)
        self.max_pending = max_pending
        self._backpressure_warned = False
        self._monitor = _health_monitor(health)
        self._writer = JournalWriter(self.run_dir, flush_interval, on_metrics=self._check_health if self._monitor else None, on_tick=self._watch_agent)
        self._lock = threading.Lock()
        self._seq = 0
        self._step = -1
        self._finished: FinishReport | None = None
        # Where an omitted step comes from when a trainer owns the step (set by the HF/TRL integration).
        self.step_source: Callable[[], int] | None = None
        self._agent = None
        self.agent_restarts = 0
        self._followers: list[Follower] = []
        if self._named and delivery == "process":
            from rllog.agent import start_agent

            self._agent = start_agent(self.run_dir)
        else:
            self._followers += [self._follower(n, _factory(n, options.get(n))) for n in self._named]
        self._followers += [self._follower(n, s) for n, s in zip(self.sink_names[len(self._named):], self._objects)]
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
            InvalidStep: a step that is not a non-negative int.
            RunFinished: the run has finished.
        """
        floats, tensors = self._prepare_metrics(values)
        stacked = stack_scalars(list(tensors.values())) if tensors else None
        if step is not None:
            step = _check_step(step)
        now = time.time()
        with self._lock:
            self._check_open()
            self._seq += 1
            if step is None:
                step = self.step_source() if self.step_source is not None else self._step + 1
            self._step = step
            entry = PendingMetrics(self._seq, self._step, now, floats, tuple(tensors), stacked)
            self._writer.append(entry)
        if self._writer.backlog > self.max_pending:
            self._wait_for_journal()

    def log_table(self, name: str, table: Any, step: int | None = None) -> None:
        """Log a table (e.g. completions) at ``step`` (default: the step of the last ``log``).

        ``table`` may be a dict of equal-length columns, a list of row dicts, a ``pyarrow.Table`` or a
        pandas DataFrame.

        Raises:
            InvalidTable: ragged columns (names each column's length) or unsupported input.
        """
        arrow = self._prepare_table(name, table)
        if step is not None:
            step = _check_step(step)
        now = time.time()
        with self._lock:
            self._check_open()
            self._seq += 1
            if step is None:
                step = self.step_source() if self.step_source is not None else max(self._step, 0)
            self._writer.append(TableRecord(self._seq, step, now, name, arrow))
        if self._writer.backlog > self.max_pending:
            self._wait_for_journal()

    @property
    def step(self) -> int:
        """The step of the last logged metrics (-1 before the first)."""
        return self._step

    @property
    def run_id(self) -> str:
        """The run's stable id (trackers use it to resume the same run on replay)."""
        return self.info.run_id

    # -- the end ---------------------------------------------------------------------------------
    def finish(self, status: str = "finished", timeout: float = 120.0) -> FinishReport:
        """Write the end marker, wait up to ``timeout`` s for every sink, and report per sink.

        A sink still busy at the deadline is stopped (the agent process is killed); what it has not
        acknowledged stays in the journal for ``rllog replay``. Calling ``finish`` again returns the
        same report.
        """
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        with self._lock:
            if self._finished is not None:
                return self._finished
            self._finished = FinishReport()  # from here on log() raises RunFinished
        deadline = time.monotonic() + timeout
        self._writer.close(status, timeout=max(0.0, deadline - time.monotonic()))
        if self._agent is not None:
            from rllog.agent import stop_agent

            stop_agent(self._agent, deadline)
        for follower in self._followers:
            if not follower.join(max(0.0, deadline - time.monotonic())):
                follower.stop()
        self._finished = report(self.run_dir, self.sink_names)
        _live_runs.discard(self)
        if not self._finished.ok:
            log.warning("rllog: run %s finished with undelivered records:\n%s", self.run_dir, self._finished)
        return self._finished

    @property
    def finished(self) -> bool:
        return self._finished is not None

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish("failed" if exc_type is not None else "finished")

    # -- internals -------------------------------------------------------------------------------
    def _check_health(self, entries: list[PendingMetrics]) -> None:
        """On the journal writer thread: run the health rules, journal and log what they raise."""
        for entry in entries:
            for draft in self._monitor.observe(entry.step, entry.values):
                with self._lock:
                    self._seq += 1
                    alert = AlertRecord(self._seq, draft.step, time.time(), draft.rule, draft.metric, float(draft.value), draft.message, draft.level)
                    self._writer.append(alert)
                log.log(logging.ERROR if draft.level == "error" else logging.WARNING, "rllog alert [%s] step %d: %s", draft.rule, draft.step, draft.message)

    def _wait_for_journal(self) -> None:
        """Backpressure: the writer is ``max_pending`` records behind (a stalled disk); wait rather than drop."""
        if not self._backpressure_warned:
            self._backpressure_warned = True
            log.warning("rllog: the journal writer is %d records behind; log() waits for it (nothing is dropped)", self._writer.backlog)
        self._writer.wake()
        while self._writer.backlog > self.max_pending // 2 and self._writer.alive:
            time.sleep(0.001)

    MAX_AGENT_RESTARTS = 5

    def _watch_agent(self) -> None:
        """On the journal writer thread: restart a delivery agent that died before ``finish``.

        Cursors are persisted and its locks die with it, so the new agent resumes where the old one
        stopped. After ``MAX_AGENT_RESTARTS`` the records stay in the journal and ``finish`` reports them.
        """
        from rllog.agent import EXIT_SINKS_FAILED, start_agent

        agent = self._agent
        if agent is None or agent.poll() is None or self._finished is not None:
            return
        if agent.returncode == EXIT_SINKS_FAILED or self.agent_restarts >= self.MAX_AGENT_RESTARTS:
            return  # its sinks failed (reported by finish), or it keeps dying

        self.agent_restarts += 1
        log.warning("rllog: the delivery agent exited with code %s; restarting it (%d/%d)", agent.returncode, self.agent_restarts, self.MAX_AGENT_RESTARTS)
        self._agent = start_agent(self.run_dir)

    def _check_open(self) -> None:
        if self._finished is not None:
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

    def _follower(self, name: str, sink) -> Follower:
        return Follower(name, sink, self.info, follow=True, flush_interval=self.flush_interval, retry=self.retry)

    def _write_run_file(self, options: dict) -> None:
        data = {
            "project": self.info.project,
            "name": self.info.name,
            "run_id": self.info.run_id,
            "config": dict(self.info.config),
            "tags": list(self.info.tags),
            "flush_interval": self.flush_interval,
            "retry": {"base": self.retry.base, "cap": self.retry.cap, "give_up_after": self.retry.give_up_after},
            "sinks": [{"name": n, "backend": n, "options": options.get(n, {})} for n in self._named],
            "pid": os.getpid(),
            "started": time.time(),
        }
        (self.run_dir / RUN_FILE).write_text(json.dumps(data, indent=1, default=str))


def _health_monitor(health: Any):
    """``True``: the default rules; ``False``/None: none; a dict: ``HealthMonitor(**health)``; else a monitor object."""
    if health is False or health is None:
        return None
    if health is True or isinstance(health, Mapping):
        from rllog.catalog import HealthMonitor

        return HealthMonitor(**(health if isinstance(health, Mapping) else {}))
    return health


def _factory(name: str, options: Mapping[str, Any] | None):
    from rllog import registry

    return lambda: registry.create(name, dict(options or {}))


def load_run_info(run_dir: str | os.PathLike) -> tuple[RunInfo, dict]:
    """The RunInfo and raw run file of an existing run directory."""
    run_dir = Path(run_dir).resolve()
    data = json.loads((run_dir / RUN_FILE).read_text())
    info = RunInfo(data["project"], data["name"], str(run_dir), data["run_id"], data.get("config", {}), tuple(data.get("tags", ())))
    return info, data


_live_runs: "weakref.WeakSet[Run]" = weakref.WeakSet()
_previous_sigterm: Any = None


def _on_sigterm(signum, frame) -> None:
    """Finish every live run as ``killed``, then hand the signal to whoever had it before."""
    for run in list(_live_runs):
        try:
            run.finish("killed", timeout=30.0)
        except Exception as exc:
            log.error("rllog: finishing %s on SIGTERM failed: %s", run.run_dir, exc)
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:  # the default action: die of SIGTERM, as the sender expects
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


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
