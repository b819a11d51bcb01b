"""``RLLogCallback``: any Hugging Face ``Trainer`` logs through rllog.

Example:
    >>> from transformers import Trainer
    >>> from rllog.integrations.transformers import RLLogCallback
    >>> callback = RLLogCallback(report_to="mlflow,parquet")
    >>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[callback])
    >>> trainer.train()
    >>> callback.finish()                      # or finish_run(trainer)

Names are the ones transformers' own callbacks give wandb, TensorBoard, trackio and Comet (their
``rewrite_logs``): training keys get ``train/`` (``train/loss``, ``train/reward``...), ``eval_x`` becomes
``eval/x`` and ``test_x`` ``test/x``, the same in every tracker (MLflow included); ``train_prefix=""``
drops the ``train/``. The end-of-training summary (``train_runtime``...) arrives once, at the last step.
A ``None`` value (TRL logs one for a metric whose every sample was NaN) is logged as NaN; a value that is
not a number (a string, a list) is not a metric and is skipped with a warning naming it, once per key.

Lifecycle: the run starts when training (or the first log of an evaluation) starts, on the global main
process (the other processes get a :class:`rllog.NullRun`, so that ``rllog.log`` in a reward function works
on every rank and writes nothing there); ``train()`` and ``evaluate()`` do not wait for the trackers: as they
end they ask every tracker to flush what they logged at once (:meth:`RLLogCallback.wait_for_trackers` waits for
that); the run stays open for later ``evaluate()`` calls and is finished by
:meth:`RLLogCallback.finish`, when the trainer is garbage-collected, or at interpreter exit. A trainer
resumed from a checkpoint (``train(resume_from_checkpoint=...)``) continues the same rllog run and
tracker runs, as a new attempt, whatever run the callback had open (in this process too, after a ``train()``
that raised or an ``evaluate()``): the run's id and directory travel in the checkpoint's ``trainer_state.json``.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import math
import os
import queue
import socket
import sys
import threading
import weakref
from datetime import datetime
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

import rllog
from rllog import messages
from rllog.errors import InvalidValue, RunFinished
from rllog.registry import BUILTIN
from rllog.validate import flatten, to_scalar

log = logging.getLogger("rllog.integrations")

# transformers' report_to names that rllog serves: every built-in backend (wandb, tensorboard, mlflow, trackio,
# comet_ml, swanlab, clearml, dvclive: transformers' names are rllog's) and rllog's own parquet and console.
SERVED = {name: name for name in BUILTIN}
# What transformers' callbacks keep as the run summary (WandbCallback's single_value_scalars), as wandb names them.
WANDB_SUMMARY_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "total_flos")
# The tracker runs a process can hold open through each tracker's own module-level API (tracker -> how to find it).
# rllog's own sinks never make one (wandb's reinit="create_new", MLflow's client, trackio's Run objects), so one found
# in the trainer's process was started beside rllog: a transformers callback of the user's (a subclass) or their code.
OWN_RUN_FINDERS = {
    "wandb": lambda module: getattr(module, "run", None),
    "mlflow": lambda module: module.active_run(),
}
PREFIXES = {"eval_": "eval/", "test_": "test/"}
TRAIN_PREFIX = "train/"
# Where the Comet backend lists a run's offline archives (RUN_DIR/trackers/comet_ml.json, docs/formats.md), and the
# line Comet itself prints for them at the end of a process that logged offline (its OFFLINE_EXPERIMENT_END).
COMET_TRACKER_FILE = os.path.join("trackers", "comet_ml.json")
COMET_ARCHIVES_KEY = "offline_archives"
COMET_UPLOAD_HINT = "COMET INFO: To upload this offline experiment, run:\n    comet upload {}"
# The key, in TrainerState.stateful_callbacks (saved in every checkpoint's trainer_state.json), of the run to resume.
STATE_KEY = "rllog"
DEFAULT_PROJECT = "huggingface"  # TrainingArguments.project's default, and the wandb project transformers uses by default


def rename(key: str, train_prefix: str = TRAIN_PREFIX) -> str:
    """``eval_loss`` -> ``eval/loss``, ``test_x`` -> ``test/x``, any other key -> ``train_prefix + key``.

    Example:
        >>> rename("eval_loss"), rename("reward"), rename("reward", train_prefix="")
        ('eval/loss', 'train/reward', 'reward')
    """
    for prefix, replacement in PREFIXES.items():
        if key.startswith(prefix):
            return replacement + key[len(prefix) :]
    return train_prefix + key


def split_report_to(report_to: Any) -> tuple[list[str], list[str]]:
    """Split a transformers ``report_to`` into (names rllog serves, names left to transformers)."""
    if report_to in (None, "none"):
        return [], []
    if isinstance(report_to, str):
        report_to = [p.strip() for p in report_to.split(",")]
    ours = [SERVED[n] for n in report_to if n in SERVED]
    theirs = [n for n in report_to if n not in SERVED and n != "none"]
    return ours, theirs


def selects_nothing(report_to: Any) -> bool:
    """Whether ``report_to`` names no tracker at all (``"none"``, ``[]``): transformers' meaning, no tracker, no
    files. ``None`` (not given) is not nothing: it selects rllog's embedded default."""
    return report_to is not None and not _selected_names(report_to) and not _has_sink_object(report_to)


