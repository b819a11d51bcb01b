"""rllog: log once from the trainer; every tracker gets it from a separate process; nothing is lost.

Example:
    >>> import rllog
    >>> with rllog.init(report_to="parquet", project="grpo-math", config={"lr": 1e-6}) as run:
    ...     run.log({"reward": 0.41, "kl": 0.012}, step=10)
    ...     run.log_table("completions", {"prompt": ["1+1="], "completion": ["2"], "reward": [1.0]}, step=10)

Importing rllog imports no tracker, torch, trl or transformers.
"""

from __future__ import annotations

import os
from typing import Any

from rllog import messages
from rllog.errors import (  # noqa: F401  (re-exported)
    BackendNotInstalled,
    InvalidKey,
    InvalidStep,
    InvalidTable,
    InvalidValue,
    RateLimited,
    RllogError,
    RunFinished,
    TransientError,
    UnknownBackend,
)
from rllog.records import AlertRecord, MetricsRecord, RunInfo, TableRecord  # noqa: F401
from rllog.run import FinishReport, NullRun, Run, SinkReport  # noqa: F401
from rllog.sink import Capabilities, MetricSink

__version__ = "0.1.0"
__all__ = [
    "Capabilities",
    "MetricSink",
    "Run",
    "current_run",
    "init",
    "log",
    "log_table",
    "prepare",
    "read_alerts",
    "read_metrics",
    "read_table",
]

_current: Run | NullRun | None = None


REINIT_MODES = ("finish_previous", "create_new")
WORKERS_DOC = "docs/workers.md"


def init(
    report_to: Any = None,
    *,
    project: str = "rllog",
    name: str | None = None,
    config: Any = None,
    reinit: str = "finish_previous",
    **kwargs: Any,
) -> Run | NullRun:
    """Start a run that delivers to ``report_to`` and make it the current run.

    Args:
        report_to: ``"wandb,tensorboard"``, a list of names and/or :class:`MetricSink` objects,
            ``"all"`` (every installed backend), ``"none"``, or None for the default (``parquet``).
        project: project / experiment name in every tracker.
        name: the run's name (default ``run-<id>``).
        config: hyperparameters: a dict, a dataclass (e.g. ``TrainingArguments``) or an object with
            ``to_dict()``; flattened with ``/``, secrets redacted.
        reinit: what happens to the run a previous ``init`` of this process started and nobody finished (a notebook
            cell run again): ``"finish_previous"`` (default) finishes it and says so; ``"create_new"`` keeps both.
        **kwargs: ``run_dir``, ``tags``, ``flush_interval`` (default 1.0 s), ``delivery``
            (``"process"``, default, or ``"thread"``), ``backend_options`` (``{"wandb": {...}}``), ``quiet``
            (print no line at ``init`` and ``finish``; default ``$RLLOG_QUIET``), and the rest of :class:`Run`'s.

    Returns:
        The run (a :class:`NullRun` on ranks other than 0), also :func:`current_run` until the next ``init``.

    Raises:
        UnknownArgument: an argument :class:`Run` does not take (the message names the closest one).

    In a multi-process run (``torch.distributed`` initialised, or ``$RANK`` set), call it on every rank:
    global rank 0 gets the real run; the other ranks get a :class:`NullRun` that validates and takes part
    in the cross-rank reduction but opens no tracker and writes no file. ``log`` is then a collective:
    every rank must call it. Code that logs from rank 0 alone (its metrics already reduced) passes
    ``reduce_across_ranks=False``, as the HF/TRL integration does.

    Example:
        >>> run = rllog.init(report_to="wandb,parquet", project="grpo-math", config={"lr": 1e-6})
        >>> run.log({"reward": 0.41, "kl": 0.012}, step=10)
        >>> report = run.finish()  # waits for every tracker; report.ok when each holds every record
    """
    global _current
    from rllog.distributed import global_rank
    from rllog.errors import InvalidArgument
    from rllog.run.opening import check_arguments

    check_arguments(kwargs, init, Run)
    if reinit not in REINIT_MODES:
        raise InvalidArgument(f"reinit must be one of {REINIT_MODES}, got {reinit!r}")
    previous = _current
    if reinit == "finish_previous" and isinstance(previous, Run) and not previous.finished:
        if not previous.quiet:
            messages.say(
                f"rllog: finishing the previous run {previous.info.name!r} first (rllog.init(reinit='create_new') keeps it open)"
            )
        previous.finish()
    cls = Run if global_rank() == 0 else NullRun
    _current = cls(report_to, project=project, name=name, config=config, **kwargs)
    return _current


