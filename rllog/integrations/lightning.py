"""``RLLogLogger``: a Lightning ``Logger``, so a ``LightningModule`` logs through rllog.

Example:
    >>> import lightning as L
    >>> from rllog.integrations.lightning import RLLogLogger
    >>> trainer = L.Trainer(logger=RLLogLogger(report_to="mlflow,parquet", project="grpo-math"), max_steps=100)
    >>> trainer.fit(model)          # self.log(...) -> every tracker, at Lightning's step; save_hyperparameters() -> config

- ``log_metrics(metrics, step)``: ``Run.log`` at Lightning's step (``trainer.global_step``); Lightning's
  ``epoch`` arrives as a metric like the others.
- ``log_hyperparams(params)``: Lightning reads ``logger.experiment`` (which starts the run) before it hands
  over the hyperparameters, so they go through ``Run.update_config`` (a ``Namespace`` or dict; nested dicts
  flattened with ``/``, secrets redacted).
- ``finalize(status)``: Lightning calls it at the end of every ``fit`` / ``validate`` / ``test``: ``"success"``
  finishes the run ``finished``, anything else (``"failed"``: an exception, Ctrl+C) ``failed``. A later stage on
  the same logger (``trainer.test`` after ``fit``) resumes the same run (same run id and directory, a new attempt
  that continues it: ``resume="continue"``, nothing superseded).
- ``logger.experiment`` is the :class:`rllog.Run` (``logger.experiment.log_table(...)`` logs a table).

Only global rank 0 starts the run (Lightning's ``rank_zero_only``); metrics reach the logger already reduced.
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

import rllog

STATUS = {"success": "finished", "finished": "finished"}


class RLLogLogger(Logger):
    """A Lightning logger that writes to an rllog run.

    Args:
        report_to: rllog backends (default: the embedded default, parquet). Ignored if ``run`` is given.
        project: the project in every tracker.
        name: the run's name (also Lightning's logger ``name``); default rllog's ``run-<id>``.
        run: an existing :class:`rllog.Run` to log into (``finalize`` then leaves it open).
        **init_kwargs: passed to :func:`rllog.init` (``run_dir``, ``tags``, ``backend_options``...).
    """

    def __init__(
        self, report_to: Any = None, project: str = "lightning", name: str | None = None, run: Any = None, **init_kwargs: Any
    ):
        super().__init__()
        self.report_to = report_to
        self.project = project
        self._name = name
        self._run = run
        self._owns_run = run is None
        self._finalized: str | None = None  # the status the last finalize() finished the run with
        self.init_kwargs = init_kwargs

    @property
    def name(self) -> str:
        return self._name or "rllog"

    @property
    def version(self) -> str | None:
        return self._run.run_id if self._run is not None and hasattr(self._run, "run_id") else None

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """The :class:`rllog.Run`, started on first use (again, as a resumed attempt, after ``finalize``)."""
        if self._run is None:
            kwargs = {"reinit": "create_new", **self.init_kwargs}  # this logger finishes its own runs (finalize)
            self._run = rllog.init(
                report_to=self.report_to, project=self.project, name=self._name, reduce_across_ranks=False, **kwargs
            )
        elif self._run.finished and self._owns_run:
            # after a stage that ended well the run continues; after a failed one (a fit resumed from ckpt_path
            # next) the attempt restarts at its first step, as a resume does
            resume = "continue" if self._finalized == "finished" else "must"
            kwargs = {"reinit": "create_new", **self.init_kwargs, "run_dir": self._run.run_dir, "run_id": self._run.run_id}
            kwargs["resume"] = resume
            self._run = rllog.init(
                report_to=self.report_to, project=self.project, name=self._name, reduce_across_ranks=False, **kwargs
            )
        return self._run

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        values = vars(params) if isinstance(params, Namespace) else dict(params or {})
        if values:
            self.experiment.update_config(values)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.experiment.log(metrics, step=step)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._run is not None and self._owns_run and not self._run.finished:
            self._finalized = STATUS.get(status, "failed")
            self._run.finish(self._finalized)
