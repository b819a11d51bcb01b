"""ClearML backend: metrics, completion tables, config and run status in a ClearML task (server or offline).

One rllog run is one ClearML task, tagged ``rllog.run_id=<run_id>``. With a server, a later session of the
same run (``rllog replay``, a resumed trainer) finds that task by its tag and continues it
(``continue_last_task``, iterations not offset). Offline (``CLEARML_OFFLINE_MODE=1`` or ``offline=True``),
ClearML writes each session to its own folder ``<CLEARML_CACHE_DIR>/offline/offline-<id>/`` (``metrics.jsonl``,
``task.json``, ``log.jsonl``) and cannot continue a task: every session there is a new offline task with the
same tag; import the first with ``Task.import_offline_session(path)`` and the later ones with
``previous_task_id=`` that task's id to put them in one task.

**Names.** A ClearML scalar is a (title, series) pair. ``a/b/c`` becomes title ``a/b``, series ``c``;
a name without ``/`` (or with an empty part, or whose two parts are equal) is both title and series
(:func:`title_series`; :func:`key_of` inverts it exactly). Tables use the same pair.

**Values.** ClearML stores NaN and ±inf as 0.0 unless told otherwise; the sink sets
``Logger.set_reporting_nan_value(nan)`` (NaN is kept) and, since ClearML has one replacement for both
infinities, writes ±inf itself as ±1.7976931348623157e308 (the largest double, as MLflow does). A step going
back is stored as it comes (ClearML keeps every event). Tables go through ``Logger.report_table`` (a plotly
table); NaN / ±inf cells become ClearML's own ``"NaN"`` / ``"Inf"`` / ``"-Inf"`` strings, cells that are not
numbers, strings or bools become JSON text.

**Config** goes to the hyperparameter section ``General`` (``General/<key>``, values stored as text),
config given later through ``Task.update_parameters``. **Status**: the tag ``rllog.status=<status>`` (in
``task.json`` offline, where ClearML keeps no status), and with a server the task is also marked
completed / failed / stopped.

ClearML is quiet with the settings the sink uses: no framework patching, no stdout/stderr capture, no
resource monitor, no argparse capture, no repository detection (which is also what asks ClearML's update
server for a new version), and the reporter runs as a thread (ClearML's default reporting subprocess
takes 5-11 s to flush and close). ClearML still prints a line at start and one at close on stdout; in the
default delivery that is the agent's log, ``RUN_DIR/agent.log``.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from rllog.records import ConfigRecord, MetricsRecord, RunInfo, TableRecord
from rllog.sink import Capabilities, took
from rllog.sink_errors import map_errors
from rllog_backends._cells import cell
from rllog_backends._conventions import remember_location

RUN_ID_TAG = "rllog.run_id="
STATUS_TAG = "rllog.status="
SECTION = "General"
MASTER_ID_VARS = ("CLEARML_PROC_MASTER_ID", "TRAINS_PROC_MASTER_ID")
MAX_DOUBLE = sys.float_info.max
FRAMEWORKS = (
    "matplotlib", "tensorflow", "tensorboard", "pytorch", "xgboost", "scikit", "fastai", "lightgbm", "hydra",
    "tfdefines", "joblib", "megengine", "catboost", "gradio", "jsonargparse", "transformers",
)  # fmt: skip
#: Task.init's ``auto_connect_frameworks``: patch nothing, and skip the repository detection (which also
#: asks ClearML's update server for a new version, even offline).
NO_FRAMEWORKS = {name: False for name in FRAMEWORKS} | {"detect_repository": False}


def title_series(key: str) -> tuple[str, str]:
    """The (title, series) a metric or table ``key`` is reported under.

    Example:
        >>> title_series("rewards/accuracy/mean"), title_series("loss")
        (('rewards/accuracy', 'mean'), ('loss', 'loss'))
    """
    title, _, series = key.rpartition("/")
    if title and series and title != series:
        return title, series
    return key, key


def key_of(title: str, series: str) -> str:
    """The rllog key of a ClearML (title, series): the inverse of :func:`title_series`."""
    return title if title == series else f"{title}/{series}"


def stored_value(value: float) -> float:
    """A metric value as the sink reports it: ±inf as ±the largest double, everything else unchanged."""
    return math.copysign(MAX_DOUBLE, value) if math.isinf(value) else value


def _forget_parent_task() -> None:
    """Drop the ClearML task a parent process (a trainer using ClearML itself) left in the environment.

    ``Task.init`` sets ``CLEARML_PROC_MASTER_ID=<pid>:<task id>`` for its child processes; in a child it then
    returns a do-nothing stub instead of a task. The delivery agent is such a child and wants a task of its own.
    """
    for name in MASTER_ID_VARS:
        value = os.environ.get(name, "")
        if value and value.split(":")[0] != str(os.getpid()):
            del os.environ[name]


class ClearMLSink:
    """Writes rllog records to a ClearML task.

    ClearML's own configuration (``clearml.conf``, ``CLEARML_API_HOST``, ``CLEARML_CACHE_DIR``,
    ``CLEARML_OFFLINE_MODE``...) applies as usual.

    Args:
        project: ClearML project; default ``run_info.project``.
        task_name: ClearML task name; default ``run_info.name``.
        offline: ``True`` / ``False`` set ClearML's offline mode; default ``CLEARML_OFFLINE_MODE``.
        task_type: ClearML task type (``"training"``, ``"testing"``...).
        section: the hyperparameter section the config goes to.
        output_uri: where ClearML stores models and artifacts (``Task.init``'s ``output_uri``).

    ClearML allows one ``Task.init`` task per process: with ``delivery="thread"`` in a trainer that
    uses ClearML itself, use the default process delivery instead.

    Example:
        >>> run = rllog.init(report_to="clearml", project="grpo-math")   # CLEARML_OFFLINE_MODE=1 works too
        >>> run.log({"reward": 0.4}, step=1)
        >>> run.finish()
    """

    # Not durable on return: ClearML's reporter thread writes (or sends) events later; flush() waits for it.
    capabilities = Capabilities(tables=True, config=True, alerts=False, durable_writes=False)

    def __init__(
        self,
        project: str | None = None,
        task_name: str | None = None,
        offline: bool | None = None,
        task_type: str = "training",
        section: str = SECTION,
        output_uri: str | None = None,
    ):
        self.project = project
        self.task_name = task_name
        self.offline = offline
        self.task_type = task_type
        self.section = section
        self.output_uri = output_uri
        self._task: Any = None

    @property
    def task(self) -> Any:
        """The ``clearml.Task`` while the sink is open, else None."""
        return self._task

    def open(self, run_info: RunInfo) -> None:
        if self._task is not None:
            return
        from clearml import Logger, Task
        from clearml.backend_interface.task.task import Task as BackendTask

        _forget_parent_task()
        if Task.current_task() is not None:
            raise RuntimeError("ClearML allows one Task.init task per process and this process has one; use delivery='process'")
        if self.offline is not None:
            Task.set_offline(self.offline)
        # ClearML's reporting subprocess takes 5-11 s per flush and close; its thread reporter writes at once.
        BackendTask._report_subprocess_enabled = False  # a lazily read config value
        project = self.project or run_info.project
        with map_errors("clearml"):
            previous = None if Task.is_offline() else self._find_task(Task, project, run_info.run_id)
            self._task = Task.init(
                project_name=project,
                task_name=self.task_name or run_info.name,
                task_type=self.task_type,
                tags=[RUN_ID_TAG + run_info.run_id, *map(str, run_info.tags)],
                reuse_last_task_id=False,
                continue_last_task=previous or False,
                output_uri=self.output_uri,
                auto_connect_arg_parser=False,
                auto_connect_frameworks=NO_FRAMEWORKS,
                auto_resource_monitoring=False,
                auto_connect_streams=False,
            )
            self._task.set_initial_iteration(0)  # a continued task would otherwise shift every step
            Logger.set_reporting_nan_value(math.nan)
            self._set_parameters(run_info.config)
        remember_location(run_info, "clearml", **self._location(Task))

    def _location(self, task_cls: Any) -> dict[str, str]:
        """Where the task is: its id, and offline the session folder (``Task.import_offline_session`` takes it)
        or with a server the task's page."""
        where = {"task_id": str(self._task.id)}
        with map_errors("clearml"):
            if task_cls.is_offline():
                where["dir"] = str(self._task.get_offline_mode_folder())
            else:
                where["url"] = str(self._task.get_output_log_web_page())
        return where

    @staticmethod
    def _find_task(task_cls: Any, project: str, run_id: str) -> str | None:
        """The id of the task an earlier session of this run created on the server, if any."""
        found = task_cls.get_tasks(project_name=project, tags=[RUN_ID_TAG + run_id], allow_archived=False)
        return found[0].id if found else None

    def _set_parameters(self, values: Any) -> None:
        if values:
            self._task.update_parameters({f"{self.section}/{key}": value for key, value in dict(values).items()})

    def write_metrics(self, records: Sequence[MetricsRecord]) -> None:
        logger = self._require_task().get_logger()
        for record in records:
            with map_errors("clearml"):
                for key, value in record.values.items():
                    title, series = title_series(key)
                    logger.report_scalar(title=title, series=series, value=stored_value(float(value)), iteration=record.step)
            took(records, record.seq)  # a call that fails later is repeated with the rest only

    def write_table(self, record: TableRecord) -> None:
        logger = self._require_task().get_logger()
        columns = [str(c) for c in record.table.column_names]
        rows = [[cell(row.get(c), nested=False) for c in record.table.column_names] for row in record.table.to_pylist()]
        title, series = title_series(record.name)
        with map_errors("clearml"):
            logger.report_table(title=title, series=series, iteration=record.step, table_plot=[columns, *rows])

    def write_config(self, record: ConfigRecord) -> None:
        """Config given after ``open`` (``Run.update_config``), added to the task's hyperparameters."""
        self._require_task()
        with map_errors("clearml"):
            self._set_parameters(record.values)

    def flush(self) -> None:
        """Wait until ClearML's reporter has written (offline) or sent (server) every event reported so far."""
        if self._task is not None:
            with map_errors("clearml"):
                self._task.flush(wait_for_uploads=True)

    def close(self, status: str) -> None:
        if self._task is None:
            return
        task, self._task = self._task, None
        with map_errors("clearml"):
            task.flush(wait_for_uploads=True)
            task.set_tags([t for t in task.get_tags() if not t.startswith(STATUS_TAG)] + [STATUS_TAG + status])
            if not task.is_offline():
                if status == "failed":
                    task.mark_failed(status_reason="rllog: the run failed", force=True)
                elif status == "killed":
                    task.mark_stopped(force=True, status_message="rllog: the trainer was killed")
            task.close()

    def _require_task(self) -> Any:
        if self._task is None:
            raise RuntimeError("ClearMLSink: open() must be called before writing")
        return self._task
