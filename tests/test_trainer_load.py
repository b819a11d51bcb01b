"""The agent waits for a CPU-bound trainer (``RLLOG_AGENT_FREE_CPUS``), with the delivery lag still bounded.

``SCHED_IDLE`` alone let the agent take a core from a training that used every core (docs/benchmarks.md, section
8): these tests load the CPUs for real, with threads that hash large buffers (hashlib releases the GIL), and check
what the agent does about it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from sinks import busy_cpus, wait_until

import rllog
from rllog.agent.placement import (
    DECIDING_THREADS,
    STAYS_IDLE_WARNING,
    TrainerLoad,
    cgroup_cpu_quota,
    cpu_demand_seconds,
    quota_cpus,
    raise_to_normal_priority,
    trainer_cpus,
)
from rllog.delivery.cursor import CursorStore
from rllog.rundir import AGENT_LOG
from rllog_backends.parquet import read_metrics

CPUS = len(os.sched_getaffinity(0))
BUSY = """
import hashlib, os, threading, time
data = b"x" * 50_000_000
def spin():
    while True:
        hashlib.sha256(data).digest()
import sys
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else len(os.sched_getaffinity(0))):
    threading.Thread(target=spin, daemon=True).start()
print("busy", flush=True)
time.sleep(600)
"""


def busy_process(threads: int | None = None) -> subprocess.Popen:
    """A process whose threads keep every CPU it may use busy (a CPU-bound training on every core), or ``threads``."""
    extra = [] if threads is None else [str(threads)]
    proc = subprocess.Popen([sys.executable, "-c", BUSY, *extra], stdout=subprocess.PIPE, text=True)
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


def test_a_trainer_that_starts_training_is_read_afresh_and_held_at_once():
    """A standby's run arrives as ``train()`` starts: ``restart`` holds the work at once, until readings taken from
    then on say the trainer leaves room; the readings of the idle second before no longer count."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline(); exec(sys.argv.pop(1))", BUSY],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        load = TrainerLoad(proc.pid, free_cpus=1.0, lag_max=60.0).start()
        time.sleep(1.0)
        assert not held_after(load, 0.3)  # loading its model: every CPU free
        proc.stdin.write("train\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "busy"
        before = load.held_seconds  # the wait for start()'s first reading
        load.restart()
        assert held_after(load, 0.0)  # at once
        time.sleep(0.6)  # readings from the restart on: every CPU busy
        assert held_after(load, 0.6)
        assert load.held_seconds == before  # still held: not yet counted
    finally:
        proc.kill()
        proc.wait()
    started = time.monotonic()
    load.wait(threading.Event())  # gone: released
    assert time.monotonic() - started < 2.0
    assert load.held_seconds > before + 1.0
    assert wait_until(lambda: not load._watching, timeout=10)  # its next reading finds the trainer gone: it ends
    load.restart()  # nothing would end a hold now: no hold
    assert not held_after(load, 0.2)
    load.stop()
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        load = TrainerLoad(idle.pid, free_cpus=1.0, lag_max=60.0).start()
        time.sleep(0.6)
        load.restart()
        started = time.monotonic()
        load.wait(threading.Event())  # the first fresh reading: room
        assert 0.2 <= time.monotonic() - started < 1.5
        load.stop()
    finally:
        idle.kill()
        idle.wait()


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
    with busy_cpus():
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
    run.log({"after": 1.0}, step=6)
    report = run.finish(timeout=60)
    assert report.ok
    rows = read_metrics(tmp_path / "run").to_pydict()
    assert sorted(zip(rows["step"], rows["key"], rows["value"], strict=True)) == [
        (0, "before", 1.0),
        *[(s, "busy", float(s)) for s in range(1, 6)],
        (6, "after", 1.0),
    ]


def test_an_agent_that_arrives_while_the_trainer_is_busy_opens_nothing_before_it_has_looked(tmp_path, monkeypatch):
    """A run's agent arrives as ``train()`` starts, every core busy: its sinks wait to open from the first moment, not
    from its first reading of the trainer half a second later (opening five trackers then cost the first steps ~1 s)."""
    monkeypatch.setenv("RLLOG_AGENT_FREE_CPUS", "1")
    monkeypatch.setenv("RLLOG_AGENT_LAG_MAX", "8")
    with busy_cpus():
        time.sleep(1.0)
        run = rllog.init(report_to="parquet", run_dir=tmp_path / "run", health=False)
        run.log({"first": 1.0}, step=0)
        run.request_flush()
        time.sleep(3.0)
        assert CursorStore(tmp_path / "run", "parquet").load().seq == 0  # not one record, though parquet opens in ms
    report = run.finish(timeout=60)
    assert report.ok
    rows = read_metrics(tmp_path / "run").to_pydict()
    assert list(zip(rows["step"], rows["key"], rows["value"], strict=True)) == [(0, "first", 1.0)]


CPU_CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
LIGHT = """
import time
while True:
    end = time.monotonic() + 0.02
    while time.monotonic() < end:
        pass
    time.sleep(0.08)
"""


@pytest.fixture
def one_cpu_cgroup():
    """A real cgroup (v1, the ``cpu`` controller this machine mounts) limited to one CPU's worth of time, as a
    container's ``--cpus=1`` or a Kubernetes limit of 1 sets it."""
    if CPUS < 2 or not os.access(CPU_CGROUP_V1 / "cgroup.procs", os.W_OK):
        pytest.skip("needs two CPUs and a writable cgroup v1 cpu controller (root on this machine)")
    group = CPU_CGROUP_V1 / f"rllog-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    (group / "cpu.cfs_period_us").write_text("100000")
    (group / "cpu.cfs_quota_us").write_text("100000")
    yield group
    for pid in filter(None, (group / "cgroup.procs").read_text().split()):
        (CPU_CGROUP_V1 / "cgroup.procs").write_text(pid)
    group.rmdir()


def test_a_trainer_in_a_one_cpu_cgroup_makes_the_agent_wait_though_its_affinity_shows_more(one_cpu_cgroup):
    """One busy thread on a two-CPU machine leaves a CPU free; inside a one-CPU quota it leaves none (the agent,
    started by the trainer, would share the quota): the CPUs are the quota's, not the affinity's."""
    proc = busy_process(threads=1)
    try:
        assert trainer_cpus(proc.pid) == CPUS and cgroup_cpu_quota(proc.pid) is None
        # Half a CPU asked free: one busy thread's demand (~1.0, more while it waits for a CPU) is off that boundary.
        load = TrainerLoad(proc.pid, free_cpus=0.5, lag_max=60.0).start()
        time.sleep(1.5)
        assert not held_after(load, 1.0)  # a CPU free
        load.stop()
        (one_cpu_cgroup / "cgroup.procs").write_text(str(proc.pid))
        assert cgroup_cpu_quota(proc.pid) == 1.0 and trainer_cpus(proc.pid) == 1.0
        load = TrainerLoad(proc.pid, free_cpus=0.5, lag_max=60.0).start()
        time.sleep(1.5)
        assert held_after(load, 1.0)  # the quota is used up
        load.stop()
    finally:
        proc.kill()
        proc.wait()
    # A GPU-like trainer in the same one-CPU quota, busy a fifth of the time (waiting for its device the rest): no
    # whole CPU is ever free in a quota of one, but half of it is, and the agent does not wait.
    light = subprocess.Popen([sys.executable, "-c", LIGHT])
    try:
        (one_cpu_cgroup / "cgroup.procs").write_text(str(light.pid))
        load = TrainerLoad(light.pid, free_cpus=1.0, lag_max=60.0).start()
        time.sleep(1.5)
        assert not held_after(load, 1.0)
        load.stop()
    finally:
        light.kill()
        light.wait()


def test_the_tightest_cgroup_v2_quota_from_the_group_up_binds(tmp_path):
    """cgroup v2's ``cpu.max`` (this machine's v2 hierarchy has no cpu controller to set one for real): a parent's
    quota binds its children, ``max`` is none."""
    group = tmp_path / "kubepods" / "pod" / "trainer"
    group.mkdir(parents=True)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "kubepods" / "cpu.max").write_text("400000 100000\n")
    (tmp_path / "kubepods" / "pod" / "cpu.max").write_text("150000 100000\n")
    (group / "cpu.max").write_text("max 100000\n")
    assert quota_cpus(group, tmp_path, "cgroup2") == 1.5
    assert quota_cpus(group, group, "cgroup2") is None
    (group / "cpu.max").write_text("50000 100000\n")
    assert quota_cpus(group, tmp_path, "cgroup2") == 0.5


