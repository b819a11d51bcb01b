"""The journal: read from any seq, followed while it grows, torn tails skipped, SIGKILL loses nothing old."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pytest
from sinks import thread_wakeups

from rllog import journal
from rllog.journal import End, JournalReader, JournalWriter, PendingMetrics, read_all
from rllog.records import MetricsRecord, TableRecord


def write_records(run_dir, n, status="finished", flush_interval=0.05):
    w = JournalWriter(run_dir, flush_interval)
    for i in range(1, n + 1):
        if i % 10 == 0:
            w.append(TableRecord(i, i, float(i), "t", pa.table({"i": [i]})))
        else:
            w.append(PendingMetrics(i, i, float(i), {"v": float(i)}))
    w.close(status)
    return w


def test_reads_from_any_sequence_number(tmp_path):
    write_records(tmp_path, 50)
    items = list(read_all(tmp_path))
    assert [r.seq for r in items if not isinstance(r, End)] == list(range(1, 51))
    assert items[-1] == End("finished", items[-1].time)
    assert isinstance(items[9], TableRecord) and items[9].table.column("i").to_pylist() == [10]
    assert [r.seq for r in read_all(tmp_path, after_seq=37) if not isinstance(r, End)] == list(range(38, 51))
    assert journal.last_seq(tmp_path) == 50


def test_segments_rotate_and_reading_crosses_them(tmp_path, monkeypatch):
    monkeypatch.setattr(journal.writer, "SEGMENT_BYTES", 300)
    w = JournalWriter(tmp_path, 0.01)
    for i in range(1, 101):
        w.append(PendingMetrics(i, i, 0.0, {"v": float(i)}))
        if i % 7 == 0:
            assert w.wait_written(i, timeout=10)  # several writes, so several segments
    w.close("finished")
    assert len(list((tmp_path / "journal").glob("*.rlj"))) > 3
    assert [r.seq for r in read_all(tmp_path, after_seq=55) if not isinstance(r, End)] == list(range(56, 101))


def test_follows_a_growing_journal(tmp_path):
    w = JournalWriter(tmp_path, 0.02)
    reader = JournalReader(tmp_path)
    seen = []
    for i in range(1, 31):
        w.append(PendingMetrics(i, i, 0.0, {"v": float(i)}))
        if i % 10 == 0:
            deadline = time.monotonic() + 10
            while len(seen) < i and time.monotonic() < deadline:
                seen += [r.seq for r in reader.read(100)]
                time.sleep(0.01)
            assert seen == list(range(1, i + 1))
    w.close("failed")
    tail = []
    deadline = time.monotonic() + 10
    while not tail and time.monotonic() < deadline:
        tail = reader.read(100)
    assert tail == [End("failed", tail[0].time)]


def test_torn_tail_is_skipped_with_a_warning(tmp_path, caplog):
    write_records(tmp_path, 20, status="finished")
    seg = next((tmp_path / "journal").glob("*.rlj"))
    data = seg.read_bytes()
    end_frame_len = len(data) - data.rfind(journal.MAGIC + bytes([journal.KIND_END]))
    # cut the end marker and half of the last record: a process killed mid-write
    last = journal.encode_metrics(20, 20, 20.0, {"v": 20.0})
    seg.write_bytes(data[: len(data) - end_frame_len - len(last) // 2])
    reader = JournalReader(tmp_path)
    assert [r.seq for r in reader.read(100)] == list(range(1, 20))  # still waiting: a writer may finish it
    with caplog.at_level(logging.WARNING, logger="rllog.journal"):
        assert reader.read(100, final=True) == []
    assert "torn" in caplog.text
    # a resumed writer starts a new segment after the torn one; readers go on past the tear
    w = JournalWriter(tmp_path, 0.01, next_seq=20)
    w.append(PendingMetrics(20, 20, 0.0, {"v": 20.5}))
    w.close("finished")
    values = [r.values["v"] for r in read_all(tmp_path) if isinstance(r, MetricsRecord)]
    assert values[-2:] == [19.0, 20.5] and len(values) == 19  # 1..19 less the table at 10, then the new 20


def test_corrupt_frame_is_not_fatal(tmp_path, caplog):
    write_records(tmp_path, 5)
    seg = next((tmp_path / "journal").glob("*.rlj"))
    data = bytearray(seg.read_bytes())
    data[-40] ^= 0xFF  # flip a byte inside the last frames
    seg.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="rllog.journal"):
        seqs = [r.seq for r in read_all(tmp_path) if not isinstance(r, End)]
    assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) >= 3


CHILD = r"""
import sys, time, rllog
run = rllog.init(report_to="none", run_dir=sys.argv[1], flush_interval=float(sys.argv[2]))
i = 0
while True:
    i += 1
    run.log({"i": float(i)}, step=i)
    print(i, time.time(), flush=True)
    time.sleep(0.002)  # a trainer's pace: the test kills it at a known time after a log