def _has_sink_object(report_to: Any) -> bool:
    items = report_to if isinstance(report_to, (list, tuple)) else [report_to]
    return any(not isinstance(item, str) for item in items)


def trainer_config(args: Any, model: Any = None, report_to: Any = None) -> dict:
    """The hyperparameters a tracker shows: the TrainingArguments, the model config under ``model/``, and
    ``model/num_parameters`` (as transformers' callbacks record it).

    Args:
        report_to: the ``report_to`` to record instead of ``args.report_to`` (an integration that rewrote
            ``args.report_to``, like the TRL mixin, passes the user's).
    """
    config = dict(args.to_dict()) if hasattr(args, "to_dict") else {}
    if report_to is not None:
        config["report_to"] = list(report_to)
    model_config = getattr(model, "config", None)
    if model_config is not None and hasattr(model_config, "to_dict"):
        config["model"] = model_config.to_dict()
    try:
        config.setdefault("model", {})["num_parameters"] = model.num_parameters()
    except (AttributeError, TypeError):
        pass
    return config


def finish_run(trainer: Any, status: str = "finished", timeout: float = 120.0):
    """Finish the rllog run of ``trainer`` (the run of its :class:`RLLogCallback`, the TRL mixin's included).

    Returns:
        The run's :class:`rllog.FinishReport`, or None on processes other than the main one (and before
        the run started).

    Raises:
        ValueError: ``trainer`` has no RLLogCallback.
    """
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, RLLogCallback):
            return callback.finish(status, timeout)
    raise ValueError(f"{type(trainer).__name__} has no RLLogCallback (add one with callbacks=[RLLogCallback(...)])")


class _StepClock:
    """The trainer's current step, for ``run.step_source``: it holds the TrainerState, never the callback or
    the trainer, so the run does not keep them alive."""

    def __init__(self) -> None:
        self.state: Any = None
        self.in_step = False

    def current(self) -> int:
        step = self.state.global_step if self.state is not None else 0
        return step + (1 if self.in_step else 0)


