"""Delivery: isolation between sinks, retries, cursors and locks, the agent process, finish reports, replay."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
from sinks import BlockingSink, CrashingSink, FlakySink, MemorySink, thread_wakeups, wait_until

import rllog
from rllog.cli import main as cli_main
from rllog.delivery import (
    LIVE_POLL_MAX,
    CursorStore,
    FlushWatcher,
    Follower,
    RetryPolicy,
    request_flush,
    wake_watcher,
)
from rllog.errors import RateLimited, SinkBusy, TransientError
from rllog.settings import RETRY_AFTER_CAP_SECONDS
from rllog.sink_errors import parse_retry_after
from rllog_backends import parquet as parquet_backend  # what the parquet sink stored (rllog.read_* may read the journal)

FAST = RetryPolicy(base=0.01, cap=0.05, give_up_after=30)


def test_blocked_sink_delays_neither_log_calls_nor_other_sinks(tmp_path):
    blocked, healthy = BlockingSink("blocked"), MemorySink("healthy")
    run = rllog.init(report_to=[blocked, healthy], run_dir=tmp_path / "r", flush_interval=0.05)
    for i in range(1000):
        run.log({"i": float(i)})
    # all 1000 calls returned while the blocked sink has not accepted a single record
    assert blocked.metrics == []
    assert healthy.wait_for(1000)
    assert healthy.seqs == list(range(1, 1001))
    assert blocked.entered.wait(30) and blocked.metrics == []  # it is stuck inside its first write
    blocked.release.set()
    report = run.finish(timeout=60)
    assert report.ok
    assert blocked.seqs == list(range(1, 1001))


def test_transient_failures_are_retried_and_every_record_arrives_once(tmp_path):
    flaky = FlakySink([TransientError("503"), RateLimited(0.01)], name="flaky")
    run = rllog.init(report_to=[flaky], run_dir=tmp_path / "r", flush_interval=0.05, retry=FAST)
    for i in range(300):
        run.log({"i": float(i)})
    assert run.finish(timeout=60).ok
    assert flaky.attempts >= 3
    assert flaky.seqs == list(range(1, 301))  # exactly once each, in order


def test_crashing_sink_is_reported_failed_and_others_go_on(tmp_path):
    crash, healthy = CrashingSink("crash"), MemorySink("healthy")
    run = rllog.init(report_to=[crash, healthy], run_dir=tmp_path / "r", flush_interval=0.05)
    for i in range(50):
        run.log({"i": float(i)})
    report = run.finish(timeout=30)
    assert report["healthy"].state == "delivered" and report["healthy"].delivered == 50
    assert report["crash"].state == "failed" and report["crash"].pending == 50
    assert "tracker exploded" in report["crash"].error
    assert healthy.seqs == list(range(1, 51))


def test_hung_sink_is_abandoned_at_the_deadline_and_reported_pending(tmp_path):
    hung, healthy = BlockingSink("hung"), MemorySink("healthy")
    run = rllog.init(report_to=[hung, healthy], run_dir=tmp_path / "r", flush_interval=0.05)
    for i in range(20):
        run.log({"i": float(i)})
    report = run.finish(timeout=2)
    assert report["healthy"].state == "delivered"
    assert report["hung"].state == "pending" and report["hung"].pending == 20 and report["hung"].delivered == 0
    assert not report.ok
    hung.release.set()


def test_retry_policy_schedule_with_injected_random():
    draws = iter([1.0 - 1e-12, 0.5, 0.0, 1.0 - 1e-12, 1.0 - 1e-12])
    policy = RetryPolicy(base=0.5, cap=4.0, random=lambda: next(draws))
    err = TransientError("x")
    delays = [policy.delay(a, err) for a in range(5)]
    assert delays[0] == pytest.approx(0.5) and delays[1] == pytest.approx(0.5) and delays[2] == 0.0
    assert delays[3] == pytest.approx(4.0) and delays[4] == pytest.approx(4.0)  # capped (0.5 * 2**4 = 8 > 4)
    assert policy.delay(7, RateLimited(12.5)) == 12.5  # Retry-After wins
    # ... up to an hour: a date in the year 9999 (or inf) would overflow the timer the follower waits on
    assert policy.delay(0, RateLimited(2.5e11)) == policy.delay(0, RateLimited(float("inf"))) == RETRY_AFTER_CAP_SECONDS == 3600
    assert policy.delay(0, RateLimited(-3.0)) == 0.0
    draws = iter([1.0 - 1e-12, 1.0 - 1e-12])  # no number (NaN, a word a third-party sink passed on): the backoff
    assert policy.delay(1, RateLimited(float("nan"))) == pytest.approx(1.0)
    assert policy.delay(1, RateLimited("soon")) == pytest.approx(1.0)  # type: ignore[arg-type]
    assert parse_retry_after("120") == 120.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == pytest.approx(10.0)
    assert parse_retry_after("garbage") is None and parse_retry_after(None) is None


def test_give_up_deadline_leaves_records_pending(tmp_path):
    class DownSink(MemorySink):
        def write_metrics(self, records):
            raise TransientError("connection refused")

    run = rllog.init(
        report_to=[DownSink("down")],
        run_dir=tmp_path / "r",
        flush_interval=0.05,
        retry=RetryPolicy(base=0.01, cap=0.02, give_up_after=0.3),
    )
    for i in range(10):
        run.log({"i": float(i)})
    report = run.finish(timeout=30)
    assert report["down"].state == "failed" and report["down"].pending == 10
    assert "connection refused" in report["down"].error
    saved = json.loads((tmp_path / "r" / "delivery" / "down.json").read_text())
    assert saved["state"] == "gave_up" and saved["seq"] == 0


def test_cursor_lock_keeps_a_second_deliverer_out(tmp_path):
    first, second = CursorStore(tmp_path, "wandb"), CursorStore(tmp_path, "wandb")
    first.acquire()
    with pytest.raises(SinkBusy):
        second.acquire()
    first.release()
    second.acquire()
    second.release()


def test_agent_process_delivers_and_finish_reports(tmp_path):
    run = rllog.init(report_to="parquet", run_dir=tmp_path / "r", flush_interval=0.1)
    assert run._agent is not None and run._agent.poll() is None  # a separate process
    for i in range(200):
        run.log({"i": float(i)}, step=i)
    report = run.finish(timeout=60)
    assert report.ok and report["parquet"].delivered == 200
    assert run._agent.returncode == 0
    assert parquet_backend.read_metrics(tmp_path / "r").column("value").to_pylist() == [float(i) for i in range(200)]


def test_parquet_data_is_visible_during_the_run(tmp_path):
    run = rllog.init(run_dir=tmp_path / "r", flush_interval=0.1)
    run.log({"reward": 0.5}, step=1)
    assert wait_until(lambda: parquet_backend.read_metrics(tmp_path / "r").num_rows == 1, timeout=30)
    run.log({"reward": 0.6}, step=2)
    assert wait_until(lambda: parquet_backend.read_metrics(tmp_path / "r").num_rows == 2, timeout=30)
    run.finish()


def test_sinks_flush_every_flush_interval_or_when_run_flush_asks_not_at_every_catch_up(tmp_path):
    """A flush of MLflow or trackio is a database transaction: the agent no longer flushes each time it catches
    up with the journal (once a step in a live run), only every ``flush_interval`` and when ``Run.flush`` asks."""
    run = rllog.init(report_to="parquet", run_dir=tmp_path / "r", flush_interval=3600)
    cursor = CursorStore(tmp_path / "r", "parquet")
    for step in range(5):
        run.log({"reward": step / 4}, step=step)
    run._writer.wake()
    assert wait_until(lambda: cursor.load().state == "running", timeout=30)  # the agent's follower started
    threading.Event().wait(1.0)  # the agent has read the five records by now (it polls every 0.5 s)
    assert cursor.load().seq == 0 and parquet_backend.read_metrics(tmp_path / "r").num_rows == 0  # written, not yet flushed
    report = run.flush(timeout=30)  # would wait an hour for the next timed flush without the request
    assert report.ok and cursor.load().seq == 5
    assert parquet_backend.read_metrics(tmp_path / "r").column("value").to_pylist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    run.log({"reward": 2.0}, step=5)
    assert run.flush(timeout=30).ok and cursor.load().seq == 6
    run.log({"reward": 3.0}, step=6)
    run.request_flush()  # asked without waiting: flushed as soon as the follower holds the record
    assert wait_until(lambda: cursor.load().seq == 7, timeout=30)
    assert parquet_backend.read_metrics(tmp_path / "r").column("value").to_pylist()[-1] == 3.0
    assert run.finish().ok


@pytest.fixture
def flush_watch(tmp_path):
    """The agent's half of a flush: ``watch(followers)`` starts a FlushWatcher on a pipe (the agent's stdin) and
    returns the trainer's half, ``ask(seq, soon=False)``: the request written, then a wake-up down the pipe."""
    pipes: list[tuple[int, int, FlushWatcher]] = []

    def watch(followers, **kwargs):
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        watcher = FlushWatcher(tmp_path / "r", followers, wakeups=read_end, **kwargs).start()
        pipes.append((read_end, write_end, watcher))

        def ask(seq: int, soon: bool = False) -> None:
            request_flush(tmp_path / "r", seq, soon=soon, wake=lambda: wake_watcher(write_end))

        def trainer_gone() -> None:  # its write end closed, as at the trainer's exit
            os.close(write_end)
            closed.add(write_end)

        ask.wake = lambda: wake_watcher(write_end)  # type: ignore[attr-defined]
        ask.watcher = watcher  # type: ignore[attr-defined]
        ask.trainer_gone = trainer_gone  # type: ignore[attr-defined]
        return ask

    closed: set[int] = set()
    yield watch
    for read_end, write_end, watcher in pipes:
        if write_end not in closed:
            os.close(write_end)
        # Once it has seen the end the watcher never touches its read end again.
        if wait_until(lambda watcher=watcher: watcher.wakeups is None, timeout=30):
            os.close(read_end)


