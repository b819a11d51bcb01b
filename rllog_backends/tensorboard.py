"""TensorBoard backend: event files written with the ``tensorboard`` package alone (no torch, no TF).

What goes where (``logdir`` is the ``logdir`` option, else ``$TENSORBOARD_LOGGING_DIR/<run name>``
when that variable is set, else the directory an earlier session of the run used, else
``<run_dir>/tensorboard``; remembered in ``RUN_DIR/trackers/tensorboard.json``)::

    <metric key>                  scalar (float32) at the record's step, wall time = the record's time
    <table name>/text_summary     a Markdown table (text plugin) at the table's step
    config/text_summary           the config as a Markdown table, at step 0; after ``Run.update_config``,
                                  the whole config again at the update's step, with a column
                                  "set at step" for the values set after the start
    _hparams_/session_start_info  the config for the HPARAMS dashboard (hparams plugin), written once:
                                  TensorBoard keeps a run's first session info, so later updates show
                                  in the config text only
    status/text_summary           "finished" / "failed" / "killed", written by ``close``
    out_of_order[_N]/             values whose step went backwards within an attempt (below)

Events are built as protos and framed with ``tensorboard.summary.writer.record_writer.RecordWriter``
(what ``EventFileWriter`` uses underneath), then appended to the event file by the sink itself.
``torch.utils.tensorboard`` would pull torch into the delivery process; ``tensorboard.summary.Writer``
writes only scalars, as tensors that ``EventAccumulator.Scalars`` does not return; ``EventFileWriter``
writes from a thread that stops for good at its first error. Scalars are written as ``simple_value``,
like ``torch.utils.tensorboard`` and the HF ``TensorBoardCallback``, so every TensorBoard reader (the
default Rust data server included) shows them. Each ``write_*`` call appends its events to the file
before returning. A write that fails (a full disk) is cut back to the last complete call and raised
as :class:`~rllog.errors.TransientError`: the repeated call writes each event once, and the file never
holds a broken record.

Backwards steps: TensorBoard's default data server treats a lower step as a restart of the job and
discards, from the view, the earlier points of that tag at steps >= the new one (one late value at
step 10 would hide steps 10..49). So a value whose step is below the highest step already written
for its tag goes to a sibling TensorBoard run, ``<logdir>/out_of_order`` (a further step back there
goes to ``out_of_order_2``, ...): every run keeps increasing steps per tag, nothing is hidden, and the
late point shows as a second series on the same chart. An equal step stays in the run (TensorBoard
shows the last value written at that step; the event file keeps both).

Resumed runs: the rule of :class:`rllog.records.Supersession` (the one ``rllog show`` and the Parquet
reader follow). When the record that decides a later attempt's restart (its first with a trainer metric;
``system/...`` samples alone are stamped with the previous attempt's last step) is at or below the highest
step already written (a job resumed from an earlier checkpoint), what was written from that step on is
superseded. The sink writes TensorBoard's own restart marker, an event with ``session_log.status = START``
at that step, into the run and each ``out_of_order`` layer, and the attempt's points go to the run as
usual. TensorBoard's Python loader (``EventAccumulator``, ``tensorboard --load_fast=false``) then drops
every earlier point at or after that step; the default Rust data server drops them per tag, as soon as
the attempt writes that tag again. Each attempt's decision is marked in the run (``session_log.msg``
``rllog attempt <n> ...``) so a reopened sink does not decide twice.

Read back with::

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(logdir, size_guidance={"scalars": 0, "tensors": 0}); acc.Reload()
    acc.Scalars("reward")                                      # [ScalarEvent(wall_time, step, value)]
    acc.Tensors("completions/text_summary")[0].tensor_proto.string_val[0].decode()
"""

from __future__ import annotations

import contextlib
import html
import io
import itertools
import json
import os
import re
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rllog.records import ConfigRecord, MetricsRecord, RunInfo, Supersession, TableRecord
from rllog.sink import Capabilities
from rllog.sink_errors import map_errors
from rllog_backends._conventions import Remembered, env, first