class _Release:
    """What finishes a run whose callback was garbage-collected: the run, and the status to finish it with."""

    def __init__(self, run: Any) -> None:
        self.run: Any = run
        self.status = "finished"
        self.orphaned = False  # set by the finalizer: the callback (and its trainer) is gone
        self.hinted = False  # the `comet upload` hint of the finished run was said

    def say_offline_uploads(self) -> None:
        """Once the run is finished (by anyone: ``trainer.rllog_run.finish()`` included), say its upload hint, once."""
        if self.run.finished and not self.hinted:
            self.hinted = True
            say_offline_uploads(self.run)

    def finish(self) -> None:
        try:
            if not self.run.finished:
                self.run.finish(self.status)
            self.say_offline_uploads()
        except Exception as exc:  # on the reaper thread or at a new run's start: nobody to raise to
            log.error("rllog: finishing %s after its trainer was released failed: %s", self.run.run_dir, exc)
        finally:
            _releases.discard(self)


_releases: set[_Release] = set()  # the runs integrations started and have not finished
_orphans: queue.SimpleQueue[_Release] = queue.SimpleQueue()
_reaper_lock = threading.Lock()
_reaper: threading.Thread | None = None


def _on_callback_collected(release: _Release) -> None:
    """The finalizer of a callback: may run at any allocation, on any thread, with any lock held, so it only
    marks and queues (``SimpleQueue.put`` is safe there); the reaper thread finishes the run."""
    release.orphaned = True
    _orphans.put(release)


def say_offline_uploads(run: Any) -> None:
    """On the trainer's stderr, what Comet prints at the end of a process that logged offline: the ``comet upload``
    command for the run's archives (the Comet sink runs in the delivery agent, whose output goes to its log)."""
    run_dir = getattr(run, "run_dir", None)
    if run_dir is None:
        return
    try:
        archives = json.loads((Path(run_dir) / COMET_TRACKER_FILE).read_text()).get(COMET_ARCHIVES_KEY) or []
    except (OSError, ValueError, AttributeError):  # no Comet sink, or nothing it could write: nothing to say
        return
    if archives:
        messages.say(COMET_UPLOAD_HINT.format(" ".join(archives)))


@atexit.register
def _finish_integration_runs() -> None:
    """At exit, finish the runs the integrations started (with the outcome their trainer saw) before rllog finishes
    every other live run, and say the ``comet upload`` hint of each, as Comet says it at the exit of a process that
    logged offline."""
    crashed = getattr(sys, "last_type", None) is not None  # an uncaught exception: rllog's own rule at exit
    for release in list(_releases):
        if crashed and release.status == "finished":
            release.status = "failed"
        release.finish()


def _reap_forever() -> None:
    while True:
        _orphans.get().finish()


def _start_reaper() -> None:
    global _reaper
    with _reaper_lock:
        if _reaper is None or not _reaper.is_alive():
            _reaper = threading.Thread(target=_reap_forever, name="rllog-integration-reaper", daemon=True)
            _reaper.start()


def _release_collected_runs() -> None:
    """Before a new run: finish the runs of trainers that are garbage now (a replaced trainer in a notebook, a
    sweep, a test suite), so that one process never keeps one delivery agent per trainer it ever built."""
    for release in [r for r in list(_releases) if r.run.finished]:  # finished by the user: nothing to release
        release.say_offline_uploads()
        _releases.discard(release)
    if not _releases:
        return
    gc.collect()  # trainers are reference cycles: without a collection a replaced trainer lingers
    for release in [r for r in list(_releases) if r.orphaned]:
        release.finish()  # waits for the reaper if it is finishing this one already


def prepare_agent(owner: object, report_to: Any, init_kwargs: dict) -> None:
    """Start the delivery agent while ``owner`` (a trainer, a callback) is being built, so the trackers are
    imported before ``train()`` (:func:`rllog.prepare`); ``owner`` collected without training releases it."""
    from rllog.run import delivery_link

    try:
        kwargs = {k: init_kwargs[k] for k in ("delivery", "system_metrics") if k in init_kwargs}
        standby = delivery_link.waiting_standby() if rllog.prepare(report_to, **kwargs) else None
        if standby is not None:
            weakref.finalize(owner, delivery_link.release_standby, standby).atexit = False
    except Exception as exc:  # only an optimisation: the run reports any real problem when it starts
        log.debug("rllog: no standby agent: %s", exc)