def test_a_live_follower_takes_what_came_while_it_waited_in_one_call_and_a_flush_request_wakes_it(tmp_path, flush_watch):
    """Between reads a live follower waits (half the flush interval); a flush request, written by a trainer
    in another process, wakes it through the agent's FlushWatcher. Here the wait is an hour: only the wake
    can make the follower read, and it then takes the thirty steps in one call."""
    run = rllog.init(report_to="parquet", run_dir=tmp_path / "r", flush_interval=3600, delivery="thread")
    assert run._followers[0].poll_interval == LIVE_POLL_MAX  # half the flush interval, at most 0.5 s
    sink = MemorySink("watched")
    follower = Follower("watched", sink, run.info, follow=True, flush_interval=3600, poll_interval=3600)
    waited_since = follower.caught_up_at
    follower.start()
    ask = flush_watch([follower])
    assert wait_until(lambda: follower.caught_up_at > waited_since, timeout=30)  # read the empty journal, now waits
    for step in range(30):
        run.log({"reward": step / 10}, step=step)
    run._writer.wake()
    assert wait_until(lambda: run._writer.written_seq == 30, timeout=30)
    ask(30)  # what Run.flush in the trainer's process does
    assert sink.wait_for(30) and sink.seqs == list(range(1, 31))
    assert sink.metric_calls == 1  # thirty steps, one call
    assert wait_until(lambda: sink.flushes == 1 and CursorStore(tmp_path / "r", "watched").load().seq == 30, timeout=30)
    assert run.finish(timeout=60).ok  # its end marker is a flush request too: the follower closes without waiting
    ask.wake()  # the wake-up Run.finish sends an agent after that request
    assert follower.join(30) and sink.closed_with == "finished"


