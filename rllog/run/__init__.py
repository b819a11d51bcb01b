"""The trainer's side of a run, one module per concern.

- :mod:`rllog.run.run`: :class:`Run`, the hot path (one ``_append`` numbers every record), ``flush``, ``finish``;
- :mod:`rllog.run.opening`: ``init``'s arguments checked, the run directory claimed or resumed;
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
