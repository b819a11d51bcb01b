"""The delivery agent: ``python -m rllog.agent RUN_DIR --follow``, and :class:`AgentProcess`, which runs it.

The agent imports and opens the trackers named in ``RUN_DIR/run.json`` and runs one
:class:`rllog.delivery.Follower` thread per sink. It exits when every follower has seen the journal's
end marker and closed its sink. If the trainer dies without ``finish``, the followers deliver what the
journal holds and close their sinks with status ``killed``.

:class:`AgentProcess` (in the trainer) starts it in its own session (a Ctrl-C aimed at the trainer
does not hit it), hands it the sinks' options through a pipe (so secrets in ``backend_options`` never
reach the disk), watches it from its own thread, restarts it when it dies for the whole life of the
run (a budget of restarts that refills over time, with backoff), says on the trainer's stderr when
delivery cannot go on, and stops it at ``finish``'s deadline.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from rllog import settings
from rllog.rundir import AGENT_LOG
from rllog.settings import (
    CAUGHT_UP_SECONDS,
    KILL_WAIT_SECONDS,
    LOCK_WAIT_SECONDS,
    ORPHAN_TIMEOUT_SECONDS,
    STARTUP_GC_PAUSE_MAX_SECONDS,
    STOP_GRACE_SECONDS,
    SYSTEM_METRICS_INTERVAL,
)
from rllog.sink import CONSOLE_FD_ENV

EXIT_SINKS_FAILED = 3  # every follower ended, some sink failed: nothing a restart would fix
EXIT_RESTART = 4  # a follower ran out of memory or descriptors in its own work: start the agent again from the cursors


class RestartAgent(Exception):
    """A live run's follower needs its agent started again (:attr:`rllog.delivery.Follower.needs_restart`)."""


OPTIONS_FROM_STDIN = "--options-stdin"
STANDBY_ARG = "--standby"

log = logging.getLogger("rllog.agent")


def _trainer_stdout() -> int | None:
    """A duplicate of the trainer's stdout for the console backend (the agent's own output goes to agent.log)."""
    try:
        return os.dup(sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # no real stdout (captured, closed)
        return None


class RestartBudget:
    """At most ``burst`` restarts at once, refilled by one every ``refill_seconds``; waits grow while it dies young.

    Args:
        burst: restarts available at once.
        refill_seconds: one restart comes back every this many seconds.
        backoff_base: first wait before a restart, doubled for each death in a row that came within
            ``young`` seconds of its start, up to ``backoff_cap``.
    """

    def __init__(
        self,
        burst: int = 5,
        refill_seconds: float = 60.0,
        backoff_base: float = 0.5,
        backoff_cap: float = 30.0,
        young: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.burst, self.refill_seconds = burst, refill_seconds
        self.backoff_base, self.backoff_cap, self.young = backoff_base, backoff_cap, young
        self.clock = clock
        self._tokens, self._stamp = float(burst), clock()
        self._young_deaths = 0

    def _refill(self) -> None:
        now = self.clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) / self.refill_seconds)
        self._stamp = now

    def wait_before_restart(self, lived: float) -> float:
        """Seconds to wait before the next restart of an agent that lived ``lived`` seconds (takes a token)."""
        self._young_deaths = self._young_deaths + 1 if lived < self.young else 0
        backoff = min(self.backoff_cap, self.backoff_base * 2 ** max(0, self._young_deaths - 1))
        self._refill()
        wait_for_token = 0.0 if self._tokens >= 1 else (1 - self._tokens) * self.refill_seconds
        self._tokens -= 1  # may go negative: the wait above pays it back
        return max(backoff, wait_for_token)