TEXT_SUFFIX = "/text_summary"
CONFIG_TAG = "config" + TEXT_SUFFIX
STATUS_TAG = "status" + TEXT_SUFFIX
RESERVED_TABLE_NAMES = ("config", "status")
OUT_OF_ORDER = "out_of_order"
HPARAMS_TAG_PREFIX = "_hparams_/"
SET_AT = "set at step"  # the config text's column for values set after the start
ATTEMPT_MARK = re.compile(r"^rllog attempt (\d+) ")  # session_log.msg of an attempt's decision
ELLIPSIS = "\u2026"
_FILE_IDS = itertools.count()

_MD_SPECIAL = re.compile(r"([\\`*_\[\]|])")
_EDGE_SPACE = re.compile(r"^\s+|\s+$")


def table_tag(name: str) -> str:
    """The TensorBoard tag a table named ``name`` is written under.

    ``<name>/text_summary``, like ``torch.utils.tensorboard``'s ``add_text``; tables named ``config`` or
    ``status`` become ``table/<name>/text_summary`` so they do not mix with the run's own config and
    status entries.
    """
    return ("table/" + name if name in RESERVED_TABLE_NAMES else name) + TEXT_SUFFIX


def format_cell(value: Any) -> str:
    """The text a table cell shows (and what the reader gives back, before shortening).

    ``None`` -> ``""``; ``bool`` -> ``"True"``/``"False"``; ``float`` -> ``repr`` (round-trips, ``nan``,
    ``inf``); lists and dicts -> JSON; everything else -> ``str``.

    Example:
        >>> [format_cell(v) for v in (None, True, 0.1, 3, "a|b", [1, 2])]
        ['', 'True', '0.1', '3', 'a|b', '[1, 2]']
    """
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, ensure_ascii=False, default=str)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="backslashreplace")
    return str(value)


def escape_cell(text: str) -> str:
    """``text`` as the content of one Markdown table cell that renders as exactly ``text``.

    HTML-escapes ``& < >`` (so ``<think>`` shows as text), backslash-escapes the Markdown characters
    ``\\ ` * _ [ ] |``, writes leading/trailing whitespace and ``\\r`` as numeric entities (a table
    cell is stripped otherwise) and newlines as ``<br>``. :func:`unescape_cell` inverts it.
    """
    text = html.escape(text, quote=False)
    text = _MD_SPECIAL.sub(r"\\\1", text)
    text = _EDGE_SPACE.sub(lambda m: "".join(f"&#{ord(c)};" for c in m.group(0)), text)
    return text.replace("\r", "&#13;").replace("\n", "<br>")


def unescape_cell(cell: str) -> str:
    """Inverse of :func:`escape_cell` (only the entities it writes are decoded)."""
    cell = cell.replace("<br>", "\n")
    cell = re.sub(r"\\(.)", r"\1", cell, flags=re.S)
    entities = {"lt": "<", "gt": ">", "amp": "&"}
    return re.sub(r"&(lt|gt|amp|#\d+);", lambda m: entities.get(m.group(1)) or chr(int(m.group(1)[1:])), cell)


