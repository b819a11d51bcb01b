"""Read a run back from TensorBoard's own event files, with the ``EventAccumulator`` TensorBoard's Python
data server loads runs with (``plugin_event_accumulator``, ``tensorboard --load_fast=false``): what it
shows, after its purge of points a restarted job superseded (``SessionLog.START``), tables included.

- metrics: every scalar tag, ``[(step, value)]`` in the order logged (the run directory and its
  ``out_of_order*`` layers merged by wall time). TensorBoard stores scalars as float32,
  so values come back rounded to float32 (``0.41`` -> ``0.4099999964237213``); compare with
  ``float(numpy.float32(x))`` or a relative tolerance of ~1e-7.
- tables: every ``<name>/text_summary`` text tag except config/status, parsed back from Markdown;
  cells are strings as :func:`rllog_backends.tensorboard.format_cell` renders them (``None`` -> ``""``,
  ``0.5`` -> ``"0.5"``); cells longer than the sink's ``max_cell_chars`` end in "…".
- config: from the HPARAMS plugin's session start info (bool, float, str; ints come back as floats,
  ``None`` as ``"None"``), then the values the last ``config`` Markdown table marks as set after the
  start (strings, as the text shows them); all from that table (strings) if hparams were off.
- status: the last ``status`` text entry.
"""

from __future__ import annotations

import errno
import os

from readers import ReadBack
from rllog.records import RUN_STATUSES
from rllog_backends._conventions import Remembered
from rllog_backends.tensorboard import (
    CONFIG_TAG,
    OUT_OF_ORDER,
    SET_AT,
    STATUS_TAG,
    TEXT_SUFFIX,
    format_cell,
    parse_markdown_table,
)


def logdir_for(env: dict, run_info) -> str:
    """Where the sink wrote for ``run_info``: the directory it remembered in the run directory, else its
    default under the test's ``env``."""
    remembered = Remembered(run_info.run_dir, "tensorboard", run_info.run_id).get("logdir")
    if remembered:
        return remembered
    base = env.get("TENSORBOARD_LOGGING_DIR")
    return os.path.join(base, run_info.name) if base else os.path.join(run_info.run_dir, "tensorboard")


def _text(event) -> str:
    return event.tensor_proto.string_val[0].decode("utf-8")


def _layers(logdir: str) -> list[str]:
    """The run's directory, then its out-of-order layers (``out_of_order``, ``out_of_order_2``, ...)."""
    extra = (
        [d for d in os.listdir(logdir) if d == OUT_OF_ORDER or d.startswith(OUT_OF_ORDER + "_")] if os.path.isdir(logdir) else []
    )
    extra.sort(key=lambda d: 1 if d == OUT_OF_ORDER else int(d.rsplit("_", 1)[1]))
    return [logdir] + [os.path.join(logdir, d) for d in extra]


def accumulators(logdir: str) -> list:
    """The loaded ``plugin_event_accumulator.EventAccumulator`` of the run and each out-of-order layer, keeping every event."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    accs = []
    for path in _layers(logdir):
        acc = EventAccumulator(path, size_guidance={"tensors": 0})
        acc.Reload()
        accs.append(acc)
    return accs


def _series(accs: list) -> tuple[dict[str, list], dict[str, list]]:
    """Scalar and text events of every layer, per tag (text: the user's tables, not config/status)."""
    scalars: dict[str, list] = {}
    texts: dict[str, list] = {}
    for acc in accs:
        for tag in acc.Tags()["tensors"]:
            plugin = acc.SummaryMetadata(tag).plugin_data.plugin_name
            if plugin == "scalars":
                scalars.setdefault(tag, []).extend(acc.Tensors(tag))
            elif plugin == "text" and tag not in (CONFIG_TAG, STATUS_TAG):
                texts.setdefault(tag, []).extend(acc.Tensors(tag))
    return scalars, texts


def read_back(env: dict, run_info, logdir: str | None = None) -> ReadBack:
    from tensorboard.plugins.hparams import metadata as hp_metadata
    from tensorboard.util import tensor_util

    accs = accumulators(logdir or logdir_for(env, run_info))
    main = accs[0]
    out = ReadBack()
    # Events of the out-of-order layers are merged back by wall time (= the record's time), which
    # restores the order the records were logged in.
    scalars, texts = _series(accs)
    for tag, events in scalars.items():
        ordered = sorted(events, key=lambda e: e.wall_time)
        out.metrics[tag] = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto).item())) for e in ordered]
    for tag, events in texts.items():
        name = tag[: -len(TEXT_SUFFIX)]
        if name.startswith("table/") and name[len("table/") :] in ("config", "status"):
            name = name[len("table/") :]
        out.tables[name] = [(e.step, parse_markdown_table(_text(e))) for e in sorted(events, key=lambda e: e.wall_time)]

    tags = main.Tags()["tensors"]
    content = main.PluginTagToContent(hp_metadata.PLUGIN_NAME) if hp_metadata.PLUGIN_NAME in main.ActivePlugins() else {}
    rows = parse_markdown_table(_text(main.Tensors(CONFIG_TAG)[-1])) if CONFIG_TAG in tags else []
    if hp_metadata.SESSION_START_INFO_TAG in content:
        info = hp_metadata.parse_session_start_info_plugin_data(content[hp_metadata.SESSION_START_INFO_TAG])
        for key, value in info.hparams.items():
            out.config[key] = getattr(value, value.WhichOneof("kind"))
        out.config.update({row["key"]: row["value"] for row in rows if row.get(SET_AT)})
    else:
        out.config = {row["key"]: row["value"] for row in rows}

    if STATUS_TAG in tags:
        status = _text(main.Tensors(STATUS_TAG)[-1]).strip()
        out.status = status if status in RUN_STATUSES else None
    return out


# -- the contract suite's hooks (see readers/__init__.py) -------------------------------------------
def stored(value: float) -> float:
    """TensorBoard keeps scalars as float32 (NaN and ±inf as they are; beyond ~3.4e38 becomes ±inf)."""
    import numpy as np

    with np.errstate(over="ignore"):
        return float(np.float32(value))


def cell(value) -> str:
    return format_cell(value)  # a Markdown table: every cell is text


def config_value(value):
    """The HPARAMS plugin keeps bools, numbers (as floats) and strings; anything else as its ``str``."""
    if isinstance(value, bool) or isinstance(value, str):
        return value
    return float(value) if isinstance(value, (int, float)) else str(value)


def config_update_value(original, new) -> str:
    """A value set after the start is read from the config text (HPARAMS keeps a run's first config)."""
    return format_cell(new)


SUPERSEDES = True  # a later attempt's restart marker hides what earlier attempts wrote from its step on


def break_next_write(monkeypatch, sink) -> None:
    """The next append to an event file stops half-way with ``ENOSPC``, as a filling disk does."""
    import rllog_backends.tensorboard as module

    fired = []

    class FillingFile:
        def __init__(self, f):
            self.f, self.written = f, False

        def write(self, data) -> int:
            if self.written:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written = True
            return self.f.write(data[: max(1, len(data) // 2)])

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.f.close()

    def filling_open(path, *args, **kwargs):
        f = open(path, *args, **kwargs)
        if fired:
            return f
        fired.append(path)
        return FillingFile(f)

    monkeypatch.setattr(module, "open", filling_open, raising=False)
