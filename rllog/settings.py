"""rllog's settings in one place: the environment variables it reads, and its tuning constants.

Environment variables
---------------------
Each is read where it is used (never at ``import rllog``), through one parser per type. Unset or blank means the
default. A value its parser refuses raises :class:`rllog.errors.InvalidSetting` naming the variable, the value and
what it accepts. The delivery agent's variables are checked in the trainer by ``rllog.init`` and ``rllog.prepare``
(:func:`check_agent_settings`), so a bad one is an error there rather than an agent that cannot start.

======================== ============ ============ =================================================================
Variable                 Type         Default      Meaning
======================== ============ ============ =================================================================
``RLLOG_DIR``            path         rllog_runs   Where ``init`` creates a run without ``run_dir``, and where a run
                                                   is looked up by its id.
``RLLOG_SYSTEM_METRICS`` switch or    on (every    The trainer's system metrics where the code leaves
                         seconds      5 s)         ``system_metrics`` unset: ``0``/``off``/``false``/``no`` turns
                                                   them off, ``on``/``true``/``yes`` samples every 5 s, a number of
                                                   seconds (> 0) sets the interval.
``RLLOG_QUIET``          switch       off          ``1``/``on``: ``init`` prints no line naming the run directory and
                                                   ``finish`` no line per tracker, where the code leaves ``quiet``
                                                   unset.
``RLLOG_AGENT_PRIORITY`` choice       idle         ``idle``: the agent runs at ``SCHED_IDLE`` (only on cycles the
                                                   trainer leaves), raised while behind; ``nice``: at nice
                                                   ``RLLOG_AGENT_NICE`` throughout.
``RLLOG_AGENT_CPUS``     CPU list     auto         ``auto``: off the CPU the trainer's main thread runs on;
                                                   ``all``: anywhere; or CPU numbers, ``2,3``.
``RLLOG_AGENT_LAG_MAX``  seconds      30           When delivery falls this far behind, the agent leaves idle
                                                   priority (back to nice) until caught up.
``RLLOG_AGENT_FREE_CPUS``
                         number       1            In ``idle`` priority, the agent's work waits while the trainer
                                                   leaves fewer CPUs than this (at most half of its CPUs: affinity,
                                                   or its cgroup's quota if tighter) free (a CPU-bound training on
                                                   every core), up to ``RLLOG_AGENT_LAG_MAX``; ``0``: never waits.
``RLLOG_AGENT_NICE``     integer      10           The niceness added to the agent (-20 to 19): delivery is
                                                   background work.
``RLLOG_CONSOLE_FD``     file         (unset)      Set by the agent, not by users: the trainer's stdout,
                         descriptor                duplicated, for the console sink to draw on.
======================== ============ ============ =================================================================

The same table is in docs/settings.md. Variables only the test suite reads (``RLLOG_TEST_MODE_<NAME>``,
``RLLOG_NETGUARD_LOG``) are not rllog's settings.

Tuning constants
----------------
Below the environment variables: the timing and size constants of the trainer side, the agent and delivery, each
with why it has its value. The modules that use them import them from here by the same name.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from rllog.errors import InvalidSetting

T = TypeVar("T")


# -- one parser per type: each takes the stripped text and raises ValueError for what it refuses -----------------
def parse_path(text: str) -> Path:
    return Path(text)


def parse_seconds(text: str) -> float:
    """A finite number of seconds above 0."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(text)
    return value


def parse_float_in(low: float, high: float) -> Callable[[str], float]:
    def parse_float(text: str) -> float:
        value = float(text)
        if not (math.isfinite(value) and low <= value <= high):
            raise ValueError(text)
        return value

    return parse_float


