"""What the delivery agent runs out of (memory, descriptors) is waited for, never taken for damage or a bad sink;
what it holds is bounded by bytes, whatever the width of a record.

The faults are real where they can be aimed: a real ``RLIMIT_NOFILE`` on the trainer (the agent inherits it), lifted
from outside with ``prlimit(2)``; real bytes that pass their checksum and do not decode. A ``MemoryError`` at one
chosen frame is injected (a real ``RLIMIT_AS`` cannot be aimed at one decode).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from sinks import FlakySink, MemorySink, wait_until

import rllog
from rllog import delivery, journal
from rllog.delivery import BATCH_BYTES, FLUSH_DUE_RECORDS, LOCAL_RETRY_CAP, Follower, RetryPolicy
from rllog.errors import TransientError
from rllog.journal import End, JournalReader, JournalWriter, PendingMetrics
from rllog.run import load_run_info
from rllog_backends import parquet as parquet_backend  # what the parquet sink stored (rllog.read_* may read the journal)

FAST = RetryPolicy(base=0.01, cap=0.05, give_up_after=30)


@contextlib.contextmanager
def talking_trainer(script: str, args: list[str], stderr: Path) -> Iterator[subprocess.Popen]:
    """A trainer subprocess running ``script`` that the test talks to (lines on stdin and stdout), its stderr in
    ``stderr``; killed if the test ends before it does."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr.open("w"), text=True
    )
    try:
        yield trainer
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


def logged_run(run_dir, steps: int, width: int = 1) -> None:
    with rllog.init(report_to="none", run_dir=run_dir, health=False) as run:
        for step in range(steps):
            run.log({f"k{i}": float(step) for i in range(width)}, step=step)


def test_a_memory_error_while_decoding_a_frame_is_waited_out_and_the_frame_delivered(tmp_path, monkeypatch):
    run_dir = tmp_path / "r"
    logged_run(run_dir, 1000)
    real_decode, raised = journal.reader.decode_frame, []

    def decode(kind, seq, payload):
        if seq == 500 and not raised:
            raised.append(seq)
            raise MemoryError
        return real_decode(kind, seq, payload)

    monkeypatch.setattr(journal.reader, "decode_frame", decode)
    sink = MemorySink("memory")
    follower = Follower("memory", sink, load_run_info(run_dir)[0], follow=False, retry=FAST)
    assert follower.start().join(60)
    assert raised == [500]
    assert sink.seqs == list(range(1, 1001))  # seq 500 once, in its place
    saved = json.loads((run_dir / "delivery" / "memory.json").read_text())
    assert saved["damage"] == {"damaged_bytes": 0, "damaged_frames": 0, "torn_bytes": 0, "places": []}
    assert (saved["state"], saved["seq"], saved["error"]) == ("closed", 1000, None)
    report = rllog.run.report(run_dir, ["memory"])
    assert report.ok and report["memory"].delivered == 1000 and not report.journal_damage


def test_the_reader_stops_before_a_frame_it_could_not_decode_for_want_of_memory(tmp_path, monkeypatch):
    logged_run(tmp_path, 10)
    real_decode, failing = journal.reader.decode_frame, [True]

    def decode(kind, seq, payload):
        if seq == 5 and failing[0]:
            raise MemoryError
        return real_decode(kind, seq, payload)

    monkeypatch.setattr(journal.reader, "decode_frame", decode)
    reader = JournalReader(tmp_path)
    assert [r.seq for r in reader.read(100)] == [1, 2, 3, 4]  # what came before the frame
    with pytest.raises(MemoryError):
        reader.read(100)
    failing[0] = False
    batch = reader.read(100, final=True)
    assert [r.seq for r in batch if not isinstance(r, End)] == list(range(5, 11)) and not reader.damage


