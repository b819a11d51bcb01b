"""The standby agent: started before its run exists (:func:`prepare`, when a trainer is built), it imports the
trackers while the model loads, then waits for the run's :class:`rllog.agent.AgentProcess` to take it."""

from __future__ import annotations

import os
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any, Protocol

from rllog.agent.launch import STANDBY_ARG, launch


class RunAgent(Protocol):
    """What :func:`prepare` needs of a run's agent (:class:`rllog.agent.AgentProcess`)."""

    owner_pid: int

    def poll(self) -> int | None: ...


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
        self.proc, self.samples_read = launch(args, self.log_path, system_interval)
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
_agents: weakref.WeakSet[Any] = weakref.WeakSet()  # this process's run agents, for prepare()


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
        if not sink_names or any(a.owner_pid == os.getpid() and a.poll() is None for a in list(_agents)):
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


def register_agent(agent: RunAgent) -> None:
    """A run's agent started in this process: no standby is started while it lives (one agent at a time)."""
    _agents.add(agent)
