"""SwanLab backend: metrics, completion tables, config and run status in a SwanLab run (cloud, local or offline).

One rllog run is one SwanLab run, with SwanLab's run id ``run_info.run_id`` opened with ``resume="allow"``:
online, a replay or a resumed trainer continues the same cloud run; offline, every session writes its own
folder ``<log_dir>/run-<time>-<run_id>/`` holding the same id (``swanlab sync`` of each folder lands in the same
cloud run).

**Steps.** SwanLab keeps one value per metric and step: a second value of a key at a step it already holds
is dropped (only a debug line says so). rllog therefore gives SwanLab its own step, the record's ``seq``
(unique and increasing, across resumed attempts too), and puts the rllog step in the key ``rllog/step``,
declared the x-axis of every metric with ``define_metric("*", x_axis="rllog/step")``. A step going back is
stored like any other point. SwanLab's custom x-axis keeps the first of two *consecutive* points of one key at
the same x value (a key logged twice in a row at one rllog step): the second is dropped, and the sink warns.

**Names.** SwanLab takes any metric name of 1-512 characters without control characters that neither starts
nor ends with ``.`` or ``/`` and does not start with ``__swanlab__.``. :func:`swanlab_key` leaves such names
alone; any other name is cleaned and gets ``_`` and 8 hex digits of its SHA-1, so it can never meet another
key. The step key's own name, logged as a metric, becomes ``rllog/rllog/step``.

**Tables** are ``swanlab.echarts.Table`` charts (``media/echarts/<step>-<sha>.json`` in the run folder, rows
under ``rowData``); cells that are not numbers, strings or bools are written as JSON text; NaN and ±inf
cells show as empty (``null``).

**Status.** ``finished`` -> SwanLab ``success``, ``failed`` -> ``crashed``, ``killed`` -> ``aborted``.

**Writes.** ``run.log`` hands the row to SwanLab's background thread, which writes the run file every 0.5 s and
keeps what fails to retry it itself; ``flush()`` waits (through a SwanLab callback) until SwanLab has written
every row logged so far and then flushes the run file's buffer to the OS.

Nothing reaches the terminal or the network by default: SwanLab's stdout/stderr proxy, its hardware,
requirements, conda and git probes and its system monitor are off, its own messages are silenced
(``quiet=True``), and ``interactive=False`` makes a missing API key an error instead of a login prompt.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from collections.abc import Sequence
from typing import Any

from rllog.errors import TransientError
from rllog.records import ConfigRecord, MetricsRecord, RunInfo, TableRecord
from rllog.sink import Capabilities, took
from rllog.sink_errors import map_errors
from rllog_backends._cells import cell
from rllog_backends._conventions import remember_location

log = logging.getLogger("rllog.backends.swanlab")

STEP_KEY = "rllog/step"
STATES = {"finished": "success", "failed": "crashed", "killed": "aborted"}
MAX_KEY_LENGTH = 512  # swanlab's METRIC_KEY_MAX_LENGTH
SYSTEM_PREFIX = "__swanlab__."
_HASH = 8
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_PROJECT_BAD = re.compile(r"[^0-9A-Za-z_\-+.]+")
_RUN_ID_BAD = re.compile(r'[<>:"/\\|?*#%\x00-\x1f\x7f]+')


def _is_valid(key: str) -> bool:
    return (
        0 < len(key) <= MAX_KEY_LENGTH
        and not _CONTROL.search(key)
        and key == key.strip(" \t\n\r./")
        and not key.startswith(SYSTEM_PREFIX)
    )


def swanlab_key(key: str, step_key: str = STEP_KEY) -> str:
    """The name SwanLab stores metric or table ``key`` under. Pure and deterministic.

    A valid name is returned unchanged (the step key gets an ``rllog/`` prefix). Otherwise control
    characters become ``_``, leading/trailing spaces, ``.`` and ``/`` go, a ``__swanlab__.`` prefix loses
    its first ``_``, and ``_`` plus 8 hex digits of the SHA-1 of the original key are appended (the whole
    cut to 512 characters), so a changed name never equals another key's.

    Example:
        >>> swanlab_key("rewards/accuracy/mean")
        'rewards/accuracy/mean'
        >>> swanlab_key("eval/acc/")
        'eval/acc_668fe04f'
    """
    if key == step_key:
        return f"rllog/{key}"
    if _is_valid(key):
        return key
    suffix = "_" + hashlib.sha1(key.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH]
    name = _CONTROL.sub("_", key).strip(" \t\n\r./")
    if name.startswith(SYSTEM_PREFIX):
        name = name[1:]
    return (name or "_")[: MAX_KEY_LENGTH - len(suffix)] + suffix


def swanlab_project(project: str) -> str:
    """A project name SwanLab accepts: letters, digits and ``_ - + .``, 1-100 characters."""
    return _PROJECT_BAD.sub("-", project).strip("-")[:100] or "rllog"


def swanlab_run_id(run_id: str) -> str:
    """The SwanLab run id: rllog's, without characters a folder name cannot hold."""
    return _RUN_ID_BAD.sub("-", run_id)[:512] or "rllog"


