"""Read a run back from its DVCLive directory (default ``<run_dir>/dvclive``).

- metrics: every ``plots/metrics/**/<name>.tsv`` (header ``step<TAB><name>``), rows in file order; the key is
  the file's path below ``plots/metrics`` without ``.tsv``. Values are parsed with ``float`` (``nan``, ``inf``,
  ``-inf`` included): exact, DVCLive writes Python's shortest round-trip text.
- tables: ``tables/<name>/step_<step>-seq_<seq>.json`` written by the sink, in ``seq`` order; NaN / ±inf cells
  are ``null``.
- config: ``params.yaml`` read with DVCLive's own YAML 1.2 loader (YAML types) without ``rllog/status``; status: ``params.yaml``'s ``rllog/status``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from pathlib import Path

from readers import ReadBack
from rllog_backends.dvclive import STATUS_PARAM

_TABLE_FILE = re.compile(r"^step_(-?\d+)-seq_(\d+)\.json$")


def live_dir(env: dict, run_info) -> Path:
    return Path(env.get("DVCLIVE_DIR") or os.path.join(run_info.run_dir, "dvclive"))


def read_tsv(path: Path) -> list[tuple[int, float]]:
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    return [(int(step), float(value)) for step, value in rows[1:]]


def read_back(env: dict, run_info, directory: str | Path | None = None) -> ReadBack:
    from dvclive.serialize import load_yaml

    root = Path(directory) if directory else live_dir(env, run_info)
    if not root.is_dir():
        raise FileNotFoundError(f"no DVCLive directory {root}")
    out = ReadBack()
    metrics_dir = root / "plots" / "metrics"
    for path in sorted(metrics_dir.rglob("*.tsv")):
        out.metrics[path.relative_to(metrics_dir).with_suffix("").as_posix()] = read_tsv(path)
    found: dict[str, list[tuple[int, int, list[dict]]]] = {}
    for path in (root / "tables").rglob("*.json") if (root / "tables").is_dir() else []:
        match = _TABLE_FILE.match(path.name)
        if match:
            doc = json.loads(path.read_text(encoding="utf-8"))
            rows = [dict(zip(doc["columns"], row, strict=True)) for row in doc["data"]]
            name = path.parent.relative_to(root / "tables").as_posix()
            found.setdefault(name, []).append((int(match.group(2)), int(match.group(1)), rows))
    out.tables = {name: [(step, rows) for _, step, rows in sorted(items)] for name, items in found.items()}
    params_file = root / "params.yaml"
    params = dict(load_yaml(params_file) or {}) if params_file.exists() else {}  # DVC's YAML 1.2 loader ("1e-06" is a float)
    out.status = (params or {}).pop(STATUS_PARAM, None)
    out.config = params or {}
    return out


# -- the contract suite's hooks (see readers/__init__.py) -------------------------------------------
TABLE_CELLS = "nested"  # lists and dicts in table cells: kept nested


def cell(value):
    """Table cells follow rllog_backends/_cells.py: NaN and ±inf are ``null``."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def break_next_write(monkeypatch, sink) -> None:
    """The next ``.tsv`` append stops half-way with ``ENOSPC`` (after the call's earlier rows were written)."""
    import builtins
    import errno

    import dvclive.plots.metric as metric_module

    real_open, calls = builtins.open, []

    class FillingFile:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(data[: max(1, len(data) // 2)])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def filling_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if "a" in mode and str(path).endswith(".tsv"):
            calls.append(path)
            if len(calls) == 2:
                return FillingFile(f)
        return f

    monkeypatch.setattr(metric_module, "open", filling_open, raising=False)
