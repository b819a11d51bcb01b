""":class:`AgentProcess`: the delivery agent of one run, supervised from the trainer.

It starts the agent in its own process group (a Ctrl-C aimed at the trainer does not hit it), hands it the sinks' options
through a pipe (so secrets in ``backend_options`` never reach the disk) that then carries its flush wake-ups, watches it from its own thread, restarts it
when it dies for the whole life of the run (:class:`RestartBudget`: a budget of restarts that refills over time, with
backoff), says on the trainer's stderr when a sink fails or starts dead-lettering (read off its cursor) and when
delivery cannot go on, and stops it at ``finish``'s deadline.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rllog import messages, settings
from rllog.agent.launch import EXIT_SINKS_FAILED, launch
from rllog.agent.placement import FROZEN_STATES, process_state, raise_to_normal_priority
from rllog.agent.standby import register_agent, take_standby
from rllog.delivery import RETRY_NOTE, CursorStore, SinkState, notices, wake_watcher
from rllog.rundir import AGENT_LOG
from rllog.settings import KILL_WAIT_SECONDS, LOCAL_RETRY_CAP, STOP_GRACE_SECONDS

log = logging.getLogger("rllog.agent")


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
    WATCH_SECONDS = settings.AGENT_WATCH_SECONDS

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
        self._cursors = {name: CursorStore(self.run_dir, name) for name in self.sink_names}
        self._cursor_stamps: dict[str, tuple[int, int]] = {}  # sink -> (mtime, size) of its cursor file when last read
        self._told_failed: set[str] = set()
        self._told_dead_letters: set[str] = set()
        self._retrying: dict[str, str] = {}  # sink -> the retry note its cursor held at the last check
        self._told_retrying: set[str] = set()
        self._next_retry_check = 0.0
        self.cursor_checks = 0  # looks at the cursors so far (every WATCH_SECONDS)
        self.budget = budget or RestartBudget()
        self._say = on_stderr or messages.say
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.exits: deque[tuple[int | None, str]] = deque(maxlen=5)  # (exit code, last line of agent.log)
        self.cause: str | None = None  # why delivery is not going on, for finish's report
        self._started_at = 0.0
        self.owner_pid = os.getpid()  # the trainer that started it (a forked child holds a copy)
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._spawning = threading.Lock()  # held from the stop check to the new agent's proc: stop() waits for it
        self._abandoned = False  # stop() could wait no longer for a restart under way: the restart kills its agent
        self._watcher: threading.Thread | None = None
        self._wakeups: Any = None  # the current agent's stdin, non-blocking once its options are sent

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> AgentProcess:
        self._spawn(first=True)
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
        # A restart under way ends first: its agent is the one to stop, not the dead one. Waited for until the
        # grace after the deadline at most, so that finish keeps its overrun; past that the restart kills its agent.
        started = self._spawning.acquire(timeout=max(0.0, deadline + STOP_GRACE_SECONDS - time.monotonic()))
        if started:
            self._spawning.release()
        with self._lock:
            self._abandoned = not started
            proc = self.proc
        if proc is None:
            return True
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            return True
        except subprocess.TimeoutExpired:
            pass
        finally:
            self._close_wakeups()  # what the agent still does needs no more of them
        # Stopped or killed, an agent's threads must each run to exit: at idle priority, on CPUs the trainer's
        # other processes keep busy, a killed agent took more than KILL_WAIT_SECONDS to go.
        raise_to_normal_priority(proc.pid)
        if process_state(proc.pid) in FROZEN_STATES:
            self.cause = (
                f"the delivery agent (pid {proc.pid}) was frozen (stopped by a signal such as SIGSTOP, or a debugger) "
                "at the finish deadline and was killed; run `rllog replay`"
            )
        else:
            proc.terminate()
            try:  # the grace counts from the deadline: a wait above for a restart has used some of it
                proc.wait(timeout=max(0.0, deadline + STOP_GRACE_SECONDS - time.monotonic()))
                return False
            except subprocess.TimeoutExpired:
                pass
        proc.kill()
        try:
            proc.wait(timeout=KILL_WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            log.warning("rllog: the delivery agent (pid %s) did not exit %.1fs after SIGKILL", proc.pid, KILL_WAIT_SECONDS)
        return False

    def wake_flush_watcher(self) -> None:
        """Tell the agent's :class:`rllog.delivery.FlushWatcher` that a flush request was written (under the lock:
        a restart closes the previous agent's pipe, whose descriptor number a new file could take)."""
        with self._lock:
            if self._wakeups is not None:
                wake_watcher(self._wakeups.fileno())

    def _close_wakeups(self) -> None:
        with self._lock:
            wakeups, self._wakeups = self._wakeups, None
        _close_pipe(wakeups)

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

    def _spawn(self, first: bool = False) -> None:
        standby = take_standby(self.sink_names, self.system_interval) if first else None
        if standby is not None:  # started while the trainer was built: its trackers are imported
            proc, samples_read = standby.proc, standby.samples_read
            assignment = {"run_dir": str(self.run_dir), "options": self.options, "env": dict(os.environ), "cwd": os.getcwd()}
            payload = json.dumps(assignment) + "\n"
        else:
            proc, samples_read = launch([str(self.run_dir)], self.run_dir / AGENT_LOG, self.system_interval)
            payload = json.dumps(self.options) + "\n"  # one line: the pipe then carries flush wake-ups
        if samples_read is not None:
            from rllog.system_metrics import SampleReader

            self._read_samples()  # what the previous agent sent last
            if self._samples is not None:
                self._samples.close()
            self._samples = SampleReader(samples_read)
        wakeups = proc.stdin
        try:
            assert wakeups is not None
            wakeups.write(payload.encode())
            wakeups.flush()
            # A wake-up must never block the training thread (an agent stopped by SIGSTOP leaves the pipe full).
            os.set_blocking(wakeups.fileno(), False)
        except OSError:  # it died at once; the watcher sees it
            _close_pipe(wakeups)
            wakeups = None
        with self._lock:
            self.proc = proc
            previous, self._wakeups = self._wakeups, wakeups
        _close_pipe(previous)
        self._started_at = time.monotonic()
        register_agent(self)

    SINK_CHECK_SECONDS = settings.SINK_CHECK_SECONDS

    def _check_sinks(self, retry_notes: bool = True) -> None:
        """Say on stderr, once per sink, when a sink fails (its records stay pending for replay) or rejects its
        first record for good (dead letters), as soon as its cursor file says so: looked at every
        :attr:`WATCH_SECONDS`, read again only when it changed. With ``retry_notes`` (every
        :attr:`SINK_CHECK_SECONDS`: every cursor is read), also when it has been retrying one error since the
        previous such check (a tracker down, no descriptor left)."""
        for name, store in self._cursors.items():
            if name in self._told_failed:
                continue
            try:
                stat = os.stat(store.path)
            except OSError:  # no deliverer has started yet
                continue
            stamp = (stat.st_mtime_ns, stat.st_size)
            if stamp == self._cursor_stamps.get(name) and not retry_notes:
                continue
            self._cursor_stamps[name] = stamp
            cursor = store.load()
            if cursor.dead_letter_count and name not in self._told_dead_letters:
                self._told_dead_letters.add(name)
                first = cursor.dead_letters[0] if cursor.dead_letters else {}
                seq, step, error = first.get("seq", 0), first.get("step", 0), first.get("error", "")
                self._say(notices.dead_lettering(name, seq, step, error, self.run_dir))
            if cursor.state in SinkState.BROKEN:
                self._told_failed.add(name)
                self._say(notices.failed(name, cursor.error, self.run_dir))
                continue
            if not retry_notes:
                continue
            note = cursor.error if cursor.state == SinkState.RUNNING and (cursor.error or "").startswith(RETRY_NOTE) else None
            if note is not None and self._retrying.get(name) == note and name not in self._told_retrying:
                self._told_retrying.add(name)
                self._say(notices.waiting(name, note, self.run_dir))
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
        interval = min(self.WATCH_SECONDS, self.system_interval or self.WATCH_SECONDS)
        while not self._stopping.wait(interval):
            self._read_samples()
            retry_notes = time.monotonic() >= self._next_retry_check
            if retry_notes:
                self._next_retry_check = time.monotonic() + self.SINK_CHECK_SECONDS
            try:
                self._check_sinks(retry_notes)
            except Exception as exc:  # the watcher must outlive anything a cursor file holds
                log.debug("rllog: checking the sinks' cursors failed: %s", exc)
            self.cursor_checks += 1
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
            if self._stopping.wait(wait) or not self._respawn():
                return

    def _respawn(self) -> bool:
        """Start the next agent. While this process cannot (no descriptor or no memory for a new process: the
        trainer's own limits), try again every :data:`rllog.settings.LOCAL_RETRY_CAP` seconds: that is no new death
        of the agent, and the report names it as the cause until a start succeeds. False when the run stops first."""
        said, died = False, self.cause  # why the agent is being restarted (kept: in a crash loop it is the cause)
        while True:
            with self._spawning:
                if self._stopping.is_set():  # finish is stopping the agent: starting one now would outlive it
                    return False
                try:
                    self._spawn()
                    failed = None
                except OSError as exc:
                    failed = exc
            if failed is None:
                with self._lock:
                    abandoned, proc = self._abandoned, self.proc
                if abandoned and proc is not None:  # stop() gave up waiting for this start: nobody else stops it
                    proc.kill()
                    proc.wait()
                    return False
                self.restarts += 1
                self.cause = died
                if said:
                    self._say("rllog: the delivery agent has been restarted; delivery goes on")
                return True
            self.cause = f"the delivery agent could not be restarted: {failed}"
            if not said:
                said = True
                self._say(f"rllog: {self.cause}; trying again every {LOCAL_RETRY_CAP:.0f}s")
            if self._stopping.wait(LOCAL_RETRY_CAP):
                return False


def _close_pipe(pipe: Any) -> None:
    """Close an agent's stdin; one whose agent died may hold options it could not send (EPIPE on the last flush)."""
    if pipe is None:
        return
    try:
        pipe.close()
    except OSError:
        pass


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 2048))
            lines = [line for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
        return lines[-1].strip()[:300] if lines else ""
    except OSError:
        return ""