def prepare(report_to: Any = None, *, delivery: str = "process", system_metrics: bool | float | None = None) -> bool:
    """Start the delivery agent for ``report_to`` now, so that the trackers' imports (seconds for MLflow,
    Comet or wandb) overlap what the program does before :func:`init` (loading a model, a dataset).

    The agent opens no tracker run and writes nothing until a run with the same backends starts; the
    first :func:`init` that matches takes it. Nothing is started on ranks other than 0, with
    ``delivery="thread"``, or while a run's agent is alive in this process (one agent at a time);
    a later ``prepare`` with other backends replaces it. The TRL/HF integrations call it when a trainer
    is built.

    Args:
        report_to: the backends the coming :func:`init` selects (as its ``report_to``; sink objects are ignored).
        delivery: ``init``'s; with ``"thread"`` there is no agent to start.
        system_metrics: ``init``'s: the agent samples the trainer's CPU, memory and GPUs.

    Returns:
        Whether an agent is waiting for the run.

    Raises:
        InvalidSetting: an ``RLLOG_*`` variable the agent reads has a bad value.

    Example:
        >>> rllog.prepare(["wandb", "mlflow"])  # at the top of the script
        >>> model = load_model()                # the trackers are imported meanwhile
        >>> run = rllog.init(["wandb", "mlflow"])
    """
    from rllog.distributed import global_rank
    from rllog.registry import parse_report_to
    from rllog.run import delivery_link
    from rllog.run.opening import agent_interval

    if delivery != "process" or global_rank() != 0:
        return False
    names = [item for item in parse_report_to(report_to) if isinstance(item, str)]
    interval = agent_interval(delivery, system_metrics)  # the standby reads the settings: a bad one is this call's error
    return delivery_link.prepare_standby(names, interval)


def current_run() -> Run | NullRun | None:
    """The run most recently started with :func:`init` (None before the first).

    Returns:
        The current :class:`Run` (a :class:`NullRun` on ranks other than 0), or None.

    Example:
        >>> rllog.init(report_to="parquet")
        >>> rllog.current_run().log({"loss": 0.7}, step=1)
    """
    return _current


def _make_current(run: Run | NullRun) -> None:
    """Make ``run`` the current run: for an integration that builds the run object itself (the HF callback's
    :class:`NullRun` on a process that is not the trainer's main one, whatever ``$RANK`` says)."""
    global _current
    _current = run


def log(values: dict, step: int | None = None) -> None:
    """Log metrics to the current run: ``current_run().log(values, step)``.

    Args:
        values: metric name -> a Python or numpy number, a bool or a one-element torch tensor; nested dicts are
            flattened with ``/``.
        step: the step they belong to (default: the last step + 1, or the trainer's step under an integration).

    Raises:
        RllogError: no run in this process (call :func:`init` first).
        InvalidValue: a value that is not one real number (names the key and the type).

    Example:
        >>> rllog.init(report_to="parquet")
        >>> rllog.log({"reward": 0.41, "kl": 0.012}, step=10)
    """
    _require_run().log(values, step)


def log_table(name: str, table: Any, step: int | None = None) -> None:
    """Log rows to the current run's table ``name``: ``current_run().log_table(name, table, step)``.

    Args:
        name: the table's name (every call with it adds rows to one table).
        table: columns (a dict of equal-length lists), a list of row dicts, a pandas DataFrame or a pyarrow Table.
        step: the step the rows belong to (default: the step of the last ``log``).

    Raises:
        RllogError: no run in this process (call :func:`init` first).
        InvalidTable: ragged columns, a column type no tracker can store, or a type changed since an earlier call.

    Example:
        >>> rllog.init(report_to="parquet")
        >>> rllog.log_table("completions", {"prompt": ["1+1="], "completion": ["2"], "reward": [1.0]}, step=10)
    """
    _require_run().log_table(name, table, step)


def _require_run() -> Run | NullRun:
    if _current is None:
        import multiprocessing

        if multiprocessing.parent_process() is not None:
            raise RllogError(
                f"no run in this process ({os.getpid()}): it is a multiprocessing worker, and a run lives in the process "
                f"that called rllog.init(); return the values from the worker and log them there ({WORKERS_DOC})"
            )
        raise RllogError("no run: call rllog.init() first")
    return _current


def read_metrics(run_dir: str | os.PathLike, attempts: str = "latest"):
    """Every metric value logged in ``run_dir``, whichever trackers the run was delivered to (:mod:`rllog.read`).

    Args:
        run_dir: the run's directory (``run.run_dir``).
        attempts: ``"latest"`` (default) shows a resumed run as its latest attempt left it; ``"all"`` keeps every row.

    Returns:
        A ``pyarrow.Table`` (step, key, value, time, seq), in seq order.

    Example:
        >>> metrics = rllog.read_metrics(run.run_dir).to_pandas()
        >>> metrics[metrics.key == "reward"].plot(x="step", y="value")
    """
    from rllog import read

    return read.read_metrics(run_dir, attempts)


def read_alerts(run_dir: str | os.PathLike, attempts: str = "latest"):
    """The health alerts of ``run_dir`` (a reward that collapsed, a KL that exploded, a NaN loss, ...).

    Args:
        run_dir: the run's directory (``run.run_dir``).
        attempts: as :func:`read_metrics`'s.

    Returns:
        A ``pyarrow.Table`` (step, seq, time, rule, metric, value, message, level), in seq order.

    Example:
        >>> for alert in rllog.read_alerts(run.run_dir).to_pylist():
        ...     print(alert["step"], alert["message"])
    """
    from rllog import read

    return read.read_alerts(run_dir, attempts)


def read_table(run_dir: str | os.PathLike, name: str, attempts: str = "latest"):
    """Every row logged to table ``name`` in ``run_dir``.

    Args:
        run_dir: the run's directory (``run.run_dir``).
        name: the table's name, as given to ``log_table``.
        attempts: as :func:`read_metrics`'s.

    Returns:
        A ``pyarrow.Table`` (_step, _seq, then the table's columns), in seq order.

    Raises:
        KeyError: no table of that name (the message lists the run's tables).

    Example:
        >>> completions = rllog.read_table(run.run_dir, "completions").to_pandas()
    """
    from rllog import read

    return read.read_table(run_dir, name, attempts)