def test_a_flush_asked_before_its_records_are_in_the_journal_is_made_once_they_land(tmp_path, monkeypatch, flush_watch):
    """``Run.request_flush`` writes the request before the journal writer writes the records it names (the end of
    ``train()`` asks so, and returns). A follower woken by it that read the journal before they landed waited its
    whole ``poll_interval`` (0.5 s live; here an hour) before it looked again: it now looks every ``POLL_INTERVAL``
    for a while (``ASKED_RECORDS_PATIENCE``, lengthened here: the records land when this test's thread runs)."""
    monkeypatch.setattr(rllog.delivery.flush, "ASKED_RECORDS_PATIENCE", 60.0)
    run = rllog.init(report_to="parquet", run_dir=tmp_path / "r", flush_interval=3600, delivery="thread", health=False)
    sink = MemorySink("watched")
    follower = Follower("watched", sink, run.info, follow=True, flush_interval=3600, poll_interval=3600)
    waited_since = follower.caught_up_at
    follower.start()
    ask = flush_watch([follower])
    assert wait_until(lambda: follower.caught_up_at > waited_since, timeout=30)
    read_before = follower.caught_up_at
    ask(30)  # the request first...
    assert wait_until(lambda: follower.caught_up_at > read_before, timeout=30)  # woken, read nothing new
    for step in range(30):  # ...then the records
        run.log({"reward": step / 10}, step=step)
    run._writer.wake()
    assert wait_until(lambda: sink.flushes == 1, timeout=10) and sink.seqs == list(range(1, 31))
    assert wait_until(lambda: CursorStore(tmp_path / "r", "watched").load().seq == 30, timeout=10)
    assert run.finish(timeout=60).ok
    ask.wake()  # the wake-up Run.finish sends an agent after its request
    assert follower.join(30) and sink.closed_with == "finished"


def test_a_flush_request_left_by_a_killed_attempt_for_records_never_journaled_does_not_stall_the_resumed_run(
    tmp_path, test_backends
):
    """A trainer killed between writing a flush request and journaling the records it names leaves a request for a
    seq the journal never got; the resumed run numbers its records below it. The followers read the latest request,
    not the highest seq ever asked for: taking the highest, they ignored the resumed run's own requests until its
    records passed that seq, and its ``flush`` waited for the periodic one (here 60 s: reported pending)."""
    from rllog_test_backends import read_jsonl

    run_dir = tmp_path / "r"
    # A sink whose every call lands in its file at once (the follower's writes are visible) and whose cursor moves
    # only after a flush (so the run's flush needs the follower to take its request).
    options = {"report_to": "jsonl", "backend_options": {"jsonl": {"mode": "scripted"}}, "health": False}
    run = rllog.init(run_dir=run_dir, **options)
    run.log({"x": 1.0}, step=0)
    assert run.finish().ok
    request_flush(run_dir, 10_000, soon=False)  # the killed attempt's request; it journaled up to seq ~2
    run = rllog.init(run_dir=run_dir, resume="must", flush_interval=60.0, **options)
    run.log({"x": 2.0}, step=1)
    # The follower delivered x=2.0; right after a write it reads the request left behind (before x=3.0's replaces it).
    assert wait_until(lambda: [r["values"]["x"] for r in read_jsonl(run_dir / "jsonl.jsonl")[0]] == [1.0, 2.0], timeout=60)
    run.log({"x": 3.0}, step=2)
    report = run.flush(timeout=10)
    assert report.ok, report
    assert [r["values"]["x"] for r in read_jsonl(run_dir / "jsonl.jsonl")[0]] == [1.0, 2.0, 3.0]
    assert run.finish().ok


def test_a_flush_request_is_written_in_place_and_a_reader_racing_it_sees_each_one_whole_or_not_at_all(tmp_path):
    """The request is written over the previous one (no file created, renamed and deleted per request: that cost
    the training thread 0.2-0.4 ms a call in the last second of ``train()``). A reader racing the writer sees a
    request whole or not yet (its checksum), never a seq nobody asked for; the same request written twice is
    news twice (the nonce)."""
    from rllog.delivery import FLUSH_REQUEST, FlushRequest, read_flush_request

    (tmp_path / "r" / "delivery").mkdir(parents=True)
    path = tmp_path / "r" / "delivery" / FLUSH_REQUEST
    request_flush(tmp_path / "r", 99, soon=True)
    inode = path.stat().st_ino
    request = FlushRequest(tmp_path / "r")
    assert request.replaced() and (request.seq, request.waited_seq) == (99, 0)
    assert not request.replaced()  # nothing new
    request_flush(tmp_path / "r", 99, soon=True)
    assert request.replaced()  # asked again: news again
    request_flush(tmp_path / "r", 120)
    assert request.replaced() and (request.seq, request.waited_seq) == (120, 120)
    assert path.stat().st_ino == inode and sorted(p.name for p in path.parent.iterdir()) == [FLUSH_REQUEST]

    # seqs whose digits change from the left, so a torn read would make a seq nobody asked for (e.g. 1999 + 2000)
    asked = [n * 1000 - 1 + k for n in range(1, 400) for k in (0, 1)]
    done = threading.Event()
    seen: list[int] = []

    def reader() -> None:
        while not done.is_set():
            found = read_flush_request(tmp_path / "r")
            if found is not None:
                seen.append(found[1])

    thread = threading.Thread(target=reader)
    thread.start()
    for seq in asked:
        request_flush(tmp_path / "r", seq, soon=seq % 2 == 0)
    done.set()
    thread.join()
    assert seen and set(seen) <= set(asked) | {120}
    assert seen == sorted(seen)  # never an older request after a newer one


