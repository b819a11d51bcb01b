"""The Comet backend (``report_to="comet_ml"``, alias ``"comet"``): one Comet experiment per rllog run.

The experiment is started with ``comet_ml.start(mode="get_or_create")`` and an experiment key derived
from the run (project, name, run id) unless ``COMET_EXPERIMENT_KEY`` names one, so a later delivery of
the same run (a resumed run, ``rllog replay`` after a crash) continues the same Comet experiment; the
key, project and workspace of the first session are remembered in ``RUN_DIR/trackers/comet_ml.json``.
The project is the ``project`` option, else ``rllog.init``'s project when given, else
``COMET_PROJECT_NAME``, else ``"rllog"`` (Comet's own default project for the transformers integration's default,
as transformers' ``CometCallback``); the workspace the option, else ``COMET_WORKSPACE``. Online or offline follows Comet's own settings
(``COMET_START_ONLINE=false`` or the ``online`` option: offline archives go to
``COMET_OFFLINE_DIRECTORY``, one ``<key>-<suffix>.zip`` per delivery session, to upload later with
``comet upload``).

What goes where:

- metrics: ``experiment.log_metrics(values, step=record.step)``, one call per record, in order; a step
  lower than an earlier one is recorded as is (Comet keeps every point). NaN/inf are passed through;
  Comet writes them as the JSON strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``.
- tables: a CSV asset ``<name>_step_<step:06d>.csv`` (what ``log_table`` makes of rows; one per table
  name and step, see :func:`table_file_name`), logged with ``log_asset_data(..., step=record.step)`` and metadata ``{"rllog_table": name, "rllog_columns":
  [[column, kind], ...]}`` so the rows can be read back with their types.
- config: ``log_parameters`` (already flattened by rllog; ``config_layout="transformers"``: ``args|x``,
  ``config|x``, as transformers' callback), at open and for every ``Run.update_config``
  (Comet keeps a parameter's latest value); names over 100 characters and string values over 1000
  characters are shortened (Comet's limits).
- run id / status: ``log_other("rllog_run_id", ...)`` at open, ``log_other("rllog_status", ...)``
  at close, then ``experiment.end()``.

The sink runs in rllog's delivery process, so it turns off everything Comet would record about *that*
process (source code, command line, stdout, git, environment and system metrics: options below), records the
training script's instead (``log_environment``: its file, source, arguments, the packages, the model graph;
not its stdout, which rllog does not capture), and turns off
Comet's auto-logging (it would patch the mlflow/TensorBoard modules other sinks use there). Offline it
also disables Comet's cloud-metadata probe (``169.254.169.254``), so an offline run never touches the
network. Offline, a session the delivery process never ended (it was killed) is archived by the next
``open`` of the same run (see :meth:`CometSink._recover`).

Example:
    >>> sink = CometSink(online=False)                       # doctest: +SKIP
    >>> sink.open(run_info)                                  # doctest: +SKIP
    >>> sink.write_metrics([MetricsRecord(seq=1, step=0, time=0.0, values={"reward": 0.5})])  # doctest: +SKIP
    >>> sink.close("finished")                               # doctest: +SKIP
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pyarrow as pa

from rllog.files import replace_file
from rllog.records import ConfigRecord, MetricsRecord, RunInfo, TableRecord, step_rows
from rllog.sink import Capabilities, took
from rllog.sink_errors import map_errors, retry_error
from rllog_backends._conventions import (
    TRANSFORMERS_LAYOUT,
    TRANSFORMERS_PROJECT,
    Remembered,
    env,
    explicit_project,
    first,
    split_transformers_config,
)

log = logging.getLogger(__name__)

#: Comet's limits (``comet_ml.config.config_constants``): key length, string value length.
MAX_KEY_LENGTH = 100
MAX_VALUE_LENGTH = 1000
TRUNCATED = " [truncated]"  # what Comet itself appends when it cuts a string
#: ``log_other`` keys this sink writes.
RUN_ID_KEY = "rllog_run_id"
STATUS_KEY = "rllog_status"
#: Asset metadata keys of a table.
TABLE_KEY = "rllog_table"
COLUMNS_KEY = "rllog_columns"
PENDING_DIR = "comet_ml"  # below RUN_DIR: markers of offline sessions not yet archived
#: In ``RUN_DIR/trackers/comet_ml.json``: the offline archives of the run's sessions, for the ``comet upload`` hint
#: the trainer's side shows (the sink's own output goes to the delivery agent's log).
ARCHIVES_KEY = "offline_archives"
#: The sections of transformers' ``CometCallback`` parameters (``args|learning_rate``, ``config|hidden_size``) and
#: Comet's separator of nested parameter names.
ARGS_SECTION = "args"
MODEL_SECTION = "config"
NESTED_SEPARATOR = "|"
#: How long Comet's offline writer thread waits for a message while ``end`` stops it (Comet's own: 1 s).
END_QUEUE_TIMEOUT = 0.02


def experiment_key(run_info: RunInfo) -> str:
    """The Comet experiment key of an rllog run: 40 hex characters, the same every time the run is opened."""
    raw = "\0".join((run_info.project, run_info.name, run_info.run_id)).encode()
    return hashlib.sha256(raw).hexdigest()[:40]


def comet_name(name: str, limit: int = MAX_KEY_LENGTH) -> str:
    """``name`` as a Comet metric/parameter name: unchanged up to ``limit`` characters, otherwise cut
    and ended with ``~`` and 8 hex characters of its hash (so two long names never collide)."""
    if len(name) <= limit:
        return name
    return name[: limit - 9] + "~" + hashlib.sha1(name.encode()).hexdigest()[:8]


def comet_param_value(value: Any) -> Any:
    """A config value as Comet stores it: numbers, bools and None as they are, anything else as a
    string of at most 1000 characters (ending in ``" [truncated]"`` when cut, like Comet does)."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    text = value if isinstance(value, str) else str(value)
    if len(text) > MAX_VALUE_LENGTH:
        text = text[: MAX_VALUE_LENGTH - len(TRUNCATED)] + TRUNCATED
    return text


