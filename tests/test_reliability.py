"""Faults: SIGTERM, a killed delivery agent, a tracker down for a whole run, bad input from many threads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from readers import read_back
from sinks import MemorySink, wait_until

import rllog
from rllog.agent.process import RestartBudget
from rllog.cli import main as cli_main
from rllog.errors import RunFinished
from rllog.run import load_run_info
from rllog.settings import FINISH_OVERRUN_MAX_SECONDS, STOP_GRACE_SECONDS
from rllog_backends import parquet as parquet_backend  # what the parquet sink stored (rllog.read_* may read the journal)

SIGTERM_CHILD = r"""
import signal, sys, time, rllog
previous_called = []
if sys.argv[2] == "chained":
    signal.signal(signal.SIGTERM, lambda s, f: (print("previous handler ran", flush=True), sys.exit(3)))
run = rllog.init(report_to="parquet,mlflow", run_dir=sys.argv[1], flush_interval=0.1)
for i in range(50):
    run.log({"i": float(i)}, step=i)
print("ready", flush=True)
time.sleep(600)  # alive until the test kills it
"""


@pytest.mark.parametrize("mode, returncode", [("default", -signal.SIGTERM), ("chained", 3)])
def test_sigterm_closes_sinks_as_killed_and_chains_the_previous_handler(tmp_path, tracker_dirs, mode, returncode):
    run_dir = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_CHILD, str(run_dir), mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == returncode
    assert ("previous handler ran" in out) == (mode == "chained")
    meta = json.loads((run_dir / "parquet" / "meta.json").read_text())
    assert meta["status"] == "killed"
    assert parquet_backend.read_metrics(run_dir).column("value").to_pylist() == [float(i) for i in range(50)]
    mlflow = read_back("mlflow", tracker_dirs, load_run_info(run_dir)[0])
    assert mlflow.status == "killed" and mlflow.metrics["i"] == [(i, float(i)) for i in range(50)]


SIGTERM_IN_FINISH_CHILD = r"""
import os, signal, sys, time, rllog
from rllog_backends.parquet import ParquetSink

class SignalledWhileClosing(ParquetSink):
    def close(self, status):
        os.kill(os.getpid(), signal.SIGTERM)  # lands on the main thread while it waits in finish() for this sink
        time.sleep(0.3)  # the fault: the signal is handled while this sink is still closing
        super().close(status)

run = rllog.init(report_to=[SignalledWhileClosing()], run_dir=sys.argv[1], delivery="thread", health=False)
for i in range(20):
    run.log({"i": float(i)}, step=i)
run.finish()
print("finish returned and the process lived on", flush=True)
time.sleep(600)  # alive until the test kills it
"""

SIGTERM_IN_LOG_CHILD = r"""
import signal, sys, time, rllog
run = rllog.init(report_to="parquet", run_dir=sys.argv[1], flush_interval=0.1, health=False)
for i in range(20):
    run.log({"i": float(i)}, step=i)
if sys.argv[2] == "log":  # inside log itself: the step is picked under the lock, by the integration's step source
    run.step_source = lambda: signal.raise_signal(signal.SIGTERM) or 20
    run.log({"i": 20.0})
else:  # the lock as finish, flush and update_config take it
    with run._lock:
        signal.raise_signal(signal.SIGTERM)
        print("inside", flush=True)