def test_a_flush_request_nobody_waits_for_is_put_off_until_the_gap_has_passed_and_a_waited_one_is_not(
    tmp_path, monkeypatch, flush_watch
):
    """The last second of ``train()`` asks for a flush at every step (``Run.request_flush``) without waiting. One
    flush per step made the trackers' fixed cost per transaction the agent's largest cost there (MLflow: 20 ms of
    CPU per one-step flush), so it fell behind just before the flush that ends ``train()``. Such requests are now
    honoured at most every ``ASKED_FLUSH_MIN_GAP``; the follower still reads at once, flushes what it put off once
    the gap has passed (without another wake: its poll is an hour away), and a request the trainer waits for
    (``Run.flush``) is honoured at once."""
    import rllog.delivery

    monkeypatch.setattr(rllog.delivery.flush, "ASKED_FLUSH_MIN_GAP", 3600.0)
    run = rllog.init(report_to="parquet", run_dir=tmp_path / "r", flush_interval=3600, delivery="thread")
    sink = MemorySink("watched")
    follower = Follower("watched", sink, run.info, follow=True, flush_interval=3600, poll_interval=3600)
    cursor = CursorStore(tmp_path / "r", "watched")
    follower.start()
    ask = flush_watch([follower])

    def log_and_ask(step: int, soon: bool) -> None:
        run.log({"reward": float(step)}, step=step)
        run._writer.wake()
        assert wait_until(lambda: run._writer.written_seq == step + 1, timeout=30)
        ask(step + 1, soon=soon)
        assert sink.wait_for(step + 1)  # woken and read at once, whatever the flush

    for step in range(6):
        log_and_ask(step, soon=True)
    threading.Event().wait(0.5)
    assert sink.flushes == 0 and cursor.load().seq == 0  # the gap (an hour here) since the follower started: put off
    log_and_ask(6, soon=False)  # what Run.flush writes: the trainer waits
    assert wait_until(lambda: cursor.load().seq == 7, timeout=30) and sink.flushes == 1
    monkeypatch.setattr(rllog.delivery.flush, "ASKED_FLUSH_MIN_GAP", 1.0)
    log_and_ask(7, soon=True)  # within a second of the last flush: put off, then flushed when the second is up
    assert wait_until(lambda: cursor.load().seq == 8, timeout=30) and sink.flushes == 2
    assert sink.seqs == list(range(1, 9))
    assert run.finish(timeout=60).ok
    ask.wake()  # the wake-up Run.finish sends an agent after its request
    assert follower.join(30) and sink.closed_with == "finished"


class _CountsWakes:
    """A follower as the FlushWatcher sees it: alive until ``done``, counting its wakes."""

    def __init__(self) -> None:
        self.wakes = 0
        self.done = threading.Event()
        self.thread: threading.Thread | None = threading.Thread(target=self.done.wait, daemon=True)
        self.thread.start()

    def wake(self) -> None:
        self.wakes += 1


def test_the_agents_flush_watcher_sleeps_until_the_trainer_sends_a_wake_up_and_wakes_the_followers_once_a_request(
    flush_watch,
):
    """The watcher read the request file every 10 ms, ~15 ms of the agent's CPU per second of the run on cores that
    training needs. It now sleeps on the agent's stdin: it looks once per wake-up the trainer sends after writing a
    request, never in between (its look for a gone trainer is an hour away here), and wakes the followers only for
    a request it has not seen; the pipe's end (the trainer exited) wakes them too."""
    follower = _CountsWakes()
    ask = flush_watch([follower], idle_check=3600.0)
    watcher = ask.watcher
    for asked in range(1, 4):
        ask(asked * 10)
        assert wait_until(lambda asked=asked: follower.wakes == asked, timeout=30)
    threading.Event().wait(0.3)  # a watcher that polls looks here, ~30 times at 10 ms
    assert (watcher.looks, follower.wakes) == (3, 3)
    ask.wake()  # a wake-up for a request already seen
    assert wait_until(lambda: watcher.looks == 4, timeout=30) and follower.wakes == 3
    ask.trainer_gone()
    assert wait_until(lambda: follower.wakes == 4, timeout=30) and watcher.wakeups is None
    follower.done.set()


def test_a_flush_asked_while_the_agent_is_frozen_does_not_block_the_trainer_and_is_made_once_it_runs(tmp_path):
    """The trainer wakes the agent with a byte down its stdin; an agent stopped by SIGSTOP reads none, and once its
    pipe is full a blocking write would hang the training thread in ``request_flush``. The pipe is non-blocking:
    the wake-ups beyond its capacity are dropped (those in it wake the agent), and the flush is made once it runs."""
    import fcntl

    run = rllog.init(report_to="parquet", run_dir=tmp_path / "r", health=False)
    run.log({"x": 1.0}, step=0)
    assert run.flush(timeout=60).ok
    agent = run._agent
    capacity = fcntl.fcntl(agent._wakeups.fileno(), fcntl.F_GETPIPE_SZ)
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        asked = threading.Thread(target=lambda: [agent.wake_flush_watcher() for _ in range(capacity + 100)], daemon=True)
        asked.start()
        asked.join(60)
        assert not asked.is_alive()  # every wake-up returned, the pipe full
        run.log({"x": 2.0}, step=1)
        run.request_flush(at_once=True)
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    assert run.flush(timeout=60).ok
    assert parquet_backend.read_metrics(tmp_path / "r").column("value").to_pylist() == [1.0, 2.0]
    assert run.finish(timeout=60).ok


TRAINER = r"""
import sys, time, rllog
run = rllog.init(report_to="parquet", run_dir=sys.argv[1], flush_interval=0.1)
for i in range(200):
    run.log({"i": float(i)}, step=i)
run.log_table("completions", {"prompt": ["p"], "completion": ["c"]})
time.sleep(0.5)  # the kill comes more than flush_interval after the last log (the guarantee's condition)
print("logged", flush=True)
time.sleep(600)  # alive until the test kills it
"""


def test_trainer_killed_with_sigkill_still_has_its_records_delivered(tmp_path):
    run_dir = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "logged"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    meta = run_dir / "parquet" / "meta.json"
    assert wait_until(lambda: meta.exists() and json.loads(meta.read_text())["status"] == "killed", timeout=60)
    assert parquet_backend.read_metrics(run_dir).column("value").to_pylist() == [float(i) for i in range(200)]
    assert parquet_backend.read_table(run_dir, "completions").column("_step").to_pylist() == [199]


def test_replay_delivers_to_a_new_backend_and_twice_delivers_nothing_twice(tmp_path, capsys):
    run = rllog.init(report_to="none", run_dir=tmp_path / "r")
    for i in range(30):
        run.log({"i": float(i)})
    run.log_table("completions", {"a": [1, 2]})
    run.finish()
    assert not (tmp_path / "r" / "parquet").exists()
    assert cli_main(["replay", str(tmp_path / "r"), "--to", "parquet"]) == 0
    assert "delivered 31 new records" in capsys.readouterr().out
    assert parquet_backend.read_metrics(tmp_path / "r").num_rows == 30
    assert cli_main(["replay", str(tmp_path / "r"), "--to", "parquet"]) == 0
    assert "delivered 0 new records" in capsys.readouterr().out
    assert parquet_backend.read_metrics(tmp_path / "r").num_rows == 30
    assert parquet_backend.read_table(tmp_path / "r", "completions").num_rows == 2
    assert json.loads((tmp_path / "r" / "parquet" / "meta.json").read_text())["status"] == "finished"


