"""DVCLive backend: metrics, config and run status in a DVCLive directory; tables as JSON files beside them.

One rllog run is one DVCLive directory (default ``<run_dir>/dvclive``), opened with ``resume=True`` so a
later session (``rllog replay``, a resumed trainer) appends to the same files. What DVCLive writes:

- ``plots/metrics/<key>.tsv``: one row ``step<TAB>value`` per value, appended in the order logged (a step going
  back is a row like any other; ``/`` in a key is a sub-folder); NaN and ±inf as ``nan`` / ``inf`` / ``-inf``;
- ``metrics.json``: the latest value of every key (DVCLive's summary), at close;
- ``params.yaml``: the config (flat keys, YAML types), and the run's end status as ``rllog/status``.

**The user's repository is never touched.** DVCLive with its defaults runs ``dvc init`` in the enclosing git
repository, stages files in its index and saves experiments as git refs. The sink opens DVCLive with
``save_dvc_exp=False, dvcyaml=None, report=None`` and without DVCLive's repository discovery: no ``.dvc/``, no
``dvc.yaml``, no git call. Add the directory to DVC yourself (``dvc exp save``, a ``dvc.yaml`` entry) if you
want DVC experiments.

**Tables**: DVCLive has no table type. Each table is written as
``<dir>/tables/<name>/step_<step>-seq_<seq>.json`` (``{"columns": [...], "data": [[...], ...]}``, the format
pandas' ``read_json(orient="split")`` reads), NaN / ±inf cells as ``null``.

**Names**: a key is a path of ``.tsv`` files, so :func:`dvclive_key` keeps it only when it is a safe relative
path (no empty, ``.`` or ``..`` part, no backslash or control character, parts of at most 200 characters)
whose last part is not ``step`` or ``timestamp`` (DVCLive's own columns); any other key is cleaned and gets
``_`` and 8 hex digits of its SHA-1.

**Writes** are durable on return: DVCLive opens, appends and closes the ``.tsv`` file for every value; a
write that fails half-way (a full disk) is cut back to the file's previous length before the error goes to
the delivery layer, so the repeated call writes each row once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rllog.files import replace_file
from rllog.records import ConfigRecord, MetricsRecord, RunInfo, TableRecord
from rllog.sink import Capabilities, took
from rllog.sink_errors import map_errors
from rllog_backends._cells import cell
from rllog_backends._conventions import remember_location

log = logging.getLogger("rllog.backends.dvclive")

STATUS_PARAM = "rllog/status"
MAX_PART = 200  # characters per path part (file systems allow 255 bytes; ".tsv" and a hash suffix must fit)
RESERVED_LAST = frozenset({"step", "timestamp"})  # DVCLive's own .tsv columns
_BAD = re.compile(r"[\\\x00-\x1f\x7f]")
_HASH = 8


def _valid(key: str) -> bool:
    parts = key.split("/")
    return (
        not _BAD.search(key)
        and all(p not in ("", ".", "..") and len(p) <= MAX_PART for p in parts)
        and parts[-1] not in RESERVED_LAST
    )


def dvclive_key(key: str) -> str:
    """The path DVCLive stores metric or table ``key`` under (``plots/metrics/<path>.tsv``). Pure and deterministic.

    Example:
        >>> dvclive_key("rewards/accuracy/mean")
        'rewards/accuracy/mean'
        >>> dvclive_key("../eval//step")
        '__/eval/step_b919497d'
    """
    if _valid(key):
        return key
    suffix = "_" + hashlib.sha1(key.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH]
    parts = ["__" if p == ".." else _BAD.sub("_", p)[:MAX_PART] for p in key.split("/") if p not in ("", ".")] or ["_"]
    parts[-1] = parts[-1][: MAX_PART - len(suffix)] + suffix
    return "/".join(parts)


def _live_class() -> type:
    from dvclive import Live

    class RepoFreeLive(Live):
        """DVCLive without its repository discovery (``dvc init``, git index, experiment refs)."""

        def _init_dvc(self) -> None:
            self._dvc_repo = None
            self._dvc_file = self._init_dvc_file()

    return RepoFreeLive


class DVCLiveSink:
    """Writes rllog records with DVCLive.

    Args:
        dir: the DVCLive directory; default ``<run_dir>/dvclive``.

    Example:
        >>> run = rllog.init(report_to="dvclive", project="grpo-math")
        >>> run.log({"reward": 0.4}, step=1)
        >>> run.finish()
        >>> # <run_dir>/dvclive/plots/metrics/reward.tsv, params.yaml, metrics.json
    """

    # Durable on return: DVCLive appends each row and closes the file; tables and params are whole files.
    capabilities = Capabilities(tables=True, config=True, alerts=False, durable_writes=True)

    def __init__(self, dir: str | None = None):
        self.dir = dir
        self._live: Any = None
        self._summary_warned: set[str] = set()
        self._partial: set[tuple[int, str]] = set()  # (seq, name) of the values written of a record cut short

    @property
    def live(self) -> Any:
        """The ``dvclive.Live`` while the sink is open, else None."""
        return self._live

    def open(self, run_info: RunInfo) -> None:
        if self._live is not None:
            return
        directory = self.dir or os.path.join(run_info.run_dir, "dvclive")
        with map_errors("dvclive"):
            self._live = _live_class()(dir=directory, resume=True, report=None, save_dvc_exp=False, dvcyaml=None)
            if run_info.config:
                self._live.log_params(dict(run_info.config))
        remember_location(run_info, "dvclive", dir=os.path.abspath(directory))

    def write_metrics(self, records: Sequence[MetricsRecord]) -> None:
        live = self._require_live()
        for record in records:
            live.step = record.step
            for key, value in record.values.items():
                name = dvclive_key(key)
                if (record.seq, name) not in self._partial:
                    self._log_metric(live, name, float(value))
                    self._partial.add((record.seq, name))
            self._partial = set()
            took(records, record.seq)  # a repeated call (after a later record's error) starts after this one

    def _log_metric(self, live: Any, name: str, value: float) -> None:
        path = Path(live.plots_dir) / "metrics" / f"{name}.tsv"
        size = path.stat().st_size if path.exists() else None
        try:
            with map_errors("dvclive"):
                live.log_metric(name, value, timestamp=False)
        except (AttributeError, TypeError):
            # The row is written; DVCLive's summary (metrics.json) cannot hold both "a" and "a/b".
            if name not in self._summary_warned:
                self._summary_warned.add(name)
                log.warning("rllog: dvclive's summary cannot hold %r next to a key it is a part of; its .tsv is complete", name)
        except BaseException:
            _cut_back(path, size)
            raise

    def write_table(self, record: TableRecord) -> None:
        live = self._require_live()
        target = Path(live.dir) / "tables" / dvclive_key(record.name) / f"step_{record.step}-seq_{record.seq}.json"
        columns = [str(c) for c in record.table.column_names]
        data = [[cell(row.get(c)) for c in record.table.column_names] for row in record.table.to_pylist()]
        text = json.dumps({"columns": columns, "data": data}, ensure_ascii=False, allow_nan=False)
        with map_errors("dvclive"):
            replace_file(target, text)

    def write_config(self, record: ConfigRecord) -> None:
        """Config given after ``open`` (``Run.update_config``), merged into ``params.yaml``."""
        live = self._require_live()
        with map_errors("dvclive"):
            live.log_params(dict(record.values))

    def flush(self) -> None:
        """Nothing to do: every write is in the file when it returns."""

    def close(self, status: str) -> None:
        if self._live is None:
            return
        live = self._live
        with map_errors("dvclive"):
            live.log_param(STATUS_PARAM, status)
            live.end()
        self._live = None

    def _require_live(self) -> Any:
        if self._live is None:
            raise RuntimeError("DVCLiveSink: open() must be called before writing")
        return self._live


def _cut_back(path: Path, size: int | None) -> None:
    """Undo a failed append: the file back to ``size`` bytes, or gone if it did not exist."""
    try:
        if size is None:
            path.unlink(missing_ok=True)
        else:
            os.truncate(path, size)
    except OSError:
        log.warning("rllog: could not cut %s back after a failed write", path)
