"""Read the parquet backend's files back (the embedded default), with the backend's own readers."""

from __future__ import annotations

import errno
import json

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
    """The next commit of a directory's tail fails with ``ENOSPC`` after part of a batch landed, as a filling disk does."""
    from rllog_backends.parquet_store import PartStore

    real, fired = PartStore.commit, []

    def commit(self):
        if fired or self._tail_file is None:
            return real(self)
        fired.append(self.directory)
        self._tail_file.write(b"\xff" * 37)  # a torn message, as the full disk left it
        self.discard_uncommitted()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PartStore, "commit", commit)