def test_log_does_no_disk_write_and_no_sink_call_on_the_caller_thread(tmp_path, monkeypatch):
    import threading

    real_write = os.write
    writers = []

    def spy_write(fd, data):
        writers.append(threading.current_thread().name)
        return real_write(fd, data)

    caller = threading.current_thread().name
    sink = MemorySink("spy")
    calls = []
    original = sink.write_metrics
    sink.write_metrics = lambda records: (calls.append(threading.current_thread().name), original(records))
    run = rllog.init(report_to=[sink], run_dir=tmp_path / "r", flush_interval=0.05)
    monkeypatch.setattr(os, "write", spy_write)
    for i in range(500):
        run.log({"i": float(i)})
        run.log_table("t", {"a": [i]})
    assert wait_until(lambda: run._writer.written_seq == run._seq, timeout=30)
    monkeypatch.undo()  # finish() writes its flush request on the caller's thread, which is not log()'s
    assert run.finish().ok
    assert writers and caller not in writers and set(writers) == {"rllog-journal"}
    assert calls and caller not in calls and set(calls) == {"rllog-follower-spy"}


def test_every_sink_sees_the_same_step_for_a_record(tmp_path):
    a, b = MemorySink("a"), MemorySink("b")
    run = rllog.init(report_to=[a, b, "parquet"], run_dir=tmp_path / "r", flush_interval=0.05)
    for step in [0, 1, 2, 7, 3, 3, 9]:
        run.log({"x": float(step)}, step=step)
    run.log({"x": 10.0})
    assert run.finish().ok
    expected = [(1, 0), (2, 1), (3, 2), (4, 7), (5, 3), (6, 3), (7, 9), (8, 10)]
    assert [(r.seq, r.step) for r in a.metrics] == [(r.seq, r.step) for r in b.metrics] == expected
    parquet = parquet_backend.read_metrics(tmp_path / "r")
    assert list(zip(parquet.column("seq").to_pylist(), parquet.column("step").to_pylist(), strict=True)) == expected


def test_batch_that_fails_midway_is_resumed_without_repeating_what_was_delivered(tmp_path):
    """Metrics of a batch go in one call, its tables after; a tracker that stays down for the table leaves the sink
    given up with the batch's metrics remembered as delivered, so a replay sends the table and nothing twice."""

    class TableDownSink(MemorySink):
        def write_table(self, record):
            raise TransientError("tables are down")

    picky = TableDownSink("picky")
    run = rllog.init(
        report_to=[picky], run_dir=tmp_path / "r", flush_interval=5.0, retry=RetryPolicy(base=0.01, cap=0.02, give_up_after=0.3)
    )
    run.log({"a": 1.0}, step=1)  # seq 1
    run.log_table("completions", {"x": [1]}, step=1)  # seq 2
    run.log({"a": 2.0}, step=2)  # seq 3
    report = run.finish(timeout=30)
    assert [r.seq for r in picky.metrics] == [1, 3]  # one batch: both metrics records in one call
    # the sink was flushed once before delivery stopped: the metrics it took are durable, the table is pending
    assert report["picky"].state == "failed" and (report["picky"].delivered, report["picky"].pending) == (2, 1)
    saved = json.loads((tmp_path / "r" / "delivery" / "picky.json").read_text())
    assert saved["seq"] == 1 and saved["ahead"] == [3] and saved["state"] == "gave_up"

    from rllog.delivery import Follower
    from rllog.run import load_run_info

    assert wait_until(lambda: not any(t.name == "rllog-follower-picky" for t in threading.enumerate()), timeout=30)
    healthy = MemorySink("picky")
    follower = Follower("picky", healthy, load_run_info(tmp_path / "r")[0], follow=False)
    follower.start().join(30)
    assert healthy.metrics == [] and [t.seq for t in healthy.tables] == [2]  # nothing sent twice
    saved = json.loads((tmp_path / "r" / "delivery" / "picky.json").read_text())
    assert saved["seq"] == 3 and saved["ahead"] == [] and saved["state"] == "closed"


def test_durable_sink_resumes_past_what_it_holds(tmp_path):
    """A sink whose writes are durable has its cursor moved right after each call: a replay after a failed table
    sends the table alone."""

    class DurableTableDown(MemorySink):
        capabilities = rllog.Capabilities(tables=True, durable_writes=True)

        def write_table(self, record):
            raise TransientError("tables are down")

    picky = DurableTableDown("picky")
    run = rllog.init(
        report_to=[picky], run_dir=tmp_path / "r", flush_interval=5.0, retry=RetryPolicy(base=0.01, cap=0.02, give_up_after=0.3)
    )
    run.log({"a": 1.0}, step=1)
    run.log_table("completions", {"x": [1]}, step=1)
    run.log({"a": 2.0}, step=2)
    report = run.finish(timeout=30)
    assert report["picky"].state == "failed" and report["picky"].delivered == 2 and report["picky"].pending == 1
    saved = json.loads((tmp_path / "r" / "delivery" / "picky.json").read_text())
    assert saved["seq"] == 1 and saved["ahead"] == [3]

    from rllog.delivery import Follower
    from rllog.run import load_run_info

    assert wait_until(lambda: not any(t.name == "rllog-follower-picky" for t in threading.enumerate()), timeout=30)
    healthy = MemorySink("picky")
    follower = Follower("picky", healthy, load_run_info(tmp_path / "r")[0], follow=False)
    follower.start().join(30)
    assert healthy.metrics == [] and [t.seq for t in healthy.tables] == [2]
    saved = json.loads((tmp_path / "r" / "delivery" / "picky.json").read_text())
    assert saved["seq"] == 3 and saved["ahead"] == [] and saved["state"] == "closed"


