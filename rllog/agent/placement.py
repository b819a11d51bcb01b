"""Where and how the agent runs beside the trainer: off the trainer's CPU (:func:`agent_cpus`, :func:`place`), at
idle CPU priority unless delivery falls behind (:class:`PriorityGovernor`), and without garbage collection while its
trackers import and open (:class:`StartupHeap`)."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from rllog import settings
from rllog.settings import CAUGHT_UP_SECONDS, STARTUP_GC_PAUSE_MAX_SECONDS

log = logging.getLogger("rllog.agent")


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
    60-step tiny GRPO with five trackers, 0.09-0.18 s waiting; off its CPU, 110-290 and 0.02-0.04 s; the agent then
    in a scheduling group of its own, see :class:`TrainerLoad`).
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


def _agent_processes() -> dict[int, list[int]]:
    """Every thread (the values) of this process and of the processes it started (the keys: a tracker's service,
    e.g. wandb-core)."""
    found: dict[int, list[int]] = {}
    pids = [os.getpid()]
    while pids:
        pid = pids.pop()
        try:
            threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        found[pid] = threads
        for tid in threads:
            try:
                pids.extend(int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
            except (OSError, ValueError):
                pass
    return found


def _agent_tasks() -> list[int]:
    """Every thread of this process and of the processes it started."""
    return [tid for threads in _agent_processes().values() for tid in threads]


def set_session_niceness(pid: int, nice: int) -> None:
    """Give the scheduling group of process ``pid``'s session the niceness ``nice``, where Linux groups by session
    (autogroup): a process that started a session of its own (wandb's service does) is a group of its own there,
    given a busy CPU as often as the trainer's whole group whatever its threads' policy (see
    ``rllog.agent.launch.AGENT_PROCESS_GROUP``). Any user may raise it; lowering it below 0 needs privilege."""
    try:
        if os.getsid(pid) != pid:  # not a session leader: in the agent's session, or in one whose leader this is called for
            return
        with open(f"/proc/{pid}/autogroup", "w") as group:
            group.write(str(nice))
    except (OSError, ValueError):  # gone, no autogroup in this kernel, or refused: its threads' policy still applies
        pass


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


# Native ids of the agent's threads that decide when the rest may run (PriorityGovernor, TrainerLoad): they leave
# SCHED_IDLE for normal priority (nice) where Linux allows it (leave_idle), or a busy machine would starve the
# decisions themselves; the governor leaves them as they are.
DECIDING_THREADS: set[int] = set()
# Set by the agent's SIGTERM handler: the governor stops putting threads back to idle while the agent stops.
STOPPING = threading.Event()


STAYS_IDLE_WARNING = (
    "rllog: the delivery agent cannot leave idle CPU priority: this user may not raise a process's priority "
    "(RLIMIT_NICE, `ulimit -e`, is 0; root or CAP_SYS_NICE may). It delivers on the cycles training leaves, so on a "
    "machine training keeps busy its lag may pass RLLOG_AGENT_LAG_MAX; RLLOG_AGENT_PRIORITY=nice keeps it at nice "
    "RLLOG_AGENT_NICE from the start instead."
)
_told_stays_idle = False


def leave_idle(tid: int) -> bool:
    """Switch thread ``tid`` (0: this one) from ``SCHED_IDLE`` to normal scheduling. Linux lets an unprivileged user
    do that only within its ``RLIMIT_NICE`` (0 on most systems: never), so for most non-root users ``SCHED_IDLE`` is
    one-way; the first refusal is said once, as a warning. False only if refused (a thread that ended meanwhile, or
    a system without scheduling policies, is not a refusal)."""
    global _told_stays_idle
    if not hasattr(os, "SCHED_OTHER"):
        return True
    try:
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    except PermissionError:
        if not _told_stays_idle:
            _told_stays_idle = True
            log.warning(STAYS_IDLE_WARNING)
        return False
    except OSError:  # the thread ended meanwhile
        pass
    return True


@contextlib.contextmanager
def deciding_thread() -> Iterator[None]:
    """The calling thread decides for the agent while in the block: it leaves ``SCHED_IDLE`` (the agent starts idle;
    the thread that started this one may be idle) and is in :data:`DECIDING_THREADS`, until the block ends (a later
    thread may get its id)."""
    tid = threading.get_native_id()
    DECIDING_THREADS.add(tid)
    leave_idle(0)
    try:
        yield
    finally:
        DECIDING_THREADS.discard(tid)


def raise_to_normal_priority(pid: int) -> None:
    """Every thread of process ``pid`` out of ``SCHED_IDLE``: an agent about to be stopped (``SIGTERM``) must get a CPU
    to save its cursors within the grace, even on a machine that training keeps busy."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        if not leave_idle(int(tid)):
            return  # refused for one, refused for all (the same user's right)


LOAD_SAMPLE_SECONDS = 0.25  # how often the trainer's CPU use is read while the agent may have to wait for it
LOAD_WINDOW_SECONDS = 1.0  # the trainer's CPU use is averaged over this long (its steps alternate busy and idle)


def cpu_demand_seconds(pid: int) -> float | None:
    """Seconds the threads of process ``pid`` have run or waited to run, so far (``/proc/<pid>/task/*/schedstat``:
    time on a CPU plus time runnable in a queue); None if the process is gone.

    Time on a CPU alone would under-count a trainer that the agent slows: its threads then wait in the queue.
    """
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for tid in tids:
        try:  # bytes, no text decoding: this also runs while an import waits on it (ImportGate)
            fd = os.open(f"/proc/{pid}/task/{tid}/schedstat", os.O_RDONLY)
            try:
                on_cpu, waiting, _ = os.read(fd, 128).split()
            finally:
                os.close(fd)
            total += int(on_cpu) + int(waiting)
        except (OSError, ValueError):  # a thread that ended since the listing
            continue
    return total / 1e9


@functools.cache
def _cgroup_mounts() -> list[tuple[str, Path, str, set[str]]]:
    """The cgroup file systems mounted here: (hierarchy root they show, mount point, type, super options); read once,
    as :class:`TrainerLoad` asks four times a second."""
    mounts: list[tuple[str, Path, str, set[str]]] = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return mounts
    for line in lines:
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            root, point = (f.replace("\\040", " ") for f in fields[3:5])
            mounts.append((root, Path(point), tail[0], set(tail[2].split(","))))
    return mounts


def quota_cpus(directory: Path, top: Path, version: str) -> float | None:
    """The tightest CPU quota from cgroup ``directory`` up to ``top`` (a parent's limit binds its children), in CPUs;
    None if none is set. cgroup v2: ``cpu.max`` (``"max 100000"`` or ``"QUOTA PERIOD"``); v1: ``cpu.cfs_quota_us``
    (-1: none) over ``cpu.cfs_period_us``."""
    tightest = None
    while True:
        try:
            if version == "cgroup2":
                quota, period = (directory / "cpu.max").read_text().split()[:2]
            else:
                quota = (directory / "cpu.cfs_quota_us").read_text().strip()
                period = (directory / "cpu.cfs_period_us").read_text().strip()
            cpus = None if quota in ("max", "-1") else int(quota) / int(period)
        except (OSError, ValueError):
            cpus = None
        if cpus is not None and cpus > 0:
            tightest = cpus if tightest is None else min(tightest, cpus)
        if directory == top or top not in directory.parents:
            return tightest
        directory = directory.parent


def cgroup_cpu_quota(pid: int) -> float | None:
    """How many CPUs' worth of time the cgroup of process ``pid`` may use (a container's ``--cpus``, a Kubernetes CPU
    limit), or None if it has no quota or none can be read. Affinity alone says 64 CPUs for a trainer limited to 2 of
    a 64-core host; the agent, started by the trainer, shares that quota."""
    try:
        memberships = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in memberships:
        hierarchy, controllers, path = line.split(":", 2)
        v2 = hierarchy == "0" and controllers == ""
        for root, point, kind, options in _cgroup_mounts():
            if (kind == "cgroup2") != v2 or (not v2 and "cpu" not in options & set(controllers.split(","))):
                continue
            inside = path[len(root) :] if root != "/" and path.startswith(root) else path
            directory = point / inside.lstrip("/")
            if not directory.is_dir():  # a container that shows the host's path for a hierarchy mounted at its own root
                directory = point
            cpus = quota_cpus(directory, point, kind)
            if cpus is not None:
                found.append(cpus)
    return min(found) if found else None


def trainer_cpus(pid: int) -> float | None:
    """The CPUs process ``pid`` may use: those of its affinity, fewer if its cgroup's quota allows less; None if the
    process is gone."""
    try:
        cpus: float = len(os.sched_getaffinity(pid))
    except OSError:
        return None
    try:
        quota = cgroup_cpu_quota(pid)
    except Exception:  # a cgroup file laid out in a way not foreseen: the affinity alone
        quota = None
    return cpus if quota is None else min(cpus, quota)


def delivery_lag(followers: list) -> float | None:
    """Seconds since the furthest-behind running follower last found nothing new to read; None when none runs."""
    running = [f for f in followers if f.thread is not None and f.thread.is_alive()]
    return time.monotonic() - min(f.caught_up_at for f in running) if running else None


class TrainerLoad:
    """Holds the agent's work back while the trainer leaves fewer than ``$RLLOG_AGENT_FREE_CPUS`` CPUs free (at most
    half of its CPUs).

    ``SCHED_IDLE`` alone did not keep the agent out of a CPU-bound training's way (measured on Linux 6.18, tiny
    GRPO on two cores, torch on both: the idle agent took a whole core for seconds while torch's two threads shared
    the other, and training ran 2x slower; stopped, the agent cost nothing). The agent then had a session, so a
    scheduling group, of its own (``rllog.agent.launch.AGENT_PROCESS_GROUP``); this wait was measured against that.
    So while the trainer's demand for CPU (its threads' time running or waiting to run, averaged over
    :data:`LOAD_WINDOW_SECONDS`) leaves less than that many CPUs of those it may run on (:func:`trainer_cpus`: its
    affinity, or its cgroup's quota if tighter), the followers wait before their next read, a sink waits to open, and
    a standby's imports wait (:class:`ImportGate`).
    The journal keeps every record meanwhile. The wait ends when the trainer leaves room (a GPU run, a pause,
    ``finish``), when the trainer is gone, or once delivery is ``$RLLOG_AGENT_LAG_MAX`` s behind (then
    :class:`PriorityGovernor` also raises the agent to catch up): on a busy machine, delivery comes in bursts at most
    that far apart.

    Example:
        >>> load = TrainerLoad(trainer_pid=None, free_cpus=1.0, lag_max=30.0)
        >>> load.wait(threading.Event())  # no trainer to watch: never waits
    """

    def __init__(self, trainer_pid: int | None, free_cpus: float, lag_max: float):
        self.trainer_pid, self.free_cpus, self.lag_max = trainer_pid, free_cpus, lag_max
        self.followers: list | None = None  # None: a standby's start-up, bounded by lag_max from start()
        self._go = threading.Event()
        self._go.set()
        self._done = threading.Event()
        self.all_started = threading.Event()  # set by serve once the followers list is complete
        self.held_seconds = 0.0  # how long the agent's work waited for the trainer, in all
        self._held_since = self._started = 0.0
        self._decide = threading.Lock()  # the watch's decisions against restart()'s and stop()'s
        self._afresh = False  # restart() asked: the readings so far say nothing of the trainer now
        self._watching = False  # the watch runs: the one thing that ends a hold

    @classmethod
    def from_settings(cls, trainer_pid: int | None) -> TrainerLoad:
        """The agent's watch on ``trainer_pid`` as the environment sets it (none unless ``RLLOG_AGENT_PRIORITY=idle``)."""
        idle = settings.AGENT_PRIORITY.get() == "idle"
        return cls(trainer_pid if idle else None, settings.AGENT_FREE_CPUS.get(), settings.AGENT_LAG_MAX.get())

    def start(self, followers: list | None = None) -> TrainerLoad:
        """Watch the trainer for ``followers`` (while one runs; the list may still be filling), or for a standby's
        start-up (until :meth:`stop`). The work waits from now until the first reading says the trainer leaves room:
        a run's agent arrives as ``train()`` starts, and opening five trackers in the half second the first reading
        used to take cost the first steps ~1 s (measured: 60-step tiny GRPO, its first two steps 1.5-2.4 s against
        0.7-0.9 s without rllog)."""
        if self.trainer_pid is not None and self.free_cpus > 0 and hasattr(os, "sched_getaffinity"):
            self.followers, self._started = followers, time.monotonic()
            self._go.clear()
            self._held_since = self._started
            self._watching = True
            threading.Thread(target=self._run, name="rllog-trainer-load", daemon=True).start()
        return self

    def stop(self) -> None:
        with self._decide:
            self._done.set()
            self._let_go()

    def restart(self) -> None:
        """The trainer is starting to train (a standby's run arrived): hold the work until a reading taken from now
        on says the trainer leaves room. The readings before, of a trainer loading its model, averaged over
        :data:`LOAD_WINDOW_SECONDS`, kept saying "room" for the first half second of training, in which a standby
        went on importing trackers beside the first steps (measured: 60-step tiny GRPO, torch on both cores, the
        first step 20-260 ms against 20-34 ms without rllog). A standby's bound on the wait, ``lag_max``, counts
        from here."""
        with self._decide:
            if self._done.is_set() or not self._watching:  # no watch to end a hold
                return
            now = time.monotonic()
            if self.followers is None:
                self._started = now
            self._afresh = True
            if self._go.is_set():
                self._go.clear()
                self._held_since = now

    def wait(self, stop: threading.Event) -> None:
        """Return once the agent may work (from :meth:`start`'s first reading on, while the trainer leaves room; at
        once when nothing is watched), or once ``stop`` is set."""
        while not self._go.wait(LOAD_SAMPLE_SECONDS):
            if stop.is_set():
                return

    def _behind(self) -> bool:
        if self.followers is None:
            return time.monotonic() - self._started > self.lag_max
        lag = delivery_lag(self.followers)
        return lag is not None and lag > self.lag_max

    def _run(self) -> None:
        with deciding_thread():
            try:
                self._watch()
            except Exception as exc:  # whatever /proc held: the agent works unheld rather than never
                log.warning("rllog: watching the trainer's CPU use failed (%s: %s); not waiting for it", type(exc).__name__, exc)
            finally:
                self._release()

    def _release(self) -> None:
        with self._decide:
            self._watching = False
            self._let_go()

    def _let_go(self) -> None:
        """End the wait (under ``_decide``), counting it."""
        if not self._go.is_set():
            self.held_seconds += time.monotonic() - self._held_since
            self._go.set()

    def _watch(self) -> None:
        pid = self.trainer_pid
        assert pid is not None
        samples: list[tuple[float, float]] = []
        while True:
            used = cpu_demand_seconds(pid)
            cpus = trainer_cpus(pid)
            if used is None or not cpus:  # the trainer is gone: deliver what it left
                self._release()
                return
            with self._decide:
                now = time.monotonic()
                if self._afresh:
                    self._afresh, samples = False, []
                samples = [(t, u) for t, u in samples if now - t <= LOAD_WINDOW_SECONDS] + [(now, used)]
                span = now - samples[0][0]
                # At most half of them: a trainer with one CPU (or a quota of one) never leaves a whole one free, and
                # a GPU training there, mostly waiting for the device, must not make the agent wait.
                free_needed = min(self.free_cpus, cpus / 2)
                if span < LOAD_SAMPLE_SECONDS:
                    busy = not self._go.is_set()  # no reading yet: as start() or restart() left it (held)
                else:
                    busy = cpus - (used - samples[0][1]) / span < free_needed
                if busy and not self._behind():
                    if self._go.is_set():
                        self._go.clear()
                        self._held_since = now
                else:
                    self._let_go()
            ended = self.followers is not None and self.all_started.is_set() and delivery_lag(self.followers) is None
            if self._done.wait(LOAD_SAMPLE_SECONDS) or ended:
                self._release()  # stopped, or every follower has ended
                return


class ImportGate:
    """Holds a standby's imports while the trainer is busy (:class:`TrainerLoad`): each module waits before it is
    found, so a tracker's import of hundreds of modules pauses between them rather than running beside training."""

    def __init__(self, load: TrainerLoad):
        self.load, self._never = load, threading.Event()

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        self.load.wait(self._never)
        return None  # the usual finders find it

    def __enter__(self) -> ImportGate:
        sys.meta_path.insert(0, self)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.meta_path.remove(self)
        self.load.stop()


class PriorityGovernor:
    """Keeps the agent at idle CPU priority (``SCHED_IDLE``: it runs only on cycles training leaves), and at
    normal priority (nice 10) while a sink is more than ``$RLLOG_AGENT_LAG_MAX`` s behind, so delivery lag stays bounded
    even when training keeps every core busy; and off the trainer's CPU (:func:`agent_cpus`), checked every second.

    Linux sets the policy per thread: every thread of the agent and of the processes it started (the trackers'
    threads, wandb's service) is switched, every second, except the deciding threads (the governor's own and
    :class:`TrainerLoad`'s, :data:`DECIDING_THREADS`), which leave idle priority where Linux allows, so that they can
    always decide. On SIGTERM (:data:`STOPPING`) every thread is raised, so that the followers save their cursors
    within the grace.
    """

    def __init__(self, followers: list, mode: str, trainer_pid: int | None = None):
        self.followers, self.trainer_pid = followers, trainer_pid
        self.lag_max = settings.AGENT_LAG_MAX.get()
        self.idle = False
        self.cpus: set[int] | None = None
        self._idle_mode = mode == "idle" and hasattr(os, "SCHED_IDLE")

    def start(self) -> PriorityGovernor:
        if self._idle_mode or agent_cpus(self.trainer_pid) is not None:
            threading.Thread(target=self._run, name="rllog-priority", daemon=True).start()
        return self

    def _set(self, idle: bool) -> None:
        self.idle = idle
        processes = _agent_processes()  # the trackers' processes too (wandb-core ran at normal priority)
        for pid in processes:
            if pid != os.getpid():
                set_session_niceness(pid, 19 if idle and self._idle_mode else settings.AGENT_NICE.get())
        if not self._idle_mode:
            return
        for tid in (tid for threads in processes.values() for tid in threads):
            if tid in DECIDING_THREADS:
                continue
            if not idle:
                if not leave_idle(tid):
                    return  # refused for one, refused for all
                continue
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except OSError:
                pass

    def _place(self) -> None:
        cpus = agent_cpus(self.trainer_pid)
        if cpus is not None and cpus != self.cpus:
            place(cpus)
            self.cpus = cpus

    def _run(self) -> None:
        with deciding_thread():  # started by an idle thread (the agent starts idle): this one must always get to decide
            self._govern()

    def _govern(self) -> None:
        self._set(True)
        while True:
            self._place()
            if STOPPING.wait(1.0):  # SIGTERM: the followers save their cursors within a short grace, at normal priority
                self._set(False)
                return
            lag = delivery_lag(self.followers)
            if lag is None:  # every follower has ended
                return
            if self.idle and lag > self.lag_max:
                log.info("rllog: delivery is %.0fs behind; back to normal priority until caught up", lag)
                self._set(False)
            elif not self.idle and lag < CAUGHT_UP_SECONDS:
                self._set(True)
            else:
                self._set(self.idle)  # threads the trackers started since get the current policy


def lower_priority(idle: bool) -> None:
    """Delivery is background work: on a machine with few cores the trainer should win the CPU (nice
    ``$RLLOG_AGENT_NICE``; with ``idle``, this thread also at ``SCHED_IDLE``)."""
    niceness = settings.AGENT_NICE.get()
    try:
        os.nice(niceness)
        if idle and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, ValueError):
        pass
