"""Weights & Biases backend: metrics, tables and config to a wandb run (online or offline).

One rllog run is one wandb run. Its wandb id is derived from ``run_info.run_id``
(:func:`wandb_run_id`) unless ``WANDB_RUN_ID`` names one, and the run is opened with ``resume="allow"``
(or ``WANDB_RESUME``), so a resumed rllog run, or ``rllog replay`` after a crash, continues the same wandb
run instead of creating a second one. The id, project, entity and name chosen at the first session are
remembered in ``RUN_DIR/trackers/wandb.json`` for the later ones (see ``rllog_backends._conventions``).

**Conventions.** With no explicit value (an option, or ``rllog.init``'s project/name other than the
defaults ``"rllog"`` / ``"run-<id>"``), wandb's own variables apply: ``WANDB_PROJECT``, ``WANDB_NAME``,
``WANDB_RUN_ID``, ``WANDB_RESUME``, ``WANDB_ENTITY``, ``WANDB_TAGS`` (when ``init`` has no tags),
``WANDB_RUN_GROUP``, ``WANDB_JOB_TYPE``, ``WANDB_MODE``, ``WANDB_DIR``.

**The agent is not the trainer.** The sink runs in rllog's delivery process, so wandb's system-metrics
sampler is off (``x_disable_stats``: it would sample the agent; rllog sends the trainer's own
``system/...`` metrics), and the run's metadata names the trainer's program and arguments
(``run_info.program`` / ``run_info.args``), not ``-m rllog.agent ...``.

**Steps.** wandb drops, with only a warning, any row whose ``step=`` is lower than the run's current
step. rllog never passes ``step=``: wandb's own ``_step`` counts the ``log`` calls (one row per
record, or per run of consecutive records of one step whose keys do not repeat), and the rllog step goes into its own key, ``rllog/step``, declared as the x-axis of every
metric with ``define_metric("*", step_metric="rllog/step")`` (the same recipe as transformers'
``WandbCallback``). A record whose step goes back is therefore stored like any other.

**Names.** Metric names are used as they are (``rewards/accuracy/mean`` groups under ``rewards`` in
the UI). The keys wandb writes itself (``_step``, ``_runtime``, ``_timestamp``, ``_wandb``) and the
step key are renamed with an ``rllog/`` prefix (``_step`` -> ``rllog/_step``): wandb would otherwise
overwrite the value or corrupt its own.

**Tables** become ``wandb.Table`` objects logged at the record's step. wandb keeps at most 10,000
rows of a table logged this way and cuts the rest without an error, so a larger table is logged as
parts ``<name>/part_0``, ``<name>/part_1``, ... of at most ``max_table_rows`` rows each, all in one
row of the history (same step).

**Status.** ``close(status)`` calls ``run.finish(exit_code=...)``: ``finished`` -> 0, ``failed`` -> 1,
``killed`` -> 255 (wandb has no "killed" state: the UI shows a non-zero exit as failed).

Example:
    >>> run = rllog.init(report_to="wandb", project="grpo-math")   # WANDB_MODE=offline works too
    >>> run.log({"reward": 0.4}, step=1)
    >>> run.finish()
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import struct
import sys
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from rllog.records import AlertRecord, ConfigRecord, MetricsRecord, RunInfo, TableRecord, step_rows
from rllog.rundir import RunFile
from rllog.sink import Capabilities, took
from rllog.sink_errors import URLLIB3_RETRIES, map_errors, retry_error
from rllog_backends._cells import cell
from rllog_backends._conventions import (
    TRANSFORMERS_LAYOUT,
    Remembered,
    env,
    explicit_name,
    explicit_project,
    first,
    nest,
    split_transformers_config,
)

STEP_KEY = "rllog/step"
MAX_TABLE_ROWS = 10_000  # wandb.Table.MAX_ROWS: rows beyond it are cut when a table is logged
RESERVED_KEYS = frozenset({"_step", "_runtime", "_timestamp", "_wandb"})
EXIT_CODES = {"finished": 0, "failed": 1, "killed": 255}
MAX_TAG_CHARS = 64
MAX_PROJECT_CHARS = 128
LOG_BLOCK = 32 * 1024  # the .wandb transaction log's block size (LevelDB log format)
DEFAULT_RESUME = "allow"
#: wandb.Settings rllog sets unless the ``settings`` option says otherwise: no console capture (the
#: agent's output is not the training log) and no system-metrics sampler (it would sample the agent).
DEFAULT_SETTINGS = {"console": "off", "x_disable_stats": True}
_ARGV_LOCK = threading.Lock()
log = logging.getLogger("rllog.backends.wandb")
_ID_OK = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HTTP_STATUS = re.compile(r"(?:HTTP|status(?:[ _]code)?|response code|returned error)\W{0,3}([45]\d\d)\b", re.IGNORECASE)


def wandb_run_id(run_id: str) -> str:
    """The wandb run id for an rllog ``run_id``: itself when wandb allows it, else a stable safe form.

    wandb ids may not contain ``/ \\ # ? % : ; , '``; we keep ``[A-Za-z0-9_-]`` and at most 64
    characters. Anything else is replaced and a short hash of the original is appended, so two
    different rllog ids never share a wandb run.
    """
    if _ID_OK.match(run_id):
        return run_id
    safe = re.sub(r"[^A-Za-z0-9_-]+", "-", run_id).strip("-")[:40]
    digest = hashlib.sha1(run_id.encode("utf-8")).hexdigest()[:12]
    return f"{safe}-{digest}" if safe else digest


def wandb_key(key: str, step_key: str = STEP_KEY) -> str:
    """A metric or table name as logged to wandb (only wandb's own keys and the step key change)."""
    return f"rllog/{key}" if key in RESERVED_KEYS or key == step_key else key


def exit_code_for(status: str) -> int:
    """The ``run.finish`` exit code for an rllog status (an unknown status counts as failed)."""
    return EXIT_CODES.get(status, 1)


def status_for(exit_code: int) -> str:
    """The rllog status for a wandb exit code (inverse of :func:`exit_code_for`)."""
    return {v: k for k, v in EXIT_CODES.items()}.get(exit_code, "failed")


def _rules() -> dict[str, Any]:
    """What is particular to wandb in :func:`rllog.sink_errors.retry_error` (wandb is imported by then)."""
    from wandb.errors import AuthenticationError, CommError

    return {
        "transient": (CommError,),  # wandb's wrapper of timeouts and dropped connections
        "permanent": (AuthenticationError,),  # a CommError subclass; a retry would not help
        "status_patterns": (_HTTP_STATUS, URLLIB3_RETRIES),  # CommError often has the status only in its text
        "wrapped": ("exc",),  # CommError.exc: the exception it wraps
    }


def map_error(exc: BaseException) -> BaseException:
    """Translate an exception from wandb into rllog's retryable errors, or return it unchanged.

    - HTTP 429 anywhere in the chain (a ``response.status_code``, or ``HTTP 429`` in wandb's message)
      -> :class:`~rllog.errors.RateLimited`, with ``Retry-After`` when a response carries it.
    - HTTP 5xx or 408 -> :class:`~rllog.errors.TransientError`.
    - a ``wandb.errors.CommError`` without an HTTP status (timeouts, dropped connections), Python's
      ``ConnectionError``/``TimeoutError``, ``requests`` connection errors and a full disk -> :class:`~rllog.errors.TransientError`.
    - everything else (``AuthenticationError``, ``UsageError``, other HTTP 4xx, bugs) is returned as is:
      retrying would not help.
    """
    mapped = retry_error(exc, "wandb", **_rules())
    return exc if mapped is None else mapped


def _mapped() -> AbstractContextManager[None]:
    """Re-raises wandb's retryable errors as rllog's (see :func:`map_error`)."""
    return map_errors("wandb", **_rules())


def run_location(run: Any) -> dict[str, str]:
    """Where a user finds a wandb run (``rllog finish`` and ``rllog show`` print it): online its ``url``; offline
    the folder of its ``.wandb`` file (``dir``) and the command that uploads it (``sync``); nothing when disabled."""
    settings = run.settings
    if settings.mode in ("offline", "dryrun"):
        return {"dir": str(settings.sync_dir), "sync": f"wandb sync {settings.sync_dir}"}
    url = getattr(run, "url", None)
    return {"url": url} if url else {}


def exit_written(path: str | os.PathLike) -> bool:
    """Whether the run's ``.wandb`` transaction log already holds its exit record.

    Reads only the last one or two 32 KiB blocks: the exit record is the last record wandb writes.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(7, (size // LOG_BLOCK - 1) * LOG_BLOCK)
            f.seek(start)
            data = f.read()
    except OSError:
        return False
    pos, pending = start, None
    end = start + len(data)
    while pos + 7 <= end:
        left = LOG_BLOCK - pos % LOG_BLOCK
        if left < 7:
            pos += left
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos - start)
        chunk = data[pos - start + 7 : pos - start + 7 + length]
        if kind == 0 or len(chunk) < length or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            return False
        pos += 7 + length
        if kind == 2:
            pending = chunk
            continue
        if kind == 3:
            pending = pending + chunk if pending is not None else None
            continue
        if kind == 4:
            payload, pending = (pending + chunk if pending is not None else None), None
        else:
            payload = chunk
        if payload is not None:
            record = pb.Record()  # generated protobuf module
            try:
                record.ParseFromString(payload)
            except Exception:
                continue
            if record.WhichOneof("record_type") == "exit":
                return True
    return False


@contextmanager
def _open_unsynced(path: Any, mode: str = "w", encoding: str | None = None) -> Iterator[Any]:
    with open(path, mode, encoding=encoding) as f:
        yield f


def _own_service() -> None:
    """Let wandb start its service for this process rather than join one another process started.

    wandb puts its service's address in ``WANDB_SERVICE`` ("<version>-<pid that started it>-unix-<socket>"), and
    children inherit it. In the delivery agent it names the trainer's service (when the training script used wandb
    itself): the tracker work would then run in the trainer's process tree at normal priority, and stop with the
    trainer (the service exits with the process that started it), so an agent could not deliver the rest after a
    crash. Called only in a process rllog owns (the agent): in the trainer, an inherited token is how wandb lets
    a child share its parent's service, and the environment is the user's.
    """
    match = re.match(r"[^-]+-(\d+)-", os.environ.get("WANDB_SERVICE", ""))
    if match and int(match.group(1)) != os.getpid():
        del os.environ["WANDB_SERVICE"]


_set_up_early = False  # wandb.setup() ran in prepare(), with the variables the standby agent started with
_set_up_lock = threading.Lock()


def _set_up_again_if_the_variables_changed() -> None:
    """The trainer's ``WANDB_*`` variables (given to the agent when the run starts) differ from those wandb read in
    :meth:`WandbSink.prepare` (e.g. ``WANDB_MODE=offline`` set after the trainer was built): wandb would ignore them
    with a warning, so end that wandb setup and its service; ``wandb.init`` starts new ones that read them. Only a
    setup this module made early: in the trainer's own process the user's wandb is left alone."""
    global _set_up_early
    with _set_up_lock:
        if not _set_up_early:
            return
        _set_up_early = False
        import wandb

        try:
            from wandb.sdk import wandb_setup

            if wandb_setup.singleton().did_environment_change():
                wandb.teardown()
        except BaseException as exc:  # an optimisation's undoing: never a reason not to open the run
            log.warning("rllog: could not restart wandb's early setup (%r); opening the run with it", exc)


def _skip_temporary_fsync() -> None:
    """wandb writes each logged table's JSON to a file of a temporary directory and ``fsync``s it, then copies it to
    its staging area (no ``fsync``) and deletes it: the sync protects nothing and costs a disk flush per table, which
    on a small machine slows the training beside the agent (docs/backends/wandb.md). Turned off (``Artifact.new_file``)
    only in a process rllog owns (the agent): the patch is process-wide, and in the trainer it would also take the
    sync from the user's own wandb artifacts. A wandb without this function is left as it is."""
    try:
        from wandb.sdk.artifacts import artifact
    except ImportError:
        return
    if callable(getattr(artifact, "fsync_open", None)):
        artifact.fsync_open = _open_unsynced