_SAFE_NAME = re.compile(r"^[A-Za-z0-9._/-]*$")


def table_file_name(name: str, step: int) -> str:
    """The asset name of a table at a step: ``<name>_step_<step:06d>.csv``, unique per table name and step.

    ``/`` becomes ``__`` (``eval/completions`` -> ``eval__completions_step_000003.csv``). A name that
    would not map back unambiguously (other characters, or a ``__`` of its own) has them replaced by
    ``_`` and ends with ``-`` and 8 hex characters of its hash, so two table names never share an asset.

    Example:
        >>> table_file_name("completions", 3), table_file_name("eval/completions", 3)
        ('completions_step_000003.csv', 'eval__completions_step_000003.csv')
    """
    if name and _SAFE_NAME.match(name) and "__" not in name:
        base = name.replace("/", "__")
    else:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", name.replace("/", "__")) or "_"
        base = f"{safe}-{hashlib.sha1(name.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"
    return f"{base}_step_{step:06d}.csv"


# -- table cells -----------------------------------------------------------------------------------
# Each column gets a "kind" (recorded in the asset's metadata) that says how its cells are written:
#   str   text as is (a string column without nulls)
#   int   str(int), "" for null          float  repr(float) ("nan", "inf"), "" for null
#   bool  "True"/"False", "" for null    json   json.dumps(value) (anything else, and strings with nulls)


def column_kind(arrow_type: Any, null_count: int) -> str:
    """How a column's cells are written (see above)."""
    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "str" if null_count == 0 else "json"
    if pa.types.is_integer(arrow_type):
        return "int"
    if pa.types.is_floating(arrow_type):
        return "float"
    if pa.types.is_boolean(arrow_type):
        return "bool"
    return "json"


def encode_cell(value: Any, kind: str) -> str:
    if kind == "str":
        return value
    if kind == "json":
        return json.dumps(value, default=str, ensure_ascii=False)
    if value is None:
        return ""
    if kind == "float":
        return repr(float(value))
    return str(value)


def decode_cell(text: str, kind: str) -> Any:
    """The inverse of :func:`encode_cell` (used by readers of the CSV assets)."""
    if kind == "str":
        return text
    if kind == "json":
        return json.loads(text)
    if text == "":
        return None
    if kind == "int":
        return int(text)
    if kind == "float":
        return float(text)
    if kind == "bool":
        return text == "True"
    return text


