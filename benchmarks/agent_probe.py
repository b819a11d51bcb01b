"""A CPU ledger inside the delivery agent, for ``benchmarks/attribution.py``: which phase of which sink used the
agent's CPU seconds.

Installed by ``benchmarks/probe/sitecustomize.py`` before the agent's own code runs; it wraps

- ``Backend.prepare`` (a standby importing a tracker), ``registry.create`` (a sink's class and tracker imported,
  the sink built) and every sink's ``open``, ``write_*``, ``flush`` and ``close``: the calling thread's CPU time
  (``time.thread_time``), per sink and phase;
- ``Follower.run``: the follower thread's whole CPU time, so that what is not a sink call (reading and decoding
  the journal, batching, cursors) is the difference;
- ``os.sched_setscheduler``: the process CPU time when the agent first put itself at ``SCHED_IDLE``;

and samples, every :data:`SAMPLE_INTERVAL` s, every thread's CPU time (by its Python name) and every process the
agent started (wandb's service), keeping each one's latest figure. The ledger is written as JSON to
``<folder>/agent-<pid>.json`` just before the agent exits (it ends with ``os._exit``).
"""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from pathlib import Path
from typing import Any

# s between samples of the threads and child processes: a thread's last second may be missed; sampling more often
# cost the agent ~2.5 ms of CPU a time, which competes with the training it measures
SAMPLE_INTERVAL = 1.0
SINK_METHODS = ("open", "write_metrics", "write_table", "write_alert", "write_config", "flush", "close")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def stat_cpu(path: str) -> float | None:
    """utime + stime (s) of a ``/proc/.../stat`` file, or None once it is gone."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``."""
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


class ChildSampler:
    """The latest CPU seconds of every process started below ``pid`` (one that exits keeps its last sample)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.seen: dict[int, dict[str, Any]] = {}

    def sample(self) -> None:
        for child in descendants(self.pid):
            cpu = stat_cpu(f"/proc/{child}/stat")
            if cpu is not None:
                entry = self.seen.setdefault(child, {"name": process_name(child), "cpu_s": 0.0})
                entry["cpu_s"] = max(entry["cpu_s"], cpu)

    def total(self) -> float:
        return sum(e["cpu_s"] for e in self.seen.values())


class Ledger:
    def __init__(self, folder: str, started_cpu: float):
        self.path = Path(folder) / f"agent-{os.getpid()}.json"
        self.started_cpu = started_cpu  # the interpreter's start-up, before any of the agent's code
        self.started_wall = time.time()
        self.lock = threading.Lock()
        self.calls: dict[str, dict[str, list[float]]] = {}  # sink -> phase -> [thread CPU s, calls]
        self.follower_cpu: dict[str, float] = {}
        self.threads: dict[int, dict[str, Any]] = {}  # tid -> name, CPU s
        self.marks: dict[str, dict[str, float]] = {}
        self.children = ChildSampler(os.getpid())
        self.idle_at_cpu: float | None = None

    def add(self, sink: str, phase: str, seconds: float) -> None:
        with self.lock:
            entry = self.calls.setdefault(sink, {}).setdefault(phase, [0.0, 0])
            entry[0] += seconds
            entry[1] += 1

    def mark(self, name: str) -> None:
        """The first time ``name`` happens: the process CPU and wall clock then."""
        if name not in self.marks:
            self.marks[name] = {"cpu_s": time.process_time(), "wall_s": time.time() - self.started_wall}

    def sample(self) -> None:
        names = {t.native_id: t.name for t in threading.enumerate()}
        for tid_text in os.listdir("/proc/self/task"):
            tid = int(tid_text)
            cpu = stat_cpu(f"/proc/self/task/{tid}/stat")
            if cpu is None:
                continue
            entry = self.threads.setdefault(tid, {"name": names.get(tid) or process_name(tid), "cpu_s": 0.0})
            if tid in names:
                entry["name"] = names[tid]
            entry["cpu_s"] = max(entry["cpu_s"], cpu)
        self.children.sample()

    def dump(self) -> None:
        self.sample()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        data = {
            "pid": os.getpid(),
            "started_cpu_s": self.started_cpu,
            "process_cpu_s": usage.ru_utime + usage.ru_stime,
            "wall_s": time.time() - self.started_wall,
            "idle_at_cpu_s": self.idle_at_cpu,
            "marks": self.marks,
            "calls": self.calls,
            "follower_cpu_s": self.follower_cpu,
            "threads": list(self.threads.values()),
            "children": list(self.children.seen.values()),
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)


def _timed(ledger: Ledger, sink: str, phase: str, fn):
    def wrapper(*args, **kwargs):
        ledger.mark(f"first {phase}")
        started = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            ledger.add(sink, phase, time.thread_time() - started)

    return wrapper


def install(folder: str) -> Ledger:
    started_cpu = time.process_time()
    from rllog import delivery, registry

    ledger = Ledger(folder, started_cpu)

    original_prepare = registry.Backend.prepare

    def prepare(self):
        return _timed(ledger, self.name, "import (standby)", original_prepare)(self)

    registry.Backend.prepare = prepare

    original_create = registry.create

    def create(name, options=None, *args, **kwargs):
        sink = _timed(ledger, name, "import + build", original_create)(name, options, *args, **kwargs)
        for method in SINK_METHODS:
            if hasattr(sink, method):
                setattr(sink, method, _timed(ledger, name, method, getattr(sink, method)))
        return sink

    registry.create = create

    original_run = delivery.Follower.run

    def run(self):
        started = time.thread_time()
        try:
            return original_run(self)
        finally:
            with ledger.lock:
                ledger.follower_cpu[self.name] = ledger.follower_cpu.get(self.name, 0.0) + time.thread_time() - started

    delivery.Follower.run = run

    original_setscheduler = os.sched_setscheduler

    def setscheduler(pid, policy, param):
        if ledger.idle_at_cpu is None and policy == getattr(os, "SCHED_IDLE", None) and pid in (0, os.getpid()):
            ledger.idle_at_cpu = time.process_time()
        return original_setscheduler(pid, policy, param)

    os.sched_setscheduler = setscheduler

    original_exit = os._exit

    def exit_after_dump(code):
        try:
            ledger.dump()
        except Exception:
            pass
        original_exit(code)

    os._exit = exit_after_dump

    def sampler():
        while True:
            time.sleep(SAMPLE_INTERVAL)
            try:
                ledger.sample()
            except Exception:
                pass

    threading.Thread(target=sampler, name="bench-agent-probe", daemon=True).start()
    return ledger