def _mixed_table(wandb: Any, columns: list[Any], rows: list[list[Any]]) -> Any:
    """``wandb.Table(columns=columns, data=rows, allow_mixed_types=True)`` without its per-row type check.

    With mixed types allowed, every column is typed "any or none" whatever the rows hold, so the check of each
    row's cells (``Table.add_data``) changes nothing: the rows are set directly. Same table file, same column types
    (compared); ~0.03 ms for a 16-row completions table instead of ~0.6 (one a step, in the agent beside training).
    """
    table = wandb.Table(columns=columns, allow_mixed_types=True)
    table.data = rows
    return table


def _clean_project(project: str) -> str:
    return re.sub(r"[/\\#?%:]", "-", project)[:MAX_PROJECT_CHARS] or "rllog"


def _clean_tags(tags: Sequence[str]) -> list[str]:
    return [str(t)[:MAX_TAG_CHARS] for t in tags if str(t)]


def outside_the_trainer(run_info: RunInfo) -> bool:
    """Whether this process is not the trainer that writes the run (``run.json``'s pid): rllog's delivery agent or
    ``rllog replay``, processes rllog owns, where the sink may set process-wide state for wandb. False in the
    trainer (``delivery="thread"``, a sink object) and when the run file cannot tell: a process rllog does not own
    is left as it is."""
    try:
        writer = RunFile.read(run_info.run_dir).pid
    except (OSError, ValueError, TypeError, KeyError):
        return False
    return writer is not None and writer != os.getpid()