"""


@pytest.mark.parametrize("flush_interval", [0.2, 1.0])
def test_sigkill_loses_nothing_older_than_flush_interval(tmp_path, flush_interval):
    """1.0 is the default: the writer then batches for 0.25 s (a quarter of it), 0.05 s at 0.2."""
    for trial in range(3):
        run_dir = tmp_path / f"r{trial}"
        command = [sys.executable, "-c", CHILD, str(run_dir), str(flush_interval)]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        logged = []
        target = round((150 + 97 * trial) * flush_interval / 0.2)
        for line in proc.stdout:
            seq, t = line.split()
            logged.append((int(seq), float(t)))
            if len(logged) >= target:
                break
        kill_time = time.time()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        found = {r.seq for r in read_all(run_dir) if isinstance(r, MetricsRecord)}
        must_have = {seq for seq, t in logged if t < kill_time - flush_interval}
        assert must_have, "the child logged for long enough"
        assert must_have <= found, sorted(must_have - found)[:10]
        assert found == set(range(1, max(found) + 1))  # a prefix: nothing in between lost


def _frames(run_dir):
    """``(kind, seq, payload)`` of every frame in the run's journal, in order."""
    for segment in journal.segments(journal.journal_dir(run_dir)):
        data, pos = segment.read_bytes(), 0
        while pos < len(data):
            kind, seq, length, _crc = journal.header_at(data, pos)
            yield kind, seq, data[pos + journal.HEADER.size : pos + journal.HEADER.size + length]
            pos += journal.HEADER.size + length


def test_a_new_table_is_encoded_by_arrow_on_the_thread_that_logs_it_and_its_repeats_as_json_on_the_writers(tmp_path, monkeypatch):
    """pyarrow's IPC writer releases the GIL several times per table; on the journal's thread that made a training
    thread wait for the GIL at each release (docs/decisions.md), so ``append`` encodes an Arrow table before it
    returns. A table with the columns of the last one of its name is not converted to Arrow at all: the writer thread
    encodes its columns as JSON (which holds the GIL throughout), and readers get the same Arrow table back."""
    import threading

    import rllog

    arrow_threads, json_threads = [], []
    encode_table, encode_table_columns = journal.writer.encode_table, journal.writer.encode_table_columns

    def spy(threads, encode):
        def spying(*args, **kwargs):
            threads.append(threading.current_thread().name)
            return encode(*args, **kwargs)

        return spying

    monkeypatch.setattr(journal.writer, "encode_table", spy(arrow_threads, encode_table))
    monkeypatch.setattr(journal.writer, "encode_table_columns", spy(json_threads, encode_table_columns))
    run = rllog.init(["parquet"], run_dir=tmp_path / "run", delivery="thread", system_metrics=False)
    for step in range(3):
        run.log_table("completions", {"step": [step, step], "text": ["a", "b"], "score": [0.5, float("nan")]}, step=step)
        run.log({"loss": step / 2}, step=step)
    run.log_table("completions", {"step": [3], "text": [None], "score": [2.0]}, step=3)  # a new shape: Arrow again
    assert run.finish().ok
    assert arrow_threads == [threading.current_thread().name] * 2 and json_threads == ["rllog-journal"] * 2
    kinds = [
        kind for kind, _seq, _payload in _frames(tmp_path / "run") if kind in (journal.KIND_TABLE, journal.KIND_TABLE_COLUMNS)
    ]
    assert kinds == [journal.KIND_TABLE, journal.KIND_TABLE_COLUMNS, journal.KIND_TABLE_COLUMNS, journal.KIND_TABLE]
    tables = [r for r in read_all(tmp_path / "run") if isinstance(r, TableRecord)]
    first = tables[0].table.schema
    assert all(r.table.schema.equals(first) for r in tables[:3])  # the repeats read back with the first one's types
    assert [(r.step, r.table.column("text").to_pylist(), r.table.column("step").to_pylist()) for r in tables[:3]] == [
        (s, ["a", "b"], [s, s]) for s in range(3)
    ]
    scores = [r.table.column("score").to_pylist() for r in tables[:3]]
    assert [s[0] for s in scores] == [0.5] * 3 and all(math.isnan(s[1]) for s in scores)
    stored = rllog.read_table(tmp_path / "run", "completions")
    assert stored.column("step").to_pylist() == [0, 0, 1, 1, 2, 2, 3]
    assert stored.column("text").to_pylist() == ["a", "b"] * 3 + [None]


