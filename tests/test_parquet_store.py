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
from sinks import fill, tmpfs

from rllog.errors import TransientError
from rllog.records import MetricsRecord, RunInfo, TableRecord
from rllog.sink import Batch
from rllog_backends import parquet_store
from rllog_backends.parquet import ParquetSink, read_metrics, read_table
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


# Kills of the writer: at least KILLS_MIN, and on until one has landed inside a merge (at most KILLS_MAX).
KILLS_MIN, KILLS_MAX = 12, 40


@pytest.mark.slow
def test_sigkill_at_random_points_inside_merges_loses_and_duplicates_nothing(tmp_path):
    directory = tmp_path / "d"
    rng = random.Random(5)
    inside_merge = 0
    flushed = 0
    for trial in range(KILLS_MAX):
        if trial >= KILLS_MIN and inside_merge:
            break
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(directory)], stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()  # started
        time.sleep(rng.uniform(0.05, 0.4))  # the fault: a SIGKILL at a random instant of the writer's work
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
    assert inside_merge >= 1, "no kill landed inside a merge; raise KILLS_MAX"
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


def open_sink(run_dir: Path) -> ParquetSink:
    sink = ParquetSink()
    sink.open(RunInfo(project="p", name="n", run_dir=str(run_dir), run_id="r"))
    return sink


def metric_rows(table: pa.Table) -> list[tuple]:
    return list(zip(table["seq"].to_pylist(), table["key"].to_pylist(), table["value"].to_pylist(), strict=True))


def split_metrics() -> list[MetricsRecord]:
    """140,000 rows in one flush (more than BATCH_ROWS): the first batch ends inside a record's keys unless cut at one."""
    return [
        MetricsRecord(seq=i + 1, step=i, time=0.0, values={f"k{j}": float(i * 100 + j) for j in range(100)}) for i in range(1400)
    ]


def chunked_table() -> TableRecord:
    """One table record whose pyarrow table has two chunks (the user's ``pa.concat_tables``)."""
    table = pa.concat_tables([pa.table({"x": [1, 2, 3]}), pa.table({"x": [4, 5, 6]})])
    return TableRecord(seq=1, step=0, time=0.0, name="t", table=table)


KILLED_MID_APPEND = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[3])
import pyarrow as pa
from test_parquet_store import chunked_table, open_sink, split_metrics


class KilledAtSecondBatch:
    '''The tail's stream: the process is SIGKILLed when the second batch of an append is due (the first is on disk).'''

    def __init__(self, writer):
        self.writer, self.batches = writer, 0

    def write_batch(self, batch):
        self.batches += 1
        if self.batches == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        self.writer.write_batch(batch)

    def __getattr__(self, name):
        return getattr(self.writer, name)


new_stream = pa.ipc.new_stream
pa.ipc.new_stream = lambda *args, **kwargs: KilledAtSecondBatch(new_stream(*args, **kwargs))
sink = open_sink(sys.argv[1])
if sys.argv[2] == "metrics":
    sink.write_metrics(split_metrics())  # flushes by itself (past MAX_BUFFERED_ROWS)
else:
    sink.write_table(chunked_table())
sink.flush()
os.kill(os.getpid(), signal.SIGKILL)  # killed before the delivery cursor moved: everything is re-sent
"""


@pytest.mark.parametrize("kind", ["metrics", "table"])
def test_a_sigkill_inside_an_append_keeps_every_row_of_the_record_it_cut(tmp_path, kind):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_APPEND, str(run), kind, str(Path(__file__).parent)], check=False)
    assert proc.returncode == -signal.SIGKILL
    sink = open_sink(run)  # the next agent: takes over the tail, then the records are re-delivered
    if kind == "metrics":
        sink.write_metrics(split_metrics())
    else:
        sink.write_table(chunked_table())
    sink.close("finished")
    if kind == "metrics":
        rows = read_metrics(run)
        expected = [(r.seq, k, v) for r in split_metrics() for k, v in r.values.items()]
        assert metric_rows(rows) == expected
    else:
        assert read_table(run, "t").column("x").to_pylist() == [1, 2, 3, 4, 5, 6]


def test_a_tail_turned_into_a_part_between_a_readers_listing_and_its_open_is_read(tmp_path, monkeypatch):
    store = PartStore(tmp_path / "d", "seq")
    store.append(batch(1, 10))
    store.flush()
    listing, raced = parquet_store._listing, []

    def listing_then_conversion(directory):
        files = listing(directory)
        if not raced:  # the reader has listed the tail; the writer now turns it into a part and removes it
            raced.append(True)
            store.roll()
        return files

    monkeypatch.setattr(parquet_store, "_listing", listing_then_conversion)
    table = PartStore.read(tmp_path / "d")
    assert raced and table is not None
    assert table.column("seq").to_pylist() == list(range(1, 11))
    assert table.column("value").to_pylist() == [float(s) for s in range(1, 11)]


@pytest.fixture
def small_disk(tmp_path):
    """A real 16 MiB filesystem (tmpfs) that the test can fill and free."""
    with tmpfs(tmp_path / "disk", "size=16m") as disk:
        yield disk


def test_a_call_that_failed_on_a_full_disk_stores_its_metrics_once(small_disk):
    """The rows a failed flush keeps buffered were taken (rllog.sink.took): the delivery layer sends none again,
    and the next flush stores each once."""
    run = small_disk / "run"
    sink = open_sink(run)
    sink.write_metrics([])  # the metrics directory exists
    records = [MetricsRecord(seq=i + 1, step=i, time=0.0, values={f"k{j}": float(j) for j in range(100)}) for i in range(1000)]
    batch = Batch(records)
    filler = fill(small_disk)
    with pytest.raises(TransientError):
        sink.write_metrics(batch)  # 100,000 rows: flushed at once, on the full disk; the rows stay buffered
    filler.unlink()
    assert len(batch.drop_taken()) == 1000 and not batch  # every record was buffered: none is handed over again
    sink.close("finished")
    rows = read_metrics(run)
    assert metric_rows(rows) == [(r.seq, k, v) for r in records for k, v in r.values.items()]


def files_open_under(directory: Path) -> int:
    """How many file handles of this process point into ``directory``."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # the listing's own handle, closed since
    return sum(link.startswith(str(directory)) for link in links)


def test_many_table_names_keep_a_bounded_number_of_files_open(tmp_path):
    run = tmp_path / "run"
    sink = open_sink(run)
    names = [f"eval/task_{i}" for i in range(300)]
    # the first flush writes 300 tables (at most MAX_OPEN_TAILS_IN_USE stay open), the second 10 of them (the
    # tails of the others, idle, are closed down to MAX_OPEN_TAILS)
    for flush, written in enumerate([names, names[:10]]):
        for i, name in enumerate(written):
            sink.write_table(TableRecord(seq=1 + flush * 300 + i, step=flush, time=0.0, name=name, table=pa.table({"x": [i]})))
        sink.write_metrics([MetricsRecord(seq=601 + flush, step=flush, time=0.0, values={"loss": float(flush)})])
        sink.flush()
        assert files_open_under(run) <= [ParquetSink.MAX_OPEN_TAILS_IN_USE, ParquetSink.MAX_OPEN_TAILS][flush]
    sink.close("finished")
    assert files_open_under(run) == 0
    for i, name in enumerate(names):
        assert read_table(run, name).column("x").to_pylist() == ([i, i] if i < 10 else [i])
    assert read_metrics(run).column("value").to_pylist() == [0.0, 1.0]
