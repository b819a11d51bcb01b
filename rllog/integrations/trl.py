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


class RLLogCompletionsCallback:
    """Every ``freq`` steps, generate completions for eval prompts and log them as a table through rllog.

    What TRL's ``LogCompletionsCallback`` does for wandb and Comet only, for every selected tracker, and
    for any Hugging Face trainer (SFT, DPO, GRPO...) whose eval dataset has a ``"prompt"`` column.
    Each call logs that step's rows (``prompt``, ``completion``) as table ``name`` at the step.

    Args:
        trainer: the trainer it is attached to.
        run: the rllog run (default: ``trainer.rllog_run`` with the mixin, else :func:`rllog.current_run`).
        generation_config: a ``transformers.GenerationConfig``.
        num_prompts: how many eval prompts (the first ones); default all.
        freq: every how many steps; default the trainer's ``eval_steps``.
        name: the table's name.

    Example:
        >>> trainer.add_callback(RLLogCompletionsCallback(trainer, num_prompts=8, freq=50))
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        from transformers import TrainerCallback

        # A TrainerCallback subclass made on first use: transformers is not imported with this module.
        if not issubclass(cls, TrainerCallback):
            cls = type(cls.__name__, (cls, TrainerCallback), {})
        return object.__new__(cls)

    def __init__(self, trainer: Any, run: Any = None, generation_config: Any = None, num_prompts: int | None = None, freq: int | None = None, name: str = "completions"):
        if trainer.eval_dataset is None or "prompt" not in trainer.eval_dataset.column_names:
            raise ValueError("RLLogCompletionsCallback needs a trainer whose eval_dataset has a 'prompt' column")
        self.trainer = trainer
        self.run = run
        self.generation_config = generation_config
        self.freq = freq
        self.name = name
        self.eval_dataset = trainer.eval_dataset if num_prompts is None else trainer.eval_dataset.select(range(num_prompts))
        self._last_logged_step = -1

    def _run(self):
        import rllog

        return self.run or getattr(self.trainer, "rllog_run", None) or rllog.current_run()

    def on_step_end(self, args, state, control, **kwargs):
        freq = self.freq or state.eval_steps or 1
        if state.global_step == self._last_logged_step or state.global_step % freq != 0:
            return
        self._last_logged_step = state.global_step
        from accelerate.utils import gather_object
        from trl.data_utils import maybe_apply_chat_template
        from trl.trainer.callbacks import _generate_completions

        tokenizer = kwargs.get("processing_class") or self.trainer.processing_class
        tokenizer.padding_side = "left"
        accelerator = self.trainer.accelerator
        with accelerator.split_between_processes(self.eval_dataset["prompt"]) as prompts:
            prompts = [maybe_apply_chat_template({"prompt": p}, tokenizer)["prompt"] for p in prompts]
            completions = _generate_completions(prompts, model=self.trainer.model_wrapped, tokenizer=tokenizer, accelerator=accelerator,
                                                generation_config=self.generation_config, batch_size=args.per_device_eval_batch_size,
                                                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
            completions = gather_object(completions)
            prompts = gather_object(prompts)
        run = self._run()
        if accelerator.is_main_process and run is not None:
            run.log_table(self.name, {"prompt": [_text(p) for p in prompts], "completion": [_text(c) for c in completions]}, step=state.global_step)