def test_the_journal_writer_waits_out_a_memory_error_while_encoding_and_loses_nothing(tmp_path, monkeypatch, caplog):
    """A MemoryError while the writer encodes a record (metrics on its thread, a table on the caller's) is waited out
    like a full disk: the record is encoded again later, in its place, and nothing is reported lost."""
    from rllog.journal import writer as writer_module

    real_metrics, real_table, raised = writer_module.encode_metrics, writer_module.encode_table, []

    def encode_metrics(seq, step, t, values):
        if seq == 7 and raised.count(7) < 3:
            raised.append(seq)
            raise MemoryError
        return real_metrics(seq, step, t, values)

    def encode_table(seq, step, t, name, table):
        if not any(r == ("table", seq) for r in raised):  # the caller's try; the writer thread's goes through
            raised.append(("table", seq))
            raise MemoryError
        return real_table(seq, step, t, name, table)

    monkeypatch.setattr(writer_module, "encode_metrics", encode_metrics)
    monkeypatch.setattr(writer_module, "encode_table", encode_table)
    run_dir = tmp_path / "r"
    with caplog.at_level("WARNING", logger="rllog.journal"):
        run = rllog.init(report_to="none", run_dir=run_dir, health=False, quiet=True)
        for step in range(20):
            run.log({"loss": step / 4, "reward": -step}, step=step)
            if step == 10:
                run.log_table("completions", {"completion": ["a", "b"], "reward": [0.5, 1.0]}, step=step)
        report = run.finish()
    assert raised.count(7) == 3 and ("table", 12) in raised
    assert report.ok and report.unwritten == 0
    records = JournalReader(run_dir).read(1000, final=True)
    kept = [r for r in records if not isinstance(r, End)]
    assert [r.seq for r in kept] == list(range(1, 22))  # seq 7 once, in its place
    metrics = [r for r in kept if hasattr(r, "values")]
    assert [(r.step, r.values) for r in metrics] == [(s, {"loss": s / 4, "reward": -s}) for s in range(20)]
    table = next(r for r in kept if getattr(r, "name", None) == "completions")
    assert (table.step, table.table.to_pydict()) == (10, {"completion": ["a", "b"], "reward": [0.5, 1.0]})
    said = [r.getMessage() for r in caplog.records]
    assert sum("out of memory while encoding" in m for m in said) == 1  # said once, not at every try
    assert any("writing again (memory available)" in m for m in said)


MEMORY_TRAINER = textwrap.dedent(
    """
    import json, resource, sys, time
    import rllog
    run = rllog.init(report_to="none", run_dir=sys.argv[1], health=False, quiet=True)
    run.log_table("texts", {"text": ["first"]}, step=0)
    run.flush()
    big = {"text": ["x" * 10_000] * int(sys.argv[2])}  # one string, many rows: little memory until encoded
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    status = open("/proc/self/status")
    run.log_table("texts", big, step=1)  # the same columns again: the writer thread encodes it, after its batching wait
    vm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 20), hard))
    time.sleep(1.5)
    held = type(run._writer.why_held).__name__
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    run.log({"after": 2.0}, step=2)
    report = run.finish()
    print(json.dumps({"held": held, "ok": report.ok, "unwritten": report.unwritten}))
    """
)


def test_a_trainer_out_of_address_space_while_its_journal_encodes_a_table_waits_and_writes_it_once_memory_is_back(
    tmp_path,
):
    """A real RLIMIT_AS, lowered right after a ``log_table`` to 1 MiB above what the trainer maps: the writer thread
    cannot encode the table (20 MB as JSON), holds it and says why, and writes it whole once the limit is raised."""
    run_dir, rows = tmp_path / "r", 2000
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_TRAINER, str(run_dir), str(rows)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"held": "MemoryError", "ok": True, "unwritten": 0}, done.stderr
    assert "out of memory while encoding" in done.stderr and "nothing is dropped" in done.stderr
    assert "writing again (memory available)" in done.stderr
    records = [r for r in JournalReader(run_dir).read(10, final=True) if not isinstance(r, End)]
    assert [(r.seq, r.step) for r in records] == [(1, 0), (2, 1), (3, 2)]
    assert records[0].table.to_pydict() == {"text": ["first"]}
    assert records[1].table.to_pydict() == {"text": ["x" * 10_000] * rows}
    assert records[2].values == {"after": 2.0}


def test_a_frame_that_passes_its_checksum_but_does_not_decode_is_damage(tmp_path):
    w = JournalWriter(tmp_path, 0.05)
    w.append(PendingMetrics(1, 1, 1.0, {"v": 1.0}))
    w.close("finished")
    (segment,) = (tmp_path / "journal").glob("*.rlj")
    with open(segment, "ab") as f:  # real bytes, checksummed, that are not a metrics record
        f.write(journal.frame(journal.KIND_METRICS, 2, b"not json"))
        f.write(journal.encode_metrics(3, 3, 3.0, {"v": 3.0}))
    reader = JournalReader(tmp_path)
    assert [r.seq for r in reader.read(100, final=True) if not isinstance(r, End)] == [1, 3]
    assert reader.damage.damaged_frames == 1


