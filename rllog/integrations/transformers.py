"""``RLLogCallback``: any Hugging Face ``Trainer`` logs through rllog.

Example:
    >>> from transformers import Trainer
    >>> from rllog.integrations.transformers import RLLogCallback
    >>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[RLLogCallback(report_to="mlflow,parquet")])

Names: training keys are logged as the trainer gives them (``loss``, ``grad_norm``, ``learning_rate``...),
evaluation keys ``eval_x`` become ``eval/x`` (``test_x`` -> ``test/x``), the same in every tracker;
the end-of-training summary (``train_runtime``...) arrives once, at the last step. A ``None`` value
(TRL logs one for a metric whose every sample was NaN) is logged as NaN; a value that is not a number
(a string, a list) is not a metric and is skipped with a warning naming it, once per key.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from transformers import TrainerCallback

import rllog
from rllog.errors import InvalidValue
from rllog.values import flatten, to_scalar

log = logging.getLogger("rllog.integrations")

# transformers' report_to names that rllog serves (transformers name -> rllog backend name).
SERVED = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow", "trackio": "trackio", "comet_ml": "comet_ml", "parquet": "parquet", "console": "console"}
PREFIXES = {"eval_": "eval/", "test_": "test/"}


def rename(key: str) -> str:
    """``eval_loss`` -> ``eval/loss``; training keys unchanged."""
    for prefix, replacement in PREFIXES.items():
        if key.startswith(prefix):
            return replacement + key[len(prefix):]
    return key


def split_report_to(report_to: Any) -> tuple[list[str], list[str]]:
    """Split a transformers ``report_to`` into (names rllog serves, names left to transformers)."""
    if report_to in (None, "none"):
        return [], []
    if isinstance(report_to, str):
        report_to = [p.strip() for p in report_to.split(",")]
    ours = [SERVED[n] for n in report_to if n in SERVED]
    theirs = [n for n in report_to if n not in SERVED and n != "none"]
    return ours, theirs


def trainer_config(args: Any, model: Any = None) -> dict:
    """The hyperparameters a tracker shows: the TrainingArguments, and the model config under ``model/``."""
    config = dict(args.to_dict()) if hasattr(args, "to_dict") else {}
    model_config = getattr(model, "config", None)
    if model_config is not None and hasattr(model_config, "to_dict"):
        config["model"] = model_config.to_dict()
    return config


class RLLogCallback(TrainerCallback):
    """Sends a Trainer's logs (and config) to an rllog run.

    Args:
        report_to: rllog backends (default: the embedded default, parquet). Ignored if ``run`` is given.
        run: an existing :class:`rllog.Run` to log into.
        **init_kwargs: passed to :func:`rllog.init` (``project``, ``name``, ``run_dir``, ...).

    The run starts at ``on_train_begin`` on the global main process (other ranks log nothing) and stays
    open after training so that later ``evaluate()`` calls are logged too; it is finished by
    ``run.finish()`` (``trainer.rllog_run`` with the TRL mixin) or at interpreter exit.
    """

    def __init__(self, report_to: Any = None, run: "rllog.Run | None" = None, **init_kwargs: Any):
        self.report_to = report_to
        self.run = run
        self.init_kwargs = init_kwargs
        self._skipped: set[str] = set()

    def start(self, args: Any, model: Any = None) -> "rllog.Run":
        """Start the run now (idempotent)."""
        if self.run is None:
            # The trainer has reduced its metrics across ranks already and logs from the main process only.
            kwargs = {"project": "huggingface", "name": getattr(args, "run_name", None), "reduce_across_ranks": False} | self.init_kwargs
            self.run = rllog.init(report_to=self.report_to, config=trainer_config(args, model), **kwargs)
        return self.run

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero:
            self.start(args, model)
        if self.run is not None:
            # rllog.log(...) without a step, from a reward function or another callback, lands on the
            # step the trainer is computing (the one its own logs for this step will carry).
            self.run.step_source = lambda: state.global_step + (1 if self._in_step else 0)

    _in_step = False

    def on_step_begin(self, args, state, control, **kwargs):
        self._in_step = True

    def on_step_end(self, args, state, control, **kwargs):
        self._in_step = False

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        run = self.start(args, model)
        values = {rename(key): math.nan if value is None else value for key, value in logs.items()}
        try:
            run.log(values, step=state.global_step)  # validates; the common case: every value is a number
            return
        except InvalidValue:
            values = self._numbers_only(logs)
        if values:
            run.log(values, step=state.global_step)

    def _numbers_only(self, logs: dict) -> dict:
        """``logs`` renamed, without the values that are not numbers (each warned about once)."""
        values = {}
        try:
            flat = flatten(logs)  # as run.log would: nested dicts become "a/b"
        except InvalidValue:
            flat = logs
        for key, value in flat.items():
            if value is None:
                value = math.nan
            try:
                to_scalar(key, value)
            except InvalidValue:
                if key not in self._skipped:
                    self._skipped.add(key)
                    log.warning("rllog: %r is not a number (%s); not logged as a metric", key, type(value).__name__)
                continue
            values[rename(key)] = value
        return values