@contextmanager
def _trainer_argv(run_info: RunInfo, owns_process: bool) -> Iterator[None]:
    """``sys.argv`` set to the trainer's command line while ``wandb.init`` runs, in a process rllog owns
    (``owns_process``: :func:`outside_the_trainer`).

    wandb records ``sys.argv[1:]`` as the run's arguments when it starts the run (a computed setting
    that no option overrides); in the delivery agent they would be the agent's. In the trainer they are the
    trainer's already, and its ``sys.argv`` belongs to the user (another thread may read it): left alone.
    """
    if not run_info.program or not owns_process:
        yield
        return
    with _ARGV_LOCK:
        saved = sys.argv
        sys.argv = [run_info.program, *run_info.args]
        try:
            yield
        finally:
            sys.argv = saved


class WandbSink:
    """Writes metrics, tables and config to a Weights & Biases run.

    Every option is optional; an option given wins over wandb's environment variable, which wins over
    rllog's default (docs/backends.md, "Precedence"). wandb's other variables (``WANDB_MODE``,
    ``WANDB_API_KEY``, ``WANDB_BASE_URL``...) apply as usual.

    Args:
        project: wandb project; default ``rllog.init``'s project if given, else ``WANDB_PROJECT``, else
            ``"rllog"`` (characters wandb rejects, ``/\\#?%:``, become ``-``; at most 128 characters).
        entity: wandb entity (user or team); default ``WANDB_ENTITY`` / your default entity.
        name: the run's display name; default ``rllog.init``'s name if given, else ``WANDB_NAME``, else
            ``run-<id>``.
        group: run group; default ``WANDB_RUN_GROUP``.
        job_type: job type; default ``WANDB_JOB_TYPE``.
        mode: ``"online"``, ``"offline"`` or ``"disabled"``; default ``WANDB_MODE`` (else online).
        dir: where wandb writes its ``wandb/`` folder; default ``WANDB_DIR``, else the rllog run directory.
        id: the wandb run id; default ``WANDB_RUN_ID``, else derived from ``run_info.run_id`` (:func:`wandb_run_id`).
        resume: wandb's ``resume`` argument; default ``WANDB_RESUME``, else ``"allow"`` (continue the run
            with this id if it exists).
        step_key: the history key that holds the rllog step (the x-axis of every metric).
        max_table_rows: rows per logged ``wandb.Table`` (at most wandb's 10,000); larger tables are
            split into ``<name>/part_<i>``.
        settings: extra ``wandb.Settings`` fields; rllog sets ``console="off"`` (the delivery process's
            output is not the training log), ``x_disable_stats=True`` (wandb's sampler would measure the
            delivery process) and ``program`` (the trainer's) unless given here.
        close_timeout: seconds ``close`` waits, after ``run.finish``, for wandb's service to write the
            run's exit record to the local ``.wandb`` file (``run.finish`` can return before it does).
        summary_keys: ``{metric: summary key}``: a metric's value also goes to the run summary under that key
            (the transformers integration passes ``{"train/train_runtime": "train_runtime", ...}``: the runs table's
            columns of transformers' ``WandbCallback``).
        config_layout: ``"rllog"`` (default): the config's keys as rllog flattened them (``a/b``);
            ``"transformers"``: as transformers' ``WandbCallback`` gives it: dict values nested again
            (``accelerator_config``, ``rope_parameters``), the model config's keys (``model/...``) at the top level
            under the TrainingArguments', ``model/num_parameters`` as it is.

    Example:
        >>> sink = WandbSink(entity="my-team", settings={"x_stats_sampling_interval": 30})
        >>> run = rllog.init(report_to=[sink], project="grpo-math")
    """

    # Not durable on return: run.log hands the row to wandb's service process, which writes it later;
    # flush() waits for the service to have it.
    capabilities = Capabilities(tables=True, config=True, alerts=True, durable_writes=False)
    # imported by wandb.init and by the first logged table (a standby agent imports them ahead: rllog.prepare)
    prepare_imports = ("wandb.sdk.launch", "wandb.proto.wandb_internal_pb2", "pandas")

    @classmethod
    def prepare(cls) -> None:
        """Start wandb's service (``wandb-core``) in the standby agent, while the trainer is built: ``wandb.init``
        at the start of ``train()`` then takes ~0.25 s instead of ~0.45 (measured), and the service's start-up
        is off the first training steps. It starts no run; the service ends with the agent. wandb reads its
        ``WANDB_*`` variables here, once: :meth:`open` starts wandb afresh if the trainer's differ by then."""
        global _set_up_early
        import wandb

        _own_service()  # not a service the training script's own wandb started (its WANDB_SERVICE); prepare runs
        # only in the standby agent (rllog.agent), a process rllog owns
        wandb.setup()
        _set_up_early = True

    def __init__(
        self,
        project: str | None = None,
        entity: str | None = None,
        name: str | None = None,
        group: str | None = None,
        job_type: str | None = None,
        mode: str | None = None,
        dir: str | None = None,
        id: str | None = None,
        resume: str | None = None,
        step_key: str = STEP_KEY,
        max_table_rows: int = MAX_TABLE_ROWS,
        settings: dict[str, Any] | None = None,
        close_timeout: float = 30.0,
        summary_keys: dict[str, str] | None = None,
        config_layout: str = "rllog",
    ):
        if max_table_rows < 1:
            raise ValueError("max_table_rows must be at least 1")
        if config_layout not in ("rllog", TRANSFORMERS_LAYOUT):
            raise ValueError(f"config_layout must be 'rllog' or {TRANSFORMERS_LAYOUT!r}, not {config_layout!r}")
        self.summary_keys = dict(summary_keys or {})
        self.config_layout = config_layout
        self.project = project
        self.entity = entity
        self.name = name
        self.group = group
        self.job_type = job_type
        self.mode = mode
        self.dir = dir
        self.id = id
        self.resume = resume
        self.step_key = step_key
        self.max_table_rows = max_table_rows
        self.settings = dict(settings or {})
        self.close_timeout = close_timeout
        self._run: Any = None
        self._owns_process = False  # set by open: this process is rllog's (the agent, replay), not the trainer

    @property
    def run(self) -> Any:
        """The ``wandb.Run`` while the sink is open, else None."""
        return self._run

    def open(self, run_info: RunInfo) -> None:
        if self._run is None:
            import wandb

            self._owns_process = outside_the_trainer(run_info)
            if self._owns_process:  # process-wide changes, only where rllog owns the process
                _skip_temporary_fsync()
                _own_service()
            _set_up_again_if_the_variables_changed()
            directory = self.dir or os.environ.get("WANDB_DIR") or run_info.run_dir
            remembered = Remembered(run_info.run_dir, "wandb", run_info.run_id)
            identity = self.identity(run_info, remembered)
            with _mapped(), _trainer_argv(run_info, self._owns_process):
                Path(directory).mkdir(parents=True, exist_ok=True)
                self._run = wandb.init(
                    **identity,
                    # wandb reads its variables once per process (at its first init): read them here.
                    group=first(self.group, env("WANDB_RUN_GROUP")),
                    job_type=first(self.job_type, env("WANDB_JOB_TYPE")),
                    mode=self.mode,  # type: ignore[arg-type]  # a str option, checked by wandb
                    resume=first(self.resume, env("WANDB_RESUME"), DEFAULT_RESUME),
                    config=self._config(run_info.config),
                    allow_val_change=True,  # a resumed run gets the same config again
                    dir=str(directory),
                    # A new run object every time, without touching wandb.run: works from any
                    # thread, several times per process, next to the user's own wandb run.
                    reinit="create_new",
                    settings=wandb.Settings(**self._settings(run_info)),
                )
            remembered.save(**identity, **run_location(self._run))
        with _mapped():
            self._run.define_metric(self.step_key)
            self._run.define_metric("*", step_metric=self.step_key)

    def identity(self, run_info: RunInfo, remembered: Remembered | None = None) -> dict[str, Any]:
        """The ``project``, ``entity``, ``name``, ``id`` and ``tags`` the run is opened with: an option (or
        ``rllog.init``'s value when not a default), else wandb's variable, else what an earlier session
        chose, else rllog's default."""
        remembered = remembered or Remembered(run_info.run_dir, "wandb", run_info.run_id)
        project = first(
            self.project, explicit_project(run_info), env("WANDB_PROJECT"), remembered.get("project"), run_info.project
        )
        return {
            "project": _clean_project(project),
            "entity": first(self.entity, env("WANDB_ENTITY"), remembered.get("entity")),
            "name": first(self.name, explicit_name(run_info), env("WANDB_NAME"), remembered.get("name"), run_info.name),
            "id": first(self.id, env("WANDB_RUN_ID"), remembered.get("id"), wandb_run_id(run_info.run_id)),
            "tags": first(_clean_tags(run_info.tags), _clean_tags((env("WANDB_TAGS") or "").split(",")), remembered.get("tags")),
        }

    def _config(self, flat: Any) -> dict[str, Any]:
        """The config as this sink's ``config_layout`` gives it to wandb."""
        if self.config_layout != TRANSFORMERS_LAYOUT:
            return dict(flat)
        args, model, own = split_transformers_config(flat)
        return {**nest(model), **nest(args), **own}  # WandbCallback: the arguments win over a model key of that name

    def _summarize(self, records: Sequence[MetricsRecord]) -> None:
        """The values of ``summary_keys`` metrics into the run summary (set again by a repeated call: the same values)."""
        summary = {self.summary_keys[k]: v for r in records for k, v in r.values.items() if k in self.summary_keys}
        if summary:
            with _mapped():
                self._require_run().summary.update(summary)

    def _settings(self, run_info: RunInfo) -> dict[str, Any]:
        trainer = {"program": run_info.program} if run_info.program else {}
        return {**DEFAULT_SETTINGS, **trainer, **self.settings}

    def write_metrics(self, records: Sequence[MetricsRecord]) -> None:
        self._summarize(records)
        run = self._require_run()
        # Consecutive records of one step share a history row (a ``run.log`` costs ~2 ms).
        for step, row, last_seq in step_rows(records, lambda k: wandb_key(k, self.step_key)):
            if row:
                with _mapped():
                    run.log({**row, self.step_key: step})
            took(records, last_seq)  # a call that fails later is repeated with the rest only

    def write_table(self, record: TableRecord) -> None:
        run = self._require_run()
        import wandb

        table = record.table
        columns: list[Any] = [str(c) for c in table.column_names]
        rows = (
            [list(r) for r in zip(*(table.column(i).to_pylist() for i in range(table.num_columns)), strict=True)]
            if table.num_columns
            else []
        )
        rows = [[cell(v) for v in r] for r in rows]
        name = wandb_key(record.name, self.step_key)
        n = min(self.max_table_rows, getattr(wandb.Table, "MAX_ROWS", MAX_TABLE_ROWS))  # never above wandb's cut
        if len(rows) <= n:
            parts = {name: rows}
        else:
            parts = {f"{name}/part_{i}": rows[i * n : (i + 1) * n] for i in range(math.ceil(len(rows) / n))}
        row: dict[str, Any] = {key: _mixed_table(wandb, columns, data) for key, data in parts.items()}
        row[self.step_key] = record.step
        with _mapped():
            run.log(row)

    def write_config(self, record: ConfigRecord) -> None:
        """Config given after ``open`` (``Run.update_config``): ``run.config.update``, changed values allowed."""
        run = self._require_run()
        with _mapped():
            run.config.update(self._config(record.values), allow_val_change=True)

    def write_alert(self, record: AlertRecord) -> None:
        """A health alert as a wandb alert (``run.alert``; stored in the run file offline, e-mailed/Slacked online).

        rllog's rules have their own cool-down, so wandb's per-title suppression is set to its minimum.
        """
        run = self._require_run()
        import wandb

        alert_level: Any = wandb.AlertLevel  # type: ignore[attr-defined]  # re-exported lazily by wandb
        level = alert_level.ERROR if record.level == "error" else alert_level.WARN
        with _mapped():
            run.alert(
                title=f"{record.rule}: {record.metric}",
                text=f"step {record.step}: {record.message}",
                level=level,
                wait_duration=1,
            )

    def flush(self) -> None:
        # wandb sends every `log` to its service process asynchronously; a summary read is a round
        # trip through the same queue, so when it returns the service has all rows logged before.
        if self._run is not None:
            with _mapped():
                self._run.summary.keys()

    def close(self, status: str) -> None:
        if self._run is None:
            return
        run = self._run
        sync_file = getattr(run.settings, "sync_file", None)
        with _mapped():
            run.finish(exit_code=exit_code_for(status))
        self._run = None
        # run.finish() can return while wandb's service still holds the last records of the
        # transaction log in its buffer; wait until the exit record is on disk.
        if sync_file and os.path.exists(sync_file) and not getattr(run.settings, "x_skip_transaction_log", False):
            deadline = time.monotonic() + self.close_timeout
            while not exit_written(sync_file):
                if time.monotonic() >= deadline:
                    log.warning("rllog: wandb has not written the exit record of %s after %.0fs", sync_file, self.close_timeout)
                    break
                time.sleep(0.01)
        if self._owns_process:
            # The agent ends with os._exit, which skips wandb's own exit: its service (wandb-core) would be left to
            # notice alone, and its directory (wandb-PID-PID-N) stayed in the temp dir after every run.
            import wandb

            wandb.teardown()

    def _require_run(self) -> Any:
        if self._run is None:
            raise RuntimeError("WandbSink: open() must be called before writing")
        return self._run