def table_csv(record: TableRecord) -> tuple[str, list[list[str]]]:
    """The CSV text of a table and its ``[[column, kind], ...]``."""
    table = record.table
    kinds = [[name, column_kind(col.type, col.null_count)] for name, col in zip(table.column_names, table.columns, strict=True)]
    out = io.StringIO()
    writer = csv.writer(out, dialect="excel")
    writer.writerow(table.column_names)
    for row in table.to_pylist():
        writer.writerow([encode_cell(row[name], kind) for name, kind in kinds])
    return out.getvalue(), kinds


# -- errors ----------------------------------------------------------------------------------------
RETRY_AFTER_HEADERS = ("Retry-After", "Retry-After-Custom")  # the second is Comet's own


def map_error(exc: BaseException) -> Exception | None:
    """The rllog error for a Comet failure worth retrying, or None.

    HTTP 429 (``CometRestApiException``, ``FileUploadThrottledException``, ``requests.HTTPError``: any
    exception carrying a ``response``) -> :class:`~rllog.errors.RateLimited` with the ``Retry-After``
    (or Comet's ``Retry-After-Custom``) seconds; HTTP 5xx, connection errors, timeouts and a full disk
    (the offline archive) -> :class:`~rllog.errors.TransientError`.
    """
    return retry_error(exc, "comet_ml", retry_after_headers=RETRY_AFTER_HEADERS)


def _mapped_errors() -> AbstractContextManager[None]:
    return map_errors("comet_ml", retry_after_headers=RETRY_AFTER_HEADERS)


def _no_cloud_details(*args: Any, **kwargs: Any) -> None:
    return None


def _block_cloud_probe(comet_ml: Any) -> None:
    """Stop Comet from asking 169.254.169.254 (AWS/Azure/GCP metadata) when an experiment starts.

    ``CometExperiment._log_cloud_details`` calls ``comet_ml.experiment.get_env_cloud_details``, which
    sends three HTTP requests to the cloud-metadata address whenever environment details are logged;
    no setting turns it off. Replaced for the whole process, once an offline sink opens.
    """
    from comet_ml import experiment

    experiment.get_env_cloud_details = _no_cloud_details