def test_a_record_the_sink_rejects_goes_to_its_dead_letters_and_delivery_goes_on(tmp_path):
    class PickySink(MemorySink):
        def write_table(self, record):
            if record.table.column("x").to_pylist() == [13]:
                raise ValueError("cannot store 13")
            super().write_table(record)

    picky = PickySink("picky")
    run = rllog.init(report_to=[picky, "parquet"], run_dir=tmp_path / "r", flush_interval=0.05)
    for i in range(20):
        run.log({"a": float(i)}, step=i)
        run.log_table("t", {"x": [i]}, step=i)
    report = run.finish(timeout=30)
    assert [t.table.column("x").to_pylist()[0] for t in picky.tables] == [i for i in range(20) if i != 13]
    assert [r.values["a"] for r in picky.metrics] == [float(i) for i in range(20)]
    sink = report["picky"]
    assert (sink.state, sink.delivered, sink.pending, sink.dead_letters) == ("delivered", 39, 0, 1)
    assert sink.dead_letter_list[0]["step"] == 13 and "cannot store 13" in sink.dead_letter_list[0]["error"]
    assert not report.ok and report["parquet"].delivered == 40
    assert "1 dead-lettered" in str(report)


def test_run_flush_verifies_only_what_was_logged_since_the_previous_flush(tmp_path, monkeypatch):
    """``Run.flush`` ends every ``train()`` and ``evaluate()``; its report used to verify the whole journal (a long
    run's flushes grew with the run). The counts stay exact: records logged before, between and after."""
    import zlib

    from rllog import journal

    sink = MemorySink("memory")
    run = rllog.init(report_to=[sink], run_dir=tmp_path / "r", flush_interval=0.05, health=False)
    for i in range(400):
        run.log({"i": float(i)}, step=i)
    first = run.flush(timeout=30)
    assert first["memory"].state == "delivered" and first["memory"].delivered == 400 and first.records == 400
    checked = []

    class CountingZlib:
        @staticmethod
        def crc32(data, value=0):
            checked.append(len(data))
            return zlib.crc32(data, value)

    monkeypatch.setattr(journal.format, "zlib", CountingZlib)  # the writer's frames
    monkeypatch.setattr(journal.reader, "zlib", CountingZlib)  # the readers' checks
    for i in range(400, 410):
        run.log({"i": float(i)}, step=i)
    second = run.flush(timeout=30)
    monkeypatch.undo()
    assert second.records == 410 and second["memory"].delivered == 410 and second["memory"].pending == 0
    # Checksums of the 10 new frames (two each, header and payload) by the writer, the in-process follower and the
    # flush: 80; re-verifying the whole journal of 410 frames made it 1,280.
    assert 0 < len(checked) <= 8 * 10
    report = run.finish(timeout=30)
    assert report.ok and report.records == 410 and sink.seqs == list(range(1, 411))


def test_in_process_followers_honour_a_flush_request_once_the_journal_holds_its_records(tmp_path, monkeypatch):
    """``delivery="thread"``: ``Run.request_flush`` used to wake the followers before the journal writer had written
    the records, so they read nothing and honoured the request only at their next poll. The writer now wakes them
    once it has. Here a poll is half an hour away: only that wake can deliver the records."""
    import rllog.delivery

    monkeypatch.setattr(rllog.delivery.flush, "LIVE_POLL_MAX", 3600.0)
    sink = MemorySink("memory")
    run = rllog.init(report_to=[sink], run_dir=tmp_path / "r", flush_interval=3600, delivery="thread", health=False)
    follower = run._followers[0]
    assert follower.poll_interval == 1800.0  # half the flush interval
    # The follower reads the empty journal as it starts, then waits. (Waiting for caught_up_at to move raced with
    # that first read when it came before the test looked.)
    threading.Event().wait(1.0)
    cursor = CursorStore(tmp_path / "r", "memory")
    for step in range(5):
        run.log({"reward": step / 4}, step=step)
        run.request_flush()
        assert wait_until(lambda step=step: cursor.load().seq == step + 1, timeout=20), cursor.load()
    assert sink.seqs == [1, 2, 3, 4, 5]
    assert run.finish(timeout=30).ok


class FailsAfterSink(MemorySink):
    """Takes the first ``good`` records (in flight, waiting for a flush), then raises ``error`` on every write."""

    def __init__(self, name: str, good: int, error: Exception):
        super().__init__(name)
        self.good, self.error = good, error

    def write_metrics(self, records):
        if len(self.metrics) + len(records) > self.good:
            raise self.error
        super().write_metrics(records)


@pytest.mark.parametrize(
    ("error", "finish_timeout", "state"),
    [
        (RuntimeError("tracker broke"), 30, "failed"),  # broken for good: the explorer's seed 96, 520 records twice
        (TransientError("tracker down"), 2, "pending"),  # stopped at the deadline while retrying: seed 20028, 80 twice
    ],
)
def test_a_sink_that_stops_taking_records_keeps_what_it_took_so_a_replay_sends_nothing_twice(
    tmp_path, error, finish_timeout, state
):
    # One call per record, no periodic flush: the 20 records the sink took are in flight when it stops taking
    # more. Left behind the cursor, a replay sent them again (a tracker that sends on write: twice).
    sink = FailsAfterSink("fails", good=20, error=error)
    run = rllog.init(report_to=[sink], run_dir=tmp_path / "r", flush_interval=3600, delivery="thread")
    for i in range(60):
        run.log({"i": float(i)})
        if i < 20:
            assert wait_until(lambda i=i: len(sink.metrics) == i + 1, 30)
    report = run.finish(timeout=finish_timeout)["fails"]
    assert report.state == state and (report.delivered, report.pending) == (20, 40)
    assert CursorStore(tmp_path / "r", "fails").load().seq == 20
    again = MemorySink("fails")
    follower = Follower("fails", again, rllog.rundir.load_run_info(tmp_path / "r")[0], follow=False).start()
    assert follower.join(30)
    assert again.seqs == list(range(21, 61))


def test_a_write_that_starts_failing_first_flushes_what_the_sink_holds(tmp_path):
    """The sink took 20 records (in flight: no periodic flush), then goes down. Before the follower waits to retry, it
    flushes once, so the cursor covers those 20 for the whole outage: an agent killed meanwhile (or stopped at the
    deadline inside a call that then hangs: the explorer's seed 73003) leaves nothing of them for a replay to send
    twice."""
    sink = FailsAfterSink("down", good=20, error=TransientError("tracker down"))
    run = rllog.init(
        report_to=[sink], run_dir=tmp_path / "r", flush_interval=3600, delivery="thread", retry=RetryPolicy(base=5, cap=5)
    )
    for i in range(40):
        run.log({"i": float(i)})
        if i < 20:
            assert wait_until(lambda i=i: len(sink.metrics) == i + 1, 30)
    assert wait_until(lambda: CursorStore(tmp_path / "r", "down").load().seq == 20, 30)
    assert sink.flushes == 1  # one flush, not retried with the write
    report = run.finish(timeout=1)["down"]
    assert (report.state, report.delivered, report.pending) == ("pending", 20, 20)