@pytest.mark.skipif(os.geteuid() != 0, reason="leaving SCHED_IDLE needs root (or CAP_SYS_NICE, or RLIMIT_NICE)")
def test_a_stopping_agent_and_the_threads_that_decide_leave_idle_priority():
    """An agent about to get SIGTERM is raised out of SCHED_IDLE (its handler must run within the grace on a busy
    machine); TrainerLoad's own thread, started by an idle thread, runs at normal priority and the governor leaves it
    there, so a busy machine cannot starve the decision to wait."""
    idle = subprocess.Popen(
        [sys.executable, "-c", "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)"]
    )
    try:
        deadline = time.monotonic() + 30
        while len(os.listdir(f"/proc/{idle.pid}/task")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tids = [int(t) for t in os.listdir(f"/proc/{idle.pid}/task")]
        assert len(tids) == 2
        for tid in tids:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_IDLE}
        raise_to_normal_priority(idle.pid)
        assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_OTHER}
    finally:
        idle.kill()
        idle.wait()

    wait_until(lambda: not DECIDING_THREADS, timeout=10)  # an earlier watch, stopped, ends within a reading
    proc = busy_process()
    seen: dict = {}

    def start_from_an_idle_thread() -> None:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        seen["load"] = TrainerLoad(proc.pid, free_cpus=1.0, lag_max=60.0).start()

    try:
        starter = threading.Thread(target=start_from_an_idle_thread)
        starter.start()
        starter.join()
        deadline = time.monotonic() + 30
        while not (DECIDING_THREADS and os.sched_getscheduler(next(iter(DECIDING_THREADS))) == os.SCHED_OTHER):
            assert time.monotonic() < deadline, DECIDING_THREADS
            time.sleep(0.05)
        [tid] = DECIDING_THREADS
        assert os.sched_getscheduler(tid) == os.SCHED_OTHER  # though started by a SCHED_IDLE thread
        seen["load"].stop()
        deadline = time.monotonic() + 10
        while DECIDING_THREADS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not DECIDING_THREADS  # gone with its thread
    finally:
        proc.kill()
        proc.wait()


