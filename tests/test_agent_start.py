"""The delivery agent is at idle CPU priority from its first instruction, not only once its own code lowers it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

import pytest
from sinks import wait_until

import rllog
from rllog import agent
from rllog_backends import parquet as parquet_backend

# Loaded by every Python process the test starts, before any of its own code: in the agent, it records the
# scheduling policy at the moment the first of rllog's code is imported (the import of ``rllog`` itself). The network
# guard the suite puts on that path is loaded as before.
SITECUSTOMIZE = """
import os
import sys

import rllog_netguard  # noqa: F401


class PolicyWhenRllogIsImported:
    def find_spec(self, name, path=None, target=None):
        if name == "rllog":
            sys.meta_path.remove(self)
            with open(os.environ["POLICY_AT_START"], "a") as out:
                out.write(f"{os.getpid()} {os.sched_getscheduler(0)}\\n")
        return None  # the usual finders import it


with open("/proc/self/cmdline", "rb") as f:
    if any(b"rllog.agent" in arg for arg in f.read().split(b"\\0")):
        sys.meta_path.insert(0, PolicyWhenRllogIsImported())
"""


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
@pytest.mark.parametrize("standby", [False, True])
def test_agent_runs_at_idle_priority_from_its_first_instruction(tmp_path, monkeypatch, standby):
    """``import rllog`` (pyarrow among it) and the agent's own imports (0.3-0.6 s of CPU in all) ran at normal priority
    before its ``main`` lowered it, taking cores that training kept busy. The agent is still found by ``rllog.agent``
    in its command line."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(probe), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("POLICY_AT_START", str(tmp_path / "policies"))
    agent.discard_standby()
    if standby:
        assert rllog.prepare(["parquet"]) is True
    with rllog.init(report_to="parquet", run_dir=tmp_path / "r", health=False) as run:
        run.log({"x": 1.0})
        pid = run._agent.pid
    assert run.finish().ok
    seen = dict(line.split() for line in (tmp_path / "policies").read_text().splitlines())
    assert seen == {str(pid): str(os.SCHED_IDLE)}


def test_a_parquet_agent_never_loads_pandas(tmp_path):
    """pyarrow's first array imports pandas to ask whether it is installed: ~0.4 s of CPU in every agent, most of a
    short run's delivery (and of each test's ``finish``). The agent answers that first question itself; the proof is
    its memory map once it has written the records (the journal's table and metrics both go through pyarrow)."""
    with rllog.init(report_to="parquet", run_dir=tmp_path / "r", health=False) as run:
        for step in range(3):
            run.log({"x": float(step)}, step=step)
        run.log_table("completions", {"text": ["a", "b"]}, step=2)
        run.flush()
        maps = open(f"/proc/{run._agent.pid}/maps").read()
    assert run.finish().ok
    assert "pyarrow" in maps  # the records went through pyarrow in that process
    assert "pandas" not in maps
    metrics = rllog.read_metrics(tmp_path / "r")
    assert [(r["step"], r["key"], r["value"]) for r in metrics.to_pylist()] == [(0, "x", 0.0), (1, "x", 1.0), (2, "x", 2.0)]


def test_an_agent_leaves_no_temporary_directory_behind(tmp_path, monkeypatch):
    """wandb makes two temporary directories when imported (``wandb-media``, ``wandb-artifacts``), which the
    interpreter's exit removes; the agent ends with ``os._exit``, and each run with wandb left both in the temp dir,
    as did a standby that was never used."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # the agent's (and its standby's) temp dir
    monkeypatch.setattr(tempfile, "tempdir", None)  # this process reads TMPDIR again (the standby's log is made here)
    agent.discard_standby()
    assert rllog.prepare(["wandb"]) is True
    standby = agent.waiting_standby()
    agent.discard_standby()  # a standby released without a run: it exits once its imports are done
    assert standby.proc.wait(timeout=120) == 0
    with rllog.init(report_to="wandb", run_dir=tmp_path / "r", health=False) as run:
        run.log({"x": 1.0}, step=0)
        pid = run._agent.pid
    assert run.finish().ok
    assert wait_until(lambda: not os.path.exists(f"/proc/{pid}"))
    assert sorted(p.name for p in temp.iterdir() if "wandb" in p.name) == []


INTERRUPTED_TRAINER = r"""
import os, sys, time
import rllog
from rllog.agent.placement import process_state

