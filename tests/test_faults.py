"""Fault injection through the delivery agent process: hung, crashing and down trackers, a 429 storm
against a real MLflow server, SIGKILL at random points. Figures: docs/reliability.md."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow_server import mlflow_server  # noqa: F401  (fixture)
from sinks import busy_cpus, wait_until

import rllog
import rllog.run
from rllog import journal, settings
from rllog.cli import main as cli_main
from rllog.delivery import RetryPolicy
from rllog_backends import parquet as parquet_backend  # what the parquet sink stored (rllog.read_* may read the journal)


def jsonl(run_dir, name):
    from rllog_test_backends import read_jsonl

    return read_jsonl(os.path.join(run_dir, f"{name}.jsonl"))


def test_hung_and_crashing_trackers_then_replay_to_healthy_instances(tmp_path, test_backends, monkeypatch, capsys):
    run_dir = tmp_path / "r"
    run = rllog.init(report_to="parquet,hangs,crashes", run_dir=run_dir, flush_interval=0.05, health=False)
    for i in range(100):
        run.log({"i": float(i)}, step=i)
    run.log_table("completions", {"prompt": ["p"] * 3})
    # The healthy tracker gets everything while the others hang and crash (a cold agent on a machine the rest of the
    # suite keeps busy may take seconds to start, so this waits for it rather than the deadline below).
    assert wait_until(lambda: rllog.run.report(run_dir, ["parquet"])["parquet"].delivered == 101, 60)
    report = run.finish(timeout=6)  # the deadline stops the hung tracker
    assert report["parquet"].state == "delivered" and report["parquet"].delivered == 101
    assert report["hangs"].state == "pending" and report["hangs"].pending == 101 and "replay" in report["hangs"].error
    assert (
        report["crashes"].state == "failed"
        and report["crashes"].pending == 101
        and "crashed on purpose" in report["crashes"].error
    )
    assert parquet_backend.read_metrics(run_dir).num_rows == 100  # the healthy tracker got everything, on time
    assert jsonl(run_dir, "hangs")[0] == [] and jsonl(run_dir, "crashes")[0] == []

    monkeypatch.setenv("RLLOG_TEST_MODE_HANGS", "ok")  # the trackers are healthy again
    monkeypatch.setenv("RLLOG_TEST_MODE_CRASHES", "ok")
    assert cli_main(["replay", str(run_dir), "--to", "hangs,crashes"]) == 0
    for name in ("hangs", "crashes"):
        records, statuses = jsonl(run_dir, name)
        assert [r["seq"] for r in records] == list(range(1, 102)), name
        assert statuses == ["finished"]
    assert cli_main(["replay", str(run_dir), "--to", "hangs,crashes,parquet"]) == 0
    out = capsys.readouterr().out
    assert out.count("delivered 0 new records") == 3
    for name in ("hangs", "crashes"):
        assert [r["seq"] for r in jsonl(run_dir, name)[0]] == list(range(1, 102))  # nothing twice
    assert parquet_backend.read_metrics(run_dir).num_rows == 100


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _state(pid: int, tid: str) -> str:
    """The state letter of thread ``tid`` of process ``pid`` (``T``: stopped; empty for a thread that has ended)."""
    try:
        return Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


# Above the margin finish allows itself (the old stop waited 2 s for SIGTERM, which a stopped process never acts on).
FINISH_SLACK_SECONDS = 0.5


def test_finish_with_a_frozen_agent_keeps_its_timeout_reports_the_freeze_and_replay_delivers_the_rest(tmp_path):
    """``finish(timeout=20)`` with the agent stopped by SIGSTOP returned after 22 s; its report blamed the deadline."""
    run_dir = tmp_path / "r"
    run = rllog.init(report_to="parquet", run_dir=run_dir, flush_interval=0.05, health=False)
    for step in range(10):
        run.log({"x": float(step)}, step=step)
    assert run.flush(timeout=60).ok
    agent_pid = run._agent.pid
    os.kill(agent_pid, signal.SIGSTOP)  # a real freeze: the agent cannot read, deliver or act on SIGTERM
    # The stop takes effect when the thread the kernel chose runs, which at idle priority on a busy machine can be
    # after a few milliseconds: wait until every thread of the agent is stopped.
    assert wait_until(lambda: all(_state(agent_pid, tid) == "T" for tid in os.listdir(f"/proc/{agent_pid}/task")), 30)
    for step in range(10, 100):
        run.log({"x": float(step)}, step=step)
    timeout = 3.0
    started = time.monotonic()
    report = run.finish(timeout=timeout)
    took = time.monotonic() - started
    assert report.records == 100
    parquet = report["parquet"]
    assert (parquet.state, parquet.delivered, parquet.pending) == ("pending", 10, 90), str(report)
    assert f"pid {agent_pid}) was frozen" in parquet.error and "killed" in parquet.error
    assert run._agent.proc.returncode == -signal.SIGKILL  # killed, and reaped: no stopped process left behind
    assert took < timeout + settings.FINISH_OVERRUN_MAX_SECONDS + FINISH_SLACK_SECONDS, took
    assert parquet_backend.read_metrics(run_dir).num_rows == 10
    assert cli_main(["replay", str(run_dir), "--to", "parquet"]) == 0
    assert sorted(parquet_backend.read_metrics(run_dir).column("value").to_pylist()) == [float(s) for s in range(100)]


def test_tracker_down_for_100k_log_calls_memory_stays_bounded(tmp_path, test_backends):
    run = rllog.init(
        report_to="down,parquet",
        run_dir=tmp_path / "r",
        flush_interval=0.2,
        health=False,
        retry=RetryPolicy(base=0.05, cap=0.2, give_up_after=None),
    )
    before = rss_kib(os.getpid())
    agent_peak = 0
    for i in range(100_000):
        run.log({"reward": i * 1e-3, "kl": 0.01, "entropy": 1.5, "loss": 0.1, "num_tokens": float(i)}, step=i)
        if i % 10_000 == 0:
            agent_peak = max(agent_peak, rss_kib(run._agent.pid, "VmHWM"))
    after = rss_kib(os.getpid())
    deadline = time.monotonic() + 120  # the healthy tracker drains; the down one would retry until the deadline
    while rllog.run.report(tmp_path / "r", ["parquet"])["parquet"].delivered < 100_000 and time.monotonic() < deadline:
        time.sleep(0.1)
    agent_peak = max(agent_peak, rss_kib(run._agent.pid, "VmHWM"))
    report = run.finish(timeout=1)
    assert report["parquet"].delivered == 100_000
    assert report["down"].state == "pending" and report["down"].pending == 100_000
    assert journal.last_seq(tmp_path / "r") == 100_000  # all of it is kept, for replay
    # The follower of the down tracker re-reads the journal from its cursor instead of holding records:
    # neither process grows with the number of records (bounds measured in docs/reliability.md).
    assert after - before < 64 * 1024, f"trainer grew {after - before} KiB"
    assert agent_peak < 400 * 1024, f"agent peak {agent_peak} KiB"


KILL_CHILD = r"""
import sys, time, rllog
run = rllog.init(report_to=sys.argv[2], run_dir=sys.argv[1], flush_interval=0.1, health=False)
i = 0
while True:
    run.log({"i": float(i), "reward": i * 0.5}, step=i)
    if i % 25 == 0:
        run.log_table("completions", {"prompt": [f"p{i}"], "completion": ["c"]}, step=i)
    print(i, time.time(), flush=True)
    i += 1
    time.sleep(0.001)  # a trainer's pace: the kill lands at a random point of a run in progress
