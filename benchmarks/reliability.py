"""Reliability figures for docs/reliability.md: memory with a tracker down for 100,000 log calls,
drain time after a 429 storm against a real MLflow server, records lost/duplicated over SIGKILLs.

    .venv/bin/python benchmarks/reliability.py
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "plugins")]
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "plugins"), os.environ.get("PYTHONPATH", "")])
os.environ.update(MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="1")

import rllog  # noqa: E402
import rllog.run  # noqa: E402
from rllog.delivery import RetryPolicy  # noqa: E402


def kib(pid: int, field: str) -> int:
    return next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith(field + ":"))


def memory_with_a_tracker_down(tmp: Path, calls: int = 100_000) -> dict:
    run = rllog.init(
        report_to="down,parquet",
        run_dir=tmp / "down",
        flush_interval=0.2,
        health=False,
        retry=RetryPolicy(base=0.05, cap=0.2, give_up_after=None),
    )
    time.sleep(3)  # the agent has imported and opened its sinks
    before = kib(os.getpid(), "VmRSS")
    agent_start = kib(run._agent.pid, "VmRSS")
    peak_agent = 0
    t = time.perf_counter()
    for i in range(calls):
        run.log({"reward": i * 1e-3, "kl": 0.01, "entropy": 1.5, "loss": 0.1, "num_tokens": float(i)}, step=i)
        if i % 5000 == 0:
            peak_agent = max(peak_agent, kib(run._agent.pid, "VmHWM"))
    logging_s = time.perf_counter() - t
    after = kib(os.getpid(), "VmRSS")
    while rllog.run.report(tmp / "down", ["parquet"])["parquet"].delivered < calls:
        time.sleep(0.1)
    peak_agent = max(peak_agent, kib(run._agent.pid, "VmHWM"))
    report = run.finish(timeout=1)
    journal_mb = sum(p.stat().st_size for p in (tmp / "down" / "journal").glob("*")) / 2**20
    return {
        "calls": calls,
        "trainer_rss_growth_mib": (after - before) / 1024,
        "agent_rss_after_start_mib": agent_start / 1024,
        "agent_peak_rss_mib": peak_agent / 1024,
        "journal_mib": journal_mb,
        "down_pending": report["down"].pending,
        "log_calls_per_s": calls / logging_s,
    }


STORM = ROOT / "tests" / "test_faults.py"


def storm_drain(tmp: Path) -> dict:
    import test_faults
    from fault_proxy import FaultProxy
    from mlflow import MlflowClient
    from mlflow_server import _stop, start_mlflow_server

    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp / 'unused.db'}"
    server, uri = start_mlflow_server(tmp / "server")
    proxy = FaultProxy(uri, retry_after="1")
    proxy.storm.set()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", test_faults.MLFLOW_STORM, str(tmp / "storm"), proxy.uri],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout.readline().strip() == "logged"
        while proxy.rejected < 5:  # the agent has started and is being refused
            time.sleep(0.05)
        time.sleep(5)  # a 5 s storm from there
        rejected = proxy.rejected
        proxy.storm.clear()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        result = json.loads(proc.stdout.readline())
        proc.wait()
        client = MlflowClient(uri)
        [run] = client.search_runs([client.get_experiment_by_name("storm").experiment_id])
        points = sum(len(client.get_metric_history(run.info.run_id, k)) for k in ("reward", "kl", "loss"))
        return {"rejected_429": rejected, "drain_after_storm_s": result["drain_seconds"], "points": points, "expected": 1500}
    finally:
        proxy.close()
        _stop(server)


def sigkills(tmp: Path, trials: int = 20) -> dict:
    import pyarrow.compute as pc
    import test_faults

    rng = random.Random(1)
    lost = dup = checked = 0
    for trial in range(trials):
        run_dir = tmp / f"kill{trial}"
        must_have = test_faults.kill_at_random_point(run_dir, "parquet", rng)
        test_faults.wait_closed(run_dir)
        steps = rllog.read_metrics(run_dir).filter(pc.field("key") == "i").column("step").to_pylist()
        lost += len(must_have - set(steps))
        dup += len(steps) - len(set(steps))
        checked += len(must_have)
    return {"trials": trials, "records_checked": checked, "lost": lost, "duplicated": dup}


def _per_tracker(run_dir: Path, logged: int, tb_dir: Path) -> dict:
    """logged / delivered / lost / duplicated for parquet and TensorBoard, from their own storage."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = rllog.read_metrics(run_dir, attempts="all").to_pylist()
    seqs = [r["seq"] for r in rows if r["key"] == "a"]
    [logdir] = [p for p in tb_dir.iterdir() if p.is_dir()]
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    steps = [e.step for e in acc.Scalars("a")]
    return {
        "parquet": {
            "logged": logged,
            "delivered": len(set(seqs)),
            "lost": logged - len(set(seqs)),
            "duplicated": len(seqs) - len(set(seqs)),
        },
        "tensorboard": {
            "logged": logged,
            "delivered": len(set(steps)),
            "lost": logged - len(set(steps)),
            "duplicated": len(steps) - len(set(steps)),
        },
    }