class RLLogCallback(TrainerCallback):
    """Sends a Trainer's logs (and config) to an rllog run.

    Args:
        report_to: rllog backends (default: the embedded default, parquet); ``"none"`` (or ``[]``): no tracker and
            no files, as in transformers (the run is a :class:`rllog.NullRun`). Ignored if ``run`` is given.
        run: an existing :class:`rllog.Run` to log into (then it is yours to finish).
        train_prefix: put before training keys (default ``"train/"``, as transformers' wandb, TensorBoard,
            trackio and Comet callbacks do); ``""`` logs them bare.
        flush_timeout: seconds :meth:`wait_for_trackers` (and the TRL mixin's ``push_to_hub``) waits for the
            trackers (:meth:`rllog.Run.flush`).
        args_report_to: the ``report_to`` to record in the config instead of ``args.report_to`` (for an
            integration that rewrote ``args.report_to``).
        **init_kwargs: passed to :func:`rllog.init` (``project``, ``name``, ``run_dir``, ``backend_options``...);
            they win over what the callback takes from the TrainingArguments (``project``, ``run_name``).
    """

    def __init__(
        self,
        report_to: Any = None,
        run: rllog.Run | None = None,
        *,
        train_prefix: str = TRAIN_PREFIX,
        flush_timeout: float = 60.0,
        args_report_to: Any = None,
        **init_kwargs: Any,
    ):
        self.report_to = report_to
        self.run: Any = run  # a Run, a NullRun on ranks > 0, or None before training starts
        self.train_prefix = train_prefix
        self.flush_timeout = flush_timeout
        self.args_report_to = args_report_to
        self.init_kwargs = init_kwargs
        self.tensorboard_logdir: str | None = None
        self._skipped: set[str] = set()
        self._renamed: dict[str, str] = {}  # key -> rename(key, train_prefix) for train_prefix == _renamed_for
        self._renamed_for = train_prefix
        self._clock = _StepClock()
        self._release: _Release | None = None
        self._training = False
        # The run about to be reopened is resumed from a checkpoint (a restart: what the earlier attempt logged from
        # the resumed step on is superseded); otherwise a reopened run continues (evaluate() after finish()).
        self._resuming_checkpoint = False
        self._other_runs_checked = False  # the one look for a tracker run started beside rllog's (_warn_other_runs)
        if run is None and not selects_nothing(report_to):
            prepare_agent(self, report_to, init_kwargs)

    # -- the run ---------------------------------------------------------------------------------
    def start(self, args: Any, model: Any = None, state: Any = None) -> rllog.Run | rllog.NullRun:
        """Start the run now (idempotent); resumes the run a checkpoint's ``state`` names."""
        if self.run is not None and not (self._release is not None and self.run.finished):
            return self.run
        if selects_nothing(self.report_to):  # transformers' "none": nothing written, rllog.log still works
            self.run = rllog.NullRun(self.report_to, reduce_across_ranks=False)
            rllog._make_current(self.run)
            return self.run
        previous = self.run  # a run this callback started and that was finished: continue it
        _release_collected_runs()
        # The trainer has reduced its metrics across ranks already and logs from the main process only.
        kwargs: dict[str, Any] = {
            "project": getattr(args, "project", None) or DEFAULT_PROJECT,
            "name": _trial(state)[0] or getattr(args, "run_name", None),
            "reduce_across_ranks": False,
            "reinit": "create_new",  # this callback finishes its own runs; another trainer's stays open
        }
        kwargs.update(self._resume_kwargs(_saved_run(state), previous))
        kwargs.update(self.init_kwargs)
        kwargs["backend_options"] = self._backend_options(
            args, kwargs.get("backend_options"), _saved_run(state), _trial(state)[0], model
        )
        config = trainer_config(args, model, self._given_report_to(args))
        trial_params = _trial(state)[1]
        if trial_params:
            config["trial"] = dict(trial_params)  # the trial's hyperparameters, as transformers' callbacks log them
        self.run = rllog.init(report_to=self.report_to, config=config, **kwargs)
        if getattr(self.run, "run_dir", None) is not None:
            self._release = _Release(self.run)
            _releases.add(self._release)
            _start_reaper()
            finalizer = weakref.finalize(self, _on_callback_collected, self._release)
            finalizer.atexit = False  # at exit, rllog finishes every live run itself (with the right status)
        self.run.step_source = self._clock.current
        self._remember(state)
        return self.run

    def finish(self, status: str = "finished", timeout: float = 120.0):
        """Finish the run (``finished``, ``failed`` or ``killed``); returns its report (None without a run, and on
        processes other than the main one, whose :class:`rllog.NullRun` has nothing to report)."""
        if self.run is None:
            return None
        report = self.run.finish(status, timeout)
        if self._release is not None:
            self._release.say_offline_uploads()
        return None if isinstance(self.run, rllog.NullRun) else report

    def start_elsewhere(self) -> rllog.NullRun:
        """On a process other than the global main one: a :class:`rllog.NullRun` made the current run (idempotent).

        GRPO computes rewards on every process, so a reward function's ``rllog.log()`` runs on every rank and
        needs a current run there too; the NullRun takes the call and writes nothing. It does not reduce across
        ranks: the main process logs without a collective, so a collective here would wait for it forever.
        """
        if self.run is None:
            self.run = rllog.NullRun(self.report_to, reduce_across_ranks=False)
            rllog._make_current(self.run)
        return self.run

    def _end_run_for_trial(self, state: Any) -> None:
        """At each trial of a hyperparameter search (``train(trial=...)``): end the run this callback started, so that
        :meth:`start` starts a run of the trial's own, as transformers' wandb, trackio and MLflow callbacks do.

        In one run, every trial logged its steps from 1 again, over the previous trial's.
        """
        if not getattr(state, "is_hyper_param_search", False) or self.run is None or self._release is None:
            return  # no search, nothing open, or a run the user gave (theirs to manage)
        if not self.run.finished:
            self.run.finish("failed" if self._training else self._release.status)
        self.run, self._release = None, None

    def _end_run_for_checkpoint_resume(self, state: Any) -> None:
        """At a ``train()`` that resumes from a checkpoint naming a run: end the run this callback has open, so that
        :meth:`start` continues the checkpoint's run as a new attempt, as a resume in a fresh process does.

        Kept open, the run took the resumed steps into the attempt that had logged them already (a ``train()``
        that failed in this process: one step shown twice); and a run started by an ``evaluate()`` before the
        resume would have taken the whole resumed training, leaving the checkpoint's run unfinished.
        """
        saved = _saved_run(state)
        if not saved or self.run is None or self._release is None:
            return  # nothing open, or a run the user gave (theirs to manage)
        same = saved.get("run_id") == self.run.run_id
        self._resuming_checkpoint = same  # start() opens it again: a new attempt, restarting at the checkpoint's step
        if not self.run.finished:
            self.run.finish("failed" if self._training else self._release.status)  # a train() that never ended failed
        if not same:  # another run (an evaluate()'s): it stays as it is
            self.run, self._release = None, None  # so that start() takes the checkpoint's run, not this one

    def _resume_kwargs(self, saved: dict | None, previous: Any) -> dict:
        if previous is not None:  # this callback's run, finished: resumed from a checkpoint, or reopened as it was
            restart, self._resuming_checkpoint = self._resuming_checkpoint, False
            return {"run_dir": previous.run_dir, "resume": "allow" if restart else "continue"}
        if not saved or not saved.get("run_id"):
            return {}
        kwargs: dict[str, Any] = {"run_id": saved["run_id"], "resume": "allow"}
        run_dir = saved.get("run_dir")
        if run_dir and os.path.isdir(run_dir):
            kwargs["run_dir"] = run_dir
        return kwargs  # without the directory (another machine): found by id under the runs root, or a new one with that id

    def _given_report_to(self, args: Any) -> list[str]:
        """The ``report_to`` to record in the config: the user's (the mixin passes it), else the TrainingArguments'
        names followed by those given to this callback (with the plain callback, ``args.report_to`` is often
        ``[]``, the user's names being the callback's)."""
        if self.args_report_to is not None:
            return list(self.args_report_to)
        given = list(getattr(args, "report_to", None) or [])
        return given + [name for name in _selected_names(self.report_to) if name not in given]

    def _backend_options(
        self, args: Any, options: Any, saved: dict | None, trial_name: str | None = None, model: Any = None
    ) -> dict:
        """The caller's backend options, plus what makes each tracker's run look as transformers' own callback makes
        it (:func:`transformers_options`), and TensorBoard's log directory where transformers writes it:
        ``<output_dir>/runs/<Mon DD_HH-MM-SS>_<host>`` (``/<trial_name>`` added for a named hyperparameter search
        trial; the same one again when the run resumes), unless
        ``TENSORBOARD_LOGGING_DIR`` or a ``logdir`` option says otherwise."""
        options = {name: dict(values) for name, values in (options or {}).items()}
        selected = _selected_names(self.report_to)
        for name, defaults in transformers_options(selected, self.train_prefix, model).items():
            options[name] = {**defaults, **options.get(name, {})}  # the caller's options win
        selects_tensorboard = "tensorboard" in selected
        given = options.get("tensorboard", {}).get("logdir") or os.environ.get("TENSORBOARD_LOGGING_DIR")
        output_dir = getattr(args, "output_dir", None)
        if selects_tensorboard and not given and output_dir:
            logdir = (saved or {}).get("tensorboard_logdir") or os.path.join(
                os.path.abspath(output_dir), "runs", datetime.now().strftime("%b%d_%H-%M-%S") + "_" + socket.gethostname()
            )
            if not (saved or {}).get("tensorboard_logdir") and trial_name:
                logdir = os.path.join(logdir, trial_name)  # where transformers puts a trial's: trials started together
            options.setdefault("tensorboard", {})["logdir"] = logdir
            self.tensorboard_logdir = logdir
            log.info("rllog: TensorBoard logs in %s", logdir)
        return options

    def _remember(self, state: Any) -> None:
        """Put the run's id and directory in the TrainerState, which every checkpoint saves: a trainer resumed
        from that checkpoint (in this process or another) continues the run."""
        run_dir = getattr(self.run, "run_dir", None)
        if state is None or run_dir is None or not isinstance(getattr(state, "stateful_callbacks", None), dict):
            return
        attributes = {
            "run_id": self.run.run_id,
            "run_dir": os.path.abspath(run_dir),
            "tensorboard_logdir": self.tensorboard_logdir,
        }
        state.stateful_callbacks[STATE_KEY] = {"args": {}, "attributes": attributes}

    def wait_for_trackers(self, timeout: float | None = None) -> Any:
        """Wait until every tracker holds every record logged so far (:meth:`rllog.Run.flush`, at most ``timeout``,
        default ``flush_timeout``, seconds) and return the report; None without a run. ``train()`` and
        ``evaluate()`` do not wait (they ask the trackers to flush at once as they end; with five trackers the wait
        took 0.02-0.21 s after runs of 12 and 120 steps, docs/trl.md): call this before reading a tracker's files in
        the same process.

        Example:
            >>> trainer.train()
            >>> trainer.rllog_callback.wait_for_trackers()  # TensorBoard's files now hold the last step
        """
        if self.run is None or self.run.finished:
            return None
        timeout = self.flush_timeout if timeout is None else timeout
        report = self.run.flush(timeout)
        if not report.ok:
            log.warning("rllog: not every tracker holds every record yet (flush timeout %ss):\n%s", timeout, report)
        return report

    def _ask_for_flush(self) -> None:
        """The end of ``train()``/``evaluate()``: the trackers flush every record logged so far at once, and the
        trainer goes on without waiting for them (docs/decisions.md, "The end of train() does not wait")."""
        if self.run is None or self.run.finished:
            return
        try:
            self.run.request_flush(at_once=True)
        except RunFinished:  # being finished on another thread (a SIGTERM): that finish flushes everything
            pass

    def _set_outcome(self, status: str) -> None:
        if self._release is not None:
            self._release.status = status

    # -- the trainer's events --------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero:
            self._end_run_for_trial(state)
            self._end_run_for_checkpoint_resume(state)
        self._clock.state = state
        self._clock.in_step = False  # a train() that raised left it set
        self._training = True
        if state.is_world_process_zero:
            self.start(args, model, state)
        else:
            self.start_elsewhere()
        if self.run is not None:
            # rllog.log(...) without a step, from a reward function or another callback, lands on the
            # step the trainer is computing (the one its own logs for this step will carry).
            self.run.step_source = self._clock.current
            self._remember(state)

    def on_step_begin(self, args, state, control, **kwargs):
        self._clock.in_step = True

    def on_step_end(self, args, state, control, **kwargs):
        self._clock.in_step = False

    def on_train_end(self, args, state, control, **kwargs):
        self._training = False
        self._clock.in_step = False
        self._set_outcome("finished")
        if state.is_world_process_zero:
            self._ask_for_flush()

    def train_raised(self, status: str) -> None:
        """``train()`` raised: transformers calls no ``on_train_end`` then (its training loop has no ``finally``).
        The run's outcome is ``status`` (``failed`` or ``killed``), and the training is over."""
        self._set_outcome(status)
        self._training = False
        self._clock.in_step = False

    def end_raised_train(self) -> None:
        """Outside ``train()``, end a ``train()`` that raised without :meth:`train_raised` (a plain Trainer's):
        left as it was, ``_training`` made a later ``evaluate()`` skip its flush request, and the clock stayed in
        the failed step, so a step-less ``rllog.log`` landed one step too high."""
        if (self._training or self._clock.in_step) and not _training_loop_running():
            self.train_raised("failed")

    def on_prediction_step(self, args, state, control, **kwargs):
        if self._clock.in_step:  # never so in an evaluation during training: it runs between steps
            self.end_raised_train()

    def on_evaluate(self, args, state, control, **kwargs):
        self.end_raised_train()
        if state.is_world_process_zero and not self._training:  # during training the end of train() asks
            self._ask_for_flush()

    def on_predict(self, args, state, control, metrics=None, **kwargs):
        self.end_raised_train()
        if state.is_world_process_zero and metrics:
            self.on_log(args, state, control, logs=metrics, model=kwargs.get("model"))
            if not self._training:
                self._ask_for_flush()

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if not state.is_world_process_zero:
            self.start_elsewhere()
            return
        if not logs:
            return
        if self._clock.state is None:
            self._clock.state = state
        run = self.start(args, model, state)
        self._warn_other_runs()  # at the first log every callback's on_train_begin has run (a WandbCallback's wandb.init)
        names = self._names()
        values = {names.get(key) or self._rename(key): math.nan if value is None else value for key, value in logs.items()}
        try:
            run.log(values, step=state.global_step)  # validates; the common case: every value is a number
            return
        except InvalidValue:
            values = self._numbers_only(logs)
        if values:
            run.log(values, step=state.global_step)

    def _names(self) -> dict[str, str]:
        """The keys renamed so far (a trainer logs the same ~30 keys every step), for the ``train_prefix`` now."""
        if self._renamed_for != self.train_prefix or len(self._renamed) > 10_000:
            self._renamed, self._renamed_for = {}, self.train_prefix
        return self._renamed

    def _rename(self, key: str) -> str:
        name = self._names()[key] = rename(key, self.train_prefix)
        return name

    def _warn_other_runs(self) -> None:
        """Once: warn when the trainer's process holds a tracker run of its own for a tracker rllog delivers to
        (a ``WandbCallback`` subclass that logs an extra key, a user's ``wandb.init``): that is a second run beside
        rllog's, and what it logs never reaches rllog's run. Only trackers already imported are looked at."""
        if self._other_runs_checked or isinstance(self.run, rllog.NullRun):
            return
        self._other_runs_checked = True
        found = []
        for name in _selected_names(self.report_to):
            module, finder = sys.modules.get(name), OWN_RUN_FINDERS.get(name)
            try:
                if module is not None and finder is not None and finder(module) is not None:
                    found.append(name)
            except Exception:  # a tracker's own state that cannot be read: nothing to say about it
                continue
        if found:
            warn_second_tracker_run(", ".join(found), "code in the training process")

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
            values[self._rename(key)] = value
        return values


