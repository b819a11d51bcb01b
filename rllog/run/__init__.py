"""The trainer's side of a run, one module per concern.

- :mod:`rllog.run.run`: :class:`Run`, the hot path (one ``_append`` numbers every record), ``flush``, ``finish``;
- :mod:`rllog.run.opening`: the steps of opening a run: ``init``'s arguments and the agent's settings checked, the
  sinks selected, the run directory claimed or resumed, the run's :class:`~rllog.records.RunInfo`;
- :mod:`rllog.run.signals`: the live runs of the process; SIGTERM, fork and exit;
- :mod:`rllog.run.null`: :class:`NullRun`, what ranks other than 0 get;
- :mod:`rllog.run.base`: what both share (validation, the cross-rank collectives);
- :mod:`rllog.run.delivery_link`: the one module here that reaches the delivery side (agent, followers, cursors).
"""

from __future__ import annotations

from rllog.run.base import RunBase
from rllog.run.null import NullRun
from rllog.run.opening import RESUME_MODES, SYSTEM_METRICS_ENV, system_interval
from rllog.run.run import Run
from rllog.rundir import FinishReport, SinkReport, load_run_info, report

__all__ = [
    "RESUME_MODES",
    "SYSTEM_METRICS_ENV",
    "FinishReport",
    "NullRun",
    "Run",
    "RunBase",
    "SinkReport",
    "load_run_info",
    "report",
    "system_interval",
]