class RejectsSeq3ThenDown(MemorySink):
    """Rejects any batch holding seq 3 for good (a bad record), takes records 1 and 2, and is down from seq 4 on."""

    def write_metrics(self, records):
        if any(r.seq == 3 for r in records):
            raise ValueError("seq 3 is bad")
        if any(r.seq >= 4 for r in records):
            raise TransientError("tracker down")
        super().write_metrics(records)


def test_a_write_record_by_record_that_starts_failing_first_flushes_what_the_sink_holds_too(tmp_path):
    """A batch rejected for one bad record is written again record by record; when one of those writes starts
    failing, what the sink took before it is flushed first, as on the batch path above."""
    run_dir = tmp_path / "r"
    with rllog.init(report_to="none", run_dir=run_dir) as run:
        for i in range(6):
            run.log({"i": float(i)})
    sink = RejectsSeq3ThenDown("picky")
    info = rllog.rundir.load_run_info(run_dir)[0]
    follower = Follower("picky", sink, info, follow=False, flush_interval=3600, retry=RetryPolicy(base=0.05, cap=0.05))
    follower.start()
    try:
        assert wait_until(lambda: sink.flushes == 1, 10), "the record-by-record write waited with what the sink held"
        assert sink.seqs == [1, 2]
        assert wait_until(lambda: CursorStore(run_dir, "picky").load().seq == 2, 10)  # seq 3 stays a suspect
    finally:
        follower.stop()
        follower.join(30)
    assert sink.flushes == 1  # not again at the stop: nothing was taken since


class CloseFailsSink(MemorySink):
    """Buffers until flush; its close raises, and leaves it half closed: a flush then writes nothing."""

    def __init__(self, name: str):
        super().__init__(name)
        self.buffered, self.closed = [], False

    def write_metrics(self, records):
        self.buffered.extend(records)

    def flush(self):
        if not self.closed:
            self.metrics.extend(self.buffered)
            self.buffered = []

    def close(self, status):
        self.closed = True
        raise RuntimeError("close failed")


def test_a_sink_whose_close_failed_is_not_flushed_into_a_cursor_that_moves(tmp_path):
    run_dir = tmp_path / "r"
    with rllog.init(report_to="none", run_dir=run_dir) as run:
        for i in range(10):
            run.log({"i": float(i)})
    (run_dir / "delivery" / "flush-request").unlink(missing_ok=True)  # nothing asks for a flush before the close
    sink = CloseFailsSink("closing")
    follower = Follower("closing", sink, rllog.rundir.load_run_info(run_dir)[0], follow=False, flush_interval=3600)
    assert follower.start().join(30)
    saved = CursorStore(run_dir, "closing").load()
    assert sink.metrics == [] and len(sink.buffered) == 10  # taken, never written
    assert (saved.state, saved.seq) == ("failed", 0)  # so a replay sends all 10 again


class OnceDownThenRejectsOne(MemorySink):
    def __init__(self, name: str):
        super().__init__(name)
        self.calls = 0

    def write_metrics(self, records):
        self.calls += 1
        if self.calls == 1:
            raise TransientError("down for a moment")
        if any(r.seq == 5 for r in records):
            raise ValueError("seq 5 is bad")
        super().write_metrics(records)


def test_the_retry_note_is_cleared_when_retrying_ends_in_a_rejection(tmp_path):
    run_dir = tmp_path / "r"
    with rllog.init(report_to="none", run_dir=run_dir) as run:
        for i in range(10):
            run.log({"i": float(i)})
    sink = OnceDownThenRejectsOne("flaky")
    follower = Follower(
        "flaky", sink, rllog.rundir.load_run_info(run_dir)[0], follow=False, retry=RetryPolicy(base=0.01, cap=0.02)
    )
    assert follower.start().join(30)
    saved = CursorStore(run_dir, "flaky").load()
    assert sink.seqs == [1, 2, 3, 4, 6, 7, 8, 9, 10] and saved.dead_letter_count == 1
    assert (saved.state, saved.error) == ("closed", None)  # not "retrying since ..." on a sink that delivered


def test_an_idle_run_does_not_wake_the_trainer(tmp_path):
    """Each wake-up of one of rllog's threads in the trainer takes the GIL from the training thread, which then waits
    to take it back (on a GPU, where a step is mostly waiting, that was dozens of waits a step). Between logs, the
    journal writer sleeps with no timer and the agent's watcher looks once a second: the two woke ~75 times in
    these 3 s before (every 50 ms and every 200 ms)."""
    import time

    run = rllog.init(["parquet"], run_dir=tmp_path / "run", system_metrics=False, quiet=True)
    run.log({"x": 1.0}, step=1)
    assert run.flush(timeout=120).ok
    threads = {t.name: t.native_id for t in threading.enumerate() if t.name.startswith("rllog-")}
    assert {"rllog-journal", "rllog-agent-watch"} <= set(threads)
    time.sleep(0.5)
    before = {name: thread_wakeups(tid) for name, tid in threads.items()}
    time.sleep(3.0)
    woke = {name: thread_wakeups(tid) - before[name] for name, tid in threads.items()}
    assert woke["rllog-journal"] <= 2 and woke["rllog-agent-watch"] <= 5 and sum(woke.values()) <= 9, woke
    run.log({"x": 2.0}, step=2)  # and the run still delivers what comes after
    assert run.finish(timeout=120).ok
    assert parquet_backend.read_metrics(tmp_path / "run").column("value").to_pylist() == [1.0, 2.0]