def test_resource_errors_of_a_sink_are_retried_not_dead_lettered(tmp_path):
    errors = [OSError(errno.EMFILE, "Too many open files"), MemoryError(), OSError(errno.ENOMEM, "Cannot allocate memory")]
    flaky = FlakySink(errors, name="flaky")
    run = rllog.init(report_to=[flaky], run_dir=tmp_path / "r", flush_interval=0.05, retry=FAST, health=False)
    for i in range(300):
        run.log({"i": float(i)})
    report = run.finish(timeout=60)
    assert report.ok, str(report)
    assert flaky.attempts >= 4 and report["flaky"].dead_letters == 0
    assert flaky.seqs == list(range(1, 301))  # exactly once each, in order


def test_resource_errors_back_off_to_seconds_and_remote_ones_to_the_policy_cap():
    policy = RetryPolicy(base=0.5, cap=30.0, random=lambda: 1.0 - 1e-12)
    wrapped = TransientError("disk full")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    for local in (OSError(errno.EMFILE, "x"), MemoryError(), wrapped):
        assert policy.delay(20, local) == pytest.approx(LOCAL_RETRY_CAP)
    assert policy.delay(20, TransientError("503")) == pytest.approx(30.0)


def test_a_read_returns_at_most_its_byte_budget_or_one_larger_record(tmp_path):
    w = JournalWriter(tmp_path, 0.05)
    widths = [1, 50, 400, 3, 2000, 10, 10, 5000, 1, 1] * 5
    for seq, width in enumerate(widths, start=1):
        w.append(PendingMetrics(seq, seq, 0.0, {f"key{i}": float(i) for i in range(width)}))
    w.close("finished")
    sizes = {}
    for seq, width in enumerate(widths, start=1):
        sizes[seq] = len(journal.encode_metrics(seq, seq, 0.0, {f"key{i}": float(i) for i in range(width)})) - journal.HEADER.size
    budget = 20_000
    assert max(sizes.values()) > budget  # some records are larger than the budget on their own
    reader, seen, batches = JournalReader(tmp_path), [], []
    while batch := [r for r in reader.read(1000, final=True, max_bytes=budget) if not isinstance(r, End)]:
        batches.append([r.seq for r in batch])
        seen += [r.seq for r in batch]
    assert seen == list(range(1, len(widths) + 1))
    for seqs in batches:
        assert len(seqs) == 1 or sum(sizes[s] for s in seqs) <= budget, seqs
    assert any(len(seqs) > 1 for seqs in batches)


def test_a_follower_takes_a_wide_backlog_in_batches_bounded_by_bytes_and_flushes_by_size(tmp_path):
    run_dir = tmp_path / "r"
    logged_run(run_dir, 60, width=10_000)  # ~250 KB of journal a record
    calls = []

    class CountingSink(MemorySink):
        def write_metrics(self, records):
            calls.append(len(records))
            super().write_metrics(records)

    sink = CountingSink("counting")
    follower = Follower("counting", sink, load_run_info(run_dir)[0], follow=False, flush_interval=3600)
    assert follower.start().join(120)
    assert sink.seqs == list(range(1, 61))
    smallest = len(journal.encode_metrics(1, 0, 0.0, {f"k{i}": 0.0 for i in range(10_000)})) - journal.HEADER.size
    assert max(calls) <= BATCH_BYTES // smallest < 60  # not the whole backlog in one call
    many, flushes = FLUSH_DUE_RECORDS * 2 + 500, []
    logged_run(tmp_path / "narrow", many)
    narrow = MemorySink("narrow")
    narrow.flush = lambda: flushes.append(len(narrow.metrics))  # type: ignore[method-assign]
    follower = Follower("narrow", narrow, load_run_info(tmp_path / "narrow")[0], follow=False, flush_interval=3600)
    assert follower.start().join(120)
    assert len(narrow.metrics) == many
    # due by size each time FLUSH_DUE_RECORDS more were delivered (read 1,000 at a time); the last one is finish's
    assert flushes == [FLUSH_DUE_RECORDS, 2 * FLUSH_DUE_RECORDS, many]