def autogroup(pid):
    try:  # empty for a process in the kernel's default group (one whose session never came from setsid)
        return (open(f"/proc/{pid}/autogroup").read().split() or ["default"])[0]
    except OSError:  # a kernel without autogroup
        return None

run = rllog.init(report_to="parquet", run_dir=sys.argv[1], health=False)
for step in range(3):
    run.log({"x": float(step)}, step=step)
agent = run._agent.pid
try:  # from before the test can send its SIGINT (after this line)
    print(os.getsid(0), os.getpgid(0), autogroup(os.getpid()), os.getsid(agent), os.getpgid(agent), autogroup(agent), agent, flush=True)
    time.sleep(120)
except KeyboardInterrupt:  # a Ctrl-C in the trainer's terminal
    time.sleep(1.0)  # an agent that took the SIGINT too would be gone (or restarted) by now
    print(process_state(agent) in ("R", "S", "D"), run._agent.pid == agent, flush=True)  # alive, not a zombie
    run.log({"x": 3.0}, step=3)
    print(run.finish().ok, flush=True)
"""


def test_a_ctrl_c_to_the_trainer_spares_its_agent_which_shares_the_trainers_scheduling_group(tmp_path):
    """The agent has its own process group, so the SIGINT a terminal sends its foreground group (the trainer's) does
    not reach it; but not its own session, which Linux's autogroup scheduling makes a group that shares a busy CPU
    with the trainer's as an equal, whatever the agent's ``SCHED_IDLE`` (the training thread waited behind it in
    whole 4 ms ticks). The trainer runs as a terminal would start it: the leader of its own session and group."""
    script = tmp_path / "trainer.py"
    script.write_text(INTERRUPTED_TRAINER)
    trainer = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "r")], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        sid, pgid, group, agent_sid, agent_pgid, agent_group, agent = trainer.stdout.readline().split()
        assert (sid, pgid) == (str(trainer.pid), str(trainer.pid))
        assert agent_sid == sid  # the trainer's session, so its scheduling group
        assert agent_group == group
        assert agent_pgid == agent != pgid  # its own process group
        os.killpg(trainer.pid, signal.SIGINT)
        assert trainer.stdout.readline().split() == ["True", "True"]  # the same agent, alive
        assert trainer.stdout.readline().strip() == "True"  # finish: every record delivered
        assert trainer.wait(timeout=60) == 0
    finally:
        trainer.kill()
        trainer.wait()
    metrics = parquet_backend.read_metrics(tmp_path / "r")  # what the sink stored (rllog.read_* may read the journal)
    assert [(r["step"], r["value"]) for r in metrics.to_pylist()] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]


STOPPED_AGENT_TRAINER = r"""
import os, signal, sys, time
import rllog
from rllog.agent.placement import process_state

signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as in a shell's job (a test runner may have it ignored)
run = rllog.init(report_to="parquet", run_dir=sys.argv[1], health=False)
for step in range(5):
    run.log({"x": float(step)}, step=step)
assert run.flush(timeout=60).ok
agent = run._agent.pid
os.kill(agent, signal.SIGSTOP)  # a debugger, or a user's `kill -STOP`
deadline = time.monotonic() + 30
while any(process_state(int(t)) != "T" for t in os.listdir(f"/proc/{agent}/task")) and time.monotonic() < deadline:
    time.sleep(0.01)
for step in range(5, 10):
    run.log({"x": float(step)}, step=step)
time.sleep(1.5)  # the journal has them (written within 0.25 s)
print(agent, flush=True)
os._exit(0)  # the trainer dies without finish
"""


def test_an_agent_stopped_when_its_trainer_dies_goes_on_and_delivers_everything(tmp_path):
    """The agent's process group (its own, in the trainer's session) is orphaned when the trainer dies, and Linux sends
    an orphaned group with a stopped process SIGHUP, then SIGCONT: the agent ignores the SIGHUP, and the SIGCONT lets
    it deliver what the trainer left, as an orphan does."""
    script = tmp_path / "trainer.py"
    script.write_text(STOPPED_AGENT_TRAINER)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "r")], capture_output=True, text=True, timeout=120)
    agent = int(out.stdout.split()[0])
    assert wait_until(lambda: not os.path.exists(f"/proc/{agent}"), 120), "the orphaned agent did not end"
    metrics = parquet_backend.read_metrics(tmp_path / "r")  # what the sink stored (rllog.read_* may read the journal)
    assert [(r["step"], r["value"]) for r in metrics.to_pylist()] == [(s, float(s)) for s in range(10)]