print("the SIGTERM was not acted on as the lock was released", flush=True)
time.sleep(600)  # alive until the test kills it
"""


def test_sigterm_during_finish_lets_that_finish_end_then_ends_the_process(tmp_path):
    """The handler runs on the main thread; a SIGTERM while that thread waits in ``finish`` used to wait for that
    same finish, forever (the process hung until SIGKILL)."""
    run_dir = tmp_path / "r"
    proc = subprocess.run(
        [sys.executable, "-c", SIGTERM_IN_FINISH_CHILD, str(run_dir)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert "lived on" not in proc.stdout
    assert json.loads((run_dir / "parquet" / "meta.json").read_text())["status"] == "finished"
    assert parquet_backend.read_metrics(run_dir).column("value").to_pylist() == [float(i) for i in range(20)]


@pytest.mark.parametrize("where", ["log", "lock"])
def test_sigterm_inside_log_is_acted_on_once_the_lock_is_released(tmp_path, where):
    """A SIGTERM that lands while the main thread holds the run's lock (inside ``log``) used to deadlock the handler
    on that lock; it is acted on as the main thread releases the lock: the run is finished as ``killed`` and the
    process ends before its next line. ``log`` takes the bare lock (its wrapper's Python calls were a third of its
    cost), so both ways out are tried."""
    run_dir = tmp_path / "r"
    proc = subprocess.run(
        [sys.executable, "-c", SIGTERM_IN_LOG_CHILD, str(run_dir), where], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert proc.stdout.splitlines() == ([] if where == "log" else ["inside"])
    assert json.loads((run_dir / "parquet" / "meta.json").read_text())["status"] == "killed"
    logged = 21 if where == "log" else 20  # the record being numbered when the signal landed is kept
    assert parquet_backend.read_metrics(run_dir).column("value").to_pylist() == [float(i) for i in range(logged)]


EXCEPTION_CHILD = r"""
import sys, rllog
with rllog.init(report_to="parquet,mlflow", run_dir=sys.argv[1]) as run:
    run.log({"loss": 0.5}, step=1)
    raise RuntimeError("user code failed")
"""


def test_exception_in_user_code_closes_trackers_as_failed(tmp_path, tracker_dirs):
    proc = subprocess.run(
        [sys.executable, "-c", EXCEPTION_CHILD, str(tmp_path / "r")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1 and "user code failed" in proc.stderr
    assert json.loads((tmp_path / "r" / "parquet" / "meta.json").read_text())["status"] == "failed"
    mlflow = read_back("mlflow", tracker_dirs, load_run_info(tmp_path / "r")[0])
    assert mlflow.status == "failed" and mlflow.metrics["loss"] == [(1, 0.5)]


def test_killed_agent_is_restarted_and_nothing_is_lost(tmp_path):
    run = rllog.init(report_to="parquet", run_dir=tmp_path / "r", flush_interval=0.1, health=False)
    for i in range(100):
        run.log({"i": float(i)}, step=i)
    first = run._agent.proc
    assert wait_until(lambda: parquet_backend.read_metrics(tmp_path / "r").num_rows >= 1)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    for i in range(100, 200):
        run.log({"i": float(i)}, step=i)  # the trainer goes on, unaffected
    assert wait_until(lambda: run._agent.proc is not first)
    report = run.finish(timeout=60)
    assert run._agent.restarts == 1
    assert report.ok
    # a cursor means durable, and parquet recognises what a killed agent had written: each record once
    assert parquet_backend.read_metrics(tmp_path / "r").column("value").to_pylist() == [float(i) for i in range(200)]


@pytest.mark.parametrize("start_takes", [0.4, 3.0])
def test_a_finish_deadline_that_falls_inside_a_restart_stops_the_agent_that_restart_started(tmp_path, monkeypatch, start_takes):
    """``finish``'s stop read the dead agent while the supervisor was still starting the next one, took it for an agent
    that had exited by itself, and returned: the new agent then started and outlived ``finish``. The start is slowed
    here (a loaded machine) so that the deadline falls inside it. A start that ends within the grace after the
    deadline is waited for and its agent stopped by ``finish``; a longer one is not waited for (``finish`` keeps its
    overrun bound) and the restart kills the agent it started."""
    from rllog.agent import process

    real_launch, starting = process.launch, threading.Event()

    def slow_launch(*args, **kwargs):
        starting.set()
        time.sleep(start_takes)
        return real_launch(*args, **kwargs)

    run = rllog.init(report_to="parquet", run_dir=tmp_path / "r", flush_interval=0.1, health=False)
    run._agent.budget = RestartBudget(backoff_base=0.01)
    for i in range(50):
        run.log({"i": float(i)}, step=i)
    first = run._agent.proc
    assert first is not None
    monkeypatch.setattr(process, "launch", slow_launch)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert starting.wait(30)
    began = time.monotonic()
    run.finish(timeout=0.2)
    assert time.monotonic() - began < 0.2 + FINISH_OVERRUN_MAX_SECONDS + 0.5  # the bound finish promises (and some slack)
    if start_takes < 0.2 + STOP_GRACE_SECONDS:
        started = run._agent.proc
        assert started is not first and started is not None, "finish returned before the restart it raced had started"
        assert started.poll() is not None, "the agent started during finish outlived it"
    else:
        assert wait_until(lambda: run._agent.proc is not first, 30)
        assert wait_until(lambda: run._agent.proc.poll() is not None, 30), "the agent of an abandoned restart lives on"
        assert run._agent.restarts == 0  # killed at once: no restart counted
    monkeypatch.setattr(process, "launch", real_launch)
    assert cli_main(["replay", str(tmp_path / "r"), "--to", "parquet"]) == 0
    assert parquet_backend.read_metrics(tmp_path / "r").column("value").to_pylist() == [float(i) for i in range(50)]


def test_log_from_many_threads_keeps_every_record(tmp_path):
    sink = MemorySink("m")
    run = rllog.init(report_to=[sink], run_dir=tmp_path / "r", flush_interval=0.05, health=False)
    errors = []

    def worker(n):
        try:
            for i in range(500):
                run.log({f"t{n}": float(i)})
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert run.finish().ok and errors == []
    assert sorted(r.seq for r in sink.metrics) == list(range(1, 4001))
    per_thread = {}
    for r in sink.metrics:
        ((key, value),) = r.values.items()
        per_thread.setdefault(key, []).append(value)
    assert all(v == [float(i) for i in range(500)] for v in per_thread.values()) and len(per_thread) == 8
    steps = [r.step for r in sink.metrics]
    assert steps == list(range(4000))  # one step per call, no duplicates under contention
    with pytest.raises(RunFinished):
        run.log({"late": 1.0})


def test_agent_whose_sinks_all_failed_is_not_restarted(tmp_path, test_backends):
    from rllog.delivery import MAX_SUSPECTS

    run = rllog.init(report_to="crashes", run_dir=tmp_path / "r", flush_interval=0.05, health=False)
    for i in range(MAX_SUSPECTS):  # rejected one after another: the sink is broken, not the records
        run.log({"x": float(i)})
    assert wait_until(lambda: run._agent.poll() is not None)
    run.log({"x": 2.0})
    # the watcher saw the agent's exit and decided: it stops watching (a watcher that restarts the agent goes on)
    assert wait_until(lambda: run._agent.cause is not None and not run._agent._watcher.is_alive(), timeout=30)
    report = run.finish(timeout=10)
    assert run._agent.restarts == 0
    assert (
        report["crashes"].state == "failed"
        and report["crashes"].pending == MAX_SUSPECTS + 1
        and report["crashes"].dead_letters == 0
    )


STDERR_GONE = r"""
import json, os, signal, sys, time, rllog
run = rllog.init(report_to="parquet", run_dir=sys.argv[1], flush_interval=0.1, health=False)
sys.stdin.readline()  # the reader of stderr has gone
for i in range(100):
    run.log({"i": float(i)}, step=i)