"""


def kill_at_random_point(run_dir, report_to, rng):
    proc = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(run_dir), report_to], stdout=subprocess.PIPE, text=True)
    target = rng.randint(1, 400)
    logged = []
    for line in proc.stdout:
        i, t = line.split()
        logged.append((int(i), float(t)))
        if len(logged) > target:
            break
    killed_at = time.time()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return {i for i, t in logged if t < killed_at - 0.1}  # logged more than flush_interval before the kill


def wait_closed(run_dir, timeout=90):
    meta = run_dir / "parquet" / "meta.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if meta.exists() and json.loads(meta.read_text())["status"] == "killed":
            return True
        time.sleep(0.05)
    return False


def test_sigkill_at_10_random_points_loses_nothing(tmp_path):
    """Ten random kill points here; the fault-schedule explorer (tests/test_explorer.py, benchmarks/soak.py) kills
    the agent at many more, amid other faults."""
    rng = random.Random(20261122)
    for trial in range(10):
        run_dir = tmp_path / f"r{trial}"
        must_have = kill_at_random_point(run_dir, "parquet", rng)
        assert wait_closed(run_dir), f"trial {trial}: the agent did not close the sinks as killed"
        steps = (
            parquet_backend.read_metrics(run_dir)
            .filter(__import__("pyarrow.compute", fromlist=["x"]).field("key") == "i")
            .column("step")
            .to_pylist()
        )
        assert must_have <= set(steps), f"trial {trial}: lost {sorted(must_have - set(steps))[:5]}"
        assert len(steps) == len(set(steps))  # and nothing twice
        table_steps = (
            set(parquet_backend.read_table(run_dir, "completions").column("_step").to_pylist())
            if any((run_dir / "parquet" / "tables").glob("*"))
            else set()
        )
        assert {s for s in must_have if s % 25 == 0} <= table_steps
        # every part file is a whole parquet file (no reader breaks on a partial write)
        for part in (run_dir / "parquet").rglob("*.parquet"):
            __import__("pyarrow.parquet", fromlist=["x"]).read_table(part)
        assert not list((run_dir / "parquet").rglob("*.tmp"))


def test_sigkill_with_every_tracker_delivers_to_each_and_closes_as_killed(tmp_path, tracker_dirs):
    from readers import read_back

    trackers = ["parquet", "wandb", "trackio", "tensorboard", "mlflow", "comet_ml"]
    run_dir = tmp_path / "r"
    must_have = kill_at_random_point(run_dir, ",".join(trackers), random.Random(7))
    assert must_have

    def every_sink_closed() -> bool:
        states = [json.loads(p.read_text()).get("state") for p in (run_dir / "delivery").glob("*.json")]
        return len(states) == len(trackers) and all(s == "closed" for s in states)

    assert wait_until(every_sink_closed, timeout=120)
    info, _ = __import__("rllog.run", fromlist=["x"]).load_run_info(run_dir)
    for backend in trackers:
        got = read_back(backend, tracker_dirs, info)
        steps = {s for s, _ in got.metrics["i"]}
        assert must_have <= steps, (backend, sorted(must_have - steps)[:5])
        assert got.status in ("killed", None), backend


MLFLOW_STORM = r"""
import json, sys, time, rllog
from rllog.delivery import RetryPolicy
run = rllog.init(report_to="mlflow", run_dir=sys.argv[1], project="storm", flush_interval=0.1, health=False,
                 backend_options={"mlflow": {"tracking_uri": sys.argv[2]}}, retry=RetryPolicy(base=0.1, cap=0.5, give_up_after=None))
