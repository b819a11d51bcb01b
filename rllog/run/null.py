"""What ranks other than global rank 0 get from :func:`rllog.init`: the same calls as :class:`rllog.run.Run`, no
trackers, no files (``tests/test_run_package.py`` checks that both have the same public methods)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rllog.errors import RunFinished
from rllog.registry import parse_report_to
from rllog.run.base import RunBase, takes_tables
from rllog.rundir import FinishReport
from rllog.validate import check_step, flatten_config


class NullRun(RunBase):
    """What ranks other than global rank 0 get from :func:`rllog.init`: same calls, no trackers, no files.

    It validates like a real run and takes part in the cross-rank reduction, so user code never
    branches on rank.
    """

    def __init__(self, report_to: Any = None, reduce_across_ranks: bool | None = None, **kwargs: Any):
        super().__init__(reduce_across_ranks)
        self._selected = parse_report_to(report_to)
        self._takes_tables = takes_tables(self._selected)
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
        self._log_held()
        return FinishReport()

    def request_flush(self, at_once: bool = False) -> None:
        pass

    def finish(self, status: str = "finished", timeout: float = 120.0) -> FinishReport:
        if self._finished is None:
            self._log_held()
        self._finished = self._finished or FinishReport()
        return self._finished

    def __repr__(self) -> str:
        return f"<rllog.NullRun step={self._step}{' finished' if self.finished else ''}>"
