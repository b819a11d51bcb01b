"""Read the parquet backend's files back (the embedded default), with the backend's own readers."""

from __future__ import annotations

import errno
import json
from pathlib import Path

from readers import ReadBack
from rllog_backends.parquet import read_alerts, read_metrics, read_table, store_dir, table_names


def read_back(env: dict, run_info) -> ReadBack:
    out = ReadBack()
    for row in read_metrics(run_info.run_dir).to_pylist():
        out.metrics.setdefault(row["key"], []).append((row["step"], row["value"]))
    for name in table_names(run_info.run_dir):
        by_seq: dict[int, tuple[int, list]] = {}
        for row in read_table(run_info.run_dir, name).to_pylist():
            step, seq = row.pop("_step"), row.pop("_seq")
            by_seq.setdefault(seq, (step, []))[1].append(row)
        out.tables[name] = [by_seq[s] for s in sorted(by_seq)]
    out.alerts = [
        {"title": f"{a['rule']}: {a['metric']}", "text": a["message"], "level": a["level"], "step": a["step"]}
        for a in read_alerts(run_info.run_dir).to_pylist()
    ]
    meta = json.loads((store_dir(run_info.run_dir) / "meta.json").read_text())
    out.config, out.status = meta["config"], meta["status"]
    return out


# -- the contract suite's hooks (see readers/__init__.py) -------------------------------------------
def break_next_write(monkeypatch, sink) -> None:
    """The next part file stops half-way with ``ENOSPC``, as a filling disk does (the sink writes parts at flush)."""
    import pyarrow.parquet as pq

    real, fired = pq.write_table, []

    def write_table(table, where, *args, **kwargs):
        if fired:
            return real(table, where, *args, **kwargs)
        fired.append(where)
        Path(where).write_bytes(b"PAR1" + bytes(64))  # a torn part, as the full disk left it
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pq, "write_table", write_table)
