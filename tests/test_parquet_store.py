"""The parquet store for long runs: bounded files, bounded memory, crash-safe merges (real SIGKILLs)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from rllog_backends import parquet_store
from rllog_backends.parquet_store import FAN_IN, PartStore


def batch(first: int, n: int, extra_column: bool = False) -> pa.Table:
    columns = {"seq": list(range(first, first + n)), "value": [float(s) for s in range(first, first + n)]}
    if extra_column:
        columns["note"] = [f"n{s}" for s in range(first, first + n)]
    return pa.table(columns)


def test_many_flushes_keep_few_files_and_read_back_in_order(tmp_path, monkeypatch):
    monkeypatch.setattr(parquet_store, "TAIL_ROWS", 50)
    store = PartStore(tmp_path / "d", "seq")
    most, seq = 0, 1
    for flush in range(2000):  # 2,000 flushes of 10 rows: a long run at a short flush_interval
        store.append(batch(seq, 10, extra_column=flush >= 1500))
        store.flush()
        seq += 10
        most = max(most, len(PartStore.files(tmp_path / "d")))
    levels = 1 + max(int(p.stem.rsplit("L", 1)[1]) for p in PartStore.files(tmp_path / "d") if p.suffix == ".parquet")
    assert most <= (FAN_IN - 1) * levels + 2  # a tail, (FAN_IN - 1) parts per level, a merge's output
    table = PartStore.read(tmp_path / "d")
    assert table.column("seq").to_pylist() == list(range(1, seq))
    assert table.column("note").to_pylist()[:3] == [None] * 3 and table.column("note").to_pylist()[-1] == f"n{seq - 1}"
    store.close()
    assert [p.suffix for p in PartStore.files(tmp_path / "d")] == [".parquet"]  # one file at the end
    assert PartStore.read(tmp_path / "d").column("seq").to_pylist() == list(range(1, seq))


WRITER = r"""
import sys
from rllog_backends import parquet_store
parquet_store.TAIL_ROWS = 30
parquet_store.FAN_IN = 2  # a merge at almost every roll: kills land inside merges
import pyarrow as pa
store = parquet_store.PartStore(parquet_store.Path(sys.argv[1]), "seq")
store.open()
seq = store.written_seq + 1
while True:
    store.append(pa.table({"seq": list(range(seq, seq + 10)), "value": [float(s) for s in range(seq, seq + 10)]}))
    store.flush()
    seq += 10
    print(seq - 1, flush=True)
"""


@pytest.mark.slow
def test_sigkill_at_random_points_inside_merges_loses_and_duplicates_nothing(tmp_path):
    directory = tmp_path / "d"
    rng = random.Random(5)
    inside_merge = 0
    flushed = 0
    for trial in range(25):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(directory)], stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()  # started
        time.sleep(rng.uniform(0.05, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        lines = out.split()
        flushed = max([flushed, *(int(x) for x in lines if x.isdigit())])
        names = [p.name for p in directory.iterdir()]
        parts = [n for n in names if n.startswith("part-")]
        covered = len(parts) - len(parquet_store._live([f for f in parquet_store._listing(directory) if not f.is_tail]))
        inside_merge += any(n.endswith(".tmp") for n in names) or covered > 0
        seqs = PartStore.read(directory).column("seq").to_pylist()
        assert seqs == list(range(1, len(seqs) + 1)), trial  # in order, nothing twice, no gap
        assert len(seqs) >= flushed  # everything flushed before the kill is there
    assert inside_merge >= 1, "no kill landed inside a merge; raise the trials"
    store = PartStore(directory, "seq")
    store.open()  # takes over: tails to parts, replaced inputs and temporary files removed
    store.close()
    assert not [p for p in directory.iterdir() if p.name.endswith(".tmp")]
    assert PartStore.read(directory).column("seq").to_pylist() == list(range(1, store.written_seq + 1))


def test_a_torn_tail_batch_is_left_out(tmp_path):
    store = PartStore(tmp_path / "d", "seq")
    store.append(batch(1, 10))
    store.flush()
    store.append(batch(11, 10))
    store.flush()
    (tail,) = [p for p in PartStore.files(tmp_path / "d") if p.name.startswith("_tail")]
    data = tail.read_bytes()
    Path(tail).write_bytes(data[:-37])  # a writer killed in the middle of its last batch
    assert PartStore.read(tmp_path / "d").column("seq").to_pylist() == list(range(1, 11))