def test_a_run_that_logs_steadily_wakes_the_journal_writer_a_few_times_a_second(tmp_path):
    """Each batch the writer hands to the OS wakes it twice (its first record, the end of the wait), and each wake-up
    takes the GIL from the training thread. Batching for 50 ms, a CPU training on every core was preempted ~350 times
    in 60 steps (~30 without rllog); the default batch is now a quarter of ``flush_interval``, 0.25 s. A step of
    10 ms logging 30 metrics, for 2 s: the writer woke ~80 times at 50 ms."""
    import time

    run = rllog.init(["parquet"], run_dir=tmp_path / "run", system_metrics=False, quiet=True)
    run.log({"x": -1.0}, step=0)
    assert run.flush(timeout=120).ok
    writer = next(t.native_id for t in threading.enumerate() if t.name == "rllog-journal")
    before = thread_wakeups(writer)
    for step in range(1, 201):
        run.log({f"m{i}": step + i / 100 for i in range(30)}, step=step)
        time.sleep(0.01)
    woke = thread_wakeups(writer) - before
    assert woke <= 30, woke
    assert run.finish(timeout=120).ok
    metrics = parquet_backend.read_metrics(tmp_path / "run")
    assert metrics.num_rows == 1 + 200 * 30
    assert max(metrics.column("step").to_pylist()) == 200


def _stderr_said(capfd, seen: list[str], text: str) -> bool:
    """Whether ``text`` was written to this process's stderr (``seen`` keeps what was read so far)."""
    seen.append(capfd.readouterr().err)
    return text in "".join(seen)


def _watcher_looked_twice(run) -> bool:
    """With the agent, the trainer's watcher says what it reads off a cursor: wait for two of its looks (counts)."""
    if run._agent is None:
        return True
    looks = run._agent.cursor_checks
    return wait_until(lambda: run._agent.cursor_checks >= looks + 2, timeout=30)


@pytest.mark.parametrize("delivery", ["process", "thread"])
def test_a_failing_tracker_is_said_on_the_trainers_stderr_when_it_fails_not_at_finish(tmp_path, test_backends, capfd, delivery):
    """A sink raising on every write was marked failed in agent.log only (the trainer's watcher read the cursors
    every 5 s; in-process followers said nothing): a 4 s run's stderr said nothing before finish. Now the line comes
    as the sink fails, once, with the cause and what happens to its records."""
    run = rllog.init(report_to=["parquet", "crashes"], run_dir=tmp_path / "r", delivery=delivery, health=False)
    for step in range(12):  # more records in a row than MAX_SUSPECTS: the sink is broken, not a record
        run.log({"loss": float(step)}, step=step)
    cursor = CursorStore(tmp_path / "r", "crashes")
    assert wait_until(lambda: cursor.load().state == "failed", timeout=60)
    assert _watcher_looked_twice(run)
    seen: list[str] = []
    assert _stderr_said(capfd, seen, "rllog: delivery to 'crashes' failed (")  # before finish is called
    assert "RuntimeError: crashes crashed on purpose" in seen[0] and f"rllog replay {tmp_path / 'r'} --to crashes" in seen[0]
    report = run.finish(timeout=60)
    _stderr_said(capfd, seen, "")
    assert "".join(seen).count("delivery to 'crashes' failed") == 1
    assert report["crashes"].state == "failed" and report["parquet"].state == "delivered"


@pytest.mark.parametrize("delivery", ["process", "thread"])
def test_a_tracker_that_starts_dead_lettering_says_so_once_on_the_trainers_stderr(tmp_path, test_backends, capfd, delivery):
    """The first record a sink rejects for good is said when it is dead-lettered (not only counted in the report at
    finish); later ones are counted, not said again. JsonlSink cannot write a date cell as JSON."""
    import datetime

    run = rllog.init(report_to="jsonl", run_dir=tmp_path / "r", delivery=delivery, health=False)
    cursor = CursorStore(tmp_path / "r", "jsonl")
    step = 0

    def dead_letters_after_a_good_record(count: int) -> bool:
        nonlocal step
        step += 1
        run.log({"loss": float(step)}, step=step)  # a record the sink takes: the rejected table was the problem
        return cursor.load().dead_letter_count == count

    run.log_table("bad", {"id": [datetime.date(2020, 1, 1)]}, step=0)
    assert wait_until(lambda: dead_letters_after_a_good_record(1), timeout=60)
    assert _watcher_looked_twice(run)
    seen: list[str] = []
    assert _stderr_said(capfd, seen, "rllog: 'jsonl' rejected record seq 1 (step 0) for good (TypeError:")
    assert "dead-letter list" in seen[0] and "delivery to it goes on" in seen[0]
    run.log_table("bad", {"id": [datetime.date(2020, 1, 2)]}, step=step)
    assert wait_until(lambda: dead_letters_after_a_good_record(2), timeout=60)
    report = run.finish(timeout=60)
    _stderr_said(capfd, seen, "")
    assert "".join(seen).count("rejected record") == 1
    assert report["jsonl"].dead_letters == 2 and report["jsonl"].state == "delivered"


def test_a_write_that_fails_halfway_is_repeated_with_only_what_the_sink_had_not_taken(tmp_path):
    """The re-send rule is the delivery layer's (four backends tracked seqs themselves): a sink storing a batch record
    by record says how far it got (rllog.sink.took); after a transient failure halfway the call is repeated with the
    rest only, and after a permanent one the records are tried one by one without those it took. No record twice."""
    from rllog.sink import took

    class RecordByRecord(MemorySink):
        down_once = True

        def write_metrics(self, records):
            for record in records:
                if record.step == 3 and self.down_once:
                    self.down_once = False
                    raise TransientError("down for a moment")
                if record.step == 6:
                    raise ValueError("step 6 cannot be stored")
                super().write_metrics([record])
                took(records, record.seq)

    sink = RecordByRecord("bybatch")
    run = rllog.init(report_to=[sink], run_dir=tmp_path / "r", flush_interval=3600, retry=FAST, health=False)
    for step in range(1, 9):  # however the follower's reads cut them into batches
        run.log({"x": float(step)}, step=step)
    report = run.finish(timeout=60)
    assert [r.step for r in sink.metrics] == [1, 2, 3, 4, 5, 7, 8]  # each once, in order
    assert report["bybatch"].dead_letters == 1 and report["bybatch"].delivered == 7 and not sink.down_once