TABLES_TRAINER = textwrap.dedent(
    r"""
    import json, sys
    import rllog
    run_dir, names = sys.argv[1], int(sys.argv[2])
    run = rllog.init(report_to="parquet", run_dir=run_dir, flush_interval=0.05, health=False)
    run.log({"a": -1.0}, step=0)
    run.flush(timeout=60)  # the sink is open: the test takes the agent's spare descriptors away now
    print(run._agent.pid, flush=True)
    sys.stdin.readline()
    for step in range(3):
        for t in range(names):
            run.log_table(f"t{t}", {"x": [step]}, step=step)
        run.log({"a": float(step)}, step=step)
    sys.stdin.readline()  # the test lifts the limit, then says "finish"
    report = run.finish(timeout=120)
    print(json.dumps({"ok": report.ok, "text": str(report), "delivered": report["parquet"].delivered}), flush=True)
    """
)


@pytest.mark.slow
def test_an_agent_out_of_descriptors_waits_says_why_and_delivers_everything_once_the_limit_is_lifted(tmp_path):
    """A real RLIMIT_NOFILE lowered on the running agent to the descriptors it holds (prlimit(2)), then 100 table
    names to parquet: every open fails with EMFILE until the limit is lifted. (The Parquet sink caps its open tails
    from the limit, so a limit merely low no longer stalls it; one with no descriptor to spare does.)"""
    run_dir = tmp_path / "r"
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    stderr = tmp_path / "trainer-stderr.txt"
    with talking_trainer(TABLES_TRAINER, [str(run_dir), "100"], stderr) as trainer:
        assert trainer.stdout is not None and trainer.stdin is not None
        agent_pid = int(trainer.stdout.readline())
        held = len(os.listdir(f"/proc/{agent_pid}/fd"))
        resource.prlimit(agent_pid, resource.RLIMIT_NOFILE, (held, hard))
        trainer.stdin.write("log\n")
        trainer.stdin.flush()
        cursor = run_dir / "delivery" / "parquet.json"

        def stalled_and_says_why() -> bool:
            try:
                saved = json.loads(cursor.read_text())
            except (FileNotFoundError, ValueError):
                return False
            return saved["state"] == "running" and "Too many open files" in (saved["error"] or "")

        assert wait_until(stalled_and_says_why, timeout=60), cursor.read_text() if cursor.exists() else "no cursor"
        assert os.path.exists(f"/proc/{agent_pid}")  # the agent is alive, delivering nothing, and the report says why
        pending = rllog.run.report(run_dir, ["parquet"])["parquet"]
        assert pending.state == "pending" and "Too many open files" in (pending.error or "")
        said = "rllog: delivery to 'parquet' is waiting, retrying since"
        assert wait_until(lambda: said in stderr.read_text(), timeout=60), stderr.read_text()
        assert "Too many open files" in stderr.read_text()
        resource.prlimit(agent_pid, resource.RLIMIT_NOFILE, (hard, hard))  # prlimit(2): up to its own hard limit
        out, _ = trainer.communicate("finish\n", timeout=180)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ok"], result["text"] + stderr.read_text()
    assert result["delivered"] == 3 * 100 + 3 + 1
    assert all(sorted(parquet_backend.read_table(run_dir, f"t{t}").column("x").to_pylist()) == [0, 1, 2] for t in range(100))
    assert len(parquet_backend.read_metrics(run_dir)) == 4


def test_an_import_cut_for_want_of_descriptors_does_not_fail_a_sink_for_good_its_agent_starts_afresh(
    tmp_path, test_backends, monkeypatch
):
    """A tracker's import cut part-way by a real RLIMIT_NOFILE leaves its package half made in the agent's interpreter:
    the retried import raises a NameError that names no resource (as ``import asyncio`` did in the explorer's agent,
    seed 7153). The sink is not failed for it: the agent starts again from the cursors, and the fresh interpreter
    imports it and delivers everything, once."""
    from rllog_test_backends import read_jsonl

    marker = tmp_path / "import-cut"
    monkeypatch.setenv("RLLOG_TEST_CUT_IMPORT", str(marker))
    run_dir = tmp_path / "r"
    options = {"jsonl": {"imports": "rllog_test_halfmade"}}
    run = rllog.init(report_to="jsonl", run_dir=run_dir, backend_options=options, flush_interval=0.1, health=False)
    for step in range(30):
        run.log({"x": float(step)}, step=step)
    report = run.finish(timeout=120)
    assert marker.exists()  # the import was cut (once: the fresh agent's import goes through)
    assert report.ok and report["jsonl"].state == "delivered", report
    records, statuses = read_jsonl(run_dir / "jsonl.jsonl")
    assert sorted(r["seq"] for r in records) == list(range(1, 31)) and statuses == ["finished"]
    assert run._agent.restarts == 1


