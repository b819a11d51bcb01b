"""Reading a run back from its journal: the data behind ``rllog show`` and ``rllog plot``."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from rllog.journal import End, read_all
from rllog.records import AlertRecord, MetricsRecord, Supersession, TableRecord
from rllog.rundir import load_run_info


@dataclass
class MetricSummary:
    count: int = 0
    last: float = math.nan
    last_step: int = -1
    min: float = math.inf
    max: float = -math.inf
    non_finite: int = 0


@dataclass
class RunSummary:
    records: int = 0
    steps: set[int] = field(default_factory=set)
    metrics: dict[str, MetricSummary] = field(default_factory=dict)
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    tables: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (tables logged, rows)
    alerts: list[AlertRecord] = field(default_factory=list)
    status: str | None = None


def _latest_attempt(run_dir: str | os.PathLike, metrics: list[MetricsRecord]) -> list[MetricsRecord]:
    """A resumed run as its latest attempt left it: what a later attempt superseded (``rllog.records.Supersession``,
    the rule ``rllog.read_metrics`` and TensorBoard follow) is left out. ``metrics`` are in seq order."""
    try:
        rule = Supersession.of(load_run_info(run_dir)[0])
    except (FileNotFoundError, ValueError, TypeError, KeyError):
        return metrics
    for m in metrics:
        rule.decide(m.seq, m.step, m.values)
    return [m for m in metrics if not rule.superseded(m.seq, m.step)]


def summarise(run_dir: str | os.PathLike) -> RunSummary:
    """Every metric's count/last/min/max (NaN and inf counted apart) and series, every table's size."""
    s = RunSummary()
    metrics: list[MetricsRecord] = []
    for item in read_all(run_dir):
        if isinstance(item, End):
            s.status = item.status
            continue
        s.status = None  # records after an end marker: a resumed attempt, running or killed until its own end
        s.records += 1
        if isinstance(item, AlertRecord):
            s.alerts.append(item)
        elif isinstance(item, TableRecord):
            n, rows = s.tables.get(item.name, (0, 0))
            s.tables[item.name] = (n + 1, rows + item.table.num_rows)
        elif isinstance(item, MetricsRecord):
            metrics.append(item)
        # a ConfigRecord (Run.update_config) counts as a record; config is not summarised
    for item in _latest_attempt(run_dir, metrics):
        s.steps.add(item.step)
        for key, value in item.values.items():
            m = s.metrics.setdefault(key, MetricSummary())
            m.count += 1
            m.last, m.last_step = value, item.step
            s.series.setdefault(key, []).append((item.step, value))
            if math.isfinite(value):
                m.min, m.max = min(m.min, value), max(m.max, value)
            else:
                m.non_finite += 1
    return s
