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

- The ``report_to`` names rllog has a backend for (wandb, tensorboard, mlflow, trackio, comet_ml, swanlab,
  clearml, dvclive, and rllog's own parquet/console; ``"all"`` included) go through rllog; transformers never
  builds its callbacks for them, so nothing is logged twice. Other names (e.g. neptune) stay with
  transformers. ``rllog_report_to=`` overrides the list. ``"none"`` (transformers' default) selects nothing:
  no tracker and no files, as in transformers (the run is a :class:`rllog.NullRun`). The run's config records
  the ``report_to`` the user gave. A transformers tracker callback (a subclass) for a name rllog serves, passed
  in ``callbacks=``, is warned about once: it opens a second run of that tracker.
- Metric names are transformers' (``train/reward``, ``eval/reward``: :class:`RLLogCallback`).
- Every logged step's completions table (``step``, prompt, completion, one column per reward function,
  every ``log_extra`` column, advantage; one row per prompt with ``log_unique_prompts``) goes to every
  selected tracker through ``log_table`` at that step, from the main process only: ``completions`` in
  training, ``eval/completions`` in evaluation. Conversations stay lists of messages. TRL's own
  wandb/trackio-only table path does not run.
- ``trl.extras.profiling``'s ``profiling/Time taken: ...`` timings, which TRL would write straight to
  wandb/mlflow/trackio, are logged through rllog, to every selected tracker, at the step being trained, under
  TRL's names (``GRPOTrainer.<method>``) whatever the mixin class is called.
- The run starts when ``train()`` or ``evaluate()`` starts. Both return without waiting for the trackers: as
  they end, the trackers are asked to flush what they logged at once (``trainer.rllog_callback.wait_for_trackers()``
  waits for that; ``push_to_hub()`` does, so the TensorBoard files it uploads hold the last step). A trainer that
  is garbage-collected finishes its run. ``train(resume_from_checkpoint=...)``
  continues the same run and tracker runs.
"""

from __future__ import annotations

import contextvars
import functools
import json
import sys
import warnings
from typing import TYPE_CHECKING, Any

from rllog.errors import RunFinished
from rllog.integrations.transformers import (
    TRAIN_PREFIX,
    RLLogCallback,
    prepare_agent,
    selects_nothing,
    split_report_to,
    warn_second_tracker_run,
)

EVAL_TABLE = "eval/completions"
TRAIN_TABLE = "completions"
_THIS_FILE = (lambda: None).__code__.co_filename  # what the warnings module reports for a frame of this module
# While a mixin trainer trains or evaluates: the callback whose run TRL's profiling timings go to, the trainer's class
# name, the name of the TRL class it derives from (the timings are named after TRL's class, whatever the user's is)
# and the trainer's HeldTimings.
_profiling_callback: contextvars.ContextVar[tuple[RLLogCallback, str, str, HeldTimings] | None] = contextvars.ContextVar(
    "rllog_profiling_callback", default=None
)


class HeldTimings:
    """TRL's profiling timings of the step being trained, held to be logged as one record (``run.log``) rather than
    one record each (8 a GRPO step, 1,920 of a 240-step training's 2,161 records): each record costs the journal
    writer an encoding with the GIL held, the trainer's garbage collector its objects and the agent a delivery
    (docs/decisions.md). Every timing keeps the step it was taken at, as a ``log`` at that
    moment would have given it. What is held is logged when a timing of another step, or one already held, comes;
    as the trainer logs (before its metrics, the order ``log`` calls gave); as ``train()`` and ``evaluate()``
    return; and before the run flushes or finishes (``Run.before_flush``: a SIGTERM's finish included).

    No lock: the finish of a SIGTERM runs on another thread while the main thread waits inside the signal handler,
    possibly inside :meth:`add`; a lock held there would never be released. One swap of :attr:`held` hands the
    record over, and a held dict is never changed once made, so a flush on another thread racing with :meth:`add`
    can log a timing twice, never lose it.
    """

    def __init__(self) -> None:
        self.run: Any = None
        self.held: tuple[int, dict[str, float]] | None = None  # (step, {name: seconds})

    def add(self, run: Any, name: str, duration: float) -> None:
        step_source = getattr(run, "step_source", None)
        if step_source is None:  # a run no trainer drives the step of: nothing to hold a step's timings by
            self._log(run, {name: duration}, None)
            return
        if run is not self.run:
            self.log_held()
            self.run = run
            run.before_flush(self.log_held)
        step = step_source()
        held = self.held
        if held is None or held[0] != step or name in held[1]:
            self.log_held()
            self.held = (step, {name: duration})
        else:  # a new dict, never one handed over: a flush on another thread meanwhile logs this one twice at worst
            self.held = (step, {**held[1], name: duration})

    def log_held(self) -> None:
        held, self.held = self.held, None
        if held is not None:
            self._log(self.run, held[1], held[0])

    @staticmethod
    def _log(run: Any, values: dict[str, float], step: int | None) -> None:
        try:
            run.log(values, step=step)
        except RunFinished:
            pass  # the user finished the run and trains on: there is nowhere to log


def _trl_class_name(cls: type) -> str:
    """The name of the first TRL trainer class ``cls`` derives from (``GRPOTrainer`` for ``class Trainer(RLLogMixin,
    GRPOTrainer)``), as TRL names its profiling timings without the mixin; ``cls``'s own name if none is TRL's."""
    for base in cls.__mro__:
        if base.__module__.split(".")[0] == "trl":
            return base.__name__
    return cls.__name__


def _profiling_name(name: str, current: tuple[RLLogCallback, str, str, HeldTimings]) -> str:
    """TRL's timing name (``<class>.<method>``) with the user's class name replaced by TRL's."""
    _, own, trl, _ = current
    return trl + name[len(own) :] if name.startswith(own + ".") else name


def _text(value: Any) -> str:
    """A prompt or completion as text: conversations (lists of messages) as ``role: content`` lines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
        return "\n".join(
            f"{m.get('role', '?')}: {m['content'] if isinstance(m['content'], str) else json.dumps(m['content'], default=str)}"
            for m in value
        )
    return json.dumps(value, default=str)


def _is_conversation(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def _messages(value: Any) -> Any:
    """A prompt or completion for a table cell: text as it is; a conversation as a list of messages whose
    fields are text (a structured ``content``, e.g. multimodal blocks with their images dropped, as JSON), so
    every call's column has one type; anything else as JSON."""
    if isinstance(value, str):
        return value
    if _is_conversation(value):
        from trl.trainer.utils import strip_images_from_messages

        return [
            {str(k): v if v is None or isinstance(v, str) else json.dumps(v, default=str) for k, v in m.items()}
            for m in strip_images_from_messages(value)
        ]
    return json.dumps(value, default=str)


def _first_rows_per_prompt(prompts: list) -> list[int]:
    """Indices of the first row of each distinct prompt (TRL's ``log_unique_prompts``, compared as text)."""
    seen: set[str] = set()
    keep = []
    for i, prompt in enumerate(prompts):
        text = str(prompt)
        if text not in seen:
            seen.add(text)
            keep.append(i)
    return keep


def _caller_frame():
    """The first frame outside this module: the user's code that built or called the trainer."""
    frame: Any = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == _THIS_FILE:
        frame = frame.f_back
    return frame


def _warnings_at(frame, call, *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)`` with the warnings that would point at this module (the mixin's ``__init__`` is
    one frame more between the user and TRL's ``stacklevel``) pointing at ``frame`` instead, under the
    user's filters and once-per-location registry, as without the mixin.

    The filters are left alone (changing them resets every module's once-per-location registry); this
    module's registry is emptied instead, so each call's warnings reach :func:`warnings.showwarning`.
    """
    show = warnings.showwarning

    def reissue(message, category, filename, lineno, file=None, line=None):
        if filename != _THIS_FILE:
            return show(message, category, filename, lineno, file, line)
        module_globals = frame.f_globals
        warnings.warn_explicit(
            message,
            category,
            frame.f_code.co_filename,
            frame.f_lineno,
            module=module_globals.get("__name__"),
            registry=module_globals.setdefault("__warningregistry__", {}),
            module_globals=module_globals,
        )

    globals().pop("__warningregistry__", None)
    warnings.showwarning = reissue
    try:
        return call(*args, **kwargs)
    finally:
        if warnings.showwarning is reissue:
            warnings.showwarning = show
        globals().pop("__warningregistry__", None)


def _route_profiling_through_rllog() -> None:
    """Make ``trl.extras.profiling`` log its timings through rllog too (once per process): TRL writes them only
    to wandb/mlflow/trackio directly, and only for names left in ``args.report_to``, which rllog serves."""
    try:
        from trl.extras.profiling import ProfilingContext
    except ImportError:
        return
    original = getattr(ProfilingContext, "_log_metrics", None)
    if original is None or getattr(original, "_rllog", False):
        return

    @functools.wraps(original)
    def _log_metrics(self, duration: float) -> None:
        original(self, duration)
        current = _profiling_callback.get()
        run = current[0].run if current is not None else None
        if current is None or run is None or not self.is_main_process:
            return
        current[3].add(run, f"{self.metric_prefix}: {_profiling_name(self.name, current)}", duration)

    _log_metrics._rllog = True  # type: ignore[attr-defined]
    ProfilingContext._log_metrics = _log_metrics


if TYPE_CHECKING:  # the mixin's attributes (args, state, model, train, log...) are the trainer's
    from transformers import Trainer as _TrainerBase
else:
    _TrainerBase = object


class RLLogMixin(_TrainerBase):
    """Put first in the bases of a TRL trainer: ``class T(RLLogMixin, GRPOTrainer)``.

    Keyword args (besides the trainer's own):
        rllog_report_to: rllog backends, overriding the ones taken from ``args.report_to``.
        rllog_options: passed to :func:`rllog.init` (``project``, ``name``, ``run_dir``, ``backend_options``...);
            they win over ``args.project`` and ``args.run_name``.
        rllog_train_prefix: put before training metric names (default ``"train/"``, as transformers'
            callbacks do); ``""`` logs them bare.
    """

    def __init__(
        self,
        *args: Any,
        rllog_report_to: Any = None,
        rllog_options: dict | None = None,
        rllog_train_prefix: str = TRAIN_PREFIX,
        **kwargs: Any,
    ):
        from transformers.integrations import INTEGRATION_TO_CALLBACK

        self._rllog_timings = HeldTimings()
        # transformers builds a callback for each name left in report_to (and refuses names it does not know, such
        # as parquet): only the names rllog does not serve are left to it, so it never builds one rllog replaces.
        training_args = kwargs.get("args", args[2] if len(args) > 2 else None)
        users_report_to = list(getattr(training_args, "report_to", None) or [])
        ours, theirs = split_report_to(getattr(training_args, "report_to", None))
        # transformers' "none" (its default) selects no tracker: no rllog run, no files either
        selected = rllog_report_to if rllog_report_to is not None else (ours or "none")
        if training_args is not None:
            training_args.report_to = [n for n in theirs if n in INTEGRATION_TO_CALLBACK]
            if not selects_nothing(selected):  # the trackers import while the model loads (rank 0 only)
                prepare_agent(self, selected, rllog_options or {})
        _warnings_at(_caller_frame(), super().__init__, *args, **kwargs)
        if training_args is None:
            users_report_to = list(self.args.report_to or [])
            ours, theirs = split_report_to(self.args.report_to)
            selected = rllog_report_to if rllog_report_to is not None else (ours or "none")
        self.rllog_callback = RLLogCallback(
            report_to=selected, train_prefix=rllog_train_prefix, args_report_to=users_report_to, **(rllog_options or {})
        )
        self.add_callback(self.rllog_callback)
        self._warn_tracker_callbacks(ours)
        # TRL's completions table and profiling read args.report_to; rllog serves those names now.
        self.args.report_to = theirs
        _route_profiling_through_rllog()

    def _warn_tracker_callbacks(self, ours: list[str]) -> None:
        """Warn (once) about a transformers tracker callback for a tracker rllog serves that is still in the trainer:
        a user's subclass (``class MyCallback(WandbCallback)``, passed in ``callbacks=``), which opens a second run."""
        from transformers.integrations import INTEGRATION_TO_CALLBACK

        for callback in self.callback_handler.callbacks:
            for name in ours:
                tracker_callback = INTEGRATION_TO_CALLBACK.get(name)
                if tracker_callback is not None and isinstance(callback, tracker_callback):
                    warn_second_tracker_run(name, f"{type(callback).__name__} (a {tracker_callback.__name__})")
                    self.rllog_callback._other_runs_checked = True
                    return

    @property
    def rllog_run(self):
        """The rllog run (None before ``train()``/``evaluate()``; a :class:`rllog.NullRun` on processes other than
        the main one)."""
        return self.rllog_callback.run

    def _profiling_target(self) -> tuple[RLLogCallback, str, str, HeldTimings]:
        return self.rllog_callback, type(self).__name__, _trl_class_name(type(self)), self._rllog_timings

    def train(self, *args: Any, **kwargs: Any):
        token = _profiling_callback.set(self._profiling_target())
        try:
            return super().train(*args, **kwargs)
        except KeyboardInterrupt:
            self.rllog_callback.train_raised("killed")
            raise
        except Exception:
            self.rllog_callback.train_raised("failed")
            raise
        finally:
            self._rllog_timings.log_held()
            _profiling_callback.reset(token)

    def evaluate(self, *args: Any, **kwargs: Any):
        # reward functions may rllog.log() during it, on every process: each needs a current run
        self.rllog_callback.end_raised_train()
        if self.accelerator.is_main_process:
            self.rllog_callback.start(self.args, self.model, self.state)
        else:
            self.rllog_callback.start_elsewhere()
        token = _profiling_callback.set(self._profiling_target())
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self._rllog_timings.log_held()
            _profiling_callback.reset(token)

    def push_to_hub(self, *args: Any, **kwargs: Any):
        # TensorBoard writes under output_dir/runs, which the push uploads: its files must hold the last step
        self.rllog_callback.wait_for_trackers()
        return super().push_to_hub(*args, **kwargs)

    def log(self, logs: dict, start_time: float | None = None) -> None:
        self._rllog_timings.log_held()  # before the step's metrics, as each timing's own log() came before them
        table = self._rllog_completions() if self.accelerator.is_main_process else None
        super().log(logs, start_time)
        if table is not None and self.rllog_run is not None:
            self.rllog_run.log_table(*table, step=self.state.global_step)

    def _rllog_completions(self) -> tuple[str, dict] | None:
        """(table name, columns) of the generations since the last log, or None."""
        if not getattr(self, "log_completions", False) or not hasattr(self, "_logs") or not self._logs["prompt"]:
            return None
        mode = "train" if self.model.training else "eval"
        if not any(self._metrics[mode].values()):  # no new generations since the last log (e.g. the final summary)
            return None
        logs = self._logs
        n = len(logs["prompt"])
        table = {
            "step": [self.state.global_step] * n,
            "prompt": [_messages(p) for p in logs["prompt"]],
            "completion": [_messages(c) for c in logs["completion"]],
        }
        table.update({name: list(values) for name, values in logs["rewards"].items()})
        table.update({name: list(values) for name, values in logs.get("extra", {}).items()})
        table["advantage"] = list(logs["advantages"])
        # a log_extra column first seen in a later batch is shorter: its earlier rows are empty
        table = {k: ([None] * (n - len(v)) + v)[-n:] for k, v in table.items()}
        if getattr(self, "log_unique_prompts", False):
            keep = _first_rows_per_prompt(table["prompt"])
            table = {k: [v[i] for i in keep] for k, v in table.items()}
        return (TRAIN_TABLE if mode == "train" else EVAL_TABLE), table


class RLLogCompletionsCallback:
    """Every ``freq`` steps, generate completions for eval prompts and log them as a table through rllog.

    What TRL's ``LogCompletionsCallback`` does for wandb and Comet only, for every selected tracker, and
    for any Hugging Face trainer (SFT, DPO, GRPO...) whose eval dataset has a ``"prompt"`` column.
    Each call logs that step's rows (``step``, ``prompt``, ``completion``) as table ``name`` at the step.
    The tokenizer is left as it was found (generation pads on the left only while it generates).

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

    def __init__(
        self,
        trainer: Any,
        run: Any = None,
        generation_config: Any = None,
        num_prompts: int | None = None,
        freq: int | None = None,
        name: str = "completions",
    ):
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
        tokenizer = kwargs.get("processing_class") or self.trainer.processing_class
        prompts, completions = self._generate(args, tokenizer)
        run = self._run()
        if self.trainer.accelerator.is_main_process and run is not None:
            table = {
                "step": [state.global_step] * len(prompts),
                "prompt": [_text(p) for p in prompts],
                "completion": [_text(c) for c in completions],
            }
            run.log_table(self.name, table, step=state.global_step)

    def _generate(self, args: Any, tokenizer: Any) -> tuple[list, list]:
        from accelerate.utils import gather_object
        from trl.data_utils import maybe_apply_chat_template
        from trl.trainer.callbacks import _generate_completions

        accelerator = self.trainer.accelerator
        padding_side = tokenizer.padding_side  # the data collator pads with it too: put it back after
        tokenizer.padding_side = "left"
        try:
            with accelerator.split_between_processes(self.eval_dataset["prompt"]) as prompts:
                prompts = [maybe_apply_chat_template({"prompt": p}, tokenizer)["prompt"] for p in prompts]
                completions = _generate_completions(
                    prompts,
                    model=self.trainer.model_wrapped,
                    tokenizer=tokenizer,
                    accelerator=accelerator,
                    generation_config=self.generation_config,
                    batch_size=args.per_device_eval_batch_size,
                    gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
                )
                return gather_object(prompts), gather_object(completions)
        finally:
            tokenizer.padding_side = padding_side