class TakesOneWriteThenBreaks(MemorySink):
    """Takes its first write (held until a flush, as a buffering tracker does), then raises a permanent error."""

    def write_metrics(self, records):
        if self.metric_calls:
            raise RuntimeError("broken after a fault")
        super().write_metrics(records)


def test_an_agent_that_ran_out_keeps_what_its_sink_took_before_it_restarts_so_nothing_is_sent_twice(tmp_path):
    """In an agent that ran out of a resource, a permanent error ends the follower for a restart (RAN_OUT). What the
    sink took and holds is flushed first, so the fresh agent does not send it again (explorer seed 81323: 20 jsonl
    records twice after a sink's EMFILE then its crash)."""
    from rllog.delivery.calls import RAN_OUT

    run_dir = tmp_path / "r"
    logged_run(run_dir, 100)
    sink = TakesOneWriteThenBreaks("memory")
    RAN_OUT.set()
    try:
        first = Follower(
            "memory", sink, load_run_info(run_dir)[0], follow=True, restartable=True, batch_size=50, flush_interval=60
        )
        assert first.start().join(60)
    finally:
        RAN_OUT.clear()
    saved = json.loads((run_dir / "delivery" / "memory.json").read_text())
    assert first.needs_restart and saved["state"] == "running" and "judged again" in saved["error"], saved
    assert sink.seqs == list(range(1, 51)) and sink.flushes == 1 and saved["seq"] == 50
    again = MemorySink("memory")
    assert Follower("memory", again, load_run_info(run_dir)[0], follow=True).start().join(60)
    assert again.seqs == list(range(51, 101))  # what the broken sink took is not sent again


