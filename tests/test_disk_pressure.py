"""A run whose journal shares a small, nearly full disk with what is derived from it (the Parquet store, the
cursor files): nothing logged is lost, and once space returns every record reaches every tracker.

The disk is a real tmpfs, filled with real files and freed; TensorBoard and the trackers' own files are elsewhere, as
they are when only the run directory is on the small disk.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from readers import read_back
from sinks import fill, tmpfs

import rllog
from rllog import journal
from rllog.cli import main as cli_main
from rllog.delivery import Cursor, CursorStore
from rllog.errors import TransientError
from rllog.files import JOURNAL_RESERVE_BYTES
from rllog.journal import JournalWriter, PendingMetrics
from rllog.records import MetricsRecord, RunInfo
from rllog.run import load_run_info
from rllog_backends.parquet import OPEN_FILES_SHARE, ParquetSink, open_tail_cap, read_metrics

SCENARIO_DISK = "size=3m"
SCENARIO_FREE_AT_START = 150 * 1024  # what the disk has free when the run starts
SCENARIO_FREED = 2800 * 1024  # freed at half the run
SCENARIO_STEPS = 3000
SCENARIO_METRICS = 20
# Room for the run's own data and little more: its journal (~1.40 MB), its Parquet store compressed (~0.2-0.3 MB,
# more while tails wait to become parts) and cursors; the store's tails uncompressed (~2.7 MB) would not fit.
TIGHT_DISK = "size=1800k"


def filler(disk: Path, name: str, size: int | None = None, free: int = 0) -> Path:
    """A file on ``disk`` of ``size`` bytes, or one that leaves ``free`` bytes free (rounded to the disk's blocks)."""
    if size is None:
        st = os.statvfs(disk)
        size = max(0, st.f_bavail * st.f_frsize - free)
    path = disk / name
    with open(path, "wb", buffering=0) as f:
        f.write(b"\0" * size)
    return path


def run_disk_pressure(disk: Path, tensorboard_dir: Path, crowded: bool = True, timeout: float = 120) -> dict:
    """The run of ``SCENARIO_STEPS`` x ``SCENARIO_METRICS`` to parquet and TensorBoard on ``disk``, a fresh tmpfs.
    ``crowded``: other files leave ``SCENARIO_FREE_AT_START`` free, and ``SCENARIO_FREED`` of them is freed at half
    the run; else the run is alone on the disk. Returns what each tracker holds."""
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(tensorboard_dir)
    released = None
    if crowded:
        released = filler(disk, "released", size=SCENARIO_FREED)
        filler(disk, "kept", free=SCENARIO_FREE_AT_START)
    run_dir = disk / "r"
    run = rllog.init(report_to="parquet,tensorboard", run_dir=run_dir, flush_interval=0.05, health=False)
    keys = [f"m{i:02d}/value" for i in range(SCENARIO_METRICS)]
    for step in range(SCENARIO_STEPS):
        if step == SCENARIO_STEPS // 2 and released is not None:
            released.unlink()
        run.log({key: step + i / 100 for i, key in enumerate(keys)}, step=step)
    report = run.finish(timeout=timeout)
    table = read_metrics(run_dir)
    env = {"TENSORBOARD_LOGGING_DIR": str(tensorboard_dir)}
    tensorboard = read_back("tensorboard", env, load_run_info(run_dir)[0]).metrics
    return {
        "report": report,
        "lost": report.unwritten,
        "parquet_rows": table.num_rows,
        "parquet_distinct": len(set(zip(table.column("seq").to_pylist(), table.column("key").to_pylist(), strict=True))),
        "parquet_steps": len(set(table.column("step").to_pylist())),
        "tensorboard_points": sum(len({s for s, _ in points}) for points in tensorboard.values()),
        "tensorboard_steps": {key: {s for s, _ in points} for key, points in tensorboard.items()},
    }


def assert_every_record_in_every_tracker(got: dict) -> None:
    report = got["report"]
    assert got["lost"] == 0, str(report)
    assert got["parquet_rows"] == got["parquet_distinct"] == SCENARIO_STEPS * SCENARIO_METRICS, str(report)
    assert got["tensorboard_points"] == SCENARIO_STEPS * SCENARIO_METRICS, str(report)
    assert all(steps == set(range(SCENARIO_STEPS)) for steps in got["tensorboard_steps"].values())
    assert report.ok, str(report)


@pytest.mark.slow
def test_a_disk_freed_mid_run_gets_every_record_to_parquet_and_tensorboard(tmp_path):
    """The issue's scenario: 150 KB free at the start, 2.8 MB freed at half the run."""
    with tmpfs(tmp_path / "disk", SCENARIO_DISK) as disk:
        got = run_disk_pressure(disk, tmp_path / "tensorboard")
    assert_every_record_in_every_tracker(got)


@pytest.mark.slow
def test_a_disk_with_no_headroom_beyond_the_run_gets_every_record_to_parquet_and_tensorboard(tmp_path):
    with tmpfs(tmp_path / "disk", TIGHT_DISK) as disk:
        got = run_disk_pressure(disk, tmp_path / "tensorboard", crowded=False)
    assert_every_record_in_every_tracker(got)


def test_the_journal_writes_into_its_reserve_after_another_file_filled_the_disk(small_disk):
    writer = JournalWriter(small_disk / "r", write_interval=0.01)
    fill(small_disk)  # whoever fills the disk (a derived store, a tracker, another program) after the writer started
    values = {f"m{i:02d}/value": float(i) for i in range(20)}
    frame_bytes = len(journal.encode_metrics(99_999, 99_999, 0.0, values))
    n = (JOURNAL_RESERVE_BYTES // 2) // frame_bytes  # half the reserve: what the writer can count on between top-ups
    for i in range(n):
        writer.append(PendingMetrics(seq=i + 1, step=i, time=0.0, values=dict(values)))
    assert writer.wait_written(n, timeout=30), writer.error
    assert writer.error is None
    assert writer.close("finished", timeout=30)  # the end marker too
    scan = journal.scan(small_disk / "r")
    assert scan.records == n and scan.end_seen and not scan.damage  # readers go by the size: frames only
    (segment,) = (small_disk / "r" / "journal").glob("*.rlj")
    assert segment.stat().st_blocks * 512 < segment.stat().st_size + 8192  # the reserve was given back at the end


def test_a_cursor_moves_on_a_full_disk_and_a_format_1_cursor_still_loads(small_disk):
    store = CursorStore(small_disk / "r", "parquet")
    store.directory.mkdir(parents=True)
    store.path.write_text(json.dumps({"seq": 41, "ahead": [43], "state": "running", "dead_letter_count": 0}))  # format 1
    assert (store.load().seq, store.load().ahead, store.load().state) == (41, [43], "running")
    store.save(Cursor(seq=42, state="running"))  # made at its fixed size while there is room
    fill(small_disk)
    for seq in range(43, 543):
        store.save(Cursor(seq=seq, state="running", error="x" * (seq % 7)))  # written over in place: no block needed
    assert store.load().seq == 542
    assert json.loads(store.path.read_text())["seq"] == 542  # still JSON for any reader
    data = bytearray(store.path.read_bytes())
    data[data.index(b'"seq":542') + 6] ^= 0x01  # one damaged byte fails the checksum
    store.path.write_bytes(bytes(data))
    assert store.load().seq == 0


def metrics_records(first: int, count: int, keys: int = 100) -> list[MetricsRecord]:
    rng = random.Random(first)
    return [
        MetricsRecord(seq=first + i, step=first + i, time=float(first + i), values={f"k{j}": rng.random() for j in range(keys)})
        for i in range(count)
    ]


def test_a_flush_bigger_than_the_free_space_commits_what_fits_and_never_twice(small_disk):
    sink = ParquetSink()
    sink.open(RunInfo(project="p", name="n", run_dir=str(small_disk / "r"), run_id="r"))
    records = metrics_records(1, 900)  # 90,000 rows buffered: ~1 MB in the store
    sink.write_metrics(records)
    kept = filler(small_disk, "kept", free=400 * 1024)
    with pytest.raises(TransientError):
        sink.flush()
    stored = read_metrics(small_disk / "r")
    assert 0 < stored.num_rows < 90_000 and stored.num_rows % 100 == 0  # the pieces that fit, whole records only
    kept.unlink()
    sink.flush()  # the retry: what the delivery layer does after a TransientError
    sink.close("finished")
    rows = read_metrics(small_disk / "r")
    assert list(zip(rows["seq"].to_pylist(), rows["key"].to_pylist(), rows["value"].to_pylist(), strict=True)) == [
        (r.seq, k, v) for r in records for k, v in r.values.items()
    ]


def test_the_store_is_well_below_the_journal_it_is_derived_from(tmp_path):
    """A live run's flushes (a few steps each): while it runs, the Parquet store takes a fraction of the journal's bytes."""
    run_dir = tmp_path / "r"
    with rllog.init(report_to="parquet", run_dir=run_dir, flush_interval=0.05, health=False) as run:
        rng = random.Random(3)
        for step in range(2000):
            run.log({f"m{i:02d}/value": rng.random() for i in range(20)}, step=step)
            if step % 100 == 0:
                run.flush()
        run.flush()
        journal_bytes = sum(p.stat().st_size for p in (run_dir / "journal").iterdir())
        store_bytes = sum(p.stat().st_size for p in (run_dir / "parquet").rglob("*") if p.is_file())
        assert read_metrics(run_dir).num_rows == 40_000
    assert store_bytes < journal_bytes / 2, (store_bytes, journal_bytes)


MANY_TABLES = r"""
import resource, sys
import pyarrow as pa
from rllog.records import RunInfo, TableRecord
from rllog_backends.parquet import ParquetSink, read_table
sink = ParquetSink()
sink.open(RunInfo(project="p", name="n", run_dir=sys.argv[1], run_id="r"))
for flush in range(2):
    for i in range(100):
        sink.write_table(TableRecord(seq=1 + flush * 100 + i, step=flush, time=0.0, name=f"t{i}", table=pa.table({"x": [i]})))
    sink.flush()
sink.close("finished")
print(sum(read_table(sys.argv[1], f"t{i}").num_rows for i in range(100)))
"""


def test_the_open_tail_cap_follows_the_open_file_limit(tmp_path):
    """``ulimit -n 64`` and 100 table names flushed together: the tails open stay under the limit."""

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    proc = subprocess.run(
        [sys.executable, "-c", MANY_TABLES, str(tmp_path / "r")], preexec_fn=low_limit, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "200"
    assert open_tail_cap(ParquetSink.MAX_OPEN_TAILS_IN_USE) == min(
        ParquetSink.MAX_OPEN_TAILS_IN_USE, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // OPEN_FILES_SHARE
    )


KILLED_IN_CLOSE_MERGE = r"""
import os, signal, sys, types
from rllog_backends import parquet_store
parquet_store.TAIL_ROWS = 40  # a part every flush, none merged before the close: it has several to merge
parquet_store.FAN_IN = 1000
import rllog

closing = []
real_close = parquet_store.PartStore.close


def close(self):
    closing.append(self.directory)
    real_close(self)


def replace(src, dst):
    if closing and str(dst).endswith(".parquet") and not str(dst).endswith("-L0.parquet"):
        os.kill(os.getpid(), signal.SIGKILL)  # the merge's output is written whole, not yet renamed
    os.replace(src, dst)


parquet_store.PartStore.close = close
parquet_store.os = types.SimpleNamespace(**{**vars(os), "replace": replace})
run = rllog.init(report_to="parquet", run_dir=sys.argv[1], delivery="thread", flush_interval=0.05, health=False)
for step in range(400):
    run.log({"a": float(step), "b": -float(step)}, step=step)
    if step % 25 == 0:
        run.flush()  # a tail per flush
run.flush()  # the cursor is at the end: nothing is left for a replay to deliver
run.finish()
"""


def test_a_kill_inside_the_close_time_merge_is_finished_by_replay(tmp_path):
    run_dir = tmp_path / "r"
    proc = subprocess.run([sys.executable, "-c", KILLED_IN_CLOSE_MERGE, str(run_dir)], check=False)
    assert proc.returncode == -signal.SIGKILL
    metrics = run_dir / "parquet" / "metrics"
    assert list(metrics.glob(".*.tmp")) and len(list(metrics.glob("part-*.parquet"))) > 1  # what the kill left
    assert cli_main(["replay", str(run_dir), "--to", "parquet"]) == 0
    assert not list(metrics.glob(".*")) and len(list(metrics.glob("*"))) == 1  # one part, nothing left over
    rows = read_metrics(run_dir)
    assert sorted(zip(rows["seq"].to_pylist(), rows["key"].to_pylist(), strict=True)) == sorted(
        [(s + 1, "a") for s in range(400)] + [(s + 1, "b") for s in range(400)]
    )


def test_parquets_yield_to_the_journal_is_a_full_disk_to_the_delivery_layer(tmp_path, monkeypatch):
    """The yield raises no OSError of its own; without one behind it, a live run gave it up after give_up_after."""
    from rllog.sink_errors import is_resource_exhausted
    from rllog_backends import parquet

    run = rllog.init(report_to="none", run_dir=tmp_path / "r")
    run.finish()
    sink = parquet.ParquetSink()
    sink.open(rllog.rundir.load_run_info(tmp_path / "r")[0])
    monkeypatch.setattr(parquet, "free_bytes", lambda path: 0)  # a disk with nothing free
    monkeypatch.setattr(parquet, "holds_reserve", lambda journal: True)  # and a live journal's reserve on it
    with pytest.raises(TransientError) as raised:
        sink._check_room()
    assert "disk full" in str(raised.value) and is_resource_exhausted(raised.value)