def _last_message_id(path: Path) -> int:
    """``message_id`` of the last complete line of an offline ``messages.json`` (-1 if none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().split(b"\n")[:-1]  # what follows the last newline is not complete
        return int(json.loads(lines[-1])["payload"]["message_id"]) if lines else -1
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return -1


def _wait_offline_written(experiment: Any, timeout: float) -> None:
    """Wait until Comet's offline streamer has written every message it was given to ``messages.json``.

    Its ``flush`` returns at once; messages are numbered when queued (``streamer._counter``) and
    written in that order, one line each, by one thread. Stops early if the file stops growing for
    0.5 s with the queue empty (a message Comet failed to write).
    """
    streamer: Any = getattr(experiment, "streamer", None)
    queue = getattr(streamer, "messages", None)
    tmpdir = getattr(experiment, "tmpdir", None)
    if queue is None or not tmpdir or not hasattr(streamer, "_counter"):
        return
    path = Path(tmpdir) / "messages.json"
    deadline = time.monotonic() + timeout
    last_size, stable_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        target = streamer._counter
        if queue.empty():
            if _last_message_id(path) >= target:
                return
            try:
                size = path.stat().st_size
            except OSError:
                return
            if size != last_size:
                last_size, stable_since = size, time.monotonic()
            elif time.monotonic() - stable_since >= 0.5:
                return
        time.sleep(0.005)


def _stop_writer_promptly(experiment: Any) -> None:
    """Make ``end`` stop Comet's offline writer thread as soon as it has written everything.

    ``end`` waits until the writer's queue is empty, flags the thread to stop and joins it; the thread sees the
    flag only when its wait for the next message (``queue_timeout``, 1 s) runs out, so every offline ``end``
    took a second more than the writing (comet_ml 3.58). Lowered before the status message is queued: the
    writer wakes for that message and waits :data:`END_QUEUE_TIMEOUT` from then on. Messages are still taken
    in order and all of them are written before the thread stops (``end`` empties the queue first).
    """
    streamer: Any = getattr(experiment, "streamer", None)
    if isinstance(getattr(streamer, "queue_timeout", None), (int, float)):
        streamer.queue_timeout = min(streamer.queue_timeout, END_QUEUE_TIMEOUT)


def random_suffix() -> str:
    """Six random letters, like the suffix Comet gives the archive of a continued experiment."""
    import random
    import string

    return "".join(random.choice(string.ascii_letters) for _ in range(6))


def _is_false(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("0", "false", "no", "off")


class CometSink:
    """Delivers an rllog run to a Comet experiment (online, or offline as a zip archive).

    Args:
        project: Comet project name. Default: ``rllog.init``'s project when given, else
            ``COMET_PROJECT_NAME``, else ``"rllog"``.
        workspace: Comet workspace. Default: ``COMET_WORKSPACE``, else Comet's own setting.
        online: True/False to force; default None follows Comet (``COMET_START_ONLINE``, default online).
        offline_directory: where offline archives go. Default: ``COMET_OFFLINE_DIRECTORY``, else
            Comet's default (``./.cometml-runs``).
        experiment_key: the Comet experiment key (32-50 letters/digits). Default: ``COMET_EXPERIMENT_KEY``,
            else derived from the run, the same each time the run is delivered (see :func:`experiment_key`).
        log_env_details: let Comet record host/system details and CPU/GPU/disk/network metrics. Off by
            default: the sink runs in the delivery process, not the trainer.
        log_environment: record what Comet's own start records about the training script: its file name and
            source code, its command-line arguments (as parameters, as Comet parses them), the installed Python
            and OS packages (the delivery agent runs the trainer's interpreter on the trainer's machine), and the
            ``model_graph``. Off by default; the transformers/TRL integration turns it on, as the run of
            transformers' ``CometCallback`` has them.
        model_graph: the model's graph as text (the transformers integration passes ``str(model)``, taken in
            the trainer's process), as transformers' ``CometCallback`` records it.
        epoch_key: the metric that holds the training epoch: its latest value is the experiment's current epoch
            (Comet's ``curr_epoch``), as transformers' ``CometCallback`` sets it (the integration passes
            ``"train/epoch"``).
        config_layout: ``"rllog"`` (default): parameters named as rllog flattened the config (``a/b``);
            ``"transformers"``: as transformers' ``CometCallback`` logs them: the TrainingArguments as
            ``args|<name>``, the model config as ``config|<name>``, dict values nested with ``|``.
        flush_timeout: seconds ``flush`` waits for Comet to write/send what it was given.

    Example:
        >>> sink = CometSink(project="grpo-math", online=False)
        >>> sink.capabilities.tables
        True
    """

    # Not durable on return: Comet queues every message for its streamer thread (online: an upload;
    # offline: a line of messages.json); flush() waits until the streamer wrote or sent them.
    capabilities = Capabilities(tables=True, config=True, alerts=False, durable_writes=False)
    prepare_imports = ("comet_ml.experiment", "comet_ml.offline_utils")  # a standby agent imports them ahead: rllog.prepare

    def __init__(
        self,
        project: str | None = None,
        workspace: str | None = None,
        online: bool | None = None,
        offline_directory: str | None = None,
        experiment_key: str | None = None,
        log_env_details: bool = False,
        flush_timeout: float = 30.0,
        log_environment: bool = False,
        model_graph: str | None = None,
        config_layout: str = "rllog",
        epoch_key: str | None = None,
    ):
        if config_layout not in ("rllog", TRANSFORMERS_LAYOUT):
            raise ValueError(f"config_layout must be 'rllog' or {TRANSFORMERS_LAYOUT!r}, not {config_layout!r}")
        self.log_environment = log_environment
        self.model_graph = model_graph
        self.config_layout = config_layout
        self.epoch_key = epoch_key
        self._remembered: Remembered | None = None
        self.project = project
        self.workspace = workspace
        self.online = online
        self.offline_directory = offline_directory
        self.experiment_key = experiment_key
        self.log_env_details = log_env_details
        self.flush_timeout = flush_timeout
        self._experiment: Any = None
        self._offline = False
        self._marker: Path | None = None

    # -- MetricSink ---------------------------------------------------------------------------------
    def open(self, run_info: RunInfo) -> None:
        """Start (or continue, by experiment key) the Comet experiment and log name, tags, config, run id."""
        offline_hint = self.online is False or (self.online is None and _is_false(os.environ.get("COMET_START_ONLINE")))
        if "comet_ml" not in sys.modules:
            # Read by comet_ml at import: without it, comet patches mlflow/tensorboard/torch/... on import.
            os.environ["COMET_DISABLE_AUTO_LOGGING"] = "1"
            if offline_hint:
                os.environ.setdefault("COMET_ERROR_TRACKING_ENABLE", "false")  # no Sentry reports offline
        import comet_ml

        online = comet_ml.get_config().get_bool(self.online, "comet.start.online", default=None, not_set_value=None)
        self._offline = online is False
        if self._offline:
            _block_cloud_probe(comet_ml)
        remembered = Remembered(run_info.run_dir, "comet_ml", run_info.run_id)
        identity = self.identity(run_info, remembered)
        if self._offline:
            self._recover(run_info)
        config = comet_ml.ExperimentConfig(
            name=run_info.name,
            tags=list(run_info.tags) or None,
            offline_directory=self.offline_directory,
            log_code=False,
            log_graph=False,
            parse_args=False,
            auto_output_logging=False,  # False turns it off (Comet annotates only its modes, str)
            auto_param_logging=False,
            auto_metric_logging=False,
            auto_log_co2=False,
            log_git_metadata=False,
            log_git_patch=False,
            log_env_details=self.log_env_details,
            log_env_gpu=self.log_env_details,
            log_env_host=self.log_env_details,
            log_env_cpu=self.log_env_details,
            log_env_network=self.log_env_details,
            log_env_disk=self.log_env_details,
            display_summary_level=0,
        )
        with _mapped_errors():
            experiment = comet_ml.start(
                project_name=identity["project"],
                workspace=identity["workspace"],
                experiment_key=identity["experiment_key"],
                mode="get_or_create",
                online=online,
                experiment_config=config,
            )
        self._experiment = experiment
        # where a user opens it: online the experiment's page; offline the archives close lists (ARCHIVES_KEY)
        remembered.save(**identity, **({} if self._offline else {"url": getattr(experiment, "url", None)}))
        self._remembered = remembered
        if self._offline:
            self._write_marker(run_info, experiment)
        with _mapped_errors():
            experiment.log_other(RUN_ID_KEY, run_info.run_id)
            if run_info.config:
                experiment.log_parameters(self._parameters(run_info.config), nested_support=False)
            if self.log_environment:
                self._log_environment(experiment, run_info)

    def identity(self, run_info: RunInfo, remembered: Remembered | None = None) -> dict[str, Any]:
        """The ``project``, ``workspace`` and ``experiment_key`` the experiment is started with: an option,
        else ``rllog.init``'s project when not the default, else Comet's variable, else what an earlier
        session chose, else rllog's default (None leaves the workspace to Comet)."""
        remembered = remembered or Remembered(run_info.run_dir, "comet_ml", run_info.run_id)
        # transformers' CometCallback names no project: Comet's own default (None) for the integration's default
        project = None if run_info.project == TRANSFORMERS_PROJECT else run_info.project
        return {
            "project": first(
                self.project, explicit_project(run_info), env("COMET_PROJECT_NAME"), remembered.get("project"), project
            ),
            "workspace": first(self.workspace, env("COMET_WORKSPACE"), remembered.get("workspace")),
            "experiment_key": first(
                self.experiment_key, env("COMET_EXPERIMENT_KEY"), remembered.get("experiment_key"), experiment_key(run_info)
            ),
        }

    def write_config(self, record: ConfigRecord) -> None:
        """Config given after ``open`` (``Run.update_config``): ``log_parameters``; Comet keeps each parameter's latest value."""
        experiment = self._require_open()
        with _mapped_errors():
            experiment.log_parameters(self._parameters(record.values), nested_support=False)

    def write_metrics(self, records: Sequence[MetricsRecord]) -> None:
        """One ``log_metrics`` per step (consecutive records of a step together, unless a key repeats), at the
        record's step (lower steps included).

        Each step's call is acknowledged (:func:`rllog.sink.took`), so a call that fails halfway is repeated with
        the rest only: Comet keeps every point, and a step logged twice would be stored twice.
        """
        experiment = self._require_open()
        self._set_epoch(experiment, records)
        with _mapped_errors():
            for step, values, last_seq in step_rows(records, comet_name):
                if values:
                    experiment.log_metrics(values, step=step)
                took(records, last_seq)

    def write_table(self, record: TableRecord) -> None:
        """Log the table as a CSV asset at the record's step."""
        experiment = self._require_open()
        text, kinds = table_csv(record)
        with _mapped_errors():
            experiment.log_asset_data(
                text,
                name=table_file_name(record.name, record.step),
                step=record.step,
                metadata={TABLE_KEY: record.name, COLUMNS_KEY: kinds},
            )

    def flush(self) -> None:
        """Wait (up to ``flush_timeout``) until Comet has written (offline) or sent (online) what it got."""
        experiment = self._require_open()
        with _mapped_errors():
            experiment.flush(timeout=math.ceil(self.flush_timeout))
            if self._offline:
                _wait_offline_written(experiment, self.flush_timeout)

    def close(self, status: str) -> None:
        """Record ``status`` (``log_other("rllog_status", ...)``) and end the experiment (offline: write the zip)."""
        experiment = self._experiment
        if experiment is None:
            return
        with _mapped_errors():
            if not experiment.ended:  # else a repeated close: the experiment ended, its archive did not get written
                if self._offline:
                    _stop_writer_promptly(experiment)
                experiment.log_other(STATUS_KEY, status)
                experiment.end()
                self._remember_archive(experiment)
            if self._marker is not None and self._marker.is_file():
                # Comet only logs a failure to write the offline archive (e.g. a full disk) and leaves
                # the session's files behind: write the archive from them, or raise to be called again.
                _archive_left_behind(json.loads(self._marker.read_text()))
        self._experiment = None
        if self._marker is not None:
            self._marker.unlink(missing_ok=True)
            try:
                self._marker.parent.rmdir()  # only if empty
            except OSError:
                pass
            self._marker = None

    # -- internals ----------------------------------------------------------------------------------
    def _parameters(self, config: Any) -> dict[str, Any]:
        """Comet parameters of a flattened config, named as this sink's ``config_layout`` says."""
        if self.config_layout != TRANSFORMERS_LAYOUT:
            return {comet_name(str(k)): comet_param_value(v) for k, v in config.items()}
        args, model, own = split_transformers_config(config)
        named = {f"{ARGS_SECTION}/{k}": v for k, v in args.items()} | {f"{MODEL_SECTION}/{k}": v for k, v in model.items()}
        named = {k.replace("/", NESTED_SEPARATOR): v for k, v in named.items()} | own
        return {comet_name(k): comet_param_value(v) for k, v in named.items()}

    def _set_epoch(self, experiment: Any, records: Sequence[MetricsRecord]) -> None:
        """The latest ``epoch_key`` value of ``records`` as the experiment's epoch (``curr_epoch``)."""
        epochs = [r.values[self.epoch_key] for r in records if self.epoch_key is not None and self.epoch_key in r.values]
        if epochs:
            with _mapped_errors():
                experiment.set_epoch(epochs[-1])

    def _log_environment(self, experiment: Any, run_info: RunInfo) -> None:
        """What Comet's own start records about the training script (``log_environment``), from the trainer's
        program, arguments and model graph (not the delivery process's)."""
        from comet_ml import cli_args_parse

        program = run_info.program
        if program and os.path.isfile(program):
            experiment.set_filename(program)
            experiment.log_code(file_name=program)
        if len(run_info.args) > 1:  # Comet's own rule: a single argument is not parsed
            try:
                arguments = cli_args_parse._parse_cmd_args(list(run_info.args))
            except ValueError:
                arguments = cli_args_parse._parse_cmd_args_naive(list(run_info.args))
            if arguments:
                experiment.log_parameters(
                    {comet_name(str(k)): comet_param_value(v) for k, v in arguments.items()}, nested_support=False
                )
        experiment.set_pip_packages()
        experiment.set_os_packages()
        if self.model_graph:
            experiment.set_model_graph(self.model_graph)

    def _remember_archive(self, experiment: Any) -> None:
        """Add this session's offline archive to the run's list (:data:`ARCHIVES_KEY`)."""
        name = getattr(experiment, "_get_offline_archive_file_name", None)
        directory = getattr(experiment, "offline_directory", None)
        if not self._offline or self._remembered is None or not callable(name) or not directory:
            return
        path = os.path.abspath(os.path.join(directory, name()))
        archives = list(self._remembered.get(ARCHIVES_KEY) or [])
        if os.path.isfile(path) and path not in archives:
            self._remembered.save(**{ARCHIVES_KEY: [*archives, path]})

    def _require_open(self) -> Any:
        if self._experiment is None:
            raise RuntimeError("CometSink used before open() or after close()")
        return self._experiment

    def _write_marker(self, run_info: RunInfo, experiment: Any) -> None:
        """Remember where Comet keeps this offline session until ``end`` archives it (see :meth:`_recover`)."""
        tmpdir = getattr(experiment, "tmpdir", None)
        if not tmpdir:
            return
        try:
            directory = Path(run_info.run_dir) / PENDING_DIR
            directory.mkdir(parents=True, exist_ok=True)
            marker = directory / f"pending-{Path(tmpdir).name}.json"
            try:  # the (empty) zip comet created at start and fills at end
                archive = experiment._get_offline_archive_file_name()
            except Exception:
                archive = f"{experiment.id}-{random_suffix()}.zip"
            replace_file(  # whole or not at all: _recover reads it after a kill
                marker,
                json.dumps(
                    {
                        "tmpdir": tmpdir,
                        "offline_directory": experiment.offline_directory,
                        "archive": archive,
                        "experiment_key": experiment.id,
                        "project_name": experiment.project_name,
                        "workspace": experiment.workspace,
                        "start_time": experiment.start_time,
                        "tags": list(run_info.tags),
                        "pid": os.getpid(),
                    }
                ),
            )
            self._marker = marker
        except OSError as exc:
            log.warning("rllog: comet_ml: cannot write %s (no recovery after a crash): %s", PENDING_DIR, exc)

    def _recover(self, run_info: RunInfo) -> None:
        """Archive offline sessions of this run that never reached ``end`` (the delivery process was killed).

        Comet's offline experiment writes every message to a temporary directory and zips it only at
        ``end``; a killed process leaves that directory behind. Each one recorded under
        ``RUN_DIR/comet_ml/`` is zipped into the offline directory like ``end`` would have done (a torn
        last line is dropped), so what Comet was given is not lost.
        """
        directory = Path(run_info.run_dir) / PENDING_DIR
        if not directory.is_dir():
            return
        import comet_ml

        running = comet_ml.get_running_experiment()
        live_tmpdir = getattr(running, "tmpdir", None) if running is not None and not running.ended else None
        for marker in sorted(directory.glob("pending-*.json")):
            try:
                meta = json.loads(marker.read_text())
                if live_tmpdir is not None and Path(live_tmpdir) == Path(meta["tmpdir"]):
                    continue  # still being written by an experiment of this process
                path = _archive_left_behind(meta)
                if path is not None:
                    log.warning("rllog: comet_ml: recovered an offline session that was not ended: %s", path)
                marker.unlink(missing_ok=True)
            except Exception as exc:  # recovery is best effort; never block the new session
                log.warning("rllog: comet_ml: could not recover %s: %s", marker, exc)


def _archive_left_behind(meta: dict[str, Any]) -> str | None:
    """Zip an offline session's messages into its archive, as ``end`` would have; None if there is nothing left.

    ``meta`` is a session marker (see :meth:`CometSink._write_marker`). A torn last line of
    ``messages.json`` (the process was killed mid-write) is dropped. The temporary directory goes once
    the archive is written.
    """
    import shutil

    from comet_ml.offline_utils import create_experiment_archive, write_experiment_meta_file

    tmpdir = Path(meta["tmpdir"])
    messages = tmpdir / "messages.json"
    if not messages.is_file():
        return None
    data = messages.read_bytes()
    if data and not data.endswith(b"\n"):
        messages.write_bytes(data[: data.rfind(b"\n") + 1])
    fields: dict[str, Any] = {  # as Comet writes them at end; it takes None where a session never said
        "experiment_key": meta["experiment_key"],
        "workspace": meta.get("workspace"),
        "project_name": meta.get("project_name"),
        "start_time": meta.get("start_time"),
        "stop_time": None,
        "tags": meta.get("tags") or [],
    }
    write_experiment_meta_file(
        tempdir=str(tmpdir),
        resume_strategy="get_or_create",
        user_provided_experiment_key=True,
        comet_start_sourced=True,
        **fields,
    )
    path, _ = create_experiment_archive(
        offline_directory=meta["offline_directory"],
        offline_archive_file_name=meta.get("archive") or f"{meta['experiment_key']}-{random_suffix()}.zip",
        data_dir=str(tmpdir),
        logger=log,
    )
    shutil.rmtree(tmpdir, ignore_errors=True)
    return path