def test_a_follower_whose_cursor_cannot_be_saved_for_want_of_descriptors_saves_it_with_its_spares(tmp_path):
    run_dir = tmp_path / "r"
    logged_run(run_dir, 10)
    follower = Follower("memory", MemorySink("memory"), load_run_info(run_dir)[0], follow=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    taken = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        while True:  # every descriptor this process may have
            try:
                taken.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as exc:
                assert exc.errno == errno.EMFILE
                break
        follower.error = "what the cursor must say"
        follower.stop()  # one attempt, no waiting for descriptors that never come
        assert follower._save(delivery.SinkState.FAILED)
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    saved = json.loads((run_dir / "delivery" / "memory.json").read_text())
    assert (saved["state"], saved["error"]) == ("failed", "what the cursor must say")


def test_parquet_buffers_at_most_its_row_limit_whatever_the_width_of_the_records_of_one_call(tmp_path, monkeypatch):
    from rllog.records import MetricsRecord
    from rllog_backends.parquet import ParquetSink

    sink = ParquetSink()
    logged_run(tmp_path / "r", 0)
    sink.open(load_run_info(tmp_path / "r")[0])
    buffered_at_flush = []
    real_flush = sink.flush

    def flush():
        buffered_at_flush.append(len(sink._rows))
        real_flush()

    monkeypatch.setattr(sink, "flush", flush)
    width = 10_000
    records = [MetricsRecord(seq, seq, 0.0, {f"k{i}": float(seq) for i in range(width)}) for seq in range(1, 31)]
    sink.write_metrics(records)  # one call, as a follower delivers a batch: 300,000 rows
    assert buffered_at_flush and max(buffered_at_flush) <= ParquetSink.MAX_BUFFERED_ROWS
    assert len(sink._rows) <= ParquetSink.MAX_BUFFERED_ROWS
    sink.close("finished")
    assert parquet_backend.read_metrics(tmp_path / "r").num_rows == 30 * width


def test_a_follower_thread_that_ended_while_running_is_named_in_its_cursor_by_the_agent(tmp_path):
    """What the agent does when a follower thread ends without saying how (the last-resort handler cannot raise,
    so this stands for a death nothing else could record)."""
    import threading

    run_dir = tmp_path / "r"
    logged_run(run_dir, 3)
    follower = Follower("memory", MemorySink("memory"), load_run_info(run_dir)[0], follow=False)
    follower._save(delivery.SinkState.RUNNING)
    follower.error = "OSError: [Errno 24] Too many open files"
    follower.thread = threading.Thread(target=lambda: None)
    follower.thread.start()
    follower.thread.join()
    follower.settle()
    saved = json.loads((run_dir / "delivery" / "memory.json").read_text())
    assert saved["state"] == "failed" and "ended unexpectedly" in saved["error"] and "Too many open files" in saved["error"]
    report = rllog.run.report(run_dir, ["memory"])["memory"]
    assert report.state == "failed" and "Too many open files" in report.error


def out_of_memory_at_advance(monkeypatch, call: int):
    """Make the ``call``-th ``Follower._advance`` (the follower's own bookkeeping) raise MemoryError; returns the real one."""
    real_advance, calls = Follower._advance, []

    def advance(self):
        calls.append(self.seq)
        if len(calls) == call:
            raise MemoryError
        real_advance(self)

    monkeypatch.setattr(Follower, "_advance", advance)
    return real_advance


def test_a_follower_out_of_memory_in_its_own_work_ends_for_a_restart_from_its_cursor_and_nothing_is_lost(tmp_path, monkeypatch):
    """Outside a sink call or a journal read, the follower's records in memory may be half booked: it ends with its
    cursor saying why, and a follower started again from that cursor (what its agent does) delivers the rest once."""
    from rllog_backends.parquet import ParquetSink

    run_dir = tmp_path / "r"
    logged_run(run_dir, 3000)
    real_advance = out_of_memory_at_advance(monkeypatch, call=3)
    first = Follower("parquet", ParquetSink(), load_run_info(run_dir)[0], follow=True, batch_size=500)
    assert first.start().join(60)
    saved = json.loads((run_dir / "delivery" / "parquet.json").read_text())
    assert first.needs_restart and saved["state"] == "running" and "MemoryError while delivering" in saved["error"]
    monkeypatch.setattr(Follower, "_advance", real_advance)
    again = Follower("parquet", ParquetSink(), load_run_info(run_dir)[0], follow=True)
    assert again.start().join(60)
    seqs = parquet_backend.read_metrics(run_dir).column("seq").to_pylist()
    assert sorted(seqs) == list(range(1, 3001))  # each once
    report = rllog.run.report(run_dir, ["parquet"])
    assert report.ok and report["parquet"].delivered == 3000


def test_in_the_trainers_process_a_follower_that_ended_for_a_restart_is_reported_failed_with_its_cause(tmp_path, monkeypatch):
    """delivery="thread" has no agent to start a follower again: finish settles its cursor and the report names why."""
    out_of_memory_at_advance(monkeypatch, call=2)
    sink = MemorySink("memory")
    run = rllog.init(report_to=[sink], run_dir=tmp_path / "r", delivery="thread", flush_interval=0.05)
    for i in range(20):
        run.log({"i": float(i)})
    report = run.finish(timeout=30)["memory"]
    assert report.state == "failed" and "MemoryError while delivering" in (report.error or "")
    saved = json.loads((tmp_path / "r" / "delivery" / "memory.json").read_text())
    assert saved["state"] == "failed"


class RunsOutThenRecovers(MemorySink):
    """Raises ``error`` for its first ``seconds`` of writes, then takes everything."""

    def __init__(self, name: str, error: Exception, seconds: float):
        super().__init__(name)
        self.error, self.seconds, self.first = error, seconds, None

    def write_metrics(self, records):
        import time

        self.first = self.first or time.monotonic()
        if time.monotonic() - self.first < self.seconds:
            raise self.error
        super().write_metrics(records)


@pytest.mark.parametrize(
    ("error", "trainer_gone", "waited"),
    [
        (OSError(errno.EMFILE, "Too many open files"), False, True),
        (MemoryError(), False, True),
        (TransientError("tracker down"), False, False),
        (OSError(errno.EMFILE, "Too many open files"), True, False),  # nobody will call finish: the agent must end
    ],
)
def test_a_live_follower_waits_out_what_the_machine_ran_out_of_past_give_up_after(tmp_path, error, trainer_gone, waited):
    """A live run gives up on a tracker down past give_up_after, never on memory or descriptors (they come back),
    unless its trainer is gone (an orphaned agent would otherwise wait for ever)."""
    run_dir = tmp_path / "r"
    logged_run(run_dir, 50)
    sink = RunsOutThenRecovers("out", error, seconds=1.0)
    policy = RetryPolicy(base=0.01, cap=0.05, give_up_after=0.3)
    gone = lambda: trainer_gone  # noqa: E731
    follower = Follower("out", sink, load_run_info(run_dir)[0], follow=True, writer_gone=gone, retry=policy)
    assert follower.start().join(60)
    saved = json.loads((run_dir / "delivery" / "out.json").read_text())
    if waited:
        assert sink.seqs == list(range(1, 51)) and saved["state"] == "closed"
    else:
        assert sink.seqs == [] and saved["state"] == "gave_up" and str(error) in saved["error"]


WITHOUT = r"""
import importlib, importlib.util, json, os, resource, sys
from rllog import registry
from rllog.sink_errors import is_resource_exhausted

candidates = ("_curses", "_dbm", "_gdbm", "audioop", "_bz2", "_lzma", "_ctypes", "mmap")
name = next(m for m in candidates if m not in sys.modules and importlib.util.find_spec(m) is not None)
importlib.util.find_spec(name)
actions = {"import": lambda: importlib.import_module(name).__name__ == name, "lookup": lambda: registry.resolve("jsonl").source}
action = actions[sys.argv[2]]
if sys.argv[1] == "descriptors":
    used = set()
    for n in range(4096):
        try:
            os.fstat(n)
            used.add(n)
        except OSError:
            pass
    which, limit = resource.RLIMIT_NOFILE, min(n for n in range(4097) if n not in used)  # no descriptor left
else:
    status = open("/proc/self/status").read()
    vm = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmSize:"))) * 1024
    which, limit = resource.RLIMIT_AS, vm  # no address space left to map the module into
soft, hard = resource.getrlimit(which)
resource.setrlimit(which, (limit, hard))
try:
    out = {"done": action()}
except Exception as exc:
    out = {"done": False, "type": type(exc).__name__, "message": str(exc), "resource": is_resource_exhausted(exc)}
resource.setrlimit(which, (soft, hard))
out["after"] = action()
print(json.dumps(out))
"""


def run_without(what: str, action: str) -> dict:
    """Run :data:`WITHOUT`: ``action`` ("import" an extension module, or "lookup" the test plugin) with no
    ``what`` ("descriptors" or "memory") left, then again once it is given back."""
    out = subprocess.run([sys.executable, "-c", WITHOUT, what, action], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize(
    "without, said", [("descriptors", os.strerror(errno.EMFILE)), ("memory", "failed to map segment from shared object")]
)
def test_an_extension_module_that_cannot_load_for_want_of_descriptors_or_memory_is_a_resource_error(without, said):
    """A tracker's import in the agent's follower (a sink's module, or one it imports late) ran into the explorer's
    descriptor limit (seed 8813) or address-space limit (seed 71017, parquet's libssl): the loader's ``dlopen``
    failed, and Python raised a bare ImportError with only its text, which made the sink fail for good. It is a
    resource error: waited out, then imported."""
    result = run_without(without, "import")
    assert result["done"] is False and result["type"] == "ImportError", result
    assert said in result["message"] and result["resource"] is True, result
    assert result["after"] is True  # the resource back: the same import works


def test_a_plugin_looked_up_with_no_descriptor_left_is_a_resource_error_not_an_unknown_backend(test_backends):
    """importlib.metadata suppresses the error of a sys.path entry it cannot list: in the explorer's agent with two
    descriptors to spare (seed 71029) the test plugin looked unknown, and "unknown backend 'jsonl'" failed the sink
    for good. The lookup now says what the process ran out of, which the follower waits out."""
    result = run_without("descriptors", "lookup")
    assert result["done"] is False and result["type"] == "OSError", result
    assert os.strerror(errno.EMFILE) in result["message"] and result["resource"] is True, result
    assert result["after"].startswith("entry point")  # descriptors back: the plugin is found


RESPAWN_TRAINER = r"""
import json, sys, rllog
run = rllog.init(report_to="parquet", run_dir=sys.argv[1], flush_interval=0.1, health=False)
for i in range(100):
    run.log({"i": float(i)}, step=i)
print(run._agent.proc.pid, flush=True)
sys.stdin.readline()  # the test takes this process's spare descriptors and kills its agent
for i in range(100, 200):
    run.log({"i": float(i)}, step=i)
sys.stdin.readline()  # the limit is lifted
report = run.finish(timeout=120)
print(json.dumps({"ok": report.ok, "delivered": report["parquet"].delivered, "restarts": run._agent.restarts,
                  "cause": run._agent.cause}), flush=True)
"""


LAUNCH_WITH_ONE_DESCRIPTOR = r"""
import json, os, resource, sys
from pathlib import Path
from rllog.agent.launch import launch

_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
held = []
while True:
    try:
        held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        break
os.close(held.pop())  # one left: the copy of stdout for the console takes it, and the system-metrics pipe finds none
before = len(os.listdir("/proc/self/fd"))
try:
    launch([sys.argv[1]], Path(sys.argv[2]), system_interval=1.0)
    result = "started"
except OSError as exc:
    result = exc.errno
os.close(held.pop())  # room to list the descriptors even if the start kept one
print(json.dumps({"result": result, "left_open": len(os.listdir("/proc/self/fd")) - (before - 1)}))
"""


def test_an_agent_start_that_fails_for_want_of_descriptors_gives_back_every_descriptor_it_took(tmp_path):
    """A trainer out of descriptors tries to start its agent every LOCAL_RETRY_CAP seconds; with system metrics on,
    the start took a copy of stdout, then failed to make its pipe, and kept the copy: one descriptor fewer each time,
    so the trainer never got back the room to start it."""
    out = subprocess.run(
        [sys.executable, "-c", LAUNCH_WITH_ONE_DESCRIPTOR, str(tmp_path / "r"), str(tmp_path / "agent.log")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"result": errno.EMFILE, "left_open": 0}


def test_a_trainer_out_of_descriptors_says_why_its_agent_is_not_restarted_and_restarts_it_once_it_can(tmp_path):
    """The trainer's own RLIMIT_NOFILE taken down to what it holds (prlimit(2); a script that leaks descriptors), then
    its agent SIGKILLed: no new process can be started. The trainer says why, once, and tries again every
    LOCAL_RETRY_CAP seconds. A failed start is no new death of the agent: it used to be counted as one, so the
    restart count grew, the waits grew towards the budget's 47 s, and the report blamed the old exit code."""
    run_dir, stderr = tmp_path / "r", tmp_path / "trainer-stderr.txt"
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with talking_trainer(RESPAWN_TRAINER, [str(run_dir)], stderr) as trainer:
        assert trainer.stdout is not None and trainer.stdin is not None
        agent_pid = int(trainer.stdout.readline())
        resource.prlimit(trainer.pid, resource.RLIMIT_NOFILE, (len(os.listdir(f"/proc/{trainer.pid}/fd")), hard))
        os.kill(agent_pid, 9)
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        said = "rllog: the delivery agent could not be restarted: [Errno 24] Too many open files"
        assert wait_until(lambda: said in stderr.read_text(), timeout=60), stderr.read_text()
        assert "trying again every 2s" in stderr.read_text()
        assert wait_until(lambda: False, timeout=3 * LOCAL_RETRY_CAP) is False  # a few more tries, each failing
        resource.prlimit(trainer.pid, resource.RLIMIT_NOFILE, (hard, hard))
        out, _ = trainer.communicate("finish\n", timeout=180)
    result = json.loads(out.strip().splitlines()[-1])
    cause = result.pop("cause")
    assert result == {"ok": True, "delivered": 200, "restarts": 1}, stderr.read_text()
    assert stderr.read_text().count("could not be restarted") == 1
    assert "rllog: the delivery agent has been restarted; delivery goes on" in stderr.read_text()
    assert cause.startswith("the delivery agent died (exit code -9"), cause  # not the failed start, which is over
    assert parquet_backend.read_metrics(run_dir).column("step").to_pylist() == list(range(200))
