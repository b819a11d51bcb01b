"""The agent's work: :func:`serve` runs one :class:`rllog.delivery.Follower` per sink of a run and watches them."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from rllog import settings
from rllog.agent.placement import STOPPING, PriorityGovernor, StartupHeap, TrainerLoad, agent_cpus, place
from rllog.settings import LOCK_WAIT_SECONDS, ORPHAN_TIMEOUT_SECONDS

log = logging.getLogger("rllog.agent")


class RestartAgent(Exception):
    """A live run's follower needs its agent started again (:attr:`rllog.delivery.Follower.needs_restart`)."""


def serve(
    run_dir: str,
    follow: bool,
    parent_pid: int | None,
    only: list[str] | None = None,
    orphan_timeout: float = ORPHAN_TIMEOUT_SECONDS,
    on_progress: Callable[[str, int], None] | None = None,
    options: dict[str, dict[str, Any]] | None = None,
    heap: StartupHeap | None = None,
    wakeups: int | None = None,
) -> int:
    """Deliver ``run_dir`` to its sinks (or to ``only``, by name); returns the number of sinks that failed.

    ``options`` (sink name -> keyword options) override the run file's redacted copies. ``heap``: the
    collector paused for the start-up, frozen and resumed here once every sink is open. ``wakeups``: the pipe the
    trainer sends its flush wake-ups down (the agent's stdin; :class:`rllog.delivery.FlushWatcher`).
    """
    from rllog import registry
    from rllog.delivery import (
        POLL_INTERVAL,
        FlushWatcher,
        Follower,
        RetryPolicy,
        SinkState,
        finish_deadline,
        live_poll_interval,
    )
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
    followers: list = []
    # Watching before the first follower starts: each waits to open its sink until the trainer is seen to leave room.
    load = TrainerLoad.from_settings(parent_pid if follow else None).start(followers if follow else None)
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
            hold=load.wait,
            restartable=follow,
        )
        try:
            followers.append(follower.start(wait=LOCK_WAIT_SECONDS if follow else 0.0))
        except Exception:  # SinkBusy: someone else delivers this sink; stop what was started and say so
            load.stop()
            for started in followers:
                started.stop()
                started.join(5)
            raise
    load.all_started.set()
    if follow:
        FlushWatcher(run_dir, followers, writer_gone=parent_gone, wakeups=wakeups).start()
        PriorityGovernor(followers, settings.AGENT_PRIORITY.get(), parent_pid).start()
        _stop_followers_on_sigterm(followers)
    orphaned_at = None
    ended: set[str] = set()
    told_to_stop: set[str] = set()
    while any(f.thread is not None and f.thread.is_alive() for f in followers):
        for f in followers:
            f.join(settings.FINISH_DEADLINE_LOOK_SECONDS)
            if f.name not in ended and f.join(0):  # its cursor must say how it ended, now, while others go on
                if follow and f.needs_restart:  # what the other followers have in flight is re-sent, as after a kill
                    raise RestartAgent(f"{f.name}: {f.error}")
                ended.add(f.name)
                f.settle()
        if heap is not None and not heap.frozen:
            heap.freeze_once(opened=all(f.sink is not None or not (f.thread and f.thread.is_alive()) for f in followers))
        deadline, whose = None, "its trainer's finish"
        if parent_gone():
            orphaned_at = orphaned_at or time.monotonic()
            if time.monotonic() - orphaned_at > orphan_timeout:
                log.error("trainer gone and sinks still busy after %.0fs; exiting", orphan_timeout)
                return len([f for f in followers if f.state != SinkState.CLOSED])
            deadline, whose = orphaned_at + orphan_timeout, "this orphaned agent's"
        elif follow and any(f.retry_due is not None for f in followers):
            deadline = finish_deadline(run_dir, parent_pid)
        if deadline is not None:
            _stop_retries_past(followers, deadline, whose, told_to_stop)
    if load.held_seconds:
        log.info("rllog: delivery waited %.1fs in all for the trainer to leave a CPU free", load.held_seconds)
    for f in followers:
        if follow and f.needs_restart:
            raise RestartAgent(f"{f.name}: {f.error}")
        if f.name not in ended:
            f.settle()
    return len([f for f in followers if f.state != SinkState.CLOSED])


def _stop_retries_past(followers: list, deadline: float, whose: str, told: set[str]) -> None:
    """Stop each follower whose next try of its sink comes after ``deadline`` (a 429 asking for an hour): it would
    deliver nothing more before the deadline than stopped now, and the agent would be waited for (by ``finish``, or
    as an orphan) until then for nothing. Each keeps what its sink holds and saves its cursor; the rest stays pending
    for ``rllog replay``, as at the deadline. ``told``: the names already stopped."""
    for f in followers:
        if f.name not in told and f.thread is not None and f.thread.is_alive() and f.waits_past(deadline):
            told.add(f.name)
            log.warning("rllog: sink %r: its next try is after %s deadline; stopping", f.name, whose)
            f.stop()


def _stop_followers_on_sigterm(followers: list) -> None:
    """``finish``'s deadline stops the agent with SIGTERM (then SIGKILL, :data:`STOP_GRACE_SECONDS` later): each
    follower is told to stop, so one that is retrying a tracker that is down keeps what its sink holds and saves its
    cursor before the process ends (killed outright, the records the sink had taken were sent again by a replay)."""
    if threading.current_thread() is not threading.main_thread():  # serve() run by a test or an embedding program
        return

    def stop(signum: int, frame: Any) -> None:
        STOPPING.set()
        for follower in followers:
            follower.stop()

    signal.signal(signal.SIGTERM, stop)
