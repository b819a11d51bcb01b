"""The immutable records every sink receives.

Everything a :class:`rllog.sink.MetricSink` sees is one of these. They are created by the journal
reader, never by user code, and are never mutated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import pyarrow as pa

STATUSES = ("finished", "failed", "killed")


def _frozen(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping or {}))


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


def restarting_attempts(attempts: Sequence[Mapping[str, Any]]) -> list[tuple[int, int | None]]:
    """``(first_seq, end_seq)`` of each later attempt that restarts (run.json's ``attempts``; ``end_seq`` is the next
    attempt's first seq, None for the last). An attempt marked ``continues`` (``resume="continue"``) carries on where
    the run stopped and is left out: it supersedes nothing. Readers drop an earlier attempt's rows from the first
    step a restarting attempt logged."""
    ordered = sorted(attempts, key=lambda a: a["first_seq"])
    firsts = [a["first_seq"] for a in ordered]
    return [
        (first, firsts[i + 1] if i + 1 < len(firsts) else None)
        for i, first in enumerate(firsts)
        if i > 0 and not ordered[i].get("continues")
    ]
