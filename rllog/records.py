"""The immutable records every sink receives.

Everything a :class:`rllog.sink.MetricSink` sees is one of these. They are created by the journal
reader, never by user code, and are never mutated.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import pyarrow as pa

from rllog.system_metrics import PREFIX as SYSTEM_PREFIX

# Metrics and alerts as tables, one row per value (the Parquet store's files, and what rllog.read returns).
METRICS_SCHEMA = pa.schema(
    [("step", pa.int64()), ("key", pa.string()), ("value", pa.float64()), ("time", pa.float64()), ("seq", pa.int64())]
)
ALERTS_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("seq", pa.int64()),
        ("time", pa.float64()),
        ("rule", pa.string()),
        ("metric", pa.string()),
        ("value", pa.float64()),
        ("message", pa.string()),
        ("level", pa.string()),
    ]
)

# The run status: how a run ended. Not a sink's state (rllog.delivery.SinkState) nor a report's
# (rllog.rundir.ReportState); docs/formats.md lists the three vocabularies.
RUN_STATUSES = ("finished", "failed", "killed")


def _frozen(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping or {}))


# Rows read at a time while looking for an attempt's deciding record: it is almost always the attempt's first
# record (a few ``system/...`` samples may come before it), so the first slice holds it.
DECIDING_SLICE_ROWS = 4096


@dataclass(frozen=True)
class MetricsRecord:
    """One ``Run.log`` call: scalar metrics at one step.

    Attributes:
        seq: position in the run's journal (1, 2, 3, ...), unique per record.
        step: the training step every sink records these values at.
        time: wall-clock time of the ``log`` call (seconds since the epoch).
        values: metric name -> Python float (NaN and inf kept).
    """

    seq: int
    step: int
    time: float
    values: Mapping[str, float]

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", _frozen(self.values))


def step_rows(
    records: Sequence[MetricsRecord], name: Callable[[str], str] = str
) -> Iterator[tuple[int | None, dict[str, float], int]]:
    """``(step, values, seq of its last record)``: consecutive records of one step merged into one row, for a
    tracker whose call costs more than its values (TRL logs each profiling timing as a record, ~9 a step), unless a
    key repeats, which starts a new row so that every value is kept, in order. Keys go through ``name``; a row
    without values (step None) still carries its records' seq.

    Example:
        >>> rows = step_rows([MetricsRecord(1, 7, 0.0, {"a": 1.0}), MetricsRecord(2, 7, 0.0, {"b": 2.0})])
        >>> list(rows)
        [(7, {'a': 1.0, 'b': 2.0}, 2)]
    """
    row: dict[str, float] = {}
    step: int | None = None
    last_seq = -1
    for record in records:
        values = {name(k): float(v) for k, v in record.values.items()}
        if row and (record.step != step or not values.keys().isdisjoint(row)):
            yield step, row, last_seq
            row, step = {}, None
        if values:
            row.update(values)
            step = record.step
        last_seq = record.seq
    if records:
        yield step, row, last_seq


@dataclass(frozen=True)
class TableRecord:
    """One ``Run.log_table`` call: a named table (e.g. completions) at one step."""

    seq: int
    step: int
    time: float
    name: str
    table: pa.Table


@dataclass(frozen=True)
class ConfigRecord:
    """One ``Run.update_config`` call: hyperparameters added or changed after ``init`` (flattened, secrets redacted).

    Delivered to sinks whose ``capabilities.config`` is true, through their ``write_config(record)``.
    """

    seq: int
    step: int
    time: float
    values: Mapping[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", _frozen(self.values))


@dataclass(frozen=True)
class RunInfo:
    """What a sink needs to open its tracker's run.

    Attributes:
        project: project / experiment name.
        name: the run's display name.
        run_dir: the rllog run directory (the journal lives here; file-based sinks write below it).
        run_id: a stable id for this run; sinks use it to resume the same tracker run on replay.
        config: flattened hyperparameters (secrets already redacted).
        tags: free-form tags.
        attempt_starts: the first ``seq`` of each attempt (``(1,)`` for a run never resumed; a resumed
            run's later attempts start further on). A record with ``seq >= attempt_starts[k]`` belongs to
            attempt ``k + 1``; the first record of a later attempt may restart at an earlier step.
        program: the trainer's program (``sys.argv[0]``), for trackers that show it.
        args: the trainer's command-line arguments.
    """

    project: str
    name: str
    run_dir: str
    run_id: str
    config: Mapping[str, Any] = field(default_factory=dict)
    tags: tuple[str, ...] = ()
    attempt_starts: tuple[int, ...] = (1,)
    continuing_starts: tuple[int, ...] = ()
    program: str = ""
    args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", _frozen(self.config))
        object.__setattr__(self, "tags", tuple(self.tags))
        object.__setattr__(self, "attempt_starts", tuple(self.attempt_starts))
        object.__setattr__(self, "continuing_starts", tuple(self.continuing_starts))
        object.__setattr__(self, "args", tuple(self.args))


@dataclass(frozen=True)
class AlertRecord:
    """A health alert raised by a rule of :mod:`rllog.health` (e.g. entropy collapse) at one step.

    Delivered to sinks whose ``capabilities.alerts`` is True, through their ``write_alert(record)``.
    """

    seq: int
    step: int
    time: float
    rule: str
    metric: str
    value: float
    message: str
    level: str = "warning"  # "warning" or "error"


def decides_restart(keys: Iterable[str]) -> bool:
    """Whether a metrics record with these keys sets the step its attempt restarts at: it holds a metric the trainer
    logged. ``system/...`` samples alone do not: the trainer journals them at its current step, which at the start
    of a resumed attempt is still the previous attempt's last step, not the step the attempt restarted from."""
    return any(not key.startswith(SYSTEM_PREFIX) for key in keys)


@dataclass(frozen=True)
class Restart:
    """Where a later attempt of a resumed run took over: its first record that :func:`decides_restart`.

    Attributes:
        attempt: the attempt (2, 3, ...).
        seq, step: that record's seq and step.
        supersedes: False for an attempt marked ``continues`` (``resume="continue"``): it carries on where the run
            stopped and supersedes nothing.
    """

    attempt: int
    seq: int
    step: int
    supersedes: bool


class Supersession:
    """The one rule for what a resumed run's later attempts supersede, for every reader and backend.

    A later attempt restarts at the step of its first metrics record holding a trainer metric
    (:func:`decides_restart`). Every record before that one in seq order whose step is at or after that step is
    superseded: an earlier attempt's records (what the checkpoint the job resumed from did not keep), and the
    attempt's own ``system/...`` samples journaled before it (stamped with the previous attempt's last step).
    Steps that go back later within an attempt supersede nothing: they are that attempt's own values. Tables and
    alerts are superseded by the same test but never decide.

    The rule is a stream: feed :meth:`decide` every metrics record in seq order (TensorBoard writes its restart
    marker where it returns a restart; ``rllog show`` and the Parquet reader then ask :meth:`superseded`).

    Example:
        >>> rule = Supersession(attempt_starts=(1, 11))
        >>> rule.decide(11, 9, ["system/cpu_percent"]), rule.decide(12, 5, ["loss"])
        (None, Restart(attempt=2, seq=12, step=5, supersedes=True))
        >>> rule.superseded(seq=7, step=6), rule.superseded(seq=7, step=4), rule.superseded(seq=13, step=6)
        (True, False, False)
    """

    def __init__(self, attempt_starts: Iterable[int] = (1,), continuing_starts: Iterable[int] = ()):
        self.attempt_starts = tuple(sorted(attempt_starts)) or (1,)
        self.continuing_starts = frozenset(continuing_starts)
        self.decided: set[int] = set()  # attempts whose restart is known (a sink reopened mid-run adds its own)
        self.restarts: list[Restart] = []  # the decided restarts that supersede, in seq order

    @classmethod
    def of(cls, info: RunInfo) -> Supersession:
        return cls(info.attempt_starts, info.continuing_starts)

    def copy(self) -> Supersession:
        """An independent copy (a sink that rolls a failed write back restores what it had decided before it)."""
        other = Supersession(self.attempt_starts, self.continuing_starts)
        other.decided, other.restarts = set(self.decided), list(self.restarts)
        return other

    def attempt(self, seq: int) -> int:
        """The attempt (1, 2, ...) record ``seq`` belongs to."""
        return max(1, bisect.bisect_right(self.attempt_starts, seq))

    def later_attempts(self) -> list[tuple[int, int | None]]:
        """``(first_seq, end_seq)`` of each attempt after the first (``end_seq``: the next one's first, None for the
        last): where a reader that holds records out of stream order looks for each one's deciding record."""
        starts = self.attempt_starts
        return [(first, starts[i + 1] if i + 1 < len(starts) else None) for i, first in enumerate(starts) if i > 0]

    def decide(self, seq: int, step: int, keys: Iterable[str]) -> Restart | None:
        """The restart metrics record ``seq`` decides, if it is the first of a later attempt that
        :func:`decides_restart`; None for every other record (and for an attempt already decided)."""
        attempt = self.attempt(seq)
        if attempt <= 1 or attempt in self.decided or not decides_restart(keys):
            return None
        self.decided.add(attempt)
        restart = Restart(attempt, seq, step, supersedes=self.attempt_starts[attempt - 1] not in self.continuing_starts)
        if restart.supersedes:
            self.restarts.append(restart)
        return restart

    def decide_from(self, metrics: pa.Table) -> Supersession:
        """Decide every later attempt's restart from ``metrics`` (long format: seq, step, key, in seq order), reading
        each attempt's first rows until one decides; returns ``self``."""
        import pyarrow.compute as pc

        for first, end in self.later_attempts():
            mask = pc.greater_equal(metrics.column("seq"), first)
            if end is not None:
                mask = pc.and_(mask, pc.less(metrics.column("seq"), end))
            rows = metrics.filter(mask)
            for offset in range(0, rows.num_rows, DECIDING_SLICE_ROWS):
                part = rows.slice(offset, DECIDING_SLICE_ROWS)
                seqs, steps, keys = (part.column(c).to_pylist() for c in ("seq", "step", "key"))
                if any(self.decide(seq, step, [key]) for seq, step, key in zip(seqs, steps, keys, strict=True)):
                    break
        return self

    def without_superseded(self, table: pa.Table, seq: str = "seq", step: str = "step") -> pa.Table:
        """``table`` without the rows a later attempt superseded (``seq`` and ``step``: its column names)."""
        import pyarrow.compute as pc

        mask = self.superseded_mask(table.column(seq), table.column(step)) if table.num_rows else None
        return table if mask is None else table.filter(pc.invert(mask))

    def superseded(self, seq: int, step: int) -> bool:
        """Whether a later attempt's restart supersedes the record at ``seq`` and ``step``."""
        return any(seq < r.seq and step >= r.step for r in self.restarts)

    def superseded_mask(self, seqs: pa.ChunkedArray | pa.Array, steps: pa.ChunkedArray | pa.Array) -> Any:
        """:meth:`superseded` for columns of seqs and steps at once: a boolean array (None when nothing is)."""
        import pyarrow.compute as pc

        mask = None
        for r in self.restarts:
            hit = pc.and_(pc.less(seqs, r.seq), pc.greater_equal(steps, r.step))
            mask = hit if mask is None else pc.or_(mask, hit)
        return mask