def agent_sigkills(tmp: Path, records: int = 12_000, kills: int = 8) -> dict:
    """The delivery agent SIGKILLed ``kills`` times at random while ``records`` records flow to parquet and TensorBoard."""
    import threading

    from rllog.agent import RestartBudget

    os.environ["TENSORBOARD_LOGGING_DIR"] = str(tmp / "tb_kills")
    run = rllog.init(
        report_to="parquet,tensorboard", run_dir=tmp / "kills", flush_interval=0.05, health=False, system_metrics=False
    )
    run._agent.budget = RestartBudget(burst=50, refill_seconds=1.0, backoff_base=0.05, backoff_cap=0.5)
    rng, killed = random.Random(3), []

    def killer() -> None:
        while len(killed) < kills:
            time.sleep(rng.uniform(0.1, 0.6))
            proc = run._agent.proc
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                killed.append(proc.pid)
                while run._agent.proc is proc:
                    time.sleep(0.02)

    thread = threading.Thread(target=killer)
    thread.start()
    for i in range(records):
        run.log({"a": float(i)}, step=i)
        if i % 200 == 0:
            time.sleep(0.05)
    thread.join()
    report = run.finish(timeout=120)
    return {
        "kills": len(killed),
        "report_ok": report.ok,
        "report_parquet_delivered": report["parquet"].delivered,
        **_per_tracker(tmp / "kills", records, tmp / "tb_kills"),
    }


def full_disk(tmp: Path) -> dict:
    """The run directory on a 4 MiB tmpfs, filled mid-run and freed later (needs root)."""
    mount = tmp / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)]).returncode != 0:
        return {"skipped": "mounting a tmpfs needs root"}
    try:
        os.environ["TENSORBOARD_LOGGING_DIR"] = str(mount / "tb")
        run = rllog.init(
            report_to="parquet,tensorboard", run_dir=mount / "r", flush_interval=0.05, health=False, system_metrics=False
        )
        step = 0
        for phase in ("before", "full", "freed"):
            if phase == "full":
                with open(mount / "filler", "wb") as f:
                    try:
                        while True:
                            f.write(b"\0" * 65536)
                            f.flush()
                    except OSError:
                        pass
            if phase == "freed":
                time.sleep(1.5)
                (mount / "filler").unlink()
            for _ in range(2000 if phase == "full" else 1000):
                run.log({"a": float(step)}, step=step)
                step += 1
                if step % 100 == 0:
                    time.sleep(0.02)
        report = run.finish(timeout=120)
        from rllog import journal

        return {
            "report_ok": report.ok,
            "journal_damage": journal.scan(mount / "r").damage.as_dict(),
            **_per_tracker(mount / "r", step, mount / "tb"),
        }
    finally:
        subprocess.run(["umount", "-l", str(mount)])


def journal_damage(tmp: Path, records: int = 10_000) -> dict:
    """One flipped byte in a payload, a seq and a length, in the middle of a segment; then a replay to parquet."""
    from rllog import journal
    from rllog.cli import main as cli

    run_dir = tmp / "damage"
    with rllog.init(report_to="none", run_dir=run_dir, health=False) as run:
        for i in range(records):
            run.log({"a": float(i)}, step=i)
    (segment,) = (run_dir / "journal").glob("*.rlj")
    data = bytearray(segment.read_bytes())
    for fraction, field in ((0.3, journal.HEADER.size + 5), (0.5, 12), (0.7, 16)):
        pos = data.index(journal.MAGIC, int(len(data) * fraction))
        data[pos + field] ^= 0x5A
    segment.write_bytes(bytes(data))
    cli(["replay", str(run_dir), "--to", "parquet"])
    seqs = rllog.read_metrics(run_dir).column("seq").to_pylist()
    scan = journal.scan(run_dir)
    return {
        "logged": records,
        "frames_damaged": 3,
        "readable": scan.records,
        "delivered": len(set(seqs)),
        "lost_beyond_damaged": records - 3 - len(set(seqs)),
        "duplicated": len(seqs) - len(set(seqs)),
        "damage": scan.damage.as_dict(),
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        results = {
            "agent_sigkills": agent_sigkills(tmp),
            "full_disk": full_disk(tmp),
            "journal_damage": journal_damage(tmp),
            "memory": memory_with_a_tracker_down(tmp),
            "sigkill": sigkills(tmp),
            "storm": storm_drain(tmp),
        }
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