for step in range(500):
    run.log({"reward": step * 0.25, "kl": step * 1e-3, "loss": -step * 0.5}, step=step)
print("logged", flush=True)
sys.stdin.readline()  # the test ends the storm, then lets us finish
t = time.monotonic()
report = run.finish(timeout=120)
print(json.dumps({"ok": report.ok, "drain_seconds": time.monotonic() - t}), flush=True)
"""


def test_429_storm_against_a_real_mlflow_server_loses_and_duplicates_nothing(tmp_path, tracker_dirs, mlflow_server):  # noqa: F811
    from fault_proxy import FaultProxy
    from mlflow import MlflowClient

    proxy = FaultProxy(mlflow_server, retry_after="1")
    proxy.storm.set()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", MLFLOW_STORM, str(tmp_path / "r"), proxy.uri],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout.readline().strip() == "logged"
        # all 500 log() calls returned while every write to MLflow was being refused
        deadline = time.monotonic() + 60
        while proxy.rejected < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proxy.rejected >= 3 and proxy.forwarded == 0
        proxy.storm.clear()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        result = json.loads(proc.stdout.readline())
        proc.wait(timeout=60)
        assert result["ok"]
    finally:
        proxy.close()
    client = MlflowClient(mlflow_server)
    [run] = client.search_runs([client.get_experiment_by_name("storm").experiment_id])
    for key, scale in (("reward", 0.25), ("kl", 1e-3), ("loss", -0.5)):
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted((m.step, m.value) for m in history) == [(s, s * scale) for s in range(500)], key  # each exactly once
    assert run.info.status == "FINISHED"


@pytest.mark.parametrize("cpus", ["idle", "busy"])
def test_a_tracker_down_at_the_deadline_keeps_what_it_took_and_replay_sends_the_rest_once(tmp_path, test_backends, cpus):
    """finish's deadline stops the agent with SIGTERM: its followers keep what their sinks took before it exits (the
    explorer's seed 20028; killed outright, the replay sent those 80 records again). ``busy``: the trainer's threads
    keep every CPU busy meanwhile; the agent, at idle priority, still saves its cursor within the grace (it is raised
    to normal priority to be stopped; on this machine it met the grace without that too, in 3 runs of 3)."""
    from rllog_test_backends import read_jsonl

    run_dir = tmp_path / "r"
    run = rllog.init(report_to="jsonl", run_dir=run_dir, flush_interval=3600, backend_options={"jsonl": {"mode": "scripted"}})
    for i in range(20):
        run.log({"i": float(i)})
    assert wait_until(lambda: len(read_jsonl(run_dir / "jsonl.jsonl")[0]) == 20, 60)
    (run_dir / "jsonl.control").write_text(json.dumps({"mode": "down"}))
    for i in range(20, 60):
        run.log({"i": float(i)})
    with busy_cpus(cpus == "busy"):
        report = run.finish(timeout=3)["jsonl"]
    assert report.state == "pending" and (report.delivered, report.pending) == (20, 40)
    (run_dir / "jsonl.control").unlink()
    assert cli_main(["replay", str(run_dir), "--to", "jsonl"]) == 0
    seqs = [r["seq"] for r in read_jsonl(run_dir / "jsonl.jsonl")[0]]
    assert sorted(seqs) == list(range(1, 61))  # each once


ORPHAN_CHILD = r"""
import sys, time, rllog
run = rllog.init(report_to="parquet,jsonl", run_dir=sys.argv[1], flush_interval=0.1, health=False,
                 backend_options={"jsonl": {"mode": "scripted", "control": sys.argv[2]}})