NO_RIGHT_TO_RAISE = """
import sys, rllog
run = rllog.init(report_to="parquet", run_dir=sys.argv[1], health=False)
for step in range(5):
    run.log({"loss": float(step)}, step=step)
print(run.finish(timeout=60).ok, flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and util-linux's setpriv")
def test_an_agent_that_may_not_leave_idle_priority_says_so_once_and_delivers_everything(tmp_path):
    """Most non-root users may not take a thread out of SCHED_IDLE (RLIMIT_NICE 0): the agent's deciding threads and
    the governor are refused. Here root without CAP_SYS_NICE (``setpriv``) stands for such a user: the agent says why
    once, in its log, and still delivers every record."""
    run_dir = tmp_path / "run"
    command = ["setpriv", "--bounding-set=-sys_nice", "--inh-caps=-sys_nice", sys.executable, "-c", NO_RIGHT_TO_RAISE]
    out = subprocess.run([*command, str(run_dir)], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr
    rows = read_metrics(run_dir).to_pydict()
    assert sorted(zip(rows["step"], rows["value"], strict=True)) == [(s, float(s)) for s in range(5)]
    agent_log = (run_dir / AGENT_LOG).read_text()
    assert agent_log.count(STAYS_IDLE_WARNING) == 1, agent_log


GOVERNED_AGENT = r"""
import os, threading, time
from types import SimpleNamespace
from rllog.agent.placement import STOPPING, PriorityGovernor, lower_priority