def parse_int_in(low: int, high: int) -> Callable[[str], int]:
    def parse_int(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise ValueError(text)
        return value

    return parse_int


def parse_choice(*choices: str) -> Callable[[str], str]:
    def parse_one_of(text: str) -> str:
        if text.lower() not in choices:
            raise ValueError(text)
        return text.lower()

    return parse_one_of


OFF_WORDS = ("0", "off", "false", "no")
ON_WORDS = ("on", "true", "yes")


def parse_switch(text: str) -> bool:
    """True for on (``1`` too: no interval to mistake it for), False for off."""
    if text.lower() in OFF_WORDS:
        return False
    if text.lower() in (*ON_WORDS, "1"):
        return True
    raise ValueError(text)


def parse_switch_or_seconds(text: str) -> float | bool:
    """False for off, True for on (the default interval), or an interval in seconds."""
    if text.lower() in OFF_WORDS:
        return False
    if text.lower() in ON_WORDS:
        return True
    return parse_seconds(text)


def parse_cpus(text: str) -> str | frozenset[int]:
    """``auto``, ``all`` or a set of CPU numbers."""
    if text.lower() in ("auto", "all"):
        return text.lower()
    cpus = frozenset(int(part) for part in text.split(","))
    if not cpus or min(cpus) < 0:
        raise ValueError(text)
    return cpus


def parse_fd(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


@dataclass(frozen=True)
class EnvSetting(Generic[T]):
    """One environment variable: its name, its parser, its default (as text), what it accepts and means."""

    name: str
    parse: Callable[[str], T]
    default: str
    accepts: str
    meaning: str

    def get(self) -> T:
        """The variable's value now, parsed (the default when unset or blank).

        Raises:
            InvalidSetting: a value the parser refuses, naming the variable and what it accepts.
        """
        return self.read(os.environ.get(self.name, ""))

    def read(self, raw: str) -> T:
        """``raw`` parsed as this variable's value (the default when blank)."""
        text = raw.strip() or self.default
        try:
            return self.parse(text)
        except ValueError:
            raise InvalidSetting(
                f"{self.name}={raw!r} is not valid: it takes {self.accepts} (default {self.default or 'unset'}): {self.meaning}"
            ) from None


# -- the environment variables ---------------------------------------------------------------------------------
RUNS_DIR = EnvSetting("RLLOG_DIR", parse_path, "rllog_runs", "a directory path", "where runs without a run_dir are created")
SYSTEM_METRICS = EnvSetting(
    "RLLOG_SYSTEM_METRICS",
    parse_switch_or_seconds,
    "on",
    f"{'/'.join(OFF_WORDS)} (off), {'/'.join(ON_WORDS)} (every 5 s) or a number of seconds above 0",
    "the trainer's system metrics where the code leaves system_metrics unset",
)
QUIET = EnvSetting(
    "RLLOG_QUIET",
    parse_switch,
    "off",
    f"{'/'.join(OFF_WORDS)} or 1/{'/'.join(ON_WORDS)}",
    "init and finish print nothing where the code leaves quiet unset",
)
AGENT_PRIORITY = EnvSetting(
    "RLLOG_AGENT_PRIORITY", parse_choice("idle", "nice"), "idle", "idle or nice", "the delivery agent's CPU priority"
)
AGENT_CPUS = EnvSetting(
    "RLLOG_AGENT_CPUS",
    parse_cpus,
    "auto",
    "auto, all, or CPU numbers separated by commas (2,3)",
    "the CPUs the delivery agent runs on",
)
AGENT_LAG_MAX = EnvSetting(
    "RLLOG_AGENT_LAG_MAX",
    parse_seconds,
    "30",
    "a number of seconds above 0",
    "how far behind delivery may fall before the agent leaves idle priority",
)
AGENT_FREE_CPUS = EnvSetting(
    "RLLOG_AGENT_FREE_CPUS",
    parse_float_in(0.0, 1024.0),
    "1",
    "a number of CPUs from 0 to 1024",
    "how many CPUs the trainer must leave free for the delivery agent to work beside it",
)
AGENT_NICE = EnvSetting(
    "RLLOG_AGENT_NICE", parse_int_in(-20, 19), "10", "an integer from -20 to 19", "the niceness added to the delivery agent"
)
CONSOLE_FD = EnvSetting(
    "RLLOG_CONSOLE_FD",
    lambda text: parse_fd(text) if text else None,
    "",
    "a file descriptor number",
    "the trainer's stdout for the console sink (set by the delivery agent)",
)

ENV_SETTINGS: tuple[EnvSetting, ...] = (
    RUNS_DIR,
    SYSTEM_METRICS,
    QUIET,
    AGENT_PRIORITY,
    AGENT_CPUS,
    AGENT_LAG_MAX,
    AGENT_FREE_CPUS,
    AGENT_NICE,
    CONSOLE_FD,
)
AGENT_SETTINGS: tuple[EnvSetting, ...] = (AGENT_PRIORITY, AGENT_CPUS, AGENT_LAG_MAX, AGENT_FREE_CPUS, AGENT_NICE)


def check_agent_settings() -> None:
    """Parse every variable the delivery agent reads, in the trainer that is about to start one.

    Raises:
        InvalidSetting: the first that is not valid.
    """
    for setting in AGENT_SETTINGS:
        setting.get()


# -- the trainer side (rllog.run) ------------------------------------------------------------------------------
# The journal writer hands records to the OS at least this often (and within a quarter of ``flush_interval``, so a
# SIGKILL loses nothing older than that with room to spare). Each batch wakes the writer twice (its first record, the
# end of the wait), and each wake-up takes the GIL from the training thread: at 0.05 s a CPU training on every core
# was preempted ~350 times in 60 steps against ~30 without rllog, at 0.25 s ~150 (docs/decisions.md). The end of
# ``train()`` does not wait for a batch: ``Run.request_flush`` wakes the writer.
JOURNAL_WRITE_INTERVAL = 0.25
# How often ``Run.flush`` reads the sinks' cursors while it waits (a read of six cursor files: ~0.2 ms, on a training
# thread that has nothing else to do then; a 5 ms pace adds 2.5 ms on average to the end of each train()), and, past
# FLUSH_FAST_POLL_FOR seconds (a tracker that is slow or retrying), the slower pace that costs next to no CPU.
FLUSH_POLL_SECONDS = 0.002
FLUSH_FAST_POLL_FOR = 0.5
FLUSH_SLOW_POLL_SECONDS = 0.02
SIGTERM_FINISH_SECONDS = 30.0  # how long the SIGTERM handler waits for each run's trackers
SIGTERM_JOIN_MARGIN_SECONDS = 5.0  # the SIGTERM handler's wait for its finishing thread, beyond the runs' own waits
SYSTEM_METRICS_INTERVAL = 5.0  # seconds between samples of the trainer's CPU, memory and GPU when they are on

# -- the journal (rllog.journal) -------------------------------------------------------------------------------
# How often a wait for the journal writer (``wait_written``) also checks that the writer thread is still alive.
WRITER_ALIVE_CHECK_SECONDS = 0.05

# -- the delivery agent and its supervision (rllog.agent) --------------------------------------------------------
AGENT_POLL_SECONDS = 0.2  # how often a wait for the agent's exit (``finish``) looks again through a restart
# How often the trainer's watcher checks that the agent lives, reads its system samples (at most each sample interval)
# and the sinks' cursors. Each look takes the GIL from the training thread several times (a file per sink): at 0.2 s
# the training thread blocked ~20 times a second more; a dead agent is restarted or a failed sink told a second later.
AGENT_WATCH_SECONDS = 1.0
SINK_CHECK_SECONDS = 5.0  # how often the watcher reads every cursor for a sink retrying one error (a failure: at once)
LOCK_WAIT_SECONDS = 300.0  # a resumed run's agent waits this long for the previous attempt's agent to let go of a sink
ORPHAN_TIMEOUT_SECONDS = 600.0  # an agent whose trainer died gives its sinks this long to take what is left
CAUGHT_UP_SECONDS = 2.0  # an agent raised to normal priority goes back to idle once it is this close to the trainer
STARTUP_GC_PAUSE_MAX_SECONDS = 60.0  # the collector is back on by then even if a sink is still opening (retrying)
# An agent still delivering at the finish deadline gets SIGTERM and this long to exit before SIGKILL. A frozen one
# (stopped by SIGSTOP or a debugger) cannot act on SIGTERM: it gets SIGKILL at once.
STOP_GRACE_SECONDS = 0.5
# After SIGKILL, how long to wait for the process to be gone (one in uninterruptible disk sleep dies only when its
# I/O returns; finish does not wait for that).
KILL_WAIT_SECONDS = 0.5
# The most Run.finish(timeout=T) takes beyond T for stopping the agent, whatever the agent does.
FINISH_OVERRUN_MAX_SECONDS = STOP_GRACE_SECONDS + KILL_WAIT_SECONDS

# -- delivery (rllog.delivery) ---------------------------------------------------------------------------------
POLL_INTERVAL = 0.05  # a caught-up follower's wait before it reads the journal again (replays, tests)
LIVE_POLL_MAX = 0.5  # the longest wait of a live run's follower (see delivery.live_poll_interval)
# The agent's FlushWatcher sleeps on the trainer's wake-up pipe; without a byte it looks this often whether the
# trainer is gone, to wake the followers (the trainer's exit usually ends the pipe first; a forked worker holding a
# copy of the pipe keeps it open). One look a second costs next to no CPU; the followers check too at each poll.
FLUSH_WATCH_IDLE_CHECK = 1.0
ASKED_FLUSH_MIN_GAP = 0.2  # a follower honours a request nobody waits for (soon=True) at most this often
# For this long after it sees a flush request for records the journal does not hold yet (Run.request_flush writes
# the request before the journal writer writes them), a caught-up follower reads again every POLL_INTERVAL, not
# every poll_interval; bounded, as a killed attempt's request may name records that never come.
ASKED_RECORDS_PATIENCE = 1.0
# One read of the journal: at most this many records, and this many payload bytes (a larger record alone). A
# metrics record of 10,000 keys is ~250 KB of JSON and ~2 MB once decoded: bytes, not records, bound the memory.
BATCH_RECORDS = 1000
BATCH_BYTES = 4 * 1024 * 1024
# A sink is flushed once this much was delivered to it since its last flush, whatever the time: a backlog read at
# full speed is stored in bounded pieces (one append the disk can take), not in one append per flush_interval.
FLUSH_DUE_RECORDS = 5000
FLUSH_DUE_BYTES = 8 * 1024 * 1024
# The longest backoff after this machine ran out of something (memory, descriptors, disk space): it comes back
# when a thread here frees it, within seconds, and no remote service needs sparing.
LOCAL_RETRY_CAP = 2.0
CURSOR_SAVE_RETRY = 0.5  # the wait between attempts to save a cursor the disk or the process has no room for
MAX_SUSPECTS = 10  # consecutive records a sink rejects before the sink, not the records, is deemed broken
DEAD_LETTERS_KEPT = 1000  # dead letters listed in the cursor file (the count stays exact beyond it)
# RetryPolicy's defaults: the first backoff ceiling, the largest, and how long a sink may keep failing with
# transient errors before it is given up (its records stay pending for replay).
RETRY_BASE_SECONDS = 0.5
RETRY_CAP_SECONDS = 30.0
RETRY_GIVE_UP_SECONDS = 600.0
# The longest wait a 429's Retry-After is honoured for. A tracker asking for more (an HTTP-date years away, or inf)
# is asked again after this. A wait that ends after finish's deadline is not sat out (the follower is stopped at once,
# FINISH_DEADLINE_LOOK_SECONDS), nor one that ends after a replay's give-up deadline (the replay stops and says when to
# come back). Unbounded, a date in the year 9999 overflows the timer it waits on, and the sink would fail for good.
RETRY_AFTER_CAP_SECONDS = 3600.0
# How often whoever waits for the followers at finish (the agent's main loop, finish for in-process followers)
# looks whether a follower's next try comes after finish's deadline, so that it is stopped then and not waited for.
FINISH_DEADLINE_LOOK_SECONDS = 0.2