for i in range(50):
    run.log({"i": float(i)}, step=i)
time.sleep(1.0)  # ten flush intervals: the journal holds all 50
print(run._agent.proc.pid, flush=True)
time.sleep(600)
"""


def test_an_orphaned_agent_told_to_retry_in_an_hour_stops_at_once_and_replay_delivers_the_rest(tmp_path, test_backends):
    """A 429 whose Retry-After is a date in the year 9999 (the explorer's ``sink_rate_limited``): the wait is capped at
    an hour rather than overflowing the timer and failing the sink, and an agent whose trainer died does not sit out
    the orphan timeout (600 s) when no sink would be tried again before it: it stops, the records stay pending."""
    from rllog_test_backends import read_jsonl

    run_dir, control = tmp_path / "r", tmp_path / "jsonl.control"
    control.write_text(json.dumps({"mode": "rate_limited", "retry_after": 2.5e11}))
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN_CHILD, str(run_dir), str(control)], stdout=subprocess.PIPE, text=True)
    agent = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    def agent_alive() -> bool:
        try:
            return Path(f"/proc/{agent}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    assert wait_until(lambda: not agent_alive(), 90), "the orphaned agent sat out its retry wait"
    assert parquet_backend.read_metrics(run_dir).column("step").to_pylist() == list(range(50))
    cursor = json.loads((run_dir / "delivery" / "jsonl.json").read_text())
    assert cursor["state"] == "stopped" and cursor["seq"] == 0
    assert "429" in cursor["error"] and "OverflowError" not in cursor["error"]
    assert "retrying in 3600.00s" in (run_dir / "agent.log").read_text()
    control.write_text(json.dumps({"mode": "ok"}))
    assert cli_main(["replay", str(run_dir), "--to", "jsonl"]) == 0
    assert [r["seq"] for r in read_jsonl(run_dir / "jsonl.jsonl")[0]] == list(range(1, 51))


def scripted_jsonl_run(run_dir: Path, control: Path, report_to: str = "jsonl", **options) -> rllog.Run:
    """A run delivering to the test plugin's jsonl sink, whose faults the test sets in ``control`` as it goes."""
    return rllog.init(
        report_to=report_to,
        run_dir=run_dir,
        flush_interval=0.1,
        health=False,
        backend_options={"jsonl": {"mode": "scripted", "control": str(control)}},
        **options,
    )


def replay_once_the_sink_is_back(run_dir: Path, control: Path) -> list[int]:
    """The control file back to ``ok``, one ``rllog replay`` to jsonl (which must succeed): the seqs the sink holds."""
    control.write_text(json.dumps({"mode": "ok"}))
    assert cli_main(["replay", str(run_dir), "--to", "jsonl"]) == 0
    return [r["seq"] for r in jsonl(run_dir, "jsonl")[0]]


def test_a_replay_told_to_come_back_after_its_give_up_deadline_stops_at_once_and_says_when(tmp_path, test_backends):
    """A 429 asking for an hour during ``rllog replay``: the replay slept the hour (the give-up deadline, 600 s, is
    checked only when a try fails). It now stops at once, the records pending, and says when to replay again."""
    run_dir, control = tmp_path / "r", tmp_path / "jsonl.control"
    control.write_text(json.dumps({"mode": "rate_limited", "retry_after": 3600}))
    run = scripted_jsonl_run(run_dir, control)
    for i in range(30):
        run.log({"i": float(i)}, step=i)
    assert run.finish(timeout=3)["jsonl"].pending == 30
    replay = subprocess.run(
        [sys.executable, "-m", "rllog.cli", "replay", str(run_dir), "--to", "jsonl"],
        capture_output=True,
        text=True,
        env=os.environ | {"COLUMNS": "300"},
        timeout=60,  # the old code slept the hour here
    )
    assert replay.returncode == 1, replay.stdout + replay.stderr
    cursor = json.loads((run_dir / "delivery" / "jsonl.json").read_text())
    assert (cursor["state"], cursor["seq"]) == ("stopped", 0)
    assert "HTTP 429" in cursor["error"] and "asked to wait 3600s, past this replay's give-up deadline" in cursor["error"]
    assert "state pending" in replay.stdout and "replay again after" in replay.stdout
    assert replay_once_the_sink_is_back(run_dir, control) == list(range(1, 31))


@pytest.mark.parametrize("delivery", ["process", "thread"])
def test_finish_does_not_wait_out_its_deadline_for_a_sink_told_to_come_back_after_it(tmp_path, test_backends, delivery):
    """A 429 asking for an hour at the end of a run: ``finish(timeout=60)`` waited the whole minute for a sink that
    would not be tried before it, then stopped the agent. The agent now knows finish's deadline and stops that sink
    at once (what it holds kept, the rest pending); every other sink is delivered as usual."""
    run_dir, control = tmp_path / "r", tmp_path / "jsonl.control"
    run = scripted_jsonl_run(run_dir, control, "parquet,jsonl", delivery=delivery)
    for i in range(20):
        run.log({"i": float(i)}, step=i)
    assert wait_until(lambda: len(jsonl(run_dir, "jsonl")[0]) == 20, 60)
    control.write_text(json.dumps({"mode": "rate_limited", "retry_after": 3600}))
    for i in range(20, 40):
        run.log({"i": float(i)}, step=i)
    started = time.monotonic()
    report = run.finish(timeout=60)
    waited = time.monotonic() - started
    assert waited < 30, f"finish waited {waited:.0f}s of its 60 for a sink asked to come back in an hour"
    assert "the delivery agent was stopped at the finish deadline" not in report.notes  # it ended by itself
    assert report["parquet"].state == "delivered" and report["parquet"].delivered == 40
    told_later = report["jsonl"]
    assert (told_later.state, told_later.delivered, told_later.pending) == ("pending", 20, 20)
    assert "HTTP 429" in told_later.error
    if delivery == "process":
        assert "its next try is after its trainer's finish deadline; stopping" in (run_dir / "agent.log").read_text()
    assert replay_once_the_sink_is_back(run_dir, control) == list(range(1, 41))


def test_a_replay_backing_off_from_a_429_without_retry_after_still_tries_until_its_give_up_deadline(tmp_path, test_backends):
    """Only a wait the tracker asked for stops a replay early: a 429 with no ``Retry-After`` backs off like a tracker
    that is down, and the replay keeps trying until its give-up deadline, then gives the sink up."""
    run_dir, control = tmp_path / "r", tmp_path / "jsonl.control"
    control.write_text(json.dumps({"mode": "rate_limited", "retry_after": None}))
    run = scripted_jsonl_run(run_dir, control, retry=RetryPolicy(base=0.2, cap=0.4, give_up_after=1.0))
    for i in range(10):
        run.log({"i": float(i)}, step=i)
    assert run.finish(timeout=3)["jsonl"].pending == 10
    assert cli_main(["replay", str(run_dir), "--to", "jsonl"]) == 1
    cursor = json.loads((run_dir / "delivery" / "jsonl.json").read_text())
    assert (cursor["state"], cursor["seq"]) == ("gave_up", 0) and "HTTP 429" in cursor["error"]
    assert "give-up deadline" not in cursor["error"]


def test_finish_deadline_is_heeded_only_from_the_trainer_that_wrote_it_and_not_by_a_later_run(tmp_path):
    """The agent heeds ``delivery/finish-deadline`` only when its own trainer wrote it; a run started again in the same
    process (a resume) removes the deadline an earlier ``finish`` left, which would otherwise stop at once every sink
    that waits to retry."""
    from rllog.delivery import FINISH_DEADLINE, finish_deadline, tell_finish_deadline

    run_dir = tmp_path / "r"
    with rllog.init(report_to="parquet", run_dir=run_dir, health=False) as run:
        run.log({"x": 1.0})
    assert finish_deadline(run_dir, os.getpid()) is not None  # finish told its agent
    tell_finish_deadline(run_dir, 12.5)
    assert finish_deadline(run_dir, os.getpid()) == 12.5
    assert finish_deadline(run_dir, os.getpid() + 1) is None  # another trainer's
    assert finish_deadline(run_dir, None) is None  # a replay has no trainer
    resumed = rllog.init(report_to="parquet", run_dir=run_dir, resume="must", health=False)
    try:
        assert not (run_dir / "delivery" / FINISH_DEADLINE).exists()
        assert finish_deadline(run_dir, os.getpid()) is None
    finally:
        resumed.finish()
    assert sorted(p.name for p in (run_dir / "delivery").iterdir() if p.name.endswith(".tmp")) == []