time.sleep(0.5)
os.kill(run._agent.proc.pid, signal.SIGKILL)  # its restart is said on stderr too
for i in range(100, 200):
    run.log({"i": float(i)}, step=i)
report = run.finish(timeout=60)
print(json.dumps({"ok": report.ok, "delivered": report["parquet"].delivered, "restarts": run._agent.restarts}), flush=True)
"""


def test_a_trainer_whose_stderr_reader_has_gone_trains_and_finishes(tmp_path):
    """``python train.py 2>&1 | head -1``, or a log collector that died: every write to stderr fails with EPIPE.
    rllog's messages (the agent's restart, the finish summary) are lost, never the training: ``finish`` raised
    BrokenPipeError from its summary (the explorer's ``stderr_gone``), after delivering everything."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", STDERR_GONE, str(tmp_path / "r")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "RLLOG_QUIET"},  # it speaks on stderr, as a user's run does
    )
    assert trainer.stderr is not None
    assert trainer.stderr.readline().startswith("rllog: run ")  # the opening line, then the reader goes
    trainer.stderr.close()
    out, _ = trainer.communicate("go\n", timeout=120)
    assert trainer.returncode == 0
    assert json.loads(out) == {"ok": True, "delivered": 200, "restarts": 1}
    assert parquet_backend.read_metrics(tmp_path / "r").column("step").to_pylist() == list(range(200))