def _saved_run(state: Any) -> dict | None:
    """The run a checkpoint's TrainerState names (see :meth:`RLLogCallback._remember`), if any."""
    entry = (getattr(state, "stateful_callbacks", None) or {}).get(STATE_KEY) if state is not None else None
    return entry.get("attributes") if isinstance(entry, dict) else None


def _trial(state: Any) -> tuple[str | None, dict | None]:
    """(name, hyperparameters) of the hyperparameter search trial a TrainerState trains, or (None, None)."""
    if state is None or not getattr(state, "is_hyper_param_search", False):
        return None, None
    return getattr(state, "trial_name", None), getattr(state, "trial_params", None)


def _training_loop_running() -> bool:
    """Whether this thread is inside a Trainer's training loop (``Trainer._inner_training_loop``, which every
    ``train()`` runs): an ``evaluate()`` from within it is one of training's, any other comes after it."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_inner_training_loop":
            return True
        frame = frame.f_back
    return False


def _selected_names(report_to: Any) -> list[str]:
    """The backend names a ``report_to`` selects (sink objects left out), without importing any tracker."""
    from rllog.registry import parse_report_to

    try:
        return [item for item in parse_report_to(report_to) if isinstance(item, str)]
    except Exception:  # rllog.init reports a bad report_to with its own message
        return []


def warn_second_tracker_run(trackers: str, starter: str) -> None:
    """The one warning for a tracker run started beside rllog's, saying what to do instead."""
    log.warning(
        "rllog: %s started a %s run of its own in the training process, beside the one rllog delivers to: what it "
        "logs there never reaches rllog's run. Log extra values with rllog.log({...}) (from a plain TrainerCallback's "
        "on_log, a reward function, anywhere) and drop the tracker callback or subclass (docs/trl.md, "
        '"Logging from your own code").',
        starter,
        trackers,
    )


def transformers_options(selected: list[str], train_prefix: str, model: Any = None) -> dict[str, dict[str, Any]]:
    """Backend options that make each selected tracker's run look as transformers' own callback makes it: wandb's
    run summary (``train_runtime``, ``train_loss``...), wandb's and Comet's config layout (nested dicts kept; Comet's
    ``args|x`` / ``config|x``), Comet's current epoch, and the model graph Comet's callback records (taken here, in the trainer's process)."""
    options: dict[str, dict[str, Any]] = {}
    if "wandb" in selected:
        options["wandb"] = {
            "summary_keys": {rename(key, train_prefix): key for key in WANDB_SUMMARY_KEYS},
            "config_layout": "transformers",
        }
    if "comet_ml" in selected:
        options["comet_ml"] = {
            "config_layout": "transformers",
            "epoch_key": rename("epoch", train_prefix),
            "log_environment": True,
        }
        if model is not None:
            options["comet_ml"]["model_graph"] = str(model)
    return options