def markdown_table(columns: Sequence[str], rows: Sequence[Mapping[str, Any]], max_cell_chars: int | None = None) -> str:
    """A Markdown table of ``rows``; cells longer than ``max_cell_chars`` are cut and end with "…",
    with a note line under the table saying how many were shortened."""
    if not columns:
        return f"_(empty table: no columns, {len(rows)} rows)_"
    shortened = 0
    lines = ["| " + " | ".join(escape_cell(str(c)) for c in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for column in columns:
            text = format_cell(row.get(column))
            if max_cell_chars is not None and len(text) > max_cell_chars:
                text = text[:max_cell_chars] + ELLIPSIS
                shortened += 1
            cells.append(escape_cell(text))
        lines.append("| " + " | ".join(cells) + " |")
    if shortened:
        lines += [
            "",
            f"_{shortened} cell{'s' if shortened != 1 else ''} shortened to {max_cell_chars} characters (ending in \u2026)._",
        ]
    return "\n".join(lines)


def parse_markdown_table(text: str) -> list[dict[str, str]]:
    """Rows (column -> cell text) of the first table :func:`markdown_table` wrote in ``text``."""
    lines = [line for line in text.split("\n") if line.startswith("|")]
    if len(lines) < 2:
        return []
    header = _split_row(lines[0])
    return [dict(zip(header, _split_row(line), strict=False)) for line in lines[2:]]


def _split_row(line: str) -> list[str]:
    cells, current, i = [], [], 1  # skip the leading "|"
    while i < len(line):
        c = line[i]
        if c == "\\" and i + 1 < len(line):
            current.append(line[i : i + 2])
            i += 2
            continue
        if c == "|":
            cells.append("".join(current))
            current = []
        else:
            current.append(c)
        i += 1
    return [unescape_cell(cell[1:-1] if cell.startswith(" ") and cell.endswith(" ") else cell.strip()) for cell in cells]


class TensorBoardSink:
    """Writes rllog records as TensorBoard event files.

    Args:
        logdir: the run's log directory. Default ``$TENSORBOARD_LOGGING_DIR/<run name>`` if that
            variable is set, else the directory of an earlier session of the run, else ``<run_dir>/tensorboard``.
        max_cell_chars: table cells longer than this are shortened (with "…" and a note under the
            table); ``None`` keeps them whole.
        hparams: also write the config for TensorBoard's HPARAMS dashboard (and the run's end status
            as the session status).

    Example:
        >>> run = rllog.init(report_to="tensorboard", project="grpo-math", config=args)
        >>> run.log({"reward": 0.41}, step=10)
        >>> run.finish()
        $ tensorboard --logdir $TENSORBOARD_LOGGING_DIR
    """

    # Durable on return: every write_* call appends its events to the event file before it returns.
    capabilities = Capabilities(tables=True, config=True, alerts=False, durable_writes=True)
    prepare_imports = (  # imported by open and the first writes (a standby agent imports them ahead: rllog.prepare)
        "tensorboard.compat.proto.event_pb2",
        "tensorboard.plugins.hparams.summary_v2",
        "tensorboard.plugins.text.summary_v2",
        "tensorboard.summary.writer.record_writer",
    )

    def __init__(self, logdir: str | None = None, max_cell_chars: int | None = 500, hparams: bool = True):
        self.logdir = logdir
        self.max_cell_chars = max_cell_chars
        self.hparams = hparams
        self._layers: list[_Layer] = []
        self._last_step = 0
        self._high: int | None = None  # highest step of any point written (None: none yet)
        self._supersession = Supersession()  # which record decides each later attempt's restart
        self._config: dict[str, Any] = {}  # the config so far (this session's values keep their types)
        self._config_rows: dict[str, tuple[str, str]] = {}  # key -> (value text, "set at step" text), as shown
        self._config_shown = False  # the run has a config text (a reopen shows only what changed)
        self._hparams_written = False
        self._trial_id = ""
        self._committed = self._state()

    def open(self, run_info: RunInfo) -> None:
        remembered = Remembered(run_info.run_dir, "tensorboard", run_info.run_id)
        base = env("TENSORBOARD_LOGGING_DIR")
        self.logdir = first(
            self.logdir,
            os.path.join(base, run_info.name) if base else None,
            remembered.get("logdir"),
            os.path.join(run_info.run_dir, "tensorboard"),
        )
        remembered.save(logdir=self.logdir)
        self._supersession = Supersession.of(run_info)
        self._trial_id = run_info.run_id
        self._layers = [_Layer(self._layer_path(0))]
        self._recover()
        for layer in self._layers:
            layer.commit()  # what the files already hold is the starting point of a roll-back
        self._committed = self._state()
        self._open_config(dict(run_info.config))
        self.flush()

    def write_config(self, record: ConfigRecord) -> None:
        """Config given after ``open``: the whole config again at the update's step (text plugin), the
        updated values marked with their step; the HPARAMS dashboard gets it if it had no config yet."""
        self._set_config(dict(record.values), record.step, record.time)
        self.flush()

    def write_metrics(self, records: Sequence[MetricsRecord]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        for r in records:
            self._decide_attempt(r)
            by_layer: dict[int, list] = {}
            for key, value in r.values.items():
                by_layer.setdefault(self._layer_for(key, r.step), []).append(
                    summary_pb2.Summary.Value(tag=key, simple_value=value)
                )
            for i, values in by_layer.items():
                self._layers[i].add_event(
                    event_pb2.Event(wall_time=r.time, step=r.step, summary=summary_pb2.Summary(value=values))
                )
            self._wrote(r.step)
        self.flush()  # in the OS's hands before the delivery layer moves its cursor past the batch

    def write_table(self, record: TableRecord) -> None:
        tag = table_tag(record.name)
        text = markdown_table(record.table.column_names, record.table.to_pylist(), self.max_cell_chars)
        self._layers[self._layer_for(tag, record.step)].add_event(_text_event(tag, text, step=record.step, wall_time=record.time))
        self._wrote(record.step)
        self.flush()

    def flush(self) -> None:
        """Append every layer's new events to its file, all or nothing.

        If one write fails (a full disk), every layer is cut back to its last complete flush and
        its new events are dropped: the delivery layer repeats the call that wrote them, so each
        event lands exactly once, and no file keeps a broken record.
        """
        try:
            with map_errors("tensorboard"):
                for layer in self._layers:
                    layer.write_pending()
        except BaseException:
            for layer in self._layers:
                layer.roll_back()
            self._restore(self._committed)
            raise
        for layer in self._layers:
            layer.commit()
        self._committed = self._state()

    def _state(self) -> dict[str, Any]:
        """What the sink learnt from what it wrote (restored when a write is cut back, see :meth:`flush`)."""
        return {
            "_last_step": self._last_step,
            "_high": self._high,
            "_supersession": self._supersession.copy(),
            "_config": dict(self._config),
            "_config_rows": dict(self._config_rows),
            "_config_shown": self._config_shown,
            "_hparams_written": self._hparams_written,
        }

    def _restore(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value.copy() if isinstance(value, (set, dict, Supersession)) else value)

    def close(self, status: str) -> None:
        if not self._layers:
            return
        now = time.time()
        main = self._layers[0]
        main.add_event(_text_event(STATUS_TAG, status, step=self._last_step, wall_time=now))
        if self.hparams:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

            code = api_pb2.STATUS_SUCCESS if status == "finished" else api_pb2.STATUS_FAILURE
            data = plugin_data_pb2.HParamsPluginData(
                session_end_info=plugin_data_pb2.SessionEndInfo(status=code, end_time_secs=now)
            )
            summary = summary_pb2.Summary()
            summary.value.add(
                tag=metadata.SESSION_END_INFO_TAG, metadata=metadata.create_summary_metadata(data), tensor=metadata.NULL_TENSOR
            )
            main.add_event(event_pb2.Event(wall_time=now, step=self._last_step, summary=summary))
        self.flush()
        self._layers = []

    def _recover(self) -> None:
        """On a reopen (replay, resume), learn from the files already there: each tag's highest step (a
        step that goes back across the restart still goes to an out-of-order layer), the attempts
        already decided, the config as last shown, and whether HPARAMS has its config."""
        from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

        while True:
            layer = self._layers[-1]
            files = sorted(f for f in os.listdir(layer.path) if "tfevents" in f) if os.path.isdir(layer.path) else []
            for name in files:
                for event in LegacyEventFileLoader(os.path.join(layer.path, name)).Load():
                    self._recover_event(layer, event, main=len(self._layers) == 1)
            nxt = self._layer_path(len(self._layers))
            if not os.path.isdir(nxt):
                return
            self._layers.append(_Layer(nxt))

    def _recover_event(self, layer: _Layer, event: Any, main: bool) -> None:
        if event.HasField("session_log"):
            from tensorboard.compat.proto import event_pb2

            if event.session_log.status == event_pb2.SessionLog.START:  # what TensorBoard purged is not there
                layer.has_start = True
                self._purged_from(layer, event.step)
            match = ATTEMPT_MARK.match(event.session_log.msg)
            if match:
                self._supersession.decided.add(int(match.group(1)))  # marked in the run: decided before
        for value in event.summary.value:
            if value.tag == CONFIG_TAG:
                rows = parse_markdown_table(value.tensor.string_val[0].decode("utf-8")) if value.tensor.string_val else []
                self._config_rows = {row["key"]: (row.get("value", ""), row.get(SET_AT, "")) for row in rows}
                self._config_shown = True
            elif value.tag.startswith(HPARAMS_TAG_PREFIX):
                self._hparams_written = self._hparams_written or main
            elif value.tag != STATUS_TAG:
                layer.high[value.tag] = max(layer.high.get(value.tag, event.step), event.step)
                self._wrote(event.step)

    def _layer_path(self, i: int) -> str:
        """Layer 0 is the run's directory, then ``out_of_order``, ``out_of_order_2``, ..."""
        if self.logdir is None:
            raise RuntimeError("TensorBoardSink: open() must be called first")
        return self.logdir if i == 0 else os.path.join(self.logdir, OUT_OF_ORDER if i == 1 else f"{OUT_OF_ORDER}_{i}")

    def _layer_for(self, tag: str, step: int) -> int:
        """The first layer where ``step`` does not go below ``tag``'s highest step; a new one if none."""
        for i, layer in enumerate(self._layers):
            if step >= layer.high.get(tag, step):
                layer.high[tag] = step
                return i
        self._layers.append(_Layer(self._layer_path(len(self._layers))))
        self._layers[-1].high[tag] = step
        return len(self._layers) - 1

    def _wrote(self, step: int) -> None:
        self._last_step = max(self._last_step, step)
        self._high = step if self._high is None else max(self._high, step)

    # -- resumed runs ---------------------------------------------------------------------------
    def _decide_attempt(self, record: MetricsRecord) -> None:
        """At the record that decides a later attempt's restart (:class:`rllog.records.Supersession`): TensorBoard's
        restart marker at its step, so that what was written from that step on is superseded."""
        decision = self._supersession.decide(record.seq, record.step, record.values)
        if decision is None:
            return
        from tensorboard.compat.proto import event_pb2

        restarts = decision.supersedes and self._high is not None and record.step <= self._high
        verb = "restarts" if restarts else "continues"
        session = event_pb2.SessionLog(
            status=event_pb2.SessionLog.START if restarts else event_pb2.SessionLog.STATUS_UNSPECIFIED,
            msg=f"rllog attempt {decision.attempt} {verb} at step {record.step}",
        )
        for layer in self._layers if restarts else self._layers[:1]:
            if restarts and not layer.has_start:
                # TensorBoard's server (plugin_event_accumulator) takes a run's first START for the
                # session's own start and purges only from the second on; the legacy loader purges at
                # every START. A first START at the same step satisfies both.
                first_start = event_pb2.SessionLog(status=event_pb2.SessionLog.START, msg="rllog: session start")
                layer.add_event(event_pb2.Event(wall_time=record.time, step=record.step, session_log=first_start))
            layer.add_event(event_pb2.Event(wall_time=record.time, step=record.step, session_log=session))
            if restarts:
                layer.has_start = True
                self._purged_from(layer, record.step)
        if restarts and record.step <= 0:  # the config text at step 0 went with the rest: show it again
            self._write_config_text(self._layers[0], step=0, wall_time=record.time)

    def _purged_from(self, layer: _Layer, step: int) -> None:
        """TensorBoard drops ``layer``'s points at or after ``step`` (a START there): its highest steps go below it."""
        layer.high = {tag: min(high, step - 1) for tag, high in layer.high.items()}
        if self._high is not None:
            self._high = min(self._high, step - 1)

    # -- config ---------------------------------------------------------------------------------
    def _open_config(self, config: dict[str, Any]) -> None:
        """The config at open: shown at step 0 once; a reopen with changed values shows them as an update."""
        now = time.time()
        if not self._config_shown:
            self._config = config
            self._config_rows = {k: (format_cell(v), "") for k, v in config.items()}
            self._write_config_text(self._layers[0], step=0, wall_time=now)
            self._write_hparams(step=0, wall_time=now)
            self._config_shown = True
            return
        changed = {k: v for k, v in config.items() if self._config_rows.get(k, (None, ""))[0] != format_cell(v)}
        self._config = config
        if changed:
            self._set_config(changed, max(self._last_step, 0), now)
        else:
            self._write_hparams(step=0, wall_time=now)

    def _set_config(self, values: dict[str, Any], step: int, wall_time: float) -> None:
        self._config.update(values)
        self._config_rows.update({k: (format_cell(v), str(step)) for k, v in values.items()})
        self._write_config_text(self._layers[0], step=step, wall_time=wall_time)
        self._write_hparams(step=step, wall_time=wall_time)

    def _write_config_text(self, layer: _Layer, *, step: int, wall_time: float) -> None:
        rows = [{"key": k, "value": v, SET_AT: at} for k, (v, at) in self._config_rows.items()]
        columns = ["key", "value", SET_AT] if any(row[SET_AT] for row in rows) else ["key", "value"]
        layer.add_event(_text_event(CONFIG_TAG, markdown_table(columns, rows), step=step, wall_time=wall_time))

    def _write_hparams(self, *, step: int, wall_time: float) -> None:
        """The config for the HPARAMS dashboard, once per run (TensorBoard keeps the first), once there is one."""
        if not self.hparams or self._hparams_written or not self._config:
            return
        from tensorboard.compat.proto import event_pb2
        from tensorboard.plugins.hparams import summary_v2 as hp

        values = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in self._config.items()}
        summary = hp.hparams_pb(values, trial_id=self._trial_id)
        self._layers[0].add_event(event_pb2.Event(wall_time=wall_time, step=step, summary=summary))
        self._hparams_written = True


class _Layer:
    """One TensorBoard run directory, its event file, and per tag the highest step written to it.

    Events are framed with TensorBoard's own ``RecordWriter`` into a buffer, and appended to the
    layer's file by :meth:`write_pending` (synchronously: ``EventFileWriter`` writes from a thread
    that stops for good at its first error, so a full disk would fail the sink forever). The file is
    created at the first write, a new one per open, named to sort after the directory's other event
    files (TensorBoard reads them in name order). A ``SessionLog.START`` is written only where a later
    attempt supersedes earlier points (:meth:`TensorBoardSink._decide_attempt`): TensorBoard discards
    the earlier events at or after its step.
    """

    def __init__(self, path: str):
        from tensorboard.summary.writer.record_writer import RecordWriter

        self.path = path
        self.high: dict[str, int] = {}
        self.has_start = False  # the layer's files hold a SessionLog.START
        self._committed_has_start = False
        self._committed_high: dict[str, int] = {}  # ``high`` as of the last complete flush
        self._file: str | None = None
        self._committed = 0  # bytes of the file written by complete flushes
        self._pending = io.BytesIO()
        self._records = RecordWriter(self._pending)

    def add_event(self, event) -> None:
        if self._file is None and not self._pending.tell():
            from tensorboard.compat.proto import event_pb2

            version = event_pb2.Event(
                wall_time=time.time(),
                file_version="brain.Event:2",
                source_metadata=event_pb2.SourceMetadata(writer="rllog_backends.tensorboard"),
            )
            self._records.write(version.SerializeToString())
        self._records.write(event.SerializeToString())

    def write_pending(self) -> None:
        data = self._pending.getvalue()
        if not data:
            return
        if self._file is None:
            os.makedirs(self.path, exist_ok=True)
            self._file = os.path.join(self.path, _new_event_file_name(self.path))
        with open(self._file, "ab", buffering=0) as f:
            view = memoryview(data)
            while view:
                view = view[f.write(view) :]

    def commit(self) -> None:
        self._committed += self._pending.tell()
        self._committed_high = dict(self.high)
        self._committed_has_start = self.has_start
        self._clear()

    def roll_back(self) -> None:
        """Cut the file back to its last complete flush (a file with nothing committed goes), drop the new
        events and forget their steps (the repeated call places them again, in the same layers)."""
        self._clear()
        self.high = dict(self._committed_high)
        self.has_start = self._committed_has_start
        if self._file is None:
            return
        with contextlib.suppress(FileNotFoundError):
            if self._committed:
                os.truncate(self._file, self._committed)
            else:
                os.remove(self._file)
        if not self._committed:
            self._file = None

    def _clear(self) -> None:
        self._pending.seek(0)
        self._pending.truncate()


def _new_event_file_name(directory: str) -> str:
    """An event file name that sorts after every event file in ``directory`` (TensorBoard reads them in
    name order, so a session's events, restart markers included, must come after the earlier sessions')."""
    last = max((f for f in os.listdir(directory) if f.startswith("events.out.tfevents.")), default="")
    stamp = last.split(".")[3] if last.count(".") >= 3 else ""
    seconds = max(int(time.time()), int(stamp) if stamp.isdigit() else 0)
    while True:
        name = f"events.out.tfevents.{seconds:010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILE_IDS):06d}"
        if name > last:
            return name
        seconds += 1  # an earlier session in the same second, from a process with a higher pid


def _text_event(tag: str, text: str, *, step: int, wall_time: float):
    from tensorboard.compat.proto import event_pb2
    from tensorboard.plugins.text import summary_v2 as text_summary

    return event_pb2.Event(wall_time=wall_time, step=step, summary=text_summary.text_pb(tag, text))
