"""``RLLogMixin``: TRL's GRPO and RLOO trainers log through rllog.

Example:
    >>> from trl import GRPOTrainer, GRPOConfig
    >>> from rllog.integrations.trl import RLLogMixin
    >>> class Trainer(RLLogMixin, GRPOTrainer):
    ...     pass
    >>> trainer = Trainer(model=..., reward_funcs=[...], args=GRPOConfig(report_to=["wandb", "mlflow"], log_completions=True))
    >>> trainer.train()
    >>> trainer.rllog_run.finish()

What changes:

- The ``report_to`` names rllog serves (wandb, tensorboard, mlflow, trackio, comet_ml, and rllog's own
  parquet/console) go through rllog; transformers' callbacks for those names are removed, so nothing is
  logged twice. Names rllog does not serve (e.g. clearml) stay with transformers. ``rllog_report_to=``
  overrides the list; with no name selected, rllog writes its embedded default (parquet).
- Every logged step's completions table (prompt, completion, one column per reward function, every
  ``log_extra`` column, advantage) goes to every selected tracker through ``log_table`` at that step,
  from the main process only. TRL's own wandb/trackio-only table path does not run.
- ``trl.extras.profiling`` would write ``profiling/...`` timings straight to wandb/mlflow/trackio; with
  the mixin those direct calls are off (they read ``args.report_to``, from which the mixin removes the
  names it serves after set-up): timings are not tracker metrics of the run.
"""

from __future__ import annotations

import json
from typing import Any

from rllog.integrations.transformers import RLLogCallback, split_report_to


def _text(value: Any) -> str:
    """A prompt or completion as text: conversations (lists of messages) as ``role: content`` lines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
        return "\n".join(f"{m.get('role', '?')}: {m['content'] if isinstance(m['content'], str) else json.dumps(m['content'], default=str)}" for m in value)
    return json.dumps(value, default=str)


class RLLogMixin:
    """Put first in the bases of a TRL trainer: ``class T(RLLogMixin, GRPOTrainer)``.

    Keyword args (besides the trainer's own):
        rllog_report_to: rllog backends, overriding the ones taken from ``args.report_to``.
        rllog_options: passed to :func:`rllog.init` (``project``, ``name``, ``run_dir``, ``backend_options``...).
    """

    def __init__(self, *args: Any, rllog_report_to: Any = None, rllog_options: dict | None = None, **kwargs: Any):
        from transformers.integrations import INTEGRATION_TO_CALLBACK

        # transformers refuses names it does not know (parquet, console): take them out before it looks.
        training_args = kwargs.get("args", args[2] if len(args) > 2 else None)
        ours, theirs = split_report_to(getattr(training_args, "report_to", None))
        if training_args is not None:
            training_args.report_to = [n for n in training_args.report_to if n in INTEGRATION_TO_CALLBACK]
        super().__init__(*args, **kwargs)
        for name in ours:
            if name in INTEGRATION_TO_CALLBACK:
                self.remove_callback(INTEGRATION_TO_CALLBACK[name])
        selected = rllog_report_to if rllog_report_to is not None else (ours or None)
        options = {"project": "trl", "name": self.args.run_name} | (rllog_options or {})
        self.rllog_callback = RLLogCallback(report_to=selected, **options)
        self.add_callback(self.rllog_callback)
        # TRL's completions table and profiling read args.report_to; rllog serves those names now.
        self.args.report_to = theirs
        if self.accelerator.is_main_process:
            self.rllog_callback.start(self.args, self.model)

    @property
    def rllog_run(self):
        """The rllog run (None on processes other than the main one)."""
        return self.rllog_callback.run

    def log(self, logs: dict, start_time: float | None = None) -> None:
        table = self._rllog_completions() if self.accelerator.is_main_process else None
        super().log(logs, start_time)
        if table is not None and self.rllog_run is not None:
            self.rllog_run.log_table("completions", table, step=self.state.global_step)

    def _rllog_completions(self) -> dict | None:
        if not getattr(self, "log_completions", False) or not hasattr(self, "_logs") or not self._logs["prompt"]:
            return None
        mode = "train" if self.model.training else "eval"
        if not any(self._metrics[mode].values()):  # no new generations since the last log (e.g. the final summary)
            return None
        logs = self._logs
        table = {"prompt": [_text(p) for p in logs["prompt"]], "completion": [_text(c) for c in logs["completion"]]}
        table.update({name: list(values) for name, values in logs["rewards"].items()})
        table.update({name: list(values) for name, values in logs.get("extra", {}).items()})
        table["advantage"] = list(logs["advantages"])
        n = len(table["prompt"])
        # a log_extra column first seen in a later batch is shorter: its earlier rows are empty
        return {k: ([None] * (n - len(v)) + v)[-n:] for k, v in table.items()}