class _Written:
    """A SwanLab callback that records the highest step SwanLab has written, per kind (scalar, media)."""

    def __init__(self) -> None:
        self.scalar = 0
        self.media = 0
        self.changed = threading.Condition()

    def callback(self) -> Any:
        from swanlab import Callback

        written = self

        class RllogFlushWatch(Callback):
            @property
            def name(self) -> str:
                return "rllog-flush-watch"

            def on_scalar_flush(self, scalar_records, *args, **kwargs) -> None:
                written.saw("scalar", scalar_records)

            def on_media_flush(self, media_records, *args, **kwargs) -> None:
                written.saw("media", media_records)

        return RllogFlushWatch()

    def saw(self, kind: str, records: Sequence[Any]) -> None:
        with self.changed:
            setattr(self, kind, max([getattr(self, kind)] + [r.step for r in records]))
            self.changed.notify_all()

    def wait(self, scalar: int, media: int, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.scalar >= scalar and self.media >= media, timeout)


class SwanLabSink:
    """Writes rllog records to a SwanLab run.

    Every option is optional; SwanLab's own environment variables (``SWANLAB_MODE``, ``SWANLAB_LOG_DIR``,
    ``SWANLAB_API_KEY``, ``SWANLAB_WORKSPACE``...) apply as usual.

    Args:
        project: SwanLab project; default ``run_info.project`` (characters SwanLab rejects become ``-``).
        workspace: SwanLab workspace (user or organisation); default yours.
        mode: ``"online"``, ``"local"``, ``"offline"`` or ``"disabled"``; default ``SWANLAB_MODE``, else
            SwanLab's default (online, which needs an API key: rllog never prompts for one).
        log_dir: where SwanLab writes its run folders; default ``SWANLAB_LOG_DIR``, else ``<run_dir>/swanlog``.
        group: experiment group. job_type: experiment job type.
        resume: SwanLab's ``resume``; default ``"allow"`` (continue the run with this id where SwanLab can).
        step_key: the metric that holds the rllog step (the x-axis of every metric).
        quiet: silence SwanLab's own messages on the terminal (they still go to the run's ``debug/`` log).
        flush_timeout: seconds ``flush()`` waits for SwanLab's writer before it reports a retryable error.
        settings: extra ``swanlab.Settings`` fields, merged over rllog's (e.g. ``{"probe": {"runtime": False}}``).

    Example:
        >>> run = rllog.init(report_to="swanlab", project="grpo-math")   # SWANLAB_MODE=offline works too
        >>> run.log({"reward": 0.4}, step=1)
        >>> run.finish()
    """

    # Not durable on return: SwanLab's own thread writes the rows later; flush() waits for it.
    capabilities = Capabilities(tables=True, config=True, alerts=False, durable_writes=False)

    def __init__(
        self,
        project: str | None = None,
        workspace: str | None = None,
        mode: str | None = None,
        log_dir: str | None = None,
        group: str | None = None,
        job_type: str | None = None,
        resume: str | None = "allow",
        step_key: str = STEP_KEY,
        quiet: bool = True,
        flush_timeout: float = 60.0,
        settings: dict[str, Any] | None = None,
    ):
        self.project = project
        self.workspace = workspace
        self.mode = mode
        self.log_dir = log_dir
        self.group = group
        self.job_type = job_type
        self.resume = resume
        self.step_key = step_key
        self.quiet = quiet
        self.flush_timeout = flush_timeout
        self.settings = dict(settings or {})
        self._run: Any = None
        self._written = _Written()
        self._logged = {"scalar": 0, "media": 0}  # the highest SwanLab step handed to run.log, per kind
        self._last_step: dict[str, int] = {}  # per key, the rllog step of its last point in this session
        self._was_quiet: bool | None = None

    @property
    def run(self) -> Any:
        """The ``swanlab.Run`` while the sink is open, else None."""
        return self._run

    def open(self, run_info: RunInfo) -> None:
        if self._run is not None:
            return
        import swanlab

        if swanlab.has_run():
            raise RuntimeError(
                "SwanLab allows one run per process and another SwanLab run is active here; use delivery='process'"
            )
        self._silence(True)
        self._written = _Written()
        self._logged = {"scalar": 0, "media": 0}
        self._last_step = {}
        log_dir = self.log_dir or os.environ.get("SWANLAB_LOG_DIR") or os.path.join(run_info.run_dir, "swanlog")
        with map_errors("swanlab"):
            self._run = swanlab.init(
                project=swanlab_project(self.project or run_info.project),
                workspace=self.workspace,
                mode=self.mode,
                log_dir=log_dir,
                name=run_info.name,
                group=self.group,
                job_type=self.job_type,
                tags=[str(t)[:512] for t in run_info.tags] or None,
                id=swanlab_run_id(run_info.run_id),
                resume=self.resume,
                config=dict(run_info.config),
                settings=swanlab.Settings(**self._settings()),
                callbacks=[self._written.callback()],
            )
            self._run.define_metric(self.step_key)
            self._run.define_metric("*", x_axis=self.step_key)
        remember_location(run_info, "swanlab", logdir=os.path.abspath(log_dir))

    def _settings(self) -> dict[str, Any]:
        probes = {"hardware": False, "requirements": False, "conda": False, "git": False, "monitor": False}
        ours: dict[str, Any] = {"interactive": False, "terminal": {"proxy_type": "none"}, "probe": probes}
        for key, value in self.settings.items():
            ours[key] = {**ours[key], **value} if isinstance(ours.get(key), dict) and isinstance(value, dict) else value
        return ours

    def _silence(self, on: bool) -> None:
        """SwanLab prints through its own rich console; ``quiet`` mutes that console only."""
        if not self.quiet:
            return
        try:
            from swanlab.sdk.internal.pkg import console
        except ImportError:  # another SwanLab layout: its messages stay on
            return
        if on:
            self._was_quiet = console.c.quiet
            console.c.quiet = True
        elif self._was_quiet is not None:
            console.c.quiet = self._was_quiet

    def write_metrics(self, records: Sequence[MetricsRecord]) -> None:
        run = self._require_run()
        for record in records:
            if not record.values:
                continue
            row: dict[str, Any] = {}
            for key, value in record.values.items():
                name = swanlab_key(key, self.step_key)
                if self._last_step.get(name) == record.step:
                    log.warning("rllog: swanlab keeps the first of two consecutive values of %r at step %d", key, record.step)
                self._last_step[name] = record.step
                row[name] = float(value)
            self._log(run, row, record, "scalar")
            took(records, record.seq)  # a repeated call (after a later record's error) starts after this one

    def write_table(self, record: TableRecord) -> None:
        run = self._require_run()
        import swanlab

        table = swanlab.echarts.Table()
        columns = [str(c) for c in record.table.column_names]
        rows = [[cell(row.get(c), nested=False) for c in record.table.column_names] for row in record.table.to_pylist()]
        table.add(headers=columns, rows=rows)
        self._log(run, {swanlab_key(record.name, self.step_key): table}, record, "media")

    def _log(self, run: Any, row: dict[str, Any], record: MetricsRecord | TableRecord, kind: str) -> None:
        row[self.step_key] = record.step
        with map_errors("swanlab"):
            run.log(row, step=record.seq)
        self._logged["scalar"] = max(self._logged["scalar"], record.seq)  # the step key is always a scalar
        self._logged[kind] = max(self._logged[kind], record.seq)

    def write_config(self, record: ConfigRecord) -> None:
        """Config given after ``open`` (``Run.update_config``): SwanLab rewrites ``files/config.yaml`` at once."""
        run = self._require_run()
        with map_errors("swanlab"):
            run.config.update(dict(record.values))

    def flush(self) -> None:
        """Wait until SwanLab's writer has written every row logged so far, then hand the run file's buffer to the OS.

        Raises:
            TransientError: SwanLab has not written them within ``flush_timeout`` (retried by the delivery layer).
        """
        if self._run is None:
            return
        if not self._written.wait(self._logged["scalar"], self._logged["media"], self.flush_timeout):
            raise TransientError(
                f"swanlab: rows logged up to step {self._logged['scalar']} not written after {self.flush_timeout:.0f}s"
            )
        store = getattr(getattr(self._run, "_core", None), "_store", None)
        if store is not None and hasattr(store, "ensure_flushed"):  # SwanLab flushes its run file only at finish
            with map_errors("swanlab"):
                store.ensure_flushed()

    def close(self, status: str) -> None:
        if self._run is None:
            return
        run, self._run = self._run, None
        state = STATES.get(status, "crashed")
        try:
            with map_errors("swanlab"):
                run.finish(state=state, error=None if state == "success" else f"rllog: the run ended with status {status!r}")
        finally:
            self._silence(False)

    def _require_run(self) -> Any:
        if self._run is None:
            raise RuntimeError("SwanLabSink: open() must be called before writing")
        return self._run
