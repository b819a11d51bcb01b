"""``RLLogTracker``: an accelerate ``GeneralTracker``, so a custom loop on accelerate logs through rllog.

Example:
    >>> from accelerate import Accelerator
    >>> from rllog.integrations.accelerate import RLLogTracker
    >>> accelerator = Accelerator(log_with=RLLogTracker(report_to="wandb,parquet", project="grpo-math"))
    >>> accelerator.init_trackers("grpo-math", config={"lr": 1e-6})      # config -> every selected tracker
    >>> accelerator.log({"reward": 0.41, "kl": 0.01}, step=10)
    >>> accelerator.get_tracker("rllog").log_table("completions", columns=["prompt", "completion"], data=[["1+1", "2"]], step=10)
    >>> accelerator.end_training()                                      # finishes the rllog run

Importing this module also registers the tracker under its name, so ``Accelerator(log_with="rllog")`` works
too; then ``init_trackers(project_name, init_kwargs={"rllog": {"report_to": "mlflow", ...}})`` passes
``project_name`` as the project and ``init_kwargs["rllog"]`` to :func:`rllog.init`.

The run starts in ``start()`` (accelerate calls it from ``init_trackers``, on the main process only) and
logs from the main process alone (``reduce_across_ranks=False``: accelerate's ``log`` runs on the main
process). The config of ``init_trackers`` arrives after the run started and goes through
``Run.update_config``. A value that is not a number (accelerate allows strings) is not a metric: it is
skipped with a warning naming it, once per key.
"""

from __future__ import annotations

import logging
from typing import Any

from accelerate.tracking import GeneralTracker, on_main_process, register_tracker_class

import rllog
from rllog.errors import InvalidValue
from rllog.validate import flatten, to_scalar

log = logging.getLogger("rllog.integrations")


class RLLogTracker(GeneralTracker):
    """Sends what ``accelerator.log`` / ``log_table`` receive, and the ``init_trackers`` config, to an rllog run.

    Args:
        project_name: the project (accelerate passes ``init_trackers``' ``project_name`` here when the tracker is
            selected by name); default ``"accelerate"``.
        report_to: rllog backends (default: the embedded default, parquet). Ignored if ``run`` is given.
        run: an existing :class:`rllog.Run` to log into (then ``finish`` leaves it open).
        **init_kwargs: passed to :func:`rllog.init` (``name``, ``run_dir``, ``tags``, ``backend_options``...).
    """

    name = "rllog"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, project_name: str | None = None, *, report_to: Any = None, run: Any = None, **init_kwargs: Any):
        super().__init__()
        self.project_name = init_kwargs.pop("project", None) or project_name or "accelerate"
        self.report_to = report_to
        self.run = run
        self._owns_run = run is None
        self.init_kwargs = init_kwargs
        self._skipped: set[str] = set()

    @property
    def tracker(self) -> Any:
        """The :class:`rllog.Run` (None before ``start``)."""
        return self.run

    @on_main_process
    def start(self) -> None:
        """Start a run, unless one is open; after ``end_training``, a new one (as accelerate's own trackers do)."""
        if self.run is None or (self._owns_run and self.run.finished):
            self.run = rllog.init(
                report_to=self.report_to,
                project=self.project_name,
                reduce_across_ranks=False,
                **{"reinit": "create_new", **self.init_kwargs},  # this tracker finishes its own runs (end_training)
            )

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self._require_run().update_config(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        run = self._require_run()
        try:
            run.log(values, step=step)  # validates; the common case: every value is a number
        except InvalidValue:
            numbers = self._numbers_only(values)
            if numbers:
                run.log(numbers, step=step)

    @on_main_process
    def log_table(
        self,
        table_name: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        **kwargs: Any,
    ) -> None:
        """A table from ``columns`` + ``data`` (rows) or a ``dataframe``, as accelerate's wandb and ClearML trackers take it."""
        if dataframe is not None:
            table: Any = dataframe
        else:
            if columns is None or data is None:
                raise ValueError("log_table needs `columns` and `data`, or `dataframe`")
            table = {column: [row[i] for row in data] for i, column in enumerate(columns)}
        self._require_run().log_table(table_name, table, step=step)

    @on_main_process
    def finish(self) -> None:
        if self.run is not None and self._owns_run:
            self.run.finish()

    def _numbers_only(self, values: dict) -> dict:
        """``values`` without what is not a number (each such key warned about once)."""
        numbers = {}
        for key, value in flatten(values).items():
            try:
                to_scalar(key, value)
            except InvalidValue:
                if key not in self._skipped:
                    self._skipped.add(key)
                    log.warning("rllog: %r is not a number (%s); not logged as a metric", key, type(value).__name__)
                continue
            numbers[key] = value
        return numbers

    def _require_run(self) -> Any:
        if self.run is None:
            self.start()
        return self.run


def register() -> None:
    """Make ``Accelerator(log_with="rllog")`` select :class:`RLLogTracker` (done when this module is imported)."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    if LOGGER_TYPE_TO_CLASS.get(RLLogTracker.name) is not RLLogTracker:
        register_tracker_class(RLLogTracker)


register()
