"""The agent waits for a CPU-bound trainer (``RLLOG_AGENT_FREE_CPUS``), with the delivery lag still bounded.

``SCHED_IDLE`` alone let the agent take a core from a training that used every core (docs/benchmarks.md, section
8): these tests load the CPUs for real, with threads that hash large buffers (hashlib releases the GIL), and check
what the agent does about it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time

import rllog
from rllog.agent.placement import TrainerLoad, cpu_demand_seconds
from rllog.delivery.cursor import CursorStore
from rllog_backends.parquet import read_metrics

CPUS = len(os.sched_getaffinity(0))
BUSY = """
import hashlib, os, threading, time
data = b"x" * 50_000_000
def spin():
    while True:
        hashlib.sha256(data).digest()
for _ in range(len(os.sched_getaffinity(0))):
    threading.Thread(target=spin, daemon=True).start()
print("busy", flush=True)
time.sleep(600)
"""


def busy_process() -> subprocess.Popen:
    """A process whose threads keep every CPU it may use busy (a CPU-bound training on every core)."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "busy"
    return proc


def held_after(load: TrainerLoad, seconds: float) -> bool:
    """Whether the agent's work would still be waiting ``seconds`` from now."""
    gone = threading.Event()
    waiter = threading.Thread(target=lambda: (load.wait(threading.Event()), gone.set()), daemon=True)
    waiter.start()
    return not gone.wait(seconds)


def test_the_demand_of_a_busy_process_counts_every_thread_running_or_waiting():
    proc = busy_process()
    try:
        first = cpu_demand_seconds(proc.pid)
        time.sleep(1.0)
        demand = (cpu_demand_seconds(proc.pid) or 0.0) - (first or 0.0)
        assert demand > 0.8 * CPUS, demand  # every CPU wanted, whether it ran or waited for one
    finally:
        proc.kill()
        proc.wait()
    assert cpu_demand_seconds(proc.pid) is None  # gone


def test_a_standby_waits_for_a_busy_trainer_at_most_lag_max_and_not_for_an_idle_one():
    proc = busy_process()
    try:
        load = TrainerLoad(proc.pid, free_cpus=1.0, lag_max=4.0).start()
        time.sleep(1.0)  # the first window
        started = time.monotonic()
        assert held_after(load, 1.0)  # every CPU busy: the work waits
        load.wait(threading.Event())  # ... but not past lag_max
        assert time.monotonic() - started < 6.0
        load.stop()
    finally:
        proc.kill()
        proc.wait()
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        load = TrainerLoad(idle.pid, free_cpus=1.0, lag_max=60.0).start()
        time.sleep(1.0)
        assert not held_after(load, 1.0)  # the trainer leaves every CPU free
        load.stop()
    finally:
        idle.kill()
        idle.wait()


def test_a_trainer_that_ends_releases_the_wait_at_once():
    proc = busy_process()
    load = TrainerLoad(proc.pid, free_cpus=1.0, lag_max=60.0).start()
    time.sleep(1.0)
    assert held_after(load, 0.5)
    proc.kill()
    proc.wait()
    started = time.monotonic()
    load.wait(threading.Event())
    assert time.monotonic() - started < 2.0


def test_the_agent_holds_delivery_while_the_trainer_is_busy_and_delivers_everything_after(tmp_path, monkeypatch):
    """A real run and agent: records logged while the trainer's own threads keep every CPU busy stay in the journal
    until the trainer leaves a CPU free (or RLLOG_AGENT_LAG_MAX passes); finish delivers every one."""
    monkeypatch.setenv("RLLOG_AGENT_FREE_CPUS", "1")
    monkeypatch.setenv("RLLOG_AGENT_LAG_MAX", "8")
    run = rllog.init(report_to="parquet", run_dir=tmp_path / "run", health=False)
    cursor = CursorStore(tmp_path / "run", "parquet")

    def delivered() -> int:
        return cursor.load().seq

    run.log({"before": 1.0}, step=0)
    deadline = time.monotonic() + 60
    while delivered() < 1 and time.monotonic() < deadline:  # an idle trainer: delivered at once
        time.sleep(0.05)
    assert delivered() >= 1
    stop = threading.Event()
    data = b"x" * 50_000_000

    def spin() -> None:
        while not stop.is_set():
            hashlib.sha256(data).digest()

    spinners = [threading.Thread(target=spin, daemon=True) for _ in range(CPUS)]
    for t in spinners:
        t.start()
    try:
        time.sleep(2.0)  # the agent sees the trainer busy
        seq = delivered()
        for step in range(1, 6):
            run.log({"busy": float(step)}, step=step)
        run.request_flush()
        time.sleep(2.0)
        held = delivered()
        assert held == seq, (seq, held)  # nothing more delivered while every CPU is the trainer's
        deadline = time.monotonic() + 30
        while delivered() < seq + 5 and time.monotonic() < deadline:  # lag_max bounds the wait, busy or not
            time.sleep(0.1)
        assert delivered() >= seq + 5
    finally:
        stop.set()
        for t in spinners:
            t.join()
    run.log({"after": 1.0}, step=6)
    report = run.finish(timeout=60)
    assert report.ok
    rows = read_metrics(tmp_path / "run").to_pydict()
    assert sorted(zip(rows["step"], rows["key"], rows["value"], strict=True)) == [
        (0, "before", 1.0),
        *[(s, "busy", float(s)) for s in range(1, 6)],
        (6, "after", 1.0),
    ]