class AgentProcess:
    """The delivery agent of one run, supervised from the trainer.

    Args:
        run_dir: the run directory (its ``run.json`` names the sinks).
        options: sink name -> keyword options, secrets included; sent to the agent through a pipe.
        budget: the restart policy.
        on_stderr: where "delivery cannot go on" messages go (default: the trainer's stderr).

    Example:
        >>> agent = AgentProcess(run_dir, {"wandb": {"entity": "me"}}).start()
        >>> ...                                  # the run logs; the agent delivers
        >>> agent.stop(deadline=time.monotonic() + 120)
    """

    POLL_SECONDS = settings.AGENT_POLL_SECONDS

    def __init__(
        self,
        run_dir: Path,
        options: dict[str, dict[str, Any]] | None = None,
        budget: RestartBudget | None = None,
        on_stderr: Callable[[str], None] | None = None,
        sink_names: list[str] | None = None,
        system_interval: float | None = None,
        on_system: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.system_interval = system_interval
        self.on_system = on_system
        self._samples: Any = None  # system_metrics.SampleReader of the current agent
        self.options = options or {}
        self.sink_names = list(sink_names if sink_names is not None else self.options)
        self._told_failed: set[str] = set()
        self._retrying: dict[str, str] = {}  # sink -> the retry note its cursor held at the last check
        self._told_retrying: set[str] = set()
        self._next_sink_check = 0.0
        self.budget = budget or RestartBudget()
        self._say = on_stderr or (lambda text: print(text, file=sys.stderr, flush=True))
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.exits: deque[tuple[int | None, str]] = deque(maxlen=5)  # (exit code, last line of agent.log)
        self.cause: str | None = None  # why delivery is not going on, for finish's report
        self._started_at = 0.0
        self._pid = os.getpid()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> AgentProcess:
        self._spawn()
        self._watcher = threading.Thread(target=self._watch, name="rllog-agent-watch", daemon=True)
        self._watcher.start()
        return self

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    def stop(self, deadline: float) -> bool:
        """Wait until ``deadline`` (monotonic) for the agent to exit by itself; then stop it, within
        :data:`rllog.settings.FINISH_OVERRUN_MAX_SECONDS` of the deadline. True if it exited by itself."""
        self._stopping.set()
        with self._lock:
            proc = self.proc
        if proc is None:
            return True
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            return True
        except subprocess.TimeoutExpired:
            pass
        if process_state(proc.pid) in FROZEN_STATES:
            self.cause = (
                f"the delivery agent (pid {proc.pid}) was frozen (stopped by a signal such as SIGSTOP, or a debugger) "
                "at the finish deadline and was killed; run `rllog replay`"
            )
        else:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_GRACE_SECONDS)
                return False
            except subprocess.TimeoutExpired:
                pass
        proc.kill()
        try:
            proc.wait(timeout=KILL_WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            log.warning("rllog: the delivery agent (pid %s) did not exit %.1fs after SIGKILL", proc.pid, KILL_WAIT_SECONDS)
        return False

    def wait_while_alive(self, deadline: float) -> None:
        """Block until the agent exits for good or ``deadline``; restarts (by the watcher) are waited through."""
        while time.monotonic() < deadline:
            with self._lock:
                proc = self.proc
            if proc is not None and proc.poll() is None:
                try:
                    proc.wait(timeout=max(0.0, min(self.POLL_SECONDS, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    pass
                continue
            if self._done():
                return
            time.sleep(self.POLL_SECONDS)

    # -- internals -------------------------------------------------------------------------------
    def _done(self) -> bool:
        """The agent exited and will not be restarted: it finished its work, or its sinks failed."""
        proc = self.proc
        if proc is None or proc.poll() is None or proc.returncode not in (0, EXIT_SINKS_FAILED):
            return False
        if proc.returncode == EXIT_SINKS_FAILED and self.cause is None:  # finish may look before the watcher does
            self.cause = self._sinks_failed_cause()
        return True

    def _sinks_failed_cause(self) -> str:
        last = _last_line(self.run_dir / AGENT_LOG)
        return (
            f"every sink ended and some failed (agent exit code {EXIT_SINKS_FAILED}); see the sinks' errors"
            f"{' and the agent log: ' + last if last else ''}"
        )

    def _spawn(self) -> None:
        standby = take_standby(self.sink_names, self.system_interval) if self.restarts == 0 else None
        if standby is not None:  # started while the trainer was built: its trackers are imported
            proc, samples_read = standby.proc, standby.samples_read
            assignment = {"run_dir": str(self.run_dir), "options": self.options, "env": dict(os.environ), "cwd": os.getcwd()}
            payload = json.dumps(assignment) + "\n"
        else:
            proc, samples_read = _launch([str(self.run_dir)], self.run_dir / AGENT_LOG, self.system_interval)
            payload = json.dumps(self.options)
        if samples_read is not None:
            from rllog.system_metrics import SampleReader

            self._read_samples()  # what the previous agent sent last
            if self._samples is not None:
                self._samples.close()
            self._samples = SampleReader(samples_read)
        try:
            assert proc.stdin is not None
            proc.stdin.write(payload.encode())
            proc.stdin.close()
        except OSError:  # it died at once; the watcher sees it
            pass
        with self._lock:
            self.proc = proc
        self._started_at = time.monotonic()
        _agents.add(self)

    SINK_CHECK_SECONDS = settings.SINK_CHECK_SECONDS

    def _check_sinks(self) -> None:
        """Say on stderr, once per sink, when a sink fails (its records stay pending for replay), and when its
        cursor says it has been retrying one error since the previous check (a tracker down, no descriptor left)."""
        from rllog.delivery import RETRY_NOTE, CursorStore, SinkState

        for name in self.sink_names:
            if name in self._told_failed:
                continue
            cursor = CursorStore(self.run_dir, name).load()
            if cursor.state in SinkState.BROKEN:
                self._told_failed.add(name)
                self._say(
                    f"rllog: delivery to {name!r} failed ({cursor.error}); its records stay in the journal "
                    f"({self.run_dir}): `rllog replay {self.run_dir} --to {name}` once the cause is fixed"
                )
                continue
            note = cursor.error if cursor.state == SinkState.RUNNING and (cursor.error or "").startswith(RETRY_NOTE) else None
            if note is not None and self._retrying.get(name) == note and name not in self._told_retrying:
                self._told_retrying.add(name)
                self._say(f"rllog: delivery to {name!r} is waiting, {note}; its records stay in the journal ({self.run_dir})")
            self._retrying[name] = note or ""

    def _read_samples(self) -> None:
        if self._samples is None or self.on_system is None:
            return
        for sample in self._samples.read():
            try:
                self.on_system(sample)
            except Exception as exc:  # the run finished meanwhile
                log.debug("rllog: system sample not journaled: %s", exc)

    def _watch(self) -> None:
        while not self._stopping.wait(self.POLL_SECONDS):
            self._read_samples()
            if time.monotonic() >= self._next_sink_check:
                self._next_sink_check = time.monotonic() + self.SINK_CHECK_SECONDS
                try:
                    self._check_sinks()
                except Exception as exc:  # the watcher must outlive anything a cursor file holds
                    log.debug("rllog: checking the sinks' cursors failed: %s", exc)
            proc = self.proc
            if proc is None or proc.poll() is None:
                continue
            code = proc.returncode
            if code == 0:
                return  # every sink closed: the run's end marker was delivered
            last = _last_line(self.run_dir / AGENT_LOG)
            self.exits.append((code, last))
            if code == EXIT_SINKS_FAILED:
                self.cause = self._sinks_failed_cause()
                self._check_sinks()
                return
            wait = self.budget.wait_before_restart(time.monotonic() - self._started_at)
            self.cause = (
                f"the delivery agent died (exit code {code}{': ' + last if last else ''}); restarted {self.restarts} times"
            )
            if wait >= 5:
                self._say(
                    f"rllog: delivery to the trackers has stopped: the delivery agent keeps dying (exit code {code}"
                    f"{': ' + last if last else ''}); restarting it in {wait:.0f}s. Records stay in the journal ({self.run_dir})."
                )
            else:
                log.warning("rllog: the delivery agent exited with code %s; restarting it in %.1fs", code, wait)
            if self._stopping.wait(wait):
                return
            self.restarts += 1
            try:
                self._spawn()
            except OSError as exc:  # e.g. no memory for a new process: try again later
                self.cause = f"the delivery agent could not be restarted: {exc}"
                self._say(f"rllog: {self.cause}")


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 2048))
            lines = [line for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
        return lines[-1].strip()[:300] if lines else ""
    except OSError:
        return ""


# Runs the module named by its first argument at idle CPU priority from the agent's first instruction: the
# interpreter's start-up and ``import rllog`` (pyarrow among it; ~0.5 s of CPU) come before ``main`` could lower it,
# and on cores that training keeps busy that time came out of training. The module's name stays an argument of its
# own, so the agent is found by ``rllog.agent`` in its command line as with ``-m``.
IDLE_FROM_EXEC = (
    "import os, runpy, sys\n"
    "try:\n"
    "    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
    "except (AttributeError, OSError):\n"
    "    pass\n"
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)\n"
)


def _launch(args: list[str], log_path: Path, system_interval: float | None) -> tuple[subprocess.Popen, int | None]:
    """Start ``python -m rllog.agent ARGS`` for this trainer (at idle priority from its start, see
    :data:`IDLE_FROM_EXEC`); returns the process and the read end of its system-metrics pipe (None without system
    metrics). Its stdin is a pipe: what it delivers comes that way."""
    console_fd = _trainer_stdout()
    env = dict(os.environ)
    start = ["-c", IDLE_FROM_EXEC] if settings.AGENT_PRIORITY.get() == "idle" else ["-m"]
    command = [sys.executable, *start, "rllog.agent", *args, "--follow", "--parent-pid", str(os.getpid()), OPTIONS_FROM_STDIN]
    passed = []
    if console_fd is not None:
        env[CONSOLE_FD_ENV] = str(console_fd)
        passed.append(console_fd)
    samples_read = samples_write = None
    if system_interval:
        samples_read, samples_write = os.pipe()
        passed.append(samples_write)
        command += ["--system-metrics-fd", str(samples_write), "--system-interval", str(system_interval)]
    try:
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C aimed at the trainer does not hit it
                close_fds=True,
                pass_fds=tuple(passed),
                env=env,
            )
    except BaseException:
        if samples_read is not None:
            os.close(samples_read)
        raise
    finally:
        for fd in (console_fd, samples_write):
            if fd is not None:
                os.close(fd)
    return proc, samples_read


def standby_key(sink_names: list[str], system_interval: float | None) -> tuple[frozenset[str], float | None]:
    """What a run must match to take a standby: the same backends in any order (the standby only imports
    them; the run's own list decides the rest), and the same system-metrics sampling."""
    return frozenset(sink_names), system_interval


class Standby:
    """A delivery agent started before its run exists (see :func:`prepare`).

    It imports the named backends' trackers (``Backend.prepare``) at idle CPU priority, then waits on
    its stdin for the run it will deliver; it opens no tracker run and writes nothing before that. The
    first :class:`AgentProcess` of a run with the same sinks takes it (:func:`take_standby`); closing
    its stdin (:meth:`release`, or the trainer's exit) ends it.
    """

    def __init__(self, sink_names: list[str], system_interval: float | None):
        self.key = standby_key(sink_names, system_interval)
        fd, log_name = tempfile.mkstemp(prefix="rllog-standby-", suffix=".log")
        os.close(fd)
        self.log_path = Path(log_name)
        args = [STANDBY_ARG, "--sinks", ",".join(sink_names), "--standby-log", str(self.log_path)]
        self.proc, self.samples_read = _launch(args, self.log_path, system_interval)
        self.owner_pid = os.getpid()
        self.owners = 1  # trainers waiting for it; the last one collected without training releases it

    def alive(self) -> bool:
        return self.owner_pid == os.getpid() and self.proc.poll() is None

    def release(self) -> None:
        """End it: closing its stdin tells it no run is coming, and it exits once its imports are done. Nothing
        waits for that (this may run in a garbage collector's finalizer on the training thread). Only the process
        that started it does anything (a forked child holds a copy of the object, not the agent)."""
        if self.owner_pid != os.getpid():
            return
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        if self.samples_read is not None:
            os.close(self.samples_read)
            self.samples_read = None
        if self.proc.poll() is not None:  # died before its run (otherwise it removes its log itself)
            self.log_path.unlink(missing_ok=True)
        else:  # reap it when it exits, off this thread
            threading.Thread(target=self.proc.wait, name="rllog-standby-reap", daemon=True).start()


_standby: Standby | None = None
_standby_lock = threading.Lock()
_agents: weakref.WeakSet[AgentProcess] = weakref.WeakSet()  # this process's run agents, for prepare()


def prepare(sink_names: list[str], system_interval: float | None) -> Standby | None:
    """Start a standby agent for these sinks now, unless one is waiting already or a run's agent is alive
    in this process (one agent at a time: a sweep that builds trainer after trainer keeps one).

    The integrations call it when a trainer is built, so the trackers' imports (seconds: MLflow, Comet,
    wandb) overlap the model's loading rather than the first steps of training. Returns the standby
    (None when none was started).
    """
    global _standby
    with _standby_lock:
        if _standby is not None and _standby.alive():
            if _standby.key == standby_key(sink_names, system_interval):
                _standby.owners += 1
                return _standby
            _standby.release()
        _standby = None
        if not sink_names or any(a.poll() is None for a in list(_agents) if a.proc is not None and a._pid == os.getpid()):
            return None
        _standby = Standby(sink_names, system_interval)
        return _standby


def take_standby(sink_names: list[str], system_interval: float | None) -> Standby | None:
    """The waiting standby if it was started for exactly these sinks (it is then no longer waiting)."""
    global _standby
    with _standby_lock:
        standby, _standby = _standby, None
    if standby is None:
        return None
    if standby.alive() and standby.key == standby_key(sink_names, system_interval):
        return standby
    standby.release()
    return None


def release_standby(standby: Standby) -> None:
    """A trainer that asked for ``standby`` went without training: end it if no other trainer waits for it."""
    global _standby
    with _standby_lock:
        standby.owners -= 1
        if _standby is not standby or standby.owners > 0:
            return
        _standby = None
    standby.release()


def waiting_standby() -> Standby | None:
    """The standby agent waiting for a run, if any."""
    return _standby


def discard_standby() -> None:
    """End the waiting standby, whoever asked for it."""
    global _standby
    with _standby_lock:
        waiting, _standby = _standby, None
    if waiting is not None:
        waiting.release()


PRIORITY_ENV = settings.AGENT_PRIORITY.name
CPUS_ENV = settings.AGENT_CPUS.name


def _stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` from the third on (after the command name, which may hold spaces)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def trainer_cpu(pid: int) -> int | None:
    """The CPU the main thread of process ``pid`` ran on last (``/proc/<pid>/stat``, field 39), or None."""
    try:
        return int(_stat_fields(pid)[36])
    except (OSError, ValueError, IndexError):
        return None


FROZEN_STATES = ("T", "t")  # /proc/<pid>/stat states: stopped by a signal, stopped by a tracer


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``R``, ``S``, ``T``...; ``/proc/<pid>/stat``, field 3), or None."""
    try:
        return _stat_fields(pid)[0]
    except (OSError, IndexError):
        return None


def agent_cpus(trainer_pid: int | None, setting: str | None = None) -> set[int] | None:
    """The CPUs the agent should run on (None: leave it where it is), from ``setting`` or :data:`CPUS_ENV`.

    ``auto``: every CPU the trainer may use except the one its main thread is on, if that leaves any. At idle
    priority the agent never takes a CPU from the trainer, but its threads still wake on the trainer's CPU and
    run there between the trainer's time slices (measured: 290-720 preemptions of the training thread in a
    60-step tiny GRPO with five trackers, 0.09-0.18 s waiting; off its CPU, 110-290 and 0.02-0.04 s).
    """
    cpus = settings.AGENT_CPUS.get() if setting is None else settings.AGENT_CPUS.read(setting)
    if cpus == "all" or not hasattr(os, "sched_getaffinity"):
        return None
    if isinstance(cpus, frozenset):
        return set(cpus)
    if trainer_pid is None:
        return None
    try:
        allowed = os.sched_getaffinity(trainer_pid)
    except OSError:
        return None
    cpu = trainer_cpu(trainer_pid)
    rest = allowed - {cpu}
    return rest if cpu in allowed and rest else None


def _agent_tasks() -> list[int]:
    """Every thread of this process and of the processes it started (a tracker's service, e.g. wandb-core)."""
    tids: list[int] = []
    pids = [os.getpid()]
    while pids:
        pid = pids.pop()
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in threads:
            tids.append(int(tid))
            try:
                pids.extend(int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
            except (OSError, ValueError):
                pass
    return tids


def place(cpus: set[int] | None) -> None:
    """Move every thread of the agent (and of the processes it started) to ``cpus``; later threads inherit it."""
    if not cpus:
        return
    for tid in _agent_tasks():
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass


class StartupHeap:
    """No garbage collection while the trackers import and open; then their objects are frozen out of it.

    Opening five trackers allocates ~700,000 long-lived objects (modules, classes, ORM mappings). With the
    collector on, the growing heap set off 7 full collections of up to 0.45 s each (measured: 1.8 s of the
    agent's CPU in the seconds when training starts beside it), and any later full collection would walk
    them all again. ``gc.freeze`` moves them to the permanent generation
    once every sink is open (or :data:`STARTUP_GC_PAUSE_MAX_SECONDS` have passed): later collections see
    only the objects delivery makes. The startup's own garbage (~48,000 objects, a few MB, measured) stays.

    Example:
        >>> heap = StartupHeap.pause()
        >>> heap.freeze_once(opened=True)  # in the agent's main loop
    """

    def __init__(self) -> None:
        self.deadline: float | None = None  # set when the sinks start opening (a standby may wait long before)
        self.frozen = False

    @classmethod
    def pause(cls) -> StartupHeap:
        gc.disable()
        return cls()

    def freeze_once(self, opened: bool) -> None:
        """Freeze the heap and turn the collector back on, the first time every sink is ``opened`` (or too late)."""
        if self.deadline is None:
            self.deadline = time.monotonic() + STARTUP_GC_PAUSE_MAX_SECONDS
        if self.frozen or not (opened or time.monotonic() > self.deadline):
            return
        made = gc.get_count()[0]  # objects made (net) since the pause; get_freeze_count() would walk them all
        gc.freeze()
        gc.enable()
        self.frozen = True
        log.info("rllog: %d objects of the trackers' start-up frozen out of garbage collection", made)


class PriorityGovernor:
    """Keeps the agent at idle CPU priority (``SCHED_IDLE``: it runs only on cycles training leaves), and at
    normal priority (nice 10) while a sink is more than ``$RLLOG_AGENT_LAG_MAX`` s behind, so delivery lag stays bounded
    even when training keeps every core busy; and off the trainer's CPU (:func:`agent_cpus`), checked every second.

    Linux sets the policy per thread: every thread of the agent and of the processes it started (the trackers'
    threads, wandb's service) is switched, every second, except the governor's own, which stays at normal
    priority so that it can always decide.
    """

    def __init__(self, followers: list, mode: str, trainer_pid: int | None = None):
        self.followers, self.trainer_pid = followers, trainer_pid
        self.lag_max = settings.AGENT_LAG_MAX.get()
        self.idle = False
        self.cpus: set[int] | None = None
        self._idle_mode = mode == "idle" and hasattr(os, "SCHED_IDLE")
        self._own_tid = 0

    def start(self) -> PriorityGovernor:
        if self._idle_mode or agent_cpus(self.trainer_pid) is not None:
            threading.Thread(target=self._run, name="rllog-priority", daemon=True).start()
        return self

    def _set(self, idle: bool) -> None:
        self.idle = idle
        if not self._idle_mode:
            return
        policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
        for tid in _agent_tasks():  # the trackers' processes too (wandb-core ran at normal priority)
            if tid != self._own_tid:
                try:
                    os.sched_setscheduler(tid, policy, os.sched_param(0))
                except OSError:
                    pass

    def _place(self) -> None:
        cpus = agent_cpus(self.trainer_pid)
        if cpus is not None and cpus != self.cpus:
            place(cpus)
            self.cpus = cpus

    def _run(self) -> None:
        self._own_tid = threading.get_native_id()
        if self._idle_mode:  # started by an idle thread (the agent starts idle): this one must always get to decide
            try:
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            except OSError:
                pass
        self._set(True)
        while True:
            self._place()
            time.sleep(1.0)
            running = [f for f in self.followers if f.thread is not None and f.thread.is_alive()]
            if not running:
                return
            lag = time.monotonic() - min(f.caught_up_at for f in running)
            if self.idle and lag > self.lag_max:
                log.info("rllog: delivery is %.0fs behind; back to normal priority until caught up", lag)
                self._set(False)
            elif not self.idle and lag < CAUGHT_UP_SECONDS:
                self._set(True)
            else:
                self._set(self.idle)  # threads the trackers started since get the current policy


def serve(
    run_dir: str,
    follow: bool,
    parent_pid: int | None,
    only: list[str] | None = None,
    orphan_timeout: float = ORPHAN_TIMEOUT_SECONDS,
    on_progress: Callable[[str, int], None] | None = None,
    options: dict[str, dict[str, Any]] | None = None,
    heap: StartupHeap | None = None,
) -> int:
    """Deliver ``run_dir`` to its sinks (or to ``only``, by name); returns the number of sinks that failed.

    ``options`` (sink name -> keyword options) override the run file's redacted copies. ``heap``: the
    collector paused for the start-up, frozen and resumed here once every sink is open.
    """
    from rllog import registry
    from rllog.delivery import POLL_INTERVAL, FlushWatcher, Follower, RetryPolicy, SinkState, live_poll_interval
    from rllog.rundir import SinkSpec, load_run_info

    info, run_file = load_run_info(run_dir)
    specs = run_file.sinks
    if only is not None:
        known = {s.name: s for s in specs}
        specs = [known.get(n, SinkSpec(n)) for n in only]

    def parent_gone() -> bool:
        return parent_pid is not None and os.getppid() != parent_pid

    def attempt_starts() -> tuple[int, ...]:
        return load_run_info(run_dir)[0].attempt_starts

    if follow:
        place(agent_cpus(parent_pid))  # before the trackers start their threads and processes, which inherit it
    followers = []
    for spec in specs:
        sink_options = (options or {}).get(spec.name, spec.options)

        def factory(name: str = spec.name, sink_options: dict = sink_options) -> Any:
            return registry.create(name, sink_options)

        follower = Follower(
            spec.name,
            factory,
            info,
            follow=follow,
            writer_gone=parent_gone,
            attempt_starts=attempt_starts,
            flush_interval=run_file.flush_interval,
            poll_interval=live_poll_interval(run_file.flush_interval) if follow else POLL_INTERVAL,
            retry=RetryPolicy(**run_file.retry),
            on_progress=partial(on_progress, spec.name) if on_progress else None,
        )
        try:
            followers.append(follower.start(wait=LOCK_WAIT_SECONDS if follow else 0.0))
        except Exception:  # SinkBusy: someone else delivers this sink; stop what was started and say so
            for started in followers:
                started.stop()
                started.join(5)
            raise
    if follow:
        FlushWatcher(run_dir, followers, writer_gone=parent_gone).start()
        PriorityGovernor(followers, settings.AGENT_PRIORITY.get(), parent_pid).start()
        _stop_followers_on_sigterm(followers)
    orphaned_at = None
    ended: set[str] = set()
    while any(f.thread is not None and f.thread.is_alive() for f in followers):
        for f in followers:
            f.join(0.2)
            if f.name not in ended and f.join(0):  # its cursor must say how it ended, now, while others go on
                if follow and f.needs_restart:  # what the other followers have in flight is re-sent, as after a kill
                    raise RestartAgent(f"{f.name}: {f.error}")
                ended.add(f.name)
                f.settle()
        if heap is not None and not heap.frozen:
            heap.freeze_once(opened=all(f.sink is not None or not (f.thread and f.thread.is_alive()) for f in followers))
        if parent_gone():
            orphaned_at = orphaned_at or time.monotonic()
            if time.monotonic() - orphaned_at > orphan_timeout:
                log.error("trainer gone and sinks still busy after %.0fs; exiting", orphan_timeout)
                return len([f for f in followers if f.state != SinkState.CLOSED])
    for f in followers:
        if follow and f.needs_restart:
            raise RestartAgent(f"{f.name}: {f.error}")
        if f.name not in ended:
            f.settle()
    return len([f for f in followers if f.state != SinkState.CLOSED])


def _stop_followers_on_sigterm(followers: list) -> None:
    """``finish``'s deadline stops the agent with SIGTERM (then SIGKILL, :data:`STOP_GRACE_SECONDS` later): each
    follower is told to stop, so one that is retrying a tracker that is down keeps what its sink holds and saves its
    cursor before the process ends (killed outright, the records the sink had taken were sent again by a replay)."""
    if threading.current_thread() is not threading.main_thread():  # serve() run by a test or an embedding program
        return

    def stop(signum: int, frame: Any) -> None:
        for follower in followers:
            follower.stop()

    signal.signal(signal.SIGTERM, stop)


def _lower_priority(idle: bool) -> None:
    """Delivery is background work: on a machine with few cores the trainer should win the CPU (nice
    ``$RLLOG_AGENT_NICE``; with ``idle``, this thread also at ``SCHED_IDLE``)."""
    niceness = settings.AGENT_NICE.get()
    try:
        os.nice(niceness)
        if idle and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, ValueError):
        pass


def _wait_for_run(args: argparse.Namespace) -> dict[str, Any]:
    """A standby's life before its run: import the trackers at idle priority, then read the run from stdin
    (exit quietly on end of file: the trainer went without training)."""
    from rllog import delivery, registry, rundir  # noqa: F401  (what serve() needs, imported ahead too)

    _lower_priority(idle=True)  # only cycles the trainer leaves
    place(agent_cpus(os.getppid()))
    for name in filter(None, args.sinks.split(",")):
        try:
            registry.resolve(name).prepare()
        except Exception as exc:  # the run's agent will meet (and report) the same problem when it opens the sink
            print(f"rllog: preparing {name!r} failed: {type(exc).__name__}: {exc}", flush=True)
    line = sys.stdin.readline()
    log_path = Path(args.standby_log) if args.standby_log else None
    if not line.strip():
        if log_path is not None:
            log_path.unlink(missing_ok=True)
        os._exit(0)
    assignment = json.loads(line)
    # The trainer's environment and directory as they are now (they may have changed since the standby started).
    console = os.environ.get(CONSOLE_FD_ENV)
    os.environ.clear()
    os.environ.update(assignment.get("env", {}))
    if console is not None:
        os.environ[CONSOLE_FD_ENV] = console
    os.chdir(assignment.get("cwd", os.getcwd()))
    run_log = Path(assignment["run_dir"]) / AGENT_LOG
    sys.stdout.flush()
    sys.stderr.flush()
    with open(run_log, "ab") as out:
        if log_path is not None:
            out.write(log_path.read_bytes())
            out.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    if log_path is not None:
        log_path.unlink(missing_ok=True)
    if hasattr(os, "SCHED_OTHER"):  # the PriorityGovernor decides from now on (its own thread must not be idle)
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            pass
    return assignment


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rllog.agent", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("run_dir", nargs="?", help="the run to deliver (a standby reads it from stdin)")
    parser.add_argument("--follow", action="store_true", help="keep delivering while the journal grows, until its end marker")
    parser.add_argument(
        "--parent-pid", type=int, default=None, help="the trainer's pid: when it dies, deliver what is left and close as killed"
    )
    parser.add_argument("--orphan-timeout", type=float, default=ORPHAN_TIMEOUT_SECONDS)
    parser.add_argument(OPTIONS_FROM_STDIN, action="store_true", help="read the sinks' options (JSON) from standard input")
    parser.add_argument(
        STANDBY_ARG,
        action="store_true",
        help="import the --sinks' trackers now, then read the run (run_dir, options) as one JSON line from standard input",
    )
    parser.add_argument("--sinks", default="", help="with --standby: the backends to prepare, comma-separated")
    parser.add_argument("--standby-log", default=None, help="with --standby: the output before the run, moved into its agent.log")
    parser.add_argument(
        "--system-metrics-fd", type=int, default=None, help="write samples of the trainer (--parent-pid) to this pipe"
    )
    parser.add_argument("--system-interval", type=float, default=SYSTEM_METRICS_INTERVAL)
    args = parser.parse_args(argv)
    heap = StartupHeap.pause() if args.follow or args.standby else None
    if args.standby:
        assignment = _wait_for_run(args)
        args.run_dir, options = assignment["run_dir"], assignment.get("options")
    elif args.run_dir is None:
        parser.error("run_dir is required (or --standby)")
    if args.system_metrics_fd is not None and args.parent_pid is not None:
        from rllog.system_metrics import run_sampler

        run_sampler(args.parent_pid, args.system_metrics_fd, args.system_interval, threading.Event())
    if not args.standby:
        options = json.loads(sys.stdin.read() or "{}") if args.options_stdin else None
        _lower_priority(idle=False)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        failed = serve(args.run_dir, args.follow, args.parent_pid, orphan_timeout=args.orphan_timeout, options=options, heap=heap)
    except RestartAgent as exc:
        print(f"rllog: restarting the delivery agent: {exc}", flush=True)
        os._exit(EXIT_RESTART)
    sys.stdout.flush()
    # os._exit: a tracker's non-daemon thread (or a hung sink) must not keep the agent alive.
    os._exit(EXIT_SINKS_FAILED if failed else 0)


if __name__ == "__main__":
    main()