def test_a_tables_journal_bytes_do_not_depend_on_pyarrows_legacy_format_variables(tmp_path, monkeypatch):
    """pyarrow's IPC writer reads ARROW_PRE_0_15_IPC_FORMAT from the environment for every stream it opens unless
    given its options: set, a journal's tables were written in the pre-0.15 format (and every table paid the
    environment lookups on the training thread)."""
    from rllog.journal.format import encode_table

    table = pa.table({"step": [3, 3], "prompt": ["a", "b"], "reward": [0.5, -1.0]})
    plain = encode_table(7, 3, 1.5, "completions", table)
    monkeypatch.setenv("ARROW_PRE_0_15_IPC_FORMAT", "1")
    monkeypatch.setenv("ARROW_PRE_1_0_METADATA_VERSION", "1")
    assert encode_table(7, 3, 1.5, "completions", table) == plain
    w = JournalWriter(tmp_path)
    w.append(TableRecord(1, 3, 1.5, "completions", table))
    w.close("finished")
    (read,) = [r for r in read_all(tmp_path) if isinstance(r, TableRecord)]
    assert (read.seq, read.step, read.name, read.table.to_pydict()) == (1, 3, "completions", table.to_pydict())


def test_wait_written_returns_when_the_entry_is_handed_to_the_os(tmp_path):
    w = JournalWriter(tmp_path, write_interval=30.0)  # no tick during the test: only wake() writes
    w.append(PendingMetrics(1, 0, 1.0, {"v": 1.0}))
    assert w.wait_written(1, timeout=0.2) is False and w.written_seq == 0
    w.wake()
    assert w.wait_written(1, timeout=10.0) is True
    assert [r.values["v"] for r in read_all(tmp_path) if isinstance(r, MetricsRecord)] == [1.0]
    w.close("finished")
    assert w.wait_written(5, timeout=10.0) is False  # a writer that stopped is not waited for


def test_damage_read_again_from_an_earlier_cursor_is_counted_once(tmp_path):
    """A follower saves what its reader skipped while its cursor is still before it; restarted from that cursor
    (the agent killed), its reader goes over the same bytes again: the explorer's seed 1177 counted 2 frames for 1."""
    write_records(tmp_path, 30)
    seg = next((tmp_path / "journal").glob("*.rlj"))
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one payload byte in the middle
    seg.write_bytes(bytes(data))
    first = JournalReader(tmp_path)
    read = first.read(1000, final=True)
    assert first.damage.damaged_frames == 1 and len(read) == 30  # 29 records and the end marker
    saved = first.damage.as_dict()  # what the cursor file holds
    again = JournalReader(tmp_path)  # from the same (earlier) cursor
    again.damage = journal.Damage(**saved)
    assert len(again.read(1000, final=True)) == 30
    assert again.damage.as_dict() == saved  # the same frame, counted once
    other = bytearray(seg.read_bytes())
    other[-60] ^= 0xFF  # new damage, elsewhere, is still counted
    seg.write_bytes(bytes(other))
    third = JournalReader(tmp_path)
    third.damage = journal.Damage(**saved)
    third.read(1000, final=True)
    assert len(third.damage.places) == 2 and third.damage.damaged_bytes > saved["damaged_bytes"]


def test_an_idle_writer_sleeps_and_a_new_entry_still_lands(tmp_path):
    """Each wake-up of the writer takes the GIL from the training thread, which then waits to take it back: a writer
    with nothing to write must not wake on a timer (it woke every ``write_interval``: 40 times in these 2 s)."""
    w = JournalWriter(tmp_path, write_interval=0.05)
    w.append(PendingMetrics(1, 0, 1.0, {"v": 1.0}))
    assert w.wait_written(1, timeout=10.0)
    time.sleep(0.3)  # the writer has gone idle
    before = thread_wakeups(w._thread.native_id)
    time.sleep(2.0)
    assert thread_wakeups(w._thread.native_id) - before <= 2
    w.append(PendingMetrics(2, 1, 2.0, {"v": 2.0}))  # no wake(): the append itself ends the idle wait
    assert w.wait_written(2, timeout=10.0) is True
    w.close("finished")
    assert [r.values["v"] for r in read_all(tmp_path) if isinstance(r, MetricsRecord)] == [1.0, 2.0]


