"""MLflow backend: metrics, completion tables, config and run status in an MLflow run.

Talks to MLflow through its own ``mlflow.MlflowClient(tracking_uri)`` (never the fluent
``mlflow.start_run`` global state), so it can live in a thread next to other sinks. The MLflow run is,
first match wins: the ``run_id`` option, ``MLFLOW_RUN_ID`` (a run AzureML or Databricks created for the
job gets the data), the run an earlier session of this rllog run used (``RUN_DIR/trackers/mlflow.json``),
the run tagged ``rllog.run_id`` in the experiment, or a new run there. So a resumed run, or ``rllog
replay``, continues the same MLflow run. The experiment is the ``experiment_name`` option, else
``rllog.init``'s project when given, else ``MLFLOW_EXPERIMENT_NAME``, else ``"rllog"`` (``rllog.init``'s
default project), or MLflow's ``"Default"`` for a run of the transformers integration that names no project,
as transformers' ``MLflowCallback`` leaves it. ``MLFLOW_TAGS`` (a JSON object) adds tags, as that callback
does. A run this sink creates gets the system tags MLflow gives a script's run (:func:`system_tags`: user,
the trainer's program as source), naming the training script, not the delivery process.

Config: params. MLflow refuses to change a param, so a value that changes later (``Run.update_config``,
or a resumed run's new config) keeps the first value as the param and puts the current one in the tag
``rllog.config.<param>``. MLflow's own system-metrics monitor is never started (``MlflowClient`` does not
start it; ``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING`` applies to ``mlflow.start_run`` only): it would measure
the delivery process; rllog sends the trainer's ``system/...`` metrics itself.

Names: MLflow accepts metric and param keys made of letters, digits, ``_ - . / :`` and space, that do
not change under ``posixpath.normpath`` and have at most 250 characters. :func:`mlflow_key` maps any
name onto those rules (it leaves valid names alone); see ``docs/backends/mlflow.md``.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from rllog.errors import RateLimited, TransientError
from rllog.files import replace_file
from rllog.records import ConfigRecord, MetricsRecord, RunInfo, TableRecord
from rllog.sink import Capabilities
from rllog.sink_errors import exception_chain, map_errors
from rllog_backends._cells import cell
from rllog_backends._conventions import REMEMBERED_DIR, TRANSFORMERS_PROJECT, Remembered, env, explicit_project, first

logger = logging.getLogger(__name__)

MAX_KEY_LENGTH = 250  # MLflow's MAX_ENTITY_KEY_LENGTH (metric, param and tag keys)
MAX_PARAM_VALUE_LENGTH = 6000  # MLflow's MAX_PARAM_VAL_LENGTH
MAX_TAG_VALUE_LENGTH = 8000  # MLflow's MAX_TAG_VAL_LENGTH
MAX_METRICS_PER_BATCH = 1000  # MLflow's MAX_METRICS_PER_BATCH
MAX_PARAMS_PER_BATCH = 100  # MLflow's MAX_PARAMS_TAGS_PER_BATCH
MAX_BATCH_BYTES = 900_000  # MLflow rejects log_batch requests over 1e6 bytes of JSON
RUN_ID_TAG = "rllog.run_id"
CONFIG_TAG_PREFIX = "rllog.config."  # + param name: the current value of a param that changed
RENAMED_TAG_PREFIX = "rllog.renamed."
LOGGED_ARTIFACTS_TAG = "mlflow.loggedArtifacts"  # mlflow.utils.mlflow_tags.MLFLOW_LOGGED_ARTIFACTS
USER_TAG = "mlflow.user"  # mlflow.utils.mlflow_tags.MLFLOW_USER
SOURCE_NAME_TAG = "mlflow.source.name"  # MLFLOW_SOURCE_NAME
SOURCE_TYPE_TAG = "mlflow.source.type"  # MLFLOW_SOURCE_TYPE
LOCAL_SOURCE = "LOCAL"  # mlflow.entities.SourceType.LOCAL as MLflow writes it: a script run on this machine
SYSTEM_DEFAULT_USER = "unknown"  # MLflow's own name when no user can be found
DEFAULT_EXPERIMENT = "Default"  # MLflow's experiment for runs that name none
STATUS = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}

_HASH_LENGTH = 8
_BAD_CHARS = re.compile(r"[^\w/.\- :]" if os.name != "nt" else r"[^\w/.\- ]")  # MLflow's own rule, negated
_RETRY_CODES_429 = {"REQUEST_LIMIT_EXCEEDED", "RESOURCE_EXHAUSTED"}
_RETRY_CODES_5XX = {"TEMPORARILY_UNAVAILABLE", "DEADLINE_EXCEEDED"}


def experiment_name(run_info: RunInfo, option: str | None = None) -> str:
    """The experiment of a run the sink finds or creates: the ``experiment_name`` option, ``rllog.init``'s project when
    chosen, ``MLFLOW_EXPERIMENT_NAME``, else the default project: ``"rllog"``, or MLflow's ``"Default"`` for the
    transformers integration's, where transformers' ``MLflowCallback`` leaves a run that names no experiment."""
    project = DEFAULT_EXPERIMENT if run_info.project == TRANSFORMERS_PROJECT else run_info.project
    return first(option, explicit_project(run_info), env("MLFLOW_EXPERIMENT_NAME"), project, DEFAULT_EXPERIMENT)


def system_tags(run_info: RunInfo) -> dict[str, str]:
    """The system tags MLflow's fluent API gives a run it starts, describing the training script (not the delivery
    process the sink runs in): ``mlflow.user``, ``mlflow.source.name`` (the trainer's program) and
    ``mlflow.source.type``. The delivery agent is the trainer's child, so it runs as the trainer's user."""
    try:
        user = env("MLFLOW_TRACKING_USERNAME") or getpass.getuser()
    except (ImportError, KeyError, OSError):  # no user name in the environment nor the password database
        user = SYSTEM_DEFAULT_USER
    tags = {USER_TAG: user, SOURCE_TYPE_TAG: LOCAL_SOURCE}
    if run_info.program:
        tags[SOURCE_NAME_TAG] = run_info.program
    return tags


def _short_hash(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_LENGTH]


def _with_suffix(name: str, suffix: str) -> str:
    """``name_<suffix>``, the name cut so that the result fits in 250 characters."""
    return f"{name[: MAX_KEY_LENGTH - len(suffix) - 1]}_{suffix}"


def mlflow_key(key: str) -> str:
    """The name MLflow stores ``key`` under (metric, param or table name). Pure and deterministic.

    A name MLflow already accepts is returned unchanged. Otherwise, in this order:

    1. every character other than letters, digits, ``_ - . / :`` and space becomes ``_``
       (``eval/acc@1`` -> ``eval/acc_1``, ``loss(mean)`` -> ``loss_mean_``, ``a,b`` -> ``a_b``);
    2. the ``/``-separated path is normalised the way MLflow requires: empty segments go
       (``a//b`` -> ``a/b``, a leading or trailing ``/`` is dropped), ``.`` segments go, ``..``
       segments become ``__``, and a name starting with ``..`` gets a leading ``_``;
    3. an empty result becomes ``_``;
    4. a result over 250 characters is cut to 241 and ends with ``_`` and 8 hex digits of the SHA-1
       of the original key, so different long keys stay different.

    Two different keys can still map to the same name (``a@b`` and ``a(b``); :class:`MlflowSink` keeps
    them apart with a hash suffix on the later one (see the docs).

    Example:
        >>> mlflow_key("rewards/accuracy/mean")
        'rewards/accuracy/mean'
        >>> mlflow_key("eval/acc@1//")
        'eval/acc_1'
    """
    if _is_valid(key):
        return key
    name = _BAD_CHARS.sub("_", key)
    segments = []
    for segment in name.split("/"):
        if segment in ("", "."):
            continue
        segments.append("__" if segment == ".." else segment)
    name = "/".join(segments)
    if name.startswith(".."):
        name = "_" + name
    name = name or "_"
    if len(name) > MAX_KEY_LENGTH:
        name = _with_suffix(name, _short_hash(key))
    return name


def _is_valid(name: str) -> bool:
    """MLflow's own key rules (``mlflow.utils.validation``): characters, normpath-stable, length."""
    if not name or len(name) > MAX_KEY_LENGTH or _BAD_CHARS.search(name):
        return False
    norm = posixpath.normpath(name)
    return norm == name and norm != "." and not norm.startswith("..") and not norm.startswith("/")


class _Names:
    """Original name -> MLflow name for one namespace (metrics, params or tables), collision-free."""

    def __init__(self, kind: str, on_rename: Callable[[str, str, str], None] | None = None):
        self.kind = kind
        self._name: dict[str, str] = {}
        self._owner: dict[str, str] = {}
        self._on_rename = on_rename

    def preload(self, key: str, name: str) -> None:
        """Re-establish a collision rename made by an earlier process (read from the run's tags)."""
        self._name[key] = name
        self._owner[name] = key

    def __call__(self, key: str) -> str:
        name = self._name.get(key)
        if name is not None:
            return name
        base = name = mlflow_key(key)
        attempt = 0
        while self._owner.get(name, key) != key:
            name = _with_suffix(base, _short_hash(key if attempt == 0 else f"{key}#{attempt}"))
            attempt += 1
        if name != base:
            logger.warning(
                "mlflow: %s names %r and %r both map to %r; %r is stored as %r",
                self.kind, self._owner[base], key, base, key, name,
            )  # fmt: skip
            if self._on_rename is not None:
                self._on_rename(self.kind, key, name)
        self._name[key] = name
        self._owner[name] = key
        return name


def _chunks(items: Sequence[Any], max_count: int, size: Callable[[Any], int]) -> Iterator[list[Any]]:
    """Consecutive slices of ``items`` with at most ``max_count`` items and about MAX_BATCH_BYTES of JSON."""
    chunk: list[Any] = []
    total = 0
    for item in items:
        n = size(item)
        if chunk and (len(chunk) >= max_count or total + n > MAX_BATCH_BYTES):
            yield chunk
            chunk, total = [], 0
        chunk.append(item)
        total += n
    if chunk:
        yield chunk


def _error_code(exc: BaseException) -> TransientError | None:
    """MLflow's own error codes worth a retry, anywhere in the chain (``MlflowException.error_code``).

    A local store raises ``TEMPORARILY_UNAVAILABLE`` for any SQLAlchemy ``OperationalError`` (sqlite's
    "database is locked" and "database or disk is full" included); a Databricks backend answers
    ``REQUEST_LIMIT_EXCEEDED`` / ``RESOURCE_EXHAUSTED`` for a rate limit.
    """
    for current in exception_chain(exc):
        code = getattr(current, "error_code", None)
        if (type(current).__module__ or "").startswith("mlflow") and isinstance(code, str):
            if code in _RETRY_CODES_429:
                return RateLimited(None, f"mlflow: {exc}")
            if code in _RETRY_CODES_5XX:
                return TransientError(f"mlflow: {exc}")
    return None


def _mapped_errors() -> AbstractContextManager[None]:
    """Re-raises MLflow's failures worth a retry as rllog's (see :mod:`rllog.sink_errors`).

    MLflow wraps everything in ``MlflowException``; the cause is in the chain: ``requests`` ``RetryError``
    (urllib3 "too many 429 error responses": the status but not the response, so no Retry-After),
    connection errors and timeouts, an error code (:func:`_error_code`), or a full disk under the artifacts.
    """
    return map_errors("mlflow", classify=_error_code)


class MlflowSink:
    """Writes rllog records to an MLflow run (local sqlite store or a tracking server).

    Args:
        tracking_uri: MLflow tracking URI; default ``MLFLOW_TRACKING_URI``, else MLflow's default.
        experiment_name: MLflow experiment; default ``rllog.init``'s project when given, else
            ``MLFLOW_EXPERIMENT_NAME``, else ``"rllog"`` (``"Default"`` for the transformers integration's default
            project, as transformers' ``MLflowCallback``).
        run_id: an existing MLflow run to log into; default ``MLFLOW_RUN_ID``, else the run of an
            earlier session, else the run tagged with the rllog run id, else a new one.
        tags: tags set on the run (``{name: value}``); default ``MLFLOW_TAGS`` (a JSON object).
        artifact_location: artifact root for an experiment this sink creates (it becomes
            ``<artifact_location>/<experiment name>``). Default ``MLFLOW_ARTIFACT_ROOT``; for a sqlite
            URI without either, ``<directory of the .db>/mlartifacts``; otherwise MLflow's or the
            server's default. An existing experiment keeps its own location.
        http_max_retries: how often MLflow's REST client retries a request itself (it reads
            ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, process-wide). rllog retries with its own backoff, so
            for an ``http(s)://`` URI the sink sets it to this value, default 0 unless the variable is
            already set.

    Example:
        >>> run = rllog.init(report_to="mlflow", project="grpo-math",
        ...                  backend_options={"mlflow": {"tracking_uri": "sqlite:///mlflow.db"}})
        >>> run.log({"reward": 0.4, "eval/acc@1": 0.7}, step=1)   # stored as "eval/acc_1"
        >>> run.finish()
        >>> # mlflow ui --backend-store-uri sqlite:///mlflow.db: experiment "grpo-math", tag rllog.run_id
    """

    # Metrics, tables and the table list are held until flush(): one log_batch (with the table list's tag) and one
    # log_artifacts per flush instead of a store transaction (4 fsyncs with SQLite) per call and a log_text (a
    # temporary directory, a file and a copy: 2.5 ms of the agent's CPU, measured) per table.
    capabilities = Capabilities(tables=True, config=True, alerts=False, durable_writes=False)
    # imported when the tracking store opens (a standby agent imports them ahead: rllog.prepare)
    prepare_imports = (
        "mlflow.store.tracking.sqlalchemy_store",
        "mlflow.store.db.utils",
        "alembic.command",
        "alembic.config",
        "alembic.runtime.migration",
        "mlflow.entities",
    )

    @classmethod
    def prepare(cls) -> None:
        """Open the local SQLite tracking store the run will use (``MLFLOW_TRACKING_URI``, else MLflow's default,
        ``mlflow.db`` in the working directory), so the run's ``open`` finds it ready: MLflow creates its tables
        if the file is new (~2 s of CPU) and checks them in every new process (~0.6 s for an existing file,
        measured). It reads only: no experiment or run is made. A tracking server (``http...``) is left alone."""
        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI") or mlflow.get_tracking_uri()
        if uri.startswith("sqlite:"):
            mlflow.MlflowClient(tracking_uri=uri).search_experiments(max_results=1)

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment_name: str | None = None,
        artifact_location: str | None = None,
        http_max_retries: int | None = None,
        run_id: str | None = None,
        tags: Mapping[str, Any] | None = None,
    ):
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.given_run_id = run_id
        self.tags = dict(tags) if tags is not None else None
        self.artifact_location = artifact_location
        self.http_max_retries = http_max_retries
        self._client: Any = None
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self._metric_names = _Names("metric", self._remember_rename)
        self._table_names = _Names("table", self._remember_rename)
        self._param_names = _Names("param")
        self._params: dict[str, str] = {}  # param name -> the value MLflow holds
        self._config_tags: dict[str, str] = {}  # param name -> current value, for params that changed
        self._logged_artifacts: list[dict[str, str]] | None = []
        self._pending_metrics: list[Any] = []  # written, not yet sent (flush)
        self._pending_tables: str | None = None  # the table list to set at the next flush
        self._staged: Path | None = None  # table files written since the last flush, uploaded together by flush()
        self._last_timestamp = 0  # ms, of the last record written

    # -- MetricSink ----------------------------------------------------------------------------

    def open(self, run_info: RunInfo) -> None:
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        if uri and uri.startswith(("http://", "https://")):
            if self.http_max_retries is not None:
                os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = str(int(self.http_max_retries))
            else:
                os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        from mlflow import MlflowClient

        remembered = Remembered(run_info.run_dir, "mlflow", run_info.run_id)
        with _mapped_errors():
            self._client = MlflowClient(tracking_uri=uri)
            run = self._given_run(remembered, uri) or self._run_of_experiment(run_info, uri)
            if run.info.status != "RUNNING":
                self._client.update_run(run.info.run_id, status="RUNNING")
            self.run_id = run.info.run_id
            self.experiment_id = run.info.experiment_id
            if run.data.tags.get(RUN_ID_TAG) != run_info.run_id:
                self._client.set_tag(self.run_id, RUN_ID_TAG, run_info.run_id, synchronous=True)
            self._resume_state(run.data.tags)
            self._params = dict(run.data.params)
            self._log_params(run_info.config)
            self._set_tags()
        remembered.save(tracking_uri=uri or "", run_id=self.run_id)
        # What an earlier agent staged and never flushed was not acknowledged: it is delivered again from the journal.
        self._staged = Path(run_info.run_dir) / REMEMBERED_DIR / "mlflow-tables"
        shutil.rmtree(self._staged, ignore_errors=True)

    def write_config(self, record: ConfigRecord) -> None:
        """Config given after ``open``: new keys become params, a changed value goes to ``rllog.config.<param>``."""
        with _mapped_errors():
            self._log_params(record.values)

    def write_metrics(self, records: Sequence[MetricsRecord]) -> None:
        from mlflow.entities import Metric

        metrics = []
        last = self._last_timestamp
        with _mapped_errors():  # a name collision's rename is a run tag, sent now
            for record in records:
                # Strictly increasing per record: MLflow orders a history by timestamp and stores
                # identical (key, timestamp, step, value) once, so a repeated step in the same ms
                # would otherwise be reordered or merged.
                last = timestamp = max(round(record.time * 1000), last + 1)
                for key, value in record.values.items():
                    metrics.append(Metric(self._metric_names(key), float(value), timestamp, int(record.step)))
        self._pending_metrics.extend(metrics)
        self._last_timestamp = last

    def write_table(self, record: TableRecord) -> None:
        columns = record.table.column_names
        data = [[cell(v) for v in row] for row in zip(*(column.to_pylist() for column in record.table.columns), strict=True)]
        # The format of MlflowClient.log_table (pandas "split", no index), so load_table reads it.
        text = json.dumps({"columns": columns, "data": data}, default=str)
        assert self._staged is not None, "open() first"
        with _mapped_errors():  # a full disk is transient here too
            directory = f"tables/{self._table_names(record.name)}"
            path = f"{directory}/step_{record.step:06d}-seq_{record.seq:06d}.json"
            replace_file(self._staged / path, text)  # UTF-8, as log_text writes it; whole or not at all
            self._register_table(directory, path)

    def flush(self) -> None:
        """Send what was written since the last flush: the table files (one ``log_artifacts``), then the metrics
        (``log_batch`` chunks) and the table list.

        A chunk leaves the buffer once MLflow took it, so a flush repeated after an error resumes where
        it stopped (a repeated chunk is stored once: MLflow skips identical metric rows).
        """
        from mlflow.entities import RunTag

        with _mapped_errors():
            if self._staged is not None and self._staged.is_dir():
                # The files first: the table list sent below names them. A repeated upload overwrites (idempotent).
                self._client.log_artifacts(self.run_id, str(self._staged))
                shutil.rmtree(self._staged)
            while self._pending_metrics or self._pending_tables is not None:
                chunk = next(_chunks(self._pending_metrics, MAX_METRICS_PER_BATCH, lambda m: len(json.dumps(m.key)) + 80), [])
                # The table list rides with the first chunk: one call (one request to a tracking server), not two.
                tags = [] if self._pending_tables is None else [RunTag(LOGGED_ARTIFACTS_TAG, self._pending_tables)]
                self._client.log_batch(self.run_id, metrics=chunk, tags=tags, synchronous=True)
                del self._pending_metrics[: len(chunk)]
                self._pending_tables = None
            # The delivery layer acknowledges up to here: an agent killed later re-sends from the next record
            # with a new sink, whose timestamps start afresh. Starting afresh here too gives a re-sent record
            # the timestamp it had, so MLflow stores it once.
            self._last_timestamp = 0

    def close(self, status: str) -> None:
        if self.run_id is None:
            return
        self.flush()
        with _mapped_errors():
            self._client.set_terminated(self.run_id, status=STATUS.get(status, "FAILED"))

    # -- helpers -------------------------------------------------------------------------------

    def _given_run(self, remembered: Remembered, uri: str | None) -> Any:
        """The run named by the ``run_id`` option or ``MLFLOW_RUN_ID``, else an earlier session's run (None if none).

        A named run that does not exist is an error; a remembered one that is gone (deleted, another
        tracking store) is skipped.
        """
        from mlflow.exceptions import MlflowException

        given = first(self.given_run_id, env("MLFLOW_RUN_ID"))
        if given is not None:
            run = self._client.get_run(given)
            if run.info.lifecycle_stage == "deleted":
                raise ValueError(f"MLflow run {given!r} is deleted: restore it (`mlflow runs restore`) or unset MLFLOW_RUN_ID")
            return run
        previous = remembered.get("run_id")
        if previous is None or remembered.get("tracking_uri") != (uri or ""):
            return None
        try:
            run = self._client.get_run(previous)
        except MlflowException as exc:
            if getattr(exc, "error_code", None) not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise
            return None
        return run if run.info.lifecycle_stage != "deleted" else None

    def _run_of_experiment(self, run_info: RunInfo, uri: str | None) -> Any:
        """The experiment's run tagged with this rllog run id, or a new one there."""
        self.experiment_id = self._experiment(run_info, uri)
        run = self._find_run(run_info.run_id)
        if run is None:
            tags = {mlflow_key(t): "" for t in run_info.tags if not mlflow_key(t).startswith("mlflow.")}
            tags.update(system_tags(run_info))
            tags[RUN_ID_TAG] = run_info.run_id
            run = self._client.create_run(self.experiment_id, run_name=run_info.name or None, tags=tags)
        return run

    def _experiment(self, run_info: RunInfo, uri: str | None) -> str:
        from mlflow.exceptions import MlflowException

        name = experiment_name(run_info, self.experiment_name)
        experiment = self._client.get_experiment_by_name(name)
        if experiment is None:
            try:
                return self._client.create_experiment(name, artifact_location=self._artifact_location(name, uri))
            except MlflowException as exc:  # created meanwhile by another process
                experiment = self._client.get_experiment_by_name(name)
                if experiment is None:
                    raise exc
        if experiment.lifecycle_stage == "deleted":
            raise ValueError(
                f"MLflow experiment {name!r} is deleted: restore it (`mlflow experiments restore`) or use another project name"
            )
        return experiment.experiment_id

    def _set_tags(self) -> None:
        """The ``tags`` option, else ``MLFLOW_TAGS`` (a JSON object), on the run; an unreadable variable is ignored."""
        from mlflow.entities import RunTag

        tags = self.tags
        if tags is None and env("MLFLOW_TAGS"):
            try:
                tags = json.loads(os.environ["MLFLOW_TAGS"])
            except ValueError as exc:
                logger.warning("mlflow: MLFLOW_TAGS is not JSON, ignored: %s", exc)
            if not isinstance(tags, dict):
                logger.warning("mlflow: MLFLOW_TAGS is not a JSON object, ignored")
                tags = None
        if tags:
            run_tags = [RunTag(str(k), str(v)[:MAX_TAG_VALUE_LENGTH]) for k, v in tags.items()]
            self._client.log_batch(self.run_id, tags=run_tags, synchronous=True)

    def _artifact_location(self, experiment: str, uri: str | None) -> str | None:
        root = self.artifact_location or os.environ.get("MLFLOW_ARTIFACT_ROOT")
        if not root and uri and uri.startswith("sqlite:///") and uri != "sqlite:///:memory:":
            root = os.path.join(os.path.dirname(os.path.abspath(uri[len("sqlite:///") :])), "mlartifacts")
        if not root:
            return None
        if "://" not in root:
            root = os.path.abspath(root)
        return f"{root.rstrip('/')}/{mlflow_key(experiment)}"

    def _find_run(self, run_id: str) -> Any:
        quote = '"' if "'" in run_id else "'"
        runs = self._client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = {quote}{run_id}{quote}", max_results=1
        )
        return runs[0] if runs else None

    def _resume_state(self, tags: dict[str, str]) -> None:
        """Collision renames and registered tables from an earlier process, read from the run's tags."""
        self._config_tags = {k[len(CONFIG_TAG_PREFIX) :]: v for k, v in tags.items() if k.startswith(CONFIG_TAG_PREFIX)}
        for key, value in tags.items():
            if key.startswith(RENAMED_TAG_PREFIX):
                try:
                    entry = json.loads(value)
                    names = {"metric": self._metric_names, "table": self._table_names}[entry["kind"]]
                    names.preload(entry["key"], entry["name"])
                except (ValueError, KeyError, TypeError):
                    logger.warning("mlflow: ignoring unreadable tag %s", key)
        try:
            logged = json.loads(tags.get(LOGGED_ARTIFACTS_TAG, "[]"))
            self._logged_artifacts = logged if isinstance(logged, list) else None
        except ValueError:
            self._logged_artifacts = None  # not ours to repair; tables are still written

    def _remember_rename(self, kind: str, key: str, name: str) -> None:
        """Record a collision rename as a run tag, so a resumed sink makes the same choice."""
        value = json.dumps({"kind": kind, "key": key, "name": name})
        if self.run_id is not None and len(value) <= MAX_TAG_VALUE_LENGTH:
            self._client.set_tag(
                self.run_id, f"{RENAMED_TAG_PREFIX}{kind}.{_short_hash(kind + ':' + key)}", value, synchronous=True
            )

    def _register_table(self, directory: str, path: str) -> None:
        """List the table's newest file in ``mlflow.loggedArtifacts`` (what the MLflow UI shows as tables).

        One entry per table name (the last logged): one per file would overflow the tag's 8000
        characters after about 120 tables, after which ``MlflowClient.log_table`` itself fails.
        """
        if self._logged_artifacts is None:
            return
        entries = [
            e
            for e in self._logged_artifacts
            if not (isinstance(e, dict) and posixpath.dirname(str(e.get("path", ""))) == directory)
        ]
        entries.append({"path": path, "type": "table"})
        value = json.dumps(entries)
        if len(value) > MAX_TAG_VALUE_LENGTH:
            logger.warning(
                "mlflow: too many table names to list in %s; later tables are only in the artifacts", LOGGED_ARTIFACTS_TAG
            )
            self._logged_artifacts = None
            return
        self._pending_tables = value
        self._logged_artifacts = entries

    def _log_params(self, config: Mapping[str, Any]) -> None:
        """New keys become params; a changed value becomes the tag ``rllog.config.<param>`` (MLflow params cannot change)."""
        from mlflow.entities import Param, RunTag

        params, changed = [], []
        for key, value in config.items():
            name = self._param_names(key)
            text = str(value)[:MAX_PARAM_VALUE_LENGTH]
            if name not in self._params:
                params.append(Param(name, text))
            elif text != self._config_tags.get(name, self._params[name]):
                changed.append(RunTag(mlflow_key(CONFIG_TAG_PREFIX + name), str(value)[:MAX_TAG_VALUE_LENGTH]))
                self._config_tags[name] = text
        size = lambda e: len(json.dumps(e.key)) + len(json.dumps(e.value)) + 30  # noqa: E731
        for chunk in _chunks(params, MAX_PARAMS_PER_BATCH, size):
            self._client.log_batch(self.run_id, params=chunk, synchronous=True)
            self._params.update((p.key, p.value) for p in chunk)
        for tags in _chunks(changed, MAX_PARAMS_PER_BATCH, size):
            self._client.log_batch(self.run_id, tags=tags, synchronous=True)
        if changed:
            logger.warning(
                "mlflow: params cannot change; the new values of %s are in the tags %s",
                [t.key[len(CONFIG_TAG_PREFIX):] for t in changed], [t.key for t in changed],
            )  # fmt: skip