lower_priority(idle=True)  # as an agent: idle from the start
done = threading.Event()
worker = threading.Thread(target=done.wait, daemon=True)  # a follower's thread, idle like the rest
worker.start()
follower = SimpleNamespace(thread=worker, caught_up_at=time.monotonic())
PriorityGovernor([follower], "idle").start()
time.sleep(1.5)
before = os.sched_getscheduler(worker.native_id)
STOPPING.set()  # what the agent's SIGTERM handler does
deadline = time.monotonic() + 30
while os.sched_getscheduler(worker.native_id) != os.SCHED_OTHER and time.monotonic() < deadline:
    time.sleep(0.05)
print(before == os.SCHED_IDLE, os.sched_getscheduler(worker.native_id) == os.SCHED_OTHER, os.sched_getscheduler(0) == os.SCHED_OTHER)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="leaving SCHED_IDLE needs root (or CAP_SYS_NICE, or RLIMIT_NICE)")
def test_a_stopping_agents_governor_raises_every_thread_and_stops_putting_them_back_to_idle():
    """SIGTERM gives the followers a short grace to save their cursors: the governor, which put every thread back to
    idle each second, raises them all instead (the trainer's raise before SIGTERM would otherwise be undone)."""
    env = os.environ | {"RLLOG_AGENT_LAG_MAX": "600"}  # never behind in this test: only STOPPING may raise them
    out = subprocess.run([sys.executable, "-c", GOVERNED_AGENT], capture_output=True, text=True, timeout=60, env=env)
    assert out.stdout.split() == ["True", "True", "True"], out.stdout + out.stderr


SESSION_LEADING_CHILD = r"""
import os, subprocess, sys, threading, time
from types import SimpleNamespace
from rllog.agent.placement import STOPPING, PriorityGovernor, lower_priority

def niceness(pid):  # empty for a process in the kernel's default group (its session never came from setsid)
    return (open(f"/proc/{pid}/autogroup").read().split() or ["default"])[-1]

lower_priority(idle=True)
service = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,  # as wandb's
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    worker = threading.Thread(target=threading.Event().wait, daemon=True)
    worker.start()
    PriorityGovernor([SimpleNamespace(thread=worker, caught_up_at=time.monotonic())], "idle").start()
    deadline = time.monotonic() + 30
    while niceness(service.pid) != "19" and time.monotonic() < deadline:
        time.sleep(0.05)
    idle = niceness(service.pid)
    STOPPING.set()  # the governor raises everything
    while niceness(service.pid) == "19" and time.monotonic() < deadline:
        time.sleep(0.05)
    print(niceness(os.getpid()), idle, niceness(service.pid))
finally:
    service.kill()
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="a kernel without autogroup scheduling")
def test_a_tracker_service_in_a_session_of_its_own_gets_an_idle_scheduling_group():
    """wandb starts its service in a session of its own, which Linux's autogroup makes a scheduling group of its own:
    given a busy CPU as often as the trainer's whole group, whatever the threads' ``SCHED_IDLE``. The governor gives
    that group the least weight (niceness 19) while the agent is idle, ``RLLOG_AGENT_NICE`` when it raises it; the
    agent's own group, the trainer's, is left alone."""
    env = os.environ | {"RLLOG_AGENT_LAG_MAX": "600", "RLLOG_AGENT_NICE": "10"}
    out = subprocess.run([sys.executable, "-c", SESSION_LEADING_CHILD], capture_output=True, text=True, timeout=60, env=env)
    mine = (open("/proc/self/autogroup").read().split() or ["default"])[-1]  # the default group has no niceness to show
    assert out.stdout.split() == [mine, "19", "10"], out.stdout + out.stderr