def test_a_writer_fed_faster_than_it_writes_wakes_once_a_batch_on_its_timer_alone(tmp_path):
    """A training loop logs every few milliseconds: the writer then goes from one batch to the next on its timer, not
    to an idle wait the next entry ends and then the batch's wait (two wake-ups a batch, each taking the GIL and a CPU
    from training: 2 s of this took ~40). Each entry still lands within a ``write_interval`` or so of its append, and
    once the entries stop the writer sleeps with no timer again."""
    interval, seconds = 0.1, 2.0
    w = JournalWriter(tmp_path, write_interval=interval)
    w.append(PendingMetrics(1, 0, 1.0, {"v": 0.0}))
    assert w.wait_written(1, timeout=10.0)
    appended: dict[int, float] = {}
    landed: dict[int, float] = {}
    before = thread_wakeups(w._thread.native_id)
    seq, end = 1, time.monotonic() + seconds
    while time.monotonic() < end:
        seq += 1
        appended[seq] = time.monotonic()
        w.append(PendingMetrics(seq, seq, float(seq), {"v": float(seq)}))
        for s in range(len(landed) + 2, w.written_seq + 1):  # seen to land since the last look
            landed[s] = time.monotonic()
        time.sleep(0.005)
    wakeups = thread_wakeups(w._thread.native_id) - before
    assert wakeups <= 1.4 * seconds / interval, wakeups  # ~20 batches; each woke the writer twice before (~40)
    assert w.wait_written(seq, timeout=10.0)
    late = [landed[s] - appended[s] for s in landed]
    assert len(late) > seq / 2 and sorted(late)[len(late) // 2] < interval  # within a batch's wait of the append
    time.sleep(3 * interval)  # a whole interval with nothing: the writer goes idle
    idle_before = thread_wakeups(w._thread.native_id)
    time.sleep(1.0)
    assert thread_wakeups(w._thread.native_id) - idle_before <= 1
    w.close("finished")
    assert [r.values["v"] for r in read_all(tmp_path) if isinstance(r, MetricsRecord)] == [0.0] + [
        float(s) for s in range(2, seq + 1)
    ]


def test_an_entry_appended_while_the_writer_goes_idle_is_never_left_behind(tmp_path):
    """``append`` and the writer's idle wait race: an entry that comes between the writer's last look at what is
    pending and its sleep must still end the sleep, or it would wait for the next entry (for the last one of a run:
    forever). Each round appends one entry at a random moment around the writer going idle, then waits for it with no
    ``wake()``."""
    import random

    w = JournalWriter(tmp_path, write_interval=0.0005)
    rng = random.Random(7)
    for seq in range(1, 301):
        time.sleep(rng.random() * 0.002)
        w.append(PendingMetrics(seq, seq, float(seq), {"v": float(seq)}))
        assert w.wait_written(seq, timeout=5.0) is True, seq
    w.close("finished")
    assert [r.seq for r in read_all(tmp_path) if isinstance(r, MetricsRecord)] == list(range(1, 301))


def test_the_journals_json_is_what_json_dumps_writes():
    """Metrics and repeated tables' columns are encoded with json's C encoder made once (not ``json.dumps`` per
    record): the same text, NaN, infinities, -0.0, large ints, non-ASCII text and a lone surrogate included."""
    from rllog.journal import format as fmt

    values = {"nan": float("nan"), "inf": float("-inf"), "zero": -0.0, "big": 1e300, "exact": 2.0**53 + 2, "é": 0.1}
    columns = {"text": ["é", "\ud800", "a\nb", None], "flag": [True, False, None, True], "n": [1, -2, 3, 2**62]}
    assert fmt._COMPACT_JSON(values) == json.dumps(values, separators=(",", ":"))
    assert fmt._COMPACT_UTF8_JSON(columns) == json.dumps(columns, separators=(",", ":"), ensure_ascii=False)
    with pytest.raises(TypeError, match="not JSON serializable"):
        fmt._COMPACT_JSON({"x": object()})
    frame = fmt.encode_metrics(7, 3, 1.5, values)
    record = fmt.decode_frame(
        fmt.KIND_METRICS, 7, frame[-len(json.dumps({"step": 3, "time": 1.5, "values": values}, separators=(",", ":"))) :]
    )
    assert (record.seq, record.step, record.time) == (7, 3, 1.5)
    assert {k: repr(v) for k, v in record.values.items()} == {k: repr(v) for k, v in values.items()}
